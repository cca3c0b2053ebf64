"""Timing several calls side by side on a machine whose speed drifts: each call once a round, the order
reversed every other round, medians (what `specplug bench-runtime` times T(k) with, and what
Transformer.measure_verify_curve times the engine's pricing curve with)."""
from __future__ import annotations

import statistics
import time


def no_sync() -> None:
    pass


def in_turn(keys: list, repeats: int):
    """The keys, `repeats` rounds of each once, the order reversed every other round: the order in
    which the benchmarks take several forwards, so that each one's repeats share the same
    minutes. (This VM's speed swings for seconds at a time, several-row forwards by up to 1.2-2.5x
    while one-row ones barely move (docs/results/runtime.md, session 37): T(k) timed one k after
    another could pair a T(1) from a fast stretch with a T(8) from a slow one.)"""
    for r in range(repeats):
        yield from keys if r % 2 == 0 else reversed(keys)


def medians_in_turn_ms(fns: dict, repeats: int, warmup: int = 2, sync=no_sync) -> dict:
    """{key: median wall time of fns[key]}, the calls taken in turn (`in_turn`); `sync` waits for the
    device after each call (torch.cuda.synchronize on CUDA, where a call only queues its kernels)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    times: dict = {k: [] for k in fns}
    for k in in_turn(list(fns), repeats):
        t0 = time.perf_counter()
        fns[k]()
        sync()
        times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def median_ms(fn, repeats: int, warmup: int = 2, sync=no_sync) -> float:
    """Median wall time of fn (`medians_in_turn_ms` of it alone)."""
    return medians_in_turn_ms({0: fn}, repeats, warmup, sync)[0]
