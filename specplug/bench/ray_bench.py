"""`specplug bench --ray`: the prompts spread over Ray actors.

Each actor loads the target once and holds the same `Bench` a single process would (plain plus
every variant, warmed up, fresh speculators per pass). A prompt runs whole on one actor, its
variants back to back in the same rotated order as in one process, so its results (text, token
ids, accepted lengths) are the ones a single process gets; only timings differ. Aggregates are
computed from the per-prompt records as always (specplug.bench.report).

Priced drafting (`cost_trim`, the default) decides from measured timings, so which steps draft,
and the accepted lengths with them, vary between any two runs, in one process or on Ray; with
`cost_trim: false` they repeat exactly. Greedy text is the target's either way.
Speculators that learn across prompts (ngram-mod's pool, ngram-cache's dynamic cache) see only
the prompts of their own actor here, so their acceptance can differ from a single process's.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from specplug import cluster, machine
from specplug.bench.runner import Bench, peak_rss_mb
from specplug.config import target_args
from specplug.runtime import load_target


class BenchWorker:
    """A Ray actor: one target, one Bench; prompts on request."""

    def __init__(self, cfg, chain: bool, chains=()):
        self.target = load_target(cfg.model, **target_args(cfg))
        self.bench = Bench(cfg, self.target, chain=chain, chains=chains)
        self.bench.warmup()

    def info(self) -> dict:
        import torch

        m = self.target.model
        return {"device": str(m.device), "quant": m.quant, "threads": torch.get_num_threads(),
                "variants": [n for n in self.bench.engines if n != "plain"], "peak_rss_mb": peak_rss_mb(),
                "machine": machine.describe(str(m.device)), "verify_curve": self.bench.pricing.info()}  # (worker 0's)

    def fresh(self) -> None:
        self.bench.fresh_engines()

    def prompt(self, rec: dict, max_tokens: int, index: int) -> list:
        return self.bench.run_prompt(rec, max_tokens, index)


def run_on_ray(args, cfg, records: list[dict], path: Path) -> tuple[list, dict]:
    """Every pass over the prompts on a pool of Ray actors: (per-pass results, what ran them)."""
    from tqdm import tqdm

    ray = cluster.connect(args.ray)
    threads = cluster.worker_threads(cfg.threads)
    wcfg = dataclasses.replace(cfg, threads=threads)
    n = min(cluster.pool_size(ray, threads, args.ray_workers), max(1, len(records)))
    actor_cls = ray.remote(BenchWorker)
    actors = [actor_cls.options(**cluster.actor_options(threads)).remote(wcfg, args.chain, args.chains)
              for _ in range(n)]
    print(f"specplug: bench on {n} Ray workers x {threads} thread{'s' * (threads > 1)}", file=sys.stderr)
    bar = tqdm(total=len(records) * args.repeats, unit="prompt", file=sys.stderr,
               desc=f"bench (ray) {Path(args.config).name} on {path.name}")
    passes = []
    try:
        for r in range(args.repeats):
            ray.get([a.fresh.remote() for a in actors])  # every pass starts with fresh speculators, as in one process
            by_index: dict[int, list] = {}
            jobs = list(enumerate(records))
            for (i, _), results in cluster.run_on_pool(
                    ray, actors, jobs, lambda a, job, r=r: a.prompt.remote(job[1], cfg.max_tokens, job[0] + r)):
                by_index[i] = results
                bar.update(1)
            passes.append([res for i in range(len(records)) for res in by_index[i]])
        infos = ray.get([a.info.remote() for a in actors])
    finally:
        bar.close()
        for a in actors:
            ray.kill(a)
    info = dict(infos[0])
    info["peak_rss_mb"] = max(x["peak_rss_mb"] for x in infos)  # per worker process
    info["ray"] = {"workers": n, "threads_per_worker": threads}
    return passes, info
