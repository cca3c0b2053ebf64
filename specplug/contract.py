"""The rules of the hook contract that the host enforces on what a plugin returns.

Each check returns None when the plugin kept the rules, or one line naming the rule it broke
(the engine then disables that speculator with this line; the text is never affected).
"""
from __future__ import annotations

import numbers
from typing import Any, Sequence

import torch

from specplug.types import Draft, DraftRequest

# |sum of a probs row - 1| allowed: float32 softmax rows over 49k tokens sum to 1 within ~1e-6;
# 16-bit rows get a few of their own epsilons (a peaked bf16 row is off by up to 2^-8 per entry)
PROBS_SUM_TOL = 1e-3


def probs_sum_tol(dtype: torch.dtype) -> float:
    """How far from 1 a row of draft probs of `dtype` may sum."""
    return max(PROBS_SUM_TOL, 4 * torch.finfo(dtype).eps)


def check_drafts(res: Any, reqs: Sequence[DraftRequest], vocab: int) -> str | None:
    """The result of `draft` for `reqs`: one Draft or None per request, within n_max and the vocabulary,
    probs and confidences well formed, and every probs row a distribution giving its drafted token mass.

    The probs values are checked in one pass per device: a few reductions per draft on the device
    its probs are on, and one transfer of [3, tokens] numbers (row sums, row minima, drafted
    token's mass) for all drafts there."""
    if not isinstance(res, (list, tuple)) or len(res) != len(reqs):
        n = len(res) if hasattr(res, "__len__") else "?"
        return f"draft returned {type(res).__name__} of length {n} for {len(reqs)} requests"
    with_probs: list[tuple[DraftRequest, Draft]] = []
    for r, d in zip(reqs, res):
        if d is None:
            continue
        if not isinstance(d, Draft):
            return f"draft for sequence {r.seq_id} is a {type(d).__name__}, not a specplug.types.Draft"
        if len(d) > r.n_max:
            return f"draft for sequence {r.seq_id} has {len(d)} tokens, more than n_max={r.n_max}"
        bad = [t for t in d.token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            return f"draft for sequence {r.seq_id} has token id {bad[0]!r} outside the vocabulary [0, {vocab})"
        if d.probs is not None:
            if not isinstance(d.probs, torch.Tensor) or not d.probs.is_floating_point():
                what = (f"a {d.probs.dtype} tensor" if isinstance(d.probs, torch.Tensor)
                        else f"a {type(d.probs).__name__}")
                return f"draft probs for sequence {r.seq_id} must be a floating-point torch.Tensor, got {what}"
            if tuple(d.probs.shape) != (len(d), vocab):
                return (f"draft probs for sequence {r.seq_id} have shape {tuple(d.probs.shape)}, "
                        f"expected ({len(d)}, {vocab})")
            if len(d):
                with_probs.append((r, d))
        if d.confidence is not None:
            c = d.confidence
            if len(c) != len(d) or not all(isinstance(x, numbers.Real) and 0.0 <= x <= 1.0 for x in c):
                return (f"draft confidence for sequence {r.seq_id} must be {len(d)} numbers in [0, 1], "
                        f"one per token, got {c!r}")
    return _check_probs(with_probs) if with_probs else None


def _check_probs(drafts: list[tuple[DraftRequest, Draft]]) -> str | None:
    """Finite, non-negative rows summing to 1 within probs_sum_tol, q(d_i) > 0: the first draft
    (in request order) that breaks one of these, or None."""
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, d) in enumerate(drafts):
        by_device.setdefault(d.probs.device, []).append(i)
    stats: list[torch.Tensor | None] = [None] * len(drafts)  # per draft [3, len] float64 on the CPU
    for dev, members in by_device.items():
        rows = []
        for i in members:
            p = drafts[i][1].probs
            ids = torch.tensor(drafts[i][1].token_ids, dtype=torch.long, device=dev)
            # a row sum is finite only if every entry is (NaN and inf propagate), so the sums
            # carry the finiteness rule too; amin is NaN when the row holds a NaN
            rows.append(torch.stack([p.sum(-1, dtype=torch.float64), p.amin(-1).double(),
                                     p.gather(1, ids[:, None])[:, 0].double()]))
        flat = torch.cat(rows, 1).cpu()  # the one synchronisation per device
        off = 0
        for i, t in zip(members, rows):
            stats[i] = flat[:, off:off + t.shape[1]]
            off += t.shape[1]
    for (r, d), st in zip(drafts, stats):
        sums, mins, q_d = st
        tol = probs_sum_tol(d.probs.dtype)
        where = f"draft probs for sequence {r.seq_id}"
        if not bool(torch.isfinite(sums).all()):
            j = int((~torch.isfinite(sums)).nonzero()[0])
            return f"{where} are not all finite (row {j} holds NaN or inf)"
        if not bool((mins >= 0).all()):
            j = int((mins < 0).nonzero()[0])
            return f"{where} have a negative entry (row {j}: {float(mins[j]):.4g})"
        off_one = (sums - 1).abs() > tol
        if bool(off_one.any()):
            j = int(off_one.nonzero()[0])
            return (f"{where} are not probability distributions: row {j} sums to {float(sums[j]):.6g}, "
                    f"not 1 (within {tol:g})")
        if not bool((q_d > 0).all()):
            j = int((q_d <= 0).nonzero()[0])
            return (f"{where} give drafted token {d.token_ids[j]} (position {j}) zero probability: probs must be "
                    "the distribution each token was sampled from")
    return None
