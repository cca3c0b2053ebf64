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

The parts, one module each: `schemas` (request bodies, errors), `limits` (body size, prompt
length), `prompts` (the pool), `worker` (the engine thread), `metrics`, `answers` (engine events
-> OpenAI objects) and `app` (routes, `create_app`, `serve`).
"""
from __future__ import annotations

from specplug.server.answers import Answers, TextOut
from specplug.server.app import (
    DEFAULT_MAX_BODY_MB,
    EXIT_ENGINE_FAILED,
    _model_name,  # noqa: F401  (specplug.serve_ray names a served model with it)
    create_app,
    serve,
)
from specplug.server.limits import BodyLimit
from specplug.server.metrics import Metrics
from specplug.server.prompts import Prompts
from specplug.server.schemas import APIError, ChatRequest, CompletionRequest
from specplug.server.worker import EngineDown, EngineWorker, Job

__all__ = ["APIError", "Answers", "BodyLimit", "ChatRequest", "CompletionRequest", "DEFAULT_MAX_BODY_MB",
           "EXIT_ENGINE_FAILED", "EngineDown", "EngineWorker", "Job", "Metrics", "Prompts", "TextOut", "create_app",
           "serve"]
