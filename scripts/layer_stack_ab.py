"""A forward's native paths side by side in one process on the real target: token ids to logits in
one native call (`LayerStack.forward_tokens`, what a forward runs), all decoder layers in one call
(`LayerStack.forward`) with the embedding and head called from Python around it, and one
`layer_forward` call per layer from Python. A forward of k rows after `--ctx` positions (the rows
removed again after each), the ways call by call in turn, the order reversed every time (this VM's
speed drifts within a minute: rounds of many calls read 0.87-1.13x of each other), medians. All
compute the same bits (tests/test_native.py); only the Python between the kernels differs.

    python scripts/layer_stack_ab.py --ctx 128 512 --calls 200 --json out.json
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
    p.add_argument("--calls", type=int, default=200, help="timed forwards per way, context and k")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    m = load_target(args.model, device="cpu", quant="gguf", threads=args.threads).model
    stack = Transformer._layer_stack
    # name -> (Transformer._layer_stack, whether the stack also embeds and applies the head)
    ways = {"ids to logits": (stack, True), "layers in one call": (stack, False),
            "a call per layer": (lambda self: None, False)}
    cache = m.new_cache(1, max(args.ctx) + max(args.ks) + 1)
    times: dict[tuple[str, int, int], list[float]] = {}
    names = list(ways)
    for ctx in args.ctx:
        cache.clear()
        m.forward(list(range(100, 100 + ctx)), list(range(ctx)), [0] * ctx, cache, logits_rows=[ctx - 1])
        for call in range(args.calls):
            for k in args.ks:
                for name in (names if call % 2 == 0 else names[::-1]):
                    Transformer._layer_stack, tokens = ways[name]
                    m._layer_stack()  # (built once, then looked up)
                    m._stack_tokens = tokens
                    cache.seq_rm(0, ctx)
                    t0 = time.perf_counter()
                    m.forward([5 + j for j in range(k)], list(range(ctx, ctx + k)), [0] * k, cache)
                    times.setdefault((name, ctx, k), []).append((time.perf_counter() - t0) * 1e3)
    Transformer._layer_stack = stack
    m._layer_stack()
    m._stack_tokens = True
    rows = []
    print("| ctx | rows | ids to logits ms | layers in one call ms | a call per layer ms | ids to logits faster |")
    print("|---|---|---|---|---|---|")
    for ctx in args.ctx:
        for k in args.ks:
            a, b, c = (statistics.median(times[(n, ctx, k)]) for n in ways)
            rows.append({"ctx": ctx, "k": k, "ids_to_logits_ms": round(a, 3), "one_call_ms": round(b, 3),
                         "per_layer_ms": round(c, 3), "ratio_vs_one_call": round(b / a, 3),
                         "ratio_vs_per_layer": round(c / a, 3)})
            print(f"| {ctx} | {k} | {a:.3f} | {b:.3f} | {c:.3f} | {b / a:.3f}x / {c / a:.3f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine.describe("cpu"), "calls": args.calls, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
