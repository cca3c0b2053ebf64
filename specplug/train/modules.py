"""Trainable (float32, autograd) twins of the runtime's building blocks, for head training.

`TrainLayer` is `specplug.runtime.layers.DecoderLayer` as an `nn.Module`: same weight layout
(q/k rows in interleaved RoPE order, [q | k | v] stacked, [gate | up] stacked), so a trained
layer is written to a head file with `head_tensors` and read back at inference by
`specplug.heads.layer_from_head`, with no conversion in between.

`ttt_attention` is the training-time test of EAGLE-3 (and of a recursive MTP): the head is
unrolled r = 0..S-1 steps over whole sequences at once; at step r the query at position t
stands for the draft token r positions past an anchor a = t - r. It sees the step-0 keys up to
the anchor (states computed from the target's own hidden states) and, for i = 1..r, the
step-i key at position a + i (the head's own earlier draft states), exactly the cache the
head holds when it drafts r tokens past a committed prefix.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from specplug.runtime.layers import LayerShape


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight: torch.Tensor | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim) if weight is None else weight.detach().clone().float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*positions.shape, head_dim / 2] for interleaved pairs, as the runtime's `Rope`."""
    inv = (base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)).float()
    ang = positions.float().unsqueeze(-1) * inv.to(positions.device)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D] with pairs (2i, 2i+1) rotated by cos/sin [B, T, D/2]."""
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)


class TrainLayer(nn.Module):
    """A llama decoder layer in float32 with autograd; see the module docstring.

    d_attn_in: width of the attention input (n_embd, or 2 n_embd for Eagle3's [embed; h]).
    attn_norm: whether the layer normalizes its attention input itself (False when the caller
    passes an already normalized input, as Eagle3 does).
    """

    def __init__(self, d_model: int, shape: LayerShape, eps: float, rope_base: float, d_attn_in: int | None = None,
                 attn_norm: bool = True):
        super().__init__()
        d_in = d_attn_in or d_model
        H, Hkv, D = shape.n_head, shape.n_head_kv, shape.head_dim
        self.shape, self.eps, self.rope_base, self.d_model = shape, eps, rope_base, d_model
        self.attn_norm = RMSNorm(d_in, eps) if attn_norm else None
        self.wqkv = nn.Parameter(torch.randn((H + 2 * Hkv) * D, d_in) / math.sqrt(d_in))
        self.wo = nn.Parameter(torch.randn(d_model, H * D) / math.sqrt(H * D) * 0.5)
        self.ffn_norm = RMSNorm(d_model, eps)
        self.w_gate_up = nn.Parameter(torch.randn(2 * shape.n_ff, d_model) / math.sqrt(d_model))
        self.w_down = nn.Parameter(torch.randn(d_model, shape.n_ff) / math.sqrt(shape.n_ff) * 0.5)

    def load_target_layer(self, w: dict[str, torch.Tensor]) -> None:
        """Start from a target layer's weights (as from `target_layer_weights`)."""
        with torch.no_grad():
            if self.attn_norm is not None:
                self.attn_norm.weight.copy_(w["attn_norm"])
            self.wqkv.copy_(w["attn_qkv"])
            self.wo.copy_(w["attn_output"])
            self.ffn_norm.weight.copy_(w["ffn_norm"])
            self.w_gate_up.copy_(w["ffn_gate_up"])
            self.w_down.copy_(w["ffn_down"])

    def qkv(self, x_in: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x_in [B, T, d_in] -> q [B, H, T, D], k, v [B, Hkv, T, D] (RoPE applied to q and k)."""
        S = self.shape
        H, Hkv, D = S.n_head, S.n_head_kv, S.head_dim
        if self.attn_norm is not None:
            x_in = self.attn_norm(x_in)
        qkv = F.linear(x_in, self.wqkv)
        B, T = qkv.shape[:2]
        q = qkv[..., : H * D].view(B, T, H, D).transpose(1, 2)
        k = qkv[..., H * D:(H + Hkv) * D].view(B, T, Hkv, D).transpose(1, 2)
        v = qkv[..., (H + Hkv) * D:].view(B, T, Hkv, D).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, o: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o [B, H, T, D] (attention output) -> the layer output [B, T, d_model]."""
        B, H, T, D = o.shape
        x = residual + F.linear(o.transpose(1, 2).reshape(B, T, H * D), self.wo)
        gu = F.linear(self.ffn_norm(x), self.w_gate_up)
        n_ff = self.shape.n_ff
        return x + F.linear(F.silu(gu[..., :n_ff]) * gu[..., n_ff:], self.w_down)

    def head_params(self, prefix: str) -> dict[str, nn.Parameter]:
        """The parameters themselves under the names `specplug.heads.layer_from_head` reads."""
        out = {prefix + "attn_qkv": self.wqkv, prefix + "attn_output": self.wo,
               prefix + "ffn_norm": self.ffn_norm.weight,
               prefix + "ffn_gate_up": self.w_gate_up, prefix + "ffn_down": self.w_down}
        if self.attn_norm is not None:
            out[prefix + "attn_norm"] = self.attn_norm.weight
        return out

    def head_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The weights under the names `specplug.heads.layer_from_head` reads (copies, float32, on the CPU)."""
        return {k: v.detach().float().cpu() for k, v in self.head_params(prefix).items()}

    @staticmethod
    def quantized_names(prefix: str) -> set[str]:
        """The names (under `prefix`) of the layer's matrices, which a head file stores as Q8_0
        (`write_head(..., quantize=...)`); the norms stay float32."""
        return {prefix + n for n in ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down")}


def load_head_params(params: dict[str, nn.Parameter], head) -> None:
    """Start from a head file: copy its tensors (dequantized) into the parameters of the same names,
    as a module's `head_params` gives them; a missing tensor or another shape is a HeadError."""
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(head.tensor(name, tuple(p.shape)).to(p.device, p.dtype))


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., T, D] shifted k positions later along T (zeros in front)."""
    if k == 0:
        return x
    return F.pad(x, (0, 0, k, 0))[..., : x.shape[-2], :]


def ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor],
                  scale: float | None = None) -> torch.Tensor:
    """Attention of unroll step r = len(ks) - 1 (see the module docstring).

    q [B, H, T, D]; ks[i], vs[i] [B, Hkv, T, D] are step i's keys and values at every position.
    Padding goes at the end of a row: a query never sees a key later than itself, so real
    queries never see padding.
    """
    r = len(ks) - 1
    B, H, T, D = q.shape
    Hkv = ks[0].shape[1]
    G = H // Hkv
    scale = scale if scale is not None else D ** -0.5
    qg = q.reshape(B, Hkv, G, T, D) * scale
    s0 = torch.einsum("bkgtd,bksd->bkgts", qg, ks[0])  # [B, Hkv, G, T, T]
    t_idx = torch.arange(T, device=q.device)
    allowed = t_idx.view(1, T) <= (t_idx.view(T, 1) - r)  # key j <= anchor t - r
    s0 = s0.masked_fill(~allowed, float("-inf"))
    diag = []
    for i in range(1, r + 1):
        ki = _shift(ks[i], r - i)  # step-i key at position t - r + i
        d = torch.einsum("bkgtd,bktd->bkgt", qg, ki)
        d = d.masked_fill((t_idx < r - i).view(1, 1, 1, T), float("-inf"))
        diag.append(d.unsqueeze(-1))
    scores = torch.cat([s0] + diag, -1) if diag else s0
    w = torch.softmax(scores, -1)
    w = torch.nan_to_num(w)  # queries with no visible key at all (t < r, never in a loss)
    o = torch.einsum("bkgts,bksd->bkgtd", w[..., :T], vs[0])
    for i in range(1, r + 1):
        o = o + w[..., T + i - 1].unsqueeze(-1) * _shift(vs[i], r - i).unsqueeze(2)
    return o.reshape(B, H, T, D)
