"""Our `suffix` speculator beside Arctic Inference's SuffixDecodingCache on the same token streams.

Gets the target's plain greedy answers to a prompt set (specplug's engine, no speculators,
chat template, `--max-tokens` each; every turn of a multi-turn record is a request, the earlier
turns' answers in its messages, as `specplug bench` builds them; a record's `system` replaces
the run's), caches them in `--answers` (a rerun with the same settings skips generation), then
replays speculative decoding offline for both implementations, requests in the set's order, so
the global tree grows as a deployment's does:

- the first answer token comes from the prefill; then at each step the drafter sees
  prompt + answer[:i] and proposes up to `--n-max` tokens; accepted = the longest prefix equal
  to answer[i:]; i advances by accepted + 1 (the target's bonus token). The stop token is not
  part of an answer (specplug's results leave it out), so no draft is credited for it;
- ours (`specplug_ngram.suffix.Suffix`) through its hooks as specplug's engine calls them: the
  prompt rows (`process_batch`, is_prompt), a `draft` per step, `remove(seq, len - 1)` after a
  draft not wholly accepted, the committed rows (the history's last token + the accepted ones),
  and `remove(seq, 0)` at the end, which puts the output into the global tree;
- Arctic's as vLLM's `method: suffix` proposer calls it: `start_request(prompt)`,
  `add_active_response` with each step's new tokens (so a running request's answer is in the
  global tree as it grows), `speculate(context)` per step, `stop_request` at the end;
- `arctic_at_end`: Arctic's C++ trees (`_C.SuffixTree`, the draft rule of its `speculate`) under
  our policy, a request's answer going into the global tree only when it ends: what is left of a
  difference between the first two is then the policy's or the implementation's.

Both get max_tree_depth, max_cached_requests, min_token_prob, max_spec_factor (offset 0) and the
draft cap alike; ours gets no break-even advice and the drafts are not trimmed. Only the drafting
call is timed (`Suffix.draft`, `SuffixDecodingCache.speculate` with a zero-copy int32 view of the
context). Global tree memory: Arctic's `estimate_memory()`; ours, tracemalloc over a rebuild of
its global tree from the same outputs (no eviction happens at these sizes, so the last is the peak).

Arctic is imported from wherever Python finds `arctic_inference` (it needs numpy, which it does not
declare); e.g. from a separate venv that has it installed:

    PYTHONPATH=/tmp/arcticvenv/lib/python3.11/site-packages nice -n 10 \\
        .venv/bin/python scripts/suffix_replay.py --answers /tmp/agent_answers.json --out /tmp/suffix_replay.json

`--no-arctic` replays ours alone; `--ngram-simple` replays ngram-simple beside it; `--curve BENCH.json`
(a `specplug bench` results.json on the same data and machine) adds the most each replay could speed
decoding up by on that run's verification cost curve (`ceilings`: drafting free, and only the
accepted tokens verified), beside what the bench measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tracemalloc
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch


def _load_records(data: str, limit: int | None) -> tuple[str, list[dict]]:
    from specplug.bench.data import DATASETS, dataset_path, read_jsonl_prompts

    path = dataset_path(data) if data in DATASETS else Path(data)
    recs = read_jsonl_prompts(path)
    return str(path), recs[:limit] if limit else recs


def generate(args) -> dict:
    """The target's greedy answers, one entry per request (record turn), in serving order."""
    from specplug.api import build_engine, prompt_ids
    from specplug.config import RunConfig, target_args
    from specplug.engine import Request
    from specplug.runtime import load_target

    path, recs = _load_records(args.data, args.limit)
    cfg = RunConfig(model=args.model, threads=1, max_tokens=args.max_tokens, context=args.context, chat=True)
    target = load_target(cfg.model, **target_args(cfg))
    eng = build_engine(cfg, target, speculators=False)
    tok = target.tokenizer
    out = {"model": args.model, "data": args.data, "limit": args.limit, "max_tokens": args.max_tokens,
           "vocab_size": target.model.config.vocab_size, "requests": []}
    t0 = time.perf_counter()
    n_turns = sum(len(r["turns"]) for r in recs)
    for rec in recs:
        messages: list[dict] = []
        for turn, text in enumerate(rec["turns"]):
            messages.append({"role": "user", "content": text})
            ids = prompt_ids(tok, messages, True, rec.get("system") or cfg.system)
            room = cfg.context - len(ids) - 1
            if room < 1:
                break
            res = eng.run([Request(ids, min(args.max_tokens, room))])[0]
            out["requests"].append({"id": rec["id"], "category": rec["category"], "turn": turn,
                                    "prompt": ids, "answer": res.token_ids, "finish": res.finish_reason})
            messages.append({"role": "assistant", "content": tok.decode(res.token_ids, skip_special=True)})
            n = len(out["requests"])
            print(f"\rgenerating {n}/{n_turns} ({time.perf_counter() - t0:.0f} s)", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    out["generate_s"] = round(time.perf_counter() - t0, 1)
    return out


def _committed(spec, seq: int, start: int, tokens: list[int], prompt: bool) -> None:
    from specplug.types import Batch

    n = len(tokens)
    spec.process_batch(Batch(torch.tensor(tokens, dtype=torch.long), torch.arange(start, start + n),
                             torch.full((n,), seq, dtype=torch.long), {}, prompt), None)


def _accepted(draft, answer: list[int], i: int) -> int:
    a = 0
    for t in draft:
        if i + a >= len(answer) or t != answer[i + a]:
            break
        a += 1
    return a


def _replay_hooks(spec, reqs: list[dict], n_max: int) -> list[tuple]:
    """(category, drafted, accepted, ns) per step, `spec` driven through its hooks as the engine calls
    them (module docstring); a hook it does not have is skipped."""
    from specplug.types import DraftRequest

    feeds, removes = hasattr(spec, "process_batch"), hasattr(spec, "remove")
    steps, seq = [], 0
    for r in reqs:
        prompt, ans = r["prompt"], r["answer"]
        hist = prompt + ans
        if feeds:
            _committed(spec, seq, 0, prompt, True)
        held, i = len(prompt), 1  # committed rows; the first answer token came from the prefill
        while i < len(ans):
            req = DraftRequest(seq, hist[:len(prompt) + i], n_max)
            t0 = time.perf_counter_ns()
            (d,) = spec.draft([req])
            dt = time.perf_counter_ns() - t0
            ids = d.token_ids if d is not None else ()
            a = _accepted(ids, ans, i)
            steps.append((r["category"], len(ids), a, dt))
            n = len(prompt) + i  # the history's length
            if removes and (a < len(ids) or not ids):
                spec.remove(seq, n - 1)
            if feeds:
                _committed(spec, seq, held, hist[held:n + a], False)
            held = n + a
            i += a + 1
        if removes:
            spec.remove(seq, 0)
    return steps


def replay_ours(reqs: list[dict], p: argparse.Namespace, vocab: int) -> tuple[dict, list[tuple]]:
    from specplug_ngram.suffix import Suffix

    spec = Suffix(Suffix.Params(max_tree_depth=p.depth, max_cached_requests=p.max_cached_requests,
                                max_spec_factor=p.factor, min_token_prob=p.min_token_prob),
                  SimpleNamespace(vocab_size=vocab, token_texts=()))
    steps = _replay_hooks(spec, reqs, p.n_max)
    g = spec.glob
    tracemalloc.start()
    from specplug_ngram._suffix_tree import GlobalTree

    copy = GlobalTree(p.depth, p.max_cached_requests, 10**9)
    for o in g.outputs:
        copy.add(o)
    mem = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert copy.tree.n_nodes == g.tree.n_nodes
    return _summary(steps) | {"global_nodes": g.tree.n_nodes, "global_tokens": g.n_tokens,
                              "global_bytes": mem}, steps


def replay_ngram_simple(reqs: list[dict], p: argparse.Namespace, vocab: int) -> tuple[dict, list[tuple]]:
    """ngram-simple (its defaults, the bench's config) on the same streams, every draft verified."""
    from specplug_ngram.simple import NgramSimple

    spec = NgramSimple(NgramSimple.Params(), SimpleNamespace(vocab_size=vocab, max_ctx=p.context))
    steps = _replay_hooks(spec, reqs, p.n_max)
    return _summary(steps), steps


def ceilings(steps: list[tuple], curve: list[list[float]]) -> dict:
    """What the replayed drafts could give at most on the machine whose verification cost curve is
    `curve` ([[rows, T(rows)/T(1)], ...], a bench JSON's settings.verify_curve.points): tokens a step
    over the step's cost in one-row forwards, drafting free, summed over the steps. `oracle`: only
    the accepted tokens verified (no trimming rule can verify fewer rows and keep them); `whole`:
    every draft verified whole."""
    from specplug.pricing import interpolate_cost as cost

    tokens = sum(s[2] + 1 for s in steps)
    return {"oracle": round(tokens / sum(cost(curve, 1 + s[2]) for s in steps), 3),
            "whole": round(tokens / sum(cost(curve, 1 + s[1]) for s in steps), 3)}


def replay_arctic(reqs: list[dict], p: argparse.Namespace) -> dict:
    import numpy as np
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=p.depth, max_cached_requests=p.max_cached_requests)
    steps = []
    for rid, r in enumerate(reqs):
        prompt, ans = r["prompt"], r["answer"]
        hist = np.asarray(prompt + ans, dtype=np.int32)
        cache.start_request(rid, np.asarray(prompt, dtype=np.int32))
        cache.add_active_response(rid, hist[len(prompt):len(prompt) + 1])
        i = 1
        while i < len(ans):
            ctx = hist[:len(prompt) + i]
            t0 = time.perf_counter_ns()
            d = cache.speculate(rid, ctx, max_spec_tokens=p.n_max, max_spec_factor=p.factor,
                                min_token_prob=p.min_token_prob)
            dt = time.perf_counter_ns() - t0
            a = _accepted(d.token_ids, ans, i)
            steps.append((r["category"], len(d.token_ids), a, dt))
            new = hist[len(prompt) + i:len(prompt) + i + a + 1]
            if len(new):
                cache.add_active_response(rid, new)
            i += a + 1
        cache.stop_request(rid)
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("arctic_inference")
    except PackageNotFoundError:
        release = None
    return _summary(steps) | {"global_bytes": cache._global_tree.estimate_memory(), "arctic_inference": release}


