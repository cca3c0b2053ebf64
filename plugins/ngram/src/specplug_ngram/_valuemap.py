"""The per-sequence n-gram map behind `ngram-map-k` and `ngram-map-k4v`.

Key = an n-gram of the history, value = the m tokens that followed one occurrence of it,
with a hit count per distinct value. A (key, value) pair is counted once its m-token
value is complete in the history, so a map at history length L holds every pair whose
value ends at or before L. The map is extended with the new tokens at each draft call.

Each value also carries an adaptive length (after llama.cpp's `n_accepted` per value): a
draft from it is cut to one more than the tokens accepted the last time it was used, and
back to the full m after a draft from it was accepted entirely.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specplug.hooks import hookimpl
from specplug.types import Draft, DraftRequest, TargetInfo, Verified
from specplug_ngram._common import TOKEN_DTYPE, History, SequenceStates, make_draft, window_bytes


class Value:
    """One continuation m-gram of a key: its tokens, hit count, latest position, length limit."""

    __slots__ = ("tokens", "count", "last", "limit")

    def __init__(self, tokens: bytes, last: int, limit: int):
        self.tokens, self.count, self.last, self.limit = tokens, 0, last, limit


class Key:
    """The values seen after one key n-gram, the most frequent one, and the sum of kept counts."""

    __slots__ = ("values", "best", "total")

    def __init__(self):
        self.values: dict[bytes, Value] = {}
        self.best: Value | None = None
        self.total = 0


class ValueMap:
    """Key n-gram -> counted continuation m-grams, keeping at most `max_values` per key (None: all)."""

    def __init__(self, n: int, m: int, max_values: int | None):
        self.n, self.m, self.max_values = n, m, max_values
        self.keys: dict[bytes, Key] = {}

    def add(self, key: bytes, value: bytes, pos: int) -> None:
        """Count one occurrence of `value` after `key`, its tokens starting at history index `pos`."""
        entry = self.keys.get(key)
        if entry is None:
            entry = self.keys[key] = Key()
        v = entry.values.get(value)
        if v is None:
            if self.max_values is not None and len(entry.values) >= self.max_values:
                # Keep the k most frequent: a newcomer (count 1) may only replace a value seen once,
                # the oldest of those; otherwise it is not kept.
                weakest = min(entry.values.values(), key=lambda x: (x.count, x.last))
                if weakest.count > 1:
                    return
                del entry.values[weakest.tokens]
                entry.total -= weakest.count
                if entry.best is weakest:
                    entry.best = None
            v = entry.values[value] = Value(value, pos, self.m)
        v.count += 1
        v.last = pos
        entry.total += 1
        best = entry.best
        # ties go to the most recent value: counts only grow, so `best` stays right incrementally
        if best is None or v.count >= best.count:
            entry.best = v

    def ingest(self, buf: np.ndarray, start: int, end: int) -> None:
        """Add the pairs whose value became complete when the history grew from `start` to `end`."""
        n, m = self.n, self.m
        # pair at j: key buf[j-n:j], value buf[j:j+m]; complete when j + m <= end
        j0, j1 = max(n, start - m + 1), end - m + 1
        if j1 <= j0:
            return
        keys = window_bytes(buf, j0, j1, n)
        values = window_bytes(buf, j0 + m, j1 + m, m)
        add = self.add
        for j, key, value in zip(range(j0, j1), keys, values):
            add(key, value, j)

    def lookup(self, buf: np.ndarray, end: int) -> Key | None:
        """The entry of the key n-gram that ends the history, or None."""
        if end < self.n:
            return None
        return self.keys.get(buf[end - self.n:end].tobytes())


class _SeqState:
    __slots__ = ("hist", "map")

    def __init__(self, n: int, m: int, max_values: int | None, capacity: int):
        self.hist = History(capacity)
        self.map = ValueMap(n, m, max_values)


class MapSpeculator:
    """Shared drafting for the n-gram map types; subclasses set NAME, Params and `_accept`."""

    NAME = "ngram-map"

    def _setup(self, n: int, m: int, min_hits: int, max_values: int | None, target: TargetInfo) -> None:
        self.n, self.m, self.min_hits = n, m, min_hits
        self.vocab_size = target.vocab_size
        capacity = min(target.max_ctx, 1 << 16)
        self._seqs: SequenceStates[_SeqState] = SequenceStates(lambda: _SeqState(n, m, max_values, capacity))
        self._drafted: dict[int, Value] = {}  # seq_id -> the value its last draft came from

    def _accept(self, entry: Key, best: Value) -> bool:
        """Whether `best` (the most frequent value of `entry`) is worth proposing."""
        return best.count >= self.min_hits

    def _draft_one(self, req: DraftRequest) -> Draft | None:
        st, start = self._seqs.sync(req.seq_id, req.tokens)
        st.map.ingest(st.hist.buf, start, st.hist.n)
        entry = st.map.lookup(st.hist.buf, st.hist.n)
        if entry is None or entry.best is None or not self._accept(entry, entry.best):
            return None
        best = entry.best
        length = min(best.limit, self.m, req.n_max)
        draft = make_draft(np.frombuffer(best.tokens, dtype=TOKEN_DTYPE)[:length].tolist(),
                           req.n_max, self.vocab_size)
        if draft is not None:
            self._drafted[req.seq_id] = best
        return draft

    @hookimpl
    def are_compatible(self, target: TargetInfo) -> str | None:
        """Token-only: compatible with any target."""
        return None

    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]) -> Sequence[Draft | None] | None:
        """One proposal per request: the most frequent continuation of the current key, if it qualifies."""
        self._drafted.clear()
        return [self._draft_one(r) for r in requests]

    @hookimpl
    def verified(self, results: Sequence[Verified]) -> None:
        """Adapt the length of the value each verified draft came from to what was accepted."""
        for r in results:
            value = self._drafted.pop(r.seq_id, None)
            if value is None or not r.chosen or r.n_drafted <= 0:
                continue
            value.limit = self.m if r.n_accepted >= r.n_drafted else r.n_accepted + 1

    @hookimpl
    def remove(self, seq_id: int, p0: int) -> None:
        """Drop the sequence's map when it ends (p0 = 0) or loses positions it consumed."""
        if self._seqs.drop(seq_id, p0) is not None:
            self._drafted.pop(seq_id, None)
