"""The building blocks of a decoder, public: the target is made of them, and so is every head.

A head plugin (MTP, Eagle3, DFlash, ...) builds its layers from these instead of writing its
own transformer block, and gets, for free, what the target has: the GGUF-block kernels on CPU
(batch-invariant, ~4x fewer bytes than float32), plain torch on CUDA, RoPE, and attention over
a multi-sequence KV cache with `seq_rm` rollback.

    backend = Backend.for_target(target_info)            # native kernels when the target uses them
    layer = DecoderLayer(qkv=backend.linear(w_qkv, norm_weight=attn_norm), o=backend.linear(w_o),
                         gate_up=backend.linear(w_gu, norm_weight=ffn_norm), down=backend.linear(w_down),
                         shape=LayerShape(n_head=9, n_head_kv=3, head_dim=64, n_ff=1536), eps=1e-5)
    cache = backend.new_cache(n_layer=1, n_seq=4, max_ctx=2048, n_head_kv=3, head_dim=64)
    rope = Rope(head_dim=64, base=10000.0, device=backend.device)
    step = Step(positions, seq_ids, cache, rope, backend)   # once per forward
    x = step.rows(x)                                     # entry order -> the layout layers use
    x = layer(x, step, 0)                                # layer 0 of `cache`
    y = step.entries(x)                                  # back to entry order

Rows are (token, position, sequence) entries; each row attends to its own sequence's valid cache
cells up to its position. `cache.seq_rm(seq, p0)` rolls a sequence back.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from specplug.runtime import native
from specplug.runtime.kv_cache import RING_SLACK, KVCache
from specplug.runtime.linear import DenseLinear, Int8Linear, rms_norm, take_rows
from specplug.runtime.native import QuantLinear

__all__ = ["Backend", "Linear", "LayerShape", "LayerKind", "DecoderLayer", "Rope", "Step", "StaticRows", "rms_norm",
           "KVCache"]


class Linear(Protocol):
    """y = x @ W.T (+ bias) (+ residual); `norm_linear(x, eps)` = linear(rms_norm(x) * norm_weight).

    What `Backend.linear_from_blocks` and `HeadFile.linear` return: on the gguf kernels the weight
    stays in its quantized blocks, on torch it is a float matrix."""

    out_features: int

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in_features] -> [rows, out_features]. `residual` [rows, out_features]: added to
        the product in the same call (a decoder layer's skip connection; the native kernels add it
        as they write the output); None adds nothing."""

    def norm_linear(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """linear(rms_norm(x, eps) * norm_weight), for a linear built with `norm_weight` (the RMSNorm
        before it folded into one call)."""


@dataclass(frozen=True)
class Backend:
    """Where and in which weight format layers compute.

    quant "gguf": the GGUF-block AVX2 kernels (CPU, float32 activations; weights Q8_0/Q4_1 blocks);
    "none": torch in `dtype` on `device`; "int8": fbgemm (CPU, the target's legacy option).
    """

    device: torch.device
    dtype: torch.dtype = torch.float32
    quant: str = "none"

    @property
    def native(self) -> bool:
        return self.quant == "gguf"

    @classmethod
    def for_target(cls, target) -> "Backend":
        """The backend a head should use next to this target (a TargetInfo): the GGUF kernels
        when the target runs on them, else torch on the target's device and dtype."""
        return cls(torch.device(target.device), target.dtype, "gguf" if target.quant == "gguf" else "none")

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
               norm_weight: torch.Tensor | None = None) -> Linear:
        """A linear from float weights [out, in] (quantized to Q8_0 on the native backend)."""
        if self.native:
            return QuantLinear.from_float(weight.float().cpu(), bias=bias, norm_weight=norm_weight)
        if self.quant == "int8":
            return Int8Linear(weight, bias, norm_weight)
        to = lambda t: None if t is None else t.to(self.device, self.dtype)  # noqa: E731
        return DenseLinear(to(weight), to(bias), to(norm_weight))

    def linear_from_blocks(self, raw: np.ndarray, qtype: str, shape: tuple[int, int],
                           bias: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None) -> Linear:
        """A linear from GGUF tensor bytes ([rows, bytes per row]) of type `qtype`: used as stored
        on the native backend when the kernels know the type, else dequantized."""
        if self.native and qtype in native.NATIVE_TYPES:
            return QuantLinear.from_blocks(raw, qtype, shape, bias=bias, norm_weight=norm_weight)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        w = dequantize(np.ascontiguousarray(raw), GGMLQuantizationType[qtype]).reshape(shape)
        return self.linear(torch.from_numpy(np.array(w, dtype=np.float32)), bias, norm_weight)

    def new_cache(self, n_layer: int, n_seq: int, max_ctx: int, n_head_kv: int, head_dim: int,
                  dtype: torch.dtype | None = None, spare: int = 0, windows: Sequence[int] | None = None,
                  slack: int = RING_SLACK) -> KVCache:
        """A KV cache these layers can use. Default dtype: float16 on the native kernels (they store
        keys and values rounded to float16 and widen them as they read: half the memory and the
        bytes attention reads; every row sees the same rounded values, so batch invariance holds),
        float32 for torch on CPU, the model dtype elsewhere. `windows`: each layer's sliding window
        (0: none); those layers keep a ring of the window plus `slack` cells (KVCache)."""
        if dtype is None:
            dtype = torch.float16 if self.native else (torch.float32 if self.device.type == "cpu" else self.dtype)
        if self.native and dtype not in (torch.float16, torch.float32):
            raise ValueError(f"the native kernels keep K/V in float16 or float32, not {dtype}")
        return KVCache(n_layer, n_seq, max_ctx, n_head_kv, head_dim, dtype, self.device, spare, windows, slack)