def replay_arctic_at_end(reqs: list[dict], p: argparse.Namespace) -> dict:
    """Arctic's C++ trees under our policy: a finished request's answer goes into the global tree at
    its end, not while it runs (the draft rule is SuffixDecodingCache.speculate's: the request tree's
    draft unless the global tree's scores higher)."""
    import numpy as np
    from arctic_inference.suffix_decoding._C import SuffixTree

    glob, steps = SuffixTree(p.depth), []
    for rid, r in enumerate(reqs):
        prompt, ans = r["prompt"], r["answer"]
        hist = np.asarray(prompt + ans, dtype=np.int32)
        local = SuffixTree(p.depth)
        local.extend_ndarray(0, hist[:len(prompt) + 1])
        i = 1
        while i < len(ans):
            ctx = hist[max(0, len(prompt) + i - p.depth):len(prompt) + i]
            t0 = time.perf_counter_ns()
            d1 = local.speculate_ndarray(ctx, p.n_max, p.factor, 0.0, p.min_token_prob, False)
            d2 = glob.speculate_ndarray(ctx, p.n_max, p.factor, 0.0, p.min_token_prob, False)
            d = d1 if d1.score >= d2.score else d2
            dt = time.perf_counter_ns() - t0
            a = _accepted(d.token_ids, ans, i)
            steps.append((r["category"], len(d.token_ids), a, dt))
            new = hist[len(prompt) + i:len(prompt) + i + a + 1]
            if len(new):
                local.extend_ndarray(0, new)
            i += a + 1
        if ans:
            glob.extend_ndarray(rid, hist[len(prompt):])
    return _summary(steps) | {"global_bytes": glob.estimate_memory()}


