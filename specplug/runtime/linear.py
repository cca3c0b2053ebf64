"""Linear layers in the weight formats the runtime supports.

`DenseLinear` is F.linear in the model dtype. `Int8Linear` uses fbgemm's dynamically
quantized int8 GEMM (torch.ops.quantized.linear_dynamic): on a CPU without AVX-512 it
reads a quarter of the f32 bytes and stays flat from 1 to ~8 rows, which is what makes
verifying k drafted tokens cost about as much as decoding one.

fbgemm quantizes the activations with one scale for the whole input tensor, so a row's
result would depend on the other rows in the batch and speculative verification would
round differently from one-token decoding. We make it batch-invariant: each row is divided
by its own max |x| and two extra columns hold +1 and -1 (their weights are zero), so every
row of every batch spans exactly [-1, 1] and gets the same quantization parameters. The
int32 accumulation is exact, so a row's output is bit-identical whatever shares its batch.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


class DenseLinear:
    """y = x @ W.T + b with W kept in the model dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight  # [out, in]
        self.bias = bias  # [out] or None
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def int8_available() -> bool:
    """True when this torch build has the fbgemm dynamic-quantized linear (x86 CPU builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


class Int8Linear:
    """Per-output-channel int8 weights, per-row dynamically quantized activations (CPU)."""

    _MAX_BUFFERS = 16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        out_f, in_f = weight.shape
        w = torch.zeros(out_f, in_f + 2, dtype=torch.float32)
        w[:, :in_f] = weight.float()
        scale = (w.abs().amax(1) / 127.0).clamp_min(1e-12).double()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch marks quantized tensor creation as deprecated
            qw = torch.quantize_per_channel(w, scale, torch.zeros(out_f, dtype=torch.long), 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.bias = None if bias is None else bias.float()
        self.in_features = in_f
        self.out_features = out_f
        self._bufs: dict[int, torch.Tensor] = {}

    def _buffer(self, rows: int) -> torch.Tensor:
        buf = self._bufs.get(rows)
        if buf is None:
            if len(self._bufs) >= self._MAX_BUFFERS:
                self._bufs.pop(next(iter(self._bufs)))
            buf = torch.empty(rows, self.in_features + 2)
            buf[:, -2] = 1.0
            buf[:, -1] = -1.0
            self._bufs[rows] = buf
        return buf

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax(-1, keepdim=True).clamp_min_(1e-30)  # [rows, 1]
        buf = self._buffer(x.shape[0])
        torch.div(x, scale, out=buf[:, : self.in_features])
        y = torch.ops.quantized.linear_dynamic(buf, self.packed, True)
        y.mul_(scale)
        if self.bias is not None:
            y.add_(self.bias)
        return y
