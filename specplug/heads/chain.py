"""`ChainDrafter`: the speculator half every recursive "pair" head shares (MTP, Eagle3, and the like).

Such a head reads, at position t, the pair [h(t-1), x_t]: a state derived from the target at
the previous position (MTP: the pre-norm final state; Eagle3: three layer inputs fused by
`encode`) and the embedding of the token at t. It drafts by recursion, feeding its own output
state in place of h. What differs between methods is the head's forward (given as a
`ChainHead`); the rest is built from the toolkit's parts: a `StateKeeper` (committed rows in
step, the position check, `remove`) and a `DraftLoop` (picking, confidences, the stop rule).

State per sequence:
- `process_batch` receives committed rows (x_t, t, h_t) and queues the pairs [h(t-1), x_t]
  (zeros before position 0); nothing runs yet.
- `draft` runs, in one batched head forward for all sequences, the queued pairs plus the pair
  of the last token (not yet in the target: [h(c-1), x_c]); that row's output gives the first
  draft token. Each further draft token is one more batched forward over the sequences the
  stop rule keeps, fed [own output state at t-1, drafted x_t]. The head's cache then holds
  exact pairs up to c (`done`) and draft states after it, which the next `draft` (or `remove`)
  drops.
- `remove(seq, p0)` drops cache cells >= p0; `remove(seq, 0)` forgets the sequence.
- A draft reads only the newest `catch_up` of the rows the head has not read: their cells are what
  it attends to, older unread cells stay empty (attention skips empty cells). A head that drafts
  every step reads 1-3 rows a draft and is unaffected. One paused for 64 steps (the host delivers
  a paused speculator's rows in one batch before its next draft) pays 32 rows, not 64, to probe;
  a sequence's first draft reads the newest 32 rows of its prompt, not all of it. Measured with a
  draft on every step (Eagle3 / MTP, 16 MT-bench questions x 2 turns, 128 tokens): first-token
  acceptance 34.5% / 31.7% with the prompt read this way, 35.5% / 32.4% with all of it; a first
  draft after a 200-366-token prompt took 14-26 ms reading all of it, 2-3 ms this way.

A head whose runtime sets `reads_lookup` (an Eagle3 or MTP head trained with `--lookup true`) also gets,
per row, the context's pair lookup (`specplug.heads.lookup`: the token that followed the last earlier
occurrence of the row's last two tokens), computed from the sequence's history and, for drafted
rows, the tokens drafted before them; its `forward` / `forward_pick` take them as `lookup=`.

Confidence per draft token: the head's probability of the token, calibrated per draft depth
and probability bucket from what `verified` reports (`Calibrator`). Drafting a sequence stops
when the cumulative confidence falls below `stop_below` or below the host's break-even.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np
import torch

from specplug.heads.calibrate import Calibrator
from specplug.heads.lookup import pair_lookup
from specplug.heads.loop import DraftLoop, Picks
from specplug.heads.state import StateKeeper
from specplug.hooks import hookimpl
from specplug.runtime.kv_cache import KVCache
from specplug.runtime.linear import take_rows
from specplug.types import Batch, Draft, DraftRequest, TargetInfo, Verified


class ChainHead(Protocol):
    """The head's inference form, with its own multi-sequence KV cache."""

    cache: KVCache
    d2t: torch.Tensor  # [draft vocab] int64: draft row -> target token id

    def forward(self, h_prev: torch.Tensor, token_ids: Sequence[int], positions: Sequence[int],
                seq_ids: Sequence[int], logits_rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows (h(t-1) [n, d], x_t, t, seq) -> (output states [n, d] in row order, logits over the draft
        vocabulary for `logits_rows`); every row's K/V go into the cache."""

    # Optional: `native_step` (not None) and `forward_pick(h_prev, token_ids, positions, seq_ids, logits_rows)`
    # -> (states, target ids, probabilities): the greedy step in one native call (`specplug.heads.PairStep`).
    # Optional: `reads_lookup` (True): both take `lookup=` [each row's pair lookup] (see the module docstring).


def _rows_of(states: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """states[rows] for ascending `rows`; states itself when they are all of its rows (one sequence
    drafting: no torch operation per draft step)."""
    if len(rows) == states.shape[0] and rows[-1] == len(rows) - 1:
        return states
    return take_rows(states, rows)


@dataclass
class _SeqState:
    done: int = 0  # head cache cells [0, done) hold exact pairs
    pending: list = field(default_factory=list)  # (x_t, t, h(t-1)) for t in [done, received)


class ChainDrafter:
    """Hooks `process_batch`, `draft`, `verified`, `remove` for a `ChainHead`.

    A subclass calls `setup(...)` in its constructor and implements `row_states(batch, encoded)`,
    the per-row states [len(batch), d] that pair with the next token (it adds `are_compatible`,
    `request_embeddings` and, where the method has one, `encode`).
    """

    def setup(self, head: ChainHead, target: TargetInfo, state_dim: int, temperature: float = 0.0,
              stop_below: float = 0.15, calibrate: bool = True, catch_up: int | None = 32) -> None:
        """head: the inference form; state_dim: width of the states h (zeros before position 0);
        catch_up: at a draft, the head reads at most this many of the committed rows it has not
        read yet, the prompt's included (the newest; None: all of them)."""
        self.rt = head
        self.catch_up = catch_up
        self.zeros = torch.zeros(state_dim, device=target.device)
        self.temperature, self.stop_below = temperature, stop_below
        self.state = [_SeqState() for _ in range(target.n_seq)]
        self.keeper = StateKeeper(target.n_seq, self._reset)
        self.calib = Calibrator(calibrate)
        self.loop = DraftLoop(target, head.d2t, temperature, stop_below, self.calib)
        # kept from before the toolkit's split, for subclasses that read them
        self.eot, self.vocab, self.out_device, self.gen = self.loop.eot, target.vocab_size, target.device, self.loop.gen

    # True: `row_states` are raw (e.g. Eagle3's taps side by side) and the head's first forward of a draft
    # transforms them itself (`forward(..., raw=True)`); its own output states feed the recursion
    raw_states = False

    def row_states(self, batch: Batch, encoded: torch.Tensor | None) -> torch.Tensor:
        """[len(batch), d] the state h_t each committed row leaves, which pairs with the next token
        (MTP: the final state; Eagle3: its three taps side by side). A subclass implements it."""
        raise NotImplementedError

    # --- keeping in step ----------------------------------------------------------------------------
    @hookimpl
    def process_batch(self, batch: Batch, encoded) -> None:
        rows, prev = self.keeper.receive(batch, self.row_states(batch, encoded), with_prev=True)
        if not rows:
            return
        tok, pos, seq = batch.token_ids.tolist(), batch.positions.tolist(), batch.seq_ids.tolist()
        state = self.state
        for i, hp in zip(rows, prev):
            st = state[seq[i]]
            if pos[i] >= st.done:
                st.pending.append((tok[i], pos[i], hp))

    @hookimpl
    def remove(self, seq_id: int, p0: int) -> None:
        if p0 > 0:
            self.rt.cache.seq_rm(seq_id, p0)
            st = self.state[seq_id]
            st.done = min(st.done, p0)
        self.keeper.remove(seq_id, p0)

    def _reset(self, s: int) -> None:
        self.rt.cache.seq_rm(s, 0)
        self.state[s] = _SeqState()

    # --- drafting -------------------------------------------------------------------------------------
    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft | None]:
        rt, keeper, zeros = self.rt, self.keeper, self.zeros
        reads_lookup = getattr(rt, "reads_lookup", False)
        n_look = getattr(rt, "lookup_n", 2)
        h, tok, pos, seq, last, live = [], [], [], [], [], []
        look: list[int] | None = [] if reads_lookup else None
        history: dict[int, np.ndarray] = {}  # request -> its tokens, then its drafted ones (lookups)
        for i, r in enumerate(requests):
            if r.n_max < 1 or not keeper.ready(r):
                continue
            st = self.state[r.seq_id]
            c = len(r.tokens) - 1
            rt.cache.seq_rm(r.seq_id, st.done)
            pend = st.pending
            if self.catch_up is not None and len(pend) > self.catch_up:
                pend = pend[len(pend) - self.catch_up:]  # older unread cells stay empty (not attended)
            if look is not None:
                history[i] = np.asarray(r.tokens, dtype=np.int64)
            for t, p, hp in pend:
                h.append(zeros if hp is None else hp)  # zeros before position 0
                tok.append(t)
                pos.append(p)
                seq.append(r.seq_id)
                if look is not None:
                    look.append(pair_lookup(history[i][:p + 1], n_look))
            hl = keeper.last[r.seq_id]
            h.append(zeros if hl is None else hl)
            tok.append(r.tokens[-1])
            pos.append(c)
            seq.append(r.seq_id)
            if look is not None:
                look.append(pair_lookup(history[i], n_look))
            last.append(len(tok) - 1)
            live.append(i)
            st.pending, st.done = [], c + 1
        if not live:
            return [None] * len(requests)
        states, picks = self._step(torch.stack(h), tok, pos, seq, last, raw=self.raw_states, lookup=look)
        states = _rows_of(states, last)

        def advance(depth: int, rows: list[int], tokens: list[int], reqs: list[int]) -> Picks:
            nonlocal states
            ids = [requests[i].seq_id for i in reqs]
            positions = [len(requests[i].tokens) - 1 + depth for i in reqs]
            step_look = None
            if look is not None:  # each request's history gains the token it drafted
                step_look = []
                for i, t in zip(reqs, tokens):
                    history[i] = np.append(history[i], t)
                    step_look.append(pair_lookup(history[i], n_look))
            states, picks = self._step(_rows_of(states, rows), tokens, positions, ids,
                                       list(range(len(rows))), lookup=step_look)
            return picks

        return self.loop.run(requests, live, picks, advance)

    def _step(self, h: torch.Tensor, tok: list[int], pos: list[int], seq: list[int],
              rows: list[int], raw: bool = False, lookup: list[int] | None = None) -> tuple[torch.Tensor, Picks]:
        """One head forward and the picks of `rows`: greedy picks come out of the head's own native
        step when it has one (`forward_pick`, see `specplug.heads.PairStep`), else from its logits.
        raw: `h` holds the states as `row_states` gave them, for a head that transforms them itself.
        lookup: each row's pair lookup (`specplug.heads.lookup`), for a head that reads it."""
        kw = {"raw": True} if raw else {}
        if lookup is not None:
            kw["lookup"] = lookup
        if self.temperature == 0 and getattr(self.rt, "native_step", None) is not None:
            states, ids, probs = self.rt.forward_pick(h, tok, pos, seq, rows, **kw)
            return states, (ids, probs, None)
        states, logits = self.rt.forward(h, tok, pos, seq, rows, **kw)
        return states, self.loop.pick(logits)

    def _pick(self, logits: torch.Tensor) -> Picks:
        return self.loop.pick(logits)

    @hookimpl
    def verified(self, results: Sequence[Verified]) -> None:
        self.calib.verified(results)
