"""Timing several calls side by side on a machine whose speed drifts: each call once a round, the order
reversed every other round, medians (what `specplug bench-runtime` times T(k) with, and what `verify_ms`
times a verification of k rows with for the engine's pricing curve, specplug.pricing)."""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch


def no_sync() -> None:
    pass


def in_turn(keys: list, repeats: int):
    """The keys, `repeats` rounds of each once, the order reversed every other round: the order in
    which the benchmarks take several forwards, so that each one's repeats share the same
    minutes. (A shared VM's speed swings for seconds at a time, several-row forwards by up to 1.2-2.5x
    while one-row ones barely move (AMD EPYC Zen 4, 2 threads, 2026-11-29; docs/results/runtime.md):
    T(k) timed one k after another could pair a T(1) from a fast stretch with a T(8) from a slow one.)"""
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


def verify_ms(model, ks: Sequence[int], ctx: int = 256, rounds: int = 5) -> dict[int, float]:
    """{k: median ms of one forward of k new rows of `model`} (a Transformer) on this machine now, for
    each k of `ks` and 1: after `ctx` tokens of context in a scratch cache, one forward of k rows (every
    row's logits, as a verification), taken in turn as `bench-runtime` takes T(k) (`medians_in_turn_ms`:
    the order reversed every round, so a drifting machine falls on all of them; a warm-up call each
    first), at the threads of the moment (the governor set aside: no probes of other counts), medians
    over `rounds`."""
    ks = sorted(set(ks) | {1})
    cache = model.new_cache(1, ctx + max(ks) + 1)
    n_vocab = len(model.embed)
    model.forward([(100 + i) % n_vocab for i in range(ctx)], list(range(ctx)), [0] * ctx, cache, logits_rows=[])

    def verify(k: int):
        def fn():
            model.forward([(7 + i) % n_vocab for i in range(k)], list(range(ctx, ctx + k)), [0] * k, cache)
            cache.seq_rm(0, ctx)
        return fn

    sync = torch.cuda.synchronize if model.device.type == "cuda" else no_sync
    gov, model.governor = model.governor, None
    try:
        return medians_in_turn_ms({k: verify(k) for k in ks}, rounds, warmup=1, sync=sync)
    finally:
        model.governor = gov
