"""The `gguf` weight path: kernels on GGUF's own quantized blocks (CPU: AVX2, AVX-512 VNNI).

Checked against an independent torch emulation of the same arithmetic (activations
quantized to 8 bits per block of 32, weights dequantized by the gguf package), and for the
property speculative decoding needs from it: every row's result is bit-identical whatever
else is in the batch.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specplug.errors import ModelError
from specplug.runtime import GGUFFile, load_target, native
from specplug.testing import RandomDrafts, assert_greedy_equal, isa_env, write_tiny_gguf

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"gguf kernels unavailable: {native.unavailable_reason()}")


def q8(x: torch.Tensor) -> torch.Tensor:
    """What the kernels do to activations: 8 bits per block of 32, round to nearest even."""
    b = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    q = torch.round(b * torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax)))
    return (q * (amax / 127.0)).reshape(x.shape)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F32"])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_linear_equals_emulation_and_is_batch_invariant(qtype, rows):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    g = torch.Generator().manual_seed(rows)
    n, k = 44, 96  # 44 outputs: not a multiple of the 8-column tile
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    if qtype == "F32":
        lin = native.QuantLinear.from_float(w, bias=bias)
        wd = None
    else:
        t = GGMLQuantizationType[qtype]
        raw = quantize(w.numpy(), t)
        lin = native.QuantLinear.from_blocks(raw, qtype, (n, k), bias=bias)
        wd = torch.from_numpy(dequantize(raw, t).reshape(n, k).astype(np.float64))
    if wd is None:  # Q8_0 re-quantization of float weights: within half a step of each weight
        wd = lin_weights_q8(w)
    x = torch.randn(rows, k, generator=g) * 3
    res = torch.randn(rows, n, generator=g)
    y = lin(x, residual=res)
    ref = q8(x).double() @ wd.T + bias.double() + res.double()
    assert y.shape == (rows, n)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
    # each row alone gives the same bits
    alone = torch.cat([lin(x[i:i + 1], residual=res[i:i + 1]) for i in range(rows)])
    assert torch.equal(alone, y)


def lin_weights_q8(w: torch.Tensor) -> torch.Tensor:
    b = w.double().reshape(w.shape[0], -1, 32)
    d = torch.from_numpy((b.abs().amax(-1, keepdim=True).numpy() / 127.0).astype(np.float16)).double()
    return (torch.round(torch.where(d > 0, b / d, 0.0)).clamp(-127, 127) * d).reshape(w.shape)


def emulate(path, ids: list[int]) -> torch.Tensor:
    """A llama forward in plain torch with the kernels' quantization points (independent code)."""
    f = GGUFFile(path)
    cfg = f.config
    t = lambda name: torch.from_numpy(f.tensor(name)).double()  # noqa: E731
    H, Hkv, D, eps = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rms_eps
    n = len(ids)
    x = t("token_embd.weight")[ids].float()

    def rms(v, w):
        return (v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)).double() * w

    inv = cfg.rope_base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    cos, sin = torch.cos(ang), torch.sin(ang)

    def rope(v):  # [n, heads, D], interleaved pairs
        a, b = v[..., 0::2], v[..., 1::2]
        out = torch.empty_like(v)
        out[..., 0::2] = a * cos[:, None] - b * sin[:, None]
        out[..., 1::2] = a * sin[:, None] + b * cos[:, None]
        return out

    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        h = q8(rms(x, t(p + "attn_norm.weight")).float()).double()
        q = rope((h @ t(p + "attn_q.weight").T).view(n, H, D))
        k = rope((h @ t(p + "attn_k.weight").T).view(n, Hkv, D))
        v = (h @ t(p + "attn_v.weight").T).view(n, Hkv, D)
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / D ** 0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, H * D)
        x = (x.double() + q8(o.float()).double() @ t(p + "attn_output.weight").T).float()
        h = q8(rms(x, t(p + "ffn_norm.weight")).float()).double()
        g, u = h @ t(p + "ffn_gate.weight").T, h @ t(p + "ffn_up.weight").T
        x = (x.double() + q8((torch.nn.functional.silu(g) * u).float()).double() @ t(p + "ffn_down.weight").T).float()
    head = lin_weights_q8(t("token_embd.weight").float()) if f.tensor_type("token_embd.weight") == "F32" \
        else t("token_embd.weight")
    return q8(rms(x, t("output_norm.weight")).float()).double() @ head.T


