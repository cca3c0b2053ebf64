"""`specplug convert eagle3 SOURCE --target TARGET.gguf -o FILE.gguf`; SOURCE picks the direction:
- a folder or .safetensors file: import a public EAGLE-3 head (the layout below) as a specplug head;
- a specplug eagle3 head file (.gguf): export it as llama.cpp's `eagle3` draft GGUF (`-md` of
  `llama-server --spec-type draft-eagle3`); a llama.cpp `eagle3` GGUF: import it as a specplug head
  (see specplug_eagle3.llamacpp; tensors keep their stored bits both ways, --weights is not used
  unless a llama.cpp tensor has a type a head file cannot hold).

Public heads, in the layout the EAGLE / SpecForge / vLLM ecosystem publishes:

Expected: a folder with `config.json` and `model.safetensors` (or the .safetensors file with its
config.json beside it) holding
    fc.weight [d, 3d]                         midlayer.input_layernorm.weight, midlayer.hidden_norm.weight
    midlayer.self_attn.{q,k,v,o}_proj.weight  q/k/v from 2d inputs, rows in Hugging Face (half-split) RoPE order
    midlayer.post_attention_layernorm.weight  midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight   lm_head.weight [N, d]       d2t [N] (offsets: target id = draft row + d2t[row]); t2d unused
config.json: hidden_size, num_attention_heads, num_key_value_heads, intermediate_size, rms_norm_eps,
rope_theta, vocab_size, optionally head_dim, draft_vocab_size and
eagle_config.eagle_aux_hidden_state_layer_ids (default: the target's layers 2, n/2, n-3, vLLM's choice).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specplug.errors import SpecplugError
from specplug.runtime import load_target
from specplug.runtime.model import _neox_to_interleaved
from specplug_eagle3.head import Eagle3Config, write_eagle3


def _files(source: Path) -> tuple[Path, list[Path]]:
    if source.is_dir():
        weights = sorted(source.glob("*.safetensors"))
        config = source / "config.json"
    elif source.suffix == ".safetensors":
        weights, config = [source], source.parent / "config.json"
    else:
        raise SpecplugError(f"{source}: give the head's folder or its .safetensors file")
    if not weights:
        raise SpecplugError(f"{source}: no .safetensors weights found (pytorch .bin checkpoints are not read)")
    if not config.is_file():
        raise SpecplugError(f"{config}: missing; the head's config.json must sit beside its weights")
    return config, weights


def convert(source: Path, target: Path, output: Path, weights: str = "f16") -> Path:
    """Convert an EAGLE-3 checkpoint for `target` (a GGUF path or model name) into a specplug head file,
    or a specplug head to / from llama.cpp's eagle3 GGUF (by what `source` is; see the module doc)."""
    source = Path(source)
    if source.suffix == ".gguf":
        from specplug_eagle3 import llamacpp

        arch = _gguf_arch(source)
        if arch == "specplug-head":
            return llamacpp.export_llamacpp(source, target, output)
        if arch == llamacpp.ARCH:
            return llamacpp.import_llamacpp(source, target, output, weights)
        raise SpecplugError(f"{source}: a GGUF of architecture {arch!r}; give a specplug eagle3 head (to export "
                            f"to llama.cpp) or a llama.cpp eagle3 draft (to import)")
    return _convert_checkpoint(source, target, output, weights)


def _gguf_arch(path: Path) -> str | None:
    from specplug.errors import ModelError
    from specplug.runtime.gguf_file import GGUFFile

    try:
        return GGUFFile(path).metadata.get("general.architecture")
    except ModelError as exc:
        raise SpecplugError(str(exc)) from None


