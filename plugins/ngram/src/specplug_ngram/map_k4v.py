"""`ngram-map-k4v`: like `ngram-map-k`, but each key keeps only its k most frequent continuations.

After llama.cpp's `ngram-map-k4v`: up to `k` (default 4) values per key, and the most frequent
one is proposed only when it has at least `min_hits` hits and dominates the others kept: its
count must be at least `min_ratio` times the sum of theirs (llama.cpp uses 3; 0 turns the rule
off). A new continuation of a key whose k slots are full replaces the oldest value seen only
once; when every kept value was seen more than once, the newcomer is not kept.
"""
from __future__ import annotations

from dataclasses import dataclass

from specplug.types import TargetInfo
from specplug_ngram._common import check_int, check_number
from specplug_ngram._valuemap import Key, MapSpeculator, Value

NAME = "ngram-map-k4v"


class NgramMapK4V(MapSpeculator):
    """N-gram map speculator keeping the k most frequent continuations per key."""

    NAME = NAME

    @dataclass
    class Params:
        n: int = 3  # key n-gram size
        m: int = 8  # continuation (value) size = longest draft, also capped by the host's n_max
        k: int = 4  # continuations kept per key
        min_hits: int = 2  # hits the top continuation needs before it is proposed
        min_ratio: float = 3.0  # top count must be >= min_ratio * sum of the other kept counts

    def __init__(self, params: "NgramMapK4V.Params", target: TargetInfo):
        n = check_int(NAME, params, "n", 1)
        m = check_int(NAME, params, "m", 1)
        k = check_int(NAME, params, "k", 1)
        min_hits = check_int(NAME, params, "min_hits", 1)
        self.min_ratio = check_number(NAME, params, "min_ratio", 0.0)
        self._setup(n, m, min_hits, k, target)

    def _accept(self, entry: Key, best: Value) -> bool:
        others = entry.total - best.count
        return best.count >= self.min_hits and best.count >= self.min_ratio * others
