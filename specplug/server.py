"""`specplug serve`: an OpenAI-compatible HTTP server over one Engine, with continuous batching.

One engine thread owns the model and loops: take new requests and cancellations from its
inbox, `Engine.add` / `Engine.abort` them, then `Engine.step()`; requests join the running
batch between steps as slots free up. The HTTP side (FastAPI on uvicorn) never touches
torch: it validates, has the prompt templated and tokenized in a small pool (`Prompts`), hands
the engine a `Request`, and receives committed token ids through an asyncio queue per request,
which it turns into text, stop strings included (`Answers`).

No client can stall the others: bodies over `max_body_mb` get 413 unread (`BodyLimit`), a prompt
with more characters than the context can hold is refused before tokenization, and the pool is
bounded. The worker watches its engine: a step that raises or outruns `step_timeout_s` ends the
engine's service (errors to every request, /health 503; `serve` exits 3 for a supervisor).

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
import os
import queue
import re
import secrets
import signal
import sys
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable, Literal

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


# --- request size limits -----------------------------------------------------------------------------
class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 before it is read whole.

    A Content-Length over the limit is refused before any of the body is read; a body without
    one (chunked) is counted as it arrives and refused as soon as it passes the limit. Either way
    the connection is closed, so the rest is never read. An accepted body is handed on as one
    message (the JSON parser reads it whole anyway)."""

    def __init__(self, app, max_bytes: int, on_refuse: Callable[[str], None] | None = None):
        self.app, self.max_bytes, self.on_refuse = app, max_bytes, on_refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client went away before sending its body
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._refuse(scope, send)
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        del chunks
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:  # later calls watch for a disconnect
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope, send) -> None:
        mb = self.max_bytes / 2 ** 20
        err = APIError(413, f"The request body is larger than the server's limit of {mb:g} MB "
                            "(max_body_mb in the YAML, --max-body-mb)", code="request_too_large")
        body = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
        if self.on_refuse is not None:
            self.on_refuse(scope["path"])


# --- request mapping: bodies -> engine Requests, off the event loop -------------------------------
class _PromptTooLong(Exception):
    def __init__(self, n_tokens: int):
        self.n_tokens = n_tokens


class _BoundedTokenizer:
    """The model's tokenizer as the server uses it: encoding releases the GIL, and a text with more
    than `max_tokens` tokens is refused before its ids become a Python list.

    `tokenizers`' `encode` holds the GIL for the whole call (a 1 M-character prompt: 0.7 s in which
    the event loop and the engine thread could not run, measured); `encode_batch_fast` (or
    `encode_batch` in older versions) releases it. `_fast` also skips the offsets, whose release
    took 16 ms with the GIL held for a 425 k-token text. Tokenizers without that path are used
    as they are."""

    def __init__(self, tok, max_tokens: int):
        self._tok, self.max_tokens = tok, max_tokens
        self.bos_id = tok.bos_id
        self.apply_chat_template = tok.apply_chat_template
        hf = getattr(tok, "_hf", None)
        self._batch = getattr(hf, "encode_batch_fast", None) or getattr(hf, "encode_batch", None)
        if self._batch is not None:
            self._prefix = tok.encode("")  # BOS where the tokenizer adds one
            probe = "<|im_start|>user\nhello there, 1234 \u00e9\u4e2d!<|im_end|>"
            if self.encode(probe) != tok.encode(probe):  # another add-BOS rule: take the plain path
                self._batch = None

    def encode(self, text: str) -> list[int]:
        if self._batch is None:
            ids = self._tok.encode(text)
        else:
            enc = self._batch([text], add_special_tokens=False)[0]
            if len(enc) + len(self._prefix) > self.max_tokens:
                raise _PromptTooLong(len(enc) + len(self._prefix))
            ids = self._prefix + enc.ids
        if len(ids) > self.max_tokens:
            raise _PromptTooLong(len(ids))
        return ids


