"""`dflash`: a block drafter that proposes a whole block of tokens in one forward.

In step with the target: `encode` turns the tapped target states of committed rows into context
features; `process_batch` writes every drafter layer's K/V of them at their positions (exact, so
nothing is ever replayed); `remove(seq, p0)` drops positions >= p0. `draft` runs one batched forward
of one block per sequence, [x_c, mask, ..., mask] at positions c.., attending to the context and
bidirectionally inside the block, and returns up to block - 1 tokens with calibrated confidences,
walked by the toolkit's `DraftLoop`: a block longer than the host's n_max is cut to it, and the
draft is cut after an end of turn or where the cumulative confidence falls below the host's
break-even (`DraftRequest.break_even`: the host would trim those tokens). The position check and
`remove` are the toolkit's `StateKeeper`.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Sequence

import torch

from specplug.errors import ConfigError
from specplug.heads import Calibrator, DraftLoop, HeadError, HeadFile, StateKeeper, token_table_sha256
from specplug.hooks import hookimpl
from specplug.runtime.layers import Backend
from specplug.types import Batch, Draft, DraftRequest, EmbeddingRequest, TargetInfo, Verified
from specplug_dflash.head import METHOD, VERSION, DFlashConfig, DFlashRuntime


def shipped_heads() -> list[Path]:
    return sorted(Path(str(files("specplug_dflash") / "heads")).glob("*.gguf"))


def find_head(target: TargetInfo) -> Path | None:
    want = token_table_sha256(target.token_texts)
    for p in shipped_heads():
        try:
            meta = HeadFile(p, METHOD).meta
        except HeadError:
            continue
        if meta.token_table_sha256 == want and meta.n_embd == target.n_embd:
            return p
    return None


class DFlash:
    """Speculator for a trained DFlash block drafter."""

    @dataclass(frozen=True)
    class Params:
        head: str | None = None  # head .gguf; default: the head shipped for this target
        block_size: int | None = None  # tokens per block, the last committed one included (default: as trained)
        temperature: float = 0.0  # 0 = greedy, token-only drafts; > 0 = sampled drafts with probs
        calibrate: bool = True  # learn confidences from verification outcomes

        def __post_init__(self):
            if self.head is not None and (not isinstance(self.head, str) or not self.head.strip()):
                raise ConfigError(f"dflash: head must be a path to a .gguf head file, got {self.head!r}")
            if self.block_size is not None and not 2 <= self.block_size <= 64:
                raise ConfigError(f"dflash: block_size must be in [2, 64], got {self.block_size!r}")
            if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
                raise ConfigError(f"dflash: temperature must be >= 0, got {self.temperature!r}")

    def __init__(self, params: "DFlash.Params", target: TargetInfo):
        self.params = params
        path = Path(params.head).expanduser() if params.head is not None else find_head(target)
        if path is None:
            raise ConfigError(f"dflash: no DFlash head ships for this target ({Path(str(target.model_path)).name}); "
                              f"train one (`specplug train dflash`) and set `head:`")
        try:
            self.head = HeadFile(path, METHOD, {VERSION})
            cfg = DFlashConfig.from_dict(self.head.meta.config)
        except HeadError as exc:
            raise ConfigError(f"dflash: head: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"dflash: head: {path}: config is malformed ({exc})") from None
        self.taps = cfg.taps
        self.block = params.block_size or cfg.block
        self.problem = self.head.check_target(target)
        layers = [int(t) for t in cfg.taps if t != "final"]
        if not self.problem and layers and max(layers) >= target.n_layer:
            self.problem = f"the head taps layer {max(layers)} but the target has {target.n_layer} layers"
        if self.problem:
            return
        try:
            self.rt = DFlashRuntime(self.head, target, Backend.for_target(target), target.n_seq, target.max_ctx)
        except HeadError as exc:
            raise ConfigError(f"dflash: head: {exc}") from None
        # context positions [0, received) are in the drafter's cache
        self.keeper = StateKeeper(target.n_seq, on_reset=lambda s: self.rt.cache.seq_rm(s, 0))
        self.calib = Calibrator(params.calibrate, depths=8)
        self.loop = DraftLoop(target, self.rt.d2t, params.temperature, 0.0, self.calib)

    @property
    def received(self) -> list[int]:
        """Per sequence: context positions [0, received) are in the drafter's cache."""
        return self.keeper.received

    @hookimpl
    def are_compatible(self, target: TargetInfo) -> str | None:
        return f"{self.head.path}: {self.problem}" if self.problem else None

    @hookimpl
    def request_embeddings(self, target: TargetInfo) -> EmbeddingRequest:
        return EmbeddingRequest(layers=tuple(int(t) for t in self.taps if t != "final"), final="final" in self.taps)

    @hookimpl
    def encode(self, batch: Batch) -> torch.Tensor:
        return self.rt.encode([batch.embeddings["final" if t == "final" else int(t)] for t in self.taps])

    @hookimpl
    def process_batch(self, batch: Batch, encoded: torch.Tensor) -> None:
        keep, _ = self.keeper.receive(batch)
        if keep:
            pos, seqs = batch.positions.tolist(), batch.seq_ids.tolist()
            idx = torch.tensor(keep, device=encoded.device)
            self.rt.add_context(encoded[idx], [pos[i] for i in keep], [seqs[i] for i in keep])

    @hookimpl
    def remove(self, seq_id: int, p0: int) -> None:
        self.rt.cache.seq_rm(seq_id, max(0, p0))
        self.keeper.remove(seq_id, p0)

    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft | None]:
        live, last, starts, seqs, sizes = [], [], [], [], []
        for i, r in enumerate(requests):
            c = len(r.tokens) - 1
            size = min(self.block, r.n_max + 1, self.rt.cache.max_ctx - c)
            if size < 2 or not self.keeper.ready(r):
                continue
            live.append(i)
            last.append(r.tokens[-1])
            starts.append(c)
            seqs.append(r.seq_id)
            sizes.append(size)
        if not live:
            return [None] * len(requests)
        logits = self.rt.draft(last, starts, seqs, sizes)  # [sum(size - 1), draft vocab]
        return self.loop.run_block(requests, live, logits, [size - 1 for size in sizes])

    @hookimpl
    def verified(self, results: Sequence[Verified]) -> None:
        self.calib.verified(results)
