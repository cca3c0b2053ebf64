"""`specplug bench CONFIG.yaml --data ...`: the command users run to see whether speculation pays."""
from __future__ import annotations

import sys
from pathlib import Path

from specplug import machine
from specplug.bench.data import DATASETS, dataset_path, read_jsonl_prompts
from specplug.cli_args import add_ray_args, add_step_args, step_overrides, threads_arg
from specplug.cluster import require_ray
from specplug.errors import SpecplugError
from specplug.outputs import claim, exit_1_on_write_error
from specplug.runtime import load_target

# The parser is built at every start-up (specplug.cli): the YAML config and the runner, report and Ray
# modules (the engine behind them) load only when `specplug bench` runs.

def select_prompts(records: list[dict], categories: str | None, limit: int | None, source: str) -> list[dict]:
    """Filter by category (error naming unknown ones) and keep the first `limit` of each category."""
    present = sorted({r["category"] for r in records})
    if categories:
        wanted = [c.strip() for c in categories.split(",") if c.strip()]
        unknown = [c for c in wanted if c not in present]
        if unknown:
            raise SpecplugError(f"{source}: unknown categor{'y' if len(unknown) == 1 else 'ies'} "
                                f"{', '.join(map(repr, unknown))}; present: {', '.join(present)}")
        records = [r for r in records if r["category"] in wanted]
    if limit is not None:
        if limit < 1:
            raise SpecplugError(f"--limit must be >= 1, got {limit}")
        seen: dict[str, int] = {}
        kept = []
        for r in records:
            if seen.get(r["category"], 0) < limit:
                seen[r["category"]] = seen.get(r["category"], 0) + 1
                kept.append(r)
        records = kept
    return records


@exit_1_on_write_error
def cmd_bench(args) -> int:
    from specplug.config import load_config

    overrides = ({"max_tokens": args.max_tokens} if args.max_tokens else {}) | step_overrides(args)
    if args.threads is not None:
        overrides["threads"] = args.threads
    cfg = load_config(args.config, overrides)
    if not cfg.speculators:
        raise SpecplugError(f"{args.config}: `speculators:` is empty; the bench compares them with plain decoding")
    from specplug.bench.runner import variants

    variants(cfg, args.chain, args.chains)  # a bad --chains names what to fix before the model loads
    path = dataset_path(args.data) if args.data in DATASETS else Path(args.data)
    if args.data not in DATASETS and not path.suffix.startswith(".json"):
        raise SpecplugError(f"unknown data set {args.data!r}; bundled: {', '.join(DATASETS)} (or pass a .jsonl file)")
    records = select_prompts(read_jsonl_prompts(path), args.categories, args.limit, str(path))
    if args.repeats < 1:
        raise SpecplugError(f"--repeats must be >= 1, got {args.repeats}")
    if args.ray is not None:
        require_ray()
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise SpecplugError(f"--out {out} is a file; give a folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    with claim(out, "--out"):  # before the model loads; a second bench on the same folder fails at once
        return _bench(args, cfg, path, records, out)


def _bench(args, cfg, path: Path, records: list[dict], out: Path) -> int:
    from specplug.bench.report import build_report, machine_line, markdown_table, write_outputs
    from specplug.bench.runner import merge_passes

    if args.ray is not None:
        from specplug.bench.ray_bench import run_on_ray

        passes, info = run_on_ray(args, cfg, records, path)
    else:
        passes, info = _run_here(args, cfg, records, path)
    results = merge_passes(passes)
    settings = {"config": str(args.config), "data": str(path), "categories": args.categories, "limit": args.limit,
                "repeats": args.repeats, "max_tokens": cfg.max_tokens, "model": cfg.model,
                "device": info["device"], "quant": info["quant"], "threads": info["threads"],
                "greedy": cfg.sampling.greedy, "machine": info.get("machine"), "verify_curve": info.get("verify_curve")}
    if "ray" in info:
        settings["ray"] = info["ray"]
    report = build_report(results, info["variants"], settings, info["peak_rss_mb"])
    print(machine_line(report) + markdown_table(report))
    written = write_outputs(report, out)
    print(f"\npeak RSS {report['peak_rss_mb']} MB; wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    if report["mismatches"]:
        for m in report["mismatches"]:
            gap = f"{m['top2_gap']:.4f}" if m["top2_gap"] is not None else "n/a"
            print(f"MISMATCH: prompt {m['id']} ({m['category']}, turn {m['turn']}) variant {m['variant']}: "
                  f"differs from plain greedy at token {m['index']} (top-2 logit gap there: {gap})", file=sys.stderr)
        return 1
    return 0


def _run_here(args, cfg, records: list[dict], path: Path) -> tuple[list, dict]:
    """Every pass over the prompts in this process: (per-pass results, what ran them)."""
    import torch
    from tqdm import tqdm

    from specplug.bench.runner import Bench, peak_rss_mb
    from specplug.config import target_args

    target = load_target(cfg.model, **target_args(cfg))
    bench = Bench(cfg, target, chain=args.chain, chains=args.chains)
    bench.warmup()
    bench.fresh_engines()  # the warm-up must not seed any speculator's state
    n_turns = sum(len(r["turns"]) for r in records)
    bar = tqdm(total=n_turns * len(bench.engines) * args.repeats, unit="run", file=sys.stderr,
               desc=f"bench {Path(args.config).name} on {path.name}")
    passes = []
    for r in range(args.repeats):  # whole passes, each with fresh speculators: see Bench.fresh_engines
        if r:
            bench.fresh_engines()
        results = []
        for i, rec in enumerate(records):
            results += bench.run_prompt(rec, cfg.max_tokens, i + r, progress=lambda: bar.update(1))
        passes.append(results)
    bar.close()
    return passes, {"device": str(target.model.device), "quant": target.model.quant,
                    "threads": torch.get_num_threads(), "variants": [n for n in bench.engines if n != "plain"],
                    "peak_rss_mb": peak_rss_mb(), "machine": machine.describe(str(target.model.device)),
                    "verify_curve": bench.pricing.info()}


def register(sub) -> None:
    p = sub.add_parser("bench", help="speculative vs plain decoding on real prompt sets")
    p.add_argument("config")
    add_step_args(p, defaults=False)
    p.add_argument("--data", default="spec_bench",
                   help="spec_bench | mt_bench | humaneval | agent_traffic | FILE.jsonl")
    p.add_argument("--categories", help="comma-separated categories to keep")
    p.add_argument("--limit", type=int, default=None, help="prompts per category")
    p.add_argument("--repeats", type=int, default=1,
                   help="passes over the prompts, each with fresh speculators; per prompt the median-time run is kept")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--chain", action="store_true",
                   help="also bench all speculators chained together (in the config's `chain:` mode)")
    p.add_argument("--chains", nargs="+", default=[], metavar="A>B",
                   help="also bench these chains: names joined by '>' (a cascade: each asked only where the ones "
                        "before have no draft) or '+' (all draft, the best wins), e.g. ngram-simple>eagle3")
    p.add_argument("--out", default="bench-out", help="folder for results.json, results.md and plots")
    p.add_argument("--threads", type=threads_arg, default=None,
                   help="CPU threads (each worker's, with --ray); overrides the config's `threads`")
    add_ray_args(p, "the prompts are spread over Ray actors, each running every variant with the config's "
                    "threads (auto: 1 under --ray); per-prompt results are those of one process")
    p.set_defaults(func=cmd_bench)
