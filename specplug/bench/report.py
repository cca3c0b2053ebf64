"""Bench arithmetic: per-category and overall figures, the markdown table, results.json, plots.

results.json (schema version 1):
  {"schema": 1, "settings": {...}, "peak_rss_mb": float,
   "overall":    {variant: FIGURES},
   "categories": {category: {variant: FIGURES}},
   "prompts":    [{"id", "category", "turn", "prompt_tokens", "mismatch",
                   "runs": {variant|"plain": {"time_s", "prefill_s", "tokens", "forwards", "drafted", "accepted"}}}],
   "mismatches": [{"id", "category", "turn", "variant", "index", "top2_gap"}]}
  FIGURES = {"n_prompts", "tokens", "plain_tok_s", "spec_tok_s",
             "speedup"          (total plain time / total speculative time, per generated token;
                                 prompt processing included),
             "speedup_median"   (median of per-prompt tok/s ratios),
             "decode_plain_tok_s", "decode_spec_tok_s", "decode_speedup"
                                (the decoding phase only: tokens after the first, over the time after
                                 the first token, as llama.cpp reports generation speed),
             "decode_speedup_geomean", "decode_speedup_median"
                                (per-prompt paired decode-phase ratios, speculative over plain on the
                                 same prompt: their geometric mean and median; one slow run moves
                                 one ratio, not the total. The headline figure),
             "asked_share", "verified_share" (decoding steps where a speculator was asked / had its
                                 draft verified, of the steps where it could draft),
             "draft_ms_per_accepted" (seconds in `draft` per token the target accepted, in ms),
             "first_token_match" (drafts whose first token is the one the target committed, over
                                 every draft returned, verified or not),
             "mean_accepted_length" (tokens the target produced per decoding forward, the stop
                                 token included: plain decoding is exactly 1), "acceptance_rate",
             "acceptance_per_position" (drafts with token i accepted / drafts with a token i),
             "acceptance_per_position_conditional" (token i accepted given tokens < i were),
             "accepted_length_hist" (drafts by tokens accepted),
             "time_split" {"target", "speculators", "host"} (fractions of speculative time),
             "draft_ms_per_token", "draft_ms_per_forward" (speculator time per drafted token / per
                                 target forward),
             "mismatches"}
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from specplug import machine
from specplug.bench.runner import PromptResult
from specplug.outputs import claim, replacing, write_atomic


def figures(results: list[PromptResult], variant: str) -> dict:
    """The figures of one variant over a set of prompt results (see module docstring)."""
    rs = [r for r in results if variant in r.runs]
    plain_t = sum(r.runs["plain"].time_s for r in rs)
    spec_t = sum(r.runs[variant].time_s for r in rs)
    plain_n = sum(len(r.runs["plain"].token_ids) for r in rs)
    spec_n = sum(len(r.runs[variant].token_ids) for r in rs)
    plain_tok_s = plain_n / plain_t if plain_t else 0.0
    spec_tok_s = spec_n / spec_t if spec_t else 0.0
    ratios = []
    for r in rs:
        p, s = r.runs["plain"], r.runs[variant]
        if p.time_s > 0 and s.time_s > 0 and p.token_ids and s.token_ids:
            ratios.append((len(s.token_ids) / s.time_s) / (len(p.token_ids) / p.time_s))
    def decode_tok_s(name: str) -> float:  # tokens after the first, over the time after it
        n = sum(max(0, len(r.runs[name].token_ids) - 1) for r in rs)
        t = sum(max(0.0, r.runs[name].time_s - r.runs[name].prefill_s) for r in rs)
        return n / t if t > 0 else 0.0

    dec_plain, dec_spec = decode_tok_s("plain"), decode_tok_s(variant)
    dec_ratios = [d for d in map(lambda r: _decode_ratio(r, variant), rs) if d is not None]
    runs = [r.runs[variant] for r in rs]
    forwards = sum(x.forwards for x in runs)
    drafted = sum(x.drafted for x in runs)
    accepted = sum(x.accepted for x in runs)
    drafts = sum(x.drafts for x in runs)
    width = max([len(x.drafted_at) for x in runs] + [0])
    acc_at = [sum(x.accepted_at[i] if i < len(x.accepted_at) else 0 for x in runs) for i in range(width)]
    dr_at = [sum(x.drafted_at[i] if i < len(x.drafted_at) else 0 for x in runs) for i in range(width)]
    re_at = [sum(x.reached_at[i] if i < len(x.reached_at) else 0 for x in runs) for i in range(width)]
    # drafts with exactly k accepted tokens: accepted_at[k-1] - accepted_at[k]
    hist = [drafts - (acc_at[0] if acc_at else 0)] + [acc_at[k] - (acc_at[k + 1] if k + 1 < width else 0)
                                                      for k in range(width)]
    t_target = sum(x.time_target_s for x in runs)
    t_spec = sum(x.time_speculators_s for x in runs)
    return {
        "n_prompts": len(rs),
        "tokens": spec_n,
        "plain_tok_s": round(plain_tok_s, 3),
        "spec_tok_s": round(spec_tok_s, 3),
        "speedup": round(spec_tok_s / plain_tok_s, 4) if plain_tok_s else 0.0,
        "speedup_median": round(statistics.median(ratios), 4) if ratios else 0.0,
        "decode_plain_tok_s": round(dec_plain, 3),
        "decode_spec_tok_s": round(dec_spec, 3),
        "decode_speedup": round(dec_spec / dec_plain, 4) if dec_plain else 0.0,
        "decode_speedup_geomean": round(statistics.geometric_mean(dec_ratios), 4) if dec_ratios else 0.0,
        "decode_speedup_median": round(statistics.median(dec_ratios), 4) if dec_ratios else 0.0,
        "mean_accepted_length": round(sum(x.emitted for x in runs) / forwards, 4) if forwards else 0.0,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "acceptance_per_position": [round(a / d, 4) if d else 0.0 for a, d in zip(acc_at, dr_at)],
        # token i accepted given that tokens < i were (EAGLE's per-position acceptance)
        "acceptance_per_position_conditional": [round(a / d, 4) if d else 0.0 for a, d in zip(acc_at, re_at)],
        "accepted_length_hist": hist,
        "time_split": {"target": round(t_target / spec_t, 4) if spec_t else 0.0,
                       "speculators": round(t_spec / spec_t, 4) if spec_t else 0.0,
                       "host": round(max(0.0, spec_t - t_target - t_spec) / spec_t, 4) if spec_t else 0.0},
        # the speculator's own time (drafting and keeping its context in step) per token it drafted
        "draft_ms_per_token": round(1e3 * t_spec / drafted, 4) if drafted else 0.0,
        "draft_ms_per_forward": round(1e3 * t_spec / forwards, 4) if forwards else 0.0,
        "asked_share": (round(sum(x.asked for x in runs) / steps, 4)
                        if (steps := sum(x.seq_steps for x in runs)) else 0.0),
        "verified_share": round(drafts / steps, 4) if steps else 0.0,
        "draft_ms_per_accepted": round(1e3 * sum(x.draft_s for x in runs) / accepted, 4) if accepted else None,
        "first_token_match": round(sum(x.first_hit for x in runs) / proposed, 4)
        if (proposed := sum(x.proposed for x in runs)) else None,
        "mismatches": sum(1 for r in rs if r.mismatch and r.mismatch["variant"] == variant),
    }


def _decode_ratio(r: PromptResult, variant: str) -> float | None:
    """Decode-phase tok/s of `variant` over plain's on the same prompt (None without a decoding phase)."""
    rates = []
    for x in (r.runs[variant], r.runs["plain"]):
        n, t = len(x.token_ids) - 1, x.time_s - x.prefill_s
        if n < 1 or t <= 0:
            return None
        rates.append(n / t)
    return rates[0] / rates[1]


