"""Greedy speculative == plain, token for token, for every example config on the static step
(specplug.runtime.static, batch-invariant): the check tests/test_cuda.py makes on a GPU, runnable
on any device.

    python scripts/static_equal.py --device cpu --compile off --max-tokens 16 --prompts 2
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

from specplug.machine import describe

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Explain why the sky is blue in two sentences.",
           "Write a Python function that returns the n-th Fibonacci number.",
           "Summarize: The quick brown fox jumps over the lazy dog. The dog sleeps. The fox runs away."]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", choices=["on", "off"], default="on", help="off: the static step run eagerly")
    ap.add_argument("--step-tokens", type=int, default=8)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    from specplug.api import build_engine
    from specplug.config import load_config
    from specplug.engine import Request
    from specplug.runtime import load_target
    from specplug.runtime.static import StaticOptions

    target = load_target("smollm2-135m", device=args.device, dtype=args.dtype, quant="none", compile=True,
                         step_tokens=args.step_tokens)
    if args.compile == "off":
        target.model.use_static(StaticOptions(compile=False, fixed_tokens=target.model.static.options.fixed_tokens))
    tok = target.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
           for p in PROMPTS[:args.prompts]]
    results, bad = [], 0
    for path in sorted(ROOT.glob("examples/*.yaml")):
        cfg = load_config(path)
        if not cfg.speculators:
            continue
        cfg = dataclasses.replace(cfg, device=args.device, dtype=args.dtype, max_tokens=args.max_tokens,
                                  parallel=args.parallel)
        t0 = time.perf_counter()
        outs = []
        try:
            for spec in (False, True):
                eng = build_engine(cfg, target, speculators=spec)
                outs.append([r.token_ids for r in eng.run([Request(x, cfg.max_tokens, i) for i, x in enumerate(ids)])])
        except Exception as exc:  # one config's failure must not hide the others' verdicts (a GPU call is short)
            bad += 1
            results.append({"config": path.name, "equal": False, "error": f"{type(exc).__name__}: {exc}",
                            "seconds": round(time.perf_counter() - t0, 1)})
            traceback.print_exc()
            print(f"{path.name:<28} FAILED  {results[-1]['error'][:200]}", flush=True)
            continue
        same = outs[0] == outs[1]
        bad += not same
        drafted = sum(s.drafted_tokens for s in eng.stats.speculators.values())
        accepted = sum(s.accepted_tokens for s in eng.stats.speculators.values())
        results.append({"config": path.name, "equal": same, "drafted": drafted, "accepted": accepted,
                        "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{path.name:<28} {'equal' if same else 'DIFFERENT'}  drafted {drafted:>4} accepted {accepted:>4}  "
              f"{results[-1]['seconds']} s", flush=True)
    summary = {"device": str(target.model.device), "dtype": str(target.model.dtype), "compile": args.compile,
               "step_tokens": args.step_tokens, "parallel": args.parallel, "max_tokens": args.max_tokens,
               "prompts": len(ids), "configs": results, "all_equal": bad == 0}
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "machine": describe()}, indent=2))
    print(f"{len(results) - bad} of {len(results)} configs: speculative == plain")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
