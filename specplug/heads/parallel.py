"""Heads that draft from the newest committed state of a sequence: the hooks they share
(`NewestStateDrafter`), and `ParallelHeadsDrafter`, the speculator half of parallel heads
(Medusa-style: k heads on the last state, one forward gives every depth).

At `draft` the newest committed state of a sequence is h(c-1), c = len(tokens) - 1 being the
last token (not in the target yet). Head k reads (h(c-1), x_c) and predicts the token at
c + 1 + k: one batched `ParallelHead.logits` call for all sequences gives every depth, and the
`DraftLoop` walks them with the stop rule (cutting where the host would trim). Training lines up
the same way (`specplug.heads.masks.parallel_mask`).

Heads where head k also reads the tokens drafted before it (Hydra-style) use
`specplug.heads.sequential.SequentialHeadsDrafter`, on the same base.

A subclass calls `setup(head, target, state_dim, ...)` in its constructor and, where the state
is not the target's final hidden state, overrides `row_states(batch, encoded)`.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from specplug.heads.calibrate import Calibrator
from specplug.heads.loop import DraftLoop
from specplug.heads.state import StateKeeper
from specplug.hooks import hookimpl
from specplug.types import Batch, Draft, DraftRequest, TargetInfo, Verified


class ParallelHead(Protocol):
    """The heads' inference form: no cache, every depth from the newest state at once."""

    d2t: torch.Tensor  # [draft vocab] int64: draft row -> target token id
    depths: int  # heads, i.e. the longest draft

    def logits(self, states: torch.Tensor, token_ids: Sequence[int]) -> torch.Tensor:
        """(h(c-1) [n, d], x_c [n]) -> [n, depths, draft vocab]: head k's logits for the token at c + 1 + k."""


class NewestStateDrafter:
    """Hooks `process_batch`, `remove` and `verified` for heads that draft from the newest committed
    state of each sequence (kept by a `StateKeeper`); a subclass implements `draft`.

    After `setup`: `self.heads` (the head), `self.keeper` (the states), `self.zeros` (the state
    before position 0), `self.calib` (the confidences) and `self.loop` (the `DraftLoop`)."""

    def setup(self, head, target: TargetInfo, state_dim: int, temperature: float = 0.0,
              stop_below: float = 0.15, calibrate: bool = True) -> None:
        """head: the inference form (with `d2t` and `depths`); state_dim: width of the states (zeros
        before position 0); temperature: 0 drafts the argmax, else samples; stop_below: the cumulative
        confidence under which a draft stops; calibrate: confidences from what `verified` reports."""
        self.heads = head
        self.zeros = torch.zeros(state_dim, device=target.device)
        self.keeper = StateKeeper(target.n_seq)
        self.calib = Calibrator(calibrate, depths=max(1, head.depths))
        self.loop = DraftLoop(target, head.d2t, temperature, stop_below, self.calib)

    def row_states(self, batch: Batch, encoded: torch.Tensor | None) -> torch.Tensor:
        """[len(batch), d] the state each committed row leaves (default: `encoded`, else the final state)."""
        return encoded if encoded is not None else batch.embeddings["final"]

    def live_states(self, requests: Sequence[DraftRequest]) -> tuple[list[int], torch.Tensor | None]:
        """(indices of the requests that can draft, their newest states h(c-1) [len(live), d]);
        (the empty list, None) when none can."""
        live = [i for i, r in enumerate(requests) if r.n_max >= 1 and self.keeper.ready(r)]
        if not live:
            return [], None
        return live, self.keeper.states([requests[i].seq_id for i in live], self.zeros)

    @hookimpl
    def process_batch(self, batch: Batch, encoded) -> None:
        self.keeper.receive(batch, self.row_states(batch, encoded))

    @hookimpl
    def remove(self, seq_id: int, p0: int) -> None:
        self.keeper.remove(seq_id, p0)

    @hookimpl
    def verified(self, results: Sequence[Verified]) -> None:
        self.calib.verified(results)


class ParallelHeadsDrafter(NewestStateDrafter):
    """Hooks `process_batch`, `draft`, `verified`, `remove` for a `ParallelHead` (given to `setup`)."""

    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft | None]:
        live, states = self.live_states(requests)
        if not live:
            return [None] * len(requests)
        k = self.heads.depths
        logits = self.heads.logits(states, [requests[i].tokens[-1] for i in live])
        return self.loop.run_block(requests, live, logits.reshape(len(live) * k, -1), [k] * len(live))
