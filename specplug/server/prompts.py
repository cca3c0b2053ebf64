"""The prompt pool: OpenAI request bodies -> engine Requests, templated and tokenized in a small
thread pool at low priority, off the event loop and off the engine thread."""
from __future__ import annotations

import asyncio
import math
import os
import secrets
from concurrent.futures import ThreadPoolExecutor

from specplug.api import prompt_ids
from specplug.engine import Engine, Request
from specplug.errors import SpecplugError
from specplug.record import lower_priority
from specplug.sampling import SamplingParams
from specplug.server.limits import BoundedTokenizer, PromptTooLong
from specplug.server.schemas import APIError, ChatRequest, CompletionRequest, SamplingBody, SpeculativeOptions


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
        self.tok = BoundedTokenizer(tok, engine.max_ctx)
        self.spec_names = [s.name for s in engine.specs]
        self.max_waiting, self.wait_s = max_waiting, wait_s
        # one text per call: tokenizers' rayon threads would only spin beside the worker (0.82 vs
        # 0.42 s of CPU for 850 k characters, measured) and escape its lower priority
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="specplug-prompt", initializer=lower_priority)
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

    def _check_model(self, body: SamplingBody) -> None:
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
        try:
            ids = prompt_ids(self.tok, msgs, self.chat_template, system)
        except PromptTooLong as exc:
            self._too_long(exc.n_tokens, "messages")
        except SpecplugError as exc:
            raise APIError(400, str(exc), "messages") from None
        return self._request(body, ids, body.max_completion_tokens or body.max_tokens, "messages")

    def _completion(self, body: CompletionRequest, p: str | list[int]) -> Request:
        if isinstance(p, str):
            try:
                ids = self.tok.encode(p)
            except PromptTooLong as exc:
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

    def _request(self, body: SamplingBody, ids: list[int], max_tokens: int | None, param: str) -> Request:
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
