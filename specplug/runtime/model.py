"""The target model: a llama-family transformer in plain torch, run over batches of
(token, position, sequence) entries against a multi-sequence KV cache.

One forward serves prompt chunks, single-token decoding and k-token verification of many
sequences at once. The caller chooses which rows get logits and which hidden states are
tapped; nothing is computed or copied for rows and taps nobody asked for.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from specplug.errors import ModelError
from specplug.runtime.gguf_file import GGUFFile, ModelConfig
from specplug.runtime.kv_cache import KVCache
from specplug.runtime import native
from specplug.runtime.linear import DenseLinear, Int8Linear, int8_available, rms_norm
from specplug.runtime.native import QuantLinear

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTS = ("auto", "none", "int8", "gguf")

# T(k)/T(1): the time of one forward of k new rows relative to one row, per runtime, measured with
# `specplug bench-runtime` (SmolLM2-135M, 2 threads, median of 3; README). The engine trims drafts
# that carry confidences to the length where one more row costs more than it is expected to save.
# CPU float32 (and int8, not measured apart) is flat because one row is already slow; the gguf
# kernels are fast at one row, so each extra row costs ~0.15-0.3 of a step. CUDA: not measured
# here (no GPU was lent); a small model's forward is launch-bound for dozens of rows, hence nearly flat.
VERIFY_COST_CURVES = {
    "gguf": ((1, 1.0), (2, 1.15), (3, 1.35), (4, 1.60), (6, 2.23), (8, 2.83), (12, 4.03), (16, 5.22), (32, 9.91)),
    "cpu": ((1, 1.0), (2, 1.11), (3, 1.17), (4, 1.29), (6, 1.39), (8, 1.54), (12, 1.79), (16, 2.07), (32, 3.06)),
    "cuda": ((1, 1.0), (32, 1.3)),
}


def interpolate_cost(curve: Sequence[tuple[int, float]], n: int) -> float:
    """Piecewise-linear T(n)/T(1) through the curve's points, extended with its last slope."""
    if n <= curve[0][0]:
        return curve[0][1]
    for (a, ta), (b, tb) in zip(curve, curve[1:]):
        if n <= b:
            return ta + (tb - ta) * (n - a) / (b - a)
    (a, ta), (b, tb) = curve[-2], curve[-1]
    return tb + (tb - ta) * (n - b) / (b - a)


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"device {device!r} was asked for but torch sees no CUDA device (use device: cpu or auto)")
    return torch.device(device)


_LINEAR_SUFFIXES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
                    "ffn_up.weight", "ffn_down.weight")


