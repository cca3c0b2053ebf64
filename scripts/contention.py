"""How fast is the CPU runtime when it does not have the machine to itself? (issue 27)

For threads 1, 2 and auto, idle and beside a busy neighbour (a separate process spinning on
one core, for at most --neighbour-s seconds, killed when each measurement ends), measures:

- decode tok/s: plain greedy decoding of the first turns of MT-bench questions, each to
  --max-tokens tokens (end of turn ignored); tokens after the first over the time after the
  first token, as llama.cpp reports generation speed;
- `specplug train data` tok/s: the command as users run it (--parallel 8 sequences), generated
  tokens over the generation time in its manifest;
- llama.cpp's `llama-bench` tg tok/s on the same file, if --llama-bench gives its path.

Each measurement runs in a fresh process; the order is interleaved (every setting once per
repeat) and the table gives medians. Prints one table and writes JSON. Usage:

    python scripts/contention.py --repeats 3 --json contention.json
    python scripts/contention.py --prompts 1 --max-tokens 16 --train-prompts 8 --train-tokens 8 --repeats 1  # smoke
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specplug.machine import describe

SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


@contextlib.contextmanager
def neighbour(busy: bool, core: int, seconds: float):
    """A process spinning on `core` while the block runs (bounded by `seconds` in any case)."""
    if not busy:
        yield
        return
    p = subprocess.Popen([sys.executable, "-c", SPIN, str(seconds)],
                         preexec_fn=((lambda: os.sched_setaffinity(0, {core}))
                                                              if hasattr(os, "sched_setaffinity") else None))
    try:
        time.sleep(0.2)  # let it start spinning
        yield
    finally:
        p.kill()
        p.wait()


def decode_worker(model: str, threads: str, n_prompts: int, max_tokens: int) -> dict:
    """In a fresh process: plain greedy decoding; prints the figures as JSON."""
    import torch

    from specplug.api import build_engine, prompt_ids
    from specplug.bench.data import dataset_path, read_jsonl_prompts
    from specplug.config import RunConfig
    from specplug.engine import Request

    cfg = RunConfig(model=model, threads=int(threads) if threads != "auto" else "auto", max_tokens=max_tokens)
    engine = build_engine(cfg, speculators=False)
    tok = engine.target.tokenizer
    prompts = [prompt_ids(tok, r["turns"][0], True) for r in read_jsonl_prompts(dataset_path("mt_bench"))[:n_prompts]]
    engine.run([Request(prompts[0], max_tokens=8, ignore_eos=True)])  # warm-up
    tokens = seconds = 0.0
    for ids in prompts:
        res = engine.run([Request(ids, max_tokens=max_tokens, ignore_eos=True)])[0]
        tokens += len(res.token_ids) - 1
        seconds += res.stats.time_s - res.stats.time_prefill_s
    gov = engine.model.governor  # threads: auto chooses the count online (specplug.runtime.governor)
    return {"tok_s": tokens / seconds, "threads_used": gov.describe() if gov else torch.get_num_threads()}


def run_decode(args, threads: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--decode-worker", "--model", args.model, "--threads-one", threads,
                          "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens)],
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"decode worker failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_train_data(args, threads: str) -> dict:
    from specplug.bench.data import dataset_path

    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-m", "specplug.cli", "train", "data", "--model", args.model,
                              "--prompts", str(dataset_path("mt_bench")), "--limit", str(args.train_prompts),
                              "--max-tokens", str(args.train_tokens), "--keep-overlap", "--threads", threads,
                              "-o", str(Path(tmp) / "data")], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"train data failed:\n{out.stderr[-2000:]}")
        man = json.loads((Path(tmp) / "data" / "manifest.json").read_text())
    g = man["generation"]
    return {"tok_s": g["generated_tokens"] / g["seconds"], "threads_used": man["settings"]["threads"]}


def run_llama_bench(args, threads: str) -> dict:
    from specplug.runtime import resolve_model, resolve_threads

    n = resolve_threads("auto" if threads == "auto" else int(threads))
    out = subprocess.run([args.llama_bench, "-m", str(resolve_model(args.model)), "-p", "0", "-n", str(args.max_tokens),
                          "-t", str(n), "-r", "3", "-o", "json"], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"llama-bench failed:\n{out.stderr[-2000:]}")
    rows = [r for r in json.loads(out.stdout) if r.get("n_gen")]
    return {"tok_s": rows[0]["avg_ts"], "threads_used": n}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", default="1,2,auto", help="comma-separated thread settings")
    p.add_argument("--prompts", type=int, default=4, help="MT-bench first turns to decode")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per decoded prompt (and llama-bench -n)")
    p.add_argument("--train-prompts", type=int, default=16, help="`train data --limit`")
    p.add_argument("--train-tokens", type=int, default=128, help="`train data --max-tokens`")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--neighbour-core", type=int, default=None,
                   help="the core the neighbour spins on (default: the last)")
    p.add_argument("--neighbour-s", type=float, default=600.0, help="the neighbour ends by itself after this long")
    p.add_argument("--llama-bench", default=None, metavar="PATH", help="also measure llama.cpp's llama-bench binary")
    p.add_argument("--skip-train", action="store_true", help="decode only")
    p.add_argument("--json", default="contention.json")
    p.add_argument("--decode-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads-one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.decode_worker:
        print(json.dumps(decode_worker(args.model, args.threads_one, args.prompts, args.max_tokens)))
        return 0

    core = args.neighbour_core if args.neighbour_core is not None else cores()[-1]
    settings = args.threads.split(",")
    what = {"decode": run_decode} | ({} if args.skip_train else {"train data": run_train_data}) | \
        ({"llama-bench": run_llama_bench} if args.llama_bench else {})
    runs: dict[str, list] = {}
    for r in range(args.repeats):
        for load in ("idle", "busy"):
            for t in settings:
                for name, fn in what.items():
                    with neighbour(load == "busy", core, args.neighbour_s):
                        res = fn(args, t)
                    runs.setdefault(f"{name}|{load}|{t}", []).append(res)
                    print(f"repeat {r + 1}/{args.repeats}: {name:<11} {load:<4} threads {t:<4} "
                          f"({res['threads_used']}): {res['tok_s']:7.1f} tok/s", file=sys.stderr, flush=True)
    table = {k: {"tok_s_median": round(statistics.median(x["tok_s"] for x in v), 1),
                 "tok_s": [round(x["tok_s"], 1) for x in v], "threads_used": v[0]["threads_used"]}
                 for k, v in runs.items()}
    lines = [f"tok/s, median of {args.repeats}; busy = one process spinning on core {core} "
             f"(of {len(cores())}); x = of threads 1 under the same load",
             "| | load | " + " | ".join(f"threads {t}" for t in settings) + " |",
             "|---|---|" + "---|" * len(settings)]
    for name in what:
        for load in ("idle", "busy"):
            base = table[f"{name}|{load}|1"]["tok_s_median"] if "1" in settings else None
            cells = []
            for t in settings:
                v = table[f"{name}|{load}|{t}"]["tok_s_median"]
                cells.append(f"{v:.1f}" + (f" ({v / base:.2f}x)" if base and t != "1" else ""))
            lines.append(f"| {name} | {load} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    result = {"model": args.model, "prompts": args.prompts, "max_tokens": args.max_tokens,
              "train_prompts": args.train_prompts, "train_tokens": args.train_tokens, "repeats": args.repeats,
              "neighbour_core": core, "cores": cores(), "results": table, "table": lines,
              "machine": describe()}
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
