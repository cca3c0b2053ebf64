"""The static-shape step (specplug.runtime.static): what CUDA graphs need, proven on CPU.

Every row bucket compiles with torch.compile(fullgraph=True, dynamic=False) (a graph break would
raise), the compiled step computes what the eager forward computes, padding rows never touch a
sequence, and with fixed rows a row's result is bit-identical whatever shares its step, so
greedy speculative output equals plain.
"""
from __future__ import annotations

import random
import shutil

import pytest
import torch

from specplug.errors import ModelError
from specplug.runtime import Transformer, load_target
from specplug.runtime.static import ROW_BUCKETS, StaticOptions, ctx_bucket, row_bucket
from specplug.testing import Oracle, RandomDrafts, assert_greedy_equal, greedy_outputs, write_tiny_gguf

CTX = 512


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("static") / "tiny.gguf", context=CTX)


def _model(path, **opts) -> Transformer:
    m = Transformer.load(path, device="cpu", dtype="float32", quant="none")
    if opts:
        m.use_static(StaticOptions(**opts))
    return m


def _batch(n: int, n_seq: int, seed: int):
    """A mixed step of n rows over n_seq sequences after different prefixes: (prefixes, rows)."""
    rng = random.Random(seed)
    prefixes = {s: [rng.randrange(3, 250) for _ in range(rng.randrange(1, 60))] for s in range(n_seq)}
    counts = [n // n_seq + (1 if s < n % n_seq else 0) for s in range(n_seq)]
    rows = []
    for s, c in enumerate(counts):
        p0 = len(prefixes[s])
        rows += [(rng.randrange(3, 250), p0 + i, s) for i in range(c)]
    rng.shuffle(rows)
    return prefixes, rows


def _run(model, prefixes, rows, taps=(0, 2)):
    cache = model.new_cache(len(prefixes), CTX)
    for s, toks in prefixes.items():
        model.forward(toks, list(range(len(toks))), [s] * len(toks), cache, logits_rows=[])
    ids, pos, seq = zip(*rows)
    return model.forward(list(ids), list(pos), list(seq), cache, logits_rows=None, taps=set(taps)), cache


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() <= 2e-5 * max(1.0, scale), ((a - b).abs().max().item(), scale)


def test_buckets():
    assert [row_bucket(n) for n in (1, 2, 3, 5, 9, 64, 65, 512)] == [1, 2, 4, 8, 16, 64, 128, 512]
    with pytest.raises(ValueError):
        row_bucket(513)
    assert [ctx_bucket(n, 2048) for n in (1, 256, 257, 1500, 2048)] == [256, 256, 512, 2048, 2048]
    assert ctx_bucket(900, 700) == 700
    with pytest.raises(ValueError, match="fixed_tokens"):
        StaticOptions(fixed_tokens=3)


def test_every_bucket_compiles_fullgraph_and_matches_eager(gguf_path):
    """fullgraph=True makes any graph break an error: every bucket traces as one graph."""
    eager = _model(gguf_path)
    static = _model(gguf_path, compile=True, backend="aot_eager", granularity="step")
    for i, R in enumerate(ROW_BUCKETS):
        n = R if R <= 8 else R - R // 4  # full buckets and padded ones
        prefixes, rows = _batch(n, min(3, n), seed=i)
        if max(p for _, p, _ in rows) >= CTX:
            continue
        want, _ = _run(eager, prefixes, rows)
        got, cache = _run(static, prefixes, rows)
        assert got.logits.shape == want.logits.shape
        _close(got.logits, want.logits)
        for t in (0, 2):
            _close(got.hidden[t], want.hidden[t])
        assert cache.k.shape[1] == len(prefixes) + 1  # the spare slot
    assert static.static.graphs >= 5


def test_one_compiled_layer_serves_every_layer(gguf_path):
    """granularity "layer": per shape, one graph for the decoder layer and one for the head, however
    many layers the model has (the layer index and weights are inputs, not constants)."""
    from torch._dynamo.utils import counters

    big = _model(write_tiny_gguf(gguf_path.with_name("deep.gguf"), n_layer=5, context=CTX), compile=True,
                 backend="aot_eager")
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    prefixes, rows = _batch(3, 1, seed=9)
    _run(big, prefixes, rows)
    assert counters["stats"]["unique_graphs"] - before <= 4  # prefill (rows 8), then the step's (rows 4): layer + head


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="inductor's CPU code generation needs a C++ compiler")
def test_inductor_compiles_the_step(gguf_path):
    """The real compiler (inductor), not only the tracer: one decode and one verification bucket."""
    eager = _model(gguf_path)
    static = _model(gguf_path, compile=True, backend="inductor")
    for n, seed in ((1, 0), (5, 1)):
        prefixes, rows = _batch(n, 1, seed)
        want, _ = _run(eager, prefixes, rows)
        got, _ = _run(static, prefixes, rows)
        scale = want.logits.abs().max().item()
        assert (got.logits - want.logits).abs().max().item() <= 1e-4 * max(1.0, scale)


def test_padding_rows_touch_only_the_spare_slot(gguf_path):
    m = _model(gguf_path, compile=False)
    cache = m.new_cache(2, CTX)
    m.forward([5, 6, 7], [0, 1, 2], [0, 0, 0], cache, logits_rows=[2])  # 1 x 3 tokens -> 1 x 4: one pad row
    k_before = cache.k[:, :2].clone()
    m.forward([8], [3], [1], cache, logits_rows=[0])  # seq 1 at position 3 -> 1 x 1, no pad
    m.forward([9, 10, 11], [3, 4, 5], [0, 0, 0], cache, logits_rows=None)  # one pad again
    assert cache.valid[0, :6].all() and not cache.valid[0, 6:].any()
    assert cache.valid[1].nonzero().flatten().tolist() == [3]
    assert cache.valid[2].any()  # the pad rows wrote the spare slot
    # seq 0's cells 0-2 and seq 1's cell 3 kept what their own rows wrote
    assert torch.equal(cache.k[:, 0, :, :3], k_before[:, 0, :, :3])
    assert cache.seq_len(0) == 6 and cache.seq_len(1) == 4


