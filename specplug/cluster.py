"""Ray glue shared by `train data --ray`, `bench --ray` and `serve --ray` (the `specplug[ray]` extra).

specplug schedules nothing across machines itself: Ray's actors carry the work (one target loaded
per actor, restarted and its call retried when its process dies), Ray Serve the replicas. This
module only connects, sizes the worker pool and hands out work to whichever actor is free.

Outputs that workers write (data shards) go straight to the output folder, so on a real cluster it
must be storage every node mounts at the same path; the driver checks each file it is told about.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Callable, Iterable, Iterator

from specplug.errors import SpecplugError

EXTRA_HINT = "pip install 'specplug[ray]'"


def require_ray():
    """The ray module, or one clear error naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise SpecplugError(f"--ray needs Ray, which is not installed here: {EXTRA_HINT}") from None
    return ray


def connect(address: str | None):
    """Join the cluster at `address` ('auto' = the one `ray start` made on this node), or, with an
    empty address, RAY_ADDRESS's cluster when set, else a local cluster on this machine."""
    ray = require_ray()
    if ray.is_initialized():
        return ray
    kwargs: dict[str, Any] = {"log_to_driver": False, "include_dashboard": False}
    if address:
        kwargs["address"] = address
    elif not os.environ.get("RAY_ADDRESS"):
        kwargs["_node_ip_address"] = "127.0.0.1"  # a private local cluster: nothing listens beyond this host
    # the driver's own modules (specplug, plugins) are installed on every node, not shipped per job
    try:
        ray.init(**kwargs)
    except ConnectionError as exc:
        raise SpecplugError(f"--ray {address}: cannot reach a Ray cluster there ({exc}); start one with "
                            "`ray start --head` (and `ray start --address HEAD:6379` on the other nodes)") from None
    return ray


def worker_threads(threads) -> int:
    """A Ray worker's CPU threads from a `threads` setting: `auto` (or none) means 1 under Ray, where
    the cluster's CPUs are shared out among workers; a count as given."""
    return 1 if threads in ("auto", None) else int(threads)


def pool_size(ray, threads: int, workers: int | None) -> int:
    """Workers to start: `workers`, or as many `threads`-CPU actors as the cluster's CPUs hold."""
    if workers is not None and workers < 1:
        raise SpecplugError(f"--ray-workers must be >= 1, got {workers}")
    cpus = int(ray.cluster_resources().get("CPU", 1))
    if workers is not None:
        if workers * threads > cpus:
            print(f"specplug: warning: {workers} Ray workers x {threads} threads need {workers * threads} CPUs; the "
                  f"cluster has {cpus}, so some workers wait for others to finish", file=sys.stderr)
        return workers
    return max(1, cpus // max(1, threads))


RETRIES = 4  # a worker process that dies is restarted, and its call rerun, this many times at most


def actor_options(threads: int) -> dict:
    """Actors that Ray restarts when their process dies, retrying the call they were running."""
    return {"num_cpus": threads, "max_restarts": RETRIES, "max_task_retries": RETRIES}


def run_on_pool(ray, actors: list, jobs: Iterable[Any], call: Callable[[Any, Any], Any]) -> Iterator[tuple[Any, Any]]:
    """Yield (job, result) as they finish; each actor runs one job at a time, taking the next
    when it is done (so a slow worker takes fewer). `call(actor, job)` returns an ObjectRef.
    A job whose actor dies is retried by Ray on the restarted actor; an error raised by the job
    itself ends the run as a SpecplugError naming it."""
    pending = iter(jobs)
    inflight: dict = {}
    for a in actors:
        job = next(pending, None)
        if job is None:
            break
        inflight[call(a, job)] = (a, job)
    while inflight:
        ready, _ = ray.wait(list(inflight), num_returns=1)
        ref = ready[0]
        actor, job = inflight.pop(ref)
        try:
            result = ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            if isinstance(cause, SpecplugError):
                raise SpecplugError(str(cause)) from None
            raise SpecplugError(f"a Ray worker failed on {job!r:.80}: {type(cause).__name__}: {cause}") from None
        nxt = next(pending, None)
        if nxt is not None:
            inflight[call(actor, nxt)] = (actor, nxt)
        yield job, result
