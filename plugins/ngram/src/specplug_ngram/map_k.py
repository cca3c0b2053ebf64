"""`ngram-map-k`: propose the most frequent continuation seen after the current key n-gram.

Each sequence keeps a map from every key n-gram of its history to the distinct m-token
continuations that followed it, with hit counts (see `_valuemap`). The draft is the most
frequent continuation of the last n tokens (ties: the most recent), proposed only once it
was seen at least `min_hits` times.
"""
from __future__ import annotations

from dataclasses import dataclass

from specplug.types import TargetInfo
from specplug_ngram._common import check_int
from specplug_ngram._valuemap import MapSpeculator

NAME = "ngram-map-k"


class NgramMapK(MapSpeculator):
    """N-gram map speculator with every continuation counted per key."""

    NAME = NAME

    @dataclass
    class Params:
        n: int = 3  # key n-gram size
        m: int = 8  # continuation (value) size = longest draft, also capped by the host's n_max
        min_hits: int = 2  # times the continuation must have followed the key before it is proposed

    def __init__(self, params: "NgramMapK.Params", target: TargetInfo):
        n = check_int(NAME, params, "n", 1)
        m = check_int(NAME, params, "m", 1)
        min_hits = check_int(NAME, params, "min_hits", 1)
        self._setup(n, m, min_hits, None, target)
