"""Writing and reading head files (GGUF through the `gguf` package); see `specplug.heads`."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

import numpy as np
import torch

from specplug.errors import ModelError
from specplug.outputs import claim, replacing
from specplug.runtime.gguf_file import GGUFFile
from specplug.runtime.layers import DecoderLayer

HEAD_ARCH = "specplug-head"
_P = "specplug.head."


class HeadError(ModelError):
    """A head file that cannot serve: unreadable, another method, another target, bad tensors."""


def token_table_sha256(token_texts: Sequence[str]) -> str:
    """A fingerprint of a vocabulary: sha256 of its token strings (in id order) as a JSON list."""
    return hashlib.sha256(json.dumps(list(token_texts), ensure_ascii=False).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class HeadMeta:
    """What a head file says about itself (the metadata keys of `specplug.heads`)."""

    method: str
    version: int
    target_arch: str
    target_name: str
    n_embd: int
    vocab_size: int
    token_table_sha256: str
    taps: tuple[str, ...]  # "final" and/or layer indices as strings
    config: dict = field(default_factory=dict)
    recipe: dict = field(default_factory=dict)

    @classmethod
    def for_target(cls, target, method: str, version: int, taps: Sequence[str | int], config: dict,
                   recipe: dict | None = None) -> "HeadMeta":
        """Metadata for a head trained for `target`: a TargetInfo, or anything with its arch, model_path,
        n_embd, vocab_size and token_texts (or a ready token_table_sha256)."""
        table = getattr(target, "token_table_sha256", None) or token_table_sha256(target.token_texts)
        return cls(method, version, target.arch, Path(str(target.model_path)).stem, int(target.n_embd),
                   int(target.vocab_size), table, tuple(str(t) for t in taps), dict(config), dict(recipe or {}))

    def target_problem(self, target) -> str | None:
        """Why this head cannot serve `target` (a TargetInfo), naming both; None when it can."""
        mine = f"{self.target_name} ({self.target_arch}, n_embd {self.n_embd}, vocab {self.vocab_size}, " \
               f"token table {self.token_table_sha256[:12]})"
        theirs_hash = token_table_sha256(target.token_texts)
        theirs = f"{Path(str(target.model_path)).name} ({target.arch}, n_embd {target.n_embd}, " \
                 f"vocab {target.vocab_size}, token table {theirs_hash[:12]})"
        if (self.target_arch, self.n_embd, self.vocab_size, self.token_table_sha256) != \
                (target.arch, int(target.n_embd), int(target.vocab_size), theirs_hash):
            return f"the head was trained for {mine}, not for the target {theirs}"
        return None


def write_head(path: str | Path, meta: HeadMeta, tensors: Mapping[str, torch.Tensor | np.ndarray],
               quantize: Collection[str] = (), f16: Collection[str] = ()) -> Path:
    """Write a head file atomically (a temporary file, fsynced, renamed into place), holding the
    head's claim meanwhile (specplug.outputs: another process writing it makes this fail at once).

    `tensors`: name -> array; 2-D float tensors named in `quantize` are stored Q8_0 (their rows
    must be a multiple of 32 long), those in `f16` as F16, other floats F32, integers I32.
    """
    import gguf

    path = Path(path)
    with claim(path, "head"), replacing(path, "head") as tmp:  # nests in a trainer's claim of the same head
        _write_gguf(gguf, tmp, meta, tensors, quantize, f16)
    return path


def _write_gguf(gguf, tmp: Path, meta: HeadMeta, tensors, quantize, f16) -> None:
    w = gguf.GGUFWriter(str(tmp), HEAD_ARCH)
    w.add_name(f"{meta.method} head for {meta.target_name}")
    w.add_string(_P + "method", meta.method)
    w.add_uint32(_P + "version", int(meta.version))
    w.add_string(_P + "target.arch", meta.target_arch)
    w.add_string(_P + "target.name", meta.target_name)
    w.add_uint32(_P + "target.n_embd", int(meta.n_embd))
    w.add_uint32(_P + "target.vocab_size", int(meta.vocab_size))
    w.add_string(_P + "target.token_table_sha256", meta.token_table_sha256)
    w.add_array(_P + "taps", [str(t) for t in meta.taps] or [""])
    w.add_string(_P + "config", json.dumps(meta.config, sort_keys=True))
    w.add_string(_P + "recipe", json.dumps(meta.recipe, sort_keys=True))
    for name, t in tensors.items():
        a = t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
        if np.issubdtype(a.dtype, np.integer):
            w.add_tensor(name, np.ascontiguousarray(a.astype(np.int32)))
        elif name in quantize:
            a = np.ascontiguousarray(a.astype(np.float32))
            if a.ndim != 2 or a.shape[1] % 32:
                raise ValueError(f"{name}: Q8_0 needs a 2-D tensor with rows a multiple of 32 long, got {a.shape}")
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        elif name in f16:
            w.add_tensor(name, np.ascontiguousarray(a.astype(np.float16)))
        else:
            w.add_tensor(name, np.ascontiguousarray(a.astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class HeadFile:
    """A head file opened for reading. Every problem is a HeadError naming the file."""

    def __init__(self, path: str | Path, method: str | None = None, versions: Collection[int] | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise HeadError(f"head file not found: {self.path}")
        try:
            self.gguf = GGUFFile(self.path)
            md = self.gguf.metadata
        except ModelError as exc:
            raise HeadError(f"{exc} (is it a complete specplug head file?)") from None
        arch = md.get("general.architecture")
        if arch != HEAD_ARCH:
            raise HeadError(f"{self.path}: not a specplug head (its architecture is {arch!r}; a target model "
                            f"file goes under `model:`, a head under the speculator's `head:`)")
        try:
            taps = tuple(t for t in md.get(_P + "taps", []) if t)
            self.meta = HeadMeta(str(md[_P + "method"]), int(md[_P + "version"]), str(md[_P + "target.arch"]),
                                 str(md[_P + "target.name"]), int(md[_P + "target.n_embd"]),
                                 int(md[_P + "target.vocab_size"]), str(md[_P + "target.token_table_sha256"]),
                                 taps, json.loads(md.get(_P + "config", "{}")), json.loads(md.get(_P + "recipe", "{}")))
        except KeyError as exc:
            raise HeadError(f"{self.path}: head metadata key {exc.args[0]!r} is missing") from None
        except (TypeError, ValueError) as exc:
            raise HeadError(f"{self.path}: head metadata is malformed ({exc})") from None
        if method is not None and self.meta.method != method:
            raise HeadError(f"{self.path}: this is a {self.meta.method!r} head, not a {method!r} head "
                            f"(use it with `type: {self.meta.method}`)")
        if versions is not None and self.meta.version not in versions:
            raise HeadError(f"{self.path}: {self.meta.method} head format version {self.meta.version} is not "
                            f"supported by this plugin (supported: {', '.join(map(str, sorted(versions)))})")
        for name in self.gguf.tensors:  # a truncated file fails here, not in the middle of a run
            try:
                self.gguf.raw(name)
            except ModelError as exc:
                raise HeadError(f"{exc} (the head file is truncated or corrupt)") from None

    def has(self, name: str) -> bool:
        """Whether the file holds a tensor of this name (for optional parts of a head)."""
        return name in self.gguf.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape as torch orders it (rows first), without reading its data; a missing
        tensor is a HeadError naming it."""
        return self.gguf.shape(self._need(name))

    def tensor(self, name: str, shape: Sequence[int] | None = None) -> torch.Tensor:
        """A tensor dequantized to float32 (integers stay int64), checked against `shape` if given."""
        self._need(name)
        t = self.gguf.tensors[name]
        from gguf import GGMLQuantizationType

        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype in (GGMLQuantizationType.I32, GGMLQuantizationType.I64, GGMLQuantizationType.I16,
                     GGMLQuantizationType.I8):
            out = torch.from_numpy(np.array(t.data).astype(np.int64).reshape(self.gguf.shape(name)))
        else:
            try:
                out = torch.from_numpy(self.gguf.tensor(name))
            except ModelError as exc:
                raise HeadError(str(exc)) from None
        self._check_shape(name, tuple(out.shape), shape)
        return out

    def raw(self, name: str, shape: Sequence[int] | None = None) -> tuple[np.ndarray, str, tuple[int, ...]]:
        """A tensor as stored: (bytes [rows, bytes per row], type name, shape)."""
        raw, qtype, sh = self.gguf.raw(self._need(name))
        self._check_shape(name, sh, shape)
        return raw, qtype, sh

    def linear(self, name: str, backend, shape: Sequence[int] | None = None, norm_weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None):
        """The named 2-D weight as a runtime `Linear` on `backend` (see `specplug.runtime.layers.Linear`):
        Q8_0 blocks are used as stored on the gguf kernels, other types dequantized; `shape` is
        checked if given; `norm_weight` folds an RMSNorm in front (call it as `norm_linear(x, eps)`);
        `bias` is added to every row; a call takes `residual=` (added to the product in the same call)."""
        raw, qtype, sh = self.raw(name, shape)
        if len(sh) != 2:
            raise HeadError(f"{self.path}: tensor {name!r} has shape {sh}, expected a matrix")
        return backend.linear_from_blocks(raw, qtype, sh, bias=bias, norm_weight=norm_weight)

    def _need(self, name: str) -> str:
        if name not in self.gguf.tensors:
            raise HeadError(f"{self.path}: tensor {name!r} is missing from this {self.meta.method} head")
        return name

    def _check_shape(self, name: str, got: tuple, want: Sequence[int] | None) -> None:
        if want is not None and tuple(got) != tuple(want):
            raise HeadError(f"{self.path}: tensor {name!r} has shape {tuple(got)}, expected {tuple(want)} "
                            f"(from the head's own config)")

    def check_target(self, target) -> str | None:
        """None when this head can serve `target` (a TargetInfo), else a message naming both."""
        return self.meta.target_problem(target)


