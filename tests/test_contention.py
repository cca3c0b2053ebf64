"""The native kernels on a CPU that is not ours alone (issue 27).

Work is claimed in chunks by whichever threads run, so under load the chunks land on other
threads from one call to the next. The bits must not move: every output here is compared
with a one-thread run, with an idle run, and with more threads than cores, all under busy
neighbour processes that take every core.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

from specplug.runtime import native, resolve_threads

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"gguf kernels unavailable: {native.unavailable_reason()}")

CORES = resolve_threads("auto")
SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def busy_neighbours(n: int, seconds: float = 60.0):
    """`n` processes that spin (each ends by itself after `seconds`, and is killed on exit)."""
    procs = [subprocess.Popen([sys.executable, "-c", SPIN, str(seconds)]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


@contextlib.contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def work():
    """Inputs that make many chunks per call: 1 to 64 rows, 256 weight tiles, 2 x 8 heads x 256 cells."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    g = torch.Generator().manual_seed(27)
    n, k = 2048, 1536
    w = torch.randn(n, k, generator=g)
    q4 = native.QuantLinear.from_blocks(quantize(w.numpy(), GGMLQuantizationType.Q4_1), "Q4_1", (n, k),
                                        bias=torch.randn(n, generator=g))
    q8 = native.QuantLinear.from_float(w[:1000], norm_weight=torch.rand(k, generator=g) + 0.5)  # a partial tile
    xs = [torch.randn(m, k, generator=g) for m in (1, 5, 64)]
    H, Hkv, D, ctx, M = 8, 2, 64, 256, 12
    kc = torch.randn(2, Hkv, ctx, D, generator=g)
    vc = torch.randn(2, Hkv, ctx, D, generator=g)
    valid = torch.rand(2, ctx, generator=g) > 0.1  # holes, as after a removed range
    valid[:, 0] = True
    seq = torch.tensor([i % 2 for i in range(M)], dtype=torch.int32)
    pos = torch.tensor([40 + 17 * i for i in range(M)], dtype=torch.int32)
    q = torch.randn(M, H * D, generator=g)
    return q4, q8, xs, (q, kc, vc, seq, pos, valid, H)


def outputs(work) -> list[torch.Tensor]:
    q4, q8, xs, (q, kc, vc, seq, pos, valid, H) = work
    out = []
    for x in xs:
        out += list(q8.k.quantize_rows(x, q8.norm_weight, 1e-5))
        out += [q4(x, residual=torch.ones(x.shape[0], q4.out_features)), q8.norm_linear(x, 1e-5)]
    for cache in ((kc, vc), (kc.half(), vc.half())):
        out.append(q4.k.attention(q, *cache, seq, pos, valid, H, 0.125, None))
    return out


def assert_same_bits(got: list[torch.Tensor], ref: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), f"{what}: output {i} differs from the one-thread run"


def test_kernels_are_bit_identical_under_load_and_any_thread_count(work):
    with threads(1):
        ref = outputs(work)
    with threads(max(2, CORES)):
        assert_same_bits(outputs(work), ref, "idle")
    with busy_neighbours(CORES):
        for n in (2, max(2, CORES), 2 * CORES + 1):  # up to more threads than cores: some are always descheduled
            with threads(n):
                for rep in range(5):
                    assert_same_bits(outputs(work), ref, f"{n} threads under load, pass {rep}")
    with threads(1):
        assert_same_bits(outputs(work), ref, "one thread again")


def test_model_decode_and_verify_under_load(smollm2_gguf):
    """Greedy decoding and a verification forward on SmolLM2: the same logits, bit for bit."""
    m = smollm2_gguf.model
    prompt = list(range(1000, 1040))

    def run() -> tuple[list[int], torch.Tensor]:
        c = m.new_cache(1, 256)
        logits = m.forward(prompt, list(range(len(prompt))), [0] * len(prompt), c, logits_rows=[len(prompt) - 1]).logits
        toks = [int(logits[-1].argmax())]
        for i in range(12):
            p = len(prompt) + i
            toks.append(int(m.forward([toks[-1]], [p], [0], c).logits[-1].argmax()))
        n = len(prompt) + 4
        c.seq_rm(0, n)  # verify the last 8 tokens again in one forward of 8 rows
        rows = m.forward(toks[4:12], list(range(n, n + 8)), [0] * 8, c).logits
        return toks, rows

    with threads(1):
        ref_toks, ref_rows = run()
    with busy_neighbours(CORES), threads(max(2, CORES)):
        toks, rows = run()
    assert toks == ref_toks
    assert torch.equal(rows, ref_rows)


def test_threads_auto_is_the_affinity_mask():
    if hasattr(os, "sched_getaffinity"):
        assert resolve_threads("auto") == len(os.sched_getaffinity(0))
    assert resolve_threads(3) == 3 and resolve_threads(None) is None


def test_threads_auto_is_the_default_in_config_and_cli(tmp_path):
    from specplug.cli import build_parser
    from specplug.config import RunConfig, load_config
    from specplug.errors import ConfigError

    assert RunConfig().threads == "auto"
    p = tmp_path / "t.yaml"
    p.write_text("threads: auto\n")
    assert load_config(p).threads == "auto"
    p.write_text("threads: many\n")
    with pytest.raises(ConfigError, match="threads must be >= 1 or auto"):
        load_config(p)
    args = build_parser().parse_args(["generate", "--prompt", "hi"])
    assert args.threads == "auto"
    assert build_parser().parse_args(["generate", "--prompt", "hi", "--threads", "3"]).threads == 3
    assert build_parser().parse_args(["train", "data", "-o", "x", "--threads", "auto"]).threads == "auto"


