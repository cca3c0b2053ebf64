#!/usr/bin/env python
"""How much a head gains by adapting to a stream of traffic it was not trained on (`specplug adapt`).

The stream (`--stream`): Spec-Bench's summarization and RAG first turns, interleaved in the file's
order (160 requests), or the 164 HumanEval prompts in file order (a coding assistant). Its first
half is served with the shipped head and recorded (`specplug run --record`); `specplug adapt`
fine-tunes the head on the recording; the second half is then benched with the shipped head and
the adapted one side by side (`specplug bench`, alternated with plain, greedy, 0 mismatches
required):

- every-step first-token acceptance (`cost_trim: false`, `stop_below: 0`),
- the priced decode speedup (the heads as they ship: priced drafting).

    python scripts/adapt_stream.py --work /work/data/adapt --method eagle3 --threads 2 [--lookup]

Each phase is skipped when its output exists (delete it to redo). The bench phase wants a quiet
machine (`--phase bench` runs it alone, later). The summary goes to --work/summary.json and
docs/results/ (with the machine).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CATEGORIES = ("summarization", "rag")


def sh(*args: str) -> int:
    print("+", " ".join(map(str, args)), flush=True)
    return subprocess.run([str(a) for a in args]).returncode


def stream(out: Path, max_prompt_chars: int, kind: str = "summarization-rag") -> tuple[Path, Path]:
    """The two halves of the stream as prompt files (first turns only, in arrival order).

    summarization-rag: Spec-Bench's two categories interleaved; humaneval: the HumanEval prompts in
    file order, as a coding assistant receives them."""
    if kind == "humaneval":
        from specplug.bench.data import dataset_path, read_jsonl_prompts

        order = [{"question_id": r["id"], "category": "HumanEval", "turns": r["turns"]}
                 for r in read_jsonl_prompts(dataset_path("humaneval")) if len(r["turns"][0]) <= max_prompt_chars]
    else:
        rows = [json.loads(x) for x in (ROOT / "specplug/data/spec_bench/question.jsonl").read_text().splitlines() if x]
        by = {c: [r for r in rows if r["category"] == c and len(r["turns"][0]) <= max_prompt_chars] for c in CATEGORIES}
        n = min(len(v) for v in by.values())
        order = [by[c][i] for i in range(n) for c in CATEGORIES]  # interleaved: a deployment sees both kinds
    half = len(order) // 2
    first, second = out / "first.jsonl", out / "second.jsonl"
    for path, part in ((first, order[:half]), (second, order[half:])):
        path.write_text("".join(json.dumps({"id": r["question_id"], "category": r["category"],
                                            "turns": r["turns"][:1]}) + "\n" for r in part))
    return first, second


def config(path: Path, method: str, heads: dict[str, Path | None], threads: int, max_tokens: int,
           every_step: bool) -> Path:
    lines = ["model: smollm2-135m", "device: cpu", f"threads: {threads}", f"max_tokens: {max_tokens}",
             "context: 4096", "speculators:"]
    for name, head in heads.items():
        lines += [f"  - type: {method}", f"    name: {name}", "    n_max: 6"]
        if head is not None:
            lines.append(f"    head: {head}")
        lines += ["    cost_trim: false", "    stop_below: 0"] if every_step else ["    stop_below: 0.15"]
    if not every_step:
        lines.append("  - type: noop")  # the spread of the bench itself
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--method", default="eagle3", choices=("eagle3", "mtp", "dflash"))
    ap.add_argument("--stream", default="summarization-rag", choices=("summarization-rag", "humaneval"),
                    help="the traffic: Spec-Bench summarization + RAG first turns, or HumanEval as a coding assistant")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-chars", type=int, default=6000, help="longer requests are left out of the stream")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--mix", nargs="*", default=[], help="--mix for specplug adapt (the head's original data)")
    ap.add_argument("--lookup", action="store_true", help="--lookup for specplug adapt: the adapted head also reads "
                                                          "the context's pair lookup (eagle3)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--limit", type=int, default=None, help="bench only this many second-half prompts a category")
    ap.add_argument("--base", type=Path, default=None, help="the head the stream was served and adapted from "
                                                             "(default: the plugin's shipped head)")
    ap.add_argument("--adapted", type=Path, nargs="+", default=None,
                    help="bench these heads as the adapted ones, each named <method>-<file stem> (default: the one "
                         "the adapt phase wrote)")
    ap.add_argument("--phase", choices=("all", "record", "adapt", "bench"), default="all")
    args = ap.parse_args()
    w = args.work
    w.mkdir(parents=True, exist_ok=True)
    spec = [str(ROOT / ".venv/bin/specplug")] if (ROOT / ".venv/bin/specplug").exists() else ["specplug"]
    first, second = stream(w, args.max_prompt_chars, args.stream)
    rec, adapted = w / "record", w / f"{args.method}-adapted.gguf"
    summary_path = w / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    summary.update({"stream": {"kind": args.stream, "categories": CATEGORIES if args.stream != "humaneval" else
                               ("HumanEval",), "first": sum(1 for _ in first.open()),
                               "second": sum(1 for _ in second.open())}, "method": args.method})

    if args.phase in ("all", "record") and not (rec / "manifest.json").is_file():
        cfg = config(w / "serve.yaml", args.method, {f"{args.method}-base": args.base}, args.threads,
                     args.max_tokens, every_step=False)
        t0 = time.perf_counter()
        rc = sh(*spec, "run", cfg, "--prompts", first, "--output", w / "first-answers.jsonl", "--force",
                "--stats", w / "first-stats.json", "--record", rec)
        if rc:
            return rc
        summary["record_seconds"] = round(time.perf_counter() - t0, 1)
    if args.phase in ("all", "adapt") and not (w / "adapt-report.json").is_file():
        head = args.base or _shipped_head(args.method)
        rc = sh(*spec, "adapt", "--record", rec, "--head", head, "-o", adapted, "--work", w / "adapt",
                "--steps", str(args.steps), "--lr", str(args.lr), "--threads", str(args.threads),
                *(["--mix", *args.mix] if args.mix else []), *(["--lookup"] if args.lookup else []))
        if rc not in (0, 1):
            return rc
        rep = json.loads((w / "adapt" / "adapt-report.json").read_text())
        (w / "adapt-report.json").write_text(json.dumps(rep, indent=1))
        summary["adapt"] = rep
    if args.phase in ("all", "bench"):
        if args.adapted:
            adapted_heads = {f"{args.method}-{p.stem}": p for p in args.adapted}
        else:
            if not adapted.is_file():  # not better on the held-back slice: bench it anyway
                adapted = w / "adapt" / f"candidate-{adapted.name}"
            adapted_heads = {f"{args.method}-adapted": adapted}
        heads = {f"{args.method}-base": args.base, **adapted_heads}
        for kind, every in (("every-step", True), ("priced", False)):
            out = w / f"bench-{kind}"
            if (out / "results.json").is_file():
                continue
            cfg = config(w / f"bench-{kind}.yaml", args.method, heads, args.threads, args.max_tokens, every)
            rc = sh(*spec, "bench", cfg, "--data", second, "--repeats", str(1 if every else args.repeats),
                    "--out", out, *(["--limit", str(args.limit)] if args.limit else []))
            if rc:
                return rc
        for kind in ("every-step", "priced"):
            res = json.loads((w / f"bench-{kind}" / "results.json").read_text())
            keys = ("first_token_match", "decode_speedup_geomean", "decode_speedup", "decode_speedup_median",
                    "speedup", "mean_accepted_length", "mismatches", "n_prompts", "tokens")
            summary[f"bench_{kind}"] = {name: {k: v.get(k) for k in keys}
                                        for name, v in res["overall"].items()}
            summary["machine"] = res["settings"].get("machine")
    summary_path.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k.startswith("bench") or k == "stream"}, indent=1))
    return 0


def _shipped_head(method: str) -> Path:
    """The plugin's shipped SmolLM2 head (its `shipped_heads()`)."""
    import importlib

    heads = [p for p in importlib.import_module(f"specplug_{method}.speculator").shipped_heads()
             if p.name.startswith("smollm2-135m-")]
    if not heads:
        sys.exit(f"no shipped SmolLM2 {method} head in the specplug-{method} package")
    return heads[0]

if __name__ == "__main__":
    sys.exit(main())
