"""The app: routes, auth and limits around the parts (`create_app`), and `specplug serve` (`serve`)."""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import threading
import time
from contextlib import asynccontextmanager
from typing import Callable, Sequence

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from specplug.api import build_engine
from specplug.config import SpeculatorConfig
from specplug.engine import Engine
from specplug.errors import SpecplugError
from specplug.record import Recorder
from specplug.server.answers import Answers
from specplug.server.limits import BodyLimit
from specplug.server.metrics import Metrics
from specplug.server.prompts import Prompts
from specplug.server.reload import Reloader, ReloadError, head_identity
from specplug.server.schemas import (
    APIError,
    ChatRequest,
    CompletionRequest,
    ReloadRequest,
    engine_unavailable,
    validation_error,
)
from specplug.server.worker import EngineWorker

log = logging.getLogger("specplug.server")


DEFAULT_MAX_BODY_MB = 4.0


def create_app(engine: Engine, model_name: str, *, max_queue: int = 64, api_key: str | None = None,
               chat_template: bool = True, system: str | None = None, start: bool = True,
               max_body_mb: float = DEFAULT_MAX_BODY_MB, step_timeout_s: float | None = None,
               prompt_workers: int = 2, prompt_wait_s: float = 10.0,
               on_failure: Callable[[str], None] | None = None, recorder: Recorder | None = None,
               speculators: Sequence[SpeculatorConfig] | None = None, admin_key: str | None = None) -> FastAPI:
    """The ASGI app serving `engine`. With `start`, the engine loop starts in a thread of its own with
    the app's lifespan; without, run `app.state.worker.run()` yourself (as `serve` does, in the
    main thread), and the lifespan's end stops it. Request bodies over `max_body_mb` get 413; an
    engine step that raises or runs over `step_timeout_s` ends the engine's service (/health 503,
    `on_failure(why)` called once; see EngineWorker). A `recorder` is offered every finished request
    (its owner closes it). `speculators`: the configs the engine's speculators were built from, which
    POST /admin/reload rebuilds with a new head file (`app.state.reloader`); it needs `admin_key`
    (Authorization: Bearer KEY), and answers 403 without one."""
    worker = EngineWorker(engine, max_queue, step_timeout_s=step_timeout_s, on_failure=on_failure, recorder=recorder)
    worker.metrics = metrics = Metrics(worker)
    worker.heads = {s.name: head_identity(s) for s in engine.specs}
    reloader = None if speculators is None else Reloader(
        worker, speculators, on_swap=lambda old, new, head: metrics.retire(old.name, head, old.stats))
    prompts = Prompts(engine, model_name, chat_template, system, prompt_workers, engine.n_parallel + max_queue,
                      prompt_wait_s)
    metrics.prompts = prompts
    answers = Answers(worker, metrics, engine.target.tokenizer, model_name, max_queue)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        if start:
            worker.start()
        yield
        worker.stop()
        prompts.close()

    app = FastAPI(title="specplug", lifespan=lifespan)
    app.state.worker, app.state.metrics, app.state.prompts, app.state.reloader = worker, metrics, prompts, reloader

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.middleware("http")
    async def _count_and_auth(request: HTTPRequest, call_next):
        path = request.url.path
        refused = _refusal(path, request.headers.get("authorization", ""), api_key, admin_key)
        response = refused.response() if refused is not None else await call_next(request)
        if path.startswith("/v1/"):
            metrics.requests.labels(path, str(response.status_code)).inc()
        return response

    # outermost: a body over the limit is refused before anything reads it
    app.add_middleware(BodyLimit, max_bytes=int(max_body_mb * 2 ** 20),
                       on_refuse=lambda path: metrics.requests.labels(path, "413").inc())

    @app.get("/health")
    async def health():
        alive = worker.failure is None and (worker.running or not start)
        body = {"status": "ok" if alive else "error", "running": engine.n_running, "waiting": worker.waiting,
                "slots": engine.n_parallel}
        if not alive:
            body["reason"] = worker.failure or "the engine loop is not running"
        return JSONResponse(body, status_code=200 if alive else 503)

    app.state.metrics_view = None  # an async () -> Response that replaces this server's own (serve_ray's)

    @app.get("/metrics")
    async def prom():
        if app.state.metrics_view is not None:
            return await app.state.metrics_view()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "specplug", "speculators": prompts.spec_names}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: HTTPRequest):
        if worker.failure is not None:
            raise engine_unavailable(worker.failure)
        return await answers.serve(request, body, await prompts.chat(body), chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest):
        if worker.failure is not None:
            raise engine_unavailable(worker.failure)
        return await answers.serve(request, body, await prompts.completion(body), chat=False)

    @app.post("/admin/reload")
    async def admin_reload(body: ReloadRequest):  # the key was checked by _count_and_auth
        if reloader is None:
            raise APIError(404, "This server cannot reload heads (it was started without its speculators' "
                                "settings)", code="reload_unavailable")
        try:
            return await asyncio.get_running_loop().run_in_executor(None, reloader.reload, body.speculator, body.head)
        except ReloadError as exc:
            raise APIError(exc.status, exc.message, "head" if exc.code == "head_refused" else "speculator",
                           exc.code, type_="server_error" if exc.status >= 500 else "invalid_request_error") from None

    return app


