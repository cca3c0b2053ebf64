"""`kvdraft`: a Gemma 4-style drafter that attends to the target's own KV cache.

It asks the host for the target's pre-norm final state (`EmbeddingRequest(final=True)`, as MTP) and for
the keys and values of one target layer (`kv_layers=(L,)`), which every `DraftRequest.kv` then carries
as a read-only view of the committed positions. What it keeps per sequence is the newest final state
(`StateKeeper`); nothing of the context: no cache, no prefill, no catch-up of rows it has not read. A
draft runs one batched head forward per depth (`KVDraftRuntime`), each row attending to its sequence's
view and to the rows drafted before it in the same call; `DraftLoop` picks, calibrates confidences and
stops where the host would not verify. The head file: `head.py`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from specplug.heads import Calibrator, DraftLoop, HeadSpeculator, StateKeeper, check_head_params
from specplug.heads.lookup import pair_lookup
from specplug.heads.loop import Picks
from specplug.hooks import hookimpl
from specplug.runtime.layers import Backend
from specplug.types import Batch, Draft, DraftRequest, EmbeddingRequest, TargetInfo, Verified
from specplug_kvdraft.head import METHOD, VERSION, KVDraftConfig, KVDraftRuntime


class KVDraft(HeadSpeculator):
    """Speculator for a trained kvdraft head."""

    method, versions, package, title = METHOD, (VERSION,), "specplug_kvdraft", "kvdraft"
    get_one = "train one (`specplug train data --taps final,<layer>`, then `specplug train kvdraft`) and set `head:`"
    needs = ("output_head", "token_embeddings", "attention")

    @dataclass(frozen=True)
    class Params:
        head: str | None = None  # head .gguf; default: the head shipped for this target
        temperature: float = 0.0  # 0 = greedy, token-only drafts; > 0 = sampled drafts with probs
        stop_below: float = 0.15  # stop drafting once the cumulative confidence is below this
        calibrate: bool = True  # learn confidences from verification outcomes
        full_vocab: bool = False  # draft over the whole vocabulary instead of the head's draft vocabulary

        def __post_init__(self):
            check_head_params(METHOD, self)

    def __init__(self, params: "KVDraft.Params", target: TargetInfo):
        self.params = params
        self.cfg = self.open_head(params.head, target, KVDraftConfig.from_dict)
        if not self.problem:
            self.problem = self._attention_problem(target)
        if self.problem:
            return  # are_compatible reports it; nothing is built for a wrong target
        with self.head_errors():
            self.rt = KVDraftRuntime(self.head, target, Backend.for_target(target), params.full_vocab)
        self.zeros = torch.zeros(target.n_embd, device=target.device)
        self.keeper = StateKeeper(target.n_seq)
        self.calib = Calibrator(params.calibrate)
        self.loop = DraftLoop(target, self.rt.d2t, params.temperature, params.stop_below, self.calib)

    def _attention_problem(self, target: TargetInfo) -> str | None:
        """Why the head cannot read this target's keys and values (None: it can)."""
        c, a = self.cfg, target.attention
        if not 0 <= c.kv_layer < target.n_layer:
            return (f"the head reads the keys and values of layer {c.kv_layer}, but the target has "
                    f"{target.n_layer} layers")
        if (c.n_head, c.n_head_kv, c.head_dim) != (a.n_head, a.n_head_kv, a.head_dim):
            return (f"the head's attention has {c.n_head}/{c.n_head_kv} heads of {c.head_dim}, the target's "
                    f"{a.n_head}/{a.n_head_kv} of {a.head_dim}: it cannot read the target's keys")
        return None

    @hookimpl
    def request_embeddings(self, target: TargetInfo) -> EmbeddingRequest:
        return EmbeddingRequest(final=True, kv_layers=(self.cfg.kv_layer,))

    # --- keeping in step: only the newest final state of each sequence ------------------------------
    @hookimpl
    def process_batch(self, batch: Batch, encoded) -> None:
        self.keeper.receive(batch, batch.embeddings["final"])

    @hookimpl
    def remove(self, seq_id: int, p0: int) -> None:
        self.keeper.remove(seq_id, p0)

    @hookimpl
    def verified(self, results: Sequence[Verified]) -> None:
        self.calib.verified(results)

    # --- drafting -----------------------------------------------------------------------------------
    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft | None]:
        rt, keeper, layer = self.rt, self.keeper, self.cfg.kv_layer
        live = [i for i, r in enumerate(requests) if r.n_max >= 1 and keeper.ready(r)]
        if not live:
            return [None] * len(requests)
        look = rt.reads_lookup
        history = {i: np.asarray(requests[i].tokens, dtype=np.int64) for i in live} if look else {}
        try:
            rt.begin({requests[i].seq_id: requests[i].kv[layer] for i in live})
            h = keeper.states([requests[i].seq_id for i in live], self.zeros)
            states, picks = self._step(h, [requests[i].tokens[-1] for i in live], [len(requests[i].tokens) - 1
                                                                                   for i in live],
                                       [requests[i].seq_id for i in live],
                                       [pair_lookup(history[i], rt.lookup_n) for i in live] if look else None)

            def advance(depth: int, rows: list[int], tokens: list[int], reqs: list[int]) -> Picks:
                nonlocal states
                step_look = None
                if look:  # each request's history gains the token it drafted
                    step_look = []
                    for i, t in zip(reqs, tokens):
                        history[i] = np.append(history[i], t)
                        step_look.append(pair_lookup(history[i], rt.lookup_n))
                prev = states if len(rows) == states.shape[0] else states[rows]
                states, p = self._step(prev, tokens, [len(requests[i].tokens) - 1 + depth for i in reqs],
                                       [requests[i].seq_id for i in reqs], step_look)
                return p

            return self.loop.run(requests, live, picks, advance)
        finally:
            rt.end()  # nothing of the target's views outlives the call

    def _step(self, h: torch.Tensor, tok: list[int], pos: list[int], seq: list[int],
              lookup: list[int] | None) -> tuple[torch.Tensor, Picks]:
        states, logits = self.rt.forward(h, tok, pos, seq, list(range(len(tok))), lookup=lookup)
        return states, self.loop.pick(logits)


# the heads this package ships, and the one for a target
shipped_heads, find_head = KVDraft.shipped_heads, KVDraft.find_head
