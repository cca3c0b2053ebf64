"""The engine thread: it owns the Engine, takes commands from its inbox between steps, and
watches its own health (a step that raises or stalls ends the engine's service)."""
from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, TypeVar

from specplug.engine import Engine, Request, SequenceResult
from specplug.errors import SpecplugError

if TYPE_CHECKING:
    from prometheus_client import Counter, Histogram

    from specplug.record import Recorder

log = logging.getLogger("specplug.server")
T = TypeVar("T")


class StepMetrics(Protocol):
    """What the engine thread counts (`specplug.server.metrics.Metrics` has these; it reads the rest
    from the worker at scrape time)."""

    engine_stalls: Counter
    engine_failures: Counter
    step_seconds: Histogram


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


class EngineDown(Exception):
    """The engine died or stalled; the server answers 503 until it is restarted."""


class EngineWorker:
    """The thread that owns the engine. Other threads only put commands in its inbox.

    It also watches the engine: a step that raises (the engine's state is then unknown) or runs
    longer than `step_timeout_s` ends its service. Every request in flight or queued is answered
    with an error at once, new ones get 503, `failure` says why, and `on_failure(why)` is called
    once (`serve` exits non-zero there, so that a supervisor restarts the process).
    """

    def __init__(self, engine: Engine, max_queue: int, metrics: StepMetrics | None = None,
                 step_timeout_s: float | None = None, on_failure: Callable[[str], None] | None = None,
                 recorder: Recorder | None = None):
        self.engine = engine
        self.recorder = recorder  # offered every request that finishes without an error
        self.heads: dict[str, str] = {}  # speculator -> its head file's identity (metrics labels; see reload.py)
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

    def between_steps(self, fn: Callable[[Engine], T], timeout: float) -> T:
        """fn(engine), run in the engine thread between two steps; its result (or its exception)
        returned here. Raises EngineDown when the engine stops serving first, TimeoutError after
        `timeout` seconds."""
        done: Future = Future()
        with self._lock:
            if self.failure is not None:
                raise EngineDown(self.failure)
        self.inbox.put(("call", (fn, done)))
        return done.result(timeout)

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
            elif kind == "call":
                job[1].set_exception(EngineDown(why))

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

    def _command(self, kind: str, job) -> None:
        if kind == "call":  # job: (fn, future), from between_steps
            fn, done = job
            try:
                done.set_result(fn(self.engine))
            except Exception as exc:
                done.set_exception(exc)
            return
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
            return
        job.send(("done", res))
        if self.recorder is not None:
            self.recorder.offer(res.prompt_ids, res.token_ids)

    def _done(self, job: Job) -> None:
        with self._lock:
            self.outstanding -= 1
        self._recent.append(time.perf_counter() - job.t_submit)

    def _shut_down(self, why: str) -> None:
        for job in list(self._jobs.values()):
            job.error = (503, why, "shutting_down")
        self.engine.abort_all()
        self._drain(503, why, "shutting_down")
