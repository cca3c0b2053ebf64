"""`ngram-mod`: one hashed n-gram pool shared by every sequence of the run.

After llama.cpp's `common_ngram_mod`: a fixed array of 2^pool_bits token ids maps the hash of
an n-gram to the token that most recently followed it (in any sequence). Drafting chains
lookups: the last n tokens give a token, which is appended, and the new last n tokens are
looked up again, until an empty slot or the length limit. Hash collisions are never checked
against the history: a wrong token costs one rejected draft position, nothing else.

Per sequence, the speculator turns itself off after `max_dead` consecutive verified drafts
with no accepted token, sits out `dead_backoff` draft calls, then drafts once more as a probe;
a probe with nothing accepted doubles the back-off (up to `dead_backoff_max`), any accepted token
resets it. When a new sequence starts and the pool is fuller than `max_occupancy`, the pool
is cleared (llama.cpp does the same at 25%), since a crowded pool mostly drafts collisions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specplug.hooks import hookimpl
from specplug.types import Draft, DraftRequest, TargetInfo, Verified
from specplug_ngram._common import History, SequenceStates, check_int, check_number, make_draft

NAME = "ngram-mod"
EMPTY = -1
_MASK = (1 << 64) - 1
_MULT = 6364136223846793005  # llama.cpp's polynomial (LCG) multiplier
_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: the top bits of h * _MIX index the pool
_BULK_MIN = 24  # below this many new n-grams the rolling Python loop beats numpy's fixed cost


class Pool:
    """A 2^bits array of token ids indexed by a 64-bit polynomial hash of n tokens."""

    def __init__(self, n: int, bits: int):
        self.n, self.shift = n, 64 - bits
        self.table = np.full(1 << bits, EMPTY, dtype=np.int32)
        self.used = 0  # slots holding a token
        powers = [pow(_MULT, n - 1 - i, 1 << 64) for i in range(n)]
        self._top = powers[0]  # weight of the oldest token, removed when the window rolls
        self._powers = np.array(powers, dtype=np.uint64)

    @property
    def occupancy(self) -> float:
        """Fraction of slots in use."""
        return self.used / self.table.shape[0]

    def reset(self) -> None:
        """Empty every slot."""
        self.table.fill(EMPTY)
        self.used = 0

    @staticmethod
    def hash(tokens: Sequence[int]) -> int:
        """The hash of exactly n tokens: sum of t_i * MULT^(n-1-i) mod 2^64."""
        h = 0
        for t in tokens:
            h = (h * _MULT + t) & _MASK
        return h

    def roll(self, h: int, old: int, new: int) -> int:
        """The hash of the window moved one token on: `old` leaves, `new` enters."""
        return ((h - old * self._top) * _MULT + new) & _MASK

    def slot(self, h: int) -> int:
        """The pool index of hash `h`."""
        return ((h * _MIX) & _MASK) >> self.shift

    def get(self, h: int) -> int:
        """The token stored for hash `h`, or EMPTY."""
        return int(self.table[self.slot(h)])

    def add_range(self, buf: np.ndarray, j0: int, j1: int) -> None:
        """Store buf[j] as the follower of the n-gram buf[j-n:j], for j in [j0, j1)."""
        n, table = self.n, self.table
        j0 = max(j0, n)
        if j1 <= j0:
            return
        if j1 - j0 < _BULK_MIN:
            h = self.hash(buf[j0 - n:j0].tolist())
            for j in range(j0, j1):
                s = self.slot(h)
                if table[s] == EMPTY:
                    self.used += 1
                table[s] = buf[j]
                h = self.roll(h, int(buf[j - n]), int(buf[j]))
            return
        windows = sliding_window_view(buf[j0 - n:j1 - 1], n).astype(np.uint64)
        with np.errstate(over="ignore"):  # arithmetic is meant to wrap mod 2^64
            h = windows @ self._powers
            idx = ((h * np.uint64(_MIX)) >> np.uint64(self.shift)).astype(np.intp)
        self.used += int(np.unique(idx[table[idx] == EMPTY]).size)
        table[idx] = buf[j0:j1]  # repeated slots: the last (most recent) write wins

    def chain(self, window: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens continuing `window` (n tokens), one lookup per token."""
        seq = list(window)
        h = self.hash(seq)
        out: list[int] = []
        for i in range(limit):
            t = self.get(h)
            if t < 0:
                break
            out.append(t)
            seq.append(t)
            h = self.roll(h, seq[i], t)
        return out


