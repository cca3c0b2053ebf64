"""Reading GGUF files: metadata -> a typed ModelConfig, tensors -> dequantized numpy arrays.

All parsing and dequantization is done by the `gguf` package (memory-mapped reader,
its own numpy dequantizers); this module only maps names and turns every failure into
one ModelError that names the file.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from specplug.errors import ModelError

# Architectures whose GGUF tensors we know how to run. The llama converter permutes Q/K
# rows for llama.cpp's interleaved ("normal") RoPE; qwen2/qwen3/gemma3 keep the NEOX (half-split)
# layout, which the model turns into the interleaved one at load time.
ROPE_STYLE = {"llama": "interleaved", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox"}

# gemma3 (llama.cpp src/models/gemma3.cpp): without a sliding_window_pattern key, every 6th layer
# is global and the others slide (llama_hparams::set_swa_pattern: layer i slides when i % 6 < 5);
# the sliding layers' RoPE base is rope.freq_base_swa, 10000 when the file has none.
GEMMA3_SWA_PATTERN = 6
GEMMA3_SWA_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, read from GGUF metadata."""

    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    vocab_size: int
    context_length: int
    rope_base: float
    rms_eps: float
    rope_style: str  # "interleaved" | "neox" (layout of Q/K rows in the file)
    qk_norm: bool  # qwen3: RMSNorm on each head of q and k before RoPE
    attn_bias: bool  # qwen2: bias on q, k, v
    tied_embeddings: bool  # no output.weight: the lm head is token_embd
    # gemma3 and kin; the defaults are llama's
    window: int = 0  # sliding-window size in tokens (a query at p sees keys p - window < k <= p); 0: none
    window_layers: tuple[int, ...] = ()  # the layers that slide; the others attend to everything
    rope_base_window: float = 10000.0  # the sliding layers' RoPE base
    rope_scale: float = 1.0  # linear RoPE scaling of the other layers (positions times this)
    post_norms: bool = False  # RMSNorm on the attention and MLP outputs before the residual add
    gelu: bool = False  # GeGLU (tanh GELU) in place of SwiGLU
    embed_scale: float = 1.0  # token embeddings times this (gemma: sqrt(n_embd))
    attn_scale: float = 0.0  # q.k scale; 0: 1/sqrt(head_dim)
    logit_softcap: float = 0.0  # logits = c tanh(logits / c); 0: none

    def layer_window(self, layer: int) -> int:
        """The sliding window of `layer` (0: it attends to every position)."""
        return self.window if layer in self.window_layers else 0

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim ** -0.5


def _reader(path: Path):
    """gguf.GGUFReader over a plain ndarray view of its memory map.

    The reader slices its map once per value while it parses the header; slices of an np.memmap go
    through memmap's Python-level __array_finalize__, which made a 262,144-token vocabulary (Gemma 3)
    take 15-20 s to parse. A plain view of the same mapping reads the same bytes 3x faster."""
    from gguf import GGUFReader

    class PlainReader(GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray)  # keeps the map alive through .base

    return PlainReader(str(path), "r")