def _gguf_problem(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why quant: gguf cannot run this model here, or None."""
    if device.type != "cpu" or dtype != torch.float32:
        return "it runs on device: cpu with dtype: float32"
    if cfg.n_embd % 32 or cfg.n_ff % 32:
        return f"n_embd ({cfg.n_embd}) and n_ff ({cfg.n_ff}) must be multiples of 32"
    if cfg.head_dim % 8 or cfg.head_dim > 256:
        return f"head_dim ({cfg.head_dim}) must be a multiple of 8, at most 256"
    return native.unavailable_reason()


def _auto_quant(gguf: GGUFFile, device: torch.device, dtype: torch.dtype) -> str:
    """gguf for a quantized file on CPU when the kernels build here; none (exact float weights) otherwise."""
    quantized = all(gguf.tensor_type(n) not in ("F32", "F16", "BF16", "F64")
                    for n in gguf.tensors if n.endswith(_LINEAR_SUFFIXES))
    if not quantized or _gguf_problem(gguf.config, device, dtype):
        return "none"
    try:
        native.kernels()
    except ModelError as exc:
        warnings.warn(f"{exc}; running with exact float weights (quant: none) instead")
        return "none"
    return "gguf"


@dataclass(frozen=True)
class ForwardOutput:
    """What one forward returns, rows in the order of the batch entries."""

    logits: torch.Tensor | None  # [len(logits_rows), vocab] float32
    hidden: dict[int, torch.Tensor]  # tap -> [n_entries, n_embd] float32; tap i = input of layer i, n_layer = pre-norm final


@dataclass
class _Layer:
    qkv: object  # attn_norm folded in: qkv.norm_linear(x)
    o: object
    gate_up: object  # ffn_norm folded in
    down: object
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


def _neox_to_interleaved(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder Q/K rows so RoPE pairs (i, i+d/2) become (2i, 2i+1); q.k is unchanged."""
    perm = torch.stack([torch.arange(head_dim // 2), torch.arange(head_dim // 2) + head_dim // 2], -1).flatten()
    return w.reshape(n_heads, head_dim, *w.shape[1:])[:, perm].reshape(w.shape)


class Transformer:
    """A llama/qwen2/qwen3 decoder loaded from GGUF. Use `Transformer.load(path, ...)`."""

    def __init__(self, gguf: GGUFFile, device: torch.device, dtype: torch.dtype, quant: str):
        self.config = cfg = gguf.config
        self.path = gguf.path
        self.device, self.dtype = device, dtype
        if quant == "auto":
            quant = _auto_quant(gguf, device, dtype)
        if quant == "int8" and (device.type != "cpu" or dtype != torch.float32 or not int8_available()):
            raise ModelError("quant: int8 needs device: cpu and dtype: float32 on an x86 torch build with fbgemm")
        if quant == "gguf":
            problem = _gguf_problem(cfg, device, dtype)
            if problem:
                raise ModelError(f"{gguf.path}: quant: gguf is not possible here: {problem} (use quant: none)")
            self._k = native.kernels()
        self.quant = quant

        def t(name: str) -> torch.Tensor:
            return torch.from_numpy(gguf.tensor(name))

        def lin(w: torch.Tensor, b: torch.Tensor | None = None, norm: torch.Tensor | None = None):
            if quant == "int8":
                return Int8Linear(w, b, norm)
            return DenseLinear(w.to(device, dtype), None if b is None else b.to(device, dtype),
                               None if norm is None else norm.to(device, dtype))

        def qlin(names: list[str], heads: list[int] | None = None, b: torch.Tensor | None = None,
                 norm: torch.Tensor | None = None):
            """The named tensors stacked by rows as GGUF blocks; heads[i]: neox-permute part i."""
            parts = [gguf.raw(n) for n in names]
            types = {qt for _, qt, _ in parts}
            perm = [heads[i] if heads else None for i in range(len(names))]
            if len(types) == 1 and types <= set(native.NATIVE_TYPES):
                rows = [torch.from_numpy(np.array(r)) for r, _, _ in parts]
                rows = [r if h is None else _neox_to_interleaved(r, h, cfg.head_dim) for r, h in zip(rows, perm)]
                raw = torch.cat(rows).numpy()
                return QuantLinear.from_blocks(raw, types.pop(), (raw.shape[0], parts[0][2][1]), bias=b,
                                               norm_weight=norm)
            ws = [t(n) for n in names]  # other types: re-quantized to Q8_0
            ws = [w if h is None else _neox_to_interleaved(w, h, cfg.head_dim) for w, h in zip(ws, perm)]
            return QuantLinear.from_float(torch.cat(ws), bias=b, norm_weight=norm)

        def vec(w: torch.Tensor) -> torch.Tensor:
            return w.to(device, dtype)

        H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        self.layers: list[_Layer] = []
        for i in range(cfg.n_layer):
            p = f"blk.{i}."
            q_shape, k_shape = gguf.shape(p + "attn_q.weight"), gguf.shape(p + "attn_k.weight")
            if q_shape != (H * D, cfg.n_embd) or k_shape != (Hkv * D, cfg.n_embd):
                raise ModelError(f"{gguf.path}: {p}attn_q/attn_k have shapes {q_shape}/{k_shape}, "
                                 f"which do not match the metadata (heads {H}/{Hkv}, head_dim {D})")
            bias = None
            if cfg.attn_bias:
                bias = [t(p + f"attn_{x}.bias") for x in "qkv"]
                if cfg.rope_style == "neox":
                    bias[0], bias[1] = _neox_to_interleaved(bias[0], H, D), _neox_to_interleaved(bias[1], Hkv, D)
            if quant == "gguf":
                neox = [H, Hkv, None] if cfg.rope_style == "neox" else None
                layer = _Layer(
                    qkv=qlin([p + f"attn_{x}.weight" for x in "qkv"], neox, None if bias is None else torch.cat(bias),
                             t(p + "attn_norm.weight")),
                    o=qlin([p + "attn_output.weight"]),
                    gate_up=qlin([p + "ffn_gate.weight", p + "ffn_up.weight"], None, None, t(p + "ffn_norm.weight")),
                    down=qlin([p + "ffn_down.weight"]),
                )
            else:
                wq, wk, wv = t(p + "attn_q.weight"), t(p + "attn_k.weight"), t(p + "attn_v.weight")
                if cfg.rope_style == "neox":
                    wq, wk = _neox_to_interleaved(wq, H, D), _neox_to_interleaved(wk, Hkv, D)
                layer = _Layer(
                    qkv=lin(torch.cat([wq, wk, wv]), None if bias is None else torch.cat(bias),
                            t(p + "attn_norm.weight")),
                    o=lin(t(p + "attn_output.weight")),
                    gate_up=lin(torch.cat([t(p + "ffn_gate.weight"), t(p + "ffn_up.weight")]), None,
                                t(p + "ffn_norm.weight")),
                    down=lin(t(p + "ffn_down.weight")),
                )
            if cfg.qk_norm:
                perm = _neox_to_interleaved(torch.arange(D).float().unsqueeze(1), 1, D).squeeze(1).long()
                layer.q_norm = vec(t(p + "attn_q_norm.weight")[perm])
                layer.k_norm = vec(t(p + "attn_k_norm.weight")[perm])
            self.layers.append(layer)
        emb = t("token_embd.weight")
        if emb.shape != (cfg.vocab_size, cfg.n_embd):
            raise ModelError(f"{gguf.path}: token_embd.weight has shape {tuple(emb.shape)}, "
                             f"expected ({cfg.vocab_size}, {cfg.n_embd})")
        self.embed = emb.to(device, dtype)  # [vocab, n_embd]
        out_norm = t("output_norm.weight")
        self.norm = vec(out_norm)  # [n_embd]: the head applies it (norm_linear); kept for callers of taps
        if quant == "gguf":
            self.head = qlin(["token_embd.weight" if cfg.tied_embeddings else "output.weight"], None, None, out_norm)
        else:
            self.head = lin(emb if cfg.tied_embeddings else t("output.weight"), None, out_norm)
        # RoPE as complex rotations of interleaved pairs, one row per position.
        inv = cfg.rope_base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        self._rope_inv_freq = inv.float()
        self._rope = torch.empty(0, D // 2, dtype=torch.complex64, device=device)
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
        self.metadata = gguf.metadata

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu", dtype: str = "float32", quant: str = "auto") -> "Transformer":
        """Load a GGUF model; every problem is a ModelError naming the file."""
        if dtype not in DTYPES:
            raise ModelError(f"dtype {dtype!r} is not supported (choose one of: {', '.join(DTYPES)})")
        if quant not in QUANTS:
            raise ModelError(f"quant {quant!r} is not supported (choose one of: {', '.join(QUANTS)})")
        return cls(GGUFFile(path), resolve_device(device), DTYPES[dtype], quant)

    def verify_cost(self, n_rows: int) -> float:
        """Estimated time of a forward of `n_rows` new rows, in units of a one-row forward."""
        key = "gguf" if self.quant == "gguf" else ("cuda" if self.device.type == "cuda" else "cpu")
        return interpolate_cost(VERIFY_COST_CURVES[key], n_rows)

    def new_cache(self, n_seq: int, max_ctx: int) -> KVCache:
        """A KV cache for `n_seq` sequences of up to `max_ctx` positions each."""
        cfg = self.config
        cache_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
        return KVCache(cfg.n_layer, n_seq, max_ctx, cfg.n_head_kv, cfg.head_dim, cache_dtype, self.device)

    def _rope_table(self, n: int) -> torch.Tensor:
        if self._rope.shape[0] < n:
            n = max(n, 2 * self._rope.shape[0], 256)
            ang = torch.outer(torch.arange(n, dtype=torch.float32), self._rope_inv_freq)
            self._rope = torch.polar(torch.ones_like(ang), ang).to(self.device)
        return self._rope

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        seq_ids: Sequence[int],
        cache: KVCache,
        logits_rows: Sequence[int] | None = None,
        taps: frozenset[int] | set[int] = frozenset(),
    ) -> ForwardOutput:
        """Run one batch of entries (token, position, sequence) and update the cache.

        logits_rows: indices of entries to compute logits for (None = every entry).
        taps: layer indices whose input hidden state to return for every entry;
        `config.n_layer` is the pre-norm final state (what MTP heads condition on).
        """
        cfg = self.config
        n = len(token_ids)
        assert n == len(positions) == len(seq_ids) and n > 0, (n, len(positions), len(seq_ids))
        if self.quant == "gguf":
            return self._forward_gguf(token_ids, positions, seq_ids, cache, logits_rows, taps)
        plan = _Plan(positions, seq_ids, cache, self.device, cfg.n_head // cfg.n_head_kv, self.dtype)
        dev = self.device
        tok = torch.as_tensor(token_ids, dtype=torch.long, device=dev)
        if plan.gather is not None:
            tok = tok[plan.gather]
        x = self.embed[tok]  # [B*T, n_embd]
        rope = self._rope_table(cache.max_ctx)[plan.q_pos]  # [B*T, D/2] complex
        rope = rope.unsqueeze(1)
        H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        B, T = plan.B, plan.T
        hidden: dict[int, torch.Tensor] = {}
        for li, L in enumerate(self.layers):
            if li in taps:
                hidden[li] = x
            qkv = L.qkv.norm_linear(x, cfg.rms_eps)  # [B*T, (H+2Hkv)*D]
            qk = qkv[:, : (H + Hkv) * D].unflatten(1, (H + Hkv, D))
            if L.q_norm is not None:
                qk = torch.cat([rms_norm(qk[:, :H], L.q_norm, cfg.rms_eps),
                                rms_norm(qk[:, H:], L.k_norm, cfg.rms_eps)], 1)
            qk = torch.view_as_real(torch.view_as_complex(qk.float().unflatten(2, (D // 2, 2))) * rope).flatten(2)
            qk = qk.to(x.dtype)
            q = qk[:, :H]
            k = qk[:, H:]
            v = qkv[:, (H + Hkv) * D:].unflatten(1, (Hkv, D))
            kc, vc = plan.write(cache.k[li], k), plan.write(cache.v[li], v)
            o = _attention(q, kc.to(q.dtype), vc.to(q.dtype), plan.mask, B, T, H, Hkv, D)
            x = L.o(o, residual=x)
            gu = L.gate_up.norm_linear(x, cfg.rms_eps)
            x = L.down(F.silu(gu[:, : cfg.n_ff]) * gu[:, cfg.n_ff:], residual=x)
        if cfg.n_layer in taps:
            hidden[cfg.n_layer] = x
        hidden = {k: plan.to_entries(v).float() for k, v in hidden.items()}
        logits = None
        if logits_rows is None or len(logits_rows) > 0:
            rows = plan.padded_rows(logits_rows)
            xr = x if rows is None else x[rows]
            logits = self.head.norm_linear(xr, cfg.rms_eps).float()
        return ForwardOutput(logits=logits, hidden=hidden)

    def _forward_gguf(self, token_ids, positions, seq_ids, cache: KVCache, logits_rows, taps) -> ForwardOutput:
        """forward() on the GGUF-block kernels: every entry is one row, no padding, no mask.

        Each row attends to its own sequence's valid cells up to its position, so rows of
        different sequences and lengths mix freely and every row's result is independent of
        the rest of the batch.
        """
        cfg, k = self.config, self._k
        positions = [int(p) for p in positions]
        seq_ids = [int(s) for s in seq_ids]
        _note_batch(positions, seq_ids, cache)
        if cache.k.dtype != torch.float32 or cache.k.device.type != "cpu":
            raise ModelError("quant: gguf needs a float32 CPU cache (make it with model.new_cache)")
        seq_t = torch.tensor(seq_ids, dtype=torch.int32)
        pos_t = torch.tensor(positions, dtype=torch.int32)
        cache.valid[seq_t.long(), pos_t.long()] = True
        cos, sin = self._cos_sin_table(cache.max_ctx)
        x = self.embed[torch.as_tensor(token_ids, dtype=torch.long)]
        H, Hkv, D, eps = cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rms_eps
        scale = D ** -0.5
        hidden: dict[int, torch.Tensor] = {}
        for li, L in enumerate(self.layers):
            if li in taps:
                hidden[li] = x
            qkv = L.qkv.norm_linear(x, eps)  # [n, (H + 2 Hkv) D]
            kc, vc = cache.k[li], cache.v[li]
            k.rope_store(qkv, seq_t, pos_t, cos, sin, H, Hkv, L.q_norm, L.k_norm, eps, kc, vc)
            x = L.o(k.attention(qkv, kc, vc, seq_t, pos_t, cache.valid, H, scale), residual=x)
            x = L.down.matmul(k.silu_mul_quantize(L.gate_up.norm_linear(x, eps)), residual=x)
        if cfg.n_layer in taps:
            hidden[cfg.n_layer] = x
        logits = None
        if logits_rows is None or len(logits_rows) > 0:
            xr = x if logits_rows is None or list(logits_rows) == list(range(len(seq_ids))) else \
                x[torch.as_tensor(list(logits_rows), dtype=torch.long)]
            logits = self.head.norm_linear(xr, eps)
        return ForwardOutput(logits=logits, hidden=hidden)

    def _cos_sin_table(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos_sin is None or self._cos_sin[0].shape[0] < n:
            rope = self._rope_table(n)
            self._cos_sin = (rope.real.contiguous(), rope.imag.contiguous())
        return self._cos_sin


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               B: int, T: int, H: int, Hkv: int, D: int) -> torch.Tensor:
    """q [B*T, H, D], k/v [B, Hkv, L, D] -> [B*T, H*D].

    With several query rows, the G = H/Hkv query heads sharing a kv head become rows of one
    attention per kv head ([B, Hkv, G*T, D]): no K/V repetition and fewer, larger kernels.
    """
    if T == 1:
        o = F.scaled_dot_product_attention(q.unflatten(0, (B, 1)).transpose(1, 2), k, v, attn_mask=mask,
                                           enable_gqa=Hkv != H)  # [B, H, 1, D]
        return o.reshape(B, H * D)
    G = H // Hkv
    qg = q.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)  # [B, Hkv, G*T, D]
    return o.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B * T, H * D)


def _note_batch(positions: list[int], seq_ids: list[int], cache: KVCache) -> dict[int, list[int]]:
    """Check a batch against the cache and record its writes; returns seq -> its entry indices."""
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(seq_ids):
        groups.setdefault(s, []).append(i)
    for s, g in groups.items():
        pos = [positions[i] for i in g]
        if len(set(pos)) != len(pos):
            raise ValueError(f"sequence {s} has the same position twice in one batch: {sorted(pos)}")
        cache._check_seq(s)
        cache.note_writes(s, pos)
    return groups


class _Plan:
    """How a batch of entries maps onto a padded [B sequences, T tokens] layout and the cache.

    Computed once per forward in Python (the batch is small), used by every layer.
    """

    def __init__(self, positions: Sequence[int], seq_ids: Sequence[int], cache: KVCache, dev: torch.device,
                 group: int = 1, dtype: torch.dtype = torch.float32):
        positions = [int(p) for p in positions]
        seq_ids = [int(s) for s in seq_ids]
        groups = _note_batch(positions, seq_ids, cache)
        self.slots = list(groups)
        self.B = B = len(groups)
        self.T = T = max(len(g) for g in groups.values())
        self.n = n = len(positions)
        # padded row r = b*T + t holds entry groups[b][t]; pad rows repeat the group's last entry
        if B == 1:
            self.gather = None  # identity: entries are already the padded layout
            row_of_entry = None
            q_pos = positions
            real = None
        else:
            order = []
            row_of_entry = [0] * n
            real = []
            for b, g in enumerate(groups.values()):
                for t in range(T):
                    e = g[min(t, len(g) - 1)]
                    order.append(e)
                    if t < len(g):
                        row_of_entry[e] = b * T + t
                        real.append(b * T + t)
            q_pos = [positions[e] for e in order]
            self.gather = torch.tensor(order, dtype=torch.long, device=dev)
        self._row_of_entry = row_of_entry
        self.q_pos = torch.tensor(q_pos, dtype=torch.long, device=dev)  # [B*T]
        # cache cells written by this batch (real rows only; pads would clobber cells)
        w_seq = [s for s, g in groups.items() for _ in g]
        w_pos = [positions[i] for g in groups.values() for i in g]
        self._real_rows = None if real is None or len(real) == B * T else torch.tensor(real, device=dev)
        s0, p = self.slots[0], positions
        contiguous = B == 1 and p == list(range(p[0], p[0] + n))
        self._span = (s0, p[0], p[0] + n) if contiguous else None
        if contiguous:
            cache.valid[s0, p[0]:p[0] + n] = True
        else:
            self._w_seq = torch.tensor(w_seq, dtype=torch.long, device=dev)
            self._w_pos = torch.tensor(w_pos, dtype=torch.long, device=dev)
            cache.valid[self._w_seq, self._w_pos] = True
        # keys visible to the batch: each slot's cells [0, L)
        self.L = L = max(cache.end[s] for s in self.slots)
        self._slot_span = (self.slots[0], self.slots[0] + B) if self.slots == list(range(self.slots[0], self.slots[0] + B)) else None
        self._slot_idx = None if self._slot_span else torch.tensor(self.slots, dtype=torch.long, device=dev)
        need_mask = B > 1 or T > 1 or not all(cache.dense[s] for s in self.slots)
        self.mask = None
        if need_mask:
            kpos = torch.arange(L, device=dev)
            valid = cache.valid[self._slot_span[0]:self._slot_span[1], :L] if self._slot_span else cache.valid[self._slot_idx, :L]
            keep = (kpos.view(1, 1, L) <= self.q_pos.view(B, T, 1)) & valid.view(B, 1, L)  # [B, T, L]
            # additive float mask (SDPA converts a bool one on every call), rows laid out as
            # _attention groups them: [B, 1, G*T, L] for T > 1, [B, 1, 1, L] for T == 1
            mask = torch.zeros(keep.shape, dtype=dtype, device=dev).masked_fill_(~keep, float("-inf"))
            self.mask = mask.unsqueeze(1) if T == 1 else mask.unsqueeze(1).repeat(1, 1, group, 1).view(B, 1, group * T, L)

    def write(self, store: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Write new K or V rows [B*T, Hkv, D] into `store` [n_seq, Hkv, max_ctx, D]; return [B, Hkv, L, D]."""
        if self._span is not None:
            s, a, b = self._span
            store[s, :, a:b] = new.transpose(0, 1)
        else:
            rows = new if self._real_rows is None else new[self._real_rows]
            store[self._w_seq, :, self._w_pos] = rows.to(store.dtype)
        if self._slot_span is not None:
            return store[self._slot_span[0]:self._slot_span[1], :, : self.L]
        return store[self._slot_idx, :, : self.L]

    def to_entries(self, x: torch.Tensor) -> torch.Tensor:
        """Padded rows [B*T, ...] -> entry order [n, ...]."""
        if self._row_of_entry is None:
            return x
        return x[torch.tensor(self._row_of_entry, device=x.device)]

    def padded_rows(self, entry_rows: Sequence[int] | None):
        """Padded-row indices of the given entries (None = all entries)."""
        if entry_rows is None:
            if self._row_of_entry is None:
                return None
            entry_rows = range(self.n)
        m = self._row_of_entry
        idx = list(entry_rows) if m is None else [m[i] for i in entry_rows]
        if m is None and idx == list(range(self.n)):
            return None
        return torch.tensor(idx, dtype=torch.long, device=self.q_pos.device)
