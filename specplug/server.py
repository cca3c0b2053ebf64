"""`specplug serve`: an OpenAI-compatible HTTP server over one Engine, with continuous batching.

One engine thread owns the model and loops: take new requests and cancellations from its
inbox, `Engine.add` / `Engine.abort` them, then `Engine.step()`; requests join the running
batch between steps as slots free up. The HTTP side (FastAPI on uvicorn) never touches
torch: it validates and tokenizes, hands the engine a `Request`, and receives committed token
ids through an asyncio queue per request, which it turns into text (stop strings included).

Endpoints: POST /v1/chat/completions, POST /v1/completions (both streaming with SSE or not),
GET /v1/models, GET /health, GET /metrics (Prometheus). A request picks its speculation in the
extra body field `speculative`: false (none), true / absent (every configured speculator), or
{"speculators": [names], "n_max": N}; the response carries `speculative_stats`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import queue
import re
import secrets
import signal
import threading
import time
import uuid
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, field_validator

from specplug.engine import Engine, Request, SequenceResult
from specplug.errors import SpecplugError
from specplug.sampling import SamplingParams

log = logging.getLogger("specplug.server")


# --- errors ----------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _validation_error(exc: RequestValidationError) -> APIError:
    """Pydantic's most specific complaint as one OpenAI-style 400 naming the field."""
    errors = exc.errors() or [{"msg": "invalid request", "loc": (), "type": ""}]
    # a union (`stop`, `speculative`) reports one error per member, with the member's type in the
    # path: keep field names and list indices only, and take the error that got deepest
    def path(err) -> list[str]:
        return [str(x) for x in err.get("loc", ()) if isinstance(x, int) or (
            re.fullmatch(r"[a-z_][a-z0-9_]*", str(x)) and x not in ("body", "str", "int", "float", "bool"))]

    err = max(errors, key=lambda e: len(path(e)))
    param = ".".join(path(err)) or None
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        msg = f"Unrecognized request argument supplied: {param}"
    elif kind == "json_invalid":
        msg = f"The body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
        param = None
    elif kind == "missing":
        msg = f"Missing required parameter: {param}" if param else "The request body is missing"
    else:
        text = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        msg = f"Invalid value for {param}: {text}" if param else text
    return APIError(400, msg, param)


# --- request bodies --------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpeculativeOptions(_Strict):
    speculators: list[str] | None = None  # None: every configured speculator
    n_max: int | None = Field(None, ge=0)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0, lt=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool = False
    speculative: bool | SpeculativeOptions | None = None

    @field_validator("n")
    @classmethod
    def _one(cls, v):
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, v):
        if v not in (None, 0, 0.0):
            raise ValueError("penalties are not supported (they would change the target distribution); use 0")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return v


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("logprobs are not supported")
        return v


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    @field_validator("echo", "suffix", "best_of", "logprobs")
    @classmethod
    def _unsupported(cls, v, info):
        if v not in (None, False, 1) or (info.field_name == "logprobs" and v is not None):
            raise ValueError("not supported")
        return v


# --- the engine thread -----------------------------------------------------------------------------
@dataclass
class Job:
    """One HTTP request as the engine thread sees it."""

    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    handle: int | None = None
    cancelled: bool = False
    error: str | None = None
    result: SequenceResult | None = None  # the engine's result, when it has finished
    t_submit: float = field(default_factory=time.perf_counter)

    def send(self, event: tuple) -> None:  # from the engine thread
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class _Gone(Exception):
    """The client of a non-streaming request disconnected."""


