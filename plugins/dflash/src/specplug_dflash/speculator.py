"""`dflash`: a block drafter that proposes a whole block of tokens in one forward.

In step with the target: `encode` turns the tapped target states of committed rows into context
features; `process_batch` writes every drafter layer's K/V of them at their positions (exact, so
nothing is ever replayed); `remove(seq, p0)` drops positions >= p0. `draft` runs one batched forward
of one block per sequence, [x_c, mask, ..., mask] at positions c.., attending to the context and
bidirectionally inside the block, and returns block - 1 tokens with calibrated confidences (the
cost-aware host then verifies the prefix worth its rows). A block longer than the host's n_max is
cut to it.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Sequence

import torch

from specplug.errors import ConfigError
from specplug.heads import Calibrator, HeadError, HeadFile, pick_tokens, token_table_sha256
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
        self.received = [0] * target.n_seq  # context positions [0, received) are in the drafter's cache
        self.eot = frozenset(target.eot_ids)
        self.vocab = target.vocab_size
        self.out_device = target.device
        self.calib = Calibrator(params.calibrate, depths=8)
        self.gen = torch.Generator().manual_seed(0)

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
        pos, seqs = batch.positions.tolist(), batch.seq_ids.tolist()
        keep = []
        for i, (p, s) in enumerate(zip(pos, seqs)):
            if p != self.received[s] and p != 0:
                self.received[s] = -1  # rows were missed: no drafts until the sequence restarts
                continue
            if p == 0:
                self.rt.cache.seq_rm(s, 0)
            keep.append(i)
            self.received[s] = p + 1
        if keep:
            idx = torch.tensor(keep, device=encoded.device)
            self.rt.add_context(encoded[idx], [pos[i] for i in keep], [seqs[i] for i in keep])

    @hookimpl
    def remove(self, seq_id: int, p0: int) -> None:
        self.rt.cache.seq_rm(seq_id, max(0, p0))
        if p0 <= 0:
            self.received[seq_id] = 0
        elif self.received[seq_id] > p0:
            self.received[seq_id] = -1

    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft | None]:
        live, last, starts, seqs, sizes = [], [], [], [], []
        for i, r in enumerate(requests):
            c = len(r.tokens) - 1
            size = min(self.block, r.n_max + 1, self.rt.cache.max_ctx - c)
            if self.received[r.seq_id] != c or size < 2:
                continue
            live.append(i)
            last.append(r.tokens[-1])
            starts.append(c)
            seqs.append(r.seq_id)
            sizes.append(size)
        out: list[Draft | None] = [None] * len(requests)
        if not live:
            return out
        logits = self.rt.draft(last, starts, seqs, sizes)
        toks, p_pick, full = pick_tokens(logits, self.rt.d2t, self.vocab, self.params.temperature, self.gen)
        row = 0
        for i, size in zip(live, sizes):
            ids, conf, keys = [], [], []
            for j in range(size - 1):
                t, pj = toks[row + j], p_pick[row + j]
                ids.append(t)
                conf.append(self.calib.confidence(j, pj))
                keys.append(self.calib.key(j, pj))
                if t in self.eot:  # nothing follows the end of a turn
                    break
            probs = full[row:row + len(ids)].to(self.out_device) if full is not None else None
            row += size - 1
            self.calib.record(requests[i].seq_id, keys)
            out[i] = Draft(tuple(ids), probs, tuple(conf))
        return out

    @hookimpl
    def verified(self, results: Sequence[Verified]) -> None:
        self.calib.verified(results)
