"""What decoding speedup can a drafter with a given acceptance buy on this runtime, at best?

Prices chain drafting with the *measured* figures of a `specplug bench` run (results.json): each
variant's acceptance per draft position (conditional: token i accepted given 1..i-1 were) and its
drafting time per drafted token, against the runtime's T(k)/T(1) verification curve
(`specplug.pricing`, the curve the engine trims drafts with) and the plain decode step time
of the same run. For every fixed draft length g it computes

    speedup(g) = E_g / (T(g+1)/T(1) + g * c),   E_g = 1 + sum_{i<=g} prod_{j<=i} a_j

with c the drafting cost of one token in units of a plain step (host overhead left out, which
favours the drafter), takes the best g, and solves for the first-position acceptance that would be
needed for a target speedup with the same shape of acceptances. Usage:

    python scripts/head_ceiling.py bench-out/results.json --target 1.3 [--category writing] [--json out.json]
        [--runtime bench-runtime.json]

The acceptances that bound a head are those of drafts made on every step
(examples/bench-heads-every-step.yaml); a priced run's are only of the drafts the host chose.
"""
from __future__ import annotations

import argparse
import json

from specplug.machine import describe
from specplug.pricing import BUILTIN_CURVES, interpolate_cost


def speedup(acc: list[float], c: float, curve, g_max: int = 8) -> tuple[int, float]:
    best = (0, 1.0)
    for g in range(1, min(g_max, len(acc)) + 1):
        e, p = 1.0, 1.0
        for a in acc[:g]:
            p *= a
            e += p
        s = e / (interpolate_cost(curve, g + 1) + g * c)
        if s > best[1]:
            best = (g, s)
    return best


def needed_first(acc: list[float], c: float, curve, target: float) -> float | None:
    """Smallest scale of the whole acceptance profile (capped at 1) reaching `target`, reported as
    the first-position acceptance it implies."""
    lo, hi = 0.0, 1.0 / max(acc[0], 1e-9)
    scaled = lambda k: [min(1.0, a * k) for a in acc]  # noqa: E731
    if speedup(scaled(hi), c, curve)[1] < target:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if speedup(scaled(mid), c, curve)[1] < target else (lo, mid)
    return min(1.0, acc[0] * hi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", help="results.json of a `specplug bench` run")
    ap.add_argument("--category", default=None, help="a category of the run (default: overall)")
    ap.add_argument("--curve", default="gguf", choices=sorted(BUILTIN_CURVES),
                    help="the engine's built-in T(k)/T(1) curve to price verification with")
    ap.add_argument("--runtime", default=None,
                    help="instead: the curve this machine measured (`specplug bench-runtime --repeats 60 --json F`)")
    ap.add_argument("--target", type=float, default=1.3, help="speedup to solve the needed acceptance for")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args()
    rep = json.load(open(args.results))
    figs = rep["overall"] if args.category is None else rep["categories"][args.category]
    curve = BUILTIN_CURVES[args.curve]
    if args.runtime:
        ratios = json.load(open(args.runtime))["verify_ratio"]
        curve = tuple(sorted((int(k), float(v)) for k, v in ratios.items()))
    print("T(k)/T(1):", " ".join(f"{k}:{v:.2f}" for k, v in curve))
    print(f"{'variant':<14} {'measured':>9} {'accept/pos (conditional)':<34} {'c':>6} {'best g':>6} "
          f"{'ceiling':>8} {'free drafter':>12} {'a1 needed':>10}")
    rows = []
    for name, f in figs.items():
        cond = f.get("acceptance_per_position_conditional") or []
        if not cond:
            continue
        step_ms = 1e3 / f["decode_plain_tok_s"] if f["decode_plain_tok_s"] else 0.0
        c = f["draft_ms_per_token"] / step_ms if step_ms else 0.0
        g, s = speedup(cond, c, curve)
        _, free = speedup(cond, 0.0, curve)
        need = needed_first(cond, c, curve, args.target)
        rows.append({"variant": name, "measured_decode_speedup": f["decode_speedup"], "acceptance_conditional": cond,
                     "draft_cost_steps": c, "best_draft_length": g, "ceiling": s, "ceiling_free_drafter": free,
                     "first_acceptance_needed": need})
        print(f"{name:<14} {f['decode_speedup']:>8.2f}x {' '.join(f'{a:.2f}' for a in cond[:8]):<34} {c:>6.3f} "
              f"{g:>6} {s:>7.2f}x {free:>11.2f}x {'-' if need is None else f'{need:.2f}':>10}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"results": args.results, "category": args.category, "curve": curve, "runtime": args.runtime,
                       "target": args.target, "rows": rows, "machine": describe()}, fh, indent=1)


if __name__ == "__main__":
    main()
