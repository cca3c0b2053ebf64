"""The gguf kernels' instruction-set paths (AVX2, AVX-512 VNNI): chosen from the CPU's features or
SPECPLUG_ISA, and bit-identical to each other, kernel by kernel and for a whole model.

Integer dot products are exact and the float operations are the same on every path, in the same
order, so a path that computes anything else is a bug. The comparisons need a CPU with more than
one path; on an AVX2-only CPU they skip and say so (the AVX2 path is covered by test_native.py).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specplug.errors import ModelError
from specplug.runtime import load_target, native
from specplug.testing import RandomDrafts, assert_greedy_equal, greedy_outputs, isa_env, write_tiny_gguf

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"gguf kernels unavailable: {native.unavailable_reason()}")

OTHER = [isa for isa in native.available_isas() if isa != "avx2"]
other_paths = pytest.mark.skipif(not OTHER, reason=f"this CPU ({native.cpu_model()}) runs only the AVX2 kernels: "
                                                   "no other path to compare with AVX2")
AVX2_ONLY = frozenset(native.ISA_CPU_FLAGS["avx2"])
AVX512 = frozenset(native.ISA_CPU_FLAGS["avx512"])


# ---- choosing a path ---------------------------------------------------------------------------

@pytest.fixture
def cpu(monkeypatch):
    """Pretend the CPU has the given feature flags."""
    def set_flags(flags):
        monkeypatch.setattr(native, "_cpuinfo", lambda: ("Test CPU", frozenset(flags)))
    return set_flags


def test_the_best_path_the_cpu_has_is_the_default(cpu, monkeypatch):
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    cpu(AVX512)
    assert native.available_isas() == ["avx512", "avx2"] and native.chosen_isa() == "avx512"
    cpu(AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl"})  # AVX-512 without VNNI: AVX2
    assert native.available_isas() == ["avx2"] and native.chosen_isa() == "avx2"


def test_specplug_isa_forces_a_path_and_a_wrong_one_is_one_clear_error(cpu, monkeypatch):
    cpu(AVX512)
    monkeypatch.setenv(native.ISA_ENV, "AVX2")
    assert native.chosen_isa() == "avx2"
    monkeypatch.setenv(native.ISA_ENV, "sse4")
    with pytest.raises(ModelError, match="SPECPLUG_ISA=sse4 is not a kernel path; choose one of avx2, avx512"):
        native.chosen_isa()
    assert "not a kernel path" in native.unavailable_reason()
    cpu(AVX2_ONLY)
    monkeypatch.setenv(native.ISA_ENV, "avx512")
    with pytest.raises(ModelError, match="this CPU lacks avx512f, avx512bw, avx512vl, avx512_vnni; it runs avx2"):
        native.check_isa_env()


def test_a_wrong_specplug_isa_stops_quant_auto_instead_of_falling_back(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "q.gguf", tensor_type="Q4_1", seed=1)
    monkeypatch.setenv(native.ISA_ENV, "avx1024")
    with pytest.raises(ModelError, match="SPECPLUG_ISA=avx1024"):
        load_target(str(path), device="cpu", quant="auto")


def test_no_avx2_means_no_gguf_kernels(cpu, monkeypatch):
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    cpu({"sse2"})
    assert native.available_isas() == []
    assert "need an x86 CPU with AVX2" in native.unavailable_reason()


def test_describe_names_the_cpu_and_the_path(monkeypatch):
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    monkeypatch.delenv(native.PAIR_ROWS_ENV, raising=False)
    d = native.describe()
    assert d["cpu"] == native.cpu_model() and d["isa"] == native.available_isas()[0]
    assert d["isa_flags"] == list(native.ISA_CFLAGS[d["isa"]])
    assert native.kernels(d["isa"]).isa() == d["isa"]  # the build really is that path
    if d["isa"] == "avx512":  # the tile-pair threshold it runs with
        ext = native.kernels("avx512")
        assert d["pair_rows"] == list(native.pair_rows()) == [ext.pair_rows(), ext.byte_pair_rows()]
    else:
        assert d["pair_rows"] is None
    assert d["prefetch_rows"] == native.kernels(d["isa"]).prefetch_rows()  # what the loaded build runs with


# ---- from how many rows the AVX-512 linears run on tile pairs: a tuning per CPU -----------------

def test_the_pair_threshold_follows_the_cpu_and_specplug_pair_rows(monkeypatch):
    monkeypatch.delenv(native.PAIR_ROWS_ENV, raising=False)
    # Zen 4: the 8-bit kinds on 256 bits at 1-2 rows
    monkeypatch.setattr(native, "cpu_id", lambda: ("AuthenticAMD", 25))
    assert native.pair_rows() == (1, 3)
    monkeypatch.setattr(native, "cpu_id", lambda: ("GenuineIntel", 6))  # the others: pairs from one row
    assert native.pair_rows() == native.PAIR_ROWS_DEFAULT == (1, 1)
    monkeypatch.setenv(native.PAIR_ROWS_ENV, "3")  # both
    assert native.pair_rows() == (3, 3)
    for bad in ("0", "-2", "many"):
        monkeypatch.setenv(native.PAIR_ROWS_ENV, bad)
        with pytest.raises(ModelError, match=f"SPECPLUG_PAIR_ROWS='{bad}': give a whole number of rows, 1 or more"):
            native.pair_rows()


# ---- up to how many rows the one-tile path prefetches weight tiles: a tuning per CPU -------------

def test_the_tile_prefetch_follows_the_cpu_and_specplug_prefetch_rows(monkeypatch):
    monkeypatch.delenv(native.PREFETCH_ROWS_ENV, raising=False)
    monkeypatch.setattr(native, "cpu_id", lambda: ("AuthenticAMD", 23))  # Zen 1: calls of up to 2 rows
    assert native.prefetch_rows("avx2") == native.prefetch_rows("avx512") == 2
    monkeypatch.setattr(native, "cpu_id", lambda: ("GenuineIntel", 6))  # the others: each build's own
    assert (native.prefetch_rows("avx2"), native.prefetch_rows("avx512"), native.prefetch_rows()) == (1, 0, None)
    monkeypatch.setenv(native.PREFETCH_ROWS_ENV, "2")
    assert native.prefetch_rows("avx512") == 2
    for bad in ("-1", "some", "1.5"):
        monkeypatch.setenv(native.PREFETCH_ROWS_ENV, bad)
        with pytest.raises(ModelError, match=f"SPECPLUG_PREFETCH_ROWS='{bad}': give a whole number of rows, 0 or more"):
            native.prefetch_rows("avx2")


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
def test_the_tile_prefetch_changes_no_bit(kind):
    """Whether a call prefetches its weight tiles is a tuning (native.prefetch_rows): the same bits
    with it at every row count, at one row only, and never."""
    ext = native.kernels()
    before = ext.prefetch_rows()
    lin = _linear_of(kind, 44, 512, 3)
    lin.k = ext
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4)) * 2
    try:
        outs = []
        for rows in (1000, 1, 0):
            ext.set_prefetch_rows(rows)
            outs.append(torch.cat([lin(x[:1]), lin(x)]))
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
        with pytest.raises(RuntimeError, match="rows must be >= 0"):
            ext.set_prefetch_rows(-1)
    finally:
        ext.set_prefetch_rows(before)


def test_the_signs_on_the_weights_change_no_bit_and_skip_linears_with_a_weight_of_minus_128(tmp_path):
    """On AVX2 a LayerStack's one-row Q8_0 calls on up to `sign_threads` threads compute |x| sign(w, x)
    instead of |w| sign(x, w): the same integer sums for every weight but -128, whose sign cannot flip
    in 8 bits. So the stack lets only linears without a -128 take it, and the logits are the same bits
    with it on or off."""
    ext = native.kernels("avx2")
    before = ext.sign_threads()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 192, generator=g) * 3
    x[0, 0], x[0, 1] = 40.0, -40.0  # quantized to 127 and -127
    xa = ext.quantize_rows(x, None, 0.0)
    clean = native.QuantLinear.from_float(torch.randn(100, 192, generator=g))
    every = _q8_0_linear(100, 192, 3)  # every byte value, -128 included
    path = write_tiny_gguf(tmp_path / "m.gguf", tensor_type="Q8_0", n_layer=2, seed=5)
    with isa_env("avx2"):
        target = load_target(str(path), device="cpu", quant="gguf", threads=1)
    m = target.model
    o = m.layers[1].o
    o.qs.view(-1)[::61] = 0x80  # layer 1's o now holds weights of -128
    ids = list(range(30, 50))
    try:
        ext.set_sign_threads(1000)  # on whatever the thread count
        # the kernel alone: the same bits without a -128; with one, other sums (why the stack checks)
        for lin, same in ((clean, True), (every, False)):
            usual = ext.matmul(xa, lin.qs, lin.d, None, None, None, lin.out_features)
            signs = ext.matmul(xa, lin.qs, lin.d, None, None, None, lin.out_features, signs=True)
            assert torch.equal(usual, signs) == same
        outs = []
        for threads in (1000, 0):  # the signs on the weights in every one-row call, then never
            ext.set_sign_threads(threads)
            cache = m.new_cache(1, 64)
            m.forward(ids[:-4], list(range(16)), [0] * 16, cache, logits_rows=None)
            outs.append(torch.cat([m.forward([t], [16 + i], [0], cache).logits for i, t in enumerate(ids[-4:])]))
        assert torch.equal(outs[0], outs[1])
        stack = m._layer_stack()[0]
        assert stack.signs() == [True] * 5 + [False] + [True] * 3  # layers' qkv, o, gate/up, down; the head
        with pytest.raises(RuntimeError, match="threads must be >= 0"):
            ext.set_sign_threads(-1)
    finally:
        ext.set_sign_threads(before)
    assert before == 1  # the default: one thread, where the dot rather than the stream sets the pace


def _linear_of(kind: str, n: int, k: int, seed: int):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from specplug.testing import random_k_quant

    if kind == "Q4_1":
        return _q4_1_linear(n, k, seed)
    if kind == "Q4_0":
        return _q4_0_linear(n, k, seed)
    if kind == "Q8_0":
        return _q8_0_linear(n, k, seed)
    rng = np.random.default_rng(seed)
    raw = (quantize((rng.standard_normal((n, k)) * 3).astype(np.float32), GGMLQuantizationType.Q5_0)
           if kind == "Q5_0" else random_k_quant(n, k, kind, rng))
    return native.QuantLinear.from_blocks(raw, kind, (n, k))


@other_paths
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0", "Q5_0", "Q4_K", "Q5_K", "Q6_K"])
def test_tile_pairs_and_single_tiles_give_the_same_bits_at_any_threshold(kind):
    """Which calls run on tile pairs is a tuning (native.pair_rows): a row's result is the same whether
    its call ran on pairs or on single tiles, so it never depends on how many rows share the call."""
    ext = native.kernels("avx512")
    before = ext.pair_rows(), ext.byte_pair_rows()
    lin = _linear_of(kind, 44, 512, 7)  # 6 tiles: a partial last one, in a pair with the one before
    lin.k = ext
    g = torch.Generator().manual_seed(8)
    x = torch.randn(9, 512, generator=g) * 2
    res = torch.randn(9, 44, generator=g)
    try:
        outs = {}
        for rows in (1, 5, 1000):  # pairs at every row count, from 5 rows, never
            ext.set_pair_rows(rows)  # both thresholds
            assert ext.pair_rows() == ext.byte_pair_rows() == rows
            outs[rows] = [lin(x[:m], res[:m]) for m in range(1, 10)]
            for m in range(1, 10):  # each row alone gives its bits in every call
                assert torch.equal(outs[rows][m - 1], outs[rows][-1][:m]), (kind, rows, m)
        assert all(torch.equal(a, b) for a, b in zip(outs[1], outs[1000])), kind
        assert all(torch.equal(a, b) for a, b in zip(outs[5], outs[1000])), kind
    finally:
        ext.set_pair_rows(*before)
    with pytest.raises(RuntimeError, match="rows must be >= 1"):
        ext.set_pair_rows(0)
    with pytest.raises(RuntimeError, match="rows must be >= 1"):
        ext.set_pair_rows(1, -1)
    assert (ext.pair_rows(), ext.byte_pair_rows()) == before


# ---- every path computes the same bits ---------------------------------------------------------

def _q4_1_linear(n: int, k: int, seed: int):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 32, 20), dtype=np.uint8)
    raw[:, :, 0:2] = np.frombuffer(np.float16(0.013).tobytes(), np.uint8)
    raw[:, :, 2:4] = np.frombuffer(np.float16(-0.07).tobytes(), np.uint8)
    return native.QuantLinear.from_blocks(raw.reshape(n, -1), "Q4_1", (n, k))


def _q4_0_linear(n: int, k: int, seed: int):
    """Every nibble value in random blocks, as the kernels' own kind (no offsets: the dot starts at -8 sum(x))."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 32, 18), dtype=np.uint8)
    raw[:, :, 0:2] = np.frombuffer(np.float16(0.017).tobytes(), np.uint8)
    lin = native.QuantLinear.from_blocks(raw.reshape(n, -1), "Q4_0", (n, k))
    assert lin.kind == "q4_0" and lin.m is None
    return lin


