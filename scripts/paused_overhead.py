"""What a speculator costs while it is paused: plain decoding against the same config with every
speculator paused from the start (its value set negative, no probe), and against plain decoding
that computes the speculators' taps, on one answer, runs alternated; decode time, median.

    python scripts/paused_overhead.py examples/eagle3.yaml --max-tokens 256 --runs 8
"""
from __future__ import annotations

import argparse
import statistics
import time

from specplug.api import build_engine, prompt_ids
from specplug.config import load_config, target_args
from specplug.engine import Request
from specplug.runtime import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--prompt", default="Write a long story about a dragon who learns to cook.")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=8)
    args = ap.parse_args()
    cfg = load_config(args.config)
    target = load_target(cfg.model, **target_args(cfg))
    cache = target.model.new_cache(1, cfg.context)
    engines = {"plain": build_engine(cfg, target, False, cache), "plain+taps": build_engine(cfg, target, False, cache),
               "paused": build_engine(cfg, target, True, cache)}
    engines["plain+taps"].taps = engines["paused"].taps
    for s in engines["paused"].specs:
        s.value, s.probe = -1.0, 10 ** 9  # paused from a sequence's start, never probed
    ids = prompt_ids(target.tokenizer, args.prompt, cfg.chat, cfg.system)

    def decode_s(eng) -> float:
        t0 = time.perf_counter()
        r = eng.run([Request(ids, args.max_tokens)])[0]
        return time.perf_counter() - t0 - r.stats.time_prefill_s

    for e in engines.values():
        decode_s(e)  # warm
    names, times = list(engines), {n: [] for n in engines}
    for i in range(args.runs):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(decode_s(engines[n]))
    med = {n: statistics.median(v) for n, v in times.items()}
    asked = sum(s.asked for s in engines["paused"].stats.speculators.values())
    print(f"taps {sorted(engines['paused'].taps)}; drafts asked while paused: {asked}")
    for n in names:
        print(f"{n:<11} decode {med[n] * 1e3:8.1f} ms  plain/this {med['plain'] / med[n]:.3f}  "
              f"(runs {', '.join(f'{t * 1e3:.0f}' for t in times[n])})")


if __name__ == "__main__":
    main()
