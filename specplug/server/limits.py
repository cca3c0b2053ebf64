"""What keeps one client from stalling the others before its request reaches the engine: the body
size limit (ASGI middleware) and a tokenizer that refuses a prompt longer than the context."""
from __future__ import annotations

import json
from typing import Callable

from specplug.server.schemas import APIError


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


class PromptTooLong(Exception):
    def __init__(self, n_tokens: int):
        self.n_tokens = n_tokens


class BoundedTokenizer:
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
                raise PromptTooLong(len(enc) + len(self._prefix))
            ids = self._prefix + enc.ids
        if len(ids) > self.max_tokens:
            raise PromptTooLong(len(ids))
        return ids
