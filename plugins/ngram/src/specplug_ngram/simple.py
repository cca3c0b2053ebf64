"""`ngram-simple`: prompt lookup in the sequence's own history.

The last `n` tokens are looked up in the history (no match at size `n` tries `n - 1`, ... down
to `ngram_min`). Among the most recent `candidates` earlier occurrences, the one whose match
extends furthest back (up to `match_max` tokens) wins, the most recent on ties, and the tokens
that followed it are proposed. Where the occurrence runs into the current suffix the history is
periodic, and the draft continues the period.

Each draft token carries a confidence: the acceptance rate measured so far for drafts made
from a match of that length (a token i places after a match of length l is judged as a match
of length l + i, which it becomes once the tokens before it are accepted). Long matches mean
the text is being copied and are accepted far more often than one-token matches; the host
uses the confidences to trim drafts to the length that pays for its verification rows.

Lookups are O(1) per n-gram size: each sequence keeps, per size, a dict from n-gram to the
indices of the tokens that followed its occurrences, extended with the new tokens every step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specplug.hooks import hookimpl
from specplug.types import Draft, DraftRequest, TargetInfo, Verified
from specplug_ngram._common import History, SequenceStates, check_int, window_bytes

NAME = "ngram-simple"


class _SeqState:
    __slots__ = ("hist", "followers")

    def __init__(self, sizes: range, capacity: int):
        self.hist = History(capacity)
        # followers[k][n-gram bytes] = indices of the tokens after its occurrences, ascending
        self.followers: dict[int, dict[bytes, list[int]]] = {k: {} for k in sizes}


class NgramSimple:
    """Prompt-lookup speculator: copy what followed the earlier occurrence of the current n-gram
    with the longest match, with per-token confidences learnt from the verification outcomes."""

    @dataclass
    class Params:
        n: int = 3  # longest n-gram looked up
        # shortest n-gram tried when longer ones are not found (not `n_min`: that YAML key is the host's)
        ngram_min: int = 1
        m: int = 16  # most tokens proposed (also capped by the host's n_max)
        match_max: int = 16  # how far back matches are compared; also the longest match told apart in confidences
        candidates: int = 32  # most recent occurrences compared

    def __init__(self, params: "NgramSimple.Params", target: TargetInfo):
        self.n = check_int(NAME, params, "n", 1)
        self.ngram_min = check_int(NAME, params, "ngram_min", 1, self.n)
        self.m = check_int(NAME, params, "m", 1)
        self.match_max = check_int(NAME, params, "match_max", self.n)
        self.candidates = check_int(NAME, params, "candidates", 1)
        self.vocab_size = target.vocab_size
        sizes = range(self.ngram_min, self.n + 1)
        capacity = min(target.max_ctx, 1 << 16)
        self._seqs: SequenceStates[_SeqState] = SequenceStates(lambda: _SeqState(sizes, capacity))
        # Acceptance counts per match length 0..match_max, with a uniform prior (1 of 2).
        self._accepted = np.ones(self.match_max + 1)
        self._verified = np.full(self.match_max + 1, 2.0)
        self._pending: dict[int, int] = {}  # seq_id -> match length of the draft awaiting verification

    @hookimpl
    def are_compatible(self, target: TargetInfo) -> str | None:
        """Token-only: compatible with any target."""
        return None

    def _ingest(self, st: _SeqState, start: int) -> None:
        # An n-gram ending at j is indexed once its follower tokens[j] exists, so the current
        # suffix (whose follower is what we are drafting) never matches itself.
        buf, end = st.hist.buf, st.hist.n
        for k, table in st.followers.items():
            j0 = max(k, start)
            for key, j in zip(window_bytes(buf, j0, end, k), range(j0, end)):
                occ = table.get(key)
                if occ is None:
                    table[key] = [j]
                else:
                    occ.append(j)

    def _best_match(self, buf: np.ndarray, end: int, k: int, occ: list[int]) -> tuple[int, int]:
        """(match length, follower index) of the occurrence whose match reaches furthest back."""
        f = np.asarray(occ[-self.candidates:], dtype=np.int64)
        span = min(self.match_max - k, end - k)  # tokens before the n-gram that can be compared
        if span <= 0:
            return k, int(f[-1])
        back = np.arange(1, span + 1)
        idx = f[:, None] - k - back[None, :]
        same = (idx >= 0) & (buf[np.maximum(idx, 0)] == buf[end - k - back][None, :])
        # leading run of matches per candidate: index of the first mismatch (span if none)
        ext = np.where(same.all(axis=1), span, np.argmin(same, axis=1))
        best = len(f) - 1 - int(np.argmax(ext[::-1]))  # the most recent among the longest
        return k + int(ext[best]), int(f[best])

    def _draft_one(self, req: DraftRequest) -> Draft | None:
        self._pending.pop(req.seq_id, None)
        st, start = self._seqs.sync(req.seq_id, req.tokens)
        self._ingest(st, start)
        buf, end = st.hist.buf, st.hist.n
        limit = min(self.m, req.n_max)
        if limit <= 0:
            return None
        for k in range(min(self.n, end), self.ngram_min - 1, -1):
            occ = st.followers[k].get(buf[end - k:end].tobytes())
            if occ:
                break
        else:
            return None
        length, j = self._best_match(buf, end, k, occ)
        period = end - j  # the history repeats with this period from j on
        ids = buf[j:j + min(limit, period)].tolist()
        while len(ids) < limit:
            ids.append(ids[len(ids) - period])
        if not all(0 <= t < self.vocab_size for t in ids):
            return None
        top = self.match_max
        rate = self._accepted / self._verified
        conf = tuple(float(rate[min(length + i, top)]) for i in range(len(ids)))
        self._pending[req.seq_id] = length
        return Draft(token_ids=tuple(ids), confidence=conf)

    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]) -> Sequence[Draft | None] | None:
        """One proposal per request: the continuation of the longest earlier match, or None."""
        return [self._draft_one(r) for r in requests]

    @hookimpl
    def verified(self, results: Sequence[Verified]) -> None:
        """Count, per match length, the draft tokens verified and accepted."""
        for r in results:
            length = self._pending.pop(r.seq_id, None)
            if length is None or not r.chosen:
                continue
            # tokens after the first rejection were not judged; the rejected one was
            for i in range(min(r.n_drafted, r.n_accepted + 1)):
                b = min(length + i, self.match_max)
                self._verified[b] += 1
                self._accepted[b] += i < r.n_accepted

    def confidence_table(self) -> list[float]:
        """The current acceptance estimate per match length 0..match_max."""
        return (self._accepted / self._verified).round(4).tolist()

    @hookimpl
    def remove(self, seq_id: int, p0: int) -> None:
        """Drop the sequence's index when it ends (p0 = 0) or loses positions it consumed."""
        self._seqs.drop(seq_id, p0)
