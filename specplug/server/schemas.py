"""The server's request bodies (pydantic, unknown fields refused) and its errors, answered in
OpenAI's shape: {"error": {message, type, param, code}}."""
from __future__ import annotations

import re
from typing import Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator


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


def validation_error(exc: RequestValidationError) -> APIError:
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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpeculativeOptions(_Strict):
    speculators: list[str] | None = None  # None: every configured speculator
    n_max: int | None = Field(None, ge=0)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingBody(_Strict):
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


class ChatRequest(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v):
        if v:
            raise ValueError("logprobs are not supported")
        return v


class CompletionRequest(SamplingBody):
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


class ReloadRequest(_Strict):
    """POST /admin/reload: swap the head file of one speculator (a path on the server)."""

    speculator: str
    head: str = Field(min_length=1)


def engine_unavailable(why: str) -> APIError:
    """503 for every request once the engine died or stalled (see EngineWorker.fail)."""
    return APIError(503, f"The engine is not serving: {why}; the server must be restarted", code="engine_unavailable",
                    type_="server_error")
