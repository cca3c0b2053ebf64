"""Self-distillation targets shared by head trainers: the target's recorded next-token
distribution restricted to a draft vocabulary, and which rows count at each unroll step
(`step_mask`: `specplug.heads.masks.chain_mask`, with the other masks)."""
from __future__ import annotations

import torch

from specplug.heads.masks import chain_mask as step_mask
from specplug.train.dataset import SeqBatch


def soft_targets(batch: SeqBatch, t2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft-vocabulary indices [B, T, k], probabilities [B, T, k]) of the target's top-k next tokens,
    renormalized over those inside the draft vocabulary (zero weight for the others).
    t2d: [vocab] int64, target id -> draft row, -1 outside the draft vocabulary."""
    idx = t2d[batch.topk_ids]
    p = batch.topk_logprobs.exp() * (idx >= 0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
    return idx.clamp_min(0), p


def draft_ce(logits: torch.Tensor, idx: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Per-row cross-entropy [n] of draft logits [n, V] against soft targets (idx, p) [n, k]."""
    return -(p * torch.log_softmax(logits, -1).gather(-1, idx)).sum(-1)


def invert(d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """[vocab] int64 target id -> draft row (-1 outside the draft vocabulary)."""
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    return t2d


__all__ = ["draft_ce", "invert", "soft_targets", "step_mask"]
