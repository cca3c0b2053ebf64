"""The `gguf` weight path: compute on the GGUF file's own quantized blocks, as llama.cpp does.

Q4_0, Q4_1 and Q8_0 tensors are used as stored; Q4_K, Q5_K and
Q6_K are unpacked at load into their integer values and float32 scales (exactly the weights gguf's
dequantizer gives); any other type is dequantized and re-quantized to Q8_0. Activations are quantized per row to 8 bits
per block of 32 and dotted in integers, on the best instruction set the CPU has (AVX-512 VNNI,
else AVX2; `SPECPLUG_ISA=avx2|avx512` forces one); every path gives bit-identical results. That
reads ~97 MB per token for SmolLM2-135M instead of 540 MB of float32 weights, and verifying a few
drafted rows costs little more
than one because each weight tile is unpacked once for all the rows.

The kernels (csrc/gguf_kernels.cpp) are compiled on first use with torch's C++ extension
builder and cached (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions). Every kernel
is batch-invariant (a row's result never depends on the other rows of its batch), so
speculative verification is bit-identical to one-token decoding.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from specplug.errors import ModelError
from specplug.runtime import pages

# resolved: the build runs its compiler on this path, and ninja rebuilds whenever that command changes, so a
# checkout imported through a symlink (or as `python -m` from a folder that links to it) is the same build
_SRC = Path(__file__).resolve().parent / "csrc" / "gguf_kernels.cpp"
_lock = threading.Lock()
_ext: dict[str, object] = {}  # ISA -> the loaded extension
_ext_error: dict[str, str] = {}  # ISA -> why it could not be built

Q4_1_BLOCK = 20  # f16 d, f16 m, 16 bytes of nibbles
Q8_0_BLOCK = 34  # f16 d, 32 int8
Q4_0_BLOCK = 18  # f16 d, 16 bytes of nibbles (value = (q - 8) * d)
Q5_0_BLOCK = 22  # f16 d, 4 bytes of fifth bits, 16 bytes of nibbles (value = (q - 16) * d)
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # unpacked at load into integer values and float32 scales (exact)
# computed on their own values (Q4_0 on Q4_1's nibble tiles without offsets, Q5_0 on its own 5-bit
# tiles, Q5_1 like Q5_K);
# any other type is re-quantized to Q8_0
NATIVE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0") + K_QUANTS

# ---- one build of the kernels per instruction set ------------------------------------------------
# The same source compiled with each ISA's flags; the source picks its inner loops from the
# compiler's macros (__AVX512VNNI__ ...). Integer dot products are exact and every float
# operation is the same, in the same order, on every path, so all give bit-identical results.
ISA_CFLAGS = {
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
}
ISA_CPU_FLAGS = {  # what /proc/cpuinfo must list for each
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
}
ISA_ORDER = ("avx512", "avx2")  # best first: the default is the first one the CPU has
ISA_ENV = "SPECPLUG_ISA"


@functools.lru_cache(maxsize=1)
def _cpuinfo_fields() -> dict[str, str]:
    """The first non-empty value of each key of /proc/cpuinfo ({} where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if value.strip():
            fields.setdefault(key.strip(), value.strip())
    return fields


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    """(CPU model name, feature flags) from /proc/cpuinfo; elsewhere from torch's capability."""
    fields = _cpuinfo_fields()
    model = fields.get("model name") or platform.processor() or platform.machine()
    if "flags" in fields:
        return model, frozenset(fields["flags"].split())
    # no /proc/cpuinfo: what torch says, without VNNI (it does not say)
    cap = torch.backends.cpu.get_cpu_capability()
    return model, frozenset(ISA_CPU_FLAGS["avx2"] if cap in ("AVX2", "AVX512") else ())


def cpu_model() -> str:
    return _cpuinfo()[0]


@functools.lru_cache(maxsize=1)
def cpu_id() -> tuple[str, int | None]:
    """(vendor, family) from /proc/cpuinfo: ("AuthenticAMD", 25) on Zen 3 and Zen 4; ("", None) unknown."""
    fields = _cpuinfo_fields()
    family = fields.get("cpu family", "")
    return fields.get("vendor_id", ""), int(family) if family.isdigit() else None


# ---- the tile-pair threshold, a tuning per CPU -----------------------------------------------------
# The AVX-512 build computes a linear two tiles at a time on 512-bit registers ("tile pairs") or one
# at a time on 256-bit ones; both give the same bits, so which runs is a matter of speed only. Pairs
# from one row suit Intel's server cores (Cascade Lake: the linears at one row 1.18x faster with the
# pairs' software prefetch) and, since that prefetch goes to L2, Zen 4's 4-bit kinds too (the forward
# at 1 / 2 / 4 / 8 rows 1.00 / 1.02 / 1.06 / 1.05x against the 256-bit path up to 4 rows); there the
# kinds with a byte a value (Q8_0, Q5_K, Q6_K) still stream 1.05x faster on 256 bits at 1-2 rows (AMD
# EPYC Zen 4, 2 threads, `scripts/interleaved_builds.py`, docs/results/runtime.md). A CPU measured to
# want other thresholds gets an entry here; SPECPLUG_PAIR_ROWS=n sets both for a run.
PAIR_ROWS_ENV = "SPECPLUG_PAIR_ROWS"
# (vendor, family): (from how many rows the 4- and 5-bit kinds run on tile pairs, the 8-bit ones).
# AMD family 25 is Zen 3 and Zen 4; of them only Zen 4 has AVX-512, the only path with tile pairs.
PAIR_ROWS_BY_CPU: dict[tuple[str, int], tuple[int, int]] = {("AuthenticAMD", 25): (1, 3)}
PAIR_ROWS_DEFAULT = (1, 1)


def _rows_from_env(name: str, least: int, meaning: str) -> int | None:
    """A row-count tuning forced by the environment variable `name` (None when unset); anything but
    a whole number of at least `least` is a ModelError that says what the number means."""
    forced = os.environ.get(name, "").strip()
    if not forced:
        return None
    if not forced.isdigit() or int(forced) < least:
        raise ModelError(f"{name}={forced!r}: give a whole number of rows, {least} or more ({meaning})")
    return int(forced)


def pair_rows() -> tuple[int, int]:
    """The row counts from which the AVX-512 linears run on tile pairs, (4- and 5-bit kinds, 8-bit
    kinds): ${PAIR_ROWS_ENV} for both when set, else this CPU's tuning (PAIR_ROWS_BY_CPU) or
    PAIR_ROWS_DEFAULT."""
    forced = _rows_from_env(PAIR_ROWS_ENV, 1, "linear calls of at least that many rows run on 512-bit tile pairs")
    if forced is not None:
        return forced, forced
    return PAIR_ROWS_BY_CPU.get(cpu_id(), PAIR_ROWS_DEFAULT)


# ---- the one-tile path's software prefetch, a tuning per CPU --------------------------------------
# On the 256-bit one-tile path (every linear of the AVX2 build; the AVX-512 build's below its pair
# threshold) a call of at most this many rows asks, block by block, for the weights 4 KB on
# (TILE_AHEAD in the kernels). Each build has its own default: 1 on AVX2, 0 on AVX-512, chosen when
# the prefetch asked for a whole tile two ahead at once (a Zen 3 ran one row 8% faster with it, a
# Zen 4 7-11% faster without, a Zen 1 1.24-1.30x faster without). Block by block, the
# Zen 1 runs one row 1.12x (Q4_1) to 1.37x (Q8_0) faster than with none and 2 rows 1.00-1.04x, 4 rows
# 0.98x (AMD EPYC, 2 threads, 2026-12-06, `scripts/interleaved_builds.py`, docs/results/runtime.md): 2 there. A CPU
# measured to want another gets an entry here; SPECPLUG_PREFETCH_ROWS=n sets it for a run (0: never).
# The same bits either way.
PREFETCH_ROWS_ENV = "SPECPLUG_PREFETCH_ROWS"
# (vendor, family): the rows. AMD family 23 is Zen 1, Zen+ and Zen 2 (measured: Zen 1).
PREFETCH_ROWS_BY_CPU: dict[tuple[str, int], int] = {("AuthenticAMD", 23): 2}
PREFETCH_ROWS_BUILT = {"avx2": 1, "avx512": 0}  # each build's own default (PREFETCH_ROWS in the kernels)


def _prefetch_tuning() -> int | None:
    """${PREFETCH_ROWS_ENV} when set, else this CPU's entry in PREFETCH_ROWS_BY_CPU; None: neither."""
    forced = _rows_from_env(PREFETCH_ROWS_ENV, 0, "linear calls of at most that many rows prefetch their "
                                                   "weight tiles; 0: never")
    return PREFETCH_ROWS_BY_CPU.get(cpu_id()) if forced is None else forced


def prefetch_rows(isa: str | None = None) -> int | None:
    """Up to how many rows a linear call on the one-tile path prefetches its weight tiles: the
    tuning (${PREFETCH_ROWS_ENV}, else PREFETCH_ROWS_BY_CPU), else the `isa` build's own default
    (None without an isa)."""
    tuned = _prefetch_tuning()
    return PREFETCH_ROWS_BUILT.get(isa) if tuned is None else tuned


def available_isas() -> list[str]:
    """The kernel paths this CPU can run, best first (empty: not an x86 CPU with AVX2)."""
    flags = _cpuinfo()[1]
    return [isa for isa in ISA_ORDER if all(f in flags for f in ISA_CPU_FLAGS[isa])]


def _isa_problem(isa: str | None) -> str | None:
    have = available_isas()
    if not have:
        return (f"the gguf kernels need an x86 CPU with AVX2, FMA and F16C "
                f"(torch reports {torch.backends.cpu.get_cpu_capability()})")
    if isa is None:
        return None
    if isa not in ISA_CFLAGS:
        return f"{ISA_ENV}={isa} is not a kernel path; choose one of {', '.join(ISA_CFLAGS)}"
    if isa not in have:
        missing = [f for f in ISA_CPU_FLAGS[isa] if f not in _cpuinfo()[1]]
        return f"{ISA_ENV}={isa}: this CPU lacks {', '.join(missing)}; it runs {', '.join(have)}"
    return None


def _forced_isa() -> str | None:
    return os.environ.get(ISA_ENV, "").strip().lower() or None


def chosen_isa() -> str:
    """The kernel path used: ${ISA_ENV} when set (checked against the CPU), else the best the CPU has."""
    forced = _forced_isa()
    problem = _isa_problem(forced)
    if problem:
        raise ModelError(problem)
    return forced or available_isas()[0]


def check_isa_env() -> None:
    """Raise ModelError when ${ISA_ENV} is set to a path that is unknown or that this CPU lacks."""
    forced = _forced_isa()
    if forced and available_isas():
        problem = _isa_problem(forced)
        if problem:
            raise ModelError(problem)


def unavailable_reason(isa: str | None = None) -> str | None:
    """Why the gguf path cannot run here (None = it can), without building anything."""
    try:
        isa = isa or chosen_isa()
    except ModelError as exc:
        return str(exc)
    return _isa_problem(isa) or _ext_error.get(isa)


def describe(isa: str | None = None) -> dict:
    """Where the kernels run, for results JSON: CPU model, the ISA path and its compiler flags."""
    isa = isa or (chosen_isa() if not unavailable_reason() else None)
    return {"cpu": cpu_model(), "isa": isa, "isa_flags": list(ISA_CFLAGS.get(isa, ())),
            "isas_available": available_isas(), "pair_rows": list(pair_rows()) if isa == "avx512" else None,
            "prefetch_rows": prefetch_rows(isa) if isa else None}


_CFLAGS = ("-O3", "-fopenmp")  # every ISA's build; ISA_CFLAGS adds its own
_LDFLAGS = ("-fopenmp",)


def build_key(isa: str = "avx2") -> str:
    """What the built kernels depend on: the sources (csrc/) and where they are, the compiler flags,
    torch and Python versions. Each key gets its own build folder, so two installs (checkouts, virtual
    environments) never rebuild each other's kernels: ninja rebuilds when the compile command changes,
    and the command names the source file's path, so two checkouts of the same sources sharing a
    folder would rebuild it each time the other had built (~2 min each on 2 cores)."""
    h = hashlib.sha256(str(_SRC).encode())
    for src in sorted(f for f in _SRC.parent.iterdir() if f.suffix in (".cpp", ".h")):  # kernels and headers
        h.update(src.name.encode() + src.read_bytes())
    h.update(json.dumps([_CFLAGS, ISA_CFLAGS[isa], _LDFLAGS, torch.__version__, sys.version_info[:2],
                         platform.machine()]).encode())
    return h.hexdigest()[:16]


def extensions_root() -> Path:
    """Where torch's extension builder keeps builds: TORCH_EXTENSIONS_DIR, or its default root."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def build_dir(isa: str = "avx2") -> Path:
    """The build folder of this install's kernels for one ISA (under extensions_root())."""
    return extensions_root() / f"specplug_gguf_{isa}_{build_key(isa)}"


def compile_kernels(folder: Path, isa: str, defines: Sequence[str] = (), verbose: bool = False):
    """Build (or load, when built) this checkout's kernels for `isa` in `folder`, the module named
    after the folder; `defines` (NAME or NAME=VALUE) are passed as -D flags (the tools' variants)."""
    from torch.utils.cpp_extension import load

    return load(name=folder.name, sources=[str(_SRC)],
                extra_cflags=[*_CFLAGS, *ISA_CFLAGS[isa], *[f"-D{d}" for d in defines]],
                extra_ldflags=list(_LDFLAGS), build_directory=str(folder), verbose=verbose)


def apply_tunings(ext, rows: tuple[int, int] | None = None) -> None:
    """Give a loaded kernel build this CPU's run-time tunings (the tile-pair thresholds, pair_rows(),
    or `rows`; the one-tile prefetch where this CPU or the environment sets it, prefetch_rows(), else
    the build keeps its own); every build the runtime or a tool loads gets them here. A build from
    before a tuning existed has no setter for it (or one threshold, not two) and takes what it can."""
    tuned = _prefetch_tuning()
    if tuned is not None and hasattr(ext, "set_prefetch_rows"):
        ext.set_prefetch_rows(tuned)
    if not hasattr(ext, "set_pair_rows"):
        return
    rows = pair_rows() if rows is None else rows
    if hasattr(ext, "byte_pair_rows"):
        ext.set_pair_rows(*rows)
    else:
        ext.set_pair_rows(rows[0])


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


def kernels(isa: str | None = None):
    """The compiled extension of `isa` (default: chosen_isa()), built on first call (~30 s; then
    loaded from the cache)."""
    reason = unavailable_reason(isa)
    if reason:
        raise ModelError(reason)
    isa = isa or chosen_isa()
    ext = _ext.get(isa)
    if ext is not None:
        return ext
    rows = pair_rows()  # a wrong ${PAIR_ROWS_ENV} or ${PREFETCH_ROWS_ENV} stops here, before any build
    _prefetch_tuning()
    with _lock:
        if isa not in _ext:
            say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
            folder = build_dir(isa)
            try:
                with build_lock(folder, say):
                    if not any(folder.glob(f"{folder.name}*.so")):
                        say(f"specplug: building the gguf CPU kernels for {isa} (~30 s) in {folder}...")
                    ext = compile_kernels(folder, isa, verbose=bool(os.environ.get("SPECPLUG_VERBOSE_BUILD")))
            except Exception as exc:  # no compiler, no ninja, a broken toolchain, an unwritable folder
                _ext_error[isa] = (f"could not build the gguf kernels ({isa}) in {folder} ({type(exc).__name__}: "
                                   f"{str(exc).strip()[-300:]}); install a C++ compiler and ninja, or use quant: none")
                raise ModelError(_ext_error[isa]) from None
            apply_tunings(ext, rows)
            _ext[isa] = ext
    return _ext[isa]


def k_quant_parts(blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A K-quant's super-blocks ([n, bytes]) as (q, d, m): integer values q [n, 256] (Q4_K 0..15, Q5_K
    0..31, Q6_K -32..31), float32 scales d per 32 values [n, 8] (Q6_K: per 16, [n, 16]) and offsets
    m per 32 [n, 8] (None for Q6_K), with weight = d * q + m.

    The index arithmetic is gguf's own dequantizer's (gguf.quants), stopped before the multiply:
    d = f16 d times the integer sub-block scale and m = -(f16 dmin times the integer min) are exact in
    float32, so d * q + m is bit for bit gguf's d * q - dm."""
    from gguf.quants import Q4_K

    b = np.ascontiguousarray(blocks).view(np.uint8)
    n = b.shape[0]
    if qtype in ("Q4_K", "Q5_K"):
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = Q4_K.get_scale_min(b[:, 4:16])
        rest = b[:, 16:]
        if qtype == "Q5_K":
            qh, qs = rest[:, :32], rest[:, 32:]
        else:
            qh, qs = None, rest
        q = (qs.reshape(n, -1, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
        q = q.reshape(n, -1, 32)
        if qh is not None:
            hi = (qh.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & np.uint8(1)
            q = q | (hi.reshape(n, -1, 32) << np.uint8(4))
        return (q.reshape(n, 256).astype(np.int16), d * sc.astype(np.float32),
                -(dmin * mn.astype(np.float32)))
    if qtype == "Q6_K":
        ql, qh, scales = b[:, :128], b[:, 128:192], b[:, 192:208]
        d = b[:, 208:210].copy().view(np.float16).astype(np.float32)
        lo = (ql.reshape(n, -1, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
        hi = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
        q = (lo.reshape(n, -1, 32) | (hi.reshape(n, -1, 32) << np.uint8(4))).astype(np.int16) - 32
        return q.reshape(n, 256), d * scales.view(np.int8).astype(np.float32), None
    raise ValueError(qtype)


def _q5_values(qs: np.ndarray, qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 blocks' 5-bit values 0..31 ([n, 32]) from their 16 nibble bytes and 4 high-bit
    bytes, in gguf's order (value i: low nibble of byte i, value 16 + i: high nibble; bit i of qh)."""
    n = qs.shape[0]
    hi = (np.ascontiguousarray(qh).view("<u4").reshape(n, 1) >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
    lo = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)
    return (lo | (hi.astype(np.uint8) << np.uint8(4))).astype(np.uint8)


def common_blocks(parts: list[tuple[np.ndarray, str]]) -> list[tuple[np.ndarray, str]]:
    """The parts of one linear (q/k/v: each [rows, bytes] and its type) in blocks that can be
    stacked: Q5_0 or Q4_0 beside Q8_0 or each other (a Q4_K_M file's q/k beside its v) as the Q8_0
    blocks of the same weights (a signed byte times the same float16 d); otherwise as stored."""
    types = {qt for _, qt in parts}
    if len(types) == 1 or not types <= {"Q8_0", *TO_Q8_0}:
        return parts
    return [as_q8_0_rows(raw, qt) for raw, qt in parts]


def as_q8_0_rows(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, str]:
    """A tensor's rows ([rows, bytes]) as Q8_0 rows of the same weights if they are Q5_0 or Q4_0, else
    as they are."""
    if qtype not in TO_Q8_0:
        return raw, qtype
    rows = np.ascontiguousarray(raw).view(np.uint8).reshape(raw.shape[0], -1)
    return TO_Q8_0[qtype](rows).reshape(rows.shape[0], -1), "Q8_0"


def q4_0_as_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 blocks ([n, 18]: f16 d, 16 bytes of nibbles, value i the low nibble of byte i and 16 + i
    the high one) as the Q8_0 blocks ([n, 34]) of the same weights: (q - 8) as int8 beside the same d."""
    b = np.ascontiguousarray(blocks).view(np.uint8).reshape(-1, Q4_0_BLOCK)
    out = np.empty((b.shape[0], 34), np.uint8)
    out[:, :2] = b[:, :2]
    q = np.concatenate([b[:, 2:] & np.uint8(0x0F), b[:, 2:] >> np.uint8(4)], axis=1).astype(np.int16) - 8
    out[:, 2:] = q.astype(np.int8).view(np.uint8)
    return out


def q5_0_as_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 blocks ([n, 22]: f16 d, 4 bytes of high bits, 16 of nibbles) as the Q8_0 blocks ([n, 34])
    of the same weights: (q - 16) as int8 beside the same d, so exactly the same values."""
    b = np.ascontiguousarray(blocks).view(np.uint8).reshape(-1, 22)
    out = np.empty((b.shape[0], 34), np.uint8)
    out[:, :2] = b[:, :2]
    out[:, 2:] = (_q5_values(b[:, 6:], b[:, 2:6]).astype(np.int16) - 16).astype(np.int8).view(np.uint8)
    return out


# the types whose blocks are a signed byte times a float16 d, as Q8_0's ((q - 8) d, (q - 16) d): their
# blocks as the Q8_0 blocks of the same weights
TO_Q8_0 = {"Q4_0": q4_0_as_q8_0, "Q5_0": q5_0_as_q8_0}


def _f16_as_i16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16))


class QuantLinear:
    """y = x @ W.T (+ bias) with W in tiles of 8 output rows of Q4_0, Q4_1, Q5_0, Q8_0 or K-quant blocks.

    `norm_weight` makes `norm_linear(x)` = linear(rms_norm(x) * norm_weight), fused into
    the activation quantization.
    """

    def __init__(self, kind: str, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, out_features: int,
                 bias: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None):
        # read every step, streamed: on 2 MB pages where the OS gives them (specplug.runtime.pages)
        self.kind, self.qs, self.d = kind, pages.place(qs), pages.place(d)
        self.m = None if m is None else pages.place(m)
        self.out_features = out_features
        # the bias is read a whole tile at a time: pad it to the tiled width
        self.bias = None if bias is None else torch.nn.functional.pad(bias.float(), (0, (-out_features) % 8))
        self.norm_weight = None if norm_weight is None else norm_weight.float().contiguous()
        self.k = kernels()

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_blocks(cls, raw: np.ndarray, qtype: str, shape: tuple[int, int], **kw) -> "QuantLinear":
        """From a GGUF tensor's raw bytes ([rows, bytes per row]) of type Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or a
        K-quant."""
        n, k = shape
        nb = k // 32
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)
        if qtype in K_QUANTS:
            return cls.from_k_quant(raw, qtype, shape, **kw)
        if qtype == "Q5_0":  # (u - 16) d: the nibbles as Q4_1's, a plane of the fifth bits beside them (_q5_0)
            blocks = raw.reshape(n, nb, Q5_0_BLOCK)
            d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
            qh = blocks[:, :, 2:6].copy().view("<u4")[..., 0]
            return cls._q5_0(blocks[:, :, 6:], qh, d, n, **kw)
        if qtype == "Q5_1":  # q d + m with q in 0..31: Q5_K's unsigned bytes, the scales widened
            blocks = raw.reshape(n, nb, 24)
            d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
            m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            return cls._q8_0(_q5_values(blocks[:, :, 8:].reshape(n * nb, 16), blocks[:, :, 4:8].reshape(n * nb, 4))
                             .reshape(n, nb, 32).astype(np.uint8), d, n, m=m, kind="q5_k", **kw)
        if qtype == "Q8_0":
            blocks = raw.reshape(n, nb, Q8_0_BLOCK)
            return cls._q8_0(blocks[:, :, 2:], blocks[:, :, :2].copy().view(np.float16)[..., 0], n, **kw)
        if qtype == "Q4_1":
            blocks = raw.reshape(n, nb, Q4_1_BLOCK)
            d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
            m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0]
            return cls._q4_1(blocks[:, :, 4:], d, m, n, **kw)
        if qtype == "Q4_0":  # (q - 8) d: Q4_1's nibble tiles, no offsets; the kernels' dot starts at -8 sum(x)
            blocks = raw.reshape(n, nb, Q4_0_BLOCK)
            d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
            return cls._q4_1(blocks[:, :, 2:], d, None, n, kind="q4_0", **kw)
        raise ValueError(qtype)

    @classmethod
    def from_k_quant(cls, raw: np.ndarray, qtype: str, shape: tuple[int, int], **kw) -> "QuantLinear":
        """Q4_K / Q5_K / Q6_K rows as their integer values and float32 scales per 32 (Q6_K: per 16)
        values, which represent exactly the weights gguf's dequantizer computes (k_quant_parts)."""
        n, k = shape
        q, d, m = k_quant_parts(raw.reshape(n * (k // 256), -1), qtype)
        nb = k // 32
        q, d = q.reshape(n, nb, 32), d.reshape(n, nb, -1)
        if qtype == "Q4_K":  # GGUF's Q4_1 nibble pairing: byte i holds values i and 16 + i
            nib = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
            return cls._q4_1(nib, d[..., 0], m.reshape(n, nb), n, kind="q4_k", **kw)
        if qtype == "Q5_K":
            return cls._q8_0(q.astype(np.uint8), d[..., 0], n, m=m.reshape(n, nb), kind="q5_k", **kw)
        return cls._q8_0(q.astype(np.int8).view(np.uint8), d, n, kind="q6_k", **kw)

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

    @staticmethod
    def _scale_tiles(a: np.ndarray, nt: int, nb: int) -> torch.Tensor:
        """Per-block scales [rows, nb(, 2)] -> [tile, block(, 2), column]: float16 ones as int16 bits
        (the kernels widen them), float32 ones as they are."""
        per = a.shape[2] if a.ndim == 3 else 1
        t = np.ascontiguousarray(a.reshape(nt, 8, nb, per).transpose(0, 2, 3, 1).reshape(nt, nb * per, 8))
        return _f16_as_i16(t) if t.dtype == np.float16 else torch.from_numpy(t.astype(np.float32))

    @classmethod
    def _q4_1(cls, nibbles: np.ndarray, d: np.ndarray, m: np.ndarray | None, n: int, kind: str = "q4_1",
              **kw) -> "QuantLinear":
        """Nibble tiles: Q4_1 and Q4_K (q d + m), Q4_0 (m None: (q - 8) d)."""
        nib, d = cls._pad_rows(nibbles, n), cls._pad_rows(d, n)
        nt, nb = nib.shape[0] // 8, nib.shape[1]
        # [tile, col, block, p, i] -> [tile, block, p, col, i]: byte j = 4p + i keeps GGUF's nibble pairing
        qs = nib.reshape(nt, 8, nb, 4, 4).transpose(0, 2, 3, 1, 4).reshape(nt, nb, 128)
        mt = None if m is None else cls._scale_tiles(cls._pad_rows(m, n), nt, nb)
        return cls(kind, torch.from_numpy(np.ascontiguousarray(qs)), cls._scale_tiles(d, nt, nb), mt, n, **kw)

    @classmethod
    def _q5_0(cls, nibbles: np.ndarray, qh: np.ndarray, d: np.ndarray, n: int, **kw) -> "QuantLinear":
        """Q5_0 tiles, 160 bytes a block: Q4_1's 128 nibble bytes (the values' low 4 bits; load p's
        byte c*4+i holds column c's values 4p+i and 16+4p+i), then a plane of the fifth bits, 32 bytes:
        bit 2p of byte c*4+i is the fifth bit of value 4p+i, bit 2p+1 that of value 16+4p+i."""
        nib, qh, d = cls._pad_rows(nibbles, n), cls._pad_rows(qh, n), cls._pad_rows(d, n)
        nt, nb = nib.shape[0] // 8, nib.shape[1]
        qs = nib.reshape(nt, 8, nb, 4, 4).transpose(0, 2, 3, 1, 4).reshape(nt, nb, 128)
        value = np.arange(32, dtype=np.uint32).reshape(2, 4, 4)  # [half, p, i] -> 16 half + 4p + i
        bits = (qh.astype(np.uint32).reshape(nt, 8, nb, 1, 1, 1) >> value) & np.uint32(1)  # [t, c, b, half, p, i]
        bits = bits.transpose(0, 2, 1, 5, 4, 3).reshape(nt, nb, 32, 8)  # [t, b, c*4+i, 2p+half]
        plane = (bits << np.arange(8, dtype=np.uint32)).sum(-1, dtype=np.uint32).astype(np.uint8)
        tiles = np.concatenate([qs, plane], axis=2)
        return cls("q5_0", torch.from_numpy(np.ascontiguousarray(tiles)), cls._scale_tiles(d, nt, nb), None, n, **kw)

    @classmethod
    def _q8_0(cls, qbytes: np.ndarray, d: np.ndarray, n: int, m: np.ndarray | None = None, kind: str = "q8_0",
              **kw) -> "QuantLinear":
        """Byte tiles: Q8_0 (signed, float16 scales), Q5_K (unsigned 0..31, float32 scales and
        offsets m), Q6_K (signed -32..31, two float32 scales a block: d is [rows, nb, 2])."""
        qb, d = cls._pad_rows(qbytes, n), cls._pad_rows(d, n)
        nt, nb = qb.shape[0] // 8, qb.shape[1]
        qs = qb.reshape(nt, 8, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(nt, nb, 256)
        mt = None if m is None else cls._scale_tiles(cls._pad_rows(m, n), nt, nb)
        return cls(kind, torch.from_numpy(np.ascontiguousarray(qs)), cls._scale_tiles(d, nt, nb), mt, n, **kw)

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
        if self.kind == "q8_0":
            return self.k.matmul_q8_0(xa, self.qs, self.d, self.bias, residual, self.out_features)
        return self.k.matmul(xa, self.qs, self.d, self.m, self.bias, residual, self.out_features)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.matmul(self.quantize(x.contiguous()), residual)

    def norm_linear(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        return self.matmul(self.quantize(x.contiguous(), True, eps))
