"""Ray's overhead on one machine: 2 Ray workers x 1 thread against 1 process x 2 threads, for
`specplug train data` and for `specplug bench`, alternated over --repeats rounds (issue 24).

It starts a local Ray cluster once (`ray start --head`, as on a real head node) and points the
Ray runs at it with `--ray auto`, so the figures are what a user with a running cluster sees:
the workers' start (loading torch and the target) counts, the cluster's own start does not.

    python scripts/ray_scaling.py --repeats 3 --json docs/results/ray-scaling.json

Data generation: the same prompts, `--parallel` sequences per generator; tokens/s = tokens in the
data set / wall time of the command; the two data sets' identities (manifest_sha256) must be
equal. Bench: wall time of the whole command on the same prompts (per-prompt results are equal
by construction; tests/test_ray.py checks it).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specplug.machine import describe

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], env=None) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr[-3000:]}")
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", default="data/train/gsm8k_train.jsonl.gz")
    ap.add_argument("--limit", type=int, default=96, help="prompts for the data generation runs")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--parallel", type=int, default=16, help="sequences per generator")
    ap.add_argument("--shard-prompts", type=int, default=8)
    ap.add_argument("--bench-config", default="examples/bench-ngram.yaml")
    ap.add_argument("--bench-args", default="--data spec_bench --limit 1 --max-tokens 96")
    ap.add_argument("--json")
    args = ap.parse_args()

    from specplug.train.dataset import manifest_sha256

    spl = [sys.executable, "-m", "specplug.cli"]
    ray_bin = str(Path(sys.executable).with_name("ray"))
    tmp = Path(tempfile.mkdtemp(prefix="ray-scaling-"))
    env = dict(os.environ, RAY_ADDRESS="")
    subprocess.run([ray_bin, "start", "--head", "--num-cpus", "2", "--node-ip-address", "127.0.0.1",
                    "--include-dashboard", "false", "--disable-usage-stats"], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    report = {"command": " ".join(sys.argv), "runs": []}
    try:
        data = spl + ["train", "data", "--prompts", args.prompts, "--limit", str(args.limit), "--max-tokens",
                      str(args.max_tokens), "--parallel", str(args.parallel), "--shard-prompts",
                      str(args.shard_prompts), "--taps", "final,3,15,27"]
        modes = {"process x2": ["--threads", "2"], "ray 2x1": ["--threads", "1", "--ray", "auto", "--ray-workers", "2"]}
        bench = spl + ["bench", args.bench_config, *args.bench_args.split()]
        for rep in range(args.repeats):
            for i, (mode, extra) in enumerate(modes.items() if rep % 2 == 0 else reversed(modes.items())):
                out = tmp / f"data-{rep}-{i}"
                dt = run(data + ["-o", str(out)] + extra, env)
                man = json.loads((out / "manifest.json").read_text())
                tok = man["totals"]["tokens"]
                report["runs"].append({"job": "train data", "mode": mode, "repeat": rep, "seconds": round(dt, 2),
                                       "tokens": tok, "tok_s": round(tok / dt, 1), "identity": manifest_sha256(man)})
                shutil.rmtree(out)
                print(f"train data {mode:<11} run {rep}: {tok / dt:7.1f} tok/s ({dt:.1f} s)",
                      file=sys.stderr, flush=True)
            for i, (mode, extra) in enumerate(modes.items() if rep % 2 == 0 else reversed(modes.items())):
                out = tmp / f"bench-{rep}-{i}"
                dt = run(bench + ["--out", str(out)] + extra, env)
                n = len(json.loads((out / "results.json").read_text()).get("prompts", [])) or None
                report["runs"].append({"job": "bench", "mode": mode, "repeat": rep, "seconds": round(dt, 2),
                                       "prompt_turns": n})
                shutil.rmtree(out)
                print(f"bench      {mode:<11} run {rep}: {dt:.1f} s", file=sys.stderr, flush=True)
    finally:
        subprocess.run([ray_bin, "stop"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(tmp, ignore_errors=True)
    ids = {r["identity"] for r in report["runs"] if r["job"] == "train data"}
    med = {}
    for job, key in (("train data", "tok_s"), ("bench", "seconds")):
        for mode in modes:
            med[(job, mode)] = statistics.median(r[key] for r in report["runs"]
                                                 if r["job"] == job and r["mode"] == mode)
    report["medians"] = {f"{j} / {m}": v for (j, m), v in med.items()}
    report["ratios"] = {"train data tok/s, ray 2x1 / process x2": round(med[("train data", "ray 2x1")]
                                                                      / med[("train data", "process x2")], 3),
                        "bench throughput, ray 2x1 / process x2": round(med[("bench", "process x2")]
                                                                        / med[("bench", "ray 2x1")], 3)}
    report["identical_data_sets"] = len(ids) == 1
    print(json.dumps({"medians": report["medians"], "ratios": report["ratios"],
                      "identical_data_sets": report["identical_data_sets"]}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({**report, "machine": describe()}, indent=1))
    return 0 if len(ids) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
