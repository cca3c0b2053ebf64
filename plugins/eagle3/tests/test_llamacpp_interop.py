"""specplug Eagle3 head <-> llama.cpp's `eagle3` draft GGUF (`specplug convert eagle3`), on a tiny target.

What llama.cpp requires is written out below from its source, build b11312 as vendored in the
llama-cpp-python 0.3.36 sdist (vendor/llama.cpp/...); the files are named at each list.
"""
from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from specplug_eagle3.head import Eagle3Config, write_eagle3
from specplug_eagle3.speculator import Eagle3

from specplug.api import prompt_ids
from specplug.cli import main
from specplug.engine import target_info
from specplug.errors import SpecplugError
from specplug.heads import HeadFile
from specplug.runtime import load_target
from specplug.testing import repetitive_prompts, write_tiny_gguf
from specplug.types import Batch, DraftRequest

VT, QT = gguf.GGUFValueType, gguf.GGMLQuantizationType
LAYERS, N_DRAFT, H, HKV, D, N_FF = (1, 2, 3), 150, 4, 2, 16, 96

# Keys llama.cpp reads without a default, and the exact scalar type its GGUFMeta::GKV accepts:
#   src/llama-model.cpp   llama_model_base::load_hparams: context_length, embedding_length, block_count
#                         (head_count / feed_forward_length are optional there, but a layer needs them)
#   src/models/eagle3.cpp load_arch_hparams: attention.layer_norm_rms_epsilon, target_hidden_size,
#                         target_layers (an INT32 or UINT32 array, exactly 3 entries)
#   src/llama-vocab.cpp   llama_vocab::impl::load: tokenizer.ggml.model
REQUIRED_KEYS = {"general.architecture": VT.STRING, "eagle3.context_length": VT.UINT32,
                 "eagle3.embedding_length": VT.UINT32, "eagle3.block_count": VT.UINT32,
                 "eagle3.feed_forward_length": VT.UINT32, "eagle3.attention.head_count": VT.UINT32,
                 "eagle3.attention.layer_norm_rms_epsilon": VT.FLOAT32, "eagle3.target_hidden_size": VT.UINT32,
                 "tokenizer.ggml.model": VT.STRING}
# Optional keys we write, with the type their get_key demands (a wrong type throws, not defaults).
OPTIONAL_KEYS = {"eagle3.attention.head_count_kv": VT.UINT32, "eagle3.attention.key_length": VT.UINT32,
                 "eagle3.attention.value_length": VT.UINT32, "eagle3.rope.dimension_count": VT.UINT32,
                 "eagle3.rope.freq_base": VT.FLOAT32, "eagle3.norm_before_residual": VT.BOOL,
                 "eagle3.norm_before_fc": VT.BOOL}


def _loader_tensors(d: int, n_embd_tgt: int, n_draft: int) -> dict[str, tuple[int, ...]]:
    """src/models/eagle3.cpp load_arch_tensors: every tensor it creates, with its ggml ne (reversed
    torch shape). Names from src/llama-arch.cpp LLM_TENSOR_NAMES. Optional ones (token_embd, rope_freqs,
    enc.output_norm) are absent in our files; the loader counts tensors (llama-model-loader.cpp
    done_getting_tensors: "wrong number of tensors"), so the file must hold exactly these."""
    n_inp, n_attn_in = 3 * n_embd_tgt, 2 * d
    return {"d2t": (n_draft,), "fc.weight": (n_inp, d), "output_norm.weight": (d,), "output.weight": (d, n_draft),
            "blk.0.attn_norm.weight": (d,), "blk.0.attn_norm_2.weight": (d,),
            "blk.0.attn_q.weight": (n_attn_in, D * H), "blk.0.attn_k.weight": (n_attn_in, D * HKV),
            "blk.0.attn_v.weight": (n_attn_in, D * HKV), "blk.0.attn_output.weight": (D * H, d),
            "blk.0.ffn_norm.weight": (d,), "blk.0.ffn_gate.weight": (d, N_FF), "blk.0.ffn_down.weight": (N_FF, d),
            "blk.0.ffn_up.weight": (d, N_FF)}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("llamacpp")


@pytest.fixture(scope="module")
def tiny(work) -> Path:
    return write_tiny_gguf(work / "tiny.gguf", n_layer=4, tensor_type="Q8_0", scale=1.5)


def _target(path: Path, quant: str = "none"):
    return load_target(str(path), "cpu", "float32", quant)


