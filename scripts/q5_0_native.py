"""A model's Q5_0 tensors computed natively (5.5 bits a weight) against the Q8_0 blocks of the same
weights (8.5 bits, what the loader did before), one process, forwards of k rows after 512 tokens
timed in turn (the order reversed each time, as scripts/interleaved_builds.py does), logits
compared bit for bit. A Q4_K_M file of a model whose rows are not a multiple of 256 values wide
(SmolLM2's 576) is mostly Q5_0: llama-quantize's fallback type.

    python scripts/q5_0_native.py /work/data/s24/models/smollm2.Q4_K_M.gguf --calls 60 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import specplug  # noqa: F401  (its OpenMP spin count, before torch loads)
from specplug import machine
from specplug.runtime import load_target, native

sys.path.insert(0, str(Path(__file__).parent))
from kernel_builds import fill  # noqa: E402


def load(path: str, threads: int, convert: bool):
    """The model, its Q5_0 tensors natively or (convert) as the Q8_0 blocks of the same weights."""
    if not convert:
        return load_target(path, threads=threads).model
    from_blocks, common = native.QuantLinear.from_blocks.__func__, native.common_blocks
    native.common_blocks = lambda parts: [native.as_q8_0_rows(r, qt) for r, qt in parts]
    native.QuantLinear.from_blocks = classmethod(lambda cls, raw, qtype, shape, **kw: from_blocks(
        cls, *native.as_q8_0_rows(np.asarray(raw).reshape(shape[0], -1), qtype), shape, **kw))
    try:
        return load_target(path, threads=threads).model
    finally:
        native.common_blocks, native.QuantLinear.from_blocks = common, classmethod(from_blocks)


def compare(models: dict, ks, calls: int, command: str, json_path: str | None, model_path: str) -> None:
    """Forwards of k rows after 512 tokens of each of `models` (name -> model; the first is the native
    one, the second its former representation), timed in turn (the order reversed each call), medians
    printed, the logits compared bit for bit; also written to `json_path`."""
    names = list(models)
    kinds = {n: sorted({lin.kind for layer in m.layers for lin in layer.linears()}) for n, m in models.items()}
    weight_mb = {n: round(sum(t.numel() * t.element_size() for layer in m.layers for lin in layer.linears()
                              for t in (lin.qs, lin.d, lin.m) if t is not None) / 1e6, 1) for n, m in models.items()}
    caches = {}
    for n, m in models.items():
        caches[n] = m.new_cache(1, 2048)
        fill(m, caches[n], 512)
    runs: dict[tuple[str, int], list[float]] = {}
    same = True
    for k in ks:
        def fwd(n, k=k):
            m, c = models[n], caches[n]
            t0 = time.perf_counter()
            out = m.forward([7] * k, list(range(512, 512 + k)), [0] * k, c, logits_rows=None)
            ms = (time.perf_counter() - t0) * 1e3
            c.seq_rm(0, 512)
            return ms, out.logits
        outs = {n: fwd(n)[1] for n in models}  # warm, and the logits side by side
        same = same and torch.equal(outs[names[0]], outs[names[1]])
        for i in range(calls):
            for n in (names if i % 2 == 0 else names[::-1]):
                runs.setdefault((n, k), []).append(fwd(n)[0])
    med = {key: statistics.median(v) for key, v in runs.items()}
    threads = torch.get_num_threads()
    print(f"# {machine.line(machine.describe('cpu'))}; {model_path}; forward of k rows after 512 tokens, "
          f"{calls} calls each in turn; medians ms")
    for n in models:
        print(f"{n:<8} kinds {','.join(kinds[n]):<22} layers' weights {weight_mb[n]:>6.1f} MB  " +
              "  ".join(f"k={k} {med[(n, k)]:.2f}" for k in ks))
    print(f"{names[0]} natively: " + "  ".join(f"k={k} {med[(names[1], k)] / med[(names[0], k)]:.3f}x" for k in ks) +
          f"; logits bit-identical: {same}")
    if json_path:
        Path(json_path).write_text(json.dumps({
            "command": command, "machine": machine.describe("cpu"),
            "threads": threads, "calls": calls, "kinds": kinds, "weight_mb": weight_mb,
            "medians_ms": {f"{n}@{k}": round(v, 3) for (n, k), v in med.items()}, "logits_identical": same}, indent=1))


def parse_args(doc: str) -> argparse.Namespace:
    """The model file, calls, threads, row counts and JSON path (this script's and q4_0_native.py's)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--calls", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--json", default=None)
    return p.parse_args()


def main() -> None:
    a = parse_args(__doc__)
    models = {"q5_0": load(a.model, a.threads, False), "as_q8_0": load(a.model, a.threads, True)}
    compare(models, a.ks, a.calls, "python scripts/q5_0_native.py " + " ".join(sys.argv[1:]), a.json, a.model)

if __name__ == "__main__":
    main()
