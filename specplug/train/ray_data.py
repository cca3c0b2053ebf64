"""`specplug train data --ray`: the shards of a data set made by a pool of Ray actors.

Each actor loads the target once (with its own thread count) and makes whole shards: it runs the
same DataGenerator as a single process on the shard's prompts and writes the shard under its
content-derived name (datagen.shard_name) into the output folder, unless a file of that name is
already there. The driver keeps the manifest: it adds each shard's record as the shard arrives.

A worker killed mid-shard leaves at most a temporary file (no shard): Ray restarts the actor and
runs the shard again there. A shard already written is found, not written twice. Because the
runtime's kernels are batch- and thread-count-invariant, a shard's bytes do not depend on which
worker made it, with how many threads, or beside which other prompts: the manifest of a Ray run
equals a single process's (specplug.train.dataset.manifest_sha256, which leaves out how it ran).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

from specplug import cluster
from specplug.errors import SpecplugError
from specplug.runtime import load_target
from specplug.train.generator import DataGenerator, _concat, shard_record, write_shard


class DataWorker:
    """A Ray actor: one target, one generator, whole shards on request."""

    def __init__(self, model_path: str, quant: str, threads: int, recipe: dict, out_dir: str):
        self.target = load_target(model_path, "cpu", "float32", quant, threads)
        self.gen = DataGenerator(self.target, recipe["taps"], recipe["max_tokens"], recipe["parallel"],
                                 recipe["topk"], recipe["context"], tap_dtype=recipe.get("tap_dtype", "float16"),
                                 prefill_chunk=recipe.get("prefill_chunk", 256))
        self.out_dir = Path(out_dir)

    def pid(self) -> int:
        return os.getpid()

    def shard(self, index: int, name: str, prompts: list[tuple[int, list[int]]]) -> tuple[dict, int]:
        """Make shard `index` (prompt index, prompt ids ...) as `name`; (its record, tokens generated)."""
        if (self.out_dir / name).is_file():
            return shard_record(self.out_dir, name, index), 0
        results: dict[int, dict] = {}
        before = self.gen.generated
        self.gen.run(prompts, lambda i, arrays: results.__setitem__(i, arrays))
        record = write_shard(self.out_dir, name, index, _concat([(i, results.pop(i)) for i, _ in prompts]))
        return record, self.gen.generated - before


def generate_on_ray(pool: dict, target, recipe: dict, out_dir: Path,
                    jobs: list[tuple[int, str, list]]) -> Iterator[tuple[dict, int]]:
    """Yield (shard record, tokens generated) per shard of `jobs` as Ray workers finish them."""
    from tqdm import tqdm

    ray = cluster.connect(pool.get("address"))
    threads = int(pool.get("threads") or 1)
    n = min(cluster.pool_size(ray, threads, pool.get("workers")), max(1, len(jobs)))
    model = target.model
    actor_cls = ray.remote(DataWorker)
    actors = [actor_cls.options(name=f"specplug-data-{os.getpid()}-{i}", **cluster.actor_options(threads)).remote(
        str(model.path), model.quant, threads, recipe, str(out_dir.resolve())) for i in range(n)]
    print(f"specplug: {len(jobs)} shards on {n} Ray workers x {threads} thread{'s' * (threads > 1)} "
          f"({ray.cluster_resources().get('CPU', 0):.0f} CPUs in the cluster)", file=sys.stderr)
    bar = tqdm(total=len(jobs), unit="shard", file=sys.stderr, desc=f"train data (ray) -> {out_dir.name}")
    try:
        for (index, name, _), (record, generated) in cluster.run_on_pool(
                ray, actors, jobs, lambda a, job: a.shard.remote(*job)):
            if not (out_dir / record["file"]).is_file():
                raise SpecplugError(f"a Ray worker wrote {record['file']} where this machine cannot see it; -o "
                                    f"{out_dir} must be storage that every node mounts at the same path")
            bar.update(1)
            yield record, generated
    finally:
        bar.close()
        for a in actors:
            ray.kill(a)
