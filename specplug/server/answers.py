"""Engine events -> OpenAI responses: committed token ids become text (stop strings cut), sent whole
or as server-sent events, with usage and `speculative_stats`."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse

from specplug.engine import Request
from specplug.server.metrics import Metrics
from specplug.server.schemas import APIError, SamplingBody, engine_unavailable
from specplug.server.worker import EngineDown, EngineWorker, Job


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


class _Gone(Exception):
    """The client of a non-streaming request disconnected."""


class Answers:
    """Submits a prepared Request to the engine worker and turns its events into the response."""

    def __init__(self, worker: EngineWorker, metrics: Metrics, tokenizer, model_name: str, max_queue: int):
        self.worker, self.metrics, self.tok, self.model_name, self.max_queue = (
            worker, metrics, tokenizer, model_name, max_queue)

    async def serve(self, request: HTTPRequest, body: SamplingBody, req: Request, chat: bool):
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
