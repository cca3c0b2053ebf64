"""The target's weights and KV cache on 2 MB pages (specplug.runtime.pages) against 4 KB pages, side
by side in one process: two copies of the model, one loaded with SPECPLUG_HUGE_PAGES=0, each with its
own cache; decode at ctx 128, T(k) = one forward of k rows after 512 tokens, prefill 512 (as
`specplug bench-runtime` and scripts/kernel_builds.py measure them), alternated in rounds (ABBA),
medians. The two hold the same bytes, so they compute the same bits; the script checks that too.

    python scripts/huge_pages_ab.py --rounds 5 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import specplug  # noqa: F401  (its OpenMP spin count, before torch loads)
from specplug import machine
from specplug.bench_runtime import _streamed_weights
from specplug.runtime import load_target, pages

sys.path.insert(0, str(Path(__file__).parent))
from kernel_builds import measure, round_medians  # noqa: E402  (the same figures as kernel builds side by side)


def both_page_sizes(model: str, threads: int) -> dict:
    """{"4 KB pages": model, "2 MB pages": model}: two copies of the target, the first loaded with
    SPECPLUG_HUGE_PAGES=0 (the caller's setting of it restored after)."""
    if not pages.enabled():
        raise SystemExit(f"2 MB pages are not available here (THP mode {pages.thp_mode()!r}, {pages.ENV}="
                         f"{os.environ.get(pages.ENV)!r})")
    before = os.environ.get(pages.ENV)
    models = {}
    try:
        for name, env in (("4 KB pages", "0"), ("2 MB pages", "1")):
            os.environ[pages.ENV] = env
            models[name] = load_target(model, device="cpu", quant="gguf", threads=threads).model
    finally:
        if before is None:
            os.environ.pop(pages.ENV)
        else:
            os.environ[pages.ENV] = before
    return models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    models = both_page_sizes(args.model, args.threads)
    caches = {name: m.new_cache(1, 2048) for name, m in models.items()}
    names = list(models)
    logits = []
    for n in names:  # same bytes, same bits
        caches[n].clear(0)
        logits.append(models[n].forward(list(range(100, 164)), list(range(64)), [0] * 64, caches[n],
                                        logits_rows=[63]).logits)
    if not bool((logits[0] == logits[1]).all()):
        raise SystemExit("the two copies computed different logits")
    runs: dict[str, list[dict]] = {}
    for rnd in range(args.rounds):
        for n in (names if rnd % 2 == 0 else names[::-1]):
            runs.setdefault(n, []).append(measure(models[n], caches[n], args.reps))
    medians, placed = {}, {}
    for n in names:
        medians[n] = round_medians(runs[n])
        huge, total = pages.huge_page_bytes(_streamed_weights(models[n]))
        placed[n] = {"weights_on_2mb_pages_mb": round(huge / 1e6, 1), "weights_mb": round(total / 1e6, 1)}
        print(f"{n}: {json.dumps(medians[n])}  weights on 2 MB pages: {placed[n]['weights_on_2mb_pages_mb']} of "
              f"{placed[n]['weights_mb']} MB")
    a, b = medians[names[0]], medians[names[1]]
    print(f"2 MB pages vs 4 KB: decode {a['decode128'] / b['decode128']:.2f}x, T(1) {a['T1'] / b['T1']:.2f}x, "
          f"T(4) {a['T4'] / b['T4']:.2f}x, T(8) {a['T8'] / b['T8']:.2f}x, "
          f"prefill {b['prefill_tok_s'] / a['prefill_tok_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python", *sys.argv]), "machine": machine.describe("cpu"),
                       "threads": args.threads, "rounds": args.rounds, "thp_mode": pages.thp_mode(),
                       "placed": placed, "medians": medians, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