def _q8_0_linear(n: int, k: int, seed: int):
    """Every byte value as a weight, -128 included (the VNNI paths offset signed weights by 128)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 32, 34), dtype=np.uint8)
    raw[:, :, 0:2] = np.frombuffer(np.float16(0.011).tobytes(), np.uint8)
    raw[:, 0, 2:] = np.arange(0, 256, 8, dtype=np.uint8)[None]  # 0x80 = -128 among them
    return native.QuantLinear.from_blocks(raw.reshape(n, -1), "Q8_0", (n, k))


@other_paths
@pytest.mark.parametrize("isa", OTHER)
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0", "Q8_0 every byte"])
def test_linears_are_bit_identical_to_avx2(isa, kind):
    g = torch.Generator().manual_seed(3)
    # 100 outputs: 13 tiles, the partial last one alone; 92: 12, the partial last one in a pair with
    # the one before it (AVX-512 builds compute two tiles at a time on 512-bit registers)
    for n, rows in [(100, r) for r in (1, 2, 3, 4, 5, 9, 16)] + [(92, 2), (92, 7)]:
        k = 192
        lin = (_q4_1_linear(n, k, 3) if kind == "Q4_1" else _q4_0_linear(n, k, 3) if kind == "Q4_0"
               else _q8_0_linear(n, k, 3) if kind == "Q8_0 every byte"
               else native.QuantLinear.from_float(torch.randn(n, k, generator=g)))
        lin.bias = torch.nn.functional.pad(torch.randn(n, generator=g), (0, (-n) % 8))
        x = torch.randn(rows, k, generator=g) * 3
        x[:, 0] = 40.0  # the row's largest: its quantized value 127 ...
        x[0, 1] = -40.0  # ... and -127
        res = torch.randn(rows, n, generator=g)
        outs = []
        for path in ("avx2", isa):
            lin.k = native.kernels(path)
            outs.append(lin(x, res))
        assert torch.equal(outs[0], outs[1]), (n, rows, (outs[0] - outs[1]).abs().max())


def _attention_case(dtype, H, Hkv, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx, nseq = 200, 3
    kc = torch.randn(nseq, Hkv, ctx, D, generator=g).to(dtype)
    vc = torch.randn(nseq, Hkv, ctx, D, generator=g).to(dtype)
    valid = torch.rand(nseq, ctx, generator=g) > 0.15  # holes, as rollbacks leave them
    # runs of rows of one sequence (drafted rows), limits in any order, and other sequences' rows
    seq = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2, 1], dtype=torch.int32)
    pos = torch.tensor([64, 65, 66, 67, 1, 130, 128, 199, 0], dtype=torch.int32)
    valid[seq.long(), pos.long()] = True
    q = torch.randn(len(seq), (H + 2 * Hkv) * D, generator=g)
    return q, kc, vc, seq, pos, valid


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("H,Hkv,D", [(9, 3, 64), (4, 4, 32), (4, 2, 128)])
def test_attention_rows_sharing_a_call_equal_each_row_alone(dtype, H, Hkv, D):
    """Rows of one sequence share their K/V reads in one call; each row's result is still the one
    it gets alone (batch invariance, on the path this CPU uses by default; the AVX2 build widens a
    float16 piece once for the 4 rows of sequence 0, each row alone widens its own values)."""
    q, kc, vc, seq, pos, valid = _attention_case(dtype, H, Hkv, D)
    k = native.kernels()
    together = k.attention(q, kc, vc, seq, pos, valid, H, D ** -0.5, None)
    for r in range(len(seq)):
        alone = k.attention(q[r:r + 1], kc, vc, seq[r:r + 1], pos[r:r + 1], valid, H, D ** -0.5, None)
        assert torch.equal(together[r:r + 1], alone), r


def _reference_attention(q, kc, vc, seq, pos, valid, H, scale):
    """float64 attention of each row over its sequence's valid positions <= its own."""
    Hkv, D = kc.shape[1], kc.shape[3]
    out = torch.empty(len(seq), H * D, dtype=torch.float64)
    for r, (s, p) in enumerate(zip(seq.tolist(), pos.tolist())):
        keep = valid[s, :p + 1].nonzero().flatten()
        for h in range(H):
            k, v = kc[s, h // (H // Hkv), keep].double(), vc[s, h // (H // Hkv), keep].double()
            w = torch.softmax(k @ q[r, h * D:(h + 1) * D].double() * scale, 0)
            out[r, h * D:(h + 1) * D] = w @ v
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_attention_over_many_spans_is_right_and_the_same_on_any_thread_count(dtype):
    """A row's keys are summed in spans of 128 positions that are then combined; how a call is cut
    into tasks (spans, query heads per task) follows the thread count, the result must not."""
    g = torch.Generator().manual_seed(5)
    H, Hkv, D, ctx = 9, 3, 64, 800
    kc = torch.randn(2, Hkv, ctx, D, generator=g).to(dtype)
    vc = torch.randn(2, Hkv, ctx, D, generator=g).to(dtype)
    valid = torch.rand(2, ctx, generator=g) > 0.1
    # one row alone, a verification's rows across a span boundary, a long row of another sequence
    calls = [([0], [300]), ([0, 0, 0, 0, 0], [254, 255, 256, 257, 258]), ([1, 0, 1], [799, 127, 128])]
    k = native.kernels()
    before = torch.get_num_threads()
    try:
        for seqs, poss in calls:
            seq, pos = torch.tensor(seqs, dtype=torch.int32), torch.tensor(poss, dtype=torch.int32)
            valid[seq.long(), pos.long()] = True
            q = torch.randn(len(seqs), (H + 2 * Hkv) * D, generator=g)
            outs = []
            for n in (1, 2, 3, 5):
                torch.set_num_threads(n)
                outs.append(k.attention(q, kc, vc, seq, pos, valid, H, 0.125, None))
            for o in outs[1:]:
                assert torch.equal(o, outs[0]), (poss, (o - outs[0]).abs().max())
            ref = _reference_attention(q, kc, vc, seq, pos, valid, H, 0.125)
            assert torch.allclose(outs[0].double(), ref, atol=2e-5, rtol=1e-4), (outs[0].double() - ref).abs().max()
    finally:
        torch.set_num_threads(before)


@other_paths
@pytest.mark.parametrize("isa", OTHER)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_attention_is_bit_identical_to_avx2(isa, dtype):
    q, kc, vc, seq, pos, valid = _attention_case(dtype, 9, 3, 64, seed=1)
    limit = pos.clone()
    limit[1:4] = 67  # a block drafter's rows see their whole block
    a, b = (native.kernels(p).attention(q, kc, vc, seq, pos, valid, 9, 0.125, limit) for p in ("avx2", isa))
    assert torch.equal(a, b)


@other_paths
@pytest.mark.parametrize("isa", OTHER)
def test_attention_is_bit_identical_to_avx2_at_every_span_length(isa):
    """The AVX-512 softmax takes 16 scores a step, then 8, then the padded last group, where AVX2
    takes 8 at a time: rows that see 1..48 positions of a dense sequence cover every mix of them."""
    g = torch.Generator().manual_seed(2)
    H, Hkv, D, n = 9, 3, 64, 48
    kc = torch.randn(1, Hkv, n, D, generator=g).half()
    vc = torch.randn(1, Hkv, n, D, generator=g).half()
    valid = torch.ones(1, n, dtype=torch.bool)
    seq, pos = torch.zeros(n, dtype=torch.int32), torch.arange(n, dtype=torch.int32)
    q = torch.randn(n, (H + 2 * Hkv) * D, generator=g) * 4  # large scores: exponents far below the max
    a, b = (native.kernels(p).attention(q, kc, vc, seq, pos, valid, H, 0.125, None) for p in ("avx2", isa))
    assert torch.equal(a, b), (a - b).abs().max()


@other_paths
@pytest.mark.parametrize("isa", OTHER)
@pytest.mark.parametrize("ttype", ["Q4_1", "Q8_0"])
def test_a_model_gives_bit_identical_logits_and_greedy_text_on_every_path(tmp_path, isa, ttype):
    path = write_tiny_gguf(tmp_path / "m.gguf", tensor_type=ttype, n_layer=3, seed=7)
    targets = {}
    for p in ("avx2", isa):
        with isa_env(p):
            targets[p] = load_target(str(path), device="cpu", quant="gguf")
    ids = list(range(20, 60))
    logits = [t.model.forward(ids, list(range(len(ids))), [0] * len(ids), t.model.new_cache(1, 64)).logits
              for t in targets.values()]
    assert torch.equal(logits[0], logits[1])
    prompts = [list(range(40, 60)), [3, 1, 4, 1, 5, 9, 2, 6]]
    plain = [greedy_outputs(t, [], prompts, max_tokens=24)[0] for t in targets.values()]
    assert plain[0] == plain[1]
    # and speculative == plain on the other path too
    assert_greedy_equal(targets[isa], [RandomDrafts(targets[isa].model.config.vocab_size, seed=2)], prompts,
                        max_tokens=24)


def test_results_say_where_they_ran():
    from specplug import machine

    info = machine.describe("cpu")
    assert info["cpu"] == native.cpu_model() and info["kernel_isa"] == native.chosen_isa()
    assert info["threads"] == torch.get_num_threads() and info["torch"] == torch.__version__
    line = machine.line(info)
    assert line.startswith(f"machine: {info['cpu']}") and f"kernels {info['kernel_isa']}" in line


@pytest.mark.parametrize("isa", native.available_isas())
def test_the_probes_time_the_build_s_own_instruction_and_refuse_what_they_cannot_walk(isa):
    """`dot_peak`, `fma_peak` and `stream_dots` (bench-runtime --profile's ISA ceilings and floor) run on each
    path the CPU has, with that path's instruction as its 4-bit kernels use it (AVX2: products summed in
    16 bits, widened once a block); bad arguments are one clear error each."""
    k = native.kernels(isa)
    assert k.dot_instruction() == ("vpdpbusd zmm" if isa == "avx512" else
                                   "vpmaddubsw+vpaddw ymm, vpmaddwd+vpaddd once in 8")
    assert k.dot_peak() > 0
    # the 8-bit kernels' mix: AVX2 widens every dot (two multiplies per 32); VNNI the same instruction
    assert k.dot_instruction(8) == ("vpdpbusd zmm" if isa == "avx512" else "vpmaddubsw+vpmaddwd+vpaddd ymm")
    assert k.dot_peak(8) > 0
    with pytest.raises(RuntimeError, match="dot_peak: bits must be 4 or 8, not 5"):
        k.dot_peak(5)
    assert k.fma_instruction() == ("vfmadd zmm" if isa == "avx512" else "vfmadd ymm")
    assert k.fma_peak() > 0
    w = torch.randint(0, 256, (3 * 16384 + 100,), dtype=torch.uint8)  # a partial last chunk and load
    scales = torch.zeros(777, dtype=torch.float16)
    for rows in (0, 1, 2, 4, 8, 16):
        for bits in (4, 6, 8):
            assert k.stream_dots(w, [scales], rows, bits) > 0
    assert k.stream_dots(w, [], 4, 4, repeat=5) > 0 and k.stream_dots(w, [scales], 8, 4, ahead=4096) > 0
    with pytest.raises(RuntimeError, match="ahead must be 0"):
        k.stream_dots(w, [], 1, 4, ahead=-1)
    with pytest.raises(RuntimeError, match="rows must be 0, 1, 2, 4, 8 or 16, not 3"):
        k.stream_dots(w, [], 3, 4)
    with pytest.raises(RuntimeError, match="bits must be 4, 6 or 8, not 5"):
        k.stream_dots(w, [], 1, 5)
    with pytest.raises(RuntimeError, match="contiguous CPU tensor"):
        k.stream_dots(w[::2], [], 1, 4)


@pytest.mark.parametrize("isa", list(native.ISA_CFLAGS))
def test_a_path_this_cpu_cannot_run_still_compiles(isa):
    """Each kernel path this CPU lacks is still compiled, to the end of its semantic checks (-fsyntax-only:
    no code, nothing loaded), with its own flags and torch's: on an AVX2-only machine no other test
    builds the AVX-512 source, and a change can break it there unseen (a name only that path lacked, in
    an `if constexpr` branch outside a template, did). ~50 s a path."""
    import shutil
    import subprocess
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    if isa in native.available_isas():
        pytest.skip(f"this CPU runs the {isa} path: the other tests build and run it")
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler here (the kernels need one to build at all)")
    cmd = [cxx, "-fsyntax-only", "-std=c++20", "-w", *native._CFLAGS, *native.ISA_CFLAGS[isa],
           "-DTORCH_EXTENSION_NAME=specplug_syntax_check", "-DTORCH_API_INCLUDE_EXTENSION_H",
           *[f"-I{p}" for p in include_paths()], f"-I{sysconfig.get_paths()['include']}", str(native._SRC)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"the {isa} kernels do not compile:\n{r.stderr[-3000:]}"
