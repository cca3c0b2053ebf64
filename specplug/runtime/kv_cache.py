"""A KV cache for many sequences, with llama.cpp-style range removal and prefix copy.

Each sequence owns one slot of `max_ctx` cells; the token at position p lives in cell p.
A boolean `valid` map says which cells hold a token, so removing a range in the middle
(`seq_rm`) leaves a hole that attention skips, and re-decoding writes the cells again.
Speculative rollback is the common case: `seq_rm(seq, p0)` drops everything from p0 on.
"""
from __future__ import annotations

import torch

from specplug.errors import ContextFullError


class KVCache:
    """Preallocated keys/values `[n_layer, n_seq, n_head_kv, max_ctx, head_dim]` plus a valid map.

    Head-major, so each head's keys of a sequence are one contiguous block for attention.
    `spare` extra slots after the sequences' (ids n_seq...) are scratch space: a static-shape
    step points its padding rows there (StaticRows), so they never touch a sequence.
    """

    def __init__(self, n_layer: int, n_seq: int, max_ctx: int, n_head_kv: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, spare: int = 0):
        shape = (n_layer, n_seq + spare, n_head_kv, max_ctx, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.valid = torch.zeros(n_seq + spare, max_ctx, dtype=torch.bool, device=device)  # [slots, max_ctx]
        self.spare = spare
        self.n_seq = n_seq
        self.max_ctx = max_ctx
        # Python-side bookkeeping, so the hot path never syncs with the device:
        # end[s] = 1 + highest valid position of s; dense[s] = no holes below end[s].
        self.end = [0] * n_seq
        self.dense = [True] * n_seq

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
        self.valid[seq, p0:p1] = False
        if p1 >= self.end[seq]:
            rest = self.valid[seq, :p0].nonzero()
            self.end[seq] = int(rest[-1]) + 1 if len(rest) else 0
            self.dense[seq] = self.dense[seq] or bool(self.valid[seq, : self.end[seq]].all())
        else:
            self.dense[seq] = False

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int | None = None) -> None:
        """Make positions [p0, p1) of `dst` a copy of those of `src` (shared prompt prefixes)."""
        self._check_seq(src)
        self._check_seq(dst)
        p1 = self.end[src] if p1 is None else min(p1, self.end[src])
        if p0 >= p1:
            return
        self.k[:, dst, :, p0:p1] = self.k[:, src, :, p0:p1]
        self.v[:, dst, :, p0:p1] = self.v[:, src, :, p0:p1]
        self.valid[dst, p0:p1] = self.valid[src, p0:p1]
        self.end[dst] = max(self.end[dst], p1)
        self.dense[dst] = bool(self.valid[dst, : self.end[dst]].all())

    def clear(self, seq: int | None = None) -> None:
        """Forget one sequence, or all of them."""
        for s in range(self.n_seq) if seq is None else [seq]:
            self.seq_rm(s)
            self.end[s], self.dense[s] = 0, True

    def note_writes(self, seq: int, positions: list[int]) -> None:
        """Record that `positions` of `seq` are about to be written (called by the model)."""
        if max(positions) >= self.max_ctx:
            raise ContextFullError(
                f"sequence {seq} would reach position {max(positions)}, past the context size "
                f"{self.max_ctx} (raise `context` in the config or shorten the prompt/max_tokens)"
            )
        if min(positions) < 0:
            raise ValueError(f"negative position in batch for sequence {seq}: {min(positions)}")
        old = self.end[seq]
        new = max(old, max(positions) + 1)
        if self.dense[seq]:
            # still dense only if the new positions exactly fill [old, new) or overwrite valid cells
            fresh = {p for p in positions if p >= old}
            self.dense[seq] = len(fresh) == new - old
        self.end[seq] = new
