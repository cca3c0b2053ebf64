"""The integer dot-product instruction's own ceiling on this CPU, for the `gguf` kernels' roofline.

The kernels' inner step is one 8-bit multiply-add into 32 bits: vpdpbusd (AVX-512 VNNI) on 256-bit
registers. This times that instruction alone, on 16 independent accumulators (so its latency is
hidden), on 256-bit (ymm) and 512-bit (zmm) registers, one thread, and prints multiply-adds per
second. Compare with `specplug bench-runtime --profile`'s "kernel peak" (the matmul on cache-resident
weights): where they match, the kernel's compute is at the instruction's limit, and only fewer
instructions per weight (not a different schedule) could make k-row verification cheaper.
Needs a C compiler (cc) and an AVX-512 VNNI CPU.

    python scripts/isa_peak.py --json docs/results/isa-peak-<date>.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

from specplug import machine

SRC = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define CH 16
int main(void) {
  const long n = 400000000L;
  __m256i a[CH]; __m512i z[CH];
  __m256i x = _mm256_set1_epi8(3), y = _mm256_set1_epi8(5);
  __m512i zx = _mm512_set1_epi8(3), zy = _mm512_set1_epi8(5);
  for (int i = 0; i < CH; i++) { a[i] = _mm256_setzero_si256(); z[i] = _mm512_setzero_si512(); }
  double t = now();
  for (long i = 0; i < n / CH; i++) {
    for (int j = 0; j < CH; j++) a[j] = _mm256_dpbusd_epi32(a[j], x, y);
    __asm__ volatile("" : "+x"(x));
  }
  const double ty = now() - t;
  t = now();
  for (long i = 0; i < n / CH; i++) {
    for (int j = 0; j < CH; j++) z[j] = _mm512_dpbusd_epi32(z[j], zx, zy);
    __asm__ volatile("" : "+v"(zx));
  }
  const double tz = now() - t;
  long s = 0;
  for (int j = 0; j < CH; j++) s += _mm256_extract_epi32(a[j], 0) + _mm512_reduce_add_epi32(z[j]);
  printf("ymm %.4f zmm %.4f check %ld\n", n / ty * 32 / 1e9, n / tz * 64 / 1e9, s);
  return 0;
}
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "peak.c"), os.path.join(d, "peak")
        with open(src, "w") as f:
            f.write(SRC)
        subprocess.run([os.environ.get("CC", "cc"), "-O2", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni",
                        src, "-o", exe], check=True)
        runs = []
        for _ in range(args.runs):
            out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout
            m = re.search(r"ymm ([\d.]+) zmm ([\d.]+)", out)
            runs.append({"ymm_gmac_s": float(m.group(1)), "zmm_gmac_s": float(m.group(2))})
    best = {k: max(r[k] for r in runs) for k in runs[0]}
    print(f"vpdpbusd, one thread: 256-bit {best['ymm_gmac_s']:.1f} G MAC/s, 512-bit {best['zmm_gmac_s']:.1f} G MAC/s "
          f"(best of {args.runs})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "machine": machine.describe("cpu"), "runs": runs, "best": best},
                      f, indent=1)


if __name__ == "__main__":
    main()
