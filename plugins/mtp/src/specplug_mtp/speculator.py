"""`mtp`: drafts with a trained MTP head on the target's pre-norm final hidden state.

The head reads [h(t-1), x_t] with h the target's final state, and recurses on its own output;
keeping its cache in step with the target, batching, confidences and their calibration come
from `specplug.heads.ChainDrafter` (see there), built on the toolkit's `StateKeeper` and
`DraftLoop`: a draft stops before a head forward whose token the host would trim (its
`DraftRequest.break_even`), or once the cumulative confidence is below `stop_below`.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import torch

from specplug.errors import ConfigError
from specplug.heads import ChainDrafter, HeadError, HeadFile, token_table_sha256
from specplug.hooks import hookimpl
from specplug.runtime.layers import Backend
from specplug.types import Batch, EmbeddingRequest, TargetInfo
from specplug_mtp.head import METHOD, VERSION, MTPRuntime


def shipped_heads() -> list[Path]:
    """Head files that ship inside this package."""
    return sorted(Path(str(files("specplug_mtp") / "heads")).glob("*.gguf"))


def find_head(target: TargetInfo, method: str = METHOD, heads: list[Path] | None = None) -> Path | None:
    """The shipped head trained for this target's vocabulary and width, if there is one."""
    want = token_table_sha256(target.token_texts)
    for p in shipped_heads() if heads is None else heads:
        try:
            meta = HeadFile(p, method).meta
        except HeadError:
            continue
        if meta.token_table_sha256 == want and meta.n_embd == target.n_embd:
            return p
    return None


class MTP(ChainDrafter):
    """Speculator for a trained MTP head."""

    @dataclass(frozen=True)
    class Params:
        head: str | None = None  # head .gguf; default: the head shipped for this target
        temperature: float = 0.0  # 0 = greedy, token-only drafts; > 0 = sampled drafts with probs
        stop_below: float = 0.15  # stop drafting once the cumulative confidence is below this
        calibrate: bool = True  # learn confidences from verification outcomes
        catch_up: int | None = 32  # a draft reads at most this many unread rows (the newest; the prompt too); null: all
        full_vocab: bool = False  # draft over the whole vocabulary instead of the head's draft vocabulary

        def __post_init__(self):
            if self.head is not None and (not isinstance(self.head, str) or not self.head.strip()):
                raise ConfigError(f"mtp: head must be a path to a .gguf head file, got {self.head!r}")
            if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
                raise ConfigError(f"mtp: temperature must be >= 0, got {self.temperature!r}")
            if not isinstance(self.stop_below, (int, float)) or not 0 <= self.stop_below < 1:
                raise ConfigError(f"mtp: stop_below must be in [0, 1), got {self.stop_below!r}")
            if self.catch_up is not None and (not isinstance(self.catch_up, int) or self.catch_up < 1):
                raise ConfigError(f"mtp: catch_up must be a row count >= 1 (or null for all), got {self.catch_up!r}")

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
        rt = MTPRuntime(self.head, target, self.backend, target.n_seq, target.max_ctx, params.full_vocab)
        self.setup(rt, target, target.n_embd, params.temperature, params.stop_below, params.calibrate,
                   params.catch_up)

    @hookimpl
    def are_compatible(self, target: TargetInfo) -> str | None:
        return f"{self.head.path}: {self.problem}" if self.problem else None

    @hookimpl
    def request_embeddings(self, target: TargetInfo) -> EmbeddingRequest:
        return EmbeddingRequest(final=True)

    def row_states(self, batch: Batch, encoded) -> torch.Tensor:
        return batch.embeddings["final"]
