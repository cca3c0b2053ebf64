"""Two checkouts of specplug side by side: forwards of k rows after 512 tokens, each checkout in its own
process, the processes alternated round by round (old, new; then new, old; ...), medians per round and
the rounds' ratios. For a change that moves both the kernels and how the loader lays out the weights
(a tile layout), which `scripts/interleaved_builds.py` cannot time: it swaps kernel builds under one
loaded model. Each checkout imports its own package (its folder first on sys.path) and builds its own
kernels once (the build key names the source's path).

    git worktree add /tmp/old <commit>
    python scripts/checkouts_ab.py --old /tmp/old --new . --model /path/to/model.gguf --rounds 4 \\
        --calls 30 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

KS = (1, 2, 4, 8)

# run inside each checkout: its own package first on sys.path
CHILD = r"""
import json, os, statistics, sys, time
sys.path.insert(0, os.getcwd())
import specplug  # noqa: F401  (its OpenMP spin count, before torch loads)
import torch
from specplug import machine
from specplug.runtime import load_target
model, calls, threads, ks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [int(k) for k in sys.argv[4].split(",")]
m = load_target(model, threads=threads).model
cache = m.new_cache(1, 2048)
for s in range(0, 512, 128):
    m.forward([(100 + i) % len(m.embed) for i in range(s, s + 128)], list(range(s, s + 128)), [0] * 128, cache,
              logits_rows=[])
ms = {}
for k in ks:
    def fwd():
        m.forward([7] * k, list(range(512, 512 + k)), [0] * k, cache, logits_rows=None)
        cache.seq_rm(0, 512)
    for _ in range(3):
        fwd()
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fwd()
        ts.append((time.perf_counter() - t0) * 1e3)
    ms[k] = statistics.median(ts)
kinds = sorted({lin.kind for layer in m.layers for lin in layer.linears()})
print(json.dumps({"ms": ms, "kinds": kinds, "machine": machine.describe("cpu")}))
"""


def run(checkout: str, model: str, calls: int, threads: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, model, str(calls), str(threads), ",".join(map(str, KS))],
                         cwd=checkout, capture_output=True, text=True, timeout=1200)
    if out.returncode:
        raise SystemExit(f"{checkout}: the forward run failed:\n{out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["ms"] = {int(k): v for k, v in r["ms"].items()}
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="the checkout to compare against")
    p.add_argument("--new", required=True)
    p.add_argument("--model", required=True, help="a GGUF file (or a name specplug resolves)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--calls", type=int, default=30, help="timed forwards per k in each process")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for rnd in range(a.rounds):
        for who in ("old", "new") if rnd % 2 == 0 else ("new", "old"):
            r = run(getattr(a, who), a.model, a.calls, a.threads)
            runs[who].append(r)
            print(f"round {rnd} {who}: " + "  ".join(f"k={k} {r['ms'][k]:.2f}" for k in KS), file=sys.stderr, flush=True)
    ratio = {k: [o["ms"][k] / n["ms"][k] for o, n in zip(runs["old"], runs["new"])] for k in KS}
    med = {who: {k: round(statistics.median(r["ms"][k] for r in rs), 3) for k in KS} for who, rs in runs.items()}
    new_m, old_m = runs["new"][0]["machine"], runs["old"][0]["machine"]
    print(f"# {a.model}; forward of k rows after 512 tokens, medians of {a.calls} calls a process, {a.rounds} rounds; "
          f"new {new_m.get('commit')} (kinds {','.join(runs['new'][0]['kinds'])}) against old {old_m.get('commit')} "
          f"(kinds {','.join(runs['old'][0]['kinds'])})")
    for k in KS:
        print(f"k={k}: old {med['old'][k]:.2f} ms, new {med['new'][k]:.2f} ms; new faster by "
              f"{statistics.median(ratio[k]):.3f}x (rounds: {' '.join(f'{v:.3f}' for v in ratio[k])})")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "command": " ".join(["python", *sys.argv]), "machine": new_m, "old_commit": old_m.get("commit"),
            "model": a.model, "threads": a.threads, "rounds": a.rounds, "calls": a.calls,
            "kinds": {"old": runs["old"][0]["kinds"], "new": runs["new"][0]["kinds"]},
            "medians_ms": med, "new_faster": {k: round(statistics.median(v), 3) for k, v in ratio.items()},
            "rounds_new_faster": {k: [round(x, 3) for x in v] for k, v in ratio.items()},
            "runs_ms": {who: [r["ms"] for r in rs] for who, rs in runs.items()}}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    main()
