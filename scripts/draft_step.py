"""What one drafted token costs, in units of a plain decoding step (issue 22, item 2).

For each chain head (the shipped MTP and Eagle3 heads), one sequence with a 200-token context:

- plain step: one target forward of one row with logits (what a decoding step computes);
- head, kernel by kernel: the head's forward with the native kernels called one by one from
  Python (its `native_step` switched off), then the greedy pick in torch;
- head, one call: `forward_pick` (`specplug.heads.PairStep`: embedding, pair norms, fc or proj,
  the layer, the Q8_0 draft-vocabulary head and the top-1 in one native call);
- the whole `draft` hook (`--hook-tokens` tokens, `stop_below: 0`) of a fresh speculator as shipped,
  after a prompt and 96 tokens the target wrote (so the heads reading the pair lookup find some):
  the native steps plus the drafter's Python around them (lookups, the stop rule, the cache rollback).

Each figure is the median of --iters timed calls, and the rounds alternate (--rounds); the
ratios are per round, and their medians are printed. Usage:

    python scripts/draft_step.py --rounds 5 --json draft-step.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specplug.engine import target_info
from specplug.machine import describe
from specplug.runtime import load_target
from specplug.types import Batch, DraftRequest


def timed(f, iters: int) -> float:
    ts = []
    for i in range(iters):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def hook_call(cls, target, n_tokens: int):
    """A call of the `draft` hook of a fresh `cls` speculator (as shipped, `stop_below: 0`) drafting
    n_tokens after a prompt and 96 greedy tokens; each call rolls the head's cache back to the history
    first (as drafting every step does)."""
    m = target.model
    info = target_info(target, 1, 2048)
    sp = cls(cls.Params(stop_below=0.0), info)
    text = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural "
            "experiences and must-see attractions. Describe the islands, the food and the people.")
    hist = target.tokenizer.encode(text)
    cache = m.new_cache(1, 2048)
    out = m.forward(hist, list(range(len(hist))), [0] * len(hist), cache, logits_rows=[len(hist) - 1])
    for _ in range(96):
        hist.append(int(out.logits[-1].argmax()))
        out = m.forward([hist[-1]], [len(hist) - 1], [0], cache, logits_rows=[0])
    P = len(hist) - 1  # committed rows; the last token is not yet in the target
    want = sp.request_embeddings(info)
    taps = set(want.layers) | ({m.config.n_layer} if want.final else set())
    o = m.forward(hist[:P], list(range(P)), [0] * P, m.new_cache(1, 2048), logits_rows=[P - 1], taps=taps)
    emb = {li: o.hidden[li] for li in want.layers}
    if want.final:
        emb["final"] = o.hidden[m.config.n_layer]
    batch = Batch(torch.tensor(hist[:P]), torch.arange(P), torch.zeros(P, dtype=torch.long), emb, is_prompt=True)
    sp.process_batch(batch, sp.encode(batch) if hasattr(sp, "encode") else None)
    req = DraftRequest(0, hist, n_tokens)
    sp.draft([req])  # reads the history's rows (catch_up); later calls read none
    return lambda: sp.draft([req])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hook-tokens", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from specplug_eagle3.speculator import Eagle3
    from specplug_mtp.speculator import MTP

    target = load_target(args.model, "cpu", "float32", "auto", args.threads)
    info = target_info(target, 1, 2048)
    m, P = target.model, args.context
    cache = m.new_cache(1, 2048)
    heads = {"mtp": MTP(MTP.Params(), info), "eagle3": Eagle3(Eagle3.Params(), info)}
    taps = {3, 15, 27, m.config.n_layer}
    out = m.forward(list(range(100, 100 + P)), list(range(P)), [0] * P, cache, logits_rows=[P - 1], taps=taps)
    states = {"mtp": out.hidden[m.config.n_layer][-1:].clone(),
              "eagle3": heads["eagle3"].rt.fuse([out.hidden[i][-1:] for i in (3, 15, 27)])}
    for name, sp in heads.items():  # the head's cache holds the same context
        rt = sp.rt
        rt.forward(states[name].expand(P, -1).contiguous(), list(range(100, 100 + P)), list(range(P)), [0] * P, [])

    def plain():
        cache.seq_rm(0, P)
        m.forward([5], [P], [0], cache, logits_rows=[0])

    def kernel_by_kernel(sp, h):
        def f():
            rt = sp.rt
            saved, rt.native_step = rt.native_step, None
            rt.cache.seq_rm(0, P)
            _, logits = rt.forward(h, [5], [P], [0], [0])
            rt.native_step = saved
            sp.loop.pick(logits)
        return f

    def one_call(sp, h):
        def f():
            sp.rt.cache.seq_rm(0, P)
            sp.rt.forward_pick(h, [5], [P], [0], [0])
        return f

    hooks = {name: hook_call(cls, target, args.hook_tokens) for name, cls in (("mtp", MTP), ("eagle3", Eagle3))}

    rows: dict[str, list[float]] = {}
    for r in range(args.rounds):
        step = timed(plain, args.iters)
        rows.setdefault("plain step ms", []).append(step)
        for name, sp in heads.items():
            a = timed(kernel_by_kernel(sp, states[name]), args.iters)
            b = timed(one_call(sp, states[name]), args.iters)
            rows.setdefault(f"{name} kernel by kernel ms", []).append(a)
            rows.setdefault(f"{name} one call ms", []).append(b)
            rows.setdefault(f"{name} kernel by kernel / step", []).append(a / step)
            rows.setdefault(f"{name} one call / step", []).append(b / step)
            c = timed(hooks[name], args.iters)
            rows.setdefault(f"{name} draft hook ({args.hook_tokens} tokens) ms", []).append(c)
    report = {"command": "python scripts/draft_step.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "threads": torch.get_num_threads(), "medians": {k: statistics.median(v) for k, v in rows.items()},
        "rounds": rows}
    for k, v in report["medians"].items():
        print(f"{k:<32} {v:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report, "machine": describe()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
