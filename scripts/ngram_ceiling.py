"""How much decoding speedup could copying from the context buy at best, on this runtime?

Runs plain greedy decoding on a prompt set, then replays each output against drafters that
know the answer, pricing every verification forward with the runtime's T(k)/T(1) curve
(`specplug.pricing`), the same curve the engine trims drafts with:

- `copy oracle`: drafts the longest prefix of the true continuation that occurs anywhere in
  the context (prompt + output so far), at most `n_max` tokens: any copy-based drafter's ceiling;
- `lookup oracle`: among all earlier occurrences of the last token, the continuation that
  matches the truth longest, cut to the length that pays best: prompt lookup with perfect
  choice of occurrence and of draft length;
- `longest match, perfect cut`: ngram-simple's choice of occurrence (longest backward match),
  with the draft cut where the truth diverges (only the length is known in advance).

Speedups are decode-phase ratios: generated tokens after the first, over summed forward costs
in units of a one-token forward (host overhead and drafting time are left out, which favours
the oracles). Usage:

    python scripts/ngram_ceiling.py --data spec_bench --categories summarization,rag --limit 20
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

from specplug.api import build_engine, prompt_ids
from specplug.bench.cli import select_prompts
from specplug.bench.data import DATASETS, dataset_path, read_jsonl_prompts
from specplug.config import load_config, target_args
from specplug.engine import Request
from specplug.pricing import for_run
from specplug.runtime import load_target


def _occurs(hay: str, needle: list[int]) -> bool:
    return ("," + ",".join(map(str, needle)) + ",") in hay


def copy_oracle(prompt, gen, cost, n_max):
    toks, spent, i = list(prompt) + [gen[0]], 0.0, 1
    while i < len(gen):
        hay = "," + ",".join(map(str, toks)) + ","
        k = 0
        while k < min(n_max, len(gen) - i - 1) and _occurs(hay, gen[i:i + k + 1]):
            k += 1
        spent += cost(1 + k)
        toks += gen[i:i + k + 1]
        i += k + 1
    return spent


def _best_cut(k_max: int, cost) -> int:
    return max(range(k_max + 1), key=lambda k: (k + 1) / cost(k + 1))


def lookup_oracle(prompt, gen, cost, n_max):
    toks, spent, i = list(prompt) + [gen[0]], 0.0, 1
    while i < len(gen):
        truth, end, best = gen[i:i + min(n_max, len(gen) - i - 1)], len(toks), 0
        for j in range(end - 2, -1, -1):
            if toks[j] == toks[-1]:
                r = 0
                while r < len(truth) and j + 1 + r < end and toks[j + 1 + r] == truth[r]:
                    r += 1
                best = max(best, r)
        k = _best_cut(best, cost)
        spent += cost(1 + k)
        toks += gen[i:i + k + 1]
        i += k + 1
    return spent


def longest_match_cut(prompt, gen, cost, n_max, match_max=16):
    toks, spent, i = list(prompt) + [gen[0]], 0.0, 1
    while i < len(gen):
        end, best = len(toks), (0, -1)
        for j in range(end - 2, -1, -1):
            if toks[j] == toks[-1]:
                m = 1
                while m < match_max and j - m >= 0 and toks[j - m] == toks[end - 1 - m]:
                    m += 1
                if m > best[0]:
                    best = (m, j + 1)
        a = 0
        if best[1] >= 0:
            f, limit = best[1], min(n_max, len(gen) - i - 1)
            while a < limit and f + a < end and toks[f + a] == gen[i + a]:
                a += 1
        k = _best_cut(a, cost)
        spent += cost(1 + k)
        toks += gen[i:i + k + 1]
        i += k + 1
    return spent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parent.parent / "examples" / "bench-ngram.yaml"))
    ap.add_argument("--data", default="spec_bench")
    ap.add_argument("--categories", default="summarization,rag")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--n-max", type=int, default=16)
    args = ap.parse_args()
    cfg = load_config(args.config, {"max_tokens": args.max_tokens})
    target = load_target(cfg.model, **target_args(cfg))
    eng = build_engine(cfg, target, speculators=False)
    path = dataset_path(args.data) if args.data in DATASETS else args.data
    recs = select_prompts(read_jsonl_prompts(path), args.categories, args.limit, str(path))
    cost = for_run(target.model, cfg).cost
    sums: dict = collections.defaultdict(lambda: collections.Counter())
    for n, rec in enumerate(recs, 1):
        ids = prompt_ids(target.tokenizer, rec["turns"][0], cfg.chat, cfg.system)
        gen = eng.run([Request(ids, cfg.max_tokens)])[0].token_ids
        if len(gen) < 2:
            continue
        s = sums[rec["category"]]
        s["plain"] += len(gen) - 1
        s["copy oracle"] += copy_oracle(ids, gen, cost, args.n_max)
        s["lookup oracle"] += lookup_oracle(ids, gen, cost, args.n_max)
        s["longest match, perfect cut"] += longest_match_cut(ids, gen, cost, args.n_max)
        print(f"\r{n}/{len(recs)} prompts", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    print(f"runtime {target.model.quant}; T(k)/T(1) for k = 2, 4, 8, 16: "
          + ", ".join(f"{cost(k):.2f}" for k in (2, 4, 8, 16)))
    print("| category | copy oracle | lookup oracle | longest match, perfect cut |")
    print("|---|---|---|---|")
    for cat, s in sums.items():
        cells = " | ".join(f"{s['plain'] / s[k]:.2f}x" for k in ("copy oracle", "lookup oracle",
                                                               "longest match, perfect cut"))
        print(f"| {cat} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
