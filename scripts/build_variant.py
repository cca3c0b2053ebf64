"""Build this checkout's `gguf` kernels with extra `-D` defines, as a variant to time beside the
regular build: into the torch extensions cache as `specplug_gguf_<tag>`, the name that
`scripts/interleaved_builds.py`, `scripts/kernel_builds.py` and `scripts/attention_builds.py` take
in `--builds`. The kernels' tunings that are compile-time values (PAIR_AHEAD, ZMM_RT, ATT_AHEAD,
SPECPLUG_ZMM, SPECPLUG_EMBED_BCAST, ... in specplug/runtime/csrc) are tried this way; a change to the
source is tried by building the old source under one tag and the new under another.

    python scripts/build_variant.py before                       # the source as it is now
    python scripts/build_variant.py ahead2 PAIR_AHEAD=-2          # one define
    ISA=avx2 python scripts/build_variant.py avx2_noprefetch PREFETCH_ROWS=0   # (*)
    python scripts/interleaved_builds.py --builds avx512,specplug_gguf_ahead2 --what forward

(*) A define that is also a run-time tuning is only the build's default: native.apply_tunings gives
every build loaded the tuning instead (ZMM_ROWS always: pair_rows; PREFETCH_ROWS where this CPU or
SPECPLUG_PREFETCH_ROWS sets one).
"""
from __future__ import annotations

import argparse
import os
import re

from specplug.runtime import native


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tag", help="the build is named specplug_gguf_<tag>")
    p.add_argument("defines", nargs="*", help="NAME=VALUE (or NAME), passed as -DNAME=VALUE")
    p.add_argument("--isa", default=os.environ.get("ISA", "avx512"), choices=sorted(native.ISA_CFLAGS),
                   help="the instruction set's flags (default: $ISA or avx512)")
    a = p.parse_args()
    if not re.fullmatch(r"\w+", a.tag):
        raise SystemExit(f"tag {a.tag!r}: letters, digits and _ only (it names a Python module)")
    for d in a.defines:
        if not re.fullmatch(r"[A-Za-z_]\w*(=\S+)?", d):
            raise SystemExit(f"define {d!r}: NAME or NAME=VALUE")
    folder = native.extensions_root() / f"specplug_gguf_{a.tag}"
    folder.mkdir(parents=True, exist_ok=True)
    native.compile_kernels(folder, a.isa, a.defines)
    defines = " ".join("-D" + d for d in a.defines)
    print(f"built {folder.name} ({a.isa}{', ' if a.defines else ''}{defines}) in {folder}")


if __name__ == "__main__":
    main()
