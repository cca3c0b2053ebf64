"""`ngram-simple`: prompt lookup in the sequence's own history.

The last `n` tokens are looked up in the history; at their most recent earlier occurrence, the
tokens that followed are proposed. No match at size `n` tries `n - 1`, ... down to `ngram_min`.
Lookups are O(1): each sequence keeps, per n-gram size, a dict from n-gram to the index of the
token that followed its latest occurrence, extended with the new tokens every step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from specplug.hooks import hookimpl
from specplug.types import Draft, DraftRequest, TargetInfo

from specplug_ngram._common import History, SequenceStates, check_int, make_draft, window_bytes

NAME = "ngram-simple"


class _SeqState:
    __slots__ = ("hist", "last_seen")

    def __init__(self, sizes: range, capacity: int):
        self.hist = History(capacity)
        # last_seen[k][n-gram bytes] = index of the token after its most recent occurrence
        self.last_seen: dict[int, dict[bytes, int]] = {k: {} for k in sizes}


class NgramSimple:
    """Prompt-lookup speculator: copy what followed the last earlier occurrence of the current n-gram."""

    @dataclass
    class Params:
        n: int = 3  # longest n-gram to match
        # shortest n-gram tried when longer ones are not found (not `n_min`: that YAML key is the host's)
        ngram_min: int = 1
        m: int = 8  # most tokens proposed (also capped by the host's n_max)

    def __init__(self, params: "NgramSimple.Params", target: TargetInfo):
        self.n = check_int(NAME, params, "n", 1)
        self.ngram_min = check_int(NAME, params, "ngram_min", 1, self.n)
        self.m = check_int(NAME, params, "m", 1)
        self.vocab_size = target.vocab_size
        sizes = range(self.ngram_min, self.n + 1)
        capacity = min(target.max_ctx, 1 << 16)
        self._seqs: SequenceStates[_SeqState] = SequenceStates(lambda: _SeqState(sizes, capacity))

    @hookimpl
    def are_compatible(self, target: TargetInfo) -> str | None:
        """Token-only: compatible with any target."""
        return None

    def _ingest(self, st: _SeqState, start: int) -> None:
        # An n-gram ending at j is indexed once its follower tokens[j] exists, so the current
        # suffix (whose follower is what we are drafting) never matches itself.
        buf, end = st.hist.buf, st.hist.n
        for k, table in st.last_seen.items():
            j0 = max(k, start)
            if j0 < end:
                # dict.update keeps the last value for repeated keys: the most recent occurrence
                table.update(zip(window_bytes(buf, j0, end, k), range(j0, end)))

    def _draft_one(self, req: DraftRequest) -> Draft | None:
        st, start = self._seqs.sync(req.seq_id, req.tokens)
        self._ingest(st, start)
        buf, end = st.hist.buf, st.hist.n
        limit = min(self.m, req.n_max)
        if limit <= 0:
            return None
        for k in range(min(self.n, end), self.ngram_min - 1, -1):
            j = st.last_seen[k].get(buf[end - k:end].tobytes())
            if j is not None:
                return make_draft(buf[j:min(j + limit, end)].tolist(), limit, self.vocab_size)
        return None

    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]) -> Sequence[Draft | None] | None:
        """One proposal per request: the continuation of the latest earlier match, or None."""
        return [self._draft_one(r) for r in requests]

    @hookimpl
    def remove(self, seq_id: int, p0: int) -> None:
        """Drop the sequence's index when it ends (p0 = 0) or loses positions it consumed."""
        self._seqs.drop(seq_id, p0)
