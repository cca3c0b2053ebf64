"""Where the time goes when the runtime shares the CPU (issue 27): decode tok/s together with the
process's CPU time per token and CPU/wall (cores it got), for threads 1 and 2, idle and beside a
neighbour spinning on core 1. Each setting runs in a fresh process; rounds alternate them.

    python scripts/contention_accounting.py --rounds 2 --json docs/results/contention-accounting.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from specplug.machine import describe

SPIN = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end:\n    pass\n"


def one(threads: int, busy: bool, tokens: int) -> dict:
    from specplug.runtime import load_target

    m = load_target("smollm2-135m", threads=threads).model
    cache = m.new_cache(1, 512)
    m.forward(list(range(100, 164)), list(range(64)), [0] * 64, cache, logits_rows=[63])
    nb = None
    if busy:
        nb = subprocess.Popen([sys.executable, "-c", SPIN])
        os.sched_setaffinity(nb.pid, {sorted(os.sched_getaffinity(0))[-1]})
        time.sleep(0.5)

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    try:
        c0, w0 = cpu(), time.perf_counter()
        for i in range(tokens):
            m.forward([7], [64 + i], [0], cache, logits_rows=[0])
        wall, used = time.perf_counter() - w0, cpu() - c0
    finally:
        if nb:
            nb.kill()
    return {"tok_s": tokens / wall, "cpu_per_wall": used / wall, "cpu_ms_per_token": used / tokens * 1e3,
            "wall_ms_per_token": wall / tokens * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--json")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # THREADS idle|busy: one measurement, as JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1] == "busy", args.tokens)))
        return 0
    settings = [(t, b) for t in (1, 2) for b in ("idle", "busy")]
    runs: dict[str, list[dict]] = {f"threads {t} {b}": [] for t, b in settings}
    for _ in range(args.rounds):
        for t, b in settings:
            out = subprocess.run([sys.executable, __file__, "--one", str(t), b, "--tokens", str(args.tokens)],
                                 capture_output=True, text=True, check=True).stdout
            runs[f"threads {t} {b}"].append(json.loads(out.strip().splitlines()[-1]))
    table = {k: {f: round(statistics.median(r[f] for r in v), 2) for f in v[0]} for k, v in runs.items()}
    print(f"{'setting':<18} {'tok/s':>7} {'cpu/wall':>9} {'cpu ms/tok':>11} {'wall ms/tok':>12}")
    for k, v in table.items():
        print(f"{k:<18} {v['tok_s']:>7} {v['cpu_per_wall']:>9} {v['cpu_ms_per_token']:>11} {v['wall_ms_per_token']:>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python"] + sys.argv), "medians": table, "runs": runs,
                       "machine": describe()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