def test_run_summary_names_the_threads():
    from specplug.metrics import RunStats

    assert "3 CPU threads" in RunStats(threads=3).summary()
    assert "CPU threads" not in RunStats().summary()
    assert RunStats(threads=3).to_dict()["threads"] == 3


class _Clock:
    """A fake machine: a forward at n threads takes cost(n, rows) seconds; with `busy`, a
    neighbour takes a third of the two cores (our process gets 4/3 of a core at 2 threads)."""

    def __init__(self, cost):
        self.t = self.cpu = 0.0
        self.cost, self.busy = cost, False

    def run(self, gov, rows: int) -> None:
        gov.begin(rows)
        dt = self.cost(gov.threads, rows)
        self.t += dt
        self.cpu += dt * (min(gov.threads, 4 / 3) if self.busy else gov.threads)
        gov.end()


@pytest.fixture
def fake_time(monkeypatch):
    from specplug.runtime import governor

    def make(cost):
        c = _Clock(cost)
        monkeypatch.setattr(governor.time, "perf_counter", lambda: c.t)
        monkeypatch.setattr(governor.time, "process_time", lambda: c.cpu)
        monkeypatch.setattr(governor.torch, "set_num_threads", lambda n: None)
        monkeypatch.setattr(governor.torch, "get_num_threads", lambda: gov_threads(c))
        monkeypatch.setattr(governor, "_runnable", lambda: 1 + (1 if c.busy else 0))  # ours + the neighbour
        return c

    def gov_threads(c):
        return c.threads if hasattr(c, "threads") else 0

    return make


def test_governor_never_probes_on_idle_cores(fake_time):
    from specplug.runtime.governor import ThreadGovernor

    clock = fake_time(lambda n, rows: 1.0 / n)  # idle cores: 2 threads twice as fast
    gov = ThreadGovernor(2)
    for i in range(5000):
        clock.run(gov, 1 + i % 3)
    assert gov.current == 2 and gov.moves == 0 and gov.probes == 0 and gov.skipped > 0
    assert gov.forwards[1] == 0 and gov.period == gov.max_period


def test_governor_moves_to_fewer_threads_under_load_and_back_when_it_lifts(fake_time):
    from specplug.runtime.governor import ThreadGovernor

    # a busy neighbour: 2 threads at 0.6x of 1 thread; idle: 2 threads at 1.5x
    clock = fake_time(lambda n, rows: (1.0 if n == 1 else 1.6) if clock.busy else (1.0 if n == 1 else 0.67))
    clock.busy = True
    gov = ThreadGovernor(2)
    for _ in range(60):
        clock.run(gov, 1)
    assert gov.current == 1 and gov.moves == 1
    for _ in range(3000):  # while the neighbour runs, no probe goes back up
        clock.run(gov, 1)
    assert gov.current == 1 and gov.probes == 1 and gov.forwards[2] < 30
    clock.busy = False
    for _ in range(2000):
        clock.run(gov, 1)
    assert gov.current == 2 and gov.moves == 2


def test_governor_compares_steps_of_the_same_size(fake_time):
    from specplug.runtime.governor import ThreadGovernor

    # 1 thread is never faster, but the probes happen to see only cheap decode rows while the
    # run phase saw expensive prefill chunks: comparing across sizes would wrongly move
    clock = fake_time(lambda n, rows: rows * (1.0 / n) * (1.5 if n == 2 else 1.0))  # busy: 2 threads gain little
    clock.busy = True
    gov = ThreadGovernor(2, period=8, probe=4)
    for i in range(400):
        clock.run(gov, 256 if gov.probing is None and i % 2 else 1)
    assert gov.probes > 3 and gov.current == 2 and gov.moves == 0


def test_threads_auto_runs_the_governor_and_the_summary_says_what_it_chose(tiny_q8_gguf, monkeypatch):
    from specplug.engine import Engine, Request
    from specplug.metrics import RunStats
    from specplug.runtime import governor, load_target

    if resolve_threads("auto") < 2:
        pytest.skip("one core in the affinity mask: nothing to choose")
    fixed = load_target(str(tiny_q8_gguf), "cpu", "float32", "gguf", 1)
    ids = list(range(5, 25))
    want = Engine(fixed, [], max_ctx=256).run([Request(ids, 60)])[0].token_ids
    auto = load_target(str(tiny_q8_gguf), "cpu", "float32", "gguf", "auto")
    gov = auto.model.governor
    assert gov is not None and fixed.model.governor is None
    gov.period = gov.base = gov.left = 4  # probe often, whatever the load: the count switches mid-run
    monkeypatch.setattr(governor.time, "process_time", lambda: 0.0)
    monkeypatch.setattr(governor, "_runnable", lambda: 1)
    got = Engine(auto, [], max_ctx=256).run([Request(ids, 60)])[0].token_ids
    assert got == want and gov.probes > 3 and len(gov.forwards) == 2  # switching counts never changes a token
    torch.set_num_threads(resolve_threads("auto"))
    assert "auto: " in RunStats(threads=2, threads_auto=auto.model.governor.describe()).summary()