def build_report(results: list[PromptResult], variant_names: list[str], settings: dict, peak_rss_mb: float) -> dict:
    cats = sorted({r.category for r in results})
    return {
        "schema": 1,
        "settings": settings,
        "peak_rss_mb": round(peak_rss_mb, 1),
        "overall": {v: figures(results, v) for v in variant_names},
        "categories": {c: {v: figures([r for r in results if r.category == c], v) for v in variant_names}
                       for c in cats},
        "prompts": [{"id": r.id, "category": r.category, "turn": r.turn, "prompt_tokens": r.prompt_tokens,
                     "mismatch": r.mismatch,
                     "runs": {n: {"time_s": round(x.time_s, 4), "prefill_s": round(x.prefill_s, 4),
                                  "tokens": len(x.token_ids), "forwards": x.forwards,
                                  "drafted": x.drafted, "accepted": x.accepted} for n, x in r.runs.items()}}
                    for r in results],
        "mismatches": [{"id": r.id, "category": r.category, "turn": r.turn, **r.mismatch}
                       for r in results if r.mismatch],
    }


def machine_line(report: dict) -> str:
    """'machine: ...' and a blank line, from the settings' machine record (empty for old reports)."""
    info = report.get("settings", {}).get("machine")
    return machine.line(info) + "\n\n" if info else ""


