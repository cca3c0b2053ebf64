"""The verification cost curves drafts are priced with: T(k)/T(1), the time of one target forward of k
new rows in units of a one-row forward, as (k, ratio) points; the built-in one of each kernel path,
the check a given one passes, and the interpolation between points."""
from __future__ import annotations

from typing import Sequence

Curve = tuple[tuple[int, float], ...]

# Per kernel path, measured with `specplug bench-runtime` (SmolLM2-135M, 2 threads, medians of 3). The
# engine trims drafts that carry confidences to the length where one more row costs more than it is
# expected to save. Torch on the CPU (float32, and int8, not measured apart) is flat because one row is
# already slow; the gguf kernels are fast at one row (3.4 ms after 512 tokens, AMD EPYC Zen 3,
# 2026-11-23), so each extra row costs ~0.25-0.35 of a step: its compute, at the kernels' peak
# (`bench-runtime --profile`). CUDA: not measured (no GPU run); a small model's forward is launch-bound
# for dozens of rows, hence nearly flat. A path without its own curve here (a gguf ISA not listed)
# takes its kernels' base one, "gguf".
BUILTIN_CURVES: dict[str, Curve] = {
    # the gguf kernels' AVX2 path (AMD EPYC Zen 3, 2 threads, ctx 512, 2026-11-23)
    "gguf": ((1, 1.0), (2, 1.27), (3, 1.58), (4, 1.76), (6, 2.66), (8, 3.21), (12, 4.85), (16, 6.86), (32, 12.39)),
    # their AVX-512 VNNI path (AMD EPYC Zen 4, 2 threads, ctx 512, 2026-11-25; scripts/kernel_builds.py,
    # medians of 3 alternated rounds; docs/results/kernels-isa-t2-2026-11-25.json, in git at c8dab82)
    "gguf-avx512": ((1, 1.0), (2, 1.09), (4, 1.33), (8, 2.08), (16, 3.71)),
    "cpu": ((1, 1.0), (2, 1.11), (3, 1.17), (4, 1.29), (6, 1.39), (8, 1.54), (12, 1.79), (16, 2.07), (32, 3.06)),
    "cuda": ((1, 1.0), (32, 1.3)),
}

# The row counts a measured curve times (specplug.pricing.measure_curve); past the last one the
# engine extends its last slope (interpolate_cost).
MEASURE_K = (1, 2, 3, 4, 6, 8, 12, 16)


def builtin_key(kernel_path: str) -> str:
    """The key in BUILTIN_CURVES of a model's `kernel_path` ("gguf-avx2", "gguf-avx512", "cpu", "cuda")."""
    if kernel_path in BUILTIN_CURVES:
        return kernel_path
    return "gguf" if kernel_path.startswith("gguf") else kernel_path


def check_curve(points) -> Curve:
    """A verification curve given as [[k, T(k)/T(1)], ...] (a config's `verify_curve`), checked: row
    counts ascending from 1 with ratio 1.0, ratios at least 1 and never falling. ValueError naming what
    to fix otherwise."""
    try:
        curve = tuple((int(k), float(r)) for k, r in points)
        ok_types = all(isinstance(k, int) and not isinstance(k, bool) for k, _ in points)
    except (TypeError, ValueError):
        curve, ok_types = (), False
    if not ok_types or not curve:
        raise ValueError(f"a verification curve is a list of [rows, T(rows)/T(1)] pairs, e.g. [[1, 1.0], [2, 1.4]], "
                         f"not {points!r}")
    if curve[0] != (1, 1.0):
        raise ValueError(f"a verification curve starts at [1, 1.0] (one row is the unit), not {list(curve[0])}")
    for (a, ra), (b, rb) in zip(curve, curve[1:]):
        if b <= a:
            raise ValueError(f"a verification curve's row counts must ascend: {a} then {b}")
        if rb < ra:
            raise ValueError(f"a verification curve never falls: T({b})/T(1) = {rb} is below T({a})/T(1) = {ra}")
    return curve


def never_falling(points) -> Curve:
    """(k, ratio) points in ascending k as a pricing curve: 1.0 at the first, each ratio at least the one
    before (a noisy reading never makes more rows look cheaper), rounded to 3 decimals."""
    out, top = [], 1.0
    for i, (k, r) in enumerate(points):
        top = max(top, r) if i else 1.0
        out.append((k, round(top, 3)))
    return tuple(out)


def interpolate_cost(curve: Sequence[tuple[int, float]], n: int) -> float:
    """Piecewise-linear T(n)/T(1) through the curve's points, extended with its last slope."""
    if n <= curve[0][0]:
        return curve[0][1]
    for (a, ta), (b, tb) in zip(curve, curve[1:]):
        if n <= b:
            return ta + (tb - ta) * (n - a) / (b - a)
    (a, ta), (b, tb) = curve[-2], curve[-1]
    return tb + (tb - ta) * (n - b) / (b - a)
