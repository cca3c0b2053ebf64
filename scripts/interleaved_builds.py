"""Kernel builds timed call by call in turn, for a VM that drifts faster than rounds can cancel.

`kernel_builds.py` alternates whole rounds (decode, every T(k), prefill on one build, then the next);
on a VM whose speed moves by 1.5x within minutes, two copies of the same build then read 0.7-1.3x of
each other. Here each build runs one forward (or one walk of the forward's linears) at each k in
turn, the order reversed every time, so neighbouring calls share the VM's minute, both between
builds and between row counts (T(k)/T(1) of one build); medians of many.

  forward:  one forward of k rows after 512 tokens (--ctx), as the engine runs it (T(k))
  prefill:  a prompt of k tokens into an empty sequence, the last one's logits (--ks 512 by default)
  linears:  the forward's 121 linears at k rows, one call each (and beside them the floor,
            `stream_dots`: the least work on the same bytes, on the first build)

A build is `avx2` or `avx512` (this checkout's) or a folder in the torch extensions cache
(`specplug_gguf_<tag>`, e.g. one built with other -D defines), as in kernel_builds.py.

    python scripts/interleaved_builds.py --builds specplug_gguf_before,avx512,specplug_gguf_before2 \
        --what forward --calls 100 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import specplug  # noqa: F401  (its OpenMP spin count, before torch loads)
from specplug import machine
from specplug.bench_runtime import floor_parts, walk_floor
from specplug.runtime.native import QuantLinear

sys.path.insert(0, str(Path(__file__).parent))
from kernel_builds import fill, load_build, prefill, step, swappable_model  # noqa: E402

KS = (1, 2, 4, 8, 16)


def timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builds", required=True, help="comma-separated; the first is the one the others are compared with")
    p.add_argument("--what", choices=("forward", "linears", "prefill"), default="forward")
    p.add_argument("--calls", type=int, default=60, help="timed calls per build and k")
    p.add_argument("--ks", type=int, nargs="+", default=None,
                   help="row counts (each forward computes every row's logits, as a verification does); "
                        f"prompt lengths for prefill (default: {' '.join(map(str, KS))}; prefill 512)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--ctx", type=int, default=512, help="tokens in the cache before the timed rows")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    names = a.builds.split(",")
    if len(set(names)) != len(names):
        raise SystemExit("--builds: each build once (for a null, build a second copy under another tag)")
    builds = {n: load_build(n) for n in names}
    m, use = swappable_model(a.model, a.threads)
    lins = [x for layer in m.layers for x in layer.linears()] + [m.head]
    lins = [x for x in lins if isinstance(x, QuantLinear)]
    cache = m.new_cache(1, 2048)
    if a.ks is None:
        a.ks = [512] if a.what == "prefill" else list(KS)
    if a.what == "prefill":
        if not all(1 <= k <= cache.max_ctx for k in a.ks):
            raise SystemExit(f"--ks {a.ks}: prompt lengths between 1 and {cache.max_ctx}")
    else:
        if not 1 <= a.ctx <= cache.max_ctx - max(a.ks):
            raise SystemExit(f"--ctx {a.ctx}: between 1 and {cache.max_ctx - max(a.ks)} "
                             f"(the cache holds {cache.max_ctx} positions)")
        fill(m, cache, a.ctx)
    g = torch.Generator().manual_seed(0)
    runs: dict[tuple[str, int], list[float]] = {}
    parts = floor_parts(lins)
    calls = []  # (build, k, call): every build at every k, all timed in turn
    ks = a.ks
    for k in ks:
        if a.what in ("forward", "prefill"):
            f = step(m, cache, a.ctx, k) if a.what == "forward" else prefill(m, cache, k)

            def run(n, f=f):
                use(builds[n])
                return timed(f)
            calls += [(n, k, lambda n=n, run=run: run(n)) for n in names]
        else:
            xs = [lin.quantize(torch.randn(k, lin.qs.shape[1] * 32, generator=g)) for lin in lins]

            def walk(n, xs=xs):
                use(builds[n])
                return timed(lambda: [lin.matmul(xa) for lin, xa in zip(lins, xs)])
            calls += [(n, k, lambda n=n, walk=walk: walk(n)) for n in names] + [
                ("floor", k, lambda k=k: 1e3 * walk_floor(builds[names[0]], parts, k))]
    for _, _, c in calls:  # warm
        c()
    for i in range(a.calls):
        for n, k, c in (calls if i % 2 == 0 else calls[::-1]):
            runs.setdefault((n, k), []).append(c())
    med = {key: statistics.median(v) for key, v in runs.items()}
    rows = names + (["floor"] if a.what == "linears" else [])
    what = "prefill of k tokens" if a.what == "prefill" else f"{a.what} at k rows after {a.ctx} tokens"
    print(f"# {machine.line(machine.describe('cpu'))}; {what}, {a.calls} calls a build and k in turn; medians ms")
    print("build".ljust(30) + "".join(f"k={k}".ljust(9) for k in ks) + f"  over k={ks[0]}")
    for n in rows:
        print(n.ljust(30) + "".join(f"{med[(n, k)]:<9.2f}" for k in ks) + "  " +
              " / ".join(f"{med[(n, k)] / med[(n, ks[0])]:.2f}" for k in ks[1:]))
    for n in names[1:]:
        print(f"{names[0]} / {n}: " + " ".join(f"k={k} {med[(names[0], k)] / med[(n, k)]:.3f}x" for k in ks))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"command": "python scripts/interleaved_builds.py " + " ".join(sys.argv[1:]),
                       "machine": machine.describe("cpu"), "threads": a.threads, "what": a.what,
                       "ctx": None if a.what == "prefill" else a.ctx,
                       "calls": a.calls,
                       "medians_ms": {f"{n}@{k}": round(v, 3) for (n, k), v in med.items()}}, fh, indent=1)


if __name__ == "__main__":
    main()
