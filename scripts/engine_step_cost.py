"""Where a drafting step's time goes in the engine: every target forward of at most 16 rows (the
decode phase: these prompts are longer; rows, seconds) and every decode step's wall time, by the
rows verified, beside the cost curve the price
check uses. One sequence at a time, the first turns of MT-bench's first N questions, greedy, the
config's max_tokens. This found the OpenMP spinning that specplug/__init__.py now shortens.

    python scripts/engine_step_cost.py CONFIG.yaml N_PROMPTS OUT.json
"""
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import specplug  # noqa: F401  (its OpenMP spin count, before torch loads)
from specplug.api import build_engine, prompt_ids
from specplug.bench.data import read_jsonl_prompts
from specplug.config import load_config
from specplug.engine import Engine, Request
from specplug.machine import describe

cfg = load_config(sys.argv[1])
n = int(sys.argv[2])
eng = build_engine(cfg)
fwd = []  # (rows, seconds) of every decode-phase target forward
steps = []  # (drafted rows, seconds) of every decode step
real_forward, real_step = Engine._forward, Engine._step
state = {"rows": 0}

def forward(self, toks, pos, seqs, logits_rows=None):
    t0 = time.perf_counter()
    out = real_forward(self, toks, pos, seqs, logits_rows)
    fwd.append((len(toks), time.perf_counter() - t0))
    state["rows"] = len(toks)
    return out

def step(self, seqs):
    t0 = time.perf_counter()
    state["rows"] = 0
    real_step(self, seqs)
    steps.append((state["rows"], time.perf_counter() - t0))

Engine._forward, Engine._step = forward, step
qs = read_jsonl_prompts(Path("specplug/data/mt_bench/question.jsonl"))[:n]
tok = eng.target.tokenizer
for q in qs:
    ids = prompt_ids(tok, q["turns"][0], True)
    eng.run([Request(ids, cfg.max_tokens)])
by_rows = defaultdict(list)
for r, s in fwd:
    by_rows[r].append(s)
step_rows = defaultdict(list)
for r, s in steps:
    step_rows[r].append(s)
t1 = statistics.median(by_rows[1])
curve = eng.pricing.cost
res = {"config": sys.argv[1], "prompts": n, "machine": describe("cpu"),
       "forward_ms": {r: round(statistics.median(v) * 1e3, 3) for r, v in sorted(by_rows.items()) if r <= 16},
       "forward_n": {r: len(v) for r, v in sorted(by_rows.items()) if r <= 16},
       "forward_ratio": {r: round(statistics.median(v) / t1, 3) for r, v in sorted(by_rows.items()) if r <= 16},
       "curve": {r: round(curve(r), 3) for r in sorted(by_rows) if r <= 16},
       "step_ms": {r: round(statistics.median(v) * 1e3, 3) for r, v in sorted(step_rows.items()) if r <= 16},
       "step_n": {r: len(v) for r, v in sorted(step_rows.items()) if r <= 16}}
print(json.dumps(res, indent=1))
Path(sys.argv[3]).write_text(json.dumps(res, indent=1))
