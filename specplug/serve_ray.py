"""`specplug serve CONFIG --ray [ADDRESS] --replicas N`: the same server as a Ray Serve deployment.

Each replica is a Ray actor holding one engine and the app of `specplug.server.create_app`, so
the routes, streaming, limits and errors are those of `specplug serve`; Ray Serve's proxy spreads
requests over the replicas (and, with `ray.max_replicas` in the YAML, adds and removes replicas
on the requests each one holds: running plus queued, the engine's queue depth).

Metrics: every replica labels its metrics `replica="<id>"` and serves them on a port of its own;
a small directory actor lists those addresses. GET /metrics on the proxy returns every live
replica's metrics in one exposition (the replica that answers gathers them), and GET /replicas
lists each replica's own metrics URL, for a Prometheus that scrapes them one by one.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import urllib.request

from specplug import cluster
from specplug.api import build_engine
from specplug.errors import SpecplugError
from specplug.server import _model_name, create_app

log = logging.getLogger("specplug")
_directory = None  # the ReplicaDirectory actor's handle, in the driver

APP_NAME = "specplug"
DIRECTORY = "specplug-serve-replicas"
NAMESPACE = "specplug"  # replicas live in Serve's namespace; the directory is looked up in this one


class ReplicaDirectory:
    """A Ray actor: replica id -> its metrics URL."""

    def __init__(self):
        self.urls: dict[str, str] = {}

    def put(self, replica: str, url: str) -> None:
        self.urls[replica] = url

    def drop(self, replica: str) -> None:
        self.urls.pop(replica, None)

    def all(self) -> dict[str, str]:
        return dict(self.urls)


class Labelled:
    """A collector: another collector's metrics with extra labels on every sample."""

    def __init__(self, source, labels: dict[str, str]):
        self.source, self.labels = source, labels

    def collect(self):
        from prometheus_client.metrics_core import Metric

        for fam in self.source.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, **self.labels}, s.value, s.timestamp, s.exemplar)
            yield out


def merge_expositions(texts: list[str]) -> bytes:
    """Several Prometheus text expositions (distinct label sets) -> one valid exposition."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, object] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text):
            have = families.get(fam.name)
            if have is None:
                families[fam.name] = fam
            else:
                have.samples.extend(fam.samples)

    class _All:
        def collect(self):
            yield from families.values()

    return generate_latest(_All())


def _fetch(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()
    except OSError:
        return None


def replica_app(cfg, model_name: str, max_queue: int, api_key: str | None):
    """Runs in a replica: the engine, the app, and this replica's labelled metrics server."""
    import ray
    from fastapi.responses import JSONResponse, Response
    from prometheus_client import CONTENT_TYPE_LATEST, start_http_server
    from ray import serve

    replica = serve.get_replica_context().replica_id.unique_id
    engine = build_engine(cfg)
    directory = ray.get_actor(DIRECTORY, namespace=NAMESPACE)

    def on_failure(why: str) -> None:
        # the engine's state is unknown: end this replica's process; Serve starts a new replica
        log.error("replica %s: %s; exiting so that Ray Serve replaces it", replica, why)
        directory.drop.remote(replica)
        threading.Timer(2.0, os._exit, args=(3,)).start()

    app = create_app(engine, model_name, max_queue=max_queue, api_key=api_key, chat_template=cfg.chat,
                     system=cfg.system, max_body_mb=cfg.max_body_mb, step_timeout_s=cfg.step_timeout_s,
                     on_failure=on_failure)
    labelled = Labelled(app.state.metrics.registry, {"replica": replica})
    ip = ray.util.get_node_ip_address()
    server, _ = start_http_server(0, addr=ip, registry=labelled)
    url = f"http://{ip}:{server.server_port}/metrics"
    ray.get(directory.put.remote(replica, url))

    async def all_replicas() -> Response:
        urls = await directory.all.remote()
        texts = await asyncio.gather(*(asyncio.to_thread(_fetch, u) for u in urls.values()))
        for rid, text in zip(urls, texts):
            if text is None and rid != replica:
                directory.drop.remote(rid)  # gone (replaced or scaled down)
        return Response(merge_expositions([t for t in texts if t is not None]), media_type=CONTENT_TYPE_LATEST)

    async def replicas() -> JSONResponse:
        return JSONResponse({"replicas": [{"id": k, "metrics": v} for k, v in (await directory.all.remote()).items()],
                             "answered_by": replica})

    app.state.metrics_view = all_replicas
    app.add_api_route("/replicas", replicas, methods=["GET"])
    return app


def deployment_options(cfg, replicas: int | None, max_queue: int) -> dict:
    """Ray Serve deployment options from the config's `ray:` section (`--replicas` wins)."""
    rc = cfg.ray
    threads = cluster.worker_threads(cfg.threads)
    opts: dict = {"name": APP_NAME, "ray_actor_options": {"num_cpus": threads},
                  # requests a replica takes: its slots plus its queue (beyond that its own 429s apply)
                  "max_ongoing_requests": cfg.parallel + max_queue}
    if replicas is not None or rc.max_replicas is None:
        opts["num_replicas"] = replicas or rc.replicas
    else:
        opts["autoscaling_config"] = {"min_replicas": rc.min_replicas, "max_replicas": rc.max_replicas,
                                      "target_ongoing_requests": rc.target_ongoing_requests}
    return opts


def deploy(cfg, host: str = "127.0.0.1", port: int = 8000, *, address: str | None = "", replicas: int | None = None,
           max_queue: int = 64, api_key: str | None = None, model_name: str | None = None):
    """Start (or update) the deployment on the cluster; returns its base URL once every replica is up."""
    ray = cluster.connect(address)
    from ray import serve

    rc = cfg.ray
    opts = deployment_options(cfg, replicas, max_queue)
    threads = opts["ray_actor_options"]["num_cpus"]
    rcfg = dataclasses.replace(cfg, threads=threads)
    name = model_name or _model_name(cfg.model)
    global _directory  # held while this driver runs: an actor nobody references is ended by Ray
    _directory = ray.remote(ReplicaDirectory).options(name=DIRECTORY, namespace=NAMESPACE, get_if_exists=True,
                                                      num_cpus=0).remote()

    def build():
        return replica_app(rcfg, name, max_queue, api_key)

    serve.start(http_options={"host": host, "port": port})
    deployment = serve.deployment(serve.ingress(build)(), **opts)
    t0 = time.perf_counter()
    serve.run(deployment.bind(), name=APP_NAME, route_prefix="/")
    shown = opts.get("num_replicas") or f"{rc.min_replicas}-{rc.max_replicas} (autoscaling)"
    log.warning("serving %s on http://%s:%d/v1 with %s Ray Serve replicas x %d thread%s (up in %.0f s)", name, host,
                port, shown, threads, "s" * (threads > 1), time.perf_counter() - t0)
    return f"http://{host}:{port}"


def serve_on_ray(cfg, host: str, port: int, *, address: str | None, replicas: int | None, max_queue: int,
                 api_key: str | None, model_name: str | None) -> int:
    """`specplug serve --ray`: deploy, then hold until SIGINT/SIGTERM, then remove the deployment."""
    from ray import serve

    try:
        deploy(cfg, host, port, address=address, replicas=replicas, max_queue=max_queue, api_key=api_key,
               model_name=model_name)
    except SpecplugError:
        raise
    except Exception as exc:  # Ray Serve's own errors (a replica that failed to start, a port in use)
        raise SpecplugError(f"--ray: the deployment did not start: {type(exc).__name__}: {exc}") from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("specplug: removing the deployment", file=sys.stderr)
    serve.delete(APP_NAME)
    return 0
