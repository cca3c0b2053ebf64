"""Kernel builds side by side on the real target: one-row decode after each of several context
lengths, the builds alternated round by round in one process (as `scripts/kernel_builds.py`, whose
build names it takes: `avx2`, `avx512` or a cached build folder `specplug_gguf_<isa>_<key>`).
Prints per context the median over rounds of each round's median ms, and the ratio to the first.

    python scripts/decode_builds.py --builds specplug_gguf_avx512_<before>,avx512 --ctx 128 256 400 --rounds 16
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import specplug  # noqa: F401  (its OpenMP spin count, before torch loads)
from specplug import machine
from specplug.bench_runtime import _median_ms

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_builds import fill, load_build, step, swappable_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builds", required=True, help="comma-separated: avx2, avx512 or cached build folders")
    p.add_argument("--ctx", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    names = a.builds.split(",")
    builds = {n: load_build(n) for n in names}
    m, use = swappable_model(a.model, a.threads)
    cache = m.new_cache(1, max(2048, max(a.ctx) + 8))  # as kernel_builds.py: the same cells
    ms: dict = {(n, c): [] for n in names for c in a.ctx}
    for rnd in range(a.rounds):
        for n in (names if rnd % 2 == 0 else names[::-1]):
            use(builds[n])
            for c in a.ctx:
                fill(m, cache, c)
                ms[(n, c)].append(_median_ms(step(m, cache, c, 1), a.reps, warmup=3))
    print(f"# {machine.line(machine.describe('cpu'))}; medians of {a.rounds} alternated rounds x {a.reps}")
    rows = []
    for c in a.ctx:
        base = statistics.median(ms[(names[0], c)])
        for n in names:
            v = statistics.median(ms[(n, c)])
            rows.append({"build": n, "ctx": c, "ms": round(v, 3), "vs_first": round(base / v, 3)})
            print(f"ctx {c}: {n} {v:.3f} ms ({base / v:.2f}x)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python scripts/decode_builds.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items()),
                       "machine": machine.describe("cpu"), "threads": a.threads, "rows": rows, "runs":
                       {f"{n}@{c}": v for (n, c), v in ms.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
