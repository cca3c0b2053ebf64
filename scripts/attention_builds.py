"""Attention kernels side by side: builds timed on SmolLM2-135M's shapes (9 query heads, 3 K/V
heads, head_dim 64, a float16 cache), one sequence with k rows at the end of `--ctx` positions,
one call per layer over 30 layers' caches, alternated in rounds; medians. Builds as in
`scripts/kernel_builds.py`: `avx2`, `avx512` (this checkout's) or a cached build folder
(`specplug_gguf_<isa>_<key>`) to time a change against the kernels before it.
`--dtypes float16 float32` times each build on both cache types (the kernels take either).

The caches are one [layers, ...] tensor on 2 MB pages, as the runtime's KVCache holds them. The 30
layers' K/V (11.8 MB at 512 positions) stay in a 32 MB L3 across the calls, where in a forward the
weights stream ~2.2 MB between two layers' attention and evict them: `--cold` walks that much of a
separate buffer (loads only, `stream_dots`, on the same threads) before each call and times the
calls alone, so the K/V come from memory as in the forward (on the AMD EPYC Zen 4, 2026-11-29, that adds
0.3-0.4 ms to 30 calls at every row count; a prefetch distance tuned without it was tuned on L3).

    python scripts/attention_builds.py --builds specplug_gguf_avx512_<old>,avx512 --threads 2
    python -m scripts.attention_builds --builds avx512 --dtypes float16 float32 --rounds 4 --reps 20
    python -m scripts.attention_builds --builds specplug_gguf_<before>,specplug_gguf_<after> --cold --ks 1 2 4 8
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from scripts.kernel_builds import load_build
from specplug import machine
from specplug.runtime import pages

H, HKV, D, LAYERS = 9, 3, 64, 30


def case(ctx: int, k: int, seed: int = 0, dtype: torch.dtype = torch.float16):
    g = torch.Generator().manual_seed(seed)
    kc, vc = (pages.zeros((LAYERS, 1, HKV, ctx + k, D), dtype) for _ in range(2))  # as KVCache holds them
    for layer in range(LAYERS):
        kc[layer].copy_(torch.randn(1, HKV, ctx + k, D, generator=g).half())
        vc[layer].copy_(torch.randn(1, HKV, ctx + k, D, generator=g).half())
    caches = [(kc[layer], vc[layer]) for layer in range(LAYERS)]
    valid = torch.zeros(1, ctx + k, dtype=torch.bool)
    valid[0, :ctx + k] = True
    q = torch.randn(k, (H + 2 * HKV) * D, generator=g)
    seq = torch.zeros(k, dtype=torch.int32)
    pos = torch.arange(ctx, ctx + k, dtype=torch.int32)
    return q, caches, seq, pos, valid


# bytes of weights a forward of SmolLM2-135M Q4_1 streams between two layers' attention calls: its
# layers' 66.3 MB over 30 (the other 30.1 MB of the 96.4 it reads, the output head, once a forward)
WEIGHTS_A_LAYER = 66_300_000 // LAYERS


def time_forward(kern, c, reps: int, cold=None) -> float:
    """Median ms of `reps` passes of one attention call per layer, the calls alone timed; with `cold`
    (a list of one buffer a layer), each call after a walk of its layer's buffer."""
    q, caches, seq, pos, valid = c
    out = []
    for _ in range(reps):
        total = 0.0
        for layer, (kc, vc) in enumerate(caches):
            if cold is not None:
                kern.stream_dots(cold[layer], [], 0, 4, 1, 0)  # the weights' loads between two layers
            t = time.perf_counter()
            kern.attention(q, kc, vc, seq, pos, valid, H, D ** -0.5, None, 0)
            total += time.perf_counter() - t
        out.append(total)
    return statistics.median(out) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builds", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--dtypes", nargs="+", default=["float16"], choices=["float16", "float32"],
                   help="K/V cache types to time each build on (same values: float16 ones, widened)")
    p.add_argument("--cold", action="store_true",
                   help="walk a layer's share of the weights before each call, so the K/V come from memory")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    loaded = {b: load_build(b) for b in a.builds.split(",")}
    keys = [(ctx, k) for ctx in a.ctx for k in a.ks]
    cases = {t: {key: case(*key, dtype=getattr(torch, t)) for key in keys} for t in a.dtypes}
    # a timed variant: a build on one cache type (named by the build alone when there is one type)
    variants = {(b if len(a.dtypes) == 1 else f"{b}/{t}"): (loaded[b], t) for b in loaded for t in a.dtypes}
    names = list(variants)

    def attend(n, key):
        kern, t = variants[n]
        c = cases[t][key]
        return kern.attention(c[0], *c[1][0], *c[2:], H, D ** -0.5, None, 0)

    if len(a.dtypes) == 1:  # one cache type: builds of one source agree bit for bit; say where they do not
        ref = {key: attend(names[0], key) for key in keys}
        for n in names[1:]:
            diff = max((attend(n, key) - ref[key]).abs().max().item() for key in keys)
            if diff:
                print(f"# {n} differs from {names[0]} by up to {diff:.3g} (a change of summation order?)")
    cold = [pages.zeros((WEIGHTS_A_LAYER,), torch.uint8).fill_(1) for _ in range(LAYERS)] if a.cold else None
    ms = {(n, key): [] for n in names for key in keys}
    for r in range(a.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            for key in keys:
                ms[(n, key)].append(time_forward(variants[n][0], cases[variants[n][1]][key], a.reps, cold))
    rows = []
    print(f"# {machine.line(machine.describe('cpu'))}; threads {a.threads}; {LAYERS} layers' calls"
          f"{', each after a walk of ' + str(WEIGHTS_A_LAYER // 1000) + ' kB of other memory' if a.cold else ''}, "
          f"medians of {a.rounds} rounds")
    print("| build | ctx | k | ms (30 layers) | vs first |")
    print("|---|---|---|---|---|")
    for key in keys:
        base = statistics.median(ms[(names[0], key)])
        for n in names:
            m = statistics.median(ms[(n, key)])
            rows.append({"build": n, "ctx": key[0], "k": key[1], "ms": m})
            print(f"| {n} | {key[0]} | {key[1]} | {m:.3f} | {base / m:.2f}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine.describe("cpu"), "threads": a.threads, "cold": a.cold, "rows": rows,
                       "command": "python scripts/attention_builds.py "
                                  + " ".join(f"--{k} {v}" for k, v in vars(a).items())}, f, indent=1)


if __name__ == "__main__":
    main()