@pytest.mark.parametrize("ttype", ["Q8_0", "Q4_1", "Q4_0"])
def test_model_equals_emulation(tmp_path, ttype):
    path = write_tiny_gguf(tmp_path / "m.gguf", tensor_type=ttype, seed=5)
    m = load_target(str(path), device="cpu", quant="gguf").model
    assert m.quant == "gguf"
    ids = list(range(20, 52))
    # a float32 cache: the emulation keeps keys and values in full precision
    out = m.forward(ids, list(range(len(ids))), [0] * len(ids), m.new_cache(1, 64, torch.float32)).logits
    ref = emulate(path, ids)
    # float rounding can move an activation across an 8-bit step now and then: allow that
    # on a few values, but the bulk must agree to float precision
    err = (out.double() - ref).abs()
    assert err.median() < 1e-4 * ref.abs().max(), float(err.median())
    assert (err > 1e-3 * ref.abs().max()).float().mean() < 0.02
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95


@pytest.fixture(scope="module", params=native.available_isas() or ["avx2"])
def qtiny(tmp_path_factory, request):
    """A tiny Q4_1 model on each kernel path this CPU runs (so every batch-invariance test runs on
    every path; on an AVX2-only CPU only the AVX2 one, see tests/test_isa.py)."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("native") / "q.gguf", tensor_type="Q4_1", n_layer=3, seed=2)
    with isa_env(request.param):
        return load_target(str(path), device="cpu", quant="gguf")


def test_verify_rows_are_bit_identical_to_single_steps(qtiny):
    m = qtiny.model
    toks = list(range(30, 70))
    c = m.new_cache(2, 128)
    m.forward(toks[:30], list(range(30)), [1] * 30, c)
    steps = torch.cat([m.forward([toks[30 + i]], [30 + i], [1], c).logits for i in range(8)])
    c.seq_rm(1, 30)
    for k in (2, 5, 8):
        verify = m.forward(toks[30:30 + k], list(range(30, 30 + k)), [1] * k, c).logits
        assert torch.equal(verify, steps[:k])
        c.seq_rm(1, 30)
    # and with another sequence's rows in the same batch
    m.forward(toks[:10], list(range(10)), [0] * 10, c)
    mixed = m.forward([5] + toks[30:38], [10] + list(range(30, 38)), [0] + [1] * 8, c).logits
    assert torch.equal(mixed[1:], steps)


def test_batch_of_sequences_and_rollback(qtiny):
    m = qtiny.model
    prompts = [list(range(10, 10 + n)) for n in (7, 13, 3)]
    batch = m.new_cache(3, 128)
    toks = [t for p in prompts for t in p]
    pos = [i for p in prompts for i in range(len(p))]
    seq = [s for s, p in enumerate(prompts) for _ in p]
    out = m.forward(toks, pos, seq, batch).logits
    off = 0
    for p in prompts:
        solo = m.forward(p, list(range(len(p))), [0] * len(p), m.new_cache(1, 128)).logits
        assert torch.equal(out[off:off + len(p)], solo)
        off += len(p)
    # a hole in the middle, refilled, gives the original result again
    c = m.new_cache(1, 128)
    m.forward(toks, list(range(len(toks))), [0] * len(toks), c)
    want = m.forward([77], [len(toks)], [0], c).logits
    c.seq_rm(0, 5, 9)
    c.seq_rm(0, len(toks))
    m.forward(toks[5:9], list(range(5, 9)), [0] * 4, c)
    assert torch.equal(m.forward([77], [len(toks)], [0], c).logits, want)


def test_taps_and_logit_rows(qtiny):
    m = qtiny.model
    n_layer = m.config.n_layer
    toks = list(range(30, 40))
    full = m.forward(toks, list(range(10)), [0] * 10, m.new_cache(1, 64)).logits
    out = m.forward(toks, list(range(10)), [0] * 10, m.new_cache(1, 64), logits_rows=[9, 3], taps={0, n_layer})
    assert torch.equal(out.logits, full[[9, 3]])
    assert torch.equal(out.hidden[0], m.embed[torch.tensor(toks)])
    assert torch.equal(m.head.norm_linear(out.hidden[n_layer], m.config.rms_eps), full)


def test_speculative_output_equals_plain(qtiny):
    prompts = [list(range(40, 60)), [3, 1, 4, 1, 5, 9, 2, 6]]
    eng = assert_greedy_equal(qtiny, [RandomDrafts(qtiny.model.config.vocab_size, seed=1)], prompts, max_tokens=40)
    assert sum(s.drafted_tokens for s in eng.stats.speculators.values()) > 0


@pytest.mark.parametrize("arch,head_dim", [("qwen2", None), ("qwen3", 128)])
def test_other_architectures_close_to_float(tmp_path, arch, head_dim):
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch, tensor_type="Q8_0", head_dim=head_dim, seed=4)
    g = load_target(str(path), device="cpu", quant="gguf").model
    f = load_target(str(path), device="cpu", quant="none").model
    ids = list(range(12, 44))
    a = g.forward(ids, list(range(32)), [0] * 32, g.new_cache(1, 64)).logits
    b = f.forward(ids, list(range(32)), [0] * 32, f.new_cache(1, 64)).logits
    # 8-bit activations drift from float32 as much as on llama (checked exactly against the
    # emulation above): median error ~1% of the logit range; a wrong q/k layout, bias or
    # norm would be off by the whole range
    assert (a - b).abs().median() < 0.02 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


def test_auto_picks_gguf_for_quantized_files_only(tmp_path, tiny_gguf):
    q = write_tiny_gguf(tmp_path / "q.gguf", tensor_type="Q8_0")
    assert load_target(str(q), device="cpu").model.quant == "gguf"
    assert load_target(str(tiny_gguf), device="cpu").model.quant == "none"  # F32 weights stay exact
    with pytest.raises(ModelError,
                       match="quant: gguf is not possible here: it runs on device: cpu with dtype: float32"):
        load_target(str(q), device="cpu", dtype="bfloat16", quant="gguf")
    odd = write_tiny_gguf(tmp_path / "odd.gguf", n_embd=48, n_head=4, n_head_kv=2, n_ff=80)
    with pytest.raises(ModelError, match="multiples of 32"):
        load_target(str(odd), device="cpu", quant="gguf")


def test_float16_cache_is_the_default_and_stores_rounded_float32_values(qtiny):
    m = qtiny.model
    toks = list(range(30, 70))
    c16, c32 = m.new_cache(1, 128), m.new_cache(1, 128, torch.float32)
    assert c16.k.dtype == torch.float16 and c32.k.dtype == torch.float32
    a = m.forward(toks, list(range(40)), [0] * 40, c16).logits
    b = m.forward(toks, list(range(40)), [0] * 40, c32).logits
    # layer 0's keys and values come from the same inputs: stored as their float16 rounding
    assert torch.equal(c16.k[0, 0, :, :40], c32.k[0, 0, :, :40].half())
    assert torch.equal(c16.v[0, 0, :, :40], c32.v[0, 0, :, :40].half())
    # the tiny random model amplifies any rounding (its answers are made to vary); the real model's
    # closeness is checked in test_smollm2
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.75
    assert not torch.equal(a, b)  # really computed from the float16 cache


def _three_ways(m, monkeypatch, run):
    """run(m) with all layers in one native call (LayerStack), with one layer_forward call per layer,
    and kernel by kernel (the profiler's way)."""
    from specplug.runtime.model import Transformer

    assert m._layer_stack() is not None and m._stack_tokens  # a forward on the kernels: ids to logits in one call
    stacked = run(m)
    with monkeypatch.context() as mp:
        mp.setattr(Transformer, "_layer_stack", lambda self: None)
        per_layer = run(m)
    try:
        for layer in m.layers:
            layer.fused = False
        assert m._layer_stack() is None
        apart = run(m)
    finally:
        for layer in m.layers:
            layer.fused = True
    return stacked, per_layer, apart


def _forward_two_sequences(m):
    """A prompt of 30 on sequence 1, 20 on sequence 0, then a 4-row verification on both at once;
    outputs with the taps (0, 1, n_layer) and the caches after."""
    n_layer, toks = m.config.n_layer, list(range(30, 60))
    c = m.new_cache(2, 64)
    taps = {0, 1, n_layer}
    outs = [m.forward(toks, list(range(30)), [1] * 30, c, taps=taps),
            m.forward(toks[:20], list(range(20)), [0] * 20, c, taps=taps),
            m.forward(toks[5:9] + toks[9:13], [30, 31, 32, 33, 20, 21, 22, 23], [1] * 4 + [0] * 4, c, taps=taps)]
    kc = c.k if isinstance(c.k, torch.Tensor) else torch.cat([k.flatten() for k in c.k])
    return [o.logits for o in outs] + [o.hidden[t] for o in outs for t in sorted(taps)] + [kc]


def test_one_call_for_all_layers_equals_a_call_per_layer_and_kernel_by_kernel(qtiny, monkeypatch):
    stacked, per_layer, apart = _three_ways(qtiny.model, monkeypatch, _forward_two_sequences)
    assert all(torch.equal(a, b) for a, b in zip(stacked, per_layer))
    assert all(torch.equal(a, b) for a, b in zip(stacked, apart))


def test_ids_to_logits_in_one_call_are_the_same_bits(qtiny):
    """`LayerStack.forward_tokens` (the embedding, every layer and the head in one native call, what
    a forward on the kernels runs) against the embedding and head called from Python around
    `LayerStack.forward`: the same logits and taps bit for bit, for all rows, some rows in any order,
    or none; a token id outside the table is still the embedding's IndexError."""
    m = qtiny.model
    assert m._layer_stack() is not None and m._stack_tokens
    n_layer, toks = m.config.n_layer, list(range(30, 60))

    def run(rows):
        c = m.new_cache(2, 64)
        m.forward(toks[:20], list(range(20)), [1] * 20, c, logits_rows=[19])
        out = m.forward(toks[3:9], [20, 21, 22, 0, 1, 2], [1, 1, 1, 0, 0, 0], c, logits_rows=rows, taps={1, n_layer})
        return out, c.k

    try:
        for rows in (None, [5, 0, 2], []):
            m._stack_tokens = True
            one, k_one = run(rows)
            m._stack_tokens = False
            apart, k_apart = run(rows)
            assert (one.logits is None) == (apart.logits is None) == (rows == [])
            assert rows == [] or torch.equal(one.logits, apart.logits)
            assert one.hidden.keys() == apart.hidden.keys() == {1, n_layer}
            assert all(torch.equal(one.hidden[t], apart.hidden[t]) for t in one.hidden)
            assert torch.equal(k_one, k_apart)
    finally:
        m._stack_tokens = True
    with pytest.raises(IndexError, match="out of range"):
        m.forward([len(m.embed)], [0], [0], m.new_cache(1, 8))


def test_gemma_layers_in_one_call_are_the_same_bits(tmp_path, monkeypatch):
    """Gemma 3's layers in the stack: sliding windows on ring caches (one tensor per layer), their
    own RoPE base (a second table), post norms, GeGLU."""
    path = write_tiny_gguf(tmp_path / "g.gguf", n_layer=3, head_dim=32, context=128, arch="gemma3", window=4,
                           window_pattern=2, rope_base_window=100.0, scale=2.0, tensor_type="Q8_0", seed=5)
    m = load_target(str(path), device="cpu", quant="gguf").model
    stacked, per_layer, apart = _three_ways(m, monkeypatch, _forward_two_sequences)
    assert len(m._stack[2]) == 2  # the step's RoPE and the local layers' own
    assert all(torch.equal(a, b) for a, b in zip(stacked, per_layer))
    assert all(torch.equal(a, b) for a, b in zip(stacked, apart))


def test_a_one_layer_model_runs_its_stack(tmp_path, monkeypatch):
    m = load_target(str(write_tiny_gguf(tmp_path / "one.gguf", n_layer=1, tensor_type="Q8_0", seed=4)),
                    device="cpu", quant="gguf").model
    stacked, per_layer, apart = _three_ways(m, monkeypatch, _forward_two_sequences)
    assert all(torch.equal(a, b) for a, b in zip(stacked, per_layer))
    assert all(torch.equal(a, b) for a, b in zip(stacked, apart))


def test_kernel_timers_count_each_call_of_the_engines_forward_and_only_when_asked(qtiny):
    """`stage_times`: what `bench-runtime --profile` reads, timed inside the kernels on the forward
    the engine runs (all layers in one native call)."""
    m = qtiny.model
    ext = m.layers[0]._k  # the module of the path this model runs on
    n_layer = m.config.n_layer
    c = m.new_cache(1, 64)
    m.forward(list(range(30, 40)), list(range(10)), [0] * 10, c)

    def step():
        m.forward([7, 8, 9], [10, 11, 12], [0] * 3, c)
        c.seq_rm(0, 10)

    ext.stage_times()
    step()  # timing off: nothing counted
    assert all(calls == 0 and sec == 0 for sec, calls in ext.stage_times().values())
    ext.set_stage_timing(True)
    try:
        ext.stage_times()
        step()
        times = ext.stage_times()
    finally:
        ext.set_stage_timing(False)
    assert set(times) == {"linear", "quantize", "rope_store", "attention", "norm"}
    assert times["linear"][1] == 4 * n_layer + 1  # qkv, o, gate-up, down a layer, and the output head
    assert times["attention"][1] == n_layer and times["rope_store"][1] == n_layer
    assert times["quantize"][1] >= 4 * n_layer
    assert times["norm"][1] == 0  # llama has no post norms
    assert all(sec > 0 for name, (sec, _) in times.items() if name != "norm")


def test_profile_times_the_engine_path_and_counts_what_the_linears_read(qtiny, monkeypatch):
    from specplug import bench_runtime

    monkeypatch.setattr(bench_runtime, "PROFILE_CTX", (16, 512))
    monkeypatch.setattr(bench_runtime, "PROFILE_K", (1, 2))
    monkeypatch.setattr(bench_runtime, "_machine_limits", lambda threads, ext: {
        "threads": threads, "stream_read_gb_s": 10.0, "isa": ext.isa(), "dot_instruction": ext.dot_instruction(),
        "peak_gmac_s_isa": 200.0, "peak_gmac_s_isa_8bit": 100.0, "dot_instruction_8bit": ext.dot_instruction(8),
        "peak_gmac_s_q4_1": 100.0, "peak_gmac_s_q8_0": 50.0,
        "fma_instruction": ext.fma_instruction(), "peak_gmac_s_fma": 0.001})
    m = qtiny.model
    prof = bench_runtime.profile(m, repeats=3)
    rows = {(r["ctx"], r["k"]): r for r in prof["rows"]}
    assert set(rows) == {(16, 1), (16, 2), (512, 1), (512, 2)}
    weights = sum(t.numel() * t.element_size() for lin in [x for layer in m.layers for x in layer.linears()] + [m.head]
                  for t in (lin.qs, lin.d, lin.m) if t is not None)
    for (ctx, k), r in rows.items():
        assert r["weight_mb"] == round(weights / 1e6, 1)  # every linear's weights read once a forward
        assert r["linear_ms"] > 0 and r["attention_ms"] > 0 and r["quantize_ms"] > 0
    assert rows[(16, 1)]["linear_gmacs"] > 0
    assert rows[(16, 2)]["linear_gmacs"] == pytest.approx(2 * rows[(16, 1)]["linear_gmacs"], rel=0.01)
    # of them, those on 8-bit weights (256-byte blocks: the head here, Q8_0), which the bound prices apart
    lins = [x for layer in m.layers for x in layer.linears()] + [m.head]
    macs8 = sum(lin.qs.shape[1] * 32 * lin.out_features for lin in lins if lin.qs.shape[2] == 256)
    assert 0 < macs8 < rows[(16, 1)]["linear_gmacs"] * 1e9
    assert rows[(16, 1)]["linear_gmacs_8bit"] == pytest.approx(macs8 / 1e9, abs=1e-6)
    assert rows[(16, 2)]["linear_gmacs_8bit"] == pytest.approx(2 * macs8 / 1e9, abs=1e-6)
    assert rows[(512, 1)]["attn_gmacs"] > rows[(16, 1)]["attn_gmacs"]
    # the linears' floor, walked beside the forward at ctx 512 only (and the loads alone at k = 1)
    assert rows[(512, 1)]["floor_ms"] > 0 and rows[(512, 2)]["floor_ms"] > 0 and rows[(512, 1)]["loads_ms"] > 0
    assert "floor_ms" not in rows[(16, 1)] and "loads_ms" not in rows[(512, 2)]
    text = bench_runtime.format_profile(prof)
    assert "k=1 " in text and "x the bound" in text and "x the floor" in text  # the roofline lines at ctx 512
    assert "headroom (ctx 512)" in text
    # attention against its bound: at 1 M MAC/s of float multiply-adds (above) its multiply-adds bound it
    r = rows[(512, 1)]
    assert bench_runtime.attention_bound_ms(r, prof["limits"]) == pytest.approx(r["attn_gmacs"] / 0.001 * 1e3)
    assert "roofline of attention per forward (ctx 512)" in text and "x the bound)" in text.split("attention per")[1]


def test_the_compute_bound_prices_only_q8_0_at_the_8_bit_mix():
    """dot_bits: Q8_0's bytes run the 8-bit dot's mix; the 5- and 6-bit values in byte tiles (Q5_K, Q6_K)
    sum in 16 bits as the nibble kinds do, so the 4-bit mix's peak prices them (a bound, not above the
    kernels' own work); the floor's walk reads Q8_0's bytes as 8-bit values and theirs as 6-bit ones, whose
    dots it sums in 16 bits as their kernels do (weight_bits)."""
    from specplug import bench_runtime
    from specplug.testing import random_k_quant

    rng = np.random.default_rng(0)
    q8 = native.QuantLinear.from_float(torch.randn(16, 256))
    q4 = native.QuantLinear.from_blocks(random_k_quant(16, 256, "Q4_K", rng), "Q4_K", (16, 256))
    kinds = {"Q8_0": q8, "Q4_K": q4} | {k: native.QuantLinear.from_blocks(random_k_quant(16, 256, k, rng), k, (16, 256))
                                        for k in ("Q5_K", "Q6_K")}
    assert {k: bench_runtime.dot_bits(lin.qs, lin.d) for k, lin in kinds.items()} == {
        "Q8_0": 8, "Q4_K": 4, "Q5_K": 4, "Q6_K": 4}
    assert {k: bench_runtime.weight_bits(lin.qs, lin.d) for k, lin in kinds.items()} == {
        "Q8_0": 8, "Q4_K": 4, "Q5_K": 6, "Q6_K": 6}
    assert [bits for _, _, bits in bench_runtime.floor_parts(kinds.values())] == [8, 4, 6, 6]


def test_the_prefill_ceiling_prices_every_multiply_add_at_its_isa_peak(qtiny, monkeypatch):
    """bench-runtime's prefill ceiling: a prompt's linear multiply-adds (every row; the head's on the last
    row only) at the dot's peak for their weights' bits, its causal attention's at the float peak."""
    from specplug import bench_runtime

    m = qtiny.model
    peaks = {"isa": "x", "dot_instruction": "d", "dot_instruction_8bit": "d8", "fma_instruction": "f",
             "peak_gmac_s_isa": 1.0, "peak_gmac_s_isa_8bit": 1.0, "peak_gmac_s_fma": 1.0}
    monkeypatch.setattr(bench_runtime, "isa_peaks", lambda ext: dict(peaks))
    cfg, n = m.config, 64
    layer_macs = sum(lin.qs.shape[1] * 32 * lin.out_features for layer in m.layers for lin in layer.linears())
    head_macs = m.head.qs.shape[1] * 32 * m.head.out_features
    attn = 2 * cfg.n_head * cfg.head_dim * cfg.n_layer * n * (n + 1) // 2  # row p sees p + 1 keys
    c = bench_runtime.prefill_ceiling(m, n)
    assert c["linear_gmacs"] == pytest.approx((n * layer_macs + head_macs) / 1e9, abs=1e-6)
    assert c["attn_gmacs"] == pytest.approx(attn / 1e9, abs=1e-6)
    assert c["tok_s"] == pytest.approx(n / ((n * layer_macs + head_macs + attn) / 1e9), rel=1e-3)
    # the 8-bit weights' multiply-adds (this model's head) at their own peak: twice as fast, less time
    eight = (head_macs if m.head.qs.shape[2] == 256 else 0) + n * sum(
        lin.qs.shape[1] * 32 * lin.out_features
        for layer in m.layers for lin in layer.linears() if lin.qs.shape[2] == 256)
    assert c["linear_gmacs_8bit"] == pytest.approx(eight / 1e9, abs=1e-6)
    peaks["peak_gmac_s_isa_8bit"] = 2.0
    faster = bench_runtime.prefill_ceiling(m, n)
    assert n / faster["tok_s"] == pytest.approx(n / c["tok_s"] - eight / 2 / 1e9, rel=1e-3)
    assert eight > 0


def test_headroom_puts_the_kernel_parts_at_their_least_and_keeps_the_rest():
    from specplug import bench_runtime

    lim = {"stream_read_gb_s": 20.0, "peak_gmac_s_isa": 100.0}
    row = {"total_ms": 10.0, "linear_ms": 6.0, "attention_ms": 2.0, "weight_mb": 100.0, "linear_gmacs": 0.2,
           "kv_mb": 10.0}
    assert bench_runtime.linear_bound_ms(row, lim) == pytest.approx(5.0)  # 100 MB at 20 GB/s > 0.2 G MAC at 100 G/s
    # linears at their bound (5.0), attention at 10 MB read once (0.5), the other 2 ms as measured
    assert bench_runtime.least_forward_ms(row, lim) == pytest.approx(7.5)
    # a measured floor below the bound counts instead
    assert bench_runtime.least_forward_ms({**row, "floor_ms": 4.0}, lim) == pytest.approx(6.5)
    # multiply-adds on 8-bit weights at the 8-bit mix's peak, the rest at the 4-bit one's: 0.1 G at 100 G/s
    # and 0.1 G at 20 G/s, 6 ms, above the weights' 5 ms; a record from before the 8-bit peak: all at 100
    mixed = {**row, "linear_gmacs": 0.2, "linear_gmacs_8bit": 0.1}
    assert bench_runtime.linear_bound_ms(mixed, {**lim, "peak_gmac_s_isa_8bit": 20.0}) == pytest.approx(6.0)
    assert bench_runtime.linear_compute_ms(mixed, lim) == pytest.approx(2.0)
    # many rows: the multiply-adds bound the linears
    assert bench_runtime.linear_bound_ms({**row, "linear_gmacs": 0.8}, lim) == pytest.approx(8.0)
    # attention: its multiply-adds at the float multiply-add's peak when they take longer than the read
    row["attn_gmacs"] = 0.05
    assert bench_runtime.attention_bound_ms(row, lim) == pytest.approx(0.5)  # no float peak measured: the read
    fma = {**lim, "peak_gmac_s_fma": 50.0}
    assert bench_runtime.attention_bound_ms(row, fma) == pytest.approx(1.0)  # 0.05 G MAC at 50 G/s > 0.5 ms read
    assert bench_runtime.least_forward_ms(row, fma) == pytest.approx(8.0)
    assert bench_runtime.attention_bound_ms({**row, "attn_gmacs": 0.005}, fma) == pytest.approx(0.5)


def test_the_stack_refuses_mismatched_caches_and_taps(qtiny):
    m = qtiny.model
    stack, ropes = m._layer_stack()
    c = m.new_cache(1, 16)
    step_args = (torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), c.valid)
    cos, sin = m.rope.cos_sin(16)
    x = torch.zeros(1, m.config.n_embd)
    with pytest.raises(RuntimeError, match="one tensor per layer"):
        stack.forward(x, [c.k[0]], [c.v[0], c.v[1]], *step_args, [cos], [sin], None, [])
    with pytest.raises(RuntimeError, match="ascending"):
        stack.forward(x, [c.k], [c.v], *step_args, [cos], [sin], None, [2, 1])


