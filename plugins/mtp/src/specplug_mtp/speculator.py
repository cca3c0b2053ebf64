"""`mtp`: drafts with a trained MTP head on the target's pre-norm final hidden state.

The head reads [h(t-1), x_t] with h the target's final state, and recurses on its own output;
keeping its cache in step with the target, batching, confidences and their calibration come
from `specplug.heads.ChainDrafter` (see there), built on the toolkit's `StateKeeper` and
`DraftLoop`: a draft stops before a head forward whose token the host would trim (its
`DraftRequest.break_even`), or once the cumulative confidence is below `stop_below`. Which head,
its checks and the start-up hooks are `specplug.heads.HeadSpeculator`'s.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specplug.heads import ChainDrafter, HeadSpeculator, check_head_params
from specplug.runtime.layers import Backend
from specplug.types import Batch, TargetInfo
from specplug_mtp.head import METHOD, VERSION, MTPRuntime


class MTP(HeadSpeculator, ChainDrafter):
    """Speculator for a trained MTP head."""

    method, versions, package, title = METHOD, (VERSION,), "specplug_mtp", "MTP"
    get_one = "train one (`specplug train data`, then `specplug train mtp`) and set `head:`"
    needs = ("output_head", "token_embeddings")

    @dataclass(frozen=True)
    class Params:
        head: str | None = None  # head .gguf; default: the head shipped for this target
        temperature: float = 0.0  # 0 = greedy, token-only drafts; > 0 = sampled drafts with probs
        stop_below: float = 0.15  # stop drafting once the cumulative confidence is below this
        calibrate: bool = True  # learn confidences from verification outcomes
        catch_up: int | None = 32  # a draft reads at most this many unread rows (the newest; the prompt too); null: all
        full_vocab: bool = False  # draft over the whole vocabulary instead of the head's draft vocabulary

        def __post_init__(self):
            check_head_params(METHOD, self)

    def __init__(self, params: "MTP.Params", target: TargetInfo):
        self.params = params
        self.open_head(params.head, target)
        if self.problem:
            return  # are_compatible reports it; nothing is built for a wrong target
        self.backend = Backend.for_target(target)
        with self.head_errors():
            rt = MTPRuntime(self.head, target, self.backend, target.n_seq, target.max_ctx, params.full_vocab)
        self.setup(rt, target, target.n_embd, params.temperature, params.stop_below, params.calibrate,
                   params.catch_up)

    def row_states(self, batch: Batch, encoded) -> torch.Tensor:
        return batch.embeddings["final"]


shipped_heads, find_head = MTP.shipped_heads, MTP.find_head  # the heads this package ships, and the one for a target