def _figures(steps: list[tuple]) -> dict:
    acc = [s[2] for s in steps]
    us = sorted(s[3] / 1000 for s in steps)
    return {"steps": len(steps), "accepted_per_step": round(statistics.fmean(acc), 3),
            "tokens_per_step": round(statistics.fmean(acc) + 1, 3),
            "drafted_share": round(sum(1 for s in steps if s[1]) / len(steps), 3),
            "drafted_per_step": round(statistics.fmean(s[1] for s in steps), 3),
            "us_median": round(us[len(us) // 2], 1), "us_p90": round(us[int(len(us) * 0.9)], 1)}


def _summary(steps: list[tuple]) -> dict:
    by = defaultdict(list)
    for s in steps:
        by[s[0]].append(s)
    return _figures(steps) | {"by_category": {c: _figures(v) for c, v in by.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="agent_traffic", help="bundled data set or .jsonl file")
    ap.add_argument("--limit", type=int, default=None, help="first N records only")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--answers", required=True, help="JSON cache of the greedy answers (written if missing)")
    ap.add_argument("--out", help="write the figures here (JSON)")
    ap.add_argument("--n-max", type=int, default=16)
    ap.add_argument("--depth", type=int, default=24, help="max_tree_depth")
    ap.add_argument("--max-cached-requests", type=int, default=10000)
    ap.add_argument("--min-token-prob", type=float, default=0.1)
    ap.add_argument("--factor", type=float, default=1.0, help="max_spec_factor")
    ap.add_argument("--no-arctic", action="store_true", help="replay ours only")
    ap.add_argument("--per-category", type=int, default=None, metavar="N", help="replay only the first N records "
                    "of each category, in order (as `specplug bench --limit N` serves them)")
    ap.add_argument("--ngram-simple", action="store_true", help="also replay ngram-simple")
    ap.add_argument("--curve", metavar="BENCH.json", help="a `specplug bench` results.json on this data: its "
                    "verification cost curve gives each replay's most possible speedup (`ceilings`)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    key = {"model": args.model, "data": args.data, "limit": args.limit, "max_tokens": args.max_tokens}
    cached = None
    if Path(args.answers).is_file():
        cached = json.loads(Path(args.answers).read_text())
        if any(cached.get(k) != v for k, v in key.items()):
            print(f"{args.answers} was made with other settings: generating again", file=sys.stderr)
            cached = None
    if cached is None:
        cached = generate(args)
        Path(args.answers).write_text(json.dumps(cached))
    reqs = cached["requests"]
    if args.per_category:
        first: dict[str, list] = defaultdict(list)  # category -> its first records' ids, in order
        for r in reqs:
            ids = first[r["category"]]
            if r["id"] not in ids and len(ids) < args.per_category:
                ids.append(r["id"])
        reqs = [r for r in reqs if r["id"] in first[r["category"]]]

    params = {k: getattr(args, k) for k in ("n_max", "depth", "max_cached_requests", "min_token_prob", "factor")}
    ours, steps = replay_ours(reqs, args, cached["vocab_size"])
    result = {"answers": key | {"per_category": args.per_category, "requests": len(reqs),
                                "answer_tokens": sum(len(r["answer"]) for r in reqs)},
              "params": params, "ours": ours}
    replays = {"ours": steps}
    if args.ngram_simple:
        result["ngram_simple"], replays["ngram_simple"] = replay_ngram_simple(reqs, args, cached["vocab_size"])
    if args.curve:
        bench = json.loads(Path(args.curve).read_text())
        curve = bench["settings"]["verify_curve"]["points"]
        result["ceilings"] = {"curve": curve, "from": args.curve,
                              "measured_decode_speedup": {k: v.get("decode_speedup")
                                                          for k, v in bench["overall"].items()},
                              **{name: ceilings(st, curve) for name, st in replays.items()}}
    if not args.no_arctic:
        result["arctic"] = replay_arctic(reqs, args)
        result["arctic_at_end"] = replay_arctic_at_end(reqs, args)
    if args.out:
        from specplug.machine import describe

        Path(args.out).write_text(json.dumps(result | {"machine": describe("cpu")}, indent=1))

    cols = ("accepted_per_step", "tokens_per_step", "drafted_share", "us_median", "us_p90", "global_bytes")
    print(f"{len(reqs)} requests, {result['answers']['answer_tokens']} answer tokens, {params}")
    print("| implementation | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    names = ("ours", "ngram_simple", "arctic", "arctic_at_end")
    for name in names:
        if name in result:
            print(f"| {name} | " + " | ".join(str(result[name].get(c)) for c in cols) + " |")
    if "ceilings" in result:
        c = result["ceilings"]
        print(f"most possible speedups on {c['from']}'s cost curve (drafting free): "
              + ", ".join(f"{n}: {c[n]['oracle']}x verifying only what is accepted, {c[n]['whole']}x every draft whole"
                          for n in replays))
    for name in names:
        for cat, f in result.get(name, {}).get("by_category", {}).items():
            print(f"  {name} {cat}: accepted/step {f['accepted_per_step']}, drafted {f['drafted_share']}, "
                  f"steps {f['steps']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