def markdown_table(report: dict) -> str:
    head = ("| category | speculator | prompts | plain tok/s | spec tok/s | speedup | decode plain tok/s | "
            "decode spec tok/s | decode speedup (geomean / median of prompts) | accepted length | acceptance | "
            "1st-token acceptance (verified / every draft) | asked / verified steps | draft ms per accepted | "
            "mismatches |")
    lines = [head, "|" + "---|" * 15]
    rows = [(c, v) for c in report["categories"] for v in report["categories"][c]]
    rows += [("**overall**", v) for v in report["overall"]]
    for c, v in rows:
        f = report["overall"][v] if c == "**overall**" else report["categories"][c][v]
        match = f"{100 * f['first_token_match']:.1f}%" if f.get("first_token_match") is not None else "-"
        per_acc = f"{f['draft_ms_per_accepted']:.3f}" if f.get("draft_ms_per_accepted") is not None else "-"
        lines.append(f"| {c} | {v} | {f['n_prompts']} | {f['plain_tok_s']:.1f} | {f['spec_tok_s']:.1f} | "
                     f"{f['speedup']:.2f}x | {f['decode_plain_tok_s']:.1f} | {f['decode_spec_tok_s']:.1f} | "
                     f"{f['decode_speedup_geomean']:.2f}x / {f['decode_speedup_median']:.2f}x | "
                     f"{f['mean_accepted_length']:.2f} | {100 * f['acceptance_rate']:.1f}% | "
                     f"{100 * (f['acceptance_per_position'] or [0])[0]:.1f}% / {match} | "
                     f"{100 * f['asked_share']:.0f}% / {100 * f['verified_share']:.0f}% | {per_acc} | "
                     f"{f['mismatches']} |")
    return "\n".join(lines)


def write_outputs(report: dict, out_dir: Path) -> list[Path]:
    """results.json, results.md and the PNG plots (when matplotlib is installed), each replaced
    atomically (a reader never sees half of one); the folder is claimed meanwhile (specplug.outputs)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with claim(out_dir, "--out"):  # nests in the claim `specplug bench` took before the model loaded
        return _write_outputs(report, out_dir)


def _write_outputs(report: dict, out_dir: Path) -> list[Path]:
    paths = [out_dir / "results.json", out_dir / "results.md"]
    write_atomic(paths[0], json.dumps(report, indent=2, default=str))
    write_atomic(paths[1], machine_line(report) + markdown_table(report) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    cats = list(report["categories"]) + ["overall"]
    variants = list(report["overall"])
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats) * max(1, len(variants)) / 2), 4))
    width = 0.8 / max(1, len(variants))
    for i, v in enumerate(variants):
        vals = [(report["categories"][c][v] if c != "overall" else report["overall"][v])["speedup"] for c in cats]
        ax.bar([x + i * width for x in range(len(cats))], vals, width, label=v)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(variants) - 1) / 2 for x in range(len(cats))], cats, rotation=30, ha="right")
    ax.set_ylabel("speedup over plain decoding (x)")
    ax.set_title("specplug bench: speedup per category")
    ax.legend()
    fig.tight_layout()
    with replacing(out_dir / "speedup.png") as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for v in variants:
        hist = report["overall"][v]["accepted_length_hist"]
        ax.plot(range(len(hist)), hist, marker="o", label=v)
    ax.set_xlabel("draft tokens accepted in one verification")
    ax.set_ylabel("drafts")
    ax.set_title("accepted length histogram")
    ax.legend()
    fig.tight_layout()
    with replacing(out_dir / "accepted_length.png") as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return paths + [out_dir / "speedup.png", out_dir / "accepted_length.png"]
