"""The `gguf` weight path: compute on the GGUF file's own quantized blocks, as llama.cpp does.

Q4_1 and Q8_0 tensors are used as stored (Q4_0 becomes the equivalent Q4_1); any other
type is dequantized and re-quantized to Q8_0. Activations are quantized per row to 8 bits
per block of 32 and dotted in integers (AVX2). That reads ~97 MB per token for SmolLM2-135M
instead of 540 MB of float32 weights, and verifying a few drafted rows costs little more
than one because each weight tile is unpacked once for all the rows.

The kernels (csrc/gguf_kernels.cpp) are compiled on first use with torch's C++ extension
builder and cached (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). Every kernel
is batch-invariant (a row's result never depends on the other rows of its batch), so
speculative verification is bit-identical to one-token decoding.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import threading
from pathlib import Path

import numpy as np
import torch

from specplug.errors import ModelError

_SRC = Path(__file__).parent / "csrc" / "gguf_kernels.cpp"
_lock = threading.Lock()
_ext = None
_ext_error: str | None = None

Q4_1_BLOCK = 20  # f16 d, f16 m, 16 bytes of nibbles
Q8_0_BLOCK = 34  # f16 d, 32 int8
Q4_0_BLOCK = 18  # f16 d, 16 bytes of nibbles (value = (q - 8) * d)
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # used as stored; other types are re-quantized to Q8_0


def unavailable_reason() -> str | None:
    """Why the gguf path cannot run here (None = it can), without building anything."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the gguf kernels need an x86 CPU with AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    return _ext_error


_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
_LDFLAGS = ("-fopenmp",)


def build_key() -> str:
    """What the built kernels depend on: the sources (csrc/), the compiler flags, torch and Python versions.
    Each key gets its own build folder, so two installs (checkouts, virtual environments) never
    rebuild each other's kernels."""
    h = hashlib.sha256()
    for src in sorted(f for f in _SRC.parent.iterdir() if f.suffix in (".cpp", ".h")):  # kernels and headers
        h.update(src.name.encode() + src.read_bytes())
    h.update(json.dumps([_CFLAGS, _LDFLAGS, torch.__version__, sys.version_info[:2], platform.machine()]).encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    """The build folder of this install's kernels (under TORCH_EXTENSIONS_DIR or torch's default root)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"specplug_gguf_{build_key()}"


@contextlib.contextmanager
def build_lock(folder: Path, say=print):
    """Hold an exclusive lock on `folder` while building or loading the kernels.

    torch's own build lock (a file named `lock`) stays behind when a build is killed, and every
    later load then waits for it forever. Ours is an OS file lock (flock), released when its
    process dies, however it dies. Whoever holds ours is the only builder of this folder, so a
    torch `lock` file found while holding it is stale and is removed."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "specplug.lock", "w") as f:
        try:
            import fcntl
        except ImportError:  # no flock (Windows): torch's lock alone
            fcntl = None
        if fcntl is not None:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                say(f"specplug: waiting for another process that is building the gguf kernels in {folder}...")
                fcntl.flock(f, fcntl.LOCK_EX)
            stale = folder / "lock"
            if stale.exists():
                stale.unlink()
                say(f"specplug: removed a stale build lock left by an interrupted kernel build ({stale})")
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(f, fcntl.LOCK_UN)


def kernels():
    """The compiled extension (built on first call, ~30 s; then loaded from the cache)."""
    global _ext, _ext_error
    if _ext is not None:
        return _ext
    reason = unavailable_reason()
    if reason:
        raise ModelError(reason)
    with _lock:
        if _ext is None:
            from torch.utils.cpp_extension import load

            say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
            folder = build_dir()
            name = folder.name
            try:
                with build_lock(folder, say):
                    if not any(folder.glob(f"{name}*.so")):
                        say(f"specplug: building the gguf CPU kernels (~30 s) in {folder}...")
                    _ext = load(name=name, sources=[str(_SRC)], extra_cflags=list(_CFLAGS), extra_ldflags=list(_LDFLAGS),
                                build_directory=str(folder), verbose=bool(os.environ.get("SPECPLUG_VERBOSE_BUILD")))
            except Exception as exc:  # no compiler, no ninja, a broken toolchain, an unwritable folder
                _ext_error = (f"could not build the gguf kernels in {folder} ({type(exc).__name__}: "
                              f"{str(exc).strip()[-300:]}); install a C++ compiler and ninja, or use quant: none")
                raise ModelError(_ext_error) from None
    return _ext


def _f16_as_i16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16))


