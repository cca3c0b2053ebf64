"""`mtp`: drafts with a trained MTP head on the target's pre-norm final hidden state.

State per sequence, kept in step with the target through the hooks:
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

import logging
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Sequence

import torch

from specplug.errors import ConfigError
from specplug.heads import HeadError, HeadFile, token_table_sha256
from specplug.hooks import hookimpl
from specplug.runtime.layers import Backend
from specplug.types import Batch, Draft, DraftRequest, EmbeddingRequest, TargetInfo, Verified
from specplug_mtp.head import METHOD, VERSION, MTPRuntime

log = logging.getLogger("specplug")
_BUCKETS = 10
_DEPTHS = 4
_PRIOR = 4.0


def shipped_heads() -> list[Path]:
    """Head files that ship inside this package."""
    return sorted(Path(str(files("specplug_mtp") / "heads")).glob("*.gguf"))


def find_head(target: TargetInfo) -> Path | None:
    """The shipped head trained for this target's vocabulary, if there is one."""
    want = token_table_sha256(target.token_texts)
    for p in shipped_heads():
        try:
            meta = HeadFile(p, METHOD).meta
        except HeadError:
            continue
        if meta.token_table_sha256 == want and meta.n_embd == target.n_embd:
            return p
    return None


@dataclass
class _SeqState:
    received: int = 0  # committed positions delivered so far
    done: int = 0  # head cache cells [0, done) hold exact pairs
    last_h: torch.Tensor | None = None  # target state at position received - 1
    pending: list = field(default_factory=list)  # (x_t, t, h(t-1)) for t in [done, received)
    broken: bool = False  # rows were missed: no drafts until the sequence restarts
    drafted: list = field(default_factory=list)  # calibration keys of the last draft's tokens