def describe(meta: HeadMeta) -> dict[str, Any]:
    """The metadata as a plain dict (for `specplug heads show` style output and the recipe)."""
    return {"method": meta.method, "version": meta.version, "target": {"arch": meta.target_arch,
            "name": meta.target_name, "n_embd": meta.n_embd, "vocab_size": meta.vocab_size,
            "token_table_sha256": meta.token_table_sha256}, "taps": list(meta.taps), "config": meta.config,
            "recipe": meta.recipe}


def layer_from_head(head: HeadFile, prefix: str, shape, eps: float, backend, d_model: int,
                    d_attn_in: int | None = None):
    """A runtime `DecoderLayer` from a head file's tensors `<prefix>attn_qkv`, `attn_output`,
    `ffn_gate_up`, `ffn_down` (matrices) and `attn_norm` (absent when the caller normalizes the
    attention input itself), `ffn_norm` (vectors); as `specplug.train.modules.TrainLayer` writes them."""
    H, Hkv, D = shape.n_head, shape.n_head_kv, shape.head_dim
    d_in = d_attn_in or d_model
    attn_norm = head.tensor(prefix + "attn_norm", (d_in,)) if head.has(prefix + "attn_norm") else None
    return DecoderLayer(
        qkv=head.linear(prefix + "attn_qkv", backend, ((H + 2 * Hkv) * D, d_in), norm_weight=attn_norm),
        o=head.linear(prefix + "attn_output", backend, (d_model, H * D)),
        gate_up=head.linear(prefix + "ffn_gate_up", backend, (2 * shape.n_ff, d_model),
                            norm_weight=head.tensor(prefix + "ffn_norm", (d_model,))),
        down=head.linear(prefix + "ffn_down", backend, (d_model, shape.n_ff)),
        shape=shape, eps=eps)
