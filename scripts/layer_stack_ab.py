"""All decoder layers in one native call (`LayerStack`) against one `layer_forward` call per layer
from Python, side by side in one process on the real target: a forward of k rows after `--ctx`
positions (the rows removed again after each), alternated in rounds (ABBA), medians. The two
compute the same bits (tests/test_native.py); only the Python between the layers differs.

    python scripts/layer_stack_ab.py --ctx 128 512 --rounds 6 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import specplug  # noqa: F401  (its OpenMP spin count, before torch loads)
from specplug import machine
from specplug.runtime import load_target
from specplug.runtime.model import Transformer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, nargs="+", default=[128])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    m = load_target(args.model, device="cpu", quant="gguf", threads=args.threads).model
    stack = Transformer._layer_stack
    ways = {"one call": stack, "a call per layer": lambda self: None}
    cache = m.new_cache(1, max(args.ctx) + max(args.ks) + 1)
    times: dict[tuple[str, int, int], list[float]] = {}
    for ctx in args.ctx:
        cache.clear()
        m.forward(list(range(100, 100 + ctx)), list(range(ctx)), [0] * ctx, cache, logits_rows=[ctx - 1])
        for rnd in range(args.rounds):
            for name in (list(ways) if rnd % 2 == 0 else list(ways)[::-1]):
                Transformer._layer_stack = ways[name]
                for k in args.ks:
                    ts = []
                    for _ in range(args.reps):
                        cache.seq_rm(0, ctx)
                        t0 = time.perf_counter()
                        m.forward([5 + j for j in range(k)], list(range(ctx, ctx + k)), [0] * k, cache)
                        ts.append(time.perf_counter() - t0)
                    times.setdefault((name, ctx, k), []).append(statistics.median(ts) * 1e3)
    Transformer._layer_stack = stack
    rows = []
    print("| ctx | rows | one call ms | a call per layer ms | one call faster |")
    print("|---|---|---|---|---|")
    for ctx in args.ctx:
        for k in args.ks:
            a, b = (statistics.median(times[(n, ctx, k)]) for n in ways)
            rows.append({"ctx": ctx, "k": k, "one_call_ms": round(a, 3), "per_layer_ms": round(b, 3),
                         "ratio": round(b / a, 3)})
            print(f"| {ctx} | {k} | {a:.3f} | {b:.3f} | {b / a:.3f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine.describe("cpu"), "rounds": args.rounds,
                       "reps": args.reps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
