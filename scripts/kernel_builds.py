"""Kernel builds side by side on the real target, alternated in rounds: decode at ctx 128, T(k) (one
forward of k rows after 512 tokens) and prefill 512, as `specplug bench-runtime` measures them.

A build is `avx2` or `avx512` (this checkout's, built on first use) or the name of a folder in the
torch extensions cache holding an older build (`specplug_gguf_<key>`), so a change can be timed
against the kernels before it in one process, with the same Python around them.

    python scripts/kernel_builds.py --builds avx2,avx512 --threads 2 --rounds 3 --json out.json
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import statistics
import sys

from specplug import machine
from specplug.bench_runtime import _median_ms
from specplug.runtime import load_target, native
from specplug.runtime.native import QuantLinear

KS = (1, 2, 4, 8, 16)


def load_build(name: str):
    if name in native.ISA_CFLAGS:
        return native.kernels(name)
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    so = glob.glob(os.path.join(root, name, "*.so"))
    if not so:
        raise SystemExit(f"no built kernels in {os.path.join(root, name)}")
    spec = importlib.util.spec_from_file_location(os.path.basename(so[0])[:-3], so[0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builds", required=True, help="comma-separated: avx2, avx512 or cached build folders")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    names = args.builds.split(",")
    builds = {n: load_build(n) for n in names}
    m = load_target(args.model, device="cpu", quant="gguf", threads=args.threads).model
    lins = [lin for layer in m.layers for lin in layer.linears()] + [m.head]

    def use(k) -> None:
        for lin in lins:
            if isinstance(lin, QuantLinear):
                lin.k = k
        for layer in m.layers:
            layer._k = k

    cache = m.new_cache(1, 2048)

    def timed(fn, n: int) -> float:
        return _median_ms(fn, n, warmup=3)

    def fill(ctx: int) -> None:
        cache.clear(0)
        m.forward(list(range(100, 100 + ctx)), list(range(ctx)), [0] * ctx, cache, logits_rows=None)

    def step(ctx: int, k: int):
        def f():
            m.forward([7] * k, list(range(ctx, ctx + k)), [0] * k, cache, logits_rows=None)
            cache.seq_rm(0, ctx)
        return f

    runs: dict = {}
    for rnd in range(args.rounds):
        for n in (names if rnd % 2 == 0 else names[::-1]):
            use(builds[n])
            r = {}
            fill(128)
            r["decode128"] = timed(step(128, 1), 40)
            fill(512)
            for k in KS:
                r[f"T{k}"] = timed(step(512, k), 40)
            r["prefill_tok_s"] = 512 / (timed(lambda: fill(512), 5) / 1e3)
            runs.setdefault(n, []).append(r)
    medians = {}
    for n in names:
        med = {key: statistics.median(r[key] for r in runs[n]) for key in runs[n][0]}
        med.update({f"T{k}/T1": statistics.median(r[f"T{k}"] / r["T1"] for r in runs[n]) for k in KS})
        medians[n] = {k: round(v, 3) for k, v in med.items()}
        print(n, json.dumps(medians[n]))
    for n in names[1:]:
        a, b = medians[names[0]], medians[n]
        print(f"{n} vs {names[0]}: decode {a['decode128'] / b['decode128']:.2f}x, prefill "
              f"{b['prefill_tok_s'] / a['prefill_tok_s']:.2f}x, T(1) {a['T1'] / b['T1']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "machine": machine.describe("cpu"), "threads": args.threads,
                       "rounds": args.rounds, "medians": medians, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
