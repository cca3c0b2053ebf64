"""`PairHeadTrain`: the training form a recursive pair head shares (MTP, kvdraft): its input pair, its
layer, the target's output head and the head file it writes.

    z      = proj([RMSNorm(h(t-1) + lookup); RMSNorm(embed(x_t))])   (`pair`)
    out    = the method's own layer step on z
    logits = target_head(target_output_norm(out))                    (`logits`, over the draft vocabulary)

A subclass sets `method` and `version` (the head file's), builds the rest of its module after
`super().__init__`, and writes its own `unroll`. Its config is a dataclass with at least n_embd, eps,
`shape` (the layer's `LayerShape`), rope_base and lookup.
"""
from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from specplug.heads import HeadMeta, write_head
from specplug.train.lookup import LookupTrain
from specplug.train.modules import RMSNorm, TrainLayer


class PairHeadTrain(nn.Module):
    """Trained: `hnorm`, `enorm`, `proj` [n_embd, 2 n_embd], the layer (`blk.`), and with `cfg.lookup` the
    lookup's parts. Frozen buffers: the target's embeddings, output norm and the draft vocabulary's rows
    of its output projection."""

    method: ClassVar[str]
    version: ClassVar[int]

    def __init__(self, cfg: Any, embed: torch.Tensor, out_norm: torch.Tensor, head_rows: torch.Tensor):
        super().__init__()
        d = cfg.n_embd
        self.cfg = cfg
        self.hnorm = RMSNorm(d, cfg.eps)
        self.enorm = RMSNorm(d, cfg.eps)
        self.proj = nn.Parameter(torch.randn(d, 2 * d) / math.sqrt(2 * d))
        self.layer = TrainLayer(d, cfg.shape, cfg.eps, cfg.rope_base)
        self.register_buffer("embed", embed.float(), persistent=False)
        self.register_buffer("out_norm", out_norm.float(), persistent=False)
        self.register_buffer("head_rows", head_rows.float(), persistent=False)
        if cfg.lookup:  # zero: the head starts as the one without it
            self.lookup = LookupTrain(d, cfg.eps)

    def pair(self, h_prev: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """[B, T, d] the layer's input z from the states h(t-1) (the lookup's part already added) and
        the token embeddings."""
        return F.linear(torch.cat([self.hnorm(h_prev), self.enorm(emb)], -1), self.proj)

    def logits(self, out: torch.Tensor, lookup_rows: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, d] pre-norm states -> [B, T, draft vocab] logits through the target's norm and head;
        with `lookup_rows` (each row's lookup draft row, -1: none) the lookup's gate added there."""
        x = out * torch.rsqrt(out.square().mean(-1, keepdim=True) + self.cfg.eps) * self.out_norm
        logits = F.linear(x, self.head_rows)
        if lookup_rows is None or not self.cfg.lookup:
            return logits
        return self.lookup.boost(logits, out, lookup_rows)

    def head_params(self) -> dict[str, nn.Parameter]:
        """The trained parameters under their head file names (`load_head_params` fills them from a file)."""
        p = {"hnorm": self.hnorm.weight, "enorm": self.enorm.weight, "proj": self.proj,
             **self.layer.head_params("blk.")}
        if self.cfg.lookup:
            p.update(self.lookup.head_params())
        return p

    def export(self, path, target_info, d2t: torch.Tensor, recipe: dict, weights: str = "q8_0") -> None:
        """Write the head file (method `method`, taps "final"); `weights`: q8_0 | f16 | f32 for the
        matrices (vectors stay f32)."""
        meta = HeadMeta.for_target(target_info, self.method, self.version, ["final"], asdict(self.cfg), recipe)
        tensors = {**{k: v.detach() for k, v in self.head_params().items()}, "d2t": d2t.to(torch.int32)}
        mats = {"proj"} | TrainLayer.quantized_names("blk.")
        tensors = {k: v.detach().float().cpu() if v.is_floating_point() else v for k, v in tensors.items()}
        write_head(path, meta, tensors,
                   quantize=mats if weights == "q8_0" else (), f16=mats if weights == "f16" else ())
