"""Load test of the `suffix` speculator's memory: many requests through one instance, RSS over time.

One Suffix instance (as `specplug serve` holds one per engine) sees N requests in turn through the
hooks the host calls: the prompt's rows (`process_batch`), then the answer a few rows a step with a
`draft` before each step, then `remove(seq, 0)`, which puts the output into the global tree. The
requests are the target's answers to a prompt set, cycled (`--answers`: the cache of
scripts/suffix_replay.py); with `--mutate F` each cycled answer has a share F of its tokens replaced
by random ones, so later cycles add new substrings (a deployment never repeats itself exactly) and
the tree's caps (`max_cached_requests`, `max_cached_tokens`), not the repetition, bound it. Every
`--every` requests: the process's resident memory (VmRSS), the global tree's outputs, tokens and nodes.

    python scripts/suffix_load.py --answers agent_answers.json --requests 10000 --json load.json --plot load.png
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--answers", required=True, help="scripts/suffix_replay.py's answers cache (JSON)")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--mutate", type=float, default=0.1, help="share of each cycled answer's tokens replaced")
    ap.add_argument("--every", type=int, default=250)
    ap.add_argument("--step-rows", type=int, default=3, help="answer rows committed per step")
    ap.add_argument("--param", nargs="*", default=[], metavar="KEY=VALUE", help="Suffix.Params overrides")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    a = ap.parse_args()

    from specplug_ngram.suffix import Suffix

    from specplug.types import Batch, DraftRequest

    data = json.loads(Path(a.answers).read_text())
    reqs = [r for r in data["requests"] if r["answer"]]
    vocab = int(data["vocab_size"])
    params = Suffix.Params(**{k: json.loads(v) for k, v in (p.split("=", 1) for p in a.param)})
    info = type("Info", (), {"vocab_size": vocab, "token_texts": [str(i) for i in range(vocab)]})()
    spec = Suffix(params, info)
    rng = random.Random(0)
    rows, t0, drafts = [], time.perf_counter(), 0

    def commit(seq: int, start: int, toks: list[int], prompt: bool) -> None:
        n = len(toks)
        spec.process_batch(Batch(torch.tensor(toks, dtype=torch.long), torch.arange(start, start + n),
                                 torch.full((n,), seq, dtype=torch.long), {}, prompt), None)

    base_rss = rss_mb()
    for k in range(a.requests):
        r = reqs[k % len(reqs)]
        answer = list(r["answer"])
        if k >= len(reqs) and a.mutate > 0:  # a later cycle: some tokens differ
            answer = [rng.randrange(vocab) if rng.random() < a.mutate else t for t in answer]
        prompt = list(r["prompt"])
        commit(0, 0, prompt[:-1], True)
        hist = prompt
        i = 0
        while i < len(answer):
            spec.draft([DraftRequest(0, tuple(hist), 16)])
            drafts += 1
            step = answer[i:i + a.step_rows]
            commit(0, len(hist) - 1, [hist[-1]] + step[:-1], False)
            hist = hist + step
            i += len(step)
        spec.remove(0, 0)
        if (k + 1) % a.every == 0 or k + 1 == a.requests:
            g = spec.glob
            rows.append({"requests": k + 1, "rss_mb": round(rss_mb(), 1), "outputs": len(g.outputs),
                         "tokens": g.n_tokens, "nodes": g.tree.n_nodes, "s": round(time.perf_counter() - t0, 1)})
            print(json.dumps(rows[-1]), flush=True)
    from specplug.machine import describe

    out = {"machine": describe("cpu"), "answers": a.answers, "requests": a.requests, "mutate": a.mutate,
           "params": vars(params),
           "rss_start_mb": round(base_rss, 1), "drafts": drafts, "rows": rows,
           "rss_peak_mb": max(r["rss_mb"] for r in rows),
           "rss_last_quarter_growth_mb": round(rows[-1]["rss_mb"] - rows[3 * len(rows) // 4]["rss_mb"], 1)}
    print(f"RSS {base_rss:.0f} MB at start, {out['rss_peak_mb']:.0f} MB peak, {rows[-1]['rss_mb']:.0f} MB after "
          f"{a.requests} requests (growth over the last quarter: {out['rss_last_quarter_growth_mb']} MB); global tree "
          f"{rows[-1]['outputs']} outputs, {rows[-1]['tokens']} tokens, {rows[-1]['nodes']} nodes")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.plot([r["requests"] for r in rows], [r["rss_mb"] for r in rows], label="RSS (MB)")
        ax2 = ax.twinx()
        ax2.plot([r["requests"] for r in rows], [r["nodes"] / 1e6 for r in rows], color="tab:orange",
                 label="global tree nodes (M)")
        ax.set_xlabel("requests")
        ax.set_ylabel("RSS (MB)")
        ax2.set_ylabel("nodes (millions)")
        fig.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(a.plot, dpi=100)


if __name__ == "__main__":
    main()
