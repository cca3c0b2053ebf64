"""Do the linears' weight stream and their compute overlap? The 30 decoder layers' linears (qkv, o,
gate/up, down; not the output head) at k rows, two ways: streamed (each layer's own weights in turn,
~66 MB for SmolLM2-135M Q4_1, as a forward reads them) and cache-resident (layer 0's linears, ~2.2 MB,
30 times). If the two overlapped, streamed = max(stream, resident); if they serialize, streamed =
resident + a constant. Both page sizes side by side (specplug.runtime.pages: two copies of the model,
one loaded with SPECPLUG_HUGE_PAGES=0), alternated rounds, medians of ms per 30 layers.

    python scripts/linears_resident.py --rounds 5 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import specplug  # noqa: F401  (its OpenMP spin count, before torch loads)
from specplug import machine

sys.path.insert(0, str(Path(__file__).parent))
from huge_pages_ab import both_page_sizes  # noqa: E402  (two copies of the model, one per page size)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    models = both_page_sizes(args.model, args.threads)
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {}
    for rnd in range(args.rounds):
        for name in (list(models) if rnd % 2 == 0 else list(models)[::-1]):
            layers = [layer.linears() for layer in models[name].layers]
            for k in args.ks:
                xs = [lin.quantize(torch.randn(k, lin.qs.shape[1] * 32, generator=g)) for lin in layers[0]]
                for way, sel in (("streamed", layers), ("resident", [layers[0]] * len(layers))):
                    def run():
                        for lins in sel:
                            for lin, xa in zip(lins, xs):
                                lin.matmul(xa)
                    for _ in range(3):
                        run()
                    ts = []
                    for _ in range(args.reps):
                        t0 = time.perf_counter()
                        run()
                        ts.append((time.perf_counter() - t0) * 1e3)
                    times.setdefault(f"{name}/{way}/{k}", []).append(statistics.median(ts))
    med = {key: round(statistics.median(v), 3) for key, v in times.items()}
    rows = []
    for name in models:
        for k in args.ks:
            s, r = med[f"{name}/streamed/{k}"], med[f"{name}/resident/{k}"]
            rows.append({"pages": name, "k": k, "streamed_ms": s, "resident_ms": r, "difference_ms": round(s - r, 3)})
            print(f"{name}, k={k}: streamed {s:.3f} ms, resident {r:.3f} ms, difference {s - r:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python", *sys.argv]), "machine": machine.describe("cpu"),
                       "threads": args.threads, "rounds": args.rounds, "rows": rows, "runs": times}, f, indent=1)


if __name__ == "__main__":
    main()