def _head(tiny: Path, out: Path, weights: str, seed: int = 3) -> Path:
    """A random Eagle3 head for the tiny target, scaled so that its drafts vary."""
    target = _target(tiny)
    d, vocab = target.model.config.n_embd, target.model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale / math.sqrt(s[-1])  # noqa: E731
    v = lambda n: 1 + 0.1 * torch.randn(n, generator=g)  # noqa: E731
    t = {"fc": r(d, 3 * d), "blk.input_norm": v(d), "blk.hidden_norm": v(d),
         "blk.attn_qkv": r((H + 2 * HKV) * D, 2 * d, scale=3), "blk.attn_output": r(d, H * D), "blk.ffn_norm": v(d),
         "blk.ffn_gate_up": r(2 * N_FF, d), "blk.ffn_down": r(d, N_FF), "norm": v(d), "lm_head": r(N_DRAFT, d, scale=8),
         "d2t": torch.randperm(vocab, generator=g)[:N_DRAFT].sort().values.to(torch.int32)}
    cfg = Eagle3Config(d, H, HKV, D, N_FF, 1e-5, 10000.0, LAYERS)
    write_eagle3(out, target_info(target, 1, 16), cfg, t, {"note": "random test head"}, weights)
    return out


def _convert(src: Path, tiny: Path, out: Path, *extra: str) -> Path:
    assert main(["convert", "eagle3", str(src), "--target", str(tiny), "-o", str(out), *extra]) == 0
    return out