class EngineWorker:
    """The thread that owns the engine. Other threads only put commands in its inbox."""

    def __init__(self, engine: Engine, max_queue: int, metrics: "Metrics | None" = None):
        self.engine = engine
        self.capacity = engine.n_parallel + max_queue
        self.metrics = metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.outstanding = 0  # submitted and not yet finished
        self._jobs: dict[int, Job] = {}
        self._recent: deque[float] = deque(maxlen=32)  # durations of the last requests, for Retry-After
        self.thread: threading.Thread | None = None
        self.running = False

    def start(self) -> None:
        """Run the engine loop in a new thread (tests, embedding the app elsewhere). `specplug serve`
        runs it in the main thread instead, see `serve`."""
        self.thread = threading.Thread(target=self.run, name="specplug-engine", daemon=True)
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.inbox.put(("stop", None))
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def try_submit(self, job: Job) -> bool:
        """Queue a job unless `parallel + max_queue` requests are already in; False = full."""
        with self._lock:
            if self.outstanding >= self.capacity:
                return False
            self.outstanding += 1
        self.inbox.put(("add", job))
        return True

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        self.inbox.put(("cancel", job))

    @property
    def waiting(self) -> int:
        return max(0, self.outstanding - self.engine.n_running)

    def retry_after(self) -> int:
        """Seconds until a slot is likely free: the recent mean request time x the queue ahead, per slot."""
        mean = sum(self._recent) / len(self._recent) if self._recent else 1.0
        return max(1, min(60, math.ceil(mean * (self.waiting + 1) / self.engine.n_parallel)))

    # engine thread only below
    def run(self, until=None) -> None:
        """The engine loop, in the calling thread, until `stop()` (or `until()` turns true while idle).

        Run it in the thread that loaded the model: the kernels' OpenMP workers belong to the
        thread that started them, and with a second thread starting its own team libgomp sees
        more threads than cores and stops spinning between parallel regions, which made every
        decoding step ~2.7x slower here (10.7 vs 4.0 ms on SmolLM2, measured).
        """
        self.running = True
        try:
            self._loop(until)
        finally:
            self.running = False

    def _loop(self, until) -> None:
        eng = self.engine
        while True:
            try:
                cmd = self.inbox.get_nowait() if eng.has_work else self.inbox.get(timeout=0.25)
            except queue.Empty:
                cmd = None
                if until is not None and until():
                    self._fail_all("the server is shutting down")
                    return
            while cmd is not None:
                if cmd[0] == "stop":
                    self._fail_all("the server is shutting down")
                    return
                self._command(*cmd)
                try:
                    cmd = self.inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if not eng.has_work:
                continue
            t0 = time.perf_counter()
            try:
                eng.step()
            except Exception as exc:  # the target failed: answer every request in flight, keep serving
                log.exception("engine step failed")
                self._fail_all(f"the engine failed: {type(exc).__name__}: {exc}")
            if self.metrics is not None:
                self.metrics.step_seconds.observe(time.perf_counter() - t0)

    def _command(self, kind: str, job: Job) -> None:
        if kind == "cancel":
            if job.handle is not None:
                self.engine.abort(job.handle)
            return
        if job.cancelled:  # gone before it was queued
            self._done(job)
            job.send(("done", None))
            return
        try:
            job.handle = self.engine.add(job.request, lambda ids: job.send(("tokens", ids)),
                                         lambda res: self._finished(job, res))
        except SpecplugError as exc:
            self._done(job)
            job.send(("error", 400, str(exc)))
            return
        self._jobs[job.handle] = job

    def _finished(self, job: Job, res: SequenceResult) -> None:
        self._jobs.pop(res.handle, None)
        self._done(job)
        if job.error is not None:
            job.send(("error", 500, job.error))
        else:
            job.send(("done", res))

    def _done(self, job: Job) -> None:
        with self._lock:
            self.outstanding -= 1
        self._recent.append(time.perf_counter() - job.t_submit)

    def _fail_all(self, why: str) -> None:
        for job in list(self._jobs.values()):
            job.error = why
        self.engine.abort_all()
        # jobs still in the inbox were never added
        while True:
            try:
                kind, job = self.inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._done(job)
                job.send(("error", 503, why))


