"""Sampling parameters and the target distribution they define.

The same `target_probs` serves plain sampling and stochastic verification, so speculative
and plain decoding sample from exactly the same distribution.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specplug.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off; min_p 0 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        checks = [("temperature", self.temperature >= 0, ">= 0"), ("top_k", self.top_k >= 0, ">= 0"),
                  ("top_p", 0 < self.top_p <= 1, "in (0, 1]"), ("min_p", 0 <= self.min_p < 1, "in [0, 1)")]
        for key, ok, rule in checks:
            if not ok:
                raise ConfigError(f"sampling.{key} must be {rule}, got {getattr(self, key)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """logits [n, vocab] -> probabilities [n, vocab] float32 after temperature/top-k/top-p/min-p."""
    logits = logits.float() / max(sp.temperature, 1e-6)
    if sp.top_k and sp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sp.min_p > 0:
        probs = probs.masked_fill(probs < sp.min_p * probs.amax(-1, keepdim=True), 0.0)
    if sp.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (always at least one token). A full
        # sort of a 49k vocabulary costs milliseconds per row; the nucleus almost always lies
        # in the top 256, so sort those and fall back to the full sort only when it does not.
        k = min(256, probs.shape[-1])
        sorted_p, idx = torch.topk(probs, k, dim=-1)
        if k < probs.shape[-1] and bool((sorted_p.sum(-1) < sp.top_p).any()):
            sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= sp.top_p
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p.masked_fill(drop, 0.0))
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """Draw one token id from a probability vector [vocab]."""
    return int(torch.multinomial(probs, 1, generator=gen))
