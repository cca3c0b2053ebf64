"""What the static-shape step costs on this CPU against the eager torch forward (figures in
docs/results/static-step-cpu.json): one decode token after 1024 tokens of context, quant none.

    python scripts/static_step_cpu.py MODE [N_SEQ]
    MODE: eager | static-eager | layer | whole | fixed8-eager | fixed8   (N_SEQ: cache slots, default 4)
"""
from __future__ import annotations

import sys
import time

import torch

from specplug.runtime import Transformer, resolve_model
from specplug.runtime.static import StaticOptions


def main(mode: str, n_seq: int) -> float:
    torch.set_num_threads(2)
    m = Transformer.load(resolve_model("smollm2-135m"), device="cpu", quant="none")
    if mode != "eager":
        m.use_static(StaticOptions(compile=mode not in ("static-eager", "fixed8-eager"),
                                   granularity="step" if mode == "whole" else "layer",
                                   fixed_tokens=8 if mode.startswith("fixed8") else None))
    cache = m.new_cache(n_seq, 2048)
    toks = list(range(100, 1124))
    for a in range(0, 1024, 256):
        m.forward(toks[a:a + 256], list(range(a, a + 256)), [0] * 256, cache, logits_rows=[])

    def step():
        m.forward([7], [1024], [0], cache, logits_rows=None)
        cache.seq_rm(0, 1024)

    for _ in range(3):
        step()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "eager"
    print(mode, "decode ctx 1024 ms", round(main(mode, int(sys.argv[2]) if len(sys.argv) > 2 else 4), 2))