class QuantLinear:
    """y = x @ W.T (+ bias) with W in tiles of 8 output rows of Q4_1 or Q8_0 blocks.

    `norm_weight` makes `norm_linear(x)` = linear(rms_norm(x) * norm_weight), fused into
    the activation quantization.
    """

    def __init__(self, kind: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, out_features: int,
                 bias: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None):
        self.kind, self.qs, self.d, self.m = kind, qs, d, m
        self.out_features = out_features
        # the bias is read a whole tile at a time: pad it to the tiled width
        self.bias = None if bias is None else torch.nn.functional.pad(bias.float(), (0, (-out_features) % 8))
        self.norm_weight = None if norm_weight is None else norm_weight.float().contiguous()
        self.k = kernels()

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_blocks(cls, raw: np.ndarray, qtype: str, shape: tuple[int, int], **kw) -> "QuantLinear":
        """From a GGUF tensor's raw bytes ([rows, bytes per row]) of type Q4_0, Q4_1 or Q8_0."""
        n, k = shape
        nb = k // 32
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)
        if qtype == "Q8_0":
            blocks = raw.reshape(n, nb, Q8_0_BLOCK)
            return cls._q8_0(blocks[:, :, 2:], blocks[:, :, :2].copy().view(np.float16)[..., 0], n, **kw)
        if qtype == "Q4_1":
            blocks = raw.reshape(n, nb, Q4_1_BLOCK)
            d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
            m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0]
            return cls._q4_1(blocks[:, :, 4:], d, m, n, **kw)
        if qtype == "Q4_0":  # (q - 8) * d == q * d + m with m = -8 d, exact in float16
            blocks = raw.reshape(n, nb, Q4_0_BLOCK)
            d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
            return cls._q4_1(blocks[:, :, 2:], d, (d.astype(np.float32) * -8).astype(np.float16), n, **kw)
        raise ValueError(qtype)

    @classmethod
    def from_float(cls, w: torch.Tensor, **kw) -> "QuantLinear":
        """Quantize float weights [out, in] to Q8_0 (32 values per block, round to nearest)."""
        n, k = w.shape
        wb = w.float().reshape(n, k // 32, 32).numpy()
        amax = np.abs(wb).max(-1)
        d = (amax / 127.0).astype(np.float16)
        dd = d.astype(np.float32)
        q = np.rint(np.divide(wb, dd[..., None], out=np.zeros_like(wb), where=dd[..., None] != 0))
        return cls._q8_0(np.clip(q, -127, 127).astype(np.int8).view(np.uint8), d, n, **kw)

    @staticmethod
    def _pad_rows(a: np.ndarray, n: int) -> np.ndarray:
        pad = (-n) % 8
        return a if pad == 0 else np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])

    @classmethod
    def _q4_1(cls, nibbles: np.ndarray, d: np.ndarray, m: np.ndarray, n: int, **kw) -> "QuantLinear":
        nib, d, m = cls._pad_rows(nibbles, n), cls._pad_rows(d, n), cls._pad_rows(m, n)
        nt, nb = nib.shape[0] // 8, nib.shape[1]
        # [tile, col, block, p, i] -> [tile, block, p, col, i]: byte j = 4p + i keeps GGUF's nibble pairing
        qs = nib.reshape(nt, 8, nb, 4, 4).transpose(0, 2, 3, 1, 4).reshape(nt, nb, 128)
        tiles = lambda a: _f16_as_i16(a.reshape(nt, 8, nb).transpose(0, 2, 1))  # noqa: E731
        return cls("q4_1", torch.from_numpy(np.ascontiguousarray(qs)), tiles(d), tiles(m), n, **kw)

    @classmethod
    def _q8_0(cls, qbytes: np.ndarray, d: np.ndarray, n: int, **kw) -> "QuantLinear":
        qb, d = cls._pad_rows(qbytes, n), cls._pad_rows(d, n)
        nt, nb = qb.shape[0] // 8, qb.shape[1]
        qs = qb.reshape(nt, 8, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(nt, nb, 256)
        tiles = _f16_as_i16(d.reshape(nt, 8, nb).transpose(0, 2, 1))
        return cls("q8_0", torch.from_numpy(np.ascontiguousarray(qs)), tiles, None, n, **kw)

    def packed(self) -> tuple[list[torch.Tensor], int]:
        """([qs, d, m, bias, norm_weight], out_features) as the fused layer kernel takes them (absent: empty)."""
        e = torch.empty(0)
        return [self.qs, self.d, self.m if self.m is not None else e, self.bias if self.bias is not None else e,
                self.norm_weight if self.norm_weight is not None else e], self.out_features

    # ---- use ----------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor, norm: bool = False, eps: float = 0.0):
        return self.k.quantize_rows(x, self.norm_weight if norm else None, eps)

    def matmul(self, xa, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.kind == "q4_1":
            return self.k.matmul_q4_1(xa, self.qs, self.d, self.m, self.bias, residual, self.out_features)
        return self.k.matmul_q8_0(xa, self.qs, self.d, self.bias, residual, self.out_features)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.matmul(self.quantize(x.contiguous()), residual)

    def norm_linear(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        return self.matmul(self.quantize(x.contiguous(), True, eps))
