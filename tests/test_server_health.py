"""Issue 26, item 3: the server tells the truth about its engine.

An exception that escapes `Engine.step`, or a step that runs over `step_timeout_s`, ends the
engine's service: requests in flight get an error at once (never a hang), /health answers 503
with the reason, /metrics counts the failure or stall, new requests get 503, and `specplug serve`
exits with status 3 so that a supervisor restarts it. Simulated with a monkeypatched step.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from launch import MODEL, running, stream_until_first_token, wait_for, write_config

from specplug.server import create_app
from specplug.testing import make_engine

LONG = {"prompt": "a", "max_tokens": 400, "ignore_eos": True}


class Breaker:
    """Wraps Engine.step: once armed, the next step raises IndexError (`raise`) or blocks until
    released (`hang`)."""

    def __init__(self, engine, mode: str):
        self.real, self.mode = engine.step, mode
        self.armed, self.release, self.entered = threading.Event(), threading.Event(), threading.Event()

    def __call__(self):
        if self.armed.is_set():
            self.entered.set()
            if self.mode == "raise":
                raise IndexError("list index out of range (a plugin wrote to DraftRequest.tokens)")
            self.release.wait(30)
        time.sleep(0.005)  # keep the long answers in flight while the test arms the breaker
        return self.real()


def _rest_of_stream(lines) -> list[dict]:
    events = []
    for line in lines:
        if line.startswith("data: "):
            events.append(None if line == "data: [DONE]" else json.loads(line[6:]))
    return events


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_a_dead_or_stalled_engine_answers_every_request_and_health_says_so(tiny_target, monkeypatch, mode):
    eng = make_engine(tiny_target, [], n_parallel=1)
    breaker = Breaker(eng, mode)
    monkeypatch.setattr(eng, "step", breaker)
    failures = []
    app = create_app(eng, MODEL, max_queue=4, step_timeout_s=0.5, on_failure=failures.append)
    with running(app) as url:
        cm, lines = stream_until_first_token(url, LONG)  # in a slot
        queued = []  # waiting for the slot
        t = threading.Thread(target=lambda: queued.append(httpx.post(
            url + "/v1/completions", json={"model": MODEL, **LONG}, timeout=30)), daemon=True)
        t.start()
        wait_for(lambda: app.state.worker.outstanding == 2, "the second request was not queued")
        t0 = time.perf_counter()
        breaker.armed.set()
        events = _rest_of_stream(lines)  # the stream ends with an error, then [DONE]
        cm.__exit__(None, None, None)
        t.join(30)
        seconds = time.perf_counter() - t0
        kind = "failed: IndexError" if mode == "raise" else "stalled"
        err = events[-2]["error"]
        assert events[-1] is None and kind in err["message"] and err["type"] == "server_error"
        assert err["code"] == ("engine_failed" if mode == "raise" else "engine_stalled")
        assert queued[0].status_code in (500, 503) and kind in queued[0].json()["error"]["message"]
        assert seconds < 5, f"the requests in flight were answered after {seconds:.1f} s"
        # health, metrics and new requests tell the truth (while a stalled step still hangs)
        h = httpx.get(url + "/health", timeout=10)
        assert h.status_code == 503 and h.json()["status"] == "error" and kind in h.json()["reason"]
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert f"specplug_engine_failures_total {1.0 if mode == 'raise' else 0.0}" in metrics
        assert f"specplug_engine_stalls_total {1.0 if mode == 'hang' else 0.0}" in metrics
        assert "specplug_engine_up 0.0" in metrics
        for path, body in [("/v1/completions", {"prompt": "b"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b"}]})]:
            r = httpx.post(url + path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=10)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
            assert kind in r.json()["error"]["message"]
        assert len(failures) == 1 and kind in failures[0]
        breaker.release.set()


def test_a_slow_step_under_the_limit_is_not_a_stall(tiny_target, monkeypatch):
    eng = make_engine(tiny_target, [], n_parallel=1)
    real = eng.step
    monkeypatch.setattr(eng, "step", lambda: time.sleep(0.2) or real())
    app = create_app(eng, MODEL, step_timeout_s=1.0)
    with running(app) as url:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 3,
                                                      "ignore_eos": True}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(url + "/health", timeout=10).status_code == 200


# `specplug serve` whose engine steps raise or hang (sys.argv[1]: "raise" / "hang") after the third
_BREAK_STEPS = """
import sys, time
import specplug.engine as engine
real = engine.Engine.step
calls = [0]
def step(self):
    calls[0] += 1
    if calls[0] > 3:
        if sys.argv[1] == "raise":
            raise IndexError("list index out of range")
        time.sleep(3600)
    return real(self)
engine.Engine.step = step
"""


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_specplug_serve_exits_3_when_its_engine_fails(tmp_path, tiny_gguf, mode, launch):
    cfg = write_config(tmp_path / "serve.yaml", tiny_gguf, context=256, parallel=1)
    served = launch.serve(cfg, "--step-timeout", "0.5", "--drain-timeout", "5", patch=_BREAK_STEPS, patch_arg=mode)
    r = httpx.post(served.url + "/v1/completions", json={"model": tiny_gguf.stem, "prompt": "a", "max_tokens": 50,
                                                         "ignore_eos": True}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] in ("engine_failed", "engine_stalled")
    assert served.proc.wait(30) == 3
    err = served.proc.stderr
    assert ("IndexError" if mode == "raise" else "stalled") in err and "exiting with status 3" in err