def _raw(path: Path) -> dict[str, tuple[str, bytes, tuple[int, ...]]]:
    return {t.name: (QT(t.tensor_type).name, np.asarray(t.data).tobytes(), tuple(int(x) for x in t.shape))
            for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("weights", ["q8_0", "f16", "f32"])
def test_export_holds_every_key_and_tensor_the_llamacpp_loader_requires(tiny, work, weights):
    head = _head(tiny, work / f"head-{weights}.gguf", weights)
    out = _convert(head, tiny, work / f"lcpp-{weights}.gguf")
    r = gguf.GGUFReader(str(out))
    f = r.fields
    for key, vtype in {**REQUIRED_KEYS, **OPTIONAL_KEYS}.items():
        assert key in f, key
        assert f[key].types == [vtype], (key, f[key].types)
    assert f["general.architecture"].contents() == "eagle3"  # src/llama-arch.cpp LLM_ARCH_NAMES
    layers = f["eagle3.target_layers"]
    assert layers.types[0] == VT.ARRAY and layers.types[-1] in (VT.INT32, VT.UINT32)
    assert f["eagle3.target_layers"].contents() == list(LAYERS)  # the same layers' inputs as the head taps
    assert f["eagle3.block_count"].contents() == 1  # eagle3.cpp: GGML_ASSERT(n_layer == 1)
    assert not f["eagle3.norm_before_residual"].contents() and not f["eagle3.norm_before_fc"].contents()
    tgt = gguf.GGUFReader(str(tiny)).fields
    tok_keys = sorted(k for k in tgt if k.startswith("tokenizer."))
    # the target's vocabulary, as convert_hf_to_gguf copies it (llama.cpp sizes the draft logits by it)
    assert sorted(k for k in f if k.startswith("tokenizer.")) == tok_keys
    for k in tok_keys:
        assert f[k].contents() == tgt[k].contents(), k
    d = f["eagle3.embedding_length"].contents()
    want = _loader_tensors(d, f["eagle3.target_hidden_size"].contents(), N_DRAFT)
    got = {t.name: t for t in r.tensors}
    assert set(got) == set(want)
    qtype = {"q8_0": QT.Q8_0, "f16": QT.F16, "f32": QT.F32}[weights]
    for name, ne in want.items():
        t = got[name]
        assert tuple(int(x) for x in t.shape) == ne, (name, t.shape, ne)
        if name == "d2t":
            assert t.tensor_type == QT.I64  # eagle3.cpp graph: GGML_ASSERT(model.d2t->type == GGML_TYPE_I64)
        elif len(ne) == 1:
            assert t.tensor_type == QT.F32, name  # norms: F32 (RMSNorm weights, GGML_OP_MUL)
        else:
            assert t.tensor_type == qtype, name  # matrices as stored in the head (ggml mul_mat takes all three)
    # bit-identical: every exported matrix is the head's bytes (fused q/k/v and gate/up split by rows)
    h = HeadFile(head)
    raw = {n: h.raw(n)[0].tobytes() for n in h.gguf.tensors}
    lc = {n: np.asarray(got[n].data).tobytes() for n in got}
    assert lc["blk.0.attn_q.weight"] + lc["blk.0.attn_k.weight"] + lc["blk.0.attn_v.weight"] == raw["blk.attn_qkv"]
    assert lc["blk.0.ffn_gate.weight"] + lc["blk.0.ffn_up.weight"] == raw["blk.ffn_gate_up"]
    for a, b in [("fc", "fc.weight"), ("blk.input_norm", "blk.0.attn_norm.weight"), ("norm", "output_norm.weight"),
                 ("blk.hidden_norm", "blk.0.attn_norm_2.weight"), ("blk.attn_output", "blk.0.attn_output.weight"),
                 ("blk.ffn_norm", "blk.0.ffn_norm.weight"), ("blk.ffn_down", "blk.0.ffn_down.weight"),
                 ("lm_head", "output.weight")]:
        assert lc[b] == raw[a], a
    # d2t as absolute target ids (llama.cpp's converter adds the checkpoint's offsets: conversion/llama.py)
    assert np.array_equal(np.asarray(got["d2t"].data), h.tensor("d2t").numpy())


def _draft(target, head: Path, ids: list[int], n: int = 4) -> list[int]:
    spec = Eagle3(Eagle3.Params(head=str(head), stop_below=0.0, calibrate=False, catch_up=None),  # the whole prompt
                  target_info(target, 1, 256))
    m = target.model
    out = m.forward(ids, list(range(len(ids))), [0] * len(ids), m.new_cache(1, 256), taps=set(LAYERS))
    body = Batch(torch.tensor(ids[:-1]), torch.arange(len(ids) - 1), torch.zeros(len(ids) - 1, dtype=torch.long),
                 {li: out.hidden[li][:-1] for li in LAYERS}, True)
    spec._reset(0)
    spec.process_batch(body, spec.encode(body))
    return list(spec.draft([DraftRequest(0, ids, n)])[0].token_ids)


def _ids(target, n=4, seed=5):
    return [prompt_ids(target.tokenizer, t, True) for t in repetitive_prompts(n, seed=seed)]


@pytest.mark.parametrize("weights", ["q8_0", "f16", "f32"])
def test_round_trip_keeps_every_bit_and_the_greedy_draft(tiny, work, weights):
    head = _head(tiny, work / f"rt-{weights}.gguf", weights, seed=7)
    lcpp = _convert(head, tiny, work / f"rt-{weights}-lcpp.gguf")
    back = _convert(lcpp, tiny, work / f"rt-{weights}-back.gguf")
    a, b = _raw(head), _raw(back)
    assert set(a) == set(b)
    for name in a:
        assert a[name] == b[name], name  # type, bytes and shape
    ha, hb = HeadFile(head), HeadFile(back)
    assert (hb.meta.config, hb.meta.taps, hb.meta.token_table_sha256) == (ha.meta.config, ha.meta.taps,
                                                                         ha.meta.token_table_sha256)
    assert hb.meta.recipe["note"] == "random test head" and "llama.cpp" in hb.meta.recipe["imported_from"]
    target = _target(tiny, "gguf")
    drafts = [(_draft(target, head, ids), _draft(target, back, ids)) for ids in _ids(target)]
    assert all(x == y for x, y in drafts), drafts
    assert sum(len(x) for x, _ in drafts) >= 8 and len({t for x, _ in drafts for t in x}) > 2  # real, varied drafts


class _LlamaCppEagle3:
    """llama.cpp's eagle3 decoder graph (src/models/eagle3.cpp, graph<false>; norm_before_residual off)
    run in float64 on the exported file's tensors, with its conventions: RoPE type NORM (adjacent
    pairs, src/llama-model.cpp llama_model_rope_type) and the pair (token[P+1], g[P]) at position P
    (common/speculative.cpp), logits scattered to the full vocabulary by d2t."""

    def __init__(self, path: Path):
        from gguf.quants import dequantize

        r = gguf.GGUFReader(str(path))
        self.t = {t.name: dequantize(np.asarray(t.data), QT(t.tensor_type)).astype(np.float64)
                  .reshape(tuple(reversed([int(x) for x in t.shape]))) for t in r.tensors if t.name != "d2t"}
        self.d2t = np.asarray(next(t for t in r.tensors if t.name == "d2t").data)
        f = lambda k: r.fields["eagle3." + k].contents()  # noqa: E731
        self.eps, self.base = f("attention.layer_norm_rms_epsilon"), f("rope.freq_base")
        self.layers = f("target_layers")
        self.k, self.v = [], []

    def _norm(self, x, w):
        return x / np.sqrt(np.mean(x * x) + self.eps) * w

    def _rope(self, x, pos):  # x [heads, D], ggml NORM: rotate (x[2i], x[2i+1]) by pos * base^(-2i/D)
        theta = pos * self.base ** (-np.arange(0, D, 2) / D)
        c, s = np.cos(theta), np.sin(theta)
        a, b = x[:, 0::2], x[:, 1::2]
        out = np.empty_like(x)
        out[:, 0::2], out[:, 1::2] = a * c - b * s, a * s + b * c
        return out

    def encode(self, feats: np.ndarray) -> np.ndarray:  # graph<true>: fc over [low; mid; high] layer inputs
        return feats @ self.t["fc.weight"].T

    def step(self, emb, g, pos):
        t, p = self.t, "blk.0."
        x = np.concatenate([self._norm(emb, t[p + "attn_norm.weight"]), self._norm(g, t[p + "attn_norm_2.weight"])])
        q = self._rope((t[p + "attn_q.weight"] @ x).reshape(H, D), pos)
        self.k.append(self._rope((t[p + "attn_k.weight"] @ x).reshape(HKV, D), pos))
        self.v.append((t[p + "attn_v.weight"] @ x).reshape(HKV, D))
        K, V = np.stack(self.k, 1).repeat(H // HKV, 0), np.stack(self.v, 1).repeat(H // HKV, 0)  # [H, n, D]
        att = np.einsum("hnd,hd->hn", K, q) / math.sqrt(D)
        att = np.exp(att - att.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        ffn_inp = t[p + "attn_output.weight"] @ np.einsum("hn,hnd->hd", att, V).flatten() + g
        y = self._norm(ffn_inp, t[p + "ffn_norm.weight"])
        gate = t[p + "ffn_gate.weight"] @ y
        out = t[p + "ffn_down.weight"] @ (gate / (1 + np.exp(-gate)) * (t[p + "ffn_up.weight"] @ y)) + ffn_inp
        draft_logits = t["output.weight"] @ self._norm(out, t["output_norm.weight"])
        return out, int(self.d2t[int(np.argmax(draft_logits))])


def test_the_export_drafts_in_llamacpps_graph_what_specplug_drafts(tiny, work):
    """The exported file, read the way llama.cpp's eagle3 graph reads it (fed the same target layer
    inputs), proposes exactly specplug's greedy draft from the original head."""
    head = _head(tiny, work / "ref.gguf", "f32", seed=11)
    lcpp = _convert(head, tiny, work / "ref-lcpp.gguf")
    target = _target(tiny, "none")
    m, emb = target.model, target.model.embed
    n_drafted = 0
    for ids in _ids(target, 4, seed=9):
        want = _draft(target, head, ids)
        ref = _LlamaCppEagle3(lcpp)
        out = m.forward(ids, list(range(len(ids))), [0] * len(ids), m.new_cache(1, 256), taps=set(ref.layers))
        g = ref.encode(torch.cat([out.hidden[li] for li in ref.layers], -1).double().numpy())
        for P in range(len(ids) - 1):  # prompt pairs, then the sampled token's pair completes the first draft
            state, tok = ref.step(emb[ids[P + 1]].double().numpy(), g[P], P)
        got = []
        for i in range(len(want)):
            got.append(tok)
            if tok in target.tokenizer.eot_ids:
                break
            state, tok = ref.step(emb[tok].double().numpy(), state, len(ids) - 1 + i)
        assert got == want
        n_drafted += len(want)
    assert n_drafted >= 8


def _rewrite(src: Path, dst: Path, kv: dict | None = None, extra: dict | None = None) -> Path:
    """A copy of a GGUF with some keys set and tensors added (llama.cpp variants we do not run)."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in (kv or {}):
            continue
        w.add_key_value(key, field.contents(), field.types[0],
                        sub_type=field.types[-1] if field.types[0] == VT.ARRAY else None)
    for key, (val, vtype) in (kv or {}).items():
        w.add_key_value(key, val, vtype)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=QT(t.tensor_type))
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_what_specplug_cannot_run_or_another_target_are_clear_errors(tiny, work):
    from specplug_eagle3.convert import convert

    lcpp = _convert(_head(tiny, work / "err.gguf", "f16"), tiny, work / "err-lcpp.gguf")
    variant = _rewrite(lcpp, work / "variant.gguf", {"eagle3.norm_before_residual": (True, VT.BOOL)},
                       {"rope_freqs.weight": np.ones(D // 2, dtype=np.float32)})
    with pytest.raises(SpecplugError, match=r"cannot run this draft: norm_before_residual .*; llama3 RoPE factors"):
        convert(variant, tiny, work / "x.gguf")
    other = write_tiny_gguf(work / "other.gguf", n_layer=4, n_embd=96, tensor_type="Q8_0", scale=1.5)
    with pytest.raises(SpecplugError, match=r"not a head for other.gguf: target_hidden_size 64 .* n_embd 96"):
        convert(lcpp, other, work / "x.gguf")
    with pytest.raises(SpecplugError, match=r"trained for tiny .*not for the target other.gguf"):
        convert(work / "err.gguf", other, work / "x.gguf")
    with pytest.raises(SpecplugError, match=r"architecture 'llama'"):
        convert(tiny, tiny, work / "x.gguf")
    assert not (work / "x.gguf").exists()
