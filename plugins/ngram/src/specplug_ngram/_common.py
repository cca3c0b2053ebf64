"""Shared pieces of the n-gram speculators: parameter checks, per-sequence history, draft clipping.

Every speculator here derives its per-sequence state from `DraftRequest.tokens` alone and
consumes it incrementally: a `History` remembers how much of the sequence it has seen, so
each step only the newly committed tokens are indexed. A history that no longer continues
what was seen (shorter, or different at a spot-checked position) is rebuilt from scratch.
"""
from __future__ import annotations

from typing import Any, Callable, Generic, Sequence, TypeVar

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specplug.errors import ConfigError
from specplug.types import Draft

TOKEN_DTYPE = np.int32  # token ids are < 2^31 for every GGUF vocabulary

# Below this many windows a Python loop beats the fixed cost (~20 us) of numpy window views.
_BULK_MIN = 24


def check_int(type_name: str, params: Any, name: str, minimum: int, maximum: int | None = None) -> int:
    """The int parameter `name` of `params`, or a ConfigError naming it when out of range."""
    value = getattr(params, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{type_name}: {name} must be an integer, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{type_name}: {name} must be {bound}, got {value}")
    return value


def check_number(type_name: str, params: Any, name: str, minimum: float, maximum: float | None = None) -> float:
    """The numeric parameter `name` of `params` as a float, or a ConfigError naming it."""
    value = getattr(params, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{type_name}: {name} must be a number, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"{type_name}: {name} must be {bound}, got {value}")
    return float(value)


def _as_array(tokens: Sequence[int], start: int, stop: int) -> np.ndarray:
    # The history may be a list, tuple, numpy array or CPU tensor: all of them slice.
    try:
        part = tokens[start:stop]
    except TypeError:  # a Sequence that only takes integer indices
        part = [tokens[i] for i in range(start, stop)]
    return np.asarray(part, dtype=np.int64).astype(TOKEN_DTYPE, copy=False)


class History:
    """One sequence's tokens in a growing int32 buffer; `n` is how many have been consumed."""

    __slots__ = ("buf", "n")

    def __init__(self, capacity: int = 1024):
        self.buf = np.empty(max(16, capacity), dtype=TOKEN_DTYPE)
        self.n = 0

    def continued_by(self, tokens: Sequence[int]) -> bool:
        """Whether `tokens` starts with what was consumed (O(1): length plus three spot checks)."""
        n = self.n
        if len(tokens) < n:
            return False
        if n == 0:
            return True
        buf = self.buf
        return all(int(tokens[i]) == int(buf[i]) for i in (n - 1, 0, n // 2))

    def extend_to(self, tokens: Sequence[int]) -> int:
        """Append tokens[n:] and return the old `n` (the index of the first new token)."""
        old, new = self.n, len(tokens)
        if new > old:
            if new > self.buf.shape[0]:
                grown = np.empty(max(new, 2 * self.buf.shape[0]), dtype=TOKEN_DTYPE)
                grown[:old] = self.buf[:old]
                self.buf = grown
            self.buf[old:new] = _as_array(tokens, old, new)
            self.n = new
        return old

    def view(self) -> np.ndarray:
        """The consumed tokens (a view, valid until the next extend)."""
        return self.buf[:self.n]


def window_bytes(buf: np.ndarray, j0: int, j1: int, width: int) -> list[bytes]:
    """Keys of the n-grams buf[j-width:j] for j in [j0, j1), as bytes (hashable, exact)."""
    count = j1 - j0
    if count <= 0:
        return []
    if count < _BULK_MIN:
        return [buf[j - width:j].tobytes() for j in range(j0, j1)]
    windows = np.ascontiguousarray(sliding_window_view(buf[j0 - width:j1 - 1], width))
    return windows.view(np.dtype((np.void, width * buf.itemsize))).ravel().tolist()


def make_draft(token_ids: Sequence[int], n_max: int, vocab_size: int) -> Draft | None:
    """A Draft of at most `n_max` ids, cut at the first id outside [0, vocab_size); None if empty."""
    ids = []
    for t in token_ids[:max(0, n_max)]:
        t = int(t)
        if not 0 <= t < vocab_size:
            break
        ids.append(t)
    return Draft(token_ids=tuple(ids)) if ids else None


S = TypeVar("S")


class SequenceStates(Generic[S]):
    """Per-sequence states keyed by seq_id, each holding a `hist: History`, kept in step with requests.

    `sync` returns the state and the index of the first token not yet consumed; a state whose
    history no longer matches (sequence reused, history shrank) is replaced by a fresh one.
    """

    def __init__(self, factory: Callable[[], S]):
        self._factory = factory
        self._states: dict[int, S] = {}

    def sync(self, seq_id: int, tokens: Sequence[int]) -> tuple[S, int]:
        """The state of `seq_id` after consuming `tokens`, and where the new tokens start."""
        st = self._states.get(seq_id)
        if st is None or not st.hist.continued_by(tokens):  # type: ignore[attr-defined]
            st = self._states[seq_id] = self._factory()
        return st, st.hist.extend_to(tokens)  # type: ignore[attr-defined]

    def get(self, seq_id: int) -> S | None:
        """The state of `seq_id`, or None if it has none."""
        return self._states.get(seq_id)

    def drop(self, seq_id: int, p0: int) -> S | None:
        """Forget `seq_id` when positions it consumed are gone (p0 = 0: the sequence ended).

        Returns the dropped state (or None). A rollback past what was consumed cannot happen in
        the normal draft/verify loop (the history never holds rejected draft tokens), so a
        rebuild on the next draft is cheaper than undoing counts.
        """
        st = self._states.get(seq_id)
        if st is not None and (p0 <= 0 or p0 < st.hist.n):  # type: ignore[attr-defined]
            return self._states.pop(seq_id)
        return None

    def items(self):
        """(seq_id, state) pairs."""
        return self._states.items()