def _convert_checkpoint(source: Path, target, output: Path, weights: str) -> Path:
    from safetensors.torch import load_file

    from specplug.engine import target_info

    config_path, files = _files(source)
    try:
        conf = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise SpecplugError(f"{config_path}: not valid JSON ({exc})") from None
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    tgt = load_target(str(target), "cpu", "float32", "none")
    info = target_info(tgt, 1, 16)
    mc = tgt.model.config
    try:
        d, H = int(conf["hidden_size"]), int(conf["num_attention_heads"])
        Hkv = int(conf.get("num_key_value_heads", H))
        D = int(conf.get("head_dim") or d // H)
        n_ff = int(conf["intermediate_size"])
        eps = float(conf.get("rms_norm_eps", 1e-6))
        base = float(conf.get("rope_theta", 10000.0))
        vocab = int(conf.get("vocab_size", mc.vocab_size))
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecplugError(f"{config_path}: missing or malformed key {exc}") from None
    layers = (conf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or \
        [2, mc.n_layer // 2, mc.n_layer - 3]
    problems = []
    if d != mc.n_embd:
        problems.append(f"hidden_size {d} != the target's n_embd {mc.n_embd}")
    if vocab != mc.vocab_size:
        problems.append(f"vocab_size {vocab} != the target's {mc.vocab_size}")
    if len(layers) != 3 or max(layers) >= mc.n_layer:
        problems.append(f"aux hidden state layers {layers} do not fit the target's {mc.n_layer} layers")
    if problems:
        raise SpecplugError(f"{source} is not a head for {Path(str(target)).name}: " + "; ".join(problems))

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = sd.get(name)
        if t is None:
            raise SpecplugError(f"{source}: tensor {name!r} is missing (is this an EAGLE-3 checkpoint?)")
        if tuple(t.shape) != shape:
            raise SpecplugError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t.float()

    p = "midlayer."
    N = int(conf.get("draft_vocab_size") or sd.get("lm_head.weight", torch.empty(vocab, 0)).shape[0])
    q = _neox_to_interleaved(get(p + "self_attn.q_proj.weight", (H * D, 2 * d)), H, D)
    k = _neox_to_interleaved(get(p + "self_attn.k_proj.weight", (Hkv * D, 2 * d)), Hkv, D)
    v = get(p + "self_attn.v_proj.weight", (Hkv * D, 2 * d))
    if "d2t" in sd:
        off = sd["d2t"].long().flatten()
        if off.shape[0] != N:
            raise SpecplugError(f"{source}: d2t has {off.shape[0]} entries for a draft vocabulary of {N}")
        d2t = torch.arange(N) + off
    elif N == vocab:
        d2t = torch.arange(N)
    else:
        raise SpecplugError(f"{source}: a draft vocabulary of {N} < {vocab} needs a d2t tensor")
    if int(d2t.min()) < 0 or int(d2t.max()) >= vocab:
        raise SpecplugError(f"{source}: d2t maps draft rows outside the vocabulary [0, {vocab})")
    tensors = {
        "fc": get("fc.weight", (d, 3 * d)),
        "blk.input_norm": get(p + "input_layernorm.weight", (d,)),
        "blk.hidden_norm": get(p + "hidden_norm.weight", (d,)),
        "blk.attn_qkv": torch.cat([q, k, v]),
        "blk.attn_output": get(p + "self_attn.o_proj.weight", (d, H * D)),
        "blk.ffn_norm": get(p + "post_attention_layernorm.weight", (d,)),
        "blk.ffn_gate_up": torch.cat([get(p + "mlp.gate_proj.weight", (n_ff, d)),
                                       get(p + "mlp.up_proj.weight", (n_ff, d))]),
        "blk.ffn_down": get(p + "mlp.down_proj.weight", (d, n_ff)),
        "norm": get("norm.weight", (d,)),
        "lm_head": get("lm_head.weight", (N, d)),
        "d2t": d2t.to(torch.int32),
    }
    cfg = Eagle3Config(d, H, Hkv, D, n_ff, eps, base, tuple(int(x) for x in layers))
    write_eagle3(output, info, cfg, tensors, {"converted_from": str(source), "config": conf}, weights)
    return Path(output)