class GGUFFile:
    """A GGUF file opened through `gguf.GGUFReader` (memory-mapped; tensors are read lazily)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelError(f"model file not found: {self.path}")
        try:
            self._reader = _reader(self.path)
        except Exception as exc:  # the reader raises many types on corrupt/truncated files
            raise ModelError(f"{self.path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
        self.tensors = {t.name: t for t in self._reader.tensors}

    @cached_property
    def metadata(self) -> dict[str, Any]:
        """Every key/value of the header as plain Python values (str, int, float, lists)."""
        out = {}
        for key, field in self._reader.fields.items():
            try:
                out[key] = field.contents()
            except Exception as exc:
                raise ModelError(f"{self.path}: metadata key {key!r} is unreadable ({exc})") from None
        return out

    def _get(self, key: str, default: Any = ...) -> Any:
        md = self.metadata
        if key in md:
            return md[key]
        if default is ...:
            raise ModelError(f"{self.path}: metadata key {key!r} is missing")
        return default

    @cached_property
    def config(self) -> ModelConfig:
        """The typed model configuration; ModelError for an architecture we cannot run."""
        arch = self._get("general.architecture")
        if arch not in ROPE_STYLE:
            raise ModelError(
                f"{self.path}: architecture {arch!r} is not supported (supported: {', '.join(sorted(ROPE_STYLE))})"
            )
        p = arch + "."
        n_embd = int(self._get(p + "embedding_length"))
        n_head = int(self._get(p + "attention.head_count"))
        n_head_kv = self._get(p + "attention.head_count_kv", n_head)
        if isinstance(n_head_kv, list):  # per-layer lists exist in some files; we need one value
            if len(set(n_head_kv)) != 1:
                raise ModelError(f"{self.path}: per-layer head_count_kv is not supported")
            n_head_kv = n_head_kv[0]
        head_dim = int(self._get(p + "attention.key_length", n_embd // n_head))
        emb = self.tensors.get("token_embd.weight")
        if emb is None:
            raise ModelError(f"{self.path}: tensor 'token_embd.weight' is missing")
        vocab = int(self._get(p + "vocab_size", int(emb.shape[-1])))
        n_layer = int(self._get(p + "block_count"))
        extra = self._gemma3(p, n_layer, n_embd, n_head) if arch == "gemma3" else {}
        return ModelConfig(
            arch=arch,
            name=str(self._get("general.name", self.path.stem)),
            n_layer=n_layer,
            n_embd=n_embd,
            n_ff=int(self._get(p + "feed_forward_length")),
            n_head=n_head,
            n_head_kv=int(n_head_kv),
            head_dim=head_dim,
            vocab_size=vocab,
            context_length=int(self._get(p + "context_length", 2048)),
            rope_base=float(self._get(p + "rope.freq_base", 10000.0)),
            rms_eps=float(self._get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
            rope_style=ROPE_STYLE[arch],
            qk_norm=arch in ("qwen3", "gemma3"),
            attn_bias=arch == "qwen2",
            tied_embeddings="output.weight" not in self.tensors,
            rope_scale=self._rope_scale(p),
            **extra,
        )

    def _rope_scale(self, p: str) -> float:
        """Linear RoPE scaling from rope.scaling.type/factor (llama.cpp: freq_scale = 1 / factor)."""
        kind = self._get(p + "rope.scaling.type", "none")
        factor = float(self._get(p + "rope.scaling.factor", 0.0) or 0.0)
        if kind == "none" or (kind == "linear" and factor in (0.0, 1.0)):
            return 1.0
        if kind != "linear":
            raise ModelError(f"{self.path}: rope scaling {kind!r} ({p}rope.scaling.type) is not supported "
                             "(supported: none, linear)")
        return 1.0 / factor

    def _gemma3(self, p: str, n_layer: int, n_embd: int, n_head: int) -> dict[str, Any]:
        """gemma3's keys beyond llama's, read as llama.cpp's gemma3 loader reads them."""
        if self._get(p + "attn_logit_softcapping", 0.0):
            raise ModelError(f"{self.path}: {p}attn_logit_softcapping is set; attention soft-capping "
                             "(gemma2) is not supported")
        window = int(self._get(p + "attention.sliding_window", 0) or 0)
        layers: tuple[int, ...] = ()
        if window > 0:
            pattern = self._get(p + "attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
            if isinstance(pattern, list):  # one flag per layer
                if len(pattern) != n_layer:
                    raise ModelError(f"{self.path}: {p}attention.sliding_window_pattern has {len(pattern)} "
                                     f"entries for {n_layer} layers")
                layers = tuple(i for i, slides in enumerate(pattern) if slides)
            else:
                n = int(pattern)
                layers = tuple(i for i in range(n_layer) if n == 0 or i % n < n - 1)
        head_dim = int(self._get(p + "attention.key_length", n_embd // n_head))
        # llama.cpp: 1/sqrt(head_dim) (query_pre_attn_scalar = head_dim), but 1/sqrt(n_embd / n_head)
        # for the 27B model (62 layers), as gemma_pytorch's config says
        scale = (n_embd // n_head) ** -0.5 if n_layer == 62 else head_dim ** -0.5
        return dict(window=window, window_layers=layers,
                    rope_base_window=float(self._get(p + "rope.freq_base_swa", GEMMA3_SWA_ROPE_BASE)),
                    post_norms=True, gelu=True, embed_scale=float(np.sqrt(np.float32(n_embd))),
                    attn_scale=float(self._get(p + "attention.scale", scale)),
                    logit_softcap=float(self._get(p + "final_logit_softcapping", 0.0) or 0.0))

    def has(self, name: str) -> bool:
        return name in self.tensors

    def tensor(self, name: str) -> np.ndarray:
        """Dequantize one tensor to float32 numpy, shaped like torch (rows = last GGUF dim)."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path}: tensor {name!r} is missing")
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        qtype = GGMLQuantizationType(t.tensor_type)
        try:
            arr = dequantize(np.asarray(t.data), qtype)
        except NotImplementedError:
            raise ModelError(f"{self.path}: tensor {name!r} has type {qtype.name}, "
                             "which cannot be dequantized") from None
        except Exception as exc:
            raise ModelError(f"{self.path}: tensor {name!r} ({qtype.name}) is corrupt or truncated ({exc})") from None
        shape = tuple(int(d) for d in reversed(t.shape))
        if arr.size != int(np.prod(shape)):
            raise ModelError(f"{self.path}: tensor {name!r} holds {arr.size} values, expected shape {shape}")
        arr = arr.reshape(shape).astype(np.float32, copy=False)
        return arr if arr.flags.writeable else arr.copy()  # F32 tensors come straight from the read-only map

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape in torch order (rows = last GGUF dim), without reading its data."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path}: tensor {name!r} is missing")
        return tuple(int(d) for d in reversed(t.shape))

    def raw(self, name: str) -> tuple[np.ndarray, str, tuple[int, ...]]:
        """A tensor as stored: (bytes [rows, bytes per row], type name, torch-order shape)."""
        t = self.tensors.get(name)
        if t is None:
            raise ModelError(f"{self.path}: tensor {name!r} is missing")
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        qtype = GGMLQuantizationType(t.tensor_type)
        shape = self.shape(name)
        block, size = GGML_QUANT_SIZES[qtype]
        data = np.asarray(t.data).view(np.uint8)
        row_bytes = shape[-1] // block * size
        if shape[-1] % block or data.size != int(np.prod(shape[:-1])) * row_bytes:
            raise ModelError(f"{self.path}: tensor {name!r} ({qtype.name}) holds {data.size} bytes, "
                             f"which does not match its shape {shape}")
        return data.reshape(-1, row_bytes), qtype.name, shape

    def tensor_type(self, name: str) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.tensors[name].tensor_type).name
