"""Where a figure was measured: one dict every results JSON carries, and the line its report prints.

The machines the project's figures come from change, and a ratio between runs on two machines
means nothing, so each result says what ran it: the CPU model, the gguf kernels' instruction-set
path and its compiler flags, the threads, the GPU where one was used, and the torch / specplug
versions and git commit.

Its imports of torch and the runtime are inside the functions: `specplug.bench.cli` imports this
module as the CLI builds its parser, and describing the machine is the only part that needs them.
"""
from __future__ import annotations

import functools
import os
import platform
import subprocess
from pathlib import Path


@functools.lru_cache(maxsize=1)
def _git_commit() -> str | None:
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specplug")
    except PackageNotFoundError:
        return None


def describe(device: str | None = None) -> dict:
    """The machine and software of this process (cheap: nothing is built or loaded)."""
    import torch

    from specplug.runtime import native

    isa = None if native.unavailable_reason() else native.chosen_isa()
    info = {"cpu": native.cpu_model(), "machine": platform.machine(), "cores": len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity") else os.cpu_count(), "threads": torch.get_num_threads(),
            "kernel_isa": isa, "kernel_flags": list(native.ISA_CFLAGS.get(isa, ())),
            "isas_available": native.available_isas(), "torch": torch.__version__,
            "specplug": _version(), "commit": _git_commit()}
    if device is not None and str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    if isa == "avx512":
        try:
            info["kernel_pair_rows"] = list(native.pair_rows())
        except Exception as exc:  # a wrong SPECPLUG_PAIR_ROWS: the loader says so; a report only records it
            info["kernel_pair_rows"] = f"unknown ({exc})"
    if isa is not None:
        try:
            info["kernel_prefetch_rows"] = native.prefetch_rows(isa)
        except Exception as exc:  # a wrong SPECPLUG_PREFETCH_ROWS: the loader says so; a report only records it
            info["kernel_prefetch_rows"] = f"unknown ({exc})"
    info["pages"] = _pages()
    return info


def _pages() -> str:
    """Which pages the CPU runtime asks for its weights and caches (specplug.runtime.pages)."""
    from specplug.runtime import pages

    try:
        on = pages.enabled()
    except Exception as exc:  # a wrong SPECPLUG_HUGE_PAGES: the loader says so; a report only records it
        return f"unknown ({exc})"
    return f"2 MB (THP {pages.thp_mode()})" if on else f"4 KB (THP {pages.thp_mode()}, {pages.ENV}=" \
        f"{os.environ.get(pages.ENV)})"


def _pairs(rows) -> str:
    """' (tile pairs from 1 rows, 8-bit kinds from 3)' for a report line; '' where not recorded."""
    if not rows:
        return ""
    if isinstance(rows, list) and len(rows) == 2:  # (4- and 5-bit kinds, 8-bit kinds)
        return f" (tile pairs from {rows[0]} rows" + (f", 8-bit kinds from {rows[1]})" if rows[1] != rows[0] else ")")
    return f" (tile pairs from {rows} rows)"  # one threshold (results before two), or why unknown


def line(info: dict) -> str:
    """One line for a report: 'machine: AMD EPYC, 2 cores, 2 threads, kernels avx512; torch ...'."""
    parts = [f"machine: {info.get('cpu')}", f"{info.get('cores')} cores", f"{info.get('threads')} threads",
             f"kernels {info.get('kernel_isa') or 'none'}" +
             _pairs(info.get("kernel_pair_rows"))]
    if info.get("pages"):
        parts.append(f"pages {info['pages']}")
    if info.get("gpu"):
        parts.append(f"GPU {info['gpu']}")
    parts.append(f"torch {info.get('torch')}, specplug {info.get('specplug')} @ {info.get('commit') or '?'}")
    return ", ".join(parts)
