"""`Calibrator`: per-token confidences from a drafter's own probabilities, calibrated by outcomes."""
from __future__ import annotations

from typing import Sequence

import torch

from specplug.types import Verified


class Calibrator:
    """Per-token confidences from a drafter's own probabilities, calibrated by outcomes.

    P(token accepted | earlier ones accepted) is estimated per (draft depth, probability bucket)
    as (accepted + prior * p) / (tried + prior): the raw probability until outcomes arrive, then
    what verification actually showed. After each draft, `record_probs(seq, p)` (or `record` the
    keys), then pass `verified` results on.

    The counts live in plain Python lists: `confidence` runs once per drafted token, inside the
    drafting loop, where a tensor index would cost more than the arithmetic.
    """

    def __init__(self, enabled: bool = True, depths: int = 4, buckets: int = 10, prior: float = 4.0):
        self.enabled, self.depths, self.buckets, self.prior = enabled, depths, buckets, prior
        self._acc = [[0.0] * buckets for _ in range(depths)]
        self._tried = [[0.0] * buckets for _ in range(depths)]
        self.last: dict[int, list] = {}  # seq -> its last draft's keys (depth, bucket), or its probabilities

    @property
    def table(self) -> torch.Tensor:
        """[depth, bucket, 2] (accepted, tried): a copy of the counts, for inspection."""
        return torch.tensor([[[a, t] for a, t in zip(ra, rt)] for ra, rt in zip(self._acc, self._tried)])

    def key(self, depth: int, p: float) -> tuple[int, int]:
        """(depth, bucket) of a token drafted at `depth` with probability `p`."""
        b = int(p * self.buckets)
        return min(depth, self.depths - 1), (0 if b < 0 else self.buckets - 1 if b >= self.buckets else b)

    def confidence(self, depth: int, p: float) -> float:
        """The calibrated probability that a token drafted at `depth` with probability `p` is accepted."""
        if not self.enabled:
            return 1.0 if p > 1.0 else 0.0 if p < 0.0 else p
        d = depth if depth < self.depths else self.depths - 1
        b = int(p * self.buckets)
        b = 0 if b < 0 else self.buckets - 1 if b >= self.buckets else b
        c = (self._acc[d][b] + self.prior * p) / (self._tried[d][b] + self.prior)
        return 1.0 if c > 1.0 else 0.0 if c < 0.0 else c

    def record(self, seq: int, keys: list[tuple[int, int]]) -> None:
        """The keys of the tokens of `seq`'s draft, in order."""
        self.last[seq] = keys

    def record_probs(self, seq: int, probs: list[float]) -> None:
        """The drafter's probabilities of `seq`'s draft tokens, token i drafted at depth i."""
        self.last[seq] = probs

    def verified(self, results: Sequence[Verified]) -> None:
        """Count the outcome of each recorded draft (the `verified` hook's results): per draft token
        up to the first rejected one, tried +1, and accepted +1 for the accepted ones."""
        for v in results:
            keys = self.last.pop(v.seq_id, None)
            if not keys or not v.chosen:
                continue
            if not isinstance(keys[0], tuple):
                keys = [self.key(i, p) for i, p in enumerate(keys[:v.n_drafted])]
            for i, (d, b) in enumerate(keys[:v.n_drafted]):
                self._tried[d][b] += 1
                if i < v.n_accepted:
                    self._acc[d][b] += 1
                else:
                    break
