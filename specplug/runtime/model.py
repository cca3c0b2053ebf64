"""The target model: a llama-family (llama, qwen2, qwen3) or Gemma 3 transformer, run over batches
of (token, position, sequence) entries against a multi-sequence KV cache.

One forward serves prompt chunks, single-token decoding and k-token verification of many
sequences at once. The caller chooses which rows get logits and which hidden states are
tapped; nothing is computed or copied for rows and taps nobody asked for.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from specplug.errors import ModelError
from specplug.runtime import native, pages
from specplug.runtime.gguf_file import GGUFFile, ModelConfig
from specplug.runtime.kv_cache import RING_SLACK, KVCache
from specplug.runtime.layers import Backend, DecoderLayer, LayerKind, LayerShape, Linear, Rope, Step
from specplug.runtime.linear import int8_available
from specplug.runtime.static import StaticOptions, StaticRunner

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTS = ("auto", "none", "int8", "gguf")

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
    native.check_isa_env()  # a wrong SPECPLUG_ISA is the user's to fix, not a reason to fall back
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
    # tap -> [n_entries, n_embd] float32; tap i = input of layer i, n_layer = pre-norm final
    hidden: dict[int, torch.Tensor]


def _neox_to_interleaved(w: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Reorder Q/K rows so RoPE pairs (i, i+d/2) become (2i, 2i+1); q.k is unchanged."""
    perm = torch.stack([torch.arange(head_dim // 2), torch.arange(head_dim // 2) + head_dim // 2], -1).flatten()
    return w.reshape(n_heads, head_dim, *w.shape[1:])[:, perm].reshape(w.shape)


class OutputHead:
    """The target's output norm and vocabulary projection, shared with heads that reuse them
    (MTP, DFlash): logits over the whole vocabulary or over a subset of its rows (a head that
    drafts from the most frequent tokens pays for those rows only)."""

    def __init__(self, gguf: GGUFFile, name: str, norm_weight: torch.Tensor, eps: float, backend: Backend,
                 full: Linear):
        self._gguf, self._name = gguf, name
        self.norm_weight = norm_weight  # [n_embd] float32, CPU
        self.eps = eps
        self.backend = backend
        self.full = full  # the target's own head: norm_linear(x) -> logits [rows, vocab]

    def linear(self, rows: Sequence[int] | None = None, backend: Backend | None = None,
               norm_weight: torch.Tensor | None = None) -> Linear:
        """A linear with the output norm folded in (`norm_linear(x, eps)` -> logits) over the given
        vocabulary rows (None = all), in the target's weight format unless `backend` says otherwise.
        `norm_weight`: a head's own final norm in place of the target's."""
        backend = backend or self.backend
        if rows is None and backend == self.backend and norm_weight is None:
            return self.full
        raw, qtype, shape = self._gguf.raw(self._name)
        if rows is not None:
            idx = np.asarray(list(rows), dtype=np.int64)
            raw, shape = raw[idx], (len(idx), shape[1])
        nw = self.norm_weight if norm_weight is None else norm_weight.float().cpu()
        return backend.linear_from_blocks(raw, qtype, shape, norm_weight=nw)

    def weight(self, rows: Sequence[int] | None = None) -> torch.Tensor:
        """The projection's float32 weights [len(rows) or vocab, n_embd] (for training a head)."""
        w = torch.from_numpy(self._gguf.tensor(self._name))
        return w if rows is None else w[torch.as_tensor(list(rows), dtype=torch.long)]


# GGML type ids of the embedding tables the kernels gather from (`embed_rows`)
EMBED_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 8}


def embed_blocks(raw: np.ndarray, qtype: str) -> torch.Tensor:
    """A table's blocks as the [vocab, bytes per row] uint8 tensor the kernels read (no copy)."""
    with warnings.catch_warnings():  # a read-only memory map: the kernels only read it
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(np.asarray(raw))
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


class TokenEmbeddings:
    """The token embedding table as stored in the file, indexed like a [vocab, n_embd] tensor.

    `table[ids]` (ids: an int, a list or a long tensor of any shape) gathers the asked-for rows
    and dequantizes just those: exactly the float values a dequantized copy of the whole table
    holds, without the copy (49k x 576 float32 = 113 MB for SmolLM2, against the 30 MB of
    Q8_0 blocks that stay in the memory-mapped file). Rows come back in `dtype` on `device`.
    `dense()` (or `.to(...)`, `.float()`) makes the whole float table, for code that needs it.
    """

    def __init__(self, raw: np.ndarray, qtype: str, shape: tuple[int, int], device: torch.device,
                 dtype: torch.dtype, kernels=None):
        self._raw, self._qtype = raw, qtype  # [vocab, bytes per row], the file's own blocks
        self.shape = torch.Size(shape)
        self.device, self.dtype = device, dtype
        # the gguf kernels' gather where they are loaded and read this type (the same values as
        # gguf's dequantizer, tests/test_native.py; 1 us a step against its 34 us of numpy)
        self._gather = None
        if kernels is not None and qtype in EMBED_TYPES:
            self._gather = (kernels, embed_blocks(raw, qtype), EMBED_TYPES[qtype])

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, ids) -> torch.Tensor:
        idx = torch.as_tensor(ids, dtype=torch.long).cpu()
        flat = idx.reshape(-1).numpy()
        if len(flat) and (flat.min() < -self.shape[0] or flat.max() >= self.shape[0]):
            raise IndexError(f"token id out of range for an embedding table of {self.shape[0]} rows")
        if self._gather is not None:
            k, table, type_id = self._gather
            ids = torch.from_numpy(np.where(flat < 0, flat + self.shape[0], flat).astype(np.int64))
            rows = k.embed_rows(table, type_id, ids, self.shape[1])
        else:
            rows = self._rows(np.ascontiguousarray(self._raw[flat]))
        return rows.reshape(*idx.shape, self.shape[1]).to(self.device, self.dtype)

    def _rows(self, raw: np.ndarray) -> torch.Tensor:
        """Raw rows -> float32, by the same dequantizer that makes the full table (GGUFFile.tensor)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        return torch.from_numpy(np.asarray(dequantize(raw, GGMLQuantizationType[self._qtype]), dtype=np.float32)
                                .reshape(raw.shape[0], self.shape[1]))

    def dense(self) -> torch.Tensor:
        """The whole table as a float tensor [vocab, n_embd] in `dtype` on `device`."""
        return self[torch.arange(self.shape[0])]

    def to(self, *args, **kwargs) -> torch.Tensor:
        return self.dense().to(*args, **kwargs)

    def float(self) -> torch.Tensor:
        return self.dense().float()


class Transformer:
    """A llama/qwen2/qwen3/gemma3 decoder loaded from GGUF. Use `Transformer.load(path, ...)`."""

    def __init__(self, gguf: GGUFFile, device: torch.device, dtype: torch.dtype, quant: str):
        self.config = cfg = gguf.config
        self.path = gguf.path
        pages.enabled()  # a wrong SPECPLUG_HUGE_PAGES is one clear error before anything loads
        self.device, self.dtype = device, dtype
        if quant == "auto":
            quant = _auto_quant(gguf, device, dtype)
        if quant == "int8" and (device.type != "cpu" or dtype != torch.float32 or not int8_available()):
            raise ModelError("quant: int8 needs device: cpu and dtype: float32 on an x86 torch build with fbgemm")
        if quant == "gguf":
            problem = _gguf_problem(cfg, device, dtype)
            if problem:
                raise ModelError(f"{gguf.path}: quant: gguf is not possible here: {problem} (use quant: none)")
            native.kernels()
        self.quant = quant
        self.isa = native.chosen_isa() if quant == "gguf" else None  # the kernels' instruction-set path
        self.backend = backend = Backend(device, dtype, quant)
        self.governor = None  # a ThreadGovernor under `threads: auto` (specplug.runtime.governor)
        self.static = None  # a StaticRunner once use_static() is called (specplug.runtime.static)
        self._stack = None  # (kernels module, its LayerStack of the layers, their RoPEs, ids to logits): _layer_stack
        self._stacks: dict[Any, tuple] = {}  # every kernels module's, kept
        self._stack_tokens = False  # the stack also embeds and applies the head (forward_tokens)

        def t(name: str) -> torch.Tensor:
            return torch.from_numpy(gguf.tensor(name))

        def lin(names: list[str], heads: list[int | None] | None = None, b: torch.Tensor | None = None,
                norm: torch.Tensor | None = None) -> Linear:
            """The named tensors stacked by rows; heads[i]: neox-permute part i. On the native backend
            the types the kernels know (native.NATIVE_TYPES) are computed as stored when all parts share
            one; Q5_0 or Q4_0 beside Q8_0 runs as Q8_0 of the same weights (native.common_blocks); other mixes
            (Q4_K beside Q6_K) and other types become Q8_0."""
            heads = heads or [None] * len(names)
            if backend.native:
                # in blocks that stack: a Q4_K_M file's Q5_0 q/k with its Q8_0 v as Q8_0
                raw_parts = [gguf.raw(n) for n in names]
                blocks = native.common_blocks([(np.asarray(r), qt) for r, qt, _ in raw_parts])
                parts = [(r, qt, sh) for (r, qt), (_, _, sh) in zip(blocks, raw_parts)]
                types = {qt for _, qt, _ in parts}
                if len(types) == 1 and types <= set(native.NATIVE_TYPES):
                    rows = [torch.from_numpy(np.array(r)) for r, _, _ in parts]
                    rows = [r if h is None else _neox_to_interleaved(r, h, cfg.head_dim) for r, h in zip(rows, heads)]
                    raw = torch.cat(rows).numpy()
                    return backend.linear_from_blocks(raw, types.pop(), (raw.shape[0], parts[0][2][1]), b, norm)
            ws = [t(n) for n in names]
            ws = [w if h is None else _neox_to_interleaved(w, h, cfg.head_dim) for w, h in zip(ws, heads)]
            return backend.linear(torch.cat(ws), b, norm)

        def vec(w: torch.Tensor) -> torch.Tensor:
            return w.to(device, dtype)

        H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
        shape = LayerShape(H, Hkv, D, cfg.n_ff)
        self.rope = Rope(D, cfg.rope_base, device, scale=cfg.rope_scale)
        self.rope_window = Rope(D, cfg.rope_base_window, device) if cfg.window_layers else None
        self.layers: list[DecoderLayer] = []
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
                bias = torch.cat(bias)
            neox = [H, Hkv, None] if cfg.rope_style == "neox" else None
            q_norm = k_norm = None
            if cfg.qk_norm:
                perm = _neox_to_interleaved(torch.arange(D).float().unsqueeze(1), 1, D).squeeze(1).long()
                q_norm = vec(t(p + "attn_q_norm.weight")[perm])
                k_norm = vec(t(p + "attn_k_norm.weight")[perm])
            self.layers.append(DecoderLayer(
                qkv=lin([p + f"attn_{x}.weight" for x in "qkv"], neox, bias, t(p + "attn_norm.weight")),
                o=lin([p + "attn_output.weight"]),
                gate_up=lin([p + "ffn_gate.weight", p + "ffn_up.weight"], None, None, t(p + "ffn_norm.weight")),
                down=lin([p + "ffn_down.weight"]),
                shape=shape, eps=cfg.rms_eps, q_norm=q_norm, k_norm=k_norm, kind=self._layer_kind(i, t, vec)))
        emb_shape = gguf.shape("token_embd.weight")
        if emb_shape != (cfg.vocab_size, cfg.n_embd):
            raise ModelError(f"{gguf.path}: token_embd.weight has shape {emb_shape}, "
                             f"expected ({cfg.vocab_size}, {cfg.n_embd})")
        # [vocab, n_embd]: on CPU the file's blocks, rows dequantized as they are looked up; on an
        # accelerator a dense table in device memory (a gather there costs nothing)
        table = TokenEmbeddings(*gguf.raw("token_embd.weight"), device, dtype,
                                kernels=native.kernels() if quant == "gguf" else None)
        self.embed: TokenEmbeddings | torch.Tensor = table if device.type == "cpu" else table.dense()
        out_norm = t("output_norm.weight")
        self.norm = vec(out_norm)  # [n_embd]: the head applies it (norm_linear); kept for callers of taps
        head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        self.head = lin([head_name], None, None, out_norm)
        self.output_head = OutputHead(gguf, head_name, out_norm, cfg.rms_eps, backend, self.head)
        self.metadata = gguf.metadata

    def _layer_stack(self) -> tuple[Any, list[Rope | None]] | None:
        """(the kernels' LayerStack of every layer, the RoPEs of its tables: None for the step's own),
        or None where some layer is not one native call (then each layer is called from Python: the
        same kernel calls in the same order, so the same bits). Built once per kernels module and kept
        (tools like scripts/kernel_builds.py swap the module forward by forward: ~0.1 ms a rebuild)
        while every layer is `fused` (the profiler times the kernels apart)."""
        k = getattr(self.layers[0], "_k", None)
        if k is None or not all(layer.fused and layer._fused is not None and layer._k is k for layer in self.layers):
            return None
        if self._stack is None or self._stack[0] is not k:
            if k not in self._stacks:
                self._stacks[k] = self._build_stack(k)
            self._stack = self._stacks[k]
            self._stack_tokens = self._stack[3]  # (a tool may turn it off while on one module)
        return self._stack[1], self._stack[2]

    def _build_stack(self, k) -> tuple[Any, Any, list[Rope | None], bool]:
        """(k, its LayerStack of every layer, the RoPEs of its tables, whether it also embeds and
        applies the head: ids in, logits out, all in k's code, where the embedding is gathered from
        the file's blocks and the head is a quantized linear with its norm)."""
        ropes: list[Rope | None] = [None]
        stack = k.LayerStack()
        for layer in self.layers:
            if layer.kind.rope not in ropes:
                ropes.append(layer.kind.rope)
            stack.add(*layer.stack_args(ropes.index(layer.kind.rope)))
        emb, head = self.embed, self.head
        tokens = (isinstance(emb, TokenEmbeddings) and emb._gather is not None
                  and isinstance(head, native.QuantLinear) and head.norm_weight is not None
                  and hasattr(stack, "forward_tokens"))  # (a build of older sources, scripts/kernel_builds.py, has not)
        if tokens:
            stack.set_embedding(emb._gather[1], emb._gather[2], emb.shape[1], float(self.config.embed_scale))
            stack.set_head(*head.packed(), float(self.config.rms_eps))
        return k, stack, ropes, tokens

    def _layer_kind(self, i: int, t, vec) -> LayerKind:
        """What layer i does beyond llama's (gemma3: window, its RoPE, post norms, GeGLU, scale)."""
        cfg = self.config
        if cfg.arch != "gemma3":
            return LayerKind()
        # The GGUF converter stores Gemma's RMSNorm weights with the +1 already added (llama.cpp's
        # graph multiplies by them as they are), so they are used as stored.
        p = f"blk.{i}."
        window = cfg.layer_window(i)
        return LayerKind(window=window, rope=self.rope_window if window else None,
                         post_attn_norm=vec(t(p + "post_attention_norm.weight")),
                         post_ffn_norm=vec(t(p + "post_ffw_norm.weight")), gelu=cfg.gelu, scale=cfg.scale)

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu", dtype: str = "float32", quant: str = "auto") -> "Transformer":
        """Load a GGUF model; every problem is a ModelError naming the file. dtype "auto":
        bfloat16 on CUDA, float32 on CPU."""
        if dtype not in DTYPES and dtype != "auto":
            raise ModelError(f"dtype {dtype!r} is not supported (choose one of: auto, {', '.join(DTYPES)})")
        if quant not in QUANTS:
            raise ModelError(f"quant {quant!r} is not supported (choose one of: {', '.join(QUANTS)})")
        dev = resolve_device(device)
        if dtype == "auto":
            dtype = "bfloat16" if dev.type == "cuda" else "float32"
        return cls(GGUFFile(path), dev, DTYPES[dtype], quant)

    @property
    def kernel_path(self) -> str:
        """Which code runs this model's forwards: "gguf-<isa>" (the gguf kernels on that instruction-set
        path), else torch's "cuda" or "cpu" (what specplug.pricing keys its built-in curves by)."""
        if self.quant == "gguf":
            return f"gguf-{self.isa}"
        return "cuda" if self.device.type == "cuda" else "cpu"

    def new_cache(self, n_seq: int, max_ctx: int, dtype: torch.dtype | None = None,
                  slack: int = RING_SLACK) -> KVCache:
        """A KV cache for `n_seq` sequences of up to `max_ctx` positions each (dtype: see
        Backend.new_cache; float16 on the gguf kernels); with the static step, one spare slot more.
        Sliding-window layers keep rings of their window + `slack` cells (KVCache)."""
        cfg = self.config
        return self.backend.new_cache(cfg.n_layer, n_seq, max_ctx, cfg.n_head_kv, cfg.head_dim, dtype,
                                      spare=1 if self.static is not None else 0,
                                      windows=[cfg.layer_window(i) for i in range(cfg.n_layer)], slack=slack)

    def static_problem(self) -> str | None:
        """Why the static-shape step cannot run this model, or None."""
        cfg = self.config
        if cfg.window_layers or cfg.post_norms or cfg.logit_softcap or cfg.embed_scale != 1.0:
            return f"the static-shape step (compile) runs llama-family layers only, not {cfg.arch}'s"
        return None

    def use_static(self, options=None):
        """Run every forward from now on through static-shape steps (compiled, and captured as CUDA
        graphs on CUDA; see specplug.runtime.static). Make caches after this call. Returns the runner."""
        problem = self.static_problem()
        if problem:
            raise ModelError(f"{self.path}: {problem} (set compile: false)")
        self.static = StaticRunner(self, options or StaticOptions())
        return self.static

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

        On the GGUF kernels every entry is one row, with no padding and no mask: each row
        attends to its own sequence's valid cells up to its position, so rows of different
        sequences and lengths mix freely and every row's result is independent of the rest
        of the batch.
        """
        gov = self.governor
        if gov is None:
            return self._forward_pieces(token_ids, positions, seq_ids, cache, logits_rows, taps)
        gov.begin(len(token_ids))
        try:
            return self._forward_pieces(token_ids, positions, seq_ids, cache, logits_rows, taps)
        finally:
            gov.end()

    def _forward_pieces(self, token_ids, positions, seq_ids, cache, logits_rows, taps) -> ForwardOutput:
        """One forward, or several in a row when a sequence has more rows than its sliding-window
        rings can take at once (KVCache.ring_rows: a long prompt chunk); each row's result is the same
        either way on the native kernels, which are batch-invariant."""
        most = cache.ring_rows()
        counts: dict[int, int] = {}
        for s in seq_ids:
            counts[s] = counts.get(s, 0) + 1
        if max(counts.values()) <= most:
            return self._forward(token_ids, positions, seq_ids, cache, logits_rows, taps)
        n = len(token_ids)
        piece_of, seen = [0] * n, {}
        for i in sorted(range(n), key=lambda i: (seq_ids[i], positions[i])):  # each sequence's rows by position
            piece_of[i] = seen.get(seq_ids[i], 0) // most
            seen[seq_ids[i]] = seen.get(seq_ids[i], 0) + 1
        want = list(range(n)) if logits_rows is None else [int(r) for r in logits_rows]
        logits = [None] * len(want)
        hidden: dict[int, list] = {t: [None] * n for t in taps}
        for piece in range(max(piece_of) + 1):
            rows = [i for i in range(n) if piece_of[i] == piece]
            local = {e: j for j, e in enumerate(rows)}
            mine = [k for k, e in enumerate(want) if e in local]
            out = self._forward([token_ids[i] for i in rows], [positions[i] for i in rows],
                                [seq_ids[i] for i in rows], cache, [local[want[k]] for k in mine], taps)
            for j, k in enumerate(mine):
                logits[k] = out.logits[j]
            for t, h in out.hidden.items():
                for j, e in enumerate(rows):
                    hidden[t][e] = h[j]
        return ForwardOutput(logits=torch.stack(logits) if want else None,
                             hidden={t: torch.stack(h) for t, h in hidden.items()})

    def _forward(self, token_ids, positions, seq_ids, cache, logits_rows, taps) -> ForwardOutput:
        n = len(token_ids)
        assert n == len(positions) == len(seq_ids) and n > 0, (n, len(positions), len(seq_ids))
        if self.static is not None:
            logits, hidden = self.static.forward(token_ids, positions, seq_ids, cache, logits_rows, taps)
            return ForwardOutput(logits=logits, hidden=hidden)
        cfg = self.config
        step = Step(positions, seq_ids, cache, self.rope, self.backend)
        built = self._layer_stack() if step.native else None
        if built is not None and self._stack_tokens and 0 <= min(token_ids) and max(token_ids) < len(self.embed):
            return self._forward_tokens(built, token_ids, step, cache, logits_rows, taps)
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        x = step.rows(self.embed[ids if isinstance(self.embed, TokenEmbeddings) else ids.to(self.device)])
        if cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
        hidden: dict[int, torch.Tensor] = {}
        if built is not None:  # all layers in one native call
            stack, ropes = built
            at = sorted(t for t in taps if 0 <= t <= cfg.n_layer)
            kc, vc, cos, sin = self._stack_tables(step, cache, ropes)
            out = stack.forward(x, kc, vc, step.seq, step.pos, cache.valid, cos, sin, step.limit, at)
            x, hidden = out[0], dict(zip(at, out[1:]))
        else:
            for li, layer in enumerate(self.layers):
                if li in taps:
                    hidden[li] = x
                x = layer(x, step, li)
            if cfg.n_layer in taps:
                hidden[cfg.n_layer] = x
        hidden = {k: step.entries(v).float() for k, v in hidden.items()}
        logits = None
        if logits_rows is None or len(logits_rows) > 0:
            logits = self.head.norm_linear(step.select(x, logits_rows), cfg.rms_eps).float()
            logits = self._softcap(logits)
        return ForwardOutput(logits=logits, hidden=hidden)

    def _forward_tokens(self, built, token_ids, step: Step, cache: KVCache, logits_rows, taps) -> ForwardOutput:
        """_forward's native path in one call, ids to logits (LayerStack.forward_tokens): the same
        kernel calls as its embedding lookup, layer stack and head one by one, so the same bits."""
        stack, ropes = built
        at = sorted(t for t in taps if 0 <= t <= self.config.n_layer)
        kc, vc, cos, sin = self._stack_tables(step, cache, ropes)
        rows = None if logits_rows is None else [int(r) for r in logits_rows]
        out = stack.forward_tokens([int(t) for t in token_ids], kc, vc, step.seq_ids, step.positions, cache.valid,
                                   cos, sin, step.limit, at, rows)
        logits = None if rows == [] else self._softcap(out[0])
        return ForwardOutput(logits=logits, hidden={t: h.float() for t, h in zip(at, out[2:])})

    @staticmethod
    def _stack_tables(step: Step, cache: KVCache, ropes) -> tuple[list, list, list, list]:
        """The LayerStack call's caches (one [n_layer, ...] tensor or one per layer) and RoPE tables."""
        tables = [step.tables(r) for r in ropes]
        return ([cache.k] if isinstance(cache.k, torch.Tensor) else cache.k,
                [cache.v] if isinstance(cache.v, torch.Tensor) else cache.v,
                [c for c, _ in tables], [s for _, s in tables])

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits
