"""`eagle3`: drafts with a trained (or imported) EAGLE-3 head.

The host taps the inputs of the head's three target layers; `encode` puts them side by side and
the head's draft step fuses them (fc: 3d -> d) for the rows it reads; the decoder layer reads
[embed(x_t); fused h(t-1)] and recurses on
its own output state. Keeping its cache in step with the target, batching, confidences and
calibration come from `specplug.heads.ChainDrafter` (the toolkit's `StateKeeper` and `DraftLoop`:
no head forward for a token the host's `DraftRequest.break_even` says it would trim). Which head,
its checks and the start-up hooks (the taps asked for are the head file's) are
`specplug.heads.HeadSpeculator`'s.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specplug.errors import ConfigError
from specplug.heads import ChainDrafter, HeadSpeculator, check_head_params
from specplug.hooks import hookimpl
from specplug.runtime.layers import Backend
from specplug.types import Batch, TargetInfo
from specplug_eagle3.head import METHOD, VERSION, Eagle3Config, Eagle3Runtime


class Eagle3(HeadSpeculator, ChainDrafter):
    """Speculator for an EAGLE-3 head."""

    method, versions, package, title = METHOD, (VERSION,), "specplug_eagle3", "Eagle3"
    get_one = "train one (`specplug train eagle3`) or import one (`specplug convert eagle3`) and set `head:`"
    needs = ("token_embeddings",)

    @dataclass(frozen=True)
    class Params:
        head: str | None = None  # head .gguf; default: the head shipped for this target
        layers: list[int] | None = None  # the tapped target layers; must equal the head's (default: the head's)
        temperature: float = 0.0  # 0 = greedy, token-only drafts; > 0 = sampled drafts with probs
        stop_below: float = 0.15  # stop drafting once the cumulative confidence is below this
        calibrate: bool = True  # learn confidences from verification outcomes
        catch_up: int | None = 32  # a draft reads at most this many unread rows (the newest; the prompt too); null: all

        def __post_init__(self):
            check_head_params(METHOD, self)
            if self.layers is not None and (len(self.layers) != 3 or any(x < 0 for x in self.layers)):
                raise ConfigError(f"eagle3: layers must be three layer indices (low, mid, high), got {self.layers!r}")

    def __init__(self, params: "Eagle3.Params", target: TargetInfo):
        self.params = params
        cfg = self.open_head(params.head, target, Eagle3Config.from_dict)
        self.layers = cfg.layers
        if params.layers is not None and tuple(params.layers) != cfg.layers:
            raise ConfigError(f"eagle3: layers {list(params.layers)} differ from the layers the head {self.head.path} "
                              f"was trained on {list(cfg.layers)}; drop `layers:` or use a head for those layers")
        if self.problem:
            return  # are_compatible reports it; nothing is built for a wrong target
        with self.head_errors():
            rt = Eagle3Runtime(self.head, target, Backend.for_target(target), target.n_seq, target.max_ctx)
        self.setup(rt, target, 3 * target.n_embd, params.temperature, params.stop_below, params.calibrate,
                   params.catch_up)

    raw_states = True  # the states kept per row are the three taps side by side; the draft step fuses them

    @hookimpl
    def encode(self, batch: Batch) -> torch.Tensor:
        """The three tapped layer inputs of every committed row side by side [n, 3d]. The fusion
        fc([low; mid; high]) runs inside the head's draft step, for the rows the head reads only (the
        newest `catch_up` of those it has not read)."""
        dev = self.zeros.device
        return torch.cat([batch.embeddings[li].to(dev, torch.float32) for li in self.layers], -1)

    def row_states(self, batch: Batch, encoded: torch.Tensor | None) -> torch.Tensor:
        return encoded


shipped_heads, find_head = Eagle3.shipped_heads, Eagle3.find_head  # the heads this package ships, and a target's
