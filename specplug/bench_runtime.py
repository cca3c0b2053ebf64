"""`specplug bench-runtime`: the cost curve of the target runtime that speculation lives on.

decode_ms at two contexts, T(k) for one forward of k new tokens after a 512-token context
(and T(k)/T(1), the number that decides whether verifying drafts pays), prefill speed,
4 sequences x 1 token vs 1 x 1, and peak RSS. Medians over repeats; prints and writes JSON.
"""
from __future__ import annotations

import json
import resource
import statistics
import time

import torch

VERIFY_K = (1, 2, 3, 4, 6, 8, 12, 16, 32)


def _median_ms(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _fill(model, cache, seq: int, n: int, chunk: int = 256) -> None:
    """Prefill `n` arbitrary (but fixed) tokens into `seq`."""
    g = torch.Generator().manual_seed(seq)
    toks = torch.randint(100, model.config.vocab_size - 100, (n,), generator=g).tolist()
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        model.forward(toks[a:b], list(range(a, b)), [seq] * (b - a), cache, logits_rows=[])


def run_bench(model, repeats: int = 20) -> dict:
    """Measure the runtime cost curve; returns the figures as a dict."""
    res: dict = {"model": str(model.path), "device": str(model.device), "dtype": str(model.dtype).replace("torch.", ""),
                 "quant": model.quant, "threads": torch.get_num_threads(), "repeats": repeats}
    cache = model.new_cache(4, 2048)

    def step(seqs, ctx, k=1, rows="all"):
        toks = [7] * (k * len(seqs))
        pos = [ctx + i for _ in seqs for i in range(k)]
        sids = [s for s in seqs for _ in range(k)]
        model.forward(toks, pos, sids, cache, logits_rows=None)
        for s in seqs:
            cache.seq_rm(s, ctx)

    res["decode_ms"] = {}
    for ctx in (128, 1024):
        cache.clear(0)
        _fill(model, cache, 0, ctx)
        res["decode_ms"][str(ctx)] = round(_median_ms(lambda: step([0], ctx), repeats), 2)
    cache.clear(0)
    _fill(model, cache, 0, 512)
    res["verify_ms"] = {str(k): round(_median_ms(lambda: step([0], 512, k), repeats), 2) for k in VERIFY_K}
    t1 = res["verify_ms"]["1"]
    res["verify_ratio"] = {k: round(v / t1, 3) for k, v in res["verify_ms"].items()}

    def prefill():
        cache.clear(1)
        model.forward([9] * 512, list(range(512)), [1] * 512, cache, logits_rows=[511])
    res["prefill_tok_s"] = round(512 / (_median_ms(prefill, max(3, repeats // 4), warmup=1) / 1e3), 1)

    for s in range(4):
        cache.clear(s)
        _fill(model, cache, s, 128)
    one = _median_ms(lambda: step([0], 128), repeats)
    four = _median_ms(lambda: step([0, 1, 2, 3], 128), repeats)
    res["batch4_ms"] = round(four, 2)
    res["batch1_ms"] = round(one, 2)
    res["batch4_vs_1"] = round(four / one, 3)
    res["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return res


def format_report(res: dict) -> str:
    lines = [f"model {res['model']}  device {res['device']}  dtype {res['dtype']}  quant {res['quant']}  "
             f"threads {res['threads']}  (medians of {res['repeats']})",
             "decode_ms: " + ", ".join(f"ctx {c}: {v} ms" for c, v in res["decode_ms"].items()),
             "verify after 512 tokens:",
             "  k      " + " ".join(f"{k:>7}" for k in res["verify_ms"]),
             "  T(k) ms" + " ".join(f"{v:>7.2f}" for v in res["verify_ms"].values()),
             "  T(k)/T1" + " ".join(f"{v:>7.2f}" for v in res["verify_ratio"].values()),
             f"prefill 512: {res['prefill_tok_s']} tok/s",
             f"batch 4 seq x 1 tok: {res['batch4_ms']} ms vs 1 x 1: {res['batch1_ms']} ms -> x{res['batch4_vs_1']}",
             f"peak RSS: {res['peak_rss_mb']} MB"]
    return "\n".join(lines)


def main(model, repeats: int, json_path: str | None) -> dict:
    res = run_bench(model, repeats)
    print(format_report(res))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=2)
    return res