# --- metrics ---------------------------------------------------------------------------------------
class Metrics:
    """Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

    def __init__(self, worker: EngineWorker):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specplug_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("specplug_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("specplug_completion_tokens", "Tokens returned to clients", registry=r)
        self.ttft = Histogram("specplug_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.step_seconds = Histogram("specplug_step_seconds", "Time per engine step (admissions + one verify)",
                                      registry=r, buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))
        self.rejected = Counter("specplug_rejected_requests", "Requests refused because the queue was full", registry=r)
        self._worker = worker
        r.register(self)  # the engine-side figures are read at scrape time

    def collect(self):
        w = self._worker
        eng = w.engine
        yield GaugeMetricFamily("specplug_requests_running", "Requests in a sequence slot", value=eng.n_running)
        yield GaugeMetricFamily("specplug_requests_waiting", "Requests queued for a slot (queue depth)", value=w.waiting)
        yield GaugeMetricFamily("specplug_slots", "Sequence slots (parallel)", value=eng.n_parallel)
        st = eng.stats
        yield CounterMetricFamily("specplug_target_forwards", "Decoding forwards of the target", value=st.target_forwards)
        yield CounterMetricFamily("specplug_emitted_tokens", "Tokens the target produced, stop tokens included",
                                  value=st.emitted_tokens)
        yield GaugeMetricFamily("specplug_mean_accepted_length", "Tokens per decoding forward over all requests",
                                value=st.emitted_tokens / st.target_forwards if st.target_forwards else 0.0)
        drafted = CounterMetricFamily("specplug_spec_drafted_tokens", "Draft tokens verified", labels=["speculator"])
        accepted = CounterMetricFamily("specplug_spec_accepted_tokens", "Draft tokens accepted", labels=["speculator"])
        drafts = CounterMetricFamily("specplug_spec_drafts", "Drafts verified", labels=["speculator"])
        rate = GaugeMetricFamily("specplug_spec_acceptance_rate", "Accepted / drafted tokens", labels=["speculator"])
        mal = GaugeMetricFamily("specplug_spec_mean_accepted_length",
                                "Tokens per forward when this speculator's draft was verified", labels=["speculator"])
        enabled = GaugeMetricFamily("specplug_spec_enabled", "1 while the speculator runs, 0 once disabled",
                                    labels=["speculator"])
        for s in eng.specs:
            ss = s.stats
            drafted.add_metric([s.name], ss.drafted_tokens)
            accepted.add_metric([s.name], ss.accepted_tokens)
            drafts.add_metric([s.name], ss.drafts)
            rate.add_metric([s.name], ss.acceptance_rate)
            mal.add_metric([s.name], (ss.accepted_tokens + ss.drafts) / ss.drafts if ss.drafts else 0.0)
            enabled.add_metric([s.name], 1.0 if s.enabled else 0.0)
        yield from (drafted, accepted, drafts, rate, mal, enabled)


# --- text out: incremental detokenization and stop strings ------------------------------------------
class TextOut:
    """Token ids -> text to send, cut at the first stop string; text that may begin a stop string
    is held back until it cannot."""

    def __init__(self, tokenizer, stops: list[str]):
        self._stream = tokenizer.stream(skip_special=True)
        self._stops = stops
        self._held = ""
        self.tokens = 0  # tokens consumed (those after a stop string are not)
        self.stopped = False

    def push(self, ids: list[int]) -> str:
        for t in ids:
            if self.stopped:
                break
            self.tokens += 1
            self._held += self._stream.push(t)
            self._cut()
        return self._release()

    def finish(self) -> str:
        if not self.stopped:
            self._held += self._stream.flush()
            self._cut()
        out, self._held = self._held, ""
        return out

    def _cut(self) -> None:
        hits = [i for i in (self._held.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = self._held[:min(hits)]
            self.stopped = True

    def _release(self) -> str:
        keep = 0
        if not self.stopped:
            for s in self._stops:
                for k in range(min(len(s) - 1, len(self._held)), keep, -1):
                    if self._held.endswith(s[:k]):
                        keep = k
                        break
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out


# --- the app ---------------------------------------------------------------------------------------
def create_app(engine: Engine, model_name: str, *, max_queue: int = 64, api_key: str | None = None,
               chat_template: bool = True, system: str | None = None, start: bool = True) -> FastAPI:
    """The ASGI app serving `engine`. With `start`, the engine loop starts in a thread of its own with
    the app's lifespan; without, run `app.state.worker.run()` yourself (as `serve` does, in the
    main thread), and the lifespan's end stops it."""
    worker = EngineWorker(engine, max_queue)
    worker.metrics = metrics = Metrics(worker)
    tok = engine.target.tokenizer
    spec_names = [s.name for s in engine.specs]
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        if start:
            worker.start()
        yield
        worker.stop()

    app = FastAPI(title="specplug", lifespan=lifespan)
    app.state.worker = worker
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.middleware("http")
    async def _count_and_auth(request: HTTPRequest, call_next):
        path = request.url.path
        if api_key is not None and path.startswith("/v1/") and \
                request.headers.get("authorization", "") != f"Bearer {api_key}":
            response = APIError(401, "Invalid or missing API key (Authorization: Bearer ...)", code="invalid_api_key",
                                type_="authentication_error").response()
        else:
            response = await call_next(request)
        if path.startswith("/v1/"):
            metrics.requests.labels(path, str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health():
        alive = worker.running or not start
        body = {"status": "ok" if alive else "error", "running": engine.n_running, "waiting": worker.waiting,
                "slots": engine.n_parallel}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "specplug", "speculators": spec_names}]}

    def engine_request(body: _Sampling, ids: list[int], max_tokens: int | None, param: str) -> Request:
        if body.model != model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server has `{model_name}`",
                           "model", "model_not_found")
        room = engine.max_ctx - 1 - len(ids)
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {engine.max_ctx} tokens; the prompt has "
                                f"{len(ids)} tokens, which leaves no room to generate", param, "context_length_exceeded")
        d = engine.sampling
        sp = SamplingParams(temperature=d.temperature if body.temperature is None else body.temperature,
                            top_k=d.top_k if body.top_k is None else max(0, body.top_k),
                            top_p=d.top_p if body.top_p is None else body.top_p,
                            min_p=d.min_p if body.min_p is None else body.min_p, seed=d.seed)
        seed = body.seed
        if seed is None and d.seed is None and not sp.greedy:
            seed = secrets.randbits(62)  # OpenAI semantics: no seed, a different draw every time
        speculators, n_max = None, None
        spec = body.speculative
        if spec is False:
            speculators = ()
        elif isinstance(spec, SpeculativeOptions):
            n_max = spec.n_max
            if spec.speculators is not None:
                unknown = [n for n in spec.speculators if n not in spec_names]
                if unknown:
                    raise APIError(400, f"Unknown speculator {unknown[0]!r}; this server has "
                                        f"{', '.join(map(repr, spec_names)) or 'none'}", "speculative.speculators")
                speculators = tuple(spec.speculators)
        return Request(ids, max_tokens if max_tokens is not None else room, sampling=sp, seed=seed,
                       speculators=speculators, n_max=n_max, ignore_eos=body.ignore_eos)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: HTTPRequest):
        from specplug.api import prompt_ids

        msgs = [{"role": "system" if m.role == "developer" else m.role,
                 "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
                for m in body.messages]
        try:
            ids = prompt_ids(tok, msgs, chat_template, None if any(m["role"] == "system" for m in msgs) else system)
        except SpecplugError as exc:
            raise APIError(400, str(exc), "messages") from None
        req = engine_request(body, ids, body.max_completion_tokens or body.max_tokens, "messages")
        return await _serve(request, body, req, "chat.completion", "chatcmpl")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HTTPRequest):
        p = body.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, list) and any(isinstance(x, (str, list)) for x in p):
            raise APIError(400, "Only one prompt per request is supported (n=1, a single prompt)", "prompt")
        if isinstance(p, str):
            ids = tok.encode(p)
        else:
            vocab = engine.vocab
            bad = next((t for t in p if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"Token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
            ids = list(p)
        if not ids:
            raise APIError(400, "The prompt is empty", "prompt")
        req = engine_request(body, ids, body.max_tokens, "prompt")
        return await _serve(request, body, req, "text_completion", "cmpl")

    async def _serve(request: HTTPRequest, body: _Sampling, req: Request, obj: str, prefix: str):
        job = Job(req, asyncio.get_running_loop())
        if not worker.try_submit(job):
            metrics.rejected.inc()
            raise APIError(429, f"The server is busy: {engine.n_parallel} requests running and {max_queue} waiting; "
                                "retry later", code="queue_full", type_="server_busy",
                           headers={"Retry-After": str(worker.retry_after())})
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        out = TextOut(tok, stops)
        rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
        t_created = int(time.time())
        chat = obj == "chat.completion"
        if body.stream:
            return StreamingResponse(_stream(request, body, job, out, rid, t_created, chat),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(request, job, out, rid, t_created, chat)

    async def _next(job: Job, request: HTTPRequest, watch: bool) -> tuple:
        """The next event of a job; with `watch`, cancel it when the client goes away."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), timeout=0.5 if watch else None)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    worker.cancel(job)
                    raise _Gone from None

    async def _result(job: Job, request: HTTPRequest, out: TextOut, watch: bool):
        """Events until the end: yields text pieces, returns via StopAsyncIteration; the final
        SequenceResult is left in job.result."""
        first = True
        while True:
            ev = await _next(job, request, watch)
            if ev[0] == "error":
                raise APIError(ev[1], ev[2], type_="server_error" if ev[1] >= 500 else "invalid_request_error")
            if ev[0] == "done":
                job.result = ev[1]
                tail = out.finish()
                if tail:
                    yield tail
                return
            if first and ev[1]:
                metrics.ttft.observe(time.perf_counter() - job.t_submit)
                first = False
            text = out.push(ev[1])
            if out.stopped and job.handle is not None:
                worker.cancel(job)  # stop string: the engine stops at its next step; the result still comes
            if text:
                yield text

    def finish_reason(job: Job, out: TextOut) -> str:
        res = job.result
        if out.stopped or res is None or res.finish_reason in ("stop", "abort"):
            return "stop"
        return "length"  # max_tokens, or the context filled up

    def usage(job: Job, out: TextOut) -> dict:
        n = len(job.request.prompt_ids)
        metrics.prompt_tokens.inc(n)
        metrics.completion_tokens.inc(out.tokens)
        return {"prompt_tokens": n, "completion_tokens": out.tokens, "total_tokens": n + out.tokens}

    def spec_stats(job: Job) -> dict:
        res = job.result
        if res is None:
            return {}
        d = res.stats.to_dict()
        return {**{k: d[k] for k in ("drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length",
                                     "target_forwards")},
                "by_speculator": {k: {"drafted_tokens": v.drafted_tokens, "accepted_tokens": v.accepted_tokens}
                                  for k, v in res.stats.by_speculator.items() if v.drafts}}

    async def _whole(request, job, out, rid, t_created, chat):
        pieces = []
        try:
            async for text in _result(job, request, out, True):
                pieces.append(text)
        except _Gone:  # nobody reads this answer; its slot is already being freed
            return Response(status_code=499)
        except asyncio.CancelledError:
            worker.cancel(job)
            raise
        text = "".join(pieces)
        choice = {"index": 0, "finish_reason": finish_reason(job, out), "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": t_created,
                "model": model_name, "choices": [choice], "usage": usage(job, out),
                "speculative_stats": spec_stats(job)}

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def _stream(request, body, job, out, rid, t_created, chat):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None = None, first: bool = False, **extra) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return {"id": rid, "object": kind, "created": t_created, "model": model_name, "choices": [choice], **extra}

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        try:
            if chat:
                yield sse(chunk(None, first=True))
            async for text in _result(job, request, out, False):
                yield sse(chunk(text))
            yield sse(chunk(None, finish_reason(job, out), speculative_stats=spec_stats(job)))
            u = usage(job, out)
            if include_usage:
                yield sse({"id": rid, "object": kind, "created": t_created, "model": model_name, "choices": [],
                           "usage": u})
        except APIError as exc:
            yield sse(exc.body())
        except (asyncio.CancelledError, GeneratorExit):  # the client went away: free its slot
            worker.cancel(job)
            raise
        yield "data: [DONE]\n\n"

    return app


def serve(cfg, host: str = "127.0.0.1", port: int = 8080, *, max_queue: int = 64, drain_timeout: float = 30.0,
          api_key: str | None = None, model_name: str | None = None, log_level: str = "info") -> int:
    """Load the config's target and speculators and serve them until SIGINT/SIGTERM; on a signal
    the server stops accepting, lets requests in flight finish for up to `drain_timeout`
    seconds, then exits."""
    import uvicorn

    from specplug.api import build_engine

    engine = build_engine(cfg)
    name = model_name or _model_name(cfg.model)
    app = create_app(engine, name, max_queue=max_queue, api_key=api_key, chat_template=cfg.chat, system=cfg.system,
                     start=False)
    worker: EngineWorker = app.state.worker
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout)
    server = uvicorn.Server(config)

    # uvicorn (the asyncio loop) runs in a thread; the engine loop keeps the main thread, which
    # loaded the model (see EngineWorker.run). Signals arrive in the main thread: the first
    # SIGINT/SIGTERM starts uvicorn's graceful shutdown (stop accepting, let requests in flight
    # finish for up to drain_timeout), a second one forces the exit.
    def on_signal(signum, frame):
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True
        log.warning("%s: draining requests in flight (up to %.0f s), then exiting",
                    signal.Signals(signum).name, drain_timeout)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    http = threading.Thread(target=server.run, name="specplug-http", daemon=True)
    http.start()
    log.warning("serving %s on http://%s:%d/v1 (%d slots, %d queued at most, speculators: %s)", name, host, port,
                engine.n_parallel, max_queue, ", ".join(s.name for s in engine.specs) or "none")
    worker.run(until=lambda: not http.is_alive())
    http.join(drain_timeout + 5)
    return 0 if server.started else 1


def _model_name(model: str) -> str:
    from pathlib import Path

    return Path(model).stem if model.endswith(".gguf") else model
