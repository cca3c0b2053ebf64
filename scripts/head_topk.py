"""How often the target's next token is among a chain head's k best first-token candidates, in the
engine, and what verifying those k candidates side by side (a first-token tree of width k) could
buy on a verification cost curve.

The head (MTP, Eagle3: a `ChainDrafter`) drafts one token on every step it is asked (`n_max: 1`,
`cost_trim: false`, `stop_below: 0` in CONFIG); its first forward of each draft is made through
the head's logits, so its k best candidates (through its draft vocabulary) are recorded beside
the one it drafts. After each answer, a candidate for position p is a hit when the target's own
greedy token at p is among the first k. First turns of MT-bench's first N questions, greedy.

The replay prices a width-k tree as one verification of k + 1 rows, T(k+1)/T(1) on the curve,
plus one draft call (the k candidates come from the same logits), c in units of a one-row
target forward as measured in this run:

    speedup(k) = (1 + hit(k)) / (T(k + 1) / T(1) + c)

Host overhead is left out, which favours drafting (as in scripts/head_ceiling.py).

    python scripts/head_topk.py CONFIG.yaml N_PROMPTS OUT.json [--curve gguf-avx512]
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch

import specplug  # noqa: F401  (its OpenMP spin count, before torch loads)
from specplug.api import build_engine, prompt_ids
from specplug.bench.data import read_jsonl_prompts
from specplug.config import load_config
from specplug.engine import Request
from specplug.heads.chain import ChainDrafter
from specplug.machine import describe
from specplug.pricing import BUILTIN_CURVES, interpolate_cost

K = 5
# issue 38's targets as a curve: T(2)/T(1) 1.08, T(4)/T(1) 1.15, T(8)/T(1) 1.5
CURVES = {**BUILTIN_CURVES, "issue38-targets": ((1, 1.0), (2, 1.08), (4, 1.15), (8, 1.5))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("n", type=int, help="MT-bench questions (first turns)")
    ap.add_argument("out")
    ap.add_argument("--curve", action="append", choices=sorted(CURVES),
                    help="cost curves to price the trees on (default: gguf-avx512 and issue38-targets)")
    args = ap.parse_args()
    cfg = load_config(args.config)
    eng = build_engine(cfg)
    seen: list[tuple[int, list[int]]] = []  # (position drafted for, its K best target ids)

    def first_step(self, h, tok, pos, seq, rows, raw=False):
        states, logits = self.rt.forward(h, tok, pos, seq, rows, **({"raw": True} if raw else {}))
        top = logits.topk(K, dim=-1).indices
        for j, r in enumerate(rows):
            seen.append((pos[r] + 1, self.rt.d2t[top[j]].tolist()))
        return states, self.loop.pick(logits)

    ChainDrafter._step = first_step  # every forward of a one-token draft is its first
    questions = read_jsonl_prompts(Path("specplug/data/mt_bench/question.jsonl"))[:args.n]
    tok = eng.target.tokenizer
    per_cat = collections.defaultdict(lambda: [0] * (K + 1))  # hits at k = 1..K, then drafts
    for q in questions:
        seen.clear()
        res = eng.run([Request(prompt_ids(tok, q["turns"][0], True), cfg.max_tokens)])[0]
        full = list(res.prompt_ids) + list(res.token_ids)
        c = per_cat[q.get("category", "?")]
        for p, cand in seen:
            if p < len(full):
                c[K] += 1
                for k in range(1, K + 1):
                    c[k - 1] += full[p] in cand[:k]
    drafts = sum(v[K] for v in per_cat.values())
    hit = {k: round(sum(v[k - 1] for v in per_cat.values()) / drafts, 4) for k in range(1, K + 1)}
    spec = eng.specs[0]
    c = spec.stats.draft_s / max(1, spec.stats.draft_calls) / eng.drafting.t_row
    replay = {}
    for name in args.curve or ["gguf-avx512", "issue38-targets"]:
        curve = CURVES[name]
        replay[name] = {"free": {k: round((1 + hit[k]) / interpolate_cost(curve, k + 1), 3) for k in hit},
                        f"c={c:.3f}": {k: round((1 + hit[k]) / (interpolate_cost(curve, k + 1) + c), 3) for k in hit}}
    out = {"config": args.config, "prompts": args.n, "machine": describe("cpu"), "drafts": drafts,
           "topk_hit": hit, "draft_cost_t1": round(c, 3), "tree_speedup": replay,
           "by_category": {cat: {"drafts": v[K], **{f"top{k}": round(v[k - 1] / v[K], 4) for k in range(1, K + 1)}}
                           for cat, v in sorted(per_cat.items())}}
    print(json.dumps(out, indent=1))
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
