"""Issue 37: what a DFlash draft costs by block size, with and without the chained lookup.

Times `DFlashRuntime.draft` alone (one sequence, a context of random target states, alternating
rounds over the sizes) and `chain_lookup` over a history of that length: where a block's time goes,
apart from the host and the target. `--ab-indexing` alternates the runtime's row selection
(`specplug.runtime.linear.take_rows`, index_select) with advanced indexing (`x[rows]`, what it used
before 2026-11-27) in ABBA rounds: the cost of torch's OpenMP threads spinning after an indexing.

    python scripts/dflash_block_cost.py [--head HEAD.gguf] [--ctx 300] [--sizes 2,3,4,5,8] [--calls 200] \
        [--rounds 2] [--threads 2] [--ab-indexing] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import specplug  # noqa: F401  (first: it sets GOMP_SPINCOUNT before torch loads libgomp)
from specplug.engine import target_info
from specplug.heads.lookup import chain_lookup
from specplug.machine import describe
from specplug.runtime import layers, load_target


def _round(rt, toks: list[int], a, sizes: list[int], kinds: list[str], mode: str, ms: dict) -> None:
    for size in sizes:
        for kind in kinds:
            chains = [chain_lookup(toks, size - 1)] if kind == "with chains" else None
            for _ in range(5):
                rt.draft([toks[-1]], [a.ctx], [0], [size], chains)
            t0 = time.perf_counter()
            for _ in range(a.calls):
                rt.draft([toks[-1]], [a.ctx], [0], [size], chains)
            ms[f"{kind}, {mode}"][size].append(1e3 * (time.perf_counter() - t0) / a.calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="target: a model name or a .gguf")
    ap.add_argument("--head", default=None, help="DFlash head (default: the shipped one)")
    ap.add_argument("--ctx", type=int, default=300)
    ap.add_argument("--sizes", default="2,3,4,5,8")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ab-indexing", action="store_true", help="alternate index_select with x[rows] (ABBA)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from specplug_dflash.speculator import DFlash

    torch.set_num_threads(a.threads)
    target = load_target(a.model, "cpu", "float32", "gguf")
    spec = DFlash(DFlash.Params(head=a.head), target_info(target, 1, a.ctx + 64))
    rt = spec.rt
    taps = [torch.randn(a.ctx, target.model.config.n_embd, generator=torch.Generator().manual_seed(i))
            for i in range(len(rt.cfg.taps))]
    rt.add_context(rt.encode(taps), range(a.ctx), [0] * a.ctx)
    toks = np.random.default_rng(0).integers(0, 2000, a.ctx + 1).tolist()
    toks[-40:] = toks[a.ctx // 3:a.ctx // 3 + 40]  # the end repeats earlier text: the chain proposes
    sizes = [int(x) for x in a.sizes.split(",")]
    kinds = ["with chains", "without"] if rt.reads_lookup else ["without"]
    select = {"index_select": layers.take_rows,
              "x[rows]": lambda x, r: x[r if torch.is_tensor(r) else torch.as_tensor(list(r), dtype=torch.long)]}
    modes = list(select) if a.ab_indexing else ["index_select"]
    ms: dict[str, dict[int, list[float]]] = {f"{k}, {m}": {s: [] for s in sizes} for k in kinds for m in modes}
    for rnd in range(a.rounds):
        for mode in modes if rnd % 2 == 0 else modes[::-1]:
            layers.take_rows = select[mode]
            _round(rt, toks, a, sizes, kinds, mode, ms)
    layers.take_rows = select["index_select"]
    t0 = time.perf_counter()
    for _ in range(a.calls):
        chain_lookup(toks, max(sizes) - 1)
    chain_us = 1e6 * (time.perf_counter() - t0) / a.calls
    out = {"head": str(a.head or "shipped"), "reads_lookup": rt.reads_lookup, "ctx": a.ctx, "calls": a.calls,
           "rounds": a.rounds, "command": "python scripts/dflash_block_cost.py " + " ".join(sys.argv[1:]),
           "draft_ms": {k: {s: [round(x, 4) for x in v] for s, v in d.items()} for k, d in ms.items()},
           "draft_ms_median": {k: {s: round(statistics.median(v), 4) for s, v in d.items()} for k, d in ms.items()},
           "chain_lookup_us": round(chain_us, 1), "machine": describe("cpu")}
    for k, d in out["draft_ms_median"].items():
        print(f"{k:28s} " + "  ".join(f"block {s}: {v:.3f} ms" for s, v in d.items()))
    print(f"chain_lookup of {max(sizes) - 1} over {a.ctx + 1} tokens: {chain_us:.1f} us")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
