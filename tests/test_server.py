"""`specplug serve`: the OpenAI-compatible server, driven by the real `openai` client.

Servers run on 127.0.0.1 with the tiny test model (in a thread of this process, or as a
`specplug serve` subprocess for the end-to-end and SIGTERM tests). Every request is bounded
by a client timeout.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
from launch import MODEL, running, stream_until_first_token, wait_for, write_config

from specplug.api import prompt_ids
from specplug.engine import Request
from specplug.hooks import hookimpl
from specplug.server import TextOut, create_app
from specplug.testing import Faulty, Oracle, RandomDrafts, make_engine, speculator

TEXTS = ["hello there the", "in the beginning was", "a", "on the other hand, the", "xyz 123", "the the the",
         "she sells sea shells", "onion"]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def server(tiny_target):
    """4 slots; speculators: an oracle that knows the chat answers to TEXTS (every third draft
    corrupted), and random drafts of up to 3 tokens."""
    vocab = tiny_target.model.config.vocab_size
    plain = make_engine(tiny_target, [], n_parallel=1)
    answers = {}
    for t in TEXTS:
        ids = chat_ids(tiny_target, t)
        answers[tuple(ids)] = plain.run([Request(ids, 60)])[0].token_ids
    eng = make_engine(tiny_target, [speculator(Oracle(answers, corrupt_every=3), name="oracle"),
                                    speculator(RandomDrafts(vocab, seed=6, max_len=3), name="short")], n_parallel=4)
    app = create_app(eng, MODEL, max_queue=16)
    with running(app) as url:
        yield url, app


def chat_ids(target, text: str) -> list[int]:
    return prompt_ids(target.tokenizer, [{"role": "user", "content": text}], True)


def reference(target, ids_list: list[list[int]], max_tokens: int) -> list[tuple[str, int, bool]]:
    """(text, completion tokens, ended on a stop token) of plain greedy decoding, each prompt alone."""
    outs = []
    for ids in ids_list:
        r = make_engine(target, [], n_parallel=1).run([Request(ids, max_tokens)])[0]
        outs.append((target.tokenizer.decode(r.token_ids, skip_special=True), len(r.token_ids), r.finish_reason))
    return outs


def test_models_health_and_metrics(server):
    url, _ = server
    models = client(url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    h = httpx.get(url + "/health", timeout=10).json()
    assert h["status"] == "ok" and h["slots"] == 4
    text = httpx.get(url + "/metrics", timeout=10).text
    for name in ("specplug_requests_running", "specplug_requests_waiting", "specplug_step_seconds_bucket",
                 'specplug_spec_mean_accepted_length{head="",speculator="oracle"}',  # head: no head file
                 "specplug_time_to_first_token_seconds"):
        assert name in text


def test_chat_and_completions_equal_plain_decoding(server, tiny_target):
    url, _ = server
    c = client(url)
    ids = chat_ids(tiny_target, TEXTS[0])
    (ref_text, ref_n, ref_finish), = reference(tiny_target, [ids], 40)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TEXTS[0]}], max_tokens=40,
                                  temperature=0)
    assert r.choices[0].message.content == ref_text and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("stop" if ref_finish == "stop" else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), ref_n)
    assert r.usage.total_tokens == len(ids) + ref_n
    st = r.model_extra["speculative_stats"]
    assert st["by_speculator"]["oracle"]["accepted_tokens"] > 0 and st["mean_accepted_length"] > 1.0

    tok = tiny_target.tokenizer
    (ref2, n2, _), = reference(tiny_target, [tok.encode(TEXTS[1])], 30)
    r = c.completions.create(model=MODEL, prompt=TEXTS[1], max_tokens=30, temperature=0)
    assert (r.choices[0].text == ref2 and r.usage.completion_tokens == n2
            and r.usage.prompt_tokens == len(tok.encode(TEXTS[1])))
    # a prompt as token ids
    r = c.completions.create(model=MODEL, prompt=tok.encode(TEXTS[1]), max_tokens=30, temperature=0)
    assert r.choices[0].text == ref2


def test_streaming_equals_the_whole_answer_and_reports_usage(server, tiny_target):
    url, _ = server
    c = client(url)
    ids = chat_ids(tiny_target, TEXTS[3])
    (ref, n, _), = reference(tiny_target, [ids], 50)
    chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TEXTS[3]}],
                                            max_tokens=50, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ref
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["speculative_stats"]["target_forwards"] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert chunks[-1].usage.prompt_tokens == len(ids)
    # completions stream; without include_usage there is no usage chunk
    tok = tiny_target.tokenizer
    (ref2, _, _), = reference(tiny_target, [tok.encode(TEXTS[4])], 25)
    chunks = list(c.completions.create(model=MODEL, prompt=TEXTS[4], max_tokens=25, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == ref2
    assert all(ch.usage is None for ch in chunks)
    # the raw stream ends with data: [DONE]
    with httpx.stream("POST", url + "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 3,
                                                             "stream": True}, timeout=30) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    assert resp.headers["content-type"].startswith("text/event-stream") and lines[-1] == "data: [DONE]"


def test_eight_concurrent_clients_get_their_solo_answers(server, tiny_target):
    url, _ = server
    refs = reference(tiny_target, [chat_ids(tiny_target, t) for t in TEXTS], 40)

    def ask(i):
        c = client(url)
        spec = [None, False, {"speculators": ["short"]}, {"n_max": 1}, {"n_max": 1}, None, None,
                {"speculators": ["short"]}][i]  # even i: whole answers with their statistics; odd i: streams
        kw = {"extra_body": {"speculative": spec}} if spec is not None else {}
        if i % 2:
            chunks = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TEXTS[i]}],
                                               max_tokens=40, temperature=0, stream=True, **kw)
            return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), None
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TEXTS[i]}], max_tokens=40,
                                      temperature=0, **kw)
        return r.choices[0].message.content, r.model_extra["speculative_stats"]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(8)))
    assert [g[0] for g in got] == [r[0] for r in refs]
    assert got[0][1]["drafted_tokens"] > 0  # all speculators
    assert got[0][1]["by_speculator"]["oracle"]["accepted_tokens"] > 0
    assert set(got[2][1]["by_speculator"]) <= {"short"}  # only the speculator it asked for
    # n_max 1: one draft token per forward at most
    assert 0 < got[4][1]["drafted_tokens"] <= got[4][1]["target_forwards"] and got[4][1]["mean_accepted_length"] <= 2
    assert got[6][1]["mean_accepted_length"] > 1.5  # the oracle, at full draft length


def test_no_speculation_per_request(server, tiny_target):
    url, _ = server
    r = client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                            temperature=0, extra_body={"speculative": False})
    st = r.model_extra["speculative_stats"]
    assert st["drafted_tokens"] == 0 and st["by_speculator"] == {}


def test_stop_strings_cut_the_text(server, tiny_target):
    url, _ = server
    c = client(url)
    (ref, _, _), = reference(tiny_target, [chat_ids(tiny_target, TEXTS[5])], 40)
    stop = ref[10:13]
    assert stop and ref.find(stop) >= 0
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TEXTS[5]}], max_tokens=40,
                                  temperature=0, stop=[stop, "\u2603never"])
    assert r.choices[0].message.content == ref[:ref.find(stop)] and r.choices[0].finish_reason == "stop"
    chunks = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TEXTS[5]}], max_tokens=40,
                                       temperature=0, stop=stop, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ref[:ref.find(stop)]


def test_text_out_holds_back_a_possible_stop_string(tiny_target):
    tok = tiny_target.tokenizer
    ids = tok.encode("abcdefgh")
    out = TextOut(tok, ["def", "xyz"])
    pieces = [out.push([t]) for t in ids]
    assert "".join(pieces) + out.finish() == "abc" and out.stopped
    assert out.tokens == len(tok.encode("abcdef"))  # tokens after the stop string are not counted
    out = TextOut(tok, ["hx"])
    assert "".join(out.push([t]) for t in ids) + out.finish() == "abcdefgh" and not out.stopped


@pytest.mark.parametrize("body,param,status", [
    ({"messages": [{"role": "user", "content": "hi"}], "bogus": 1}, "bogus", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, "temperature", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 1.0}, "presence_penalty", 400),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role", 400),
    ({"messages": []}, "messages", 400),
    ({}, "messages", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "speculative": {"speculators": ["nope"]}},
     "speculative.speculators", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "speculative": {"speculators": "oracle"}},
     "speculative.speculators", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "speculative": {"n_max": -2}}, "speculative.n_max", 400),
    ({"messages": [{"role": "user", "content": "x" * 2000}]}, "messages", 400),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, "model", 404),
])
def test_bad_requests_get_one_error_naming_the_field(server, body, param, status):
    url, _ = server
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error"
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"


def test_malformed_json_and_bad_prompts(server):
    url, _ = server
    r = httpx.post(url + "/v1/chat/completions", content=b'{"model": "tiny", "messages": [', timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1, 10 ** 9]}, timeout=10)
    assert (r.status_code == 400 and r.json()["error"]["param"] == "prompt"
            and "vocabulary" in r.json()["error"]["message"])
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client(url).completions.create(model=MODEL, prompt="", max_tokens=3)
    assert e.value.status_code == 400


class Slow:
    """Makes every engine step take 20 ms (drafts nothing), so a long answer stays in flight."""

    @dataclass(frozen=True)
    class Params:
        pass

    @hookimpl
    def draft(self, requests):
        time.sleep(0.02)
        return [None] * len(requests)


def test_disconnect_frees_the_slot_and_a_full_queue_gets_429(tiny_target):
    eng = make_engine(tiny_target, [speculator(Slow(), name="slow")], n_parallel=1)
    app = create_app(eng, MODEL, max_queue=1)
    with running(app) as url:
        long = {"prompt": "a", "max_tokens": 100000, "ignore_eos": True}  # runs to the context size
        cm1, lines1 = stream_until_first_token(url, long)
        cm2 = httpx.stream("POST", url + "/v1/completions", json={"model": MODEL, "stream": True, **long}, timeout=30)
        waiting = []
        t = threading.Thread(target=lambda: waiting.append(cm2.__enter__()), daemon=True)
        t.start()
        wait_for(lambda: app.state.worker.outstanding == 2, "the second request was not queued")
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "b", "max_tokens": 2}, timeout=10)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        assert "specplug_rejected_requests_total 1.0" in httpx.get(url + "/metrics", timeout=10).text
        cm1.__exit__(None, None, None)  # client 1 disconnects mid-stream: its slot goes to client 2
        wait_for(lambda: eng.n_running == 1 and eng.n_waiting == 0 and app.state.worker.outstanding == 1,
                  "the disconnected request kept its slot")
        t.join(10)
        cm2.__exit__(None, None, None)
        wait_for(lambda: app.state.worker.outstanding == 0 and not eng.has_work, "the second disconnect leaked")
        r = client(url).completions.create(model=MODEL, prompt="b", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens == 5  # serving as before


@pytest.mark.parametrize("mode", ["raise", "writes_kv"])
def test_a_failing_speculator_is_disabled_and_the_text_unchanged(tiny_target, mode):
    vocab = tiny_target.model.config.vocab_size
    eng = make_engine(tiny_target, [speculator(Faulty(mode, vocab), name="faulty")], n_parallel=2)
    app = create_app(eng, MODEL)
    refs = reference(tiny_target, [chat_ids(tiny_target, t) for t in TEXTS[:2]], 30)
    with running(app) as url:
        c = client(url)
        for t, ref in zip(TEXTS[:2], refs):
            r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": t}], max_tokens=30,
                                          temperature=0)
            assert r.choices[0].message.content == ref[0]
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'specplug_spec_enabled{speculator="faulty"} 0.0' in metrics
        assert 'specplug_spec_hook_calls_total{hook="draft",speculator="faulty"}' in metrics  # hook time per speculator
        assert 'specplug_spec_hook_seconds_total{hook="draft",speculator="faulty"}' in metrics
    assert ("ReadOnlyError" if mode == "writes_kv" else "exploded") in eng.stats.disabled["faulty"]


def test_sampling_with_a_seed_is_reproducible(server):
    url, _ = server
    c = client(url)
    kw = dict(model=MODEL, prompt="the sea", max_tokens=20, temperature=1.0, top_p=0.95,
              extra_body={"speculative": False, "min_p": 0.01, "top_k": 200})
    a, b = c.completions.create(seed=3, **kw), c.completions.create(seed=3, **kw)
    assert a.choices[0].text == b.choices[0].text
    assert c.completions.create(seed=4, **kw).choices[0].text != a.choices[0].text


def test_api_key(tiny_target):
    app = create_app(make_engine(tiny_target, []), MODEL, api_key="sekret")
    with running(app) as url:
        with pytest.raises(openai.AuthenticationError):
            client(url).models.list()
        ok = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0, timeout=10).models.list()
        assert ok.data[0].id == MODEL
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # health needs no key


def test_specplug_serve_answers_the_openai_client_and_drains_on_sigterm(tmp_path, tiny_gguf, launch):
    cfg = write_config(tmp_path / "serve.yaml", tiny_gguf, "speculators:\n  - type: noop\n", context=1024, parallel=2)
    served = launch.serve(cfg, "--drain-timeout", "20")
    url, proc = served.url, served.proc
    c = client(url)
    model = c.models.list().data[0].id
    assert model == tiny_gguf.stem
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8)
    assert r.usage.completion_tokens <= 8 and r.choices[0].finish_reason in ("stop", "length")
    # SIGTERM while a long answer streams: it is finished, then the server exits
    with httpx.stream("POST", url + "/v1/completions", json={"model": model, "prompt": "a", "max_tokens": 600,
                                                             "ignore_eos": True, "stream": True,
                                                             "stream_options": {"include_usage": True}},
                      timeout=60) as resp:
        lines = resp.iter_lines()
        first = next(ln for ln in lines if ln.startswith("data: {"))
        proc.send_signal(signal.SIGTERM)
        rest = [ln for ln in lines if ln.startswith("data: ")]
    usage = json.loads(rest[-2][6:])["usage"]
    assert rest[-1] == "data: [DONE]" and usage["completion_tokens"] == 600 and first
    assert proc.wait(30) == 0
    assert "Traceback" not in proc.stderr