class _Gate:
    """Per-sequence on/off state driven by verification results."""

    __slots__ = ("dead", "calls", "off_until", "next_backoff", "probing")

    def __init__(self, backoff: int):
        self.dead = 0  # consecutive verified drafts with nothing accepted
        self.calls = 0  # draft calls seen for this sequence
        self.off_until = 0  # no drafts while calls <= off_until
        self.next_backoff = backoff  # draft calls to sit out the next time it turns off
        self.probing = False  # turned off before and not yet accepted since


class _SeqState:
    __slots__ = ("hist",)

    def __init__(self, capacity: int):
        self.hist = History(capacity)


class NgramMod:
    """Shared hashed n-gram pool speculator with variable draft length and dead-draft back-off."""

    @dataclass
    class Params:
        n: int = 12  # n-gram size hashed (llama.cpp warns below 16: short n-grams recur with other followers)
        m: int = 16  # longest draft, also capped by the host's n_max
        pool_bits: int = 22  # pool of 2^22 int32 slots = 16 MiB, as llama.cpp
        max_dead: int = 3  # consecutive drafts with 0 accepted that turn a sequence off (0: never)
        # draft calls a sequence sits out when turned off, doubled per failed probe (not `backoff`:
        # that YAML key is the host's own pause after fully rejected drafts)
        dead_backoff: int = 16
        dead_backoff_max: int = 1024  # cap of the doubling back-off
        max_occupancy: float = 0.25  # clear the pool when a sequence starts and it is fuller than this

    def __init__(self, params: "NgramMod.Params", target: TargetInfo):
        self.n = check_int(NAME, params, "n", 1)
        self.m = check_int(NAME, params, "m", 1)
        bits = check_int(NAME, params, "pool_bits", 8, 30)
        self.max_dead = check_int(NAME, params, "max_dead", 0)
        self.backoff = check_int(NAME, params, "dead_backoff", 1)
        self.backoff_max = check_int(NAME, params, "dead_backoff_max", self.backoff)
        self.max_occupancy = check_number(NAME, params, "max_occupancy", 0.0, 1.0)
        self.vocab_size = target.vocab_size
        self.pool = Pool(self.n, bits)
        capacity = min(target.max_ctx, 1 << 16)
        self._seqs: SequenceStates[_SeqState] = SequenceStates(lambda: _SeqState(capacity))
        self._gates: dict[int, _Gate] = {}

    @hookimpl
    def are_compatible(self, target: TargetInfo) -> str | None:
        """Token-only: compatible with any target."""
        return None

    def _draft_one(self, req: DraftRequest) -> Draft | None:
        st, start = self._seqs.sync(req.seq_id, req.tokens)
        end = st.hist.n
        if start == 0 and self.pool.occupancy > self.max_occupancy:
            self.pool.reset()
        # ingest before gating: a sequence that is off still teaches the shared pool
        self.pool.add_range(st.hist.buf, start, end)
        gate = self._gates.get(req.seq_id)
        if gate is None:
            gate = self._gates[req.seq_id] = _Gate(self.backoff)
        gate.calls += 1
        limit = min(self.m, req.n_max)
        if gate.calls <= gate.off_until or end < self.n or limit <= 0:
            return None
        out = self.pool.chain(st.hist.buf[end - self.n:end].tolist(), limit)
        return make_draft(out, req.n_max, self.vocab_size)

    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]) -> Sequence[Draft | None] | None:
        """One proposal per request: the chained pool lookups after the last n tokens, or None."""
        return [self._draft_one(r) for r in requests]

    @hookimpl
    def verified(self, results: Sequence[Verified]) -> None:
        """Count dead drafts per sequence; turn a sequence off, or back on, accordingly."""
        for r in results:
            gate = self._gates.get(r.seq_id)
            if gate is None or not r.chosen or r.n_drafted <= 0:
                continue  # no draft of ours was verified: nothing learnt
            if r.n_accepted > 0:
                gate.dead, gate.probing, gate.next_backoff = 0, False, self.backoff
                continue
            gate.dead += 1
            if gate.probing or (self.max_dead > 0 and gate.dead >= self.max_dead):
                gate.off_until = gate.calls + gate.next_backoff
                gate.next_backoff = min(2 * gate.next_backoff, self.backoff_max)
                gate.probing, gate.dead = True, 0

    @hookimpl
    def remove(self, seq_id: int, p0: int) -> None:
        """Forget the sequence's history (and, when it ends, its on/off state); the pool keeps its n-grams."""
        self._seqs.drop(seq_id, p0)
        if p0 <= 0:
            self._gates.pop(seq_id, None)
