"""`SequentialHeadsDrafter`: the speculator half of sequentially dependent heads (Hydra-style):
head k reads the newest committed state h(c-1), the last token x_c and the k tokens drafted
before it, so each depth is one batched call that knows what the depths before it picked.

The head's inference form is a `SequentialHead`:
- `start(states, token_ids)`: head 0 from (h(c-1) [n, d], x_c [n]) for every drafting sequence
  at once; it returns a carry [n, ...] (whatever head 1 needs: Hydra's running input, a hidden
  state, the token embeddings so far) and head 0's logits [n, draft vocab];
- `advance(depth, carry, token_ids)`: head `depth` for the rows that go on; `carry` holds those
  rows of the previous call's carry (the drafter selects them: the stop rule drops sequences
  between depths) and `token_ids` the tokens drafted at depth - 1 for them, as target ids. It
  returns the next carry and logits in the same row order.

Nothing is cached between drafts: every draft starts again from the newest committed state, so
rejections need no rollback beyond the `StateKeeper`'s. The drafter calls `advance` only for
the rows the `DraftLoop`'s stop rule keeps (no forward is spent on a token the host would trim)
and never beyond `head.depths`.

A subclass calls `setup(head, target, state_dim, ...)` in its constructor (as for
`ParallelHeadsDrafter`, whose hooks it shares) and adds `are_compatible` / `request_embeddings`.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from specplug.heads.loop import Picks
from specplug.heads.parallel import NewestStateDrafter
from specplug.hooks import hookimpl
from specplug.runtime.linear import take_rows
from specplug.types import Draft, DraftRequest


class SequentialHead(Protocol):
    """The inference form of heads where head k also reads the tokens drafted at depths < k."""

    d2t: torch.Tensor  # [draft vocab] int64: draft row -> target token id
    depths: int  # heads, i.e. the longest draft

    def start(self, states: torch.Tensor, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(h(c-1) [n, d], x_c [n]) -> (carry [n, ...], head 0's logits [n, draft vocab])."""

    def advance(self, depth: int, carry: torch.Tensor, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(carry [m, ...] of the rows that go on, the target ids they drafted at depth - 1 [m])
        -> (carry [m, ...], head `depth`'s logits [m, draft vocab]); 1 <= depth < depths."""


class SequentialHeadsDrafter(NewestStateDrafter):
    """Hooks `process_batch`, `draft`, `verified`, `remove` for a `SequentialHead` (given to `setup`)."""

    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft | None]:
        live, states = self.live_states(requests)
        if not live:
            return [None] * len(requests)
        head, loop = self.heads, self.loop
        carry, logits = head.start(states, [requests[i].tokens[-1] for i in live])

        def advance(depth: int, rows: list[int], tokens: list[int], reqs: list[int]) -> Picks:
            nonlocal carry
            carry, logits = head.advance(depth, take_rows(carry, rows), tokens)
            return loop.pick(logits)

        return loop.run(requests, live, loop.pick(logits), advance, [head.depths] * len(live))
