"""Runtime on tiny random GGUF models: cache semantics, batching, taps, formats, errors."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from specplug.errors import ContextFullError, ModelError
from specplug.runtime import GGUFFile, load_target
from specplug.testing import write_tiny_gguf


def run(model, cache, toks, pos, seq, **kw):
    return model.forward(toks, pos, seq, cache, **kw)


@pytest.fixture(scope="module")
def tiny(tiny_target):
    return tiny_target.model


def test_range_removal_then_redecode_equals_fresh_run(tiny):
    toks = list(range(10, 40))
    c = tiny.new_cache(1, 128)
    run(tiny, c, toks, list(range(30)), [0] * 30)
    c.seq_rm(0, 20)
    assert c.seq_len(0) == 20
    other = list(range(50, 60))
    a = run(tiny, c, other, list(range(20, 30)), [0] * 10).logits
    fresh = tiny.new_cache(1, 128)
    b = run(tiny, fresh, toks[:20] + other, list(range(30)), [0] * 30).logits[20:]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_hole_in_the_middle_is_skipped_by_attention(tiny, tmp_path):
    toks = list(range(10, 40))
    # one layer: cached K/V depend on their own token only, so a run that never had the
    # removed tokens must give the same result as attention skipping their cells
    one = load_target(str(write_tiny_gguf(tmp_path / "one.gguf", n_layer=1)), device="cpu", quant="none").model
    c = one.new_cache(1, 128)
    run(one, c, toks, list(range(30)), [0] * 30)
    c.seq_rm(0, 5, 10)
    assert c.seq_len(0) == 30 and not c.dense[0]
    a = run(one, c, [77], [30], [0]).logits
    keep = [p for p in range(30) if not 5 <= p < 10]
    b = run(one, one.new_cache(1, 128), [toks[p] for p in keep] + [77], keep + [30], [0] * 26).logits[-1:]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # any depth: filling the hole again restores the original result
    c = tiny.new_cache(1, 128)
    run(tiny, c, toks, list(range(30)), [0] * 30)
    c.seq_rm(0, 5, 10)
    run(tiny, c, toks[5:10], list(range(5, 10)), [0] * 5)
    full = tiny.new_cache(1, 128)
    d = run(tiny, full, toks + [77], list(range(31)), [0] * 31).logits[-1:]
    torch.testing.assert_close(run(tiny, c, [77], [30], [0]).logits, d, rtol=1e-4, atol=1e-4)


def test_batch_of_sequences_equals_each_alone(tiny):
    prompts = [list(range(10, 10 + n)) for n in (7, 13, 3)]
    batch = tiny.new_cache(3, 128)
    toks, pos, seq = [], [], []
    for s, p in enumerate(prompts):
        toks += p
        pos += range(len(p))
        seq += [s] * len(p)
    out = run(tiny, batch, toks, pos, seq, taps={0, 1, 2}).logits
    off = 0
    for s, p in enumerate(prompts):
        solo = tiny.new_cache(1, 128)
        ref = run(tiny, solo, p, list(range(len(p))), [0] * len(p)).logits
        torch.testing.assert_close(out[off:off + len(p)], ref, rtol=1e-4, atol=1e-4)
        off += len(p)
    # then one decode step for all three at different lengths, entries interleaved
    step = run(tiny, batch, [5, 6, 7], [len(prompts[s]) for s in (2, 0, 1)], [2, 0, 1]).logits
    for i, s in enumerate([2, 0, 1]):
        solo = tiny.new_cache(1, 128)
        p = prompts[s]
        ref = run(tiny, solo, p + [5 + i], list(range(len(p) + 1)), [0] * (len(p) + 1)).logits[-1]
        torch.testing.assert_close(step[i], ref, rtol=1e-4, atol=1e-4)


def test_seq_cp_shares_a_prefix(tiny):
    c = tiny.new_cache(2, 64)
    p = list(range(20, 32))
    run(tiny, c, p, list(range(12)), [0] * 12)
    c.seq_cp(0, 1)
    a = run(tiny, c, [9, 8], [12, 13], [1, 1]).logits
    b = run(tiny, c, [9, 8], [12, 13], [0, 0]).logits
    torch.testing.assert_close(a, b)


def test_logits_only_for_requested_rows_and_taps(tiny_target):
    m = tiny_target.model
    n_layer = m.config.n_layer
    c = m.new_cache(1, 64)
    toks = list(range(30, 40))
    out = run(m, c, toks, list(range(10)), [0] * 10, logits_rows=[9, 3], taps={0, n_layer})
    assert out.logits.shape == (2, m.config.vocab_size)
    full = run(m, m.new_cache(1, 64), toks, list(range(10)), [0] * 10).logits
    torch.testing.assert_close(out.logits, full[[9, 3]])
    torch.testing.assert_close(out.hidden[0], m.embed[torch.tensor(toks)])
    final = out.hidden[n_layer]
    torch.testing.assert_close(m.head.norm_linear(final, m.config.rms_eps), full, rtol=1e-4, atol=1e-4)
    none = run(m, m.new_cache(1, 64), toks, list(range(10)), [0] * 10, logits_rows=[])
    assert none.logits is None and none.hidden == {}


def test_context_overflow_is_a_clear_error(tiny):
    c = tiny.new_cache(1, 16)
    with pytest.raises(ContextFullError, match="context size 16"):
        run(tiny, c, list(range(17)), list(range(17)), [0] * 17)


@pytest.mark.parametrize("arch,head_dim", [("llama", None), ("qwen2", None), ("qwen3", 128)])
@pytest.mark.parametrize("ttype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_matches_transformers_reference(tmp_path, arch, head_dim, ttype):
    """Independent reference: HF transformers loads the same GGUF (dequantizing through gguf)."""
    transformers = pytest.importorskip("transformers")
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch=arch, tensor_type=ttype, head_dim=head_dim, seed=3)
    ours = load_target(str(path), device="cpu", quant="none").model
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    ids = list(range(12, 52))
    out = ours.forward(ids, list(range(len(ids))), [0] * len(ids), ours.new_cache(1, 64), taps={0, 1})
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(out.logits, ref.logits[0], rtol=1e-4, atol=3e-4)
    torch.testing.assert_close(out.hidden[1], ref.hidden_states[1][0], rtol=1e-4, atol=3e-4)


def test_unknown_and_corrupt_files(tmp_path, tiny_gguf):
    with pytest.raises(ModelError, match="not found"):
        GGUFFile(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"definitely not a gguf file" * 10)
    with pytest.raises(ModelError, match="junk.gguf: not a readable GGUF"):
        GGUFFile(junk)
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "truncated.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="truncated.gguf"):
        load_target(str(cut), device="cpu", quant="none")
    with pytest.raises(ModelError, match="neither a known model name"):
        load_target("no-such-model", device="cpu")


def test_missing_tensor_and_unsupported_arch(tmp_path):
    import gguf

    p = write_tiny_gguf(tmp_path / "missing.gguf", skip_tensors=["blk.1.ffn_down.weight"])
    with pytest.raises(ModelError, match="missing.gguf: tensor 'blk.1.ffn_down.weight' is missing"):
        load_target(str(p), device="cpu", quant="none")
    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match="architecture 'mamba' is not supported"):
        load_target(str(tmp_path / "mamba.gguf"), device="cpu")


def test_bad_device_dtype_quant(tiny_gguf):
    with pytest.raises(ModelError, match="dtype 'float8'"):
        load_target(str(tiny_gguf), device="cpu", dtype="float8")
    with pytest.raises(ModelError, match="quant 'int3'"):
        load_target(str(tiny_gguf), device="cpu", quant="int3")
    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match="no CUDA device"):
            load_target(str(tiny_gguf), device="cuda")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_run_close_to_float32(tiny_gguf, tiny_target, dtype):
    m = load_target(str(tiny_gguf), device="cpu", dtype=dtype, quant="none").model
    ids = list(range(20, 30))
    a = m.forward(ids, list(range(10)), [0] * 10, m.new_cache(1, 32)).logits
    b = tiny_target.model.forward(ids, list(range(10)), [0] * 10, tiny_target.model.new_cache(1, 32)).logits
    assert a.dtype == torch.float32
    # same top token on most rows: half precision, random weights
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.7


def test_int8_linear_rows_are_bit_identical_whatever_the_batch():
    from specplug.runtime.linear import Int8Linear, int8_available

    if not int8_available():
        pytest.skip("no fbgemm")
    torch.manual_seed(0)
    lin = Int8Linear(torch.randn(200, 96) * 0.1, torch.randn(200))
    x = torch.randn(12, 96) * torch.logspace(-2, 2, 12).unsqueeze(1)  # rows of very different scale
    batched = lin(x)
    assert torch.equal(batched, torch.cat([lin(x[i:i + 1]) for i in range(12)]))
    assert torch.equal(batched[3:7], lin(x[3:7]))
    # and it is a good approximation of the float linear with the same int8 weights
    exact = x @ lin_dense(lin).T + lin.bias
    assert ((batched - exact).norm(dim=1) / exact.norm(dim=1)).max() < 0.03


def lin_dense(lin):
    """Dequantized weight of an Int8Linear, without its two scale columns."""
    w = torch.ops.quantized.linear_unpack(lin.packed)[0].dequantize()
    return w[:, :lin.in_features]


def test_int8_model_rows_nearly_independent_of_batch(tiny_gguf):
    from specplug.runtime.linear import int8_available

    if not int8_available():
        pytest.skip("no fbgemm")
    m = load_target(str(tiny_gguf), device="cpu", quant="int8").model
    ids = list(range(40, 56))
    c = m.new_cache(1, 64)
    batched = m.forward(ids, list(range(16)), [0] * 16, c).logits
    c2 = m.new_cache(1, 64)
    single = torch.cat([m.forward([t], [i], [0], c2).logits for i, t in enumerate(ids)])
    # linears are bit-identical; SDPA rounds differently for 16 rows than for 1
    torch.testing.assert_close(batched, single, rtol=0, atol=1e-4)


def test_verify_cost_curves_interpolate_and_extend():
    from specplug.pricing import BUILTIN_CURVES, interpolate_cost

    curve = ((1, 1.0), (2, 1.5), (4, 2.0))
    assert [interpolate_cost(curve, n) for n in (1, 2, 3, 4, 6)] == [1.0, 1.5, 1.75, 2.0, 2.5]
    for name, c in BUILTIN_CURVES.items():  # every runtime's curve starts at 1 and rises
        values = [interpolate_cost(c, n) for n in range(1, 65)]
        assert values[0] == 1.0 and all(b > a for a, b in zip(values, values[1:])), name


def test_a_measured_or_given_verification_curve_replaces_the_built_in_one(tiny_gguf):
    """`verify_curve: measure` times T(k)/T(1) of the model on this machine when drafting is set up
    (every k in turn, never falling); a given curve is checked and used as is; the engine prices with
    what Pricing.cost reads, and results record where it came from."""
    from specplug.errors import ModelError
    from specplug.pricing import BUILTIN_CURVES, MEASURE_K, builtin, builtin_key, interpolate_cost, resolve
    from specplug.runtime import load_target

    model = load_target(str(tiny_gguf), device="cpu").model
    pricing = resolve(model, "measure")
    curve = pricing.curve
    assert [k for k, _ in curve] == list(MEASURE_K) and curve[0] == (1, 1.0)
    assert all(b >= a for (_, a), (_, b) in zip(curve, curve[1:]))
    assert pricing.cost(3) == interpolate_cost(curve, 3)
    assert pricing.info() == {"source": "measured", "points": [list(p) for p in curve]}
    pricing = builtin(model)  # back to the runtime's own table
    assert pricing.info()["source"] == f"builtin {builtin_key(model.kernel_path)}"
    assert pricing.cost(8) == interpolate_cost(BUILTIN_CURVES[builtin_key(model.kernel_path)], 8)

    given = resolve(load_target(str(tiny_gguf), device="cpu").model, [[1, 1.0], [2, 1.5], [4, 2.0]])
    assert [given.cost(n) for n in (2, 3, 6)] == [1.5, 1.75, 2.5]
    assert given.info()["source"] == "configured"
    with pytest.raises(ModelError, match="verify_curve: a verification curve never falls"):
        resolve(load_target(str(tiny_gguf), device="cpu").model, [[1, 1.0], [2, 0.9]])


def test_verify_curve_auto_measures_on_the_gguf_cpu_kernels_when_drafts_are_priced(tiny_gguf, tmp_path):
    """A config's default `verify_curve: auto`: timed when drafting is set up on the gguf CPU kernels
    (their built-in tables each came from one machine) when a speculator is priced; the built-in table
    for float weights, and when nothing is priced (no curve to time)."""
    from specplug.config import parse_config
    from specplug.pricing import BUILTIN_CURVES, curve_setting, resolve
    from specplug.runtime import load_target
    from specplug.testing import write_tiny_gguf

    priced = parse_config({"speculators": [{"type": "noop"}]})
    assert priced.verify_curve == "auto" and curve_setting(priced) == "auto"
    assert curve_setting(parse_config({})) == "builtin"  # nothing drafts
    unpriced = parse_config({"speculators": [{"type": "noop", "cost_trim": False}]})
    assert curve_setting(unpriced) == "builtin"
    assert curve_setting(parse_config({"verify_curve": "measure"})) == "measure"  # asked for: kept

    q = write_tiny_gguf(tmp_path / "q.gguf", tensor_type="Q4_1", n_layer=2, seed=3)
    on_kernels = resolve(load_target(str(q), device="cpu", quant="gguf").model, "auto")
    assert on_kernels.info()["source"] == "measured" and on_kernels.curve[0] == (1, 1.0)
    floats = resolve(load_target(str(tiny_gguf), device="cpu", quant="none").model, "auto")
    assert floats.curve is BUILTIN_CURVES["cpu"] and floats.info()["source"] == "builtin cpu"


def test_verify_curve_auto_times_a_model_until_three_are_kept_then_reads_their_median(tmp_path, monkeypatch):
    """`auto` on the gguf CPU kernels measures while fewer than three curves of this model, on this machine
    and set-up, are kept (specplug.pricing.cache), then prices with their median and measures no more;
    `measure` always times anew (the newest five kept); other threads or a changed model file are another
    key; a damaged cache is set aside with a warning, an unwritable one costs a warning, never the run."""
    from specplug import pricing
    from specplug.pricing import cache as curve_cache

    monkeypatch.setenv("SPECPLUG_CACHE_DIR", str(tmp_path / "cache"))
    timed = []

    def fake_measure(model):  # distinct curves, so the median is checkable
        timed.append(1)
        r = 1.0 + 0.1 * len(timed)
        return ((1, 1.0), (2, round(r, 3)), (4, round(2 * r, 3)))
    monkeypatch.setattr(pricing, "measure_curve", fake_measure)
    q = write_tiny_gguf(tmp_path / "q.gguf", tensor_type="Q4_1", n_layer=1, seed=3)

    def load(curve="auto"):
        m = load_target(str(q), device="cpu", quant="gguf").model
        return pricing.resolve(m, curve).info()

    assert [load()["source"] for _ in range(3)] == ["measured"] * 3 and len(timed) == 3
    info = load()  # three kept: their median (r = 1.1, 1.2, 1.3), nothing timed
    assert len(timed) == 3 and info == {"source": "cached (median of 3 measurements)",
                                        "points": [[1, 1.0], [2, 1.2], [4, 2.4]]}
    assert load("measure")["source"] == "measured" and len(timed) == 4
    assert load()["points"][1] == [2, 1.25] and len(timed) == 4  # median of four
    for _ in range(3):
        load("measure")
    doc = json.loads((tmp_path / "cache" / curve_cache.FILE).read_text())
    (entry,) = doc["curves"].values()
    assert [m["points"][1][1] for m in entry["measured"]] == [1.3, 1.4, 1.5, 1.6, 1.7]  # the newest five
    assert entry["what"]["model"] == str(q.resolve()) and entry["what"]["isa"] is not None

    n = torch.get_num_threads()
    torch.set_num_threads(1 if n > 1 else 2)
    try:
        assert load()["source"] == "measured" and len(timed) == 8  # another thread count: another key
    finally:
        torch.set_num_threads(n)
    st = q.stat()
    os.utime(q, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the file replaced: its curves no longer apply
    assert load()["source"] == "measured" and len(timed) == 9

    (tmp_path / "cache" / curve_cache.FILE).write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable verification-curve cache"):
        assert load()["source"] == "measured"
    assert (tmp_path / "cache" / "verify-curves.bad").exists()
    assert len(json.loads((tmp_path / "cache" / curve_cache.FILE).read_text())["curves"]) == 1  # rebuilt

    (tmp_path / "not-a-folder").write_text("")
    monkeypatch.setenv("SPECPLUG_CACHE_DIR", str(tmp_path / "not-a-folder"))
    with pytest.warns(UserWarning, match="verification curve not cached .* set SPECPLUG_CACHE_DIR"):
        assert load()["source"] == "measured"


def test_median_curve_is_taken_row_count_by_row_count_and_never_falls():
    from specplug.pricing.cache import median_curve

    a, b, c = ((1, 1.0), (2, 1.5), (4, 2.0)), ((1, 1.0), (2, 1.3), (4, 2.6)), ((1, 1.0), (2, 1.9), (4, 1.4))
    assert median_curve([a, b, c]) == ((1, 1.0), (2, 1.5), (4, 2.0))
    assert median_curve([c]) == ((1, 1.0), (2, 1.9), (4, 1.9))  # held at its top


def test_model_verify_cost_follows_its_runtime(tiny_target):
    from specplug.pricing import BUILTIN_CURVES, builtin, builtin_key, interpolate_cost

    m = tiny_target.model
    key = {"gguf": f"gguf-{m.isa}" if f"gguf-{m.isa}" in BUILTIN_CURVES else "gguf"}.get(m.quant, "cpu")
    assert builtin_key(m.kernel_path) == key
    assert builtin(m).cost(8) == interpolate_cost(BUILTIN_CURVES[key], 8) > 1.0
