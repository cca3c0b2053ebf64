"""The table of scripts/gpu_check.sh: its JSON outputs in one folder -> a markdown table against the
targets of issue 23 (printed) and gpu-check.json (written beside them).

    python scripts/gpu_table.py gpu-check-out
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from specplug.machine import describe

# (label, where in the bench-runtime JSON, target, "<=" or ">=")
TARGETS = [
    ("decode ms, ctx 512", ("decode_ms", "512"), 1.0, "<="),
    ("decode ms, ctx 1024", ("decode_ms", "1024"), 1.1, "<="),
    ("T(4) ms", ("verify_ms", "4"), 1.3, "<="),
    ("T(8) ms", ("verify_ms", "8"), 1.5, "<="),
    ("T(16) ms", ("verify_ms", "16"), 2.0, "<="),
    ("prefill 512 tok/s", ("prefill_tok_s",), 50_000, ">="),
    ("16x1 / 1x1", ("batch16_vs_1",), 2.0, "<="),
]


def _get(d: dict, path: tuple):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _llama(out: Path) -> dict:
    """llama-bench's JSON: tokens/s of pp512 and tg128 -> prefill tok/s and decode ms."""
    p = out / "llama-bench.json"
    if not p.is_file():
        return {}
    try:
        rows = json.loads(p.read_text())
    except json.JSONDecodeError:
        return {}
    res = {}
    for r in rows:
        if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0:
            res["prefill_tok_s"] = round(r["avg_ts"], 1)
        elif r.get("n_gen", 0) > 0:
            res["decode_ms"] = round(1e3 / r["avg_ts"], 3)
    return res


def main(folder: str) -> int:
    out = Path(folder)
    runs = {p.stem.removeprefix("runtime-"): json.loads(p.read_text()) for p in sorted(out.glob("runtime-*.json"))}
    ngram = out / "ngram" / "results.json"
    ngram_res = json.loads(ngram.read_text())["overall"] if ngram.is_file() else {}
    llama = _llama(out)
    names = list(runs)
    lines = ["| figure | target | " + " | ".join(names) + (" | llama.cpp |" if llama else " |"),
             "|---|---|" + "---|" * len(names) + ("---|" if llama else "")]
    verdicts = {}
    for label, path, target, op in TARGETS:
        cells = []
        for n in names:
            v = _get(runs[n], path)
            ok = v is not None and (v <= target if op == "<=" else v >= target)
            verdicts.setdefault(n, {})[label] = {"value": v, "target": target, "met": ok}
            cells.append("-" if v is None else f"{v} {'ok' if ok else 'MISS'}")
        ll = ""
        if llama:
            ll = {"decode ms, ctx 512": llama.get("decode_ms"),
                  "prefill 512 tok/s": llama.get("prefill_tok_s")}.get(label)
            ll = f" {ll if ll is not None else '-'} |"
        lines.append(f"| {label} | {op} {target} | " + " | ".join(cells) + " |" + ll)
    for n in names:
        r = runs[n]
        lines.append(f"| {n}: step | | {r.get('step')}; {r.get('graphs', 0)} shapes, "
                     f"compile {r.get('compile_s', 0)} s, "
                     f"capture {r.get('capture_s', 0)} s, peak GPU {r.get('peak_gpu_mb', '-')} MB | |")
    for variant, v in ngram_res.items():
        ok = v.get("decode_speedup", 0) >= 2.0
        lines.append(f"| {variant} decode-phase speedup, Spec-Bench summarization + RAG | >= 2.0 | "
                     f"{v.get('decode_speedup')} (geomean {v.get('decode_speedup_geomean')}) "
                     f"{'ok' if ok else 'MISS'} | |")
    for p in sorted(out.glob("equal-*.json")):
        eq = json.loads(p.read_text())
        n_ok = sum(c["equal"] for c in eq["configs"])
        lines.append(f"| greedy spec == plain, {eq['dtype']} | every config | {n_ok} of {len(eq['configs'])} "
                     f"{'ok' if eq['all_equal'] else 'MISS'} | |")
    tests = out / "tests.txt"
    if tests.is_file():  # pytest's last line; empty or cut short when the step ran out of time
        last = (tests.read_text().strip().splitlines() or ["(no output)"])[-1]
        lines.append(f"| CUDA tests | all pass | {last} | |")
    print("\n".join(lines))
    (out / "gpu-check.json").write_text(json.dumps({"runtime": runs, "targets": verdicts, "ngram": ngram_res,
                                                     "llama_bench": llama, "machine": describe("cuda")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "gpu-check-out"))