def test_more_rows_than_a_step_holds(gguf_path):
    """A forward larger than the step runs as consecutive steps in position order."""
    eager = _model(gguf_path)
    m = _model(gguf_path, compile=False, fixed_tokens=4)
    prefixes, rows = _batch(11, 2, seed=5)
    want, _ = _run(eager, prefixes, rows)
    got, _ = _run(m, prefixes, rows)
    _close(got.logits, want.logits)
    _close(got.hidden[2], want.hidden[2])


@pytest.mark.parametrize("compiled", [False, True])
def test_fixed_shape_makes_a_row_independent_of_its_step(gguf_path, compiled):
    """With a fixed step shape, a sequence's decode row alone and the same row in a step full of
    other sequences' verification rows give bit-identical logits and taps."""
    opts = dict(compile=compiled, backend="aot_eager", fixed_tokens=8)
    m = _model(gguf_path, **opts)
    rng = random.Random(3)
    prefix = {s: [rng.randrange(3, 250) for _ in range(20 + 7 * s)] for s in range(3)}
    outs = []
    for others in (False, True):
        cache = m.new_cache(3, CTX)
        for s, toks in prefix.items():
            m.forward(toks, list(range(len(toks))), [s] * len(toks), cache, logits_rows=[])
        ids, pos, seq = [42], [len(prefix[0])], [0]
        if others:  # 4 verification rows of seq 2 first, a decode row of seq 1 after
            ids = [7, 8, 9, 10] + ids + [11]
            pos = [len(prefix[2]) + i for i in range(4)] + pos + [len(prefix[1])]
            seq = [2, 2, 2, 2] + seq + [1]
        out = m.forward(ids, pos, seq, cache, logits_rows=None, taps={1, 2})
        r = seq.index(0)
        outs.append((out.logits[r], out.hidden[1][r], out.hidden[2][r]))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_greedy_speculative_equals_plain_on_the_static_step(gguf_path):
    """The engine on the static step (fixed shape): speculation changes no token."""
    target = load_target(str(gguf_path), device="cpu", dtype="float32", quant="none")
    target.model.use_static(StaticOptions(compile=False, fixed_tokens=8))  # eager: the same step, quicker to test
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 250) for _ in range(rng.randrange(3, 40))] for _ in range(4)]
    plain, _ = greedy_outputs(target, [], prompts, 24, n_parallel=2)
    oracle = Oracle({tuple(p): g for p, g in zip(prompts, plain)}, corrupt_every=3)
    eng = assert_greedy_equal(target, [oracle, RandomDrafts(target.model.config.vocab_size, seed=1)], prompts, 24,
                              n_parallel=2, allow_unverified=True)
    assert eng.stats.target_forwards < eng.stats.emitted_tokens  # drafts were accepted: fewer forwards than tokens


def test_load_target_options(gguf_path, tiny_q8_gguf):
    t = load_target(str(gguf_path), device="cpu", quant="none")  # compile defaults off; dtype auto = float32 on CPU
    assert t.model.static is None and t.model.dtype == torch.float32
    t = load_target(str(gguf_path), device="cpu", quant="none", compile="auto")
    assert t.model.static is None  # auto: only on CUDA
    t = load_target(str(gguf_path), device="cpu", quant="none", compile=True, step_tokens=5)
    assert t.model.static.options.fixed_tokens == 8 and t.model.static.options.compile
    with pytest.raises(ModelError, match="compile: true runs the torch backend.*quant: none"):
        load_target(str(tiny_q8_gguf), device="cpu", quant="gguf", compile=True)


def test_config_keys(tmp_path):
    from specplug.config import ConfigError, load_config, target_args

    p = tmp_path / "c.yaml"
    p.write_text("model: x.gguf\nparallel: 2\nspeculators:\n  - type: ngram-simple\n    n_max: 5\n")
    cfg = load_config(p)
    assert cfg.dtype == "auto" and cfg.compile == "auto" and cfg.cuda_graphs and cfg.batch_invariant
    args = target_args(cfg)
    assert args["step_tokens"] == 6 and args["compile"] == "auto" and args["cuda_graphs"] is True
    p.write_text("model: x.gguf\ncompile: sometimes\n")
    with pytest.raises(ConfigError, match="compile must be true, false or auto"):
        load_config(p)
    p.write_text("model: x.gguf\nbatch_invariant: false\ncuda_graphs: false\n")
    cfg = load_config(p)
    assert target_args(cfg)["step_tokens"] is None and target_args(cfg)["cuda_graphs"] is False


def test_a_caches_graphs_go_with_the_cache(gguf_path):
    """Graphs (and on CUDA their captured memory) live on the cache they were built for: an engine's
    cache dropped, nothing of it stays behind in the runner."""
    import gc
    import weakref

    m = _model(gguf_path, compile=False)
    cache = m.new_cache(2, CTX)
    m.forward([5, 6, 7], [0, 1, 2], [0, 0, 0], cache, logits_rows=[2])
    assert m.static.graphs == 1
    ref = weakref.ref(cache)
    del cache
    gc.collect()
    assert ref() is None
