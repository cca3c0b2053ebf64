"""`StateKeeper`: what a hidden-state method keeps of each sequence between hooks.

Per sequence: how many committed positions `process_batch` delivered (`received`), the state of
the newest one (`last`, the row of position received - 1), and whether rows were missed
(`broken`: a row arrived that does not continue the sequence, or `remove` took committed rows
back; no drafts until the sequence restarts at position 0).

The alignment at `draft`: the last token of `DraftRequest.tokens` is not in the target yet, so
the newest state a method can have is h(len(tokens) - 2), and the host always delivers it (after
a verification, `process_batch` gets the committed rows before the next `draft`).
`assert_draft_aligned` says so in one line; `StateKeeper.ready` is the same check as a bool.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from specplug.types import Batch, DraftRequest


def newest_state_position(tokens: Sequence[int]) -> int:
    """The position of the newest target state a method can hold at `draft`: len(tokens) - 2
    (-1 for a one-token history: nothing committed yet)."""
    return len(tokens) - 2


def assert_draft_aligned(received: int, tokens: Sequence[int], seq_id: int | None = None) -> None:
    """Assert that `received` committed positions (0..received-1 delivered by `process_batch`) are
    exactly what a `draft` for this history needs: the states up to h(len(tokens) - 2)."""
    assert received == len(tokens) - 1, (
        f"seq {seq_id}: {received} committed positions received, but a draft after {len(tokens)} tokens needs "
        f"h(0..{len(tokens) - 2}): {len(tokens) - 1} positions (the last token is not in the target yet)")


class StateKeeper:
    """The last committed state per sequence, kept in step through `process_batch` and `remove`.

    `on_reset(seq)` is called when a sequence starts over (position 0 arrives, or `remove(seq, 0)`),
    for a method's own per-sequence state (its head's cache rows, say).
    """

    def __init__(self, n_seq: int, on_reset: Callable[[int], None] | None = None):
        self.received = [0] * n_seq  # committed positions [0, received) delivered
        self.last: list[torch.Tensor | None] = [None] * n_seq  # [d] the state of position received - 1
        self.broken = [False] * n_seq
        self.on_reset = on_reset

    def reset(self, seq: int) -> None:
        """Forget sequence `seq` (as `remove(seq, 0)`): nothing received, no state; calls `on_reset`."""
        self.received[seq], self.last[seq], self.broken[seq] = 0, None, False
        if self.on_reset is not None:
            self.on_reset(seq)

    def receive(self, batch: Batch, states: torch.Tensor | None = None,
                with_prev: bool = False) -> tuple[list[int], list[torch.Tensor | None] | None]:
        """Take a committed batch (the `process_batch` arguments: `states` [len(batch), d] per row, or
        None to keep no states). Returns the rows that continue their sequence, in order, and with
        `with_prev` each one's previous state h(t-1) (None before position 0) for pairing methods."""
        rows: list[int] = []
        prev: list[torch.Tensor | None] | None = [] if with_prev else None
        newest: dict[int, int] = {}  # seq -> its newest row in this batch
        received, broken = self.received, self.broken
        for i, (p, s) in enumerate(zip(batch.positions.tolist(), batch.seq_ids.tolist())):
            if p != received[s]:
                if p != 0:
                    broken[s] = True
                    continue
                self.reset(s)
                newest.pop(s, None)
            elif broken[s]:
                continue
            rows.append(i)
            if prev is not None:
                j = newest.get(s)
                prev.append(self.last[s] if j is None else states[j])
            newest[s] = i
            received[s] = p + 1
        if states is not None:
            for s, i in newest.items():  # a copy: a view would keep the whole batch's tensor alive
                self.last[s] = states[i].clone()
        return rows, prev

    def remove(self, seq: int, p0: int) -> None:
        """The `remove` hook: positions >= p0 are gone; taking back committed rows breaks the sequence."""
        if p0 <= 0:
            self.reset(seq)
        elif self.received[seq] > p0:
            self.broken[seq] = True

    def ready(self, r: DraftRequest) -> bool:
        """Whether the sequence is in step for this draft (every committed row received, nothing missed)."""
        return not self.broken[r.seq_id] and self.received[r.seq_id] == len(r.tokens) - 1

    def states(self, seqs: Sequence[int], zeros: torch.Tensor) -> torch.Tensor:
        """[len(seqs), d] the newest state of each sequence (`zeros` [d] where none is committed yet)."""
        return torch.stack([zeros if self.last[s] is None else self.last[s] for s in seqs])