class Rope:
    """Rotary position tables for interleaved pairs (2i, 2i+1), grown on demand. `scale`: linear
    scaling (position p turns like p * scale; llama.cpp's freq_scale)."""

    def __init__(self, head_dim: int, base: float, device: torch.device | str = "cpu", scale: float = 1.0):
        inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim) * scale
        self.inv_freq = inv.float()
        self.device = torch.device(device)
        self._table = torch.empty(0, head_dim // 2, dtype=torch.complex64, device=self.device)
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def table(self, n: int) -> torch.Tensor:
        """Complex rotations [>= n, head_dim / 2], row p for position p."""
        if self._table.shape[0] < n:
            n = max(n, 2 * self._table.shape[0], 256)
            ang = torch.outer(torch.arange(n, dtype=torch.float32), self.inv_freq)
            self._table = torch.polar(torch.ones_like(ang), ang).to(self.device)
        return self._table

    def cos_sin(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) tables [>= n, head_dim / 2] (float32) for the native kernels."""
        if self._cos_sin is None or self._cos_sin[0].shape[0] < n:
            t = self.table(n)
            self._cos_sin = (t.real.contiguous(), t.imag.contiguous())
        return self._cos_sin


def note_batch(positions: list[int], seq_ids: list[int], cache: KVCache) -> dict[int, list[int]]:
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


def note_rows(positions: Sequence[int], seq_ids: Sequence[int], cache: KVCache) -> tuple[list[int], list[int]]:
    """A native forward's rows checked against the cache and recorded in it (their cells marked valid):
    what `Step` does for the native kernels, for a caller that passes the rows itself (`PairStep`).
    Returns (positions, seq_ids) as lists of ints."""
    positions = [int(p) for p in positions]
    seq_ids = [int(s) for s in seq_ids]
    assert len(positions) == len(seq_ids) and positions, (len(positions), len(seq_ids))
    note_batch(positions, seq_ids, cache)
    cache.mark(seq_ids, positions)
    return positions, seq_ids


class Step:
    """One forward's rows (position, sequence) against one KV cache: checked, recorded in the
    cache's bookkeeping, and laid out for attention. Build it once per forward; every layer
    (of any model sharing `cache`) uses it.

    Native backend: rows stay in entry order, one row each, no padding. Torch backend: the
    rows of each sequence are padded to [B sequences x T tokens] for SDPA; `rows(x)` and
    `entries(x)` convert between entry order and that layout.
    """

    def __init__(self, positions: Sequence[int], seq_ids: Sequence[int], cache: KVCache, rope: Rope,
                 backend: Backend, limits: Sequence[int] | None = None):
        """limits: per row, the last position it attends to (default: its own position, causal);
        a block drafter passes its block's last position so attention is bidirectional inside it."""
        positions = [int(p) for p in positions]
        seq_ids = [int(s) for s in seq_ids]
        n = len(positions)
        assert n == len(seq_ids) and n > 0, (n, len(seq_ids))
        assert limits is None or (len(limits) == n and all(int(a) >= p for a, p in zip(limits, positions))), limits
        self.n = n
        self.cache = cache
        self.native = backend.native
        self._rope = rope
        self._rotations: dict[int, torch.Tensor] = {}  # id(rope) -> [B*T, 1, D/2] complex (torch backend)
        if self.native:
            if cache.dtype not in (torch.float16, torch.float32) or cache.device.type != "cpu":
                raise ValueError("the native kernels need a float16 or float32 CPU cache "
                                 "(make it with Backend.new_cache)")
            note_rows(positions, seq_ids, cache)
            self.positions, self.seq_ids = positions, seq_ids  # (the all-layers call takes them as lists)
            self.cos, self.sin = rope.cos_sin(cache.max_ctx)
            self.limit = None if limits is None else torch.tensor([int(x) for x in limits], dtype=torch.int32)
            self.plan = None
        else:
            self.plan = _Plan(positions, seq_ids, cache, cache.device, backend.dtype, limits)
            self.rope = self.rotation(rope)

    # The rows' sequences and positions as int32 tensors for the native kernels, made when first
    # asked for: a small tensor made from Python costs ~65 us after a forward has evicted the
    # interpreter's caches, and the all-layers call (Transformer._forward_tokens) takes lists.
    @functools.cached_property
    def seq(self) -> torch.Tensor:
        return torch.tensor(self.seq_ids, dtype=torch.int32)

    @functools.cached_property
    def pos(self) -> torch.Tensor:
        return torch.tensor(self.positions, dtype=torch.int32)

    def tables(self, rope: Rope | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of `rope` (default: the step's) for the native kernels (a layer with its own RoPE base)."""
        if rope is None or rope is self._rope:
            return self.cos, self.sin
        return rope.cos_sin(self.cache.max_ctx)

    def rotation(self, rope: Rope) -> torch.Tensor:
        """The rows' rotations by `rope` [B*T, 1, D/2] complex (torch backend), made once per step."""
        r = self._rotations.get(id(rope))
        if r is None:
            r = self._rotations[id(rope)] = rope.table(self.cache.max_ctx)[self.plan.q_pos].unsqueeze(1)
        return r

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """Entry-order rows [n, ...] -> the layout the layers compute in."""
        if self.plan is None or self.plan.gather is None:
            return x
        return take_rows(x, self.plan.gather)

    def entries(self, x: torch.Tensor) -> torch.Tensor:
        """Layer-layout rows -> entry order [n, ...]."""
        return x if self.plan is None else self.plan.to_entries(x)

    def select(self, x: torch.Tensor, entry_rows: Sequence[int] | None) -> torch.Tensor:
        """The layer-layout rows of the given entries (None = all entries, in entry order)."""
        if self.plan is None:
            if entry_rows is None or list(entry_rows) == list(range(self.n)):
                return x
            return take_rows(x, entry_rows)
        rows = self.plan.padded_rows(entry_rows)
        return x if rows is None else take_rows(x, rows)

    def rotate(self, x: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        """RoPE on per-head rows [rows, heads, head_dim] (interleaved pairs) at the rows' positions (float32),
        by the step's rope or the given one."""
        rot = self.rope if rope is None else self.rotation(rope)
        return torch.view_as_real(torch.view_as_complex(x.float().unflatten(2, (x.shape[2] // 2, 2))) * rot).flatten(2)

    def store(self, li: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write rotated keys and values [rows, n_head_kv, head_dim] into layer `li` of the cache."""
        self.plan.write(self.cache.k[li], k)
        self.plan.write(self.cache.v[li], v)

    def attend(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, H: int, Hkv: int, D: int,
               window: int = 0, scale: float | None = None) -> torch.Tensor:
        """Store the rows' k/v [rows, Hkv, D] in layer `li`, then attend with q [rows, H, D] -> [rows, H*D]
        (window > 0: only the last `window` positions up to each row's own; scale: default 1/sqrt(D))."""
        plan, cache = self.plan, self.cache
        if window:
            kc, vc = plan.write_window(cache.k[li], k, window), plan.write_window(cache.v[li], v, window)
            mask = plan.window_mask(H // Hkv, window)
        else:
            kc, vc, mask = plan.write(cache.k[li], k), plan.write(cache.v[li], v), plan.mask_for(H // Hkv)
        return _attention(q, kc.to(q.dtype), vc.to(q.dtype), mask, plan.B, plan.T, H, Hkv, D, scale)


class StaticRows:
    """One forward's rows as device tensors of a fixed shape: the step a compiled graph (and a
    CUDA graph) is made of. Duck-types Step for DecoderLayer on the torch backend.

    Rows are laid out as [B slots x T tokens] (row r = b * T + t): `slots` [B] the cache slot each
    group reads, `pos`/`limit` [B*T] each row's position and the last position it attends to
    (its own, causal; a block drafter's block end), `wslot`/`wpos` [B*T] the cell each row's K/V
    are written to. Every row attends to cells [0, L) of its group's slot that are valid and <= its
    limit; the G = H/Hkv query heads of a kv head and the T rows of a slot are the query rows of one
    attention, so each slot's keys are read once per step, not once per row. Padding rows (of a
    short group, or of a padding group reading the spare slot) write a spare slot of the cache
    (KVCache(..., spare=1)) and never touch a sequence. B, T and L are the graph's shape, the rest
    is data. Use it inside a function compiled with torch.compile(fullgraph=True).
    """

    native = False
    plan = None

    def __init__(self, slots: torch.Tensor, pos: torch.Tensor, limit: torch.Tensor, wslot: torch.Tensor,
                 wpos: torch.Tensor, L: int, cache: KVCache, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype,
                 group: int, kv: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None):
        """cos/sin: Rope.cos_sin tables on the cache's device; dtype: the dtype attention computes in;
        group: query heads per kv head (n_head / n_head_kv) of the layers that will use the step;
        kv: each layer's (K, V), passed into a compiled function as inputs of their own (a write
        through `cache.k[li]` there makes the compiler copy the whole cache tensor)."""
        self.slots, self.wslot, self.wpos, self.L, self.cache = slots, wslot, wpos, L, cache
        self.B, self.n = slots.shape[0], pos.shape[0]
        self.T = self.n // self.B
        self.cos, self.sin = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)  # [B*T, 1, D/2]
        cache.valid.index_put_((wslot, wpos), torch.ones_like(wpos, dtype=torch.bool))
        B, T = self.B, self.T
        keep = (torch.arange(L, device=pos.device).view(1, 1, L) <= limit.view(B, T, 1)) & \
            cache.valid[slots, :L].view(B, 1, L)  # [B, T, L]
        # finite "minus infinity": a padding row with nothing to attend to gets finite junk, not NaN;
        # for a real row exp(min - max) is exactly 0, as with -inf
        mask = torch.zeros(keep.shape, dtype=dtype, device=pos.device).masked_fill_(~keep, torch.finfo(dtype).min)
        # [B, 1, G*T, L]: rows ordered (g, t) as `attend` groups the queries
        self.mask = mask.unsqueeze(1).expand(B, group, T, L).reshape(B, 1, group * T, L)
        self.group = group
        self.kv = kv
        self.kc = self.vc = None

    def at(self, li: int) -> "StaticRows":
        """This step bound to layer `li`'s K/V (its `attend`/`store` then ignore `li`): a layer
        compiled once then serves every layer, since no layer index is baked into its graph.
        It rebinds this step and returns it (layers run one after another); no copy, because
        torch 2.11's compiler refuses to trace `copy.copy`."""
        self.kc, self.vc = self._layer_kv(li)
        return self

    def _kv(self, li: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.kc, self.vc) if self.kc is not None else self._layer_kv(li)

    def _layer_kv(self, li: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[li] if self.kv is not None else (self.cache.k[li], self.cache.v[li])

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def entries(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def select(self, x: torch.Tensor, entry_rows=None) -> torch.Tensor:
        return x  # every row: the caller picks rows outside the graph

    def rotate(self, x: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        """RoPE with real arithmetic (complex tensors do not compile everywhere); the step's own only."""
        assert rope is None, "the static step has one RoPE"
        x = x.float().unflatten(2, (x.shape[2] // 2, 2))
        a, b = x[..., 0], x[..., 1]
        return torch.stack((a * self.cos - b * self.sin, a * self.sin + b * self.cos), -1).flatten(2)

    def store(self, li: int, k: torch.Tensor, v: torch.Tensor) -> None:
        kc, vc = self._kv(li)
        # [slots, Hkv, max_ctx, D] seen as [slots, max_ctx, Hkv, D]: (slot, cell) picks a row's [Hkv, D]
        kc.transpose(1, 2).index_put_((self.wslot, self.wpos), k.to(kc.dtype))
        vc.transpose(1, 2).index_put_((self.wslot, self.wpos), v.to(vc.dtype))

    def attend(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, H: int, Hkv: int, D: int,
               window: int = 0, scale: float | None = None) -> torch.Tensor:
        assert not window and scale is None, "the static step has no sliding windows or attention scales"
        self.store(li, k, v)
        B, T, L = self.B, self.T, self.L
        G = H // Hkv
        assert G == self.group, (G, self.group)
        kc, vc = self._kv(li)
        kc = kc[:, :, :L][self.slots].to(q.dtype)  # [B, Hkv, L, D]
        vc = vc[:, :, :L][self.slots].to(q.dtype)
        qg = q.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
        o = F.scaled_dot_product_attention(qg, kc, vc, attn_mask=self.mask)  # [B, Hkv, G*T, D]
        return o.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B * T, H * D)


@dataclass(frozen=True)
class LayerShape:
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int


@dataclass(frozen=True)
class LayerKind:
    """What a layer does beyond a llama layer (the defaults): Gemma 3's sliding window, its own RoPE
    (the global layers' base differs from the local ones'), RMSNorms on the attention and MLP outputs
    before each residual add, GeGLU with the tanh GELU, and the attention scale."""

    window: int = 0  # attend to the last `window` positions only (0: all)
    rope: Rope | None = None  # None: the step's
    post_attn_norm: torch.Tensor | None = None  # [n_embd]: x + norm(attn) in place of x + attn
    post_ffn_norm: torch.Tensor | None = None  # [n_embd]
    gelu: bool = False  # gelu_tanh(gate) * up in place of silu(gate) * up
    scale: float | None = None  # q.k scale; None: 1/sqrt(head_dim)


class DecoderLayer:
    """A llama decoder layer: x + attn(norm(x)), then + SwiGLU(norm(x)); a Gemma 3 one with `kind`.

    `qkv` maps the attention input to [q | k | v] (rows of q and k in interleaved RoPE order);
    with `norm_weight` folded in (`norm_linear`) it normalizes the residual stream itself. A
    head whose attention input is something else (Eagle3: [norm(embed); norm(h)]) passes
    `attn_in` and builds `qkv` without a norm weight. `gate_up` = [gate | up] with the FFN
    norm folded in. q_norm/k_norm: per-head RMSNorm (qwen3, gemma3).
    """

    def __init__(self, qkv: Linear, o: Linear, gate_up: Linear, down: Linear, shape: LayerShape, eps: float,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 kind: LayerKind = LayerKind()):
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.shape, self.eps = shape, eps
        self.q_norm, self.k_norm = q_norm, k_norm
        self.kind = kind
        self.scale = kind.scale or shape.head_dim ** -0.5
        self._fused = None  # all four linears on the native kernels: the whole layer is one native call
        if isinstance(qkv, QuantLinear):
            self._k = native.kernels()
            if all(isinstance(m, QuantLinear) for m in (o, gate_up, down)) and qkv.norm_weight is not None \
                    and gate_up.norm_weight is not None:
                self._fused = tuple(v for m in self.linears() for v in m.packed())
                e = torch.empty(0)
                self._post = (kind.post_attn_norm.float().contiguous() if kind.post_attn_norm is not None else e,
                              kind.post_ffn_norm.float().contiguous() if kind.post_ffn_norm is not None else e)
        self.fused = True  # False: one native call per kernel (the profiler times them apart)

    def linears(self) -> tuple[Linear, Linear, Linear, Linear]:
        """qkv, o, gate_up, down."""
        return self.qkv, self.o, self.gate_up, self.down

    def _own_args(self) -> tuple:
        """The arguments of the kernels' `layer_forward` that belong to the layer, not to a call
        (`_fused` set): what `LayerStack.add` takes, less the index of the RoPE table."""
        S, kind = self.shape, self.kind
        return (*self._fused, self.q_norm, self.k_norm, self.eps, S.n_head, S.n_head_kv, self.scale, kind.window,
                *self._post, kind.gelu)

    def stack_args(self, rope: int) -> tuple:
        """The arguments of the kernels' `LayerStack.add` for this layer, one native call (`_fused`
        set); `rope`: which of a call's RoPE tables it uses."""
        return (*self._own_args(), rope)

    def __call__(self, x: torch.Tensor, step: Step, li: int, attn_in: torch.Tensor | None = None) -> torch.Tensor:
        """The layer on residual rows x [rows, n_embd], writing K/V into layer `li` of step.cache."""
        if attn_in is None and step.native and self._fused is not None and self.fused:
            cache = step.cache
            cos, sin = step.tables(self.kind.rope)
            return self._k.layer_forward(x.contiguous(), *self._own_args(), cache.k[li], cache.v[li], step.seq,
                                         step.pos, cache.valid, cos, sin, step.limit)
        return self.ffn(self.attention(x, step, li, attn_in))

    def _residual(self, y: torch.Tensor, x: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
        """x + rms_norm(y) * norm (Gemma's post norms); on the native kernels, their row kernel."""
        if isinstance(self.qkv, QuantLinear):  # the native kernels' layer
            return self._k.rms_norm_add(y.contiguous(), norm.float().contiguous(), self.eps, x.contiguous())
        return x + rms_norm(y, norm, self.eps)

    def attention(self, x: torch.Tensor, step: Step, li: int, attn_in: torch.Tensor | None = None) -> torch.Tensor:
        """x + o(attention): qkv of norm(x) (or of `attn_in` as given), K/V stored at the rows' cells."""
        S, kind = self.shape, self.kind
        H, Hkv, D = S.n_head, S.n_head_kv, S.head_dim
        qkv = self.qkv.norm_linear(x, self.eps) if attn_in is None else self.qkv(attn_in)
        cache = step.cache
        post = kind.post_attn_norm
        if step.native:
            k = self._k
            kc, vc = cache.k[li], cache.v[li]
            cos, sin = step.tables(kind.rope)
            k.rope_store(qkv, step.seq, step.pos, cos, sin, H, Hkv, self.q_norm, self.k_norm, self.eps, kc, vc)
            a = k.attention(qkv, kc, vc, step.seq, step.pos, cache.valid, H, self.scale, step.limit, kind.window)
            return self.o(a, residual=x) if post is None else self._residual(self.o(a), x, post)
        qk = qkv[:, : (H + Hkv) * D].unflatten(1, (H + Hkv, D))
        if self.q_norm is not None:
            qk = torch.cat([rms_norm(qk[:, :H], self.q_norm, self.eps), rms_norm(qk[:, H:], self.k_norm, self.eps)], 1)
        qk = step.rotate(qk, kind.rope).to(x.dtype)
        v = qkv[:, (H + Hkv) * D:].unflatten(1, (Hkv, D))
        if kind.window or kind.scale is not None:
            a = step.attend(li, qk[:, :H], qk[:, H:], v, H, Hkv, D, kind.window, self.scale)
        else:
            a = step.attend(li, qk[:, :H], qk[:, H:], v, H, Hkv, D)
        return self.o(a, residual=x) if post is None else self._residual(self.o(a), x, post)

    def store_kv(self, x: torch.Tensor, step: Step, li: int) -> None:
        """Write the keys and values of rows x (normalized by the layer's attention norm) into layer
        `li` of step.cache at the rows' cells, without attending: how a drafter injects context
        (DFlash's target features) that later rows attend to."""
        S = self.shape
        H, Hkv, D = S.n_head, S.n_head_kv, S.head_dim
        qkv = self.qkv.norm_linear(x, self.eps)
        cache = step.cache
        if step.native:
            cos, sin = step.tables(self.kind.rope)
            self._k.rope_store(qkv, step.seq, step.pos, cos, sin, H, Hkv, self.q_norm, self.k_norm,
                               self.eps, cache.k[li], cache.v[li])
            return
        k = qkv[:, H * D:(H + Hkv) * D].unflatten(1, (Hkv, D))
        if self.k_norm is not None:
            k = rms_norm(k, self.k_norm, self.eps)
        step.store(li, step.rotate(k, self.kind.rope).to(x.dtype), qkv[:, (H + Hkv) * D:].unflatten(1, (Hkv, D)))

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        """x + down(silu(gate(norm(x))) * up(norm(x))) (GeGLU and a post norm as `kind` says)."""
        gu = self.gate_up.norm_linear(x, self.eps)
        kind = self.kind
        if isinstance(self.down, QuantLinear):
            act = self._k.gelu_mul_quantize(gu) if kind.gelu else self._k.silu_mul_quantize(gu)
            if kind.post_ffn_norm is None:
                return self.down.matmul(act, residual=x)
            return self._residual(self.down.matmul(act), x, kind.post_ffn_norm)
        n_ff = self.shape.n_ff
        g = F.gelu(gu[:, :n_ff], approximate="tanh") if kind.gelu else F.silu(gu[:, :n_ff])
        if kind.post_ffn_norm is None:
            return self.down(g * gu[:, n_ff:], residual=x)
        return self._residual(self.down(g * gu[:, n_ff:]), x, kind.post_ffn_norm)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               B: int, T: int, H: int, Hkv: int, D: int, scale: float | None = None) -> torch.Tensor:
    """q [B*T, H, D], k/v [B, Hkv, L, D] -> [B*T, H*D] (scale None: SDPA's 1/sqrt(D)).

    With several query rows, the G = H/Hkv query heads sharing a kv head become rows of one
    attention per kv head ([B, Hkv, G*T, D]): no K/V repetition and fewer, larger kernels.
    """
    if T == 1:
        o = F.scaled_dot_product_attention(q.unflatten(0, (B, 1)).transpose(1, 2), k, v, attn_mask=mask,
                                           enable_gqa=Hkv != H, scale=scale)  # [B, H, 1, D]
        return o.reshape(B, H * D)
    G = H // Hkv
    qg = q.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # [B, Hkv, G*T, D]
    return o.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B * T, H * D)


class _Plan:
    """How a batch of entries maps onto a padded [B sequences, T tokens] layout and the cache.

    Computed once per forward in Python (the batch is small), used by every layer.
    """

    def __init__(self, positions: list[int], seq_ids: list[int], cache: KVCache, dev: torch.device,
                 dtype: torch.dtype = torch.float32, limits: Sequence[int] | None = None):
        groups = note_batch(positions, seq_ids, cache)
        self.cache, self._limits = cache, limits
        self.slots = list(groups)
        self._first_pos = [min(positions[i] for i in g) for g in groups.values()]  # per slot: its lowest row
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
            if limits is not None:
                limits = [limits[e] for e in order]
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
        first = self.slots[0]
        self._slot_span = (first, first + B) if self.slots == list(range(first, first + B)) else None
        self._slot_idx = None if self._slot_span else torch.tensor(self.slots, dtype=torch.long, device=dev)
        need_mask = B > 1 or T > 1 or not all(cache.dense[s] for s in self.slots) or limits is not None
        self._mask: torch.Tensor | None = None  # [B, T, L] additive; None: no mask needed
        if need_mask:
            kpos = torch.arange(L, device=dev)
            if self._slot_span:
                valid = cache.valid[self._slot_span[0]:self._slot_span[1], :L]
            else:
                valid = cache.valid[self._slot_idx, :L]
            lim = self.q_pos if limits is None else torch.tensor([int(x) for x in limits], dtype=torch.long, device=dev)
            keep = (kpos.view(1, 1, L) <= lim.view(B, T, 1)) & valid.view(B, 1, L)  # [B, T, L]
            # additive float mask (SDPA converts a bool one on every call), rows laid out as
            # _attention groups them: [B, 1, G*T, L] for T > 1, [B, 1, 1, L] for T == 1
            self._mask = torch.zeros(keep.shape, dtype=dtype, device=dev).masked_fill_(~keep, float("-inf"))
            self._grouped: dict[int, torch.Tensor] = {}
        self.dtype, self.dev = dtype, dev
        self._windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # window -> (cells [B, Lw], mask [B, T, Lw])
        self._window_masks: dict[tuple[int, int], torch.Tensor] = {}

    def _window(self, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For layers with a sliding window: per slot the cells of the positions its rows can see
        ([B, Lw], position lo_b + j in cell (lo_b + j) % cells, lo_b = the window start of the slot's
        lowest row) and the additive mask [B, T, Lw] (causal, inside each row's window, valid)."""
        got = self._windows.get(window)
        if got is not None:
            return got
        cache, dev, B, T = self.cache, self.dev, self.B, self.T
        lo = torch.tensor([max(0, p - window + 1) for p in self._first_pos], dtype=torch.long, device=dev)
        hi = torch.tensor([cache.end[s] for s in self.slots], dtype=torch.long, device=dev)  # one past the last
        Lw = int((hi - lo).max())
        kp = lo.view(B, 1) + torch.arange(Lw, device=dev).view(1, Lw)  # [B, Lw] positions
        inside = kp < hi.view(B, 1)
        kp = torch.where(inside, kp, lo.view(B, 1))  # past the end: any real cell, masked below
        slots = torch.tensor(self.slots, dtype=torch.long, device=dev)
        q = self.q_pos.view(B, T, 1)
        lim = q if self._limits is None else \
            torch.tensor([int(x) for x in self._limits], dtype=torch.long, device=dev).view(B, T, 1)
        keep = (kp.view(B, 1, Lw) <= lim) & (kp.view(B, 1, Lw) > q - window) & \
            (inside & cache.valid[slots.view(B, 1), kp]).view(B, 1, Lw)
        mask = torch.zeros(keep.shape, dtype=self.dtype, device=dev).masked_fill_(~keep, float("-inf"))
        self._windows[window] = got = (kp, mask)
        return got

    def write_window(self, store: torch.Tensor, new: torch.Tensor, window: int) -> torch.Tensor:
        """Write new K or V rows [B*T, Hkv, D] into `store` [n_seq, Hkv, cells, D] (a ring when cells <
        max_ctx), then return the keys the rows' windows can see [B, Hkv, Lw, D]."""
        ncell = store.shape[2]
        rows = new if self._real_rows is None else new[self._real_rows]
        w_seq, w_pos = self._writes()
        store[w_seq, :, w_pos % ncell] = rows.to(store.dtype)
        kp, _ = self._window(window)
        slots = torch.tensor(self.slots, dtype=torch.long, device=self.dev)
        return store[slots.view(-1, 1), :, kp % ncell].transpose(1, 2)  # [B, Lw, Hkv, D] -> [B, Hkv, Lw, D]

    def window_mask(self, group: int, window: int) -> torch.Tensor:
        """window's mask laid out as _attention groups rows (see mask_for)."""
        m = self._window_masks.get((group, window))
        if m is None:
            mask = self._window(window)[1]
            B, T, L = mask.shape
            m = mask.unsqueeze(1) if T == 1 else mask.unsqueeze(1).repeat(1, 1, group, 1).view(B, 1, group * T, L)
            self._window_masks[(group, window)] = m
        return m

    def _writes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence, position) of each real row, as long tensors."""
        if self._span is not None:
            s, a, b = self._span
            return (torch.full((b - a,), s, dtype=torch.long, device=self.dev),
                    torch.arange(a, b, dtype=torch.long, device=self.dev))
        return self._w_seq, self._w_pos

    def mask_for(self, group: int) -> torch.Tensor | None:
        """The additive mask laid out as _attention groups rows: [B, 1, G*T, L] (T > 1), [B, 1, 1, L]
        (T == 1); made once per forward and group size, shared by every layer."""
        if self._mask is None:
            return None
        m = self._grouped.get(group)
        if m is None:
            B, T, L = self._mask.shape
            m = self._mask.unsqueeze(1) if T == 1 else \
                self._mask.unsqueeze(1).repeat(1, 1, group, 1).view(B, 1, group * T, L)
            self._grouped[group] = m
        return m

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
        return take_rows(x, self._row_of_entry)

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
