"""Weights and KV caches on 2 MB pages (Linux transparent huge pages), where the kernels stream them.

A decoding step reads every weight once (96 MB for SmolLM2-135M Q4_1) and, at long contexts, much
of the KV cache. On 4 KB pages that is one TLB entry per 4 KB: the second-level TLB of a Zen 4 core
covers 12 MB, so most pages of a step miss it and the core walks the page table as it streams. On
2 MB pages the weights need 48 entries. Measured side by side on an AMD EPYC Zen 4 (2 threads, the
same bytes in both, scripts/huge_pages_ab.py): one-row forwards after 512 tokens 1.14-1.15x faster,
four rows 1.10-1.15x, decode in the engine on MT-bench 1.04x (docs/results/runtime.md).

Linux gives anonymous memory 2 MB pages where a mapping asks for them (`madvise(MADV_HUGEPAGE)`,
which THP's default "madvise" mode honours) and a 2 MB-aligned extent of it is touched. torch's
allocator does not ask, so the loader moves what it streams into mappings that do:

- `place(t)` copies a CPU tensor into a shared arena of 2 MB-aligned chunks (weights: the quantized
  linears' tiles and scales, set at load, read every step);
- `zeros(shape, dtype)` gives a zeroed tensor on a mapping of its own (a KV cache of 2 MB or more).

Tensors made here are ordinary CPU tensors over an `mmap` object; each keeps its mapping alive, so
memory is returned when the last tensor of a chunk goes. The values are the same bytes: the kernels
compute the same bits. Elsewhere (not Linux, THP set to "never", a device other than the CPU,
`SPECPLUG_HUGE_PAGES=0`) both return what torch would. `huge_page_bytes(tensors)` reads back from
/proc/self/smaps how much of them the kernel did put on 2 MB pages (it may refuse under
fragmentation: then the tensors work as before, on 4 KB pages).
"""
from __future__ import annotations

import functools
import math
import mmap
import os
import sys
import threading
from typing import Iterable

import torch

from specplug.errors import ModelError

HUGE = 2 << 20  # bytes of a huge page (x86-64, arm64 with 4 KB base pages)
CHUNK = 32 << 20  # an arena chunk; a tensor larger than a chunk gets a mapping of its own
ALIGN = 64  # each placed tensor starts on a cache line
ENV = "SPECPLUG_HUGE_PAGES"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache  # read once: every placed tensor asks (`enabled`)
def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"), or None where unknown."""
    try:
        with open(THP_MODE) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def enabled() -> bool:
    """Whether `place` and `zeros` ask for 2 MB pages: on Linux with THP not "never", unless
    SPECPLUG_HUGE_PAGES=0. Another value of it is a ModelError (the model loader checks first)."""
    env = os.environ.get(ENV, "").strip().lower()
    if env in ("0", "false", "no", "off"):
        return False
    if env and env not in ("1", "true", "yes", "on"):
        raise ModelError(f"{ENV}={os.environ[ENV]!r}: use 1 (ask for 2 MB pages, the default on Linux) or 0 (4 KB "
                         f"pages)")
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def _mapping(nbytes: int) -> tuple[torch.Tensor, int]:
    """A new anonymous mapping asking for huge pages, as a uint8 tensor, and the offset of its first
    2 MB boundary (the mapping is one huge page longer, so `nbytes` fit from there)."""
    mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)  # before any page is touched: the faults then take 2 MB pages
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # holds `mm`: unmapped when no tensor uses it
    return whole, (-whole.data_ptr()) % HUGE


class Arena:
    """Bump allocation in 2 MB-aligned chunks of CHUNK bytes (thread-safe). Only the chunk being
    filled is referenced here; a full chunk lives as long as tensors placed in it."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self._lock = threading.Lock()
        self._buf: torch.Tensor | None = None
        self._off = self._end = 0

    def alloc(self, nbytes: int) -> torch.Tensor:
        """`nbytes` uninitialized bytes (uint8) starting on a cache line."""
        if nbytes > self.chunk // 2:  # large: a mapping of its own, 2 MB-aligned
            whole, off = _mapping(nbytes)
            return whole[off:off + nbytes]
        with self._lock:
            off = -(-self._off // ALIGN) * ALIGN
            if self._buf is None or off + nbytes > self._end:
                self._buf, off = _mapping(self.chunk)
                self._end = off + self.chunk
            self._off = off + nbytes
            return self._buf[off:off + nbytes]


_arena = Arena()


def place(t: torch.Tensor) -> torch.Tensor:
    """`t` (a CPU tensor) copied into 2 MB-page memory where `enabled()`; else `t` itself."""
    if t.device.type != "cpu" or t.numel() == 0 or not enabled():
        return t
    out = _arena.alloc(t.nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape, dtype, device), on a mapping of its own asking for 2 MB pages where the
    device is the CPU, `enabled()` and the tensor fills at least one such page (a smaller one would
    hold a whole 2 MB page once touched); anonymous pages are zero: nothing is written."""
    device = torch.device(device)
    nbytes = math.prod(int(n) for n in shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < HUGE or not enabled():
        return torch.zeros(shape, dtype=dtype, device=device)
    whole, off = _mapping(nbytes)
    return whole[off:off + nbytes].view(dtype).view(shape)


def huge_page_bytes(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(bytes on 2 MB pages, bytes in all) of the mappings holding these CPU tensors, from
    /proc/self/smaps (AnonHugePages of each mapping that holds one, counted once); (0, total)
    where smaps is not readable."""
    spans = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors if t.device.type == "cpu" and t.numel()]
    total = sum(b - a for a, b in spans)
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0, total
    huge = 0
    holds = False
    for line in lines:
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            lo, hi = (int(x, 16) for x in head.split("-"))
            holds = any(lo <= a < hi for a, _ in spans)
        elif holds and line.startswith("AnonHugePages:"):
            huge += int(line.split()[1]) * 1024
    return min(huge, total), total