@pytest.mark.parametrize("ttype", ["F32", "F16", "Q8_0", "Q4_1"])
def test_token_embeddings_gather_equals_the_dequantized_table(tmp_path, ttype):
    from specplug.runtime import TokenEmbeddings

    path = write_tiny_gguf(tmp_path / "e.gguf", tensor_type=ttype, seed=3)
    m = load_target(str(path), device="cpu", quant="none").model
    assert isinstance(m.embed, TokenEmbeddings)
    full = torch.from_numpy(GGUFFile(path).tensor("token_embd.weight"))
    vocab = full.shape[0]
    ids = torch.tensor([[3, 7, 7], [0, vocab - 1, 100]])
    assert torch.equal(m.embed[ids], full[ids]) and m.embed[ids].shape == (2, 3, full.shape[1])
    assert torch.equal(m.embed[5], full[5]) and torch.equal(m.embed[[1, 2]], full[[1, 2]])
    assert torch.equal(m.embed.dense(), full) and m.embed.shape == full.shape and len(m.embed) == vocab
    with pytest.raises(IndexError, match="out of range"):
        m.embed[torch.tensor([vocab])]


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q4_0", "Q8_0"])
def test_embedding_rows_gathered_natively_equal_the_gguf_dequantizer(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from specplug.runtime.model import EMBED_TYPES, TokenEmbeddings

    w = torch.randn(50, 64, generator=torch.Generator().manual_seed(3)).numpy()
    raw = quantize(w.astype(np.float32), GGMLQuantizationType[qtype])
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(50, -1)
    table = TokenEmbeddings(raw, qtype, (50, 64), torch.device("cpu"), torch.float32)
    ids = [7, 0, 49, 7, 23]
    got = native.kernels().embed_rows(torch.from_numpy(raw), EMBED_TYPES[qtype], torch.tensor(ids), 64)
    assert torch.equal(got, table[ids])  # bit for bit: the same single float32 product per value
    # a table that gathers with the kernels (as a model on them does) gives the same rows, any shape of ids
    fast = TokenEmbeddings(raw, qtype, (50, 64), torch.device("cpu"), torch.float32, kernels=native.kernels())
    for asked in (ids, [-1, -50, 3], torch.tensor([[1, 2], [49, 0]]), 5):
        assert torch.equal(fast[asked], table[asked]), asked
    with pytest.raises(IndexError, match="out of range"):
        fast[[50]]
    with pytest.raises(RuntimeError, match="outside the embedding table"):
        native.kernels().embed_rows(torch.from_numpy(raw), EMBED_TYPES[qtype], torch.tensor([50]), 64)


def test_a_forward_s_outputs_come_from_the_pool_and_live_ones_are_never_handed_out(qtiny):
    """block_cache.h, OutputPool: a thread keeps its small outputs and hands one out again only when
    nothing else holds it. A layer's intermediates never leave C++, so the first one-row forward fills
    the pool and each later one takes them from it again, adding only the tensors it returns to
    Python (held there, or by the object Python kept of them, they are never handed out again: their
    values stay)."""
    m = qtiny.model
    k = m.layers[0]._k
    k.release_pooled_outputs()
    cache = m.new_cache(1, 64)
    first = m.forward([5], [0], [0], cache).logits
    filled = k.pooled_outputs()
    assert filled >= 3 * len(m.layers)  # at least each layer's quantized activations
    kept, held = [first], [first.clone()]
    for i in range(1, 4):
        before = k.pooled_outputs()
        out = m.forward([5 + i], [i], [0], cache).logits
        assert k.pooled_outputs() - before <= 2  # what went to Python, not the layers' intermediates
        kept.append(out)
        held.append(out.clone())
    assert all(torch.equal(a, b) for a, b in zip(kept, held))
    assert len({t.data_ptr() for t in kept}) == len(kept)
    # a larger output (a prefill's) is never kept
    n = k.pooled_outputs()
    big = k.quantize_rows(torch.zeros(1, 1 << 19), None, 1e-6)  # 512 KB of int8 values: past MAX_BYTES
    assert k.pooled_outputs() == n + 2  # its two small scale tensors only
    del big
    assert k.release_pooled_outputs() == n + 2 and k.pooled_outputs() == 0


def test_kernel_outputs_reuse_freed_blocks_and_keep_their_values():
    """block_cache.h: a freed output's block serves the next output of its size; a live output is
    never handed out again; blocks past the cache's limit go back to the C library."""
    k = native.kernels()
    k.release_kept_blocks()  # what earlier tests left (a full cache keeps nothing more)
    assert k.kept_blocks() == (0, 0)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 96, generator=g)
    q, d, s = k.quantize_rows(x, None, 1e-6)
    held = [t.clone() for t in (q, d, s)]
    ptr = q.data_ptr()
    del q, d, s
    k.release_pooled_outputs()  # (the pool keeps a thread's last outputs whole: OutputPool, above)
    again = k.quantize_rows(x, None, 1e-6)
    assert again[0].data_ptr() == ptr  # the freed block of that size, reused
    # live outputs are never reused: 50 more calls of the same size leave these values intact
    others = [k.quantize_rows(torch.randn(3, 96, generator=g), None, 1e-6) for _ in range(50)]
    assert len({o[0].data_ptr() for o in others} | {again[0].data_ptr()}) == 51
    assert all(torch.equal(a, b) for a, b in zip(again, held))
    del others
    k.release_pooled_outputs()  # the pool's last outputs (OutputPool) let go: their blocks freed too
    kept, blocks = k.kept_blocks()
    assert blocks >= 150 and kept < 64 << 20
    # an output larger than a kept block may be (16 MB) is freed, not kept
    big = k.quantize_rows(torch.zeros(1, 17 << 20), None, 1e-6)  # its 17 MB of int8 values
    del big
    assert k.kept_blocks()[0] - kept < 17 << 20
    held_bytes = k.kept_blocks()[0]
    assert k.release_kept_blocks() == held_bytes and k.kept_blocks() == (0, 0)
