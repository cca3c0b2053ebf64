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


def take_rows(x: torch.Tensor, rows) -> torch.Tensor:
    """Rows `rows` (a sequence of ints or a 1-D int64 tensor) of x, as a new tensor, by `index_select`.
    Not `x[rows]`: advanced indexing runs on torch's OpenMP threads from about 6 rows of a hidden state,
    and those threads then spin on the cores the next native kernel call needs (AMD EPYC Zen 4, 2
    threads: the output head on 6-8 selected rows 0.36-0.43 ms after `x[rows]`, 0.23-0.25 ms after
    `index_select` or none; docs/results/heads.md, 2026-11-27)."""
    if not torch.is_tensor(rows):
        rows = torch.as_tensor(list(rows), dtype=torch.long, device=x.device)
    elif rows.device != x.device:  # index_select, unlike x[rows], wants the index on x's device
        rows = rows.to(x.device)
    return x.index_select(0, rows)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # aten's rms_norm is not fused on CPU and costs ~3x these ops for one row
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def _onednn_pack(weight: torch.Tensor):
    """oneDNN-blocked f32 weight for CPU, or None where that path is unavailable.

    On this kind of CPU (AVX2, no AVX-512) MKL's default sgemm falls off its fast path for
    2-3 rows (T(2) ~ 1.8 T(1)); oneDNN's pre-packed GEMM is faster at 1 row and grows
    smoothly with the rows verified. Packed for 8 rows, the sweet spot of verification.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
        torch.ops.mkldnn._linear_pointwise(torch.zeros(1, weight.shape[1]), packed, None, "none", [], "")
        return packed
    except (RuntimeError, AttributeError):  # a build without these private ops: plain F.linear
        return None


class DenseLinear:
    """y = x @ W.T + b with the dequantized weights in the model dtype.

    With `norm_weight`, `norm_linear(x)` is linear(rms_norm(x) * norm_weight).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None):
        self.packed = _onednn_pack(weight)
        self.weight = weight if self.packed is None else None  # [out, in]
        self.bias = bias  # [out] or None
        self.norm_weight = norm_weight  # [in] or None
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        else:
            y = F.linear(x, self.weight, self.bias)
        return y if residual is None else residual + y

    def norm_linear(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        return self(rms_norm(x, self.norm_weight, eps))

    def unpack(self) -> None:
        """Back to a plain weight and F.linear: what torch.compile's inductor can lower (it cannot
        lower oneDNN's opaque packed tensors)."""
        if self.packed is not None:
            self.weight, self.packed = self.packed.to_dense(), None


def int8_available() -> bool:
    """True when this torch build has the fbgemm dynamic-quantized linear (x86 CPU builds)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


class Int8Linear:
    """Per-output-channel int8 weights, per-row dynamically quantized activations (CPU).

    With `norm_weight`, `norm_linear(x)` is linear(rms_norm(x) * norm_weight). (Folding the
    norm weight into W saves ops but quantizes the raw residual stream, whose outlier
    channels cost accuracy: top-1 agreement with float32 fell from >90% to 83%.)
    """

    _MAX_BUFFERS = 16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None):
        out_f, in_f = weight.shape
        w = torch.zeros(out_f, in_f + 2, dtype=torch.float32)
        w[:, :in_f] = weight.float()
        self.norm_weight = None if norm_weight is None else norm_weight.float()
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

    def _matmul(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        buf = self._buffer(x.shape[0])
        torch.div(x, scale, out=buf[:, : self.in_features])
        return torch.ops.quantized.linear_dynamic(buf, self.packed, True)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        scale = torch.linalg.vector_norm(x, float("inf"), -1, keepdim=True).clamp_min_(1e-30)  # [rows, 1] max |x|
        y = self._matmul(x, scale)
        if self.bias is not None:
            return torch.addcmul(self.bias if residual is None else residual + self.bias, y, scale)
        return y.mul_(scale) if residual is None else torch.addcmul(residual, y, scale)

    def norm_linear(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        return self(rms_norm(x, self.norm_weight, eps))
