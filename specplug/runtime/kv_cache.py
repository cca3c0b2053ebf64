"""A KV cache for many sequences, with llama.cpp-style range removal and prefix copy.

Each sequence owns one slot of `max_ctx` cells; the token at position p lives in cell p.
A boolean `valid` map says which positions hold a token, so removing a range in the middle
(`seq_rm`) leaves a hole that attention skips, and re-decoding writes the cells again.
Speculative rollback is the common case: `seq_rm(seq, p0)` drops everything from p0 on.

Sliding-window layers (Gemma 3's local layers) keep a ring instead: `window + slack` cells, the
token at position p in cell p % cells. A query at q reads positions (q - window, q]; the ring
still holds them as long as nothing at or past their position + cells was written since, which
the cache checks on every write (`note_writes`): a forward may write up to `slack` positions past
its first query (prompt chunks, drafted rows), and a rollback of up to `slack` positions stays
exact, since the positions it uncovers were never overwritten.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from specplug.errors import ContextFullError
from specplug.runtime import pages

RING_SLACK = 512  # cells past the window a sliding layer's ring keeps (llama.cpp: the ubatch size)


class KVCache:
    """Preallocated keys/values `[n_layer, n_seq, n_head_kv, max_ctx, head_dim]` plus a valid map.

    Head-major, so each head's keys of a sequence are one contiguous block for attention.
    `spare` extra slots after the sequences' (ids n_seq...) are scratch space: a static-shape
    step points its padding rows there (StaticRows), so they never touch a sequence.

    `windows` (one per layer, 0 = none) makes the sliding layers rings of min(max_ctx, window +
    slack) cells; `k` and `v` are then lists of per-layer tensors [slots, n_head_kv, cells, head_dim]
    (`k[li]` works either way) and `cells[li]` says each layer's count.
    """

    def __init__(self, n_layer: int, n_seq: int, max_ctx: int, n_head_kv: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, spare: int = 0, windows: Sequence[int] | None = None,
                 slack: int = RING_SLACK):
        windows = [int(w) for w in windows] if windows is not None else [0] * n_layer
        assert len(windows) == n_layer and min(windows, default=0) >= 0, (n_layer, windows)
        self.windows = windows
        self.cells = [min(max_ctx, w + slack) if w else max_ctx for w in windows]
        self.dtype, self.device = dtype, torch.device(device)
        slots = n_seq + spare
        if all(c == max_ctx for c in self.cells):
            shape = (n_layer, slots, n_head_kv, max_ctx, head_dim)
            self.k = pages.zeros(shape, dtype, device)  # on 2 MB pages on CPU (specplug.runtime.pages)
            self.v = pages.zeros(shape, dtype, device)
        else:  # one backing tensor per cell count, each layer a view of its own
            self.k, self.v = [None] * n_layer, [None] * n_layer
            for n in sorted(set(self.cells)):
                layers = [li for li, c in enumerate(self.cells) if c == n]
                shape = (len(layers), slots, n_head_kv, n, head_dim)
                k, v = pages.zeros(shape, dtype, device), pages.zeros(shape, dtype, device)
                for j, li in enumerate(layers):
                    self.k[li], self.v[li] = k[j], v[j]
        self.ring = min(self.cells) < max_ctx
        # (window, cells) of the tightest ring: the one whose slack runs out first
        self._ring_limit = min(((w, c) for w, c in zip(windows, self.cells) if w and c < max_ctx),
                               key=lambda wc: wc[1] - wc[0], default=None)
        self.valid = torch.zeros(slots, max_ctx, dtype=torch.bool, device=device)  # [slots, max_ctx]
        # on CPU the same memory as a numpy array: the few cells a decoding step marks or a rollback
        # clears cost ~1 us there against 5-20 us of torch indexing (drafting touches them every step)
        self._valid_np = self.valid.numpy() if self.device.type == "cpu" else None
        self.spare = spare
        self.n_seq = n_seq
        self.max_ctx = max_ctx
        # Python-side bookkeeping, so the hot path never syncs with the device:
        # end[s] = 1 + highest valid position of s; dense[s] = no holes below end[s];
        # high[s] = highest position written since s was last empty (what a ring may have overwritten).
        self.end = [0] * n_seq
        self.dense = [True] * n_seq
        self.high = [-1] * n_seq

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq:
            raise ValueError(f"sequence id {seq} out of range: this cache holds {self.n_seq} sequences")

    def seq_len(self, seq: int) -> int:
        """One past the highest position stored for `seq` (0 for an empty sequence)."""
        self._check_seq(seq)
        return self.end[seq]

    def seq_rm(self, seq: int, p0: int = 0, p1: int | None = None) -> None:
        """Remove positions [p0, p1) of `seq` (p1=None: to the end), like llama_memory_seq_rm."""
        self._check_seq(seq)
        p0 = max(0, p0)
        p1 = self.end[seq] if p1 is None else min(p1, self.end[seq])
        if p0 >= p1:
            return
        v = self.valid if self._valid_np is None else self._valid_np
        v[seq, p0:p1] = False
        if p1 >= self.end[seq]:
            rest = v[seq, :p0].nonzero() if self._valid_np is None else np.flatnonzero(v[seq, :p0])
            self.end[seq] = int(rest[-1]) + 1 if len(rest) else 0
            self.dense[seq] = self.dense[seq] or bool(v[seq, : self.end[seq]].all())
        else:
            self.dense[seq] = False
        if self.end[seq] == 0:
            self.high[seq] = -1

    def mark(self, seq_ids: Sequence[int], positions: Sequence[int]) -> None:
        """Set the valid bit of each (seq, position) pair (the cells a forward writes)."""
        if self._valid_np is not None:
            if len(seq_ids) <= 16:  # a decode or verification step: item by item costs less than fancy indexing
                v = self._valid_np
                for s, p in zip(seq_ids, positions):
                    v[s, p] = True
            else:
                self._valid_np[seq_ids, positions] = True
        else:
            rows = torch.as_tensor(seq_ids, device=self.device)
            self.valid[rows, torch.as_tensor(positions, device=self.device)] = True

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int | None = None) -> None:
        """Make positions [p0, p1) of `dst` a copy of those of `src` (shared prompt prefixes).
        With ring layers, `dst` must hold nothing from p0 on (a prefix copied into a shorter sequence)."""
        self._check_seq(src)
        self._check_seq(dst)
        p1 = self.end[src] if p1 is None else min(p1, self.end[src])
        if p0 >= p1:
            return
        if self.ring and self.end[dst] > p0:
            raise ValueError(f"seq_cp into sequence {dst}: with sliding-window rings the destination must hold "
                             f"nothing from position {p0} on (it holds up to {self.end[dst] - 1}); seq_rm it first")
        for li, n in enumerate(self.cells):
            if n == self.max_ctx:
                self.k[li][dst, :, p0:p1] = self.k[li][src, :, p0:p1]
                self.v[li][dst, :, p0:p1] = self.v[li][src, :, p0:p1]
            else:  # the ring cells of the positions src still holds
                held = torch.arange(max(p0, self.high[src] - n + 1), p1, device=self.device) % n
                self.k[li][dst, :, held] = self.k[li][src, :, held]
                self.v[li][dst, :, held] = self.v[li][src, :, held]
        self.valid[dst, p0:p1] = self.valid[src, p0:p1]
        self.end[dst] = max(self.end[dst], p1)
        self.dense[dst] = bool(self.valid[dst, : self.end[dst]].all())
        self.high[dst] = max(self.high[dst], self.high[src] if self.ring else p1 - 1)

    def clear(self, seq: int | None = None) -> None:
        """Forget one sequence, or all of them."""
        for s in range(self.n_seq) if seq is None else [seq]:
            self.seq_rm(s)
            self.end[s], self.dense[s], self.high[s] = 0, True, -1

    def note_writes(self, seq: int, positions: list[int]) -> None:
        """Record that `positions` of `seq` are about to be written (called by the model)."""
        if max(positions) >= self.max_ctx:
            raise ContextFullError(
                f"sequence {seq} would reach position {max(positions)}, past the context size "
                f"{self.max_ctx} (raise `context` in the config or shorten the prompt/max_tokens)"
            )
        if min(positions) < 0:
            raise ValueError(f"negative position in batch for sequence {seq}: {min(positions)}")
        high = max(self.high[seq], max(positions))
        if self._ring_limit is not None:
            window, cells = self._ring_limit
            first = max(0, min(positions) - window + 1)  # the oldest position a row of this batch reads
            if high >= first + cells:
                raise ValueError(
                    f"sequence {seq}: a sliding-window ring of {cells} cells no longer holds position {first}, "
                    f"which position {min(positions)} reads (position {high} was written since); a forward "
                    f"may run at most {cells - window} positions ahead of its first row, and a rollback "
                    f"may go back at most that far (clear the sequence and prefill it again)")
        self.high[seq] = high
        old = self.end[seq]
        new = max(old, max(positions) + 1)
        if self.dense[seq]:
            # still dense only if the new positions exactly fill [old, new) or overwrite valid cells
            fresh = {p for p in positions if p >= old}
            self.dense[seq] = len(fresh) == new - old
        self.end[seq] = new

    def ring_rows(self) -> int:
        """The most rows of one sequence a forward may hold (positions in a row) with these rings."""
        if self._ring_limit is None:
            return self.max_ctx
        window, cells = self._ring_limit
        return cells - window
