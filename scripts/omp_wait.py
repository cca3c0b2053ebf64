"""Why a k-row forward cost more in the engine than in bench-runtime (see specplug/__init__.py):
the same target forwards back to back, alternating, with the taps Eagle3 reads, and after a torch
operation over 12 MB (a stand-in for a head's draft call: torch's OpenMP threads spin after it).
Medians of 60 rounds, two passes, ms. Compare spin settings in separate processes:

    python scripts/omp_wait.py out.json                          # specplug's spin count (30000)
    OMP_WAIT_POLICY=ACTIVE python scripts/omp_wait.py out.json   # libgomp spinning on
    OMP_WAIT_POLICY=PASSIVE python scripts/omp_wait.py out.json  # no spin
"""
import json
import statistics
import sys
import time

import torch

import specplug  # noqa: F401  (sets the spin count before torch loads OpenMP)
from specplug.runtime import load_target

t = load_target("smollm2-135m", "cpu", "float32", "auto", 2)
m = t.model
cache = m.new_cache(2, 2048)
CTX = 400
m.forward([9] * CTX, list(range(CTX)), [0] * CTX, cache, logits_rows=[])
taps_e3 = frozenset({3, 15, 27, m.config.n_layer})
junk = torch.randn(12 * 2**20 // 4)  # ~12 MB: a head's weights read during a draft

def fwd(k, taps=frozenset()):
    t0 = time.perf_counter()
    m.forward([7] * k, list(range(CTX, CTX + k)), [0] * k, cache, logits_rows=None, taps=taps)
    dt = time.perf_counter() - t0
    cache.seq_rm(0, CTX)
    return dt

def run(pattern, rounds=60):
    out = {}
    for _ in range(rounds):
        for name, k, taps, touch in pattern:
            if touch:
                junk.sum()
            out.setdefault(name, []).append(fwd(k, taps))
    return {n: round(statistics.median(v) * 1e3, 3) for n, v in out.items()}

res = {}
for rnd in range(2):
    for label, pat in {
        "back-to-back k=1": [("1", 1, frozenset(), False)],
        "back-to-back k=2": [("2", 2, frozenset(), False)],
        "back-to-back k=4": [("4", 4, frozenset(), False)],
        "alternating 1,2,1,4": [("1", 1, frozenset(), False), ("2", 2, frozenset(), False), ("1b", 1, frozenset(), False), ("4", 4, frozenset(), False)],
        "alternating, taps": [("1", 1, taps_e3, False), ("2", 2, taps_e3, False), ("1b", 1, taps_e3, False), ("4", 4, taps_e3, False)],
        "alternating, taps, 12 MB read before each k>1": [("1", 1, taps_e3, False), ("2", 2, taps_e3, True), ("1b", 1, taps_e3, False), ("4", 4, taps_e3, True)],
        "12 MB read before every forward": [("1", 1, taps_e3, True), ("2", 2, taps_e3, True), ("4", 4, taps_e3, True)],
    }.items():
        res.setdefault(label, []).append(run(pat))
for k, v in res.items():
    print(k, v)
json.dump(res, open(sys.argv[1], "w"), indent=1)
