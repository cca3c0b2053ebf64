"""Peak RSS per sequence slot of each speculator: what `parallel: N` costs beyond plain decoding.

For each speculator of a config (and plain decoding), in a fresh process each: an engine with
`parallel: 1`, then one with `parallel: N`, each running the same N prompts (MT-bench's first turns,
`--max-tokens` each) to the end; the peak RSS (ru_maxrss) of each process. Per added slot:
(RSS(N) - RSS(1)) / (N - 1), and beyond plain: that less plain decoding's. A speculator with a cache
of its own for the context pays its cells per slot; one that reads the target's (kvdraft) does not.

    python scripts/rss_per_slot.py examples/bench-heads-priced.yaml --parallel 8 --json rss.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys


def child(config: str, spec: str | None, parallel: int, max_tokens: int) -> None:
    """Run N prompts with one speculator (or none) at `parallel`; print the peak RSS in MB."""
    from specplug.api import build_engine, prompt_ids
    from specplug.bench.data import dataset_path, read_jsonl_prompts
    from specplug.config import load_config
    from specplug.engine import Request

    cfg = load_config(config)
    specs = tuple(s for s in cfg.speculators if s.name == spec)
    cfg = dataclasses.replace(cfg, parallel=parallel, speculators=specs)
    eng = build_engine(cfg, speculators=bool(specs))
    recs = read_jsonl_prompts(dataset_path("mt_bench"))[:8]
    ids = [prompt_ids(eng.target.tokenizer, r["turns"][0], True) for r in recs]
    n = max(parallel, 8)
    eng.run([Request(ids[i % len(ids)], max_tokens) for i in range(n)])
    print(json.dumps({"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--only", nargs="*", help="speculator names to measure (default: all but noop)")
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        spec, par, mt = a.child
        child(a.config, None if spec == "-" else spec, int(par), int(mt))
        return
    from specplug.config import load_config
    from specplug.machine import describe

    names = a.only or [s.name for s in load_config(a.config).speculators if s.type != "noop"]
    out = {}
    for name in ["-"] + names:
        rss = {}
        for par in (1, a.parallel):
            res = subprocess.run([sys.executable, __file__, a.config, "--child", name, str(par), str(a.max_tokens)],
                                 capture_output=True, text=True, check=True)
            rss[par] = json.loads(res.stdout.strip().splitlines()[-1])["rss_mb"]
        per_slot = (rss[a.parallel] - rss[1]) / (a.parallel - 1)
        out["plain" if name == "-" else name] = {"rss_1_mb": round(rss[1], 1), "rss_n_mb": round(rss[a.parallel], 1),
                                                 "per_slot_mb": round(per_slot, 2)}
    base = out["plain"]["per_slot_mb"]
    print(f"| speculator | RSS parallel 1 (MB) | RSS parallel {a.parallel} (MB) | per added slot (MB) | beyond plain |")
    print("|---|---|---|---|---|")
    for name, r in out.items():
        r["beyond_plain_mb"] = round(r["per_slot_mb"] - base, 2)
        print(f"| {name} | {r['rss_1_mb']} | {r['rss_n_mb']} | {r['per_slot_mb']} | {r['beyond_plain_mb']:+} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": a.config, "parallel": a.parallel, "max_tokens": a.max_tokens,
                       "machine": describe("cpu"), "results": out}, f, indent=1)


if __name__ == "__main__":
    main()