class MTP:
    """Speculator for a trained MTP head (see the module docstring)."""

    @dataclass(frozen=True)
    class Params:
        head: str | None = None  # head .gguf; default: the head shipped for this target
        temperature: float = 0.0  # 0 = greedy, token-only drafts; > 0 = sampled drafts with probs
        stop_below: float = 0.15  # stop drafting once the cumulative confidence is below this
        calibrate: bool = True  # learn confidences from verification outcomes

        def __post_init__(self):
            if self.head is not None and (not isinstance(self.head, str) or not self.head.strip()):
                raise ConfigError(f"mtp: head must be a path to a .gguf head file, got {self.head!r}")
            if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
                raise ConfigError(f"mtp: temperature must be >= 0, got {self.temperature!r}")
            if not isinstance(self.stop_below, (int, float)) or not 0 <= self.stop_below < 1:
                raise ConfigError(f"mtp: stop_below must be in [0, 1), got {self.stop_below!r}")

    def __init__(self, params: "MTP.Params", target: TargetInfo):
        self.params = params
        if params.head is not None:
            path = Path(params.head).expanduser()
        else:
            path = find_head(target)
            if path is None:
                raise ConfigError(f"mtp: no MTP head ships for this target ({Path(str(target.model_path)).name}); "
                                  f"train one (`specplug train data`, then `specplug train mtp`) and set `head:`")
        try:
            self.head = HeadFile(path, METHOD, {VERSION})
        except HeadError as exc:
            raise ConfigError(f"mtp: head: {exc}") from None
        self.problem = self.head.check_target(target)
        if self.problem:
            return  # are_compatible reports it; nothing is built for a wrong target
        if target.output_head is None or target.token_embeddings is None:
            raise ConfigError("mtp: the host gave no output head / embedding table in TargetInfo")
        self.backend = Backend.for_target(target)
        self.rt = MTPRuntime(self.head, target, self.backend, target.n_seq, target.max_ctx)
        self.n_embd = target.n_embd
        self.eot = frozenset(target.eot_ids)
        self.vocab = target.vocab_size
        self.out_device = target.device
        self.state = [_SeqState() for _ in range(target.n_seq)]
        self.calib = torch.zeros(_DEPTHS, _BUCKETS, 2)  # [depth, bucket] -> (accepted, tried)
        self.gen = torch.Generator().manual_seed(0)

    # --- start-up -------------------------------------------------------------------------------
    @hookimpl
    def are_compatible(self, target: TargetInfo) -> str | None:
        return f"{self.head.path}: {self.problem}" if self.problem else None

    @hookimpl
    def request_embeddings(self, target: TargetInfo) -> EmbeddingRequest:
        return EmbeddingRequest(final=True)

    # --- keeping in step ----------------------------------------------------------------------------
    @hookimpl
    def process_batch(self, batch: Batch, encoded) -> None:
        h = batch.embeddings["final"]
        for i, (t, p, s) in enumerate(zip(batch.token_ids.tolist(), batch.positions.tolist(), batch.seq_ids.tolist())):
            st = self.state[s]
            if p != st.received:
                if p == 0:
                    self._reset(s)
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
        zeros = torch.zeros(self.n_embd, device=rt.embed.device)
        h, tok, pos, seq, last, live = [], [], [], [], [], []
        for i, r in enumerate(requests):
            st = self.state[r.seq_id]
            c = len(r.tokens) - 1
            if st.broken or st.received != c or r.n_max < 1:
                continue
            rt.cache.seq_rm(r.seq_id, st.done)
            rows = st.pending + [(r.tokens[-1], c, st.last_h)]
            for t, p, hp in rows:
                h.append(zeros if hp is None else hp)
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
        states = states[torch.tensor(last)]
        ids: dict[int, list[int]] = {i: [] for i in live}
        conf: dict[int, list[float]] = {i: [] for i in live}
        cum = {i: 1.0 for i in live}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        keys: dict[int, list[tuple[int, int]]] = {i: [] for i in live}
        depth = 0
        while live:
            toks, p_tok, q = self._pick(logits)
            nxt_h, nxt_live, nxt_tok, nxt_pos, nxt_seq = [], [], [], [], []
            for j, i in enumerate(live):
                r = requests[i]
                c = self._confidence(depth, p_tok[j])
                ids[i].append(toks[j])
                conf[i].append(c)
                keys[i].append((min(depth, _DEPTHS - 1), min(int(p_tok[j] * _BUCKETS), _BUCKETS - 1)))
                if q is not None:
                    probs[i].append(q[j])
                cum[i] *= c
                n = len(ids[i])
                if n < r.n_max and toks[j] not in self.eot and cum[i] >= self.params.stop_below \
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
            self.state[requests[i].seq_id].drafted = keys[i]
            pr = torch.stack(probs[i]).to(self.out_device) if probs[i] else None
            out[i] = Draft(tuple(ids[i]), pr, tuple(conf[i]))
        return out

    def _pick(self, logits: torch.Tensor) -> tuple[list[int], list[float], torch.Tensor | None]:
        """Per row: the target token id drafted, its probability under the head, and (when sampling)
        the full-vocabulary distribution it was drawn from."""
        d2t = self.rt.d2t
        t = self.params.temperature
        p = torch.softmax(logits.float(), -1)
        if t == 0:
            best = p.argmax(-1)
            return d2t[best].tolist(), p.gather(-1, best.unsqueeze(-1)).squeeze(-1).tolist(), None
        qd = torch.softmax(logits.float() / t, -1)
        pick = torch.multinomial(qd, 1, generator=self.gen).squeeze(-1)
        full = torch.zeros(qd.shape[0], self.vocab)
        full[:, d2t] = qd
        return d2t[pick].tolist(), qd.gather(-1, pick.unsqueeze(-1)).squeeze(-1).tolist(), full

    def _confidence(self, depth: int, p: float) -> float:
        if not self.params.calibrate:
            return min(1.0, max(0.0, p))
        acc, tried = self.calib[min(depth, _DEPTHS - 1), min(int(p * _BUCKETS), _BUCKETS - 1)].tolist()
        return min(1.0, max(0.0, (acc + _PRIOR * p) / (tried + _PRIOR)))

    @hookimpl
    def verified(self, results: Sequence[Verified]) -> None:
        for v in results:
            keys = self.state[v.seq_id].drafted
            self.state[v.seq_id].drafted = []
            if not v.chosen:
                continue
            for i, (d, b) in enumerate(keys[:v.n_drafted]):
                self.calib[d, b, 1] += 1
                if i < v.n_accepted:
                    self.calib[d, b, 0] += 1
                else:
                    break
