"""Which rows of a training batch (`specplug.train.dataset.SeqBatch`) a head is scored on.

A batch row t holds token x_t, the target's hidden states h(t) computed at it, and, where
`has_dist[t]`, the target's distribution for token t + 1 (`topk_ids[t]`, `topk_logprobs[t]`).
`dist_start` is the last prompt row: drafting starts there.

- A recursive head (MTP, Eagle3) at unroll step r reads row t and predicts token t + 1 from an
  anchor t - r: `chain_mask(batch, r)` (also `specplug.train.distill.step_mask`, beside the losses).
- Parallel heads read the newest state h(s) and the token x(s+1) (at `draft`: s = len(tokens) - 2)
  and head k predicts token s + 2 + k, whose distribution is recorded at row s + 1 + k:
  `parallel_mask(batch, k)` over state rows s, and `ahead(x, 1 + k)` to bring row s + 1 + k's
  targets (or tokens) to row s.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def chain_mask(batch, r: int) -> torch.Tensor:
    """[B, T] rows counted at unroll step r: a recorded distribution, and an anchor t - r at or after
    the last prompt token (drafts start there)."""
    t = torch.arange(batch.tokens.shape[1], device=batch.tokens.device).view(1, -1)
    return batch.has_dist & (t - r >= batch.dist_start.view(-1, 1))


def ahead(x: torch.Tensor, n: int) -> torch.Tensor:
    """[B, T, ...] -> row t holds row t + n of `x` (zeros / False past the end)."""
    if n == 0:
        return x
    pad = [0, 0] * (x.dim() - 2) + [0, n]
    return F.pad(x, pad)[:, n:]


def parallel_mask(batch, k: int) -> torch.Tensor:
    """[B, T] bool: state rows s where parallel head k (0-based) is scored: the target's distribution
    for token s + 2 + k was recorded (row s + 1 + k has one) and the draft starts at or after the last
    prompt token (s + 1 >= dist_start)."""
    t = torch.arange(batch.tokens.shape[1], device=batch.tokens.device).view(1, -1)
    return ahead(batch.has_dist, 1 + k) & (t + 1 >= batch.dist_start.view(-1, 1))


__all__ = ["ahead", "chain_mask", "parallel_mask"]
