"""The rules of the hook contract that the host enforces on what a plugin returns.

Each check returns None when the plugin kept the rules, or one line naming the rule it broke
(the engine then disables that speculator with this line; the text is never affected).
"""
from __future__ import annotations

import numbers
from typing import Any, Sequence

from specplug.types import Draft, DraftRequest


def check_drafts(res: Any, reqs: Sequence[DraftRequest], vocab: int) -> str | None:
    """The result of `draft` for `reqs`: one Draft or None per request, within n_max and the vocabulary,
    probs and confidences well formed."""
    if not isinstance(res, (list, tuple)) or len(res) != len(reqs):
        return f"draft returned {type(res).__name__} of length {len(res) if hasattr(res, '__len__') else '?'} for {len(reqs)} requests"
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
        if d.probs is not None and tuple(d.probs.shape) != (len(d), vocab):
            return f"draft probs for sequence {r.seq_id} have shape {tuple(d.probs.shape)}, expected ({len(d)}, {vocab})"
        if d.confidence is not None:
            c = d.confidence
            if len(c) != len(d) or not all(isinstance(x, numbers.Real) and 0.0 <= x <= 1.0 for x in c):
                return (f"draft confidence for sequence {r.seq_id} must be {len(d)} numbers in [0, 1], "
                        f"one per token, got {c!r}")
    return None
