"""The training form of what a head adds from the context's pair lookup (`specplug.heads.lookup`,
where the lookup itself and its drafting form are): a head module owns one as `lookup`."""
from __future__ import annotations

import torch

from specplug.heads.lookup import LOOKUP_NAMES
from specplug.train.modules import RMSNorm


class LookupTrain(torch.nn.Module):
    """The training form of what a head adds from its lookup L: `proj(norm(embed(L)))` added to its
    state before its layer (`input`), and `gate . out + gate_bias` added to L's logit (`boost`); zero-started
    (the norm at one), so a head fine-tuned into one starts as it was. A head module owns one as `lookup`."""

    def __init__(self, d: int, eps: float):
        super().__init__()
        self.proj = torch.nn.Parameter(torch.zeros(d, d))
        self.norm = RMSNorm(d, eps)
        self.gate = torch.nn.Parameter(torch.zeros(1, d))
        self.gate_bias = torch.nn.Parameter(torch.zeros(1))

    def input(self, embed: torch.Tensor, lookup: torch.Tensor) -> torch.Tensor:
        """What the lookups [B, T] add to the head's state: [B, T, d] (zero where there is none);
        embed: the target's embedding table."""
        e = self.norm(embed[lookup.clamp(min=0)])
        return torch.nn.functional.linear(e, self.proj) * (lookup >= 0).unsqueeze(-1)

    def boost(self, logits: torch.Tensor, out: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """logits [n, V] with `gate . out + bias` added at each row's lookup draft row (rows [n], -1: none)."""
        gate = torch.nn.functional.linear(out, self.gate, self.gate_bias).squeeze(-1)
        add = torch.zeros_like(logits).scatter(-1, rows.clamp(min=0).unsqueeze(-1), (gate * (rows >= 0)).unsqueeze(-1))
        return logits + add

    def head_params(self) -> dict[str, torch.nn.Parameter]:
        """The parameters under their head file names (`LOOKUP_NAMES`)."""
        return dict(zip(LOOKUP_NAMES, (self.proj, self.norm.weight, self.gate, self.gate_bias)))
