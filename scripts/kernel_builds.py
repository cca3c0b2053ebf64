"""Kernel builds side by side on the real target, alternated in rounds: decode at ctx 128 and T(k) (one
forward of k rows after 512 tokens) as `specplug bench-runtime` measures them, and prefill 512 with
every row's logits (`fill`; bench-runtime computes the last row's only, so the tok/s here read lower
than its; the ratios between builds, all timed alike, are what this script is for).

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
    """A build by name (above), with this CPU's run-time tunings as native.kernels() gives its own;
    `<name>@pairs<N>` gives it tile pairs from N rows for every kind instead (the setting is the module's, so two
    thresholds of one source need two copies of the build, under two tags)."""
    name, _, tune = name.partition("@")
    rows = None
    if tune:
        if not (tune.startswith("pairs") and tune[5:].isdigit() and int(tune[5:]) >= 1):
            raise SystemExit(f"build {name}@{tune}: the only tuning is @pairs<N>, N >= 1 (tile pairs from N rows)")
        rows = int(tune[5:])
    if name in native.ISA_CFLAGS:
        mod = native.kernels(name)
    else:
        folder = native.extensions_root() / name
        so = glob.glob(str(folder / "*.so"))
        if not so:
            raise SystemExit(f"no built kernels in {folder}")
        spec = importlib.util.spec_from_file_location(os.path.basename(so[0])[:-3], so[0])
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    native.apply_tunings(mod, None if rows is None else (rows, rows))
    return mod


def swappable_model(model: str, threads: int):
    """(the model loaded on the gguf kernels, use(kernels): run its linears, layers and embedding
    gather on that build from now on), so that builds are timed on one model in one process. A
    forward then runs the build's own ids-to-logits call (`LayerStack.forward_tokens`), each build's
    stack kept by the model, so no swap rebuilds it inside a timed forward."""
    m = load_target(model, device="cpu", quant="gguf", threads=threads).model
    lins = [lin for layer in m.layers for lin in layer.linears()] + [m.head]

    def use(k) -> None:
        for lin in lins:
            if isinstance(lin, QuantLinear):
                lin.k = k
        for layer in m.layers:
            layer._k = k
        if getattr(m.embed, "_gather", None) is not None:  # the embedding gather too
            m.embed._gather = (k, *m.embed._gather[1:])
    return m, use


def fill(m, cache, ctx: int) -> None:
    """Sequence 0 of `cache` holds `ctx` tokens of context, prefilled in one forward."""
    cache.clear(0)
    m.forward(list(range(100, 100 + ctx)), list(range(ctx)), [0] * ctx, cache, logits_rows=None)


def prefill(m, cache, k: int):
    """A callable: a prompt of k tokens into sequence 0, emptied first, with the last token's logits
    only, as `specplug bench-runtime` times a prefill (`fill` computes every row's)."""
    def f():
        cache.clear(0)
        m.forward(list(range(100, 100 + k)), list(range(k)), [0] * k, cache, logits_rows=[k - 1])
    return f


def step(m, cache, ctx: int, k: int):
    """A callable: one forward of k rows after the `ctx` tokens `fill` left, the rows removed again."""
    def f():
        m.forward([7] * k, list(range(ctx, ctx + k)), [0] * k, cache, logits_rows=None)
        cache.seq_rm(0, ctx)
    return f


def measure(m, cache, reps: int = 40) -> dict:
    """One round on model `m` (its cache `cache`, one sequence, >= 528 cells): decode at ctx 128, T(k)
    = one forward of k rows after 512 tokens (the rows removed again), prefill 512 with every row's
    logits (`fill`, not `prefill`: kept so that the figures stay comparable with earlier rounds), in
    ms / tok/s."""
    r = {}
    fill(m, cache, 128)
    r["decode128"] = _median_ms(step(m, cache, 128, 1), reps, warmup=3)
    fill(m, cache, 512)
    for k in KS:
        r[f"T{k}"] = _median_ms(step(m, cache, 512, k), reps, warmup=3)
    r["prefill_tok_s"] = 512 / (_median_ms(lambda: fill(m, cache, 512), 5, warmup=3) / 1e3)
    return r


def round_medians(runs: list[dict]) -> dict:
    """Medians over rounds of `measure`'s figures, and of each round's T(k)/T(1)."""
    med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    med.update({f"T{k}/T1": statistics.median(r[f"T{k}"] / r["T1"] for r in runs) for k in KS})
    return {k: round(v, 3) for k, v in med.items()}


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
    m, use = swappable_model(args.model, args.threads)
    cache = m.new_cache(1, 2048)
    runs: dict = {}
    for rnd in range(args.rounds):
        for n in (names if rnd % 2 == 0 else names[::-1]):
            use(builds[n])
            runs.setdefault(n, []).append(measure(m, cache))
    medians = {}
    for n in names:
        medians[n] = round_medians(runs[n])
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
