"""`ChainDrafter`: the speculator half every "pair" head shares (MTP, Eagle3, and the like).

Such a head reads, at position t, the pair [h(t-1), x_t]: a state derived from the target at
the previous position (MTP: the pre-norm final state; Eagle3: three layer inputs fused by
`encode`) and the embedding of the token at t. It drafts by recursion, feeding its own output
state in place of h. What differs between methods is the head's forward (given as a
`ChainHead`); keeping the head's cache in step with the target, batching, confidences and
calibration are the same, and live here once.

State per sequence, kept in step through the hooks:
- `process_batch` receives committed rows (x_t, t, h_t) and queues the pairs [h(t-1), x_t]
  (zeros before position 0); nothing runs yet.
- `draft` runs, in one batched head forward for all sequences, the queued pairs plus the pair
  of the last token (not yet in the target: [h(c-1), x_c]); that row's output gives the first
  draft token. Each further draft token is one more batched forward over the live sequences,
  fed [own output state at t-1, drafted x_t]. The head's cache then holds exact pairs up to
  c (`done`) and draft states after it, which the next `draft` (or `remove`) drops.
- `remove(seq, p0)` drops cache cells >= p0; `remove(seq, 0)` forgets the sequence.

Confidence per draft token: the head's probability of the token, calibrated per draft depth
and probability bucket from what `verified` reports (a prior of the raw probability, weight 4).
Drafting a sequence stops when the cumulative confidence falls below `stop_below`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from specplug.hooks import hookimpl
from specplug.runtime.kv_cache import KVCache
from specplug.types import Batch, Draft, DraftRequest, TargetInfo, Verified


class Calibrator:
    """Per-token confidences from a drafter's own probabilities, calibrated by outcomes.

    P(token accepted | earlier ones accepted) is estimated per (draft depth, probability bucket)
    as (accepted + prior * p) / (tried + prior): the raw probability until outcomes arrive, then
    what verification actually showed. `record` the keys of each draft, pass `verified` results on.
    """

    def __init__(self, enabled: bool = True, depths: int = 4, buckets: int = 10, prior: float = 4.0):
        self.enabled, self.depths, self.buckets, self.prior = enabled, depths, buckets, prior
        self.table = torch.zeros(depths, buckets, 2)  # [depth, bucket] -> (accepted, tried)
        self.last: dict[int, list[tuple[int, int]]] = {}  # seq -> keys of its last draft's tokens

    def key(self, depth: int, p: float) -> tuple[int, int]:
        return min(depth, self.depths - 1), min(max(int(p * self.buckets), 0), self.buckets - 1)

    def confidence(self, depth: int, p: float) -> float:
        if not self.enabled:
            return min(1.0, max(0.0, p))
        acc, tried = self.table[self.key(depth, p)].tolist()
        return min(1.0, max(0.0, (acc + self.prior * p) / (tried + self.prior)))

    def record(self, seq: int, keys: list[tuple[int, int]]) -> None:
        self.last[seq] = keys

    def verified(self, results: Sequence[Verified]) -> None:
        for v in results:
            keys = self.last.pop(v.seq_id, [])
            if not v.chosen:
                continue
            for i, k in enumerate(keys[:v.n_drafted]):
                self.table[k][1] += 1
                if i < v.n_accepted:
                    self.table[k][0] += 1
                else:
                    break


def pick_tokens(logits: torch.Tensor, d2t: torch.Tensor, vocab: int, temperature: float,
                gen: torch.Generator) -> tuple[list[int], list[float], torch.Tensor | None]:
    """Draft one token per row of `logits` [rows, draft vocabulary]: the argmax (temperature 0)
    or a sample at `temperature` drawn with `gen`. Returns per row the target token id (through
    `d2t`), its probability under the distribution it was picked from, and, when sampling, that
    distribution over the full target vocabulary [rows, vocab] (zero outside the draft vocabulary:
    the `probs` lossless verification needs)."""
    logits = logits.float().cpu()
    if temperature == 0:
        p = torch.softmax(logits, -1)
        best = p.argmax(-1)
        return d2t[best].tolist(), p.gather(-1, best.unsqueeze(-1)).squeeze(-1).tolist(), None
    qd = torch.softmax(logits / temperature, -1)
    pick = torch.multinomial(qd, 1, generator=gen).squeeze(-1)
    full = torch.zeros(qd.shape[0], vocab)
    full[:, d2t] = qd
    return d2t[pick].tolist(), qd.gather(-1, pick.unsqueeze(-1)).squeeze(-1).tolist(), full


class ChainHead(Protocol):
    """The head's inference form, with its own multi-sequence KV cache."""

    cache: KVCache
    d2t: torch.Tensor  # [draft vocab] int64: draft row -> target token id

    def forward(self, h_prev: torch.Tensor, token_ids: Sequence[int], positions: Sequence[int],
                seq_ids: Sequence[int], logits_rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows (h(t-1) [n, d], x_t, t, seq) -> (output states [n, d] in row order, logits over the draft
        vocabulary for `logits_rows`); every row's K/V go into the cache."""


@dataclass
class _SeqState:
    received: int = 0  # committed positions delivered so far
    done: int = 0  # head cache cells [0, done) hold exact pairs
    last_h: torch.Tensor | None = None  # the state of position received - 1
    pending: list = field(default_factory=list)  # (x_t, t, h(t-1)) for t in [done, received)
    broken: bool = False  # rows were missed: no drafts until the sequence restarts


class ChainDrafter:
    """Hooks `process_batch`, `draft`, `verified`, `remove` for a `ChainHead`.

    A subclass calls `setup(...)` in its constructor and implements `row_states(batch, encoded)`,
    the per-row states [len(batch), d] that pair with the next token (it adds `are_compatible`,
    `request_embeddings` and, where the method has one, `encode`).
    """

    def setup(self, head: ChainHead, target: TargetInfo, state_dim: int, temperature: float = 0.0,
              stop_below: float = 0.15, calibrate: bool = True) -> None:
        """head: the inference form; state_dim: width of the states h (zeros before position 0)."""
        self.rt = head
        self.zeros = torch.zeros(state_dim, device=target.device)
        self.temperature, self.stop_below = temperature, stop_below
        self.eot = frozenset(target.eot_ids)
        self.vocab = target.vocab_size
        self.out_device = target.device
        self.state = [_SeqState() for _ in range(target.n_seq)]
        self.calib = Calibrator(calibrate)
        self.gen = torch.Generator().manual_seed(0)  # sampled drafts never touch the host's streams

    def row_states(self, batch: Batch, encoded: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    # --- keeping in step ----------------------------------------------------------------------------
    @hookimpl
    def process_batch(self, batch: Batch, encoded) -> None:
        h = self.row_states(batch, encoded)
        for i, (t, p, s) in enumerate(zip(batch.token_ids.tolist(), batch.positions.tolist(), batch.seq_ids.tolist())):
            st = self.state[s]
            if p != st.received:
                if p == 0:
                    self._reset(s)
                    st = self.state[s]
                else:
                    st.broken = True
                    continue
            if p >= st.done:
                st.pending.append((t, p, st.last_h))
            st.last_h = h[i]
            st.received = p + 1

    @hookimpl
    def remove(self, seq_id: int, p0: int) -> None:
        if p0 <= 0:
            self._reset(seq_id)
            return
        st = self.state[seq_id]
        self.rt.cache.seq_rm(seq_id, p0)
        st.done = min(st.done, p0)
        if st.received > p0:  # committed rows taken back: the pairing cannot be rebuilt
            st.broken = True

    def _reset(self, s: int) -> None:
        self.rt.cache.seq_rm(s, 0)
        self.state[s] = _SeqState()

    # --- drafting -------------------------------------------------------------------------------------
    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft | None]:
        rt = self.rt
        h, tok, pos, seq, last, live = [], [], [], [], [], []
        for i, r in enumerate(requests):
            st = self.state[r.seq_id]
            c = len(r.tokens) - 1
            if st.broken or st.received != c or r.n_max < 1:
                continue
            rt.cache.seq_rm(r.seq_id, st.done)
            for t, p, hp in st.pending + [(r.tokens[-1], c, st.last_h)]:
                h.append(self.zeros if hp is None else hp)  # zeros before position 0
                tok.append(t)
                pos.append(p)
                seq.append(r.seq_id)
            last.append(len(tok) - 1)
            live.append(i)
            st.pending, st.done = [], c + 1
        out: list[Draft | None] = [None] * len(requests)
        if not live:
            return out
        states, logits = rt.forward(torch.stack(h), tok, pos, seq, last)
        states = states[torch.tensor(last, device=states.device)]
        ids: dict[int, list[int]] = {i: [] for i in live}
        conf: dict[int, list[float]] = {i: [] for i in live}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        keys: dict[int, list[tuple[int, int]]] = {i: [] for i in live}
        cum = dict.fromkeys(live, 1.0)
        depth = 0
        while live:
            toks, p_tok, q = self._pick(logits)
            nxt_h, nxt_live, nxt_tok, nxt_pos, nxt_seq = [], [], [], [], []
            for j, i in enumerate(live):
                r = requests[i]
                c = self.calib.confidence(depth, p_tok[j])
                ids[i].append(toks[j])
                conf[i].append(c)
                keys[i].append(self.calib.key(depth, p_tok[j]))
                if q is not None:
                    probs[i].append(q[j])
                cum[i] *= c
                n = len(ids[i])
                if n < r.n_max and toks[j] not in self.eot and cum[i] >= self.stop_below \
                        and len(r.tokens) + n < rt.cache.max_ctx:
                    nxt_h.append(states[j])
                    nxt_live.append(i)
                    nxt_tok.append(toks[j])
                    nxt_pos.append(len(r.tokens) - 1 + n)
                    nxt_seq.append(r.seq_id)
            live = nxt_live
            depth += 1
            if live:
                states, logits = rt.forward(torch.stack(nxt_h), nxt_tok, nxt_pos, nxt_seq, list(range(len(live))))
        for i in ids:
            self.calib.record(requests[i].seq_id, keys[i])
            pr = torch.stack(probs[i]).to(self.out_device) if probs[i] else None
            out[i] = Draft(tuple(ids[i]), pr, tuple(conf[i]))
        return out

    def _pick(self, logits: torch.Tensor) -> tuple[list[int], list[float], torch.Tensor | None]:
        return pick_tokens(logits, self.rt.d2t, self.vocab, self.temperature, self.gen)

    @hookimpl
    def verified(self, results: Sequence[Verified]) -> None:
        self.calib.verified(results)
