"""The context's own proposal for a head's next token: a pair lookup.

A head reading row t (the token at position t, predicting the token at t + 1) may also read the token
that followed the last earlier occurrence of the row's last two tokens (tokens[t-1], tokens[t]) in
the sequence so far: what a 2-gram prompt lookup proposes. On text that repeats its context
(a summary's names and figures, code's identifiers, an answer quoting its question) that token is
often the target's next one; a one-layer head cannot find it by itself (it would have to attend by
token identity across positions it only sees through the target's states). Measured with Eagle3
(docs/results/heads.md, issue 39): on a summarization + RAG stream the lookup proposes the target's
next token on 59% of the answer rows, where the head alone picks it on 34% of them.

Both sides compute it the same way: training over whole recorded sequences (`sequence_lookups`,
`batch_lookups`), drafting per row from the sequence's history (`pair_lookup`). `NONE` where the pair
has not occurred before.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

NONE = -1


def sequence_lookups(tokens: Sequence[int]) -> list[int]:
    """Per position t of one sequence: the token after the last j < t with (tokens[j-1], tokens[j]) ==
    (tokens[t-1], tokens[t]), or NONE. One pass, O(len)."""
    last: dict[tuple[int, int], int] = {}
    out = [NONE] * len(tokens)
    for t in range(1, len(tokens)):
        key = (tokens[t - 1], tokens[t])
        j = last.get(key)
        if j is not None:
            out[t] = tokens[j + 1]
        last[key] = t
    return out


def batch_lookups(tokens: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """[B, T] int64 lookups of a padded batch of sequences (row b's first lengths[b] tokens; NONE after)."""
    out = torch.full(tokens.shape, NONE, dtype=torch.long)
    rows = tokens.tolist()
    for b, n in enumerate(lengths):
        out[b, :n] = torch.tensor(sequence_lookups(rows[b][:n]), dtype=torch.long)
    return out.to(tokens.device)


def pair_lookup(history: Sequence[int] | np.ndarray) -> int:
    """The lookup of the last row of `history` (the sequence up to and including the row's token):
    what `sequence_lookups(history)[-1]` gives, by a vectorised search (drafting: one row at a time)."""
    a = np.asarray(history)
    t = len(a) - 1
    if t < 2:
        return NONE
    # j in [1, t - 1]: a[j-1] == a[t-1] and a[j] == a[t]; the last one
    hits = np.flatnonzero((a[:t - 1] == a[t - 1]) & (a[1:t] == a[t]))
    return int(a[hits[-1] + 2]) if len(hits) else NONE
