"""specplug's Eagle3 head file <-> llama.cpp's `eagle3` GGUF, the draft model of
`llama-server --spec-type draft-eagle3 -md HEAD.gguf`.

The layout is llama.cpp's as of build b11312 (vendored in the llama-cpp-python 0.3.36 sdist):
src/models/eagle3.cpp (loader and graph), src/llama-arch.cpp (key and tensor names),
src/llama-model.cpp (the keys every model reads; LLAMA_ROPE_TYPE_NORM for eagle3),
conversion/llama.py (convert_hf_to_gguf's EAGLE-3 path: the target's tokenizer, d2t as absolute I64 ids).

    specplug head                  llama.cpp eagle3 GGUF (torch-order shape)
    fc            [d, 3d]          fc.weight                                      [d, 3d]
    blk.input_norm                 blk.0.attn_norm.weight     (input_layernorm, on the token embedding)
    blk.hidden_norm                blk.0.attn_norm_2.weight   (hidden_norm, on the fused state)
    blk.attn_qkv  [(H+2Hkv)D, 2d]  blk.0.attn_q / attn_k / attn_v .weight         (its row blocks)
    blk.attn_output                blk.0.attn_output.weight
    blk.ffn_norm                   blk.0.ffn_norm.weight
    blk.ffn_gate_up [2 n_ff, d]    blk.0.ffn_gate / ffn_up .weight                (its row halves)
    blk.ffn_down                   blk.0.ffn_down.weight
    norm, lm_head [N, d]           output_norm.weight, output.weight
    d2t [N] int32 absolute ids     d2t [N] I64 absolute ids (the graph asserts I64)

Both files keep Q/K rows in the interleaved ("normal") RoPE layout and tap the *inputs* of the named
target layers (llama.cpp: `res->t_layer_inp[il] = inpL` at the top of layer il in src/models/llama.cpp,
read by common/speculative.cpp through llama_get_embeddings_layer_inp), fused low -> high. Matrices
and norms are copied as stored, byte for byte (Q8_0 / F16 / F32); only d2t widens to I64.
The loader counts tensors ("wrong number of tensors"), so the file holds exactly the ones it creates.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from specplug.errors import SpecplugError
from specplug.heads import HeadError, HeadFile, HeadMeta, token_table_sha256, write_head
from specplug.outputs import claim, replacing
from specplug_eagle3.head import METHOD, VERSION, Eagle3Config

ARCH = "eagle3"
# specplug fused matrix -> llama.cpp tensors holding its row blocks, in order
SPLITS = {"blk.attn_qkv": ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"),
          "blk.ffn_gate_up": ("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight")}
RENAMES = {"fc": "fc.weight", "blk.input_norm": "blk.0.attn_norm.weight", "blk.hidden_norm": "blk.0.attn_norm_2.weight",
           "blk.attn_output": "blk.0.attn_output.weight", "blk.ffn_norm": "blk.0.ffn_norm.weight",
           "blk.ffn_down": "blk.0.ffn_down.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
KEPT_TYPES = ("F32", "F16", "Q8_0")  # storage a specplug head file can hold as is
RECIPE_KEY = "specplug.recipe"  # ours; llama.cpp ignores keys it does not read


def _target(target):
    from specplug.engine import target_info
    from specplug.runtime import load_target

    return target_info(load_target(str(target), "cpu", "float32", "gguf"), 1, 16)


def _row_blocks(raw: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    assert raw.shape[0] == sum(sizes), (raw.shape, sizes)
    return np.split(raw, np.cumsum(sizes)[:-1])


def export_llamacpp(source: Path, target, output: Path) -> Path:
    """Write the specplug Eagle3 head `source` as llama.cpp's `eagle3` draft GGUF for `target`
    (whose tokenizer keys and context length it carries, as llama.cpp's own converter does)."""
    import gguf

    try:
        head = HeadFile(source, METHOD, {VERSION})
        cfg = Eagle3Config.from_dict(head.meta.config)
    except HeadError as exc:
        raise SpecplugError(str(exc)) from None
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecplugError(f"{source}: eagle3 head config is malformed ({exc})") from None
    if cfg.lookup:
        raise SpecplugError(f"{source}: this head also reads the context's pair lookup (config lookup: true), "
                            f"which llama.cpp's eagle3 graph has no place for; export a head trained without "
                            f"--lookup")
    info = _target(target)
    if (problem := head.check_target(info)) is not None:
        raise SpecplugError(f"{source}: {problem}")
    d, H, Hkv, D, n_ff = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff
    if len(cfg.layers) != 3 or max(cfg.layers) >= info.n_layer:
        raise SpecplugError(f"{source}: llama.cpp's eagle3 taps exactly 3 layer inputs below the target's "
                            f"{info.n_layer} layers; the head taps {list(cfg.layers)}")
    d2t = head.tensor("d2t").flatten().numpy().astype(np.int64)
    if len(np.unique(d2t)) != len(d2t):
        raise SpecplugError(f"{source}: d2t maps two draft rows to one token id (llama.cpp scatters the draft "
                            f"logits by d2t and its converter rejects duplicates)")
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    for name, dst in RENAMES.items():
        raw, qtype, shape = head.raw(name)
        tensors[dst] = (raw.reshape(*shape[:-1], -1), qtype)  # bytes shaped like the tensor (1-D norms stay 1-D)
    for name, sizes in (("blk.attn_qkv", [H * D, Hkv * D, Hkv * D]), ("blk.ffn_gate_up", [n_ff, n_ff])):
        raw, qtype, _ = head.raw(name)
        for dst, part in zip(SPLITS[name], _row_blocks(raw, sizes)):
            tensors[dst] = (part, qtype)

    reader = gguf.GGUFReader(info.model_path, "r")
    t_arch = reader.fields["general.architecture"].contents()
    ctx_field = reader.fields.get(f"{t_arch}.context_length")
    output = Path(output)
    with claim(output, "llama.cpp eagle3 head"), replacing(output, "llama.cpp eagle3 head") as tmp:
        w = gguf.GGUFWriter(str(tmp), ARCH)
        w.add_name(f"eagle3 head for {head.meta.target_name} (specplug)")
        # keys every model reads (src/llama-model.cpp, llama_model_base::load_hparams), then eagle3's own
        # (src/models/eagle3.cpp, load_arch_hparams); scalar types must match exactly (GGUFMeta::GKV)
        w.add_uint32(f"{ARCH}.context_length", int(ctx_field.contents()) if ctx_field else int(info.max_ctx))
        w.add_uint32(f"{ARCH}.embedding_length", d)
        w.add_uint32(f"{ARCH}.block_count", 1)
        w.add_uint32(f"{ARCH}.feed_forward_length", n_ff)
        w.add_uint32(f"{ARCH}.attention.head_count", H)
        w.add_uint32(f"{ARCH}.attention.head_count_kv", Hkv)
        w.add_uint32(f"{ARCH}.attention.key_length", D)
        w.add_uint32(f"{ARCH}.attention.value_length", D)
        w.add_uint32(f"{ARCH}.rope.dimension_count", D)
        w.add_float32(f"{ARCH}.rope.freq_base", float(cfg.rope_base))
        w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", float(cfg.eps))
        w.add_uint32(f"{ARCH}.vocab_size", int(info.vocab_size))
        w.add_array(f"{ARCH}.target_layers", [int(x) for x in cfg.layers])  # INT32 array
        w.add_uint32(f"{ARCH}.target_hidden_size", int(info.n_embd))
        w.add_bool(f"{ARCH}.norm_before_residual", False)  # the residual is the raw fused state
        w.add_bool(f"{ARCH}.norm_before_fc", False)  # no norm on the taps before fc
        w.add_string(RECIPE_KEY, json.dumps(head.meta.recipe, sort_keys=True))
        for key, field in reader.fields.items():  # the target's vocabulary: llama.cpp sizes the logits by it
            if key.startswith("tokenizer."):
                vtype = field.types[0]
                w.add_key_value(key, field.contents(), vtype,
                                sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
        for name, (raw, qtype) in tensors.items():
            w.add_tensor(name, np.ascontiguousarray(raw), raw_dtype=gguf.GGMLQuantizationType[qtype])
        w.add_tensor("d2t", d2t)  # int64 -> I64
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return output


def _f32(x) -> float:
    """A FLOAT32 key as the shortest decimal that reads back as it (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(x)))


def _kv(md: dict, key: str, path: Path, default=...):
    if key in md:
        return md[key]
    if default is ...:
        raise SpecplugError(f"{path}: llama.cpp eagle3 key {key!r} is missing")
    return default


def import_llamacpp(source: Path, target, output: Path, weights: str = "f16") -> Path:
    """Write llama.cpp's `eagle3` draft GGUF `source` as a specplug Eagle3 head file for `target`.
    Q8_0 / F16 / F32 tensors keep their exact bits, BF16 becomes F32 (exact); other types are
    dequantized and stored as `weights`. What specplug's Eagle3 cannot run is refused by name."""
    from gguf import GGMLQuantizationType

    from specplug.errors import ModelError
    from specplug.runtime.gguf_file import GGUFFile

    source = Path(source)
    try:
        f = GGUFFile(source)
        md = f.metadata
    except ModelError as exc:
        raise SpecplugError(str(exc)) from None
    if md.get("general.architecture") != ARCH:
        raise SpecplugError(f"{source}: not a llama.cpp eagle3 draft (architecture {md.get('general.architecture')!r})")
    p = ARCH + "."
    d = int(_kv(md, p + "embedding_length", source))
    H = int(_kv(md, p + "attention.head_count", source))
    Hkv = int(_kv(md, p + "attention.head_count_kv", source, H))
    D = int(_kv(md, p + "attention.key_length", source, d // H))
    layers = [int(x) for x in _kv(md, p + "target_layers", source)]
    problems = []
    if int(_kv(md, p + "block_count", source)) != 1:
        problems.append("block_count is not 1")
    if int(_kv(md, p + "attention.value_length", source, D)) != D:
        problems.append("value_length differs from key_length")
    if int(_kv(md, p + "rope.dimension_count", source, D)) != D:
        problems.append("RoPE covers part of the head (rope.dimension_count != key_length)")
    if md.get(p + "rope.scaling.type", "none") not in ("none", "linear") or \
            float(md.get(p + "rope.scaling.factor", 1.0) or 1.0) != 1.0:
        problems.append("RoPE scaling")
    if md.get(p + "norm_before_residual", False):
        problems.append("norm_before_residual (the RedHat variant)")
    if md.get(p + "norm_before_fc", False) or f.tensors.get("enc.output_norm.weight") is not None:
        problems.append("norm_before_fc (a norm on the taps before fc)")
    for name, what in (("token_embd.weight", "its own token embeddings"), ("rope_freqs.weight", "llama3 RoPE factors")):
        if name in f.tensors:
            problems.append(what)
    if "output.weight" not in f.tensors:
        problems.append("no output.weight (it borrows the target's lm_head)")
    if problems:
        raise SpecplugError(f"{source}: specplug's eagle3 cannot run this draft: " + "; ".join(problems))

    info = _target(target)
    if int(_kv(md, p + "target_hidden_size", source)) != info.n_embd or d != info.n_embd:
        problems.append(f"target_hidden_size {md.get(p + 'target_hidden_size')} / embedding_length {d} "
                        f"!= the target's n_embd {info.n_embd}")
    if len(layers) != 3 or min(layers) < 0 or max(layers) >= info.n_layer:
        problems.append(f"target_layers {layers} are not 3 layer inputs of the target's {info.n_layer} layers")
    if "tokenizer.ggml.tokens" in md and token_table_sha256(md["tokenizer.ggml.tokens"]) != \
            token_table_sha256(info.token_texts):
        problems.append("its tokenizer's token table differs from the target's")
    if problems:
        raise SpecplugError(f"{source} is not a head for {Path(str(target)).name}: " + "; ".join(problems))

    for name in [*RENAMES.values(), *(s for parts in SPLITS.values() for s in parts)]:
        if name not in f.tensors:
            raise SpecplugError(f"{source}: tensor {name!r} is missing (is this a complete eagle3 draft?)")

    def part(name: str) -> tuple[np.ndarray, str]:
        return f.tensor(name), f.tensor_type(name)

    n_ff = f.shape("blk.0.ffn_gate.weight")[0]
    arrays, types = {}, {}
    for name, src in RENAMES.items():
        arrays[name], types[name] = part(src)
    for name, srcs in SPLITS.items():
        parts = [part(s) for s in srcs]
        arrays[name] = np.concatenate([a for a, _ in parts])
        kinds = {t for _, t in parts}
        types[name] = kinds.pop() if len(kinds) == 1 else "mixed"
    want = {"fc": (d, 3 * d), "blk.input_norm": (d,), "blk.hidden_norm": (d,),
            "blk.attn_qkv": ((H + 2 * Hkv) * D, 2 * d), "blk.attn_output": (d, H * D), "blk.ffn_norm": (d,),
            "blk.ffn_gate_up": (2 * n_ff, d), "blk.ffn_down": (d, n_ff), "norm": (d,)}
    for name, shape in want.items():
        if arrays[name].shape != shape:
            raise SpecplugError(f"{source}: {name} has shape {arrays[name].shape}, expected {shape} from its keys")
    N = arrays["lm_head"].shape[0]
    if "d2t" in f.tensors:
        t = f.tensors["d2t"]
        d2t = np.asarray(t.data).astype(np.int64).flatten()
        if GGMLQuantizationType(t.tensor_type) not in (GGMLQuantizationType.I64, GGMLQuantizationType.I32):
            raise SpecplugError(f"{source}: d2t is {GGMLQuantizationType(t.tensor_type).name}, expected integer ids")
    else:
        d2t = np.arange(N)
    if d2t.shape != (N,) or d2t.min() < 0 or d2t.max() >= info.vocab_size:
        raise SpecplugError(f"{source}: d2t ({len(d2t)} ids) does not map the {N} output rows into the "
                            f"target's vocabulary [0, {info.vocab_size})")

    quantize, f16 = set(), set()
    for name, qtype in types.items():
        if arrays[name].ndim != 2:
            continue
        kept = qtype if qtype in KEPT_TYPES else ("F32" if qtype == "BF16" else weights.upper())
        (quantize if kept == "Q8_0" else f16 if kept == "F16" else set()).add(name)
    cfg = Eagle3Config(d, H, Hkv, D, n_ff, _f32(_kv(md, p + "attention.layer_norm_rms_epsilon", source)),
                       _f32(md.get(p + "rope.freq_base", 10000.0)), tuple(layers))
    try:
        recipe = json.loads(md.get(RECIPE_KEY, "{}"))
    except (TypeError, ValueError):
        recipe = {}
    meta = HeadMeta.for_target(info, METHOD, VERSION, [str(x) for x in layers],
                               {**asdict(cfg), "layers": layers},
                               {**recipe, "imported_from": f"llama.cpp eagle3 GGUF {source}"})
    tensors = {k: torch.from_numpy(v) for k, v in arrays.items()} | {"d2t": torch.from_numpy(d2t.astype(np.int32))}
    write_head(output, meta, tensors, quantize=quantize, f16=f16)
    _check_bits(source, f, Path(output), types)
    return Path(output)


def _check_bits(source: Path, f, output: Path, types: dict[str, str]) -> None:
    """Tensors that kept their storage type must have kept their bytes (Q8_0 re-quantizes its own
    dequantized values exactly; this proves it for the file at hand)."""
    head = HeadFile(output, METHOD)
    for name, qtype in types.items():
        got, kept, _ = head.raw(name)
        if kept != qtype:  # converted by design (BF16 -> F32, other quants -> --weights)
            continue
        want = np.concatenate([f.raw(s)[0] for s in SPLITS.get(name) or (RENAMES[name],)])
        if got.shape != want.shape or not np.array_equal(got, want):
            raise SpecplugError(f"{source}: {name} did not convert bit for bit ({qtype}); this is a bug")
