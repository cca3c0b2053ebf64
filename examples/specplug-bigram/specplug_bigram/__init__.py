"""A complete small speculator: per-sequence bigram counts, learnt from the committed context."""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Sequence

from specplug.errors import ConfigError
from specplug.hooks import hookimpl
from specplug.types import Batch, Draft, DraftRequest, TargetInfo, Verified


class Bigram:
    """Drafts by following, from the last token, the most frequent successor seen so far."""

    @dataclass(frozen=True)
    class Params:
        min_count: int = 2  # a successor must have been seen this often to be proposed
        length: int = 6  # longest draft (the host's n_max caps it too)

    def __init__(self, params: Params, target: TargetInfo):
        if params.min_count < 1 or params.length < 1:
            raise ConfigError(f"bigram: min_count and length must be >= 1, got {params}")
        self.params = params
        # seq id -> token -> Counter of next tokens; last committed token per sequence
        self.counts: dict[int, dict[int, Counter]] = defaultdict(lambda: defaultdict(Counter))
        self.last: dict[int, int] = {}
        self.accepted = self.drafted = 0

    @hookimpl
    def process_batch(self, batch: Batch, encoded) -> None:
        # rows of one sequence come in position order, continuing its committed context
        for tok, seq in zip(batch.token_ids.tolist(), batch.seq_ids.tolist()):
            prev = self.last.get(seq)
            if prev is not None:
                self.counts[seq][prev][tok] += 1
            self.last[seq] = tok

    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft | None]:
        out = []
        for r in requests:
            table, tok, ids = self.counts[r.seq_id], r.tokens[-1], []
            while len(ids) < min(self.params.length, r.n_max):
                best = table[tok].most_common(1) if tok in table else []
                if not best or best[0][1] < self.params.min_count:
                    break
                tok = best[0][0]
                ids.append(tok)
            out.append(Draft(tuple(ids)) if ids else None)
        return out

    @hookimpl
    def verified(self, results: Sequence[Verified]) -> None:
        for v in results:
            if v.chosen:
                self.drafted += v.n_drafted
                self.accepted += v.n_accepted

    @hookimpl
    def remove(self, seq_id: int, p0: int) -> None:
        if p0 == 0:  # the sequence ended: forget it (its id will be reused)
            self.counts.pop(seq_id, None)
            self.last.pop(seq_id, None)