def _refusal(path: str, authorization: str, api_key: str | None, admin_key: str | None) -> APIError | None:
    """The error a request to `path` gets for its Authorization header, or None: /v1/ needs the API key
    (when set), /admin/ the admin key (and is off without one)."""
    if path.startswith("/v1/") and api_key is not None and \
            not secrets.compare_digest(authorization.encode(), f"Bearer {api_key}".encode()):
        return APIError(401, "Invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key",
                        type_="authentication_error")
    if path.startswith("/admin/"):
        if admin_key is None:
            return APIError(403, "The admin endpoints are off: start the server with --admin-key KEY (or the "
                                 "environment variable SPECPLUG_ADMIN_KEY) to use them", code="admin_disabled",
                            type_="permission_error")
        if not secrets.compare_digest(authorization.encode(), f"Bearer {admin_key}".encode()):
            return APIError(401, "Invalid or missing admin key (Authorization: Bearer ...)", code="invalid_admin_key",
                            type_="authentication_error")
    return None


def serve(cfg, host: str = "127.0.0.1", port: int = 8080, *, max_queue: int = 64, drain_timeout: float = 30.0,
          api_key: str | None = None, model_name: str | None = None, log_level: str = "info",
          admin_key: str | None = None, config_loader: Callable[[], object] | None = None) -> int:
    """Load the config's target and speculators and serve them until SIGINT/SIGTERM; on a signal
    the server stops accepting, lets requests in flight finish for up to `drain_timeout`
    seconds, then exits 0. When the engine fails (a step raises or runs over `step_timeout_s`),
    requests in flight get an error, and the server stops and returns 3 so that a supervisor
    restarts it (the speculator at fault is unknown, and the engine's state with it).

    Head files are reloaded without a restart (specplug.server.reload) by POST /admin/reload (with
    `admin_key`) and, when `config_loader` (() -> the config read again) is given, by SIGHUP: every
    speculator whose `head:` names another file, or whose file changed, gets it."""
    import uvicorn

    engine = build_engine(cfg)
    name = model_name or _model_name(cfg.model)
    recorder = Recorder.from_config(cfg.record, engine, "serve")
    failed: list[str] = []

    def on_failure(why: str) -> None:
        failed.append(why)
        server.should_exit = True  # answers in flight (errors now) are sent, then uvicorn stops
        threading.Thread(target=exit_if_stuck, name="specplug-exit", daemon=True).start()

    def exit_if_stuck() -> None:
        # a stalled step keeps the main thread: once the HTTP side is done, do not wait for it
        http.join(drain_timeout + 5)
        time.sleep(2.0)
        log.error("the engine thread is stuck in a step; exiting with status %d", EXIT_ENGINE_FAILED)
        if recorder is not None:
            recorder.close()
        os._exit(EXIT_ENGINE_FAILED)

    app = create_app(engine, name, max_queue=max_queue, api_key=api_key, chat_template=cfg.chat, system=cfg.system,
                     start=False, max_body_mb=cfg.max_body_mb, step_timeout_s=cfg.step_timeout_s,
                     on_failure=on_failure, recorder=recorder, speculators=cfg.speculators, admin_key=admin_key)
    worker: EngineWorker = app.state.worker
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout)
    server = uvicorn.Server(config)
    _handle_signals(server, drain_timeout, app.state.reloader, config_loader)
    http = threading.Thread(target=server.run, name="specplug-http", daemon=True)
    http.start()
    log.warning("serving %s on http://%s:%d/v1 (%d slots, %d queued at most, speculators: %s)", name, host, port,
                engine.n_parallel, max_queue, ", ".join(s.name for s in engine.specs) or "none")
    if recorder is not None:
        log.warning("recording the token ids of finished requests into %s (%s of them)", recorder.folder,
                    "all" if recorder.sample == 1 else f"a random {recorder.sample:.0%}")
    try:
        worker.run(until=lambda: not http.is_alive())
        http.join(drain_timeout + 5)
    finally:
        if recorder is not None:
            recorder.close()
    if failed:
        log.error("exiting with status %d: %s", EXIT_ENGINE_FAILED, failed[0])
        return EXIT_ENGINE_FAILED
    return 0 if server.started else 1


def _handle_signals(server, drain_timeout: float, reloader: Reloader | None,
                    config_loader: Callable[[], object] | None) -> None:
    """uvicorn (the asyncio loop) runs in a thread; the engine loop keeps the main thread, which
    loaded the model (see EngineWorker.run). Signals arrive in the main thread: the first
    SIGINT/SIGTERM starts uvicorn's graceful shutdown (stop accepting, let requests in flight
    finish for up to drain_timeout), a second one forces the exit. SIGHUP reloads changed head
    files, in a thread of its own (the engine thread takes them between steps)."""
    def on_stop(signum, frame):
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True
        log.warning("%s: draining requests in flight (up to %.0f s), then exiting",
                    signal.Signals(signum).name, drain_timeout)

    def reload_heads():
        try:
            cfg = config_loader()
        except SpecplugError as exc:
            log.error("SIGHUP: the config could not be read again (%s); nothing was reloaded", exc)
            return
        reloader.reload_changed(cfg.speculators)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_stop)
    if reloader is not None and config_loader is not None:
        signal.signal(signal.SIGHUP, lambda signum, frame: threading.Thread(
            target=reload_heads, name="specplug-reload", daemon=True).start())


EXIT_ENGINE_FAILED = 3  # `specplug serve`'s exit status when its engine died or stalled


def _model_name(model: str) -> str:
    from pathlib import Path

    return Path(model).stem if model.endswith(".gguf") else model