def _lower_priority() -> None:
    """A prompt worker yields the CPU to the engine thread and the event loop (Linux: per thread).

    SCHED_IDLE, where the kernel allows it: a waking engine or loop thread then takes the core from
    the worker at once, where a niced worker may keep it for the rest of its slice. That matters to
    the engine's threads, which meet at a barrier after every parallel region. Measured by
    scripts/stall_serve.py (context 8192, a 663 k-character prompt beside small requests, 2 cores,
    3 alternations, median of 3 rounds each): p99 1.35/1.69/1.70x idle, with nice 10 1.45/1.63/2.17x."""
    if sys.platform.startswith("linux"):
        tid = threading.get_native_id()
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            try:
                os.setpriority(os.PRIO_PROCESS, tid, 10)
            except OSError:
                pass


class Prompts:
    """OpenAI request bodies -> engine Requests.

    Cheap checks (model name, prompt length in characters) run on the event loop; the chat
    template, tokenization and the rest run in a small thread pool, never on the loop nor on the
    engine thread. A prompt longer than context x the vocabulary's longest token (in characters)
    cannot fit the context whatever it says, so it is refused before it is tokenized. At most
    `max_waiting` requests wait for a worker (429 beyond), each for at most `wait_s` (then 503).
    """

    def __init__(self, engine: Engine, model_name: str, chat_template: bool, system: str | None,
                 workers: int = 2, max_waiting: int = 64, wait_s: float = 10.0):
        self.engine, self.model_name, self.chat_template, self.system = engine, model_name, chat_template, system
        tok = engine.target.tokenizer
        longest = max((len(t) for t in getattr(tok, "token_texts", ())), default=0)
        # each token covers at most `longest` characters (a byte-level token's text has one character
        # per byte; an SPM piece one per character), so more characters mean more tokens than fit
        self.max_chars = engine.max_ctx * longest if longest else None
        self.tok = _BoundedTokenizer(tok, engine.max_ctx)
        self.spec_names = [s.name for s in engine.specs]
        self.max_waiting, self.wait_s = max_waiting, wait_s
        # one text per call: tokenizers' rayon threads would only spin beside the worker (0.82 vs
        # 0.42 s of CPU for 850 k characters, measured) and escape its lower priority
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="specplug-prompt", initializer=_lower_priority)
        self._free = asyncio.Semaphore(workers)
        self._waiting = 0
        self.rejected = 0  # requests refused for want of a worker (429 or 503)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def chat(self, body: ChatRequest) -> Request:
        self._check_model(body)
        msgs = [{"role": "system" if m.role == "developer" else m.role,
                 "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)}
                for m in body.messages]
        system = None if any(m["role"] == "system" for m in msgs) else self.system
        self._check_chars(sum(len(m["content"]) for m in msgs) + len(system or ""), "messages")
        return await self._off_loop(self._chat, body, msgs, system)

    async def completion(self, body: CompletionRequest) -> Request:
        self._check_model(body)
        p = body.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, list) and any(isinstance(x, (str, list)) for x in p):
            raise APIError(400, "Only one prompt per request is supported (n=1, a single prompt)", "prompt")
        if isinstance(p, str):
            self._check_chars(len(p), "prompt")
        elif len(p) > self.engine.max_ctx:
            self._too_long(len(p), "prompt")
        return await self._off_loop(self._completion, body, p)

    def _check_model(self, body: _Sampling) -> None:
        if body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server has `{self.model_name}`",
                           "model", "model_not_found")

    def _check_chars(self, n_chars: int, param: str) -> None:
        if self.max_chars is not None and n_chars > self.max_chars:
            raise APIError(400, f"This model's maximum context length is {self.engine.max_ctx} tokens; the prompt "
                                f"has {n_chars} characters, more than that many tokens can hold "
                                f"({self.max_chars})", param, "context_length_exceeded")

    def _too_long(self, n_tokens: int, param: str):
        raise APIError(400, f"This model's maximum context length is {self.engine.max_ctx} tokens; the prompt has "
                            f"{n_tokens} tokens, which leaves no room to generate", param, "context_length_exceeded")

    async def _off_loop(self, fn, *args) -> Request:
        """fn(*args) in the pool, once a worker is free."""
        if self._waiting >= self.max_waiting:
            self.rejected += 1
            raise APIError(429, f"The server is busy: {self._waiting} requests wait for their prompt to be "
                                "prepared; retry later", code="queue_full", type_="server_busy",
                           headers={"Retry-After": "1"})
        self._waiting += 1
        try:
            await asyncio.wait_for(self._free.acquire(), self.wait_s)
        except asyncio.TimeoutError:
            self.rejected += 1
            raise APIError(503, f"The server is busy: no prompt worker was free within {self.wait_s:g} s; retry "
                                "later", code="prompt_workers_busy", type_="server_busy",
                           headers={"Retry-After": str(max(1, math.ceil(self.wait_s)))}) from None
        finally:
            self._waiting -= 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self._free.release()

    # in the pool below
    def _chat(self, body: ChatRequest, msgs: list[dict], system: str | None) -> Request:
        from specplug.api import prompt_ids

        try:
            ids = prompt_ids(self.tok, msgs, self.chat_template, system)
        except _PromptTooLong as exc:
            self._too_long(exc.n_tokens, "messages")
        except SpecplugError as exc:
            raise APIError(400, str(exc), "messages") from None
        return self._request(body, ids, body.max_completion_tokens or body.max_tokens, "messages")

    def _completion(self, body: CompletionRequest, p: str | list[int]) -> Request:
        if isinstance(p, str):
            try:
                ids = self.tok.encode(p)
            except _PromptTooLong as exc:
                self._too_long(exc.n_tokens, "prompt")
        else:
            vocab = self.engine.vocab
            bad = next((t for t in p if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"Token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
            ids = list(p)
        if not ids:
            raise APIError(400, "The prompt is empty", "prompt")
        return self._request(body, ids, body.max_tokens, "prompt")

    def _request(self, body: _Sampling, ids: list[int], max_tokens: int | None, param: str) -> Request:
        engine = self.engine
        room = engine.max_ctx - 1 - len(ids)
        if room < 1:
            self._too_long(len(ids), param)
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
                unknown = [n for n in spec.speculators if n not in self.spec_names]
                if unknown:
                    raise APIError(400, f"Unknown speculator {unknown[0]!r}; this server has "
                                        f"{', '.join(map(repr, self.spec_names)) or 'none'}", "speculative.speculators")
                speculators = tuple(spec.speculators)
        return Request(ids, max_tokens if max_tokens is not None else room, sampling=sp, seed=seed,
                       speculators=speculators, n_max=n_max, ignore_eos=body.ignore_eos)


# --- the engine thread -----------------------------------------------------------------------------
@dataclass
class Job:
    """One HTTP request as the engine thread sees it."""

    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    handle: int | None = None
    cancelled: bool = False
    error: tuple[int, str, str] | None = None  # (status, message, code) to answer instead of the result
    closed: bool = False  # answered with an error by the watchdog: later engine events are dropped
    result: SequenceResult | None = None  # the engine's result, when it has finished
    t_submit: float = field(default_factory=time.perf_counter)

    def send(self, event: tuple) -> None:  # from the engine thread
        if not self.closed:
            self._put(event)

    def fail(self, status: int, message: str, code: str) -> None:
        """Answer with an error now, whatever the engine does with this request later."""
        self.closed = True
        self._put(("error", status, message, code))

    def _put(self, event: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class _Gone(Exception):
    """The client of a non-streaming request disconnected."""


class EngineDown(Exception):
    """The engine died or stalled; the server answers 503 until it is restarted."""


class EngineWorker:
    """The thread that owns the engine. Other threads only put commands in its inbox.

    It also watches the engine: a step that raises (the engine's state is then unknown) or runs
    longer than `step_timeout_s` ends its service. Every request in flight or queued is answered
    with an error at once, new ones get 503, `failure` says why, and `on_failure(why)` is called
    once (`serve` exits non-zero there, so that a supervisor restarts the process).
    """

    def __init__(self, engine: Engine, max_queue: int, metrics: "Metrics | None" = None,
                 step_timeout_s: float | None = None, on_failure: Callable[[str], None] | None = None):
        self.engine = engine
        self.capacity = engine.n_parallel + max_queue
        self.metrics = metrics
        self.step_timeout_s = step_timeout_s
        self.on_failure = on_failure
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # outstanding, _jobs and failure
        self.outstanding = 0  # submitted and not yet finished
        self._jobs: dict[int, Job] = {}
        self._recent: deque[float] = deque(maxlen=32)  # durations of the last requests, for Retry-After
        self.thread: threading.Thread | None = None
        self.running = False
        self.failure: str | None = None  # why the engine stopped serving, once it has
        self._step_t0: float | None = None  # when the step now running began

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
        """Queue a job unless `parallel + max_queue` requests are already in; False = full.
        Raises EngineDown once the engine has failed."""
        with self._lock:
            if self.failure is not None:
                raise EngineDown(self.failure)
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

    def run(self, until=None) -> None:
        """The engine loop, in the calling thread, until `stop()`, a failure of the engine (or until
        `until()` turns true while idle).

        Run it in the thread that loaded the model: the kernels' OpenMP workers belong to the
        thread that started them, and with a second thread starting its own team libgomp sees
        more threads than cores and stops spinning between parallel regions, which made every
        decoding step ~2.7x slower here (10.7 vs 4.0 ms on SmolLM2, measured).
        """
        self.running = True
        if self.step_timeout_s:
            threading.Thread(target=self._watch, name="specplug-watchdog", daemon=True).start()
        try:
            self._loop(until)
        finally:
            self.running = False

    def _watch(self) -> None:
        """Watchdog thread: the engine thread cannot notice its own stalled step."""
        limit = self.step_timeout_s
        while self.running and self.failure is None:
            time.sleep(min(0.25, limit / 4))
            t0 = self._step_t0
            if t0 is not None and time.perf_counter() - t0 > limit:
                self.fail(f"the engine stalled: a step has run for over {limit:g} s (step_timeout_s)", "engine_stalled")

    def fail(self, why: str, code: str) -> None:
        """End the engine's service (any thread): answer every request in flight and queued with
        an error now, refuse new ones. Counted once, as a failure or a stall."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = why
            jobs = list(self._jobs.values())
            self._jobs.clear()
        log.error("%s; every request in flight is answered with an error and new ones get 503", why)
        if self.metrics is not None:
            (self.metrics.engine_stalls if code == "engine_stalled" else self.metrics.engine_failures).inc()
        for job in jobs:
            job.fail(500, why, code)
        self._drain(503, why, code)
        if self.on_failure is not None:
            self.on_failure(why)

    def _drain(self, status: int, why: str, code: str) -> None:
        """Answer the jobs still in the inbox, which were never added to the engine."""
        while True:
            try:
                kind, job = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._done(job)
                job.fail(status, why, code)

    # engine thread only below
    def _loop(self, until) -> None:
        eng = self.engine
        while self.failure is None:
            try:
                cmd = self.inbox.get_nowait() if eng.has_work else self.inbox.get(timeout=0.25)
            except queue.Empty:
                cmd = None
                if until is not None and until():
                    self._shut_down("the server is shutting down")
                    return
            while cmd is not None:
                if cmd[0] == "stop":
                    self._shut_down("the server is shutting down")
                    return
                self._command(*cmd)
                try:
                    cmd = self.inbox.get_nowait()
                except queue.Empty:
                    cmd = None
            if not eng.has_work or self.failure is not None:
                continue
            self._step_t0 = t0 = time.perf_counter()
            try:
                eng.step()
            except Exception as exc:  # its state is unknown now: no further steps
                log.exception("engine step failed")
                self.fail(f"the engine failed: {type(exc).__name__}: {exc}", "engine_failed")
            finally:
                self._step_t0 = None
            if self.metrics is not None:
                self.metrics.step_seconds.observe(time.perf_counter() - t0)
        self._drain(503, self.failure, "engine_unavailable")

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
            handle = self.engine.add(job.request, lambda ids: job.send(("tokens", ids)),
                                     lambda res: self._finished(job, res))
        except SpecplugError as exc:
            self._done(job)
            job.send(("error", 400, str(exc), None))
            return
        job.handle = handle
        with self._lock:
            self._jobs[handle] = job

    def _finished(self, job: Job, res: SequenceResult) -> None:
        with self._lock:
            self._jobs.pop(res.handle, None)
        self._done(job)
        if job.error is not None:
            job.send(("error", *job.error))
        else:
            job.send(("done", res))

    def _done(self, job: Job) -> None:
        with self._lock:
            self.outstanding -= 1
        self._recent.append(time.perf_counter() - job.t_submit)

    def _shut_down(self, why: str) -> None:
        for job in list(self._jobs.values()):
            job.error = (503, why, "shutting_down")
        self.engine.abort_all()
        self._drain(503, why, "shutting_down")


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
        self.engine_failures = Counter("specplug_engine_failures", "Engine steps that raised (the engine then stops "
                                       "serving)", registry=r)
        self.engine_stalls = Counter("specplug_engine_stalls", "Engine steps that ran over step_timeout_s (the engine "
                                     "then stops serving)", registry=r)
        self._worker = worker
        self.prompts: Prompts | None = None
        r.register(self)  # the engine-side figures are read at scrape time

    def collect(self):
        w = self._worker
        eng = w.engine
        yield GaugeMetricFamily("specplug_requests_running", "Requests in a sequence slot", value=eng.n_running)
        yield GaugeMetricFamily("specplug_requests_waiting", "Requests queued for a slot (queue depth)", value=w.waiting)
        yield GaugeMetricFamily("specplug_slots", "Sequence slots (parallel)", value=eng.n_parallel)
        yield GaugeMetricFamily("specplug_engine_up", "1 while the engine serves, 0 once it died or stalled",
                                value=0.0 if w.failure is not None else 1.0)
        if self.prompts is not None:
            yield CounterMetricFamily("specplug_prompt_rejected_requests", "Requests refused because no prompt worker "
                                      "was free (429 / 503)", value=self.prompts.rejected)
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
        hook_s = CounterMetricFamily("specplug_spec_hook_seconds", "Time in each hook of the speculator (every "
                                     "sequence waits for it)", labels=["speculator", "hook"])
        hook_calls = CounterMetricFamily("specplug_spec_hook_calls", "Calls of each hook of the speculator",
                                         labels=["speculator", "hook"])
        asked = CounterMetricFamily("specplug_spec_asked_steps", "Sequence-steps the speculator was asked to draft "
                                    "(the others of spec_possible_steps: paused, or no draft could pay)",
                                    labels=["speculator"])
        possible = CounterMetricFamily("specplug_spec_possible_steps", "Sequence-steps the speculator could have "
                                       "drafted for", labels=["speculator"])
        for s in eng.specs:
            ss = s.stats
            for hook, sec in list(ss.hook_s.items()):
                hook_s.add_metric([s.name, hook], sec)
                hook_calls.add_metric([s.name, hook], ss.hook_calls.get(hook, 0))
            asked.add_metric([s.name], ss.asked)
            possible.add_metric([s.name], ss.seq_steps)
            drafted.add_metric([s.name], ss.drafted_tokens)
            accepted.add_metric([s.name], ss.accepted_tokens)
            drafts.add_metric([s.name], ss.drafts)
            rate.add_metric([s.name], ss.acceptance_rate)
            mal.add_metric([s.name], (ss.accepted_tokens + ss.drafts) / ss.drafts if ss.drafts else 0.0)
            enabled.add_metric([s.name], 1.0 if s.enabled else 0.0)
        yield from (drafted, accepted, drafts, rate, mal, enabled, hook_s, hook_calls, asked, possible)


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


# --- answers: engine events -> OpenAI responses (whole or SSE) --------------------------------------
class Answers:
    """Submits a prepared Request to the engine worker and turns its events into the response."""

    def __init__(self, worker: EngineWorker, metrics: Metrics, tokenizer, model_name: str, max_queue: int):
        self.worker, self.metrics, self.tok, self.model_name, self.max_queue = (
            worker, metrics, tokenizer, model_name, max_queue)

    async def serve(self, request: HTTPRequest, body: _Sampling, req: Request, chat: bool):
        worker = self.worker
        job = Job(req, asyncio.get_running_loop())
        try:
            queued = worker.try_submit(job)
        except EngineDown as exc:
            raise engine_unavailable(str(exc)) from None
        if not queued:
            self.metrics.rejected.inc()
            raise APIError(429, f"The server is busy: {worker.engine.n_parallel} requests running and "
                                f"{self.max_queue} waiting; retry later", code="queue_full", type_="server_busy",
                           headers={"Retry-After": str(worker.retry_after())})
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        out = TextOut(self.tok, stops)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        t_created = int(time.time())
        if body.stream:
            return StreamingResponse(self._stream(request, body, job, out, rid, t_created, chat),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._whole(request, job, out, rid, t_created, chat)

    async def _next(self, job: Job, request: HTTPRequest, watch: bool) -> tuple:
        """The next event of a job; with `watch`, cancel it when the client goes away."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), timeout=0.5 if watch else None)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    self.worker.cancel(job)
                    raise _Gone from None

    async def _result(self, job: Job, request: HTTPRequest, out: TextOut, watch: bool):
        """Events until the end: yields text pieces, returns via StopAsyncIteration; the final
        SequenceResult is left in job.result."""
        first = True
        while True:
            ev = await self._next(job, request, watch)
            if ev[0] == "error":
                _, status, message, code = ev
                raise APIError(status, message, code=code,
                               type_="server_error" if status >= 500 else "invalid_request_error")
            if ev[0] == "done":
                job.result = ev[1]
                tail = out.finish()
                if tail:
                    yield tail
                return
            if first and ev[1]:
                self.metrics.ttft.observe(time.perf_counter() - job.t_submit)
                first = False
            text = out.push(ev[1])
            if out.stopped and job.handle is not None:
                self.worker.cancel(job)  # stop string: the engine stops at its next step; the result still comes
            if text:
                yield text

    @staticmethod
    def _finish_reason(job: Job, out: TextOut) -> str:
        res = job.result
        if out.stopped or res is None or res.finish_reason in ("stop", "abort"):
            return "stop"
        return "length"  # max_tokens, or the context filled up

    def _usage(self, job: Job, out: TextOut) -> dict:
        n = len(job.request.prompt_ids)
        self.metrics.prompt_tokens.inc(n)
        self.metrics.completion_tokens.inc(out.tokens)
        return {"prompt_tokens": n, "completion_tokens": out.tokens, "total_tokens": n + out.tokens}

    @staticmethod
    def _spec_stats(job: Job) -> dict:
        res = job.result
        if res is None:
            return {}
        d = res.stats.to_dict()
        return {**{k: d[k] for k in ("drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length",
                                     "target_forwards")},
                "by_speculator": {k: {"drafted_tokens": v.drafted_tokens, "accepted_tokens": v.accepted_tokens}
                                  for k, v in res.stats.by_speculator.items() if v.drafts}}

    async def _whole(self, request, job, out, rid, t_created, chat):
        pieces = []
        try:
            async for text in self._result(job, request, out, True):
                pieces.append(text)
        except _Gone:  # nobody reads this answer; its slot is already being freed
            return Response(status_code=499)
        except asyncio.CancelledError:
            self.worker.cancel(job)
            raise
        text = "".join(pieces)
        choice = {"index": 0, "finish_reason": self._finish_reason(job, out), "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": t_created,
                "model": self.model_name, "choices": [choice], "usage": self._usage(job, out),
                "speculative_stats": self._spec_stats(job)}

    async def _stream(self, request, body, job, out, rid, t_created, chat):
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text: str | None, finish: str | None = None, first: bool = False, **extra) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return {"id": rid, "object": kind, "created": t_created, "model": self.model_name, "choices": [choice],
                    **extra}

        include_usage = body.stream_options is not None and body.stream_options.include_usage
        try:
            if chat:
                yield _sse(chunk(None, first=True))
            async for text in self._result(job, request, out, False):
                yield _sse(chunk(text))
            yield _sse(chunk(None, self._finish_reason(job, out), speculative_stats=self._spec_stats(job)))
            u = self._usage(job, out)
            if include_usage:
                yield _sse({"id": rid, "object": kind, "created": t_created, "model": self.model_name,
                            "choices": [], "usage": u})
        except APIError as exc:
            yield _sse(exc.body())
        except (asyncio.CancelledError, GeneratorExit):  # the client went away: free its slot
            self.worker.cancel(job)
            raise
        yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def engine_unavailable(why: str) -> APIError:
    return APIError(503, f"The engine is not serving: {why}; the server must be restarted", code="engine_unavailable",
                    type_="server_error")


# --- the app: routes --------------------------------------------------------------------------------
DEFAULT_MAX_BODY_MB = 4.0


def create_app(engine: Engine, model_name: str, *, max_queue: int = 64, api_key: str | None = None,
               chat_template: bool = True, system: str | None = None, start: bool = True,
               max_body_mb: float = DEFAULT_MAX_BODY_MB, step_timeout_s: float | None = None,
               prompt_workers: int = 2, prompt_wait_s: float = 10.0,
               on_failure: Callable[[str], None] | None = None) -> FastAPI:
    """The ASGI app serving `engine`. With `start`, the engine loop starts in a thread of its own with
    the app's lifespan; without, run `app.state.worker.run()` yourself (as `serve` does, in the
    main thread), and the lifespan's end stops it. Request bodies over `max_body_mb` get 413; an
    engine step that raises or runs over `step_timeout_s` ends the engine's service (/health 503,
    `on_failure(why)` called once; see EngineWorker)."""
    worker = EngineWorker(engine, max_queue, step_timeout_s=step_timeout_s, on_failure=on_failure)
    worker.metrics = metrics = Metrics(worker)
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
    app.state.worker, app.state.metrics, app.state.prompts = worker, metrics, prompts

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

    return app


def serve(cfg, host: str = "127.0.0.1", port: int = 8080, *, max_queue: int = 64, drain_timeout: float = 30.0,
          api_key: str | None = None, model_name: str | None = None, log_level: str = "info") -> int:
    """Load the config's target and speculators and serve them until SIGINT/SIGTERM; on a signal
    the server stops accepting, lets requests in flight finish for up to `drain_timeout`
    seconds, then exits 0. When the engine fails (a step raises or runs over `step_timeout_s`),
    requests in flight get an error, and the server stops and returns 3 so that a supervisor
    restarts it (the speculator at fault is unknown, and the engine's state with it)."""
    import uvicorn

    from specplug.api import build_engine

    engine = build_engine(cfg)
    name = model_name or _model_name(cfg.model)
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
        os._exit(EXIT_ENGINE_FAILED)

    app = create_app(engine, name, max_queue=max_queue, api_key=api_key, chat_template=cfg.chat, system=cfg.system,
                     start=False, max_body_mb=cfg.max_body_mb, step_timeout_s=cfg.step_timeout_s,
                     on_failure=on_failure)
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
    if failed:
        log.error("exiting with status %d: %s", EXIT_ENGINE_FAILED, failed[0])
        return EXIT_ENGINE_FAILED
    return 0 if server.started else 1


EXIT_ENGINE_FAILED = 3  # `specplug serve`'s exit status when its engine died or stalled


def _model_name(model: str) -> str:
    from pathlib import Path

    return Path(model).stem if model.endswith(".gguf") else model
