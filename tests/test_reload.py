"""Issue 39, item 3: a new head file while serving, without a restart.

`Engine.replace_speculator` swaps between steps: the running sequences go on without the new
speculator (it never sees their rows), new ones are drafted by it, and every answer stays equal to
plain greedy decoding. The server swaps on POST /admin/reload (admin key required) and on SIGHUP,
after checking the file (are_compatible and a smoke draft): a corrupt or incompatible file is
refused with a clear error and the old head keeps serving. /metrics labels acceptance per head.
"""
from __future__ import annotations

import hashlib
import json
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from launch import MODEL, running, wait_for, write_config

from specplug.api import build_engine, prompt_ids
from specplug.config import parse_config
from specplug.engine import Request, target_info
from specplug.hooks import hookimpl
from specplug.server import create_app
from specplug.testing import RandomDrafts, make_engine, make_train_data, repetitive_prompts, speculator

ADMIN = "admin-sekret"


class Spy(RandomDrafts):
    """Random drafts, and a log of the sequences each hook was called for."""

    def __init__(self, vocab: int, seed: int):
        super().__init__(vocab, seed=seed, max_len=3)
        self.told: list[int] = []  # seq ids of process_batch rows
        self.asked: list[int] = []  # seq ids of draft requests
        self.removed: list[int] = []

    @hookimpl
    def process_batch(self, batch, encoded):
        self.told += batch.seq_ids.tolist()

    @hookimpl
    def draft(self, requests):
        self.asked += [r.seq_id for r in requests]
        return super().draft(requests)

    @hookimpl
    def remove(self, seq_id, p0):
        self.removed.append(seq_id)


def _plain(target, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Plain greedy answers, each prompt alone, past end-of-turn tokens (as every request here asks)."""
    return [make_engine(target, [], n_parallel=1).run([Request(p, max_tokens, ignore_eos=True)])[0].token_ids
            for p in prompts]


def test_replace_speculator_between_steps_keeps_running_sequences_and_their_output(tiny_target):
    vocab = tiny_target.model.config.vocab_size
    info = target_info(tiny_target, 2, 512)
    old, new = Spy(vocab, seed=1), Spy(vocab, seed=2)
    eng = make_engine(tiny_target, [speculator(old, "r", target=info, cost_trim=False)], n_parallel=2)
    prompts, lengths = [[1, 5, 9, 20], [3, 4, 40], [7, 7, 8]], [20, 60, 30]
    results = {}

    def add(i: int) -> None:
        eng.add(Request(prompts[i], lengths[i], id=i, ignore_eos=True), on_finish=lambda r: results.update({r.id: r}))

    add(0)
    add(1)
    for _ in range(4):
        eng.step()
    slot_of = {q.req.id: slot for slot, q in eng._active.items()}
    assert sorted(slot_of) == [0, 1] and not results
    replaced = eng.replace_speculator(speculator(new, "r", target=info, cost_trim=False))
    assert replaced.caller.plugin is old and eng.stats.speculators["r"] is eng.specs[0].stats
    calls_of_old = len(old.asked) + len(old.told) + len(old.removed)
    add(2)
    while eng.has_work:
        eng.step()
    want = [_plain(tiny_target, [p], n)[0] for p, n in zip(prompts, lengths)]
    assert [results[i].token_ids for i in range(3)] == want
    assert len(old.asked) + len(old.told) + len(old.removed) == calls_of_old  # the old one is not called again
    # the third request took the slot of the first (which ended first): the new speculator was told
    # about it, and drafted for it, and for no sequence that was running when it came in
    assert set(new.told) == set(new.asked) == set(new.removed) == {slot_of[0]}
    assert len(prompts[2]) <= len(new.told) <= len(prompts[2]) + lengths[2]
    assert eng.stats.speculators["r"].drafts > 0


# ---------------------------------------------------------------------------------------------
# the server, with MTP heads trained on the tiny model


@pytest.fixture(scope="module")
def heads(tiny_gguf, tiny_target, tmp_path_factory):
    """Two MTP heads for the tiny model (A, B), a cut copy of A, and a head made for another target."""
    pytest.importorskip("specplug_mtp")
    from specplug_mtp.train import MTPTrainer

    from specplug.heads import HeadMeta, write_head
    from specplug.train.loop import LoopOptions, train

    work = tmp_path_factory.mktemp("reload")
    data = make_train_data(tiny_gguf, work / "data", repetitive_prompts(60), max_tokens=24, shard_prompts=30)
    out = {}
    for name, steps in (("a", 1), ("b", 8)):
        loop = LoopOptions(steps=steps, lr=3e-3, warmup=1, batch_tokens=1024, val_every=steps, save_every=10 ** 6,
                           val_fraction=0.1)
        train(MTPTrainer, MTPTrainer.Options(draft_vocab=0), loop, data, work / f"{name}.gguf", quiet=True,
              restart=True)
        out[name] = work / f"{name}.gguf"
    blob = out["a"].read_bytes()
    (work / "cut.gguf").write_bytes(blob[: len(blob) // 2])
    out["cut"] = work / "cut.gguf"
    wide = SimpleNamespace(arch="llama", model_path="/models/wide.gguf", n_embd=96,  # another target's
                           vocab_size=tiny_target.model.config.vocab_size,
                           token_texts=tiny_target.tokenizer.token_texts)
    out["other"] = write_head(work / "other.gguf", HeadMeta.for_target(wide, "mtp", 1, ["final"], {}),
                              {"x": torch.zeros(2)})
    return out


def _identity(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


def _cfg(tiny_gguf, head: Path):
    return parse_config({"model": str(tiny_gguf), "quant": "none", "parallel": 2, "context": 512,
                         "speculators": [{"type": "mtp", "name": "mtp", "head": str(head), "cost_trim": False,
                                          "stop_below": 0.0}]})


def _reload(url: str, head, key: str | None = ADMIN, speculator: str = "mtp") -> httpx.Response:
    return httpx.post(url + "/admin/reload", json={"speculator": speculator, "head": str(head)},
                      headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=120)


def _completion(url: str, ids: list[int], n: int) -> list[int]:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0,
                                                  "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def served(tiny_gguf, tiny_target, heads):
    cfg = _cfg(tiny_gguf, heads["a"])
    eng = build_engine(cfg, target=tiny_target)
    app = create_app(eng, MODEL, speculators=cfg.speculators, admin_key=ADMIN)
    with running(app) as url:
        yield url, app


def _texts(tiny_target, texts):
    return [prompt_ids(tiny_target.tokenizer, t, True) for t in texts]


def test_reload_swaps_the_head_and_labels_its_acceptance_answers_stay_greedy(served, heads, tiny_target):
    url, app = served
    a, b = _identity(heads["a"]), _identity(heads["b"])
    prompts = _texts(tiny_target, repetitive_prompts(3, seed=5))
    want = _plain(tiny_target, prompts, 20)
    tok = tiny_target.tokenizer
    for p, w in zip(prompts, want):
        assert _completion(url, p, 20)["choices"][0]["text"] == tok.decode(w, skip_special=True)
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert f'specplug_spec_drafts_total{{head="{a}",speculator="mtp"}}' in metrics and f'head="{b}"' not in metrics
    r = _reload(url, heads["b"])
    assert r.status_code == 200, r.text
    rep = r.json()
    assert (rep["identity"], rep["previous_identity"], rep["head"]) == (b, a, str(heads["b"]))
    for p, w in zip(prompts, want):
        assert _completion(url, p, 20)["choices"][0]["text"] == tok.decode(w, skip_special=True)
    metrics = httpx.get(url + "/metrics", timeout=10).text
    drafts = {line.split("{")[1].split("}")[0]: float(line.split()[-1]) for line in metrics.splitlines()
              if line.startswith("specplug_spec_drafts_total{")}
    assert drafts[f'head="{b}",speculator="mtp"'] > 0  # the new head drafts
    assert drafts[f'head="{a}",speculator="mtp"'] > 0  # the old head's figures stay: a before/after
    assert app.state.worker.heads == {"mtp": b}


def test_a_reload_keeps_the_requests_in_flight(served, heads, tiny_target, monkeypatch):
    url, app = served
    eng = app.state.worker.engine
    real = eng.step
    monkeypatch.setattr(eng, "step", lambda: time.sleep(0.01) or real())  # the answer streams for seconds
    ids = _texts(tiny_target, ["the cat sat on the mat"])[0]
    (want,) = _plain(tiny_target, [ids], 300)
    events: list[dict] = []
    streaming = threading.Event()

    def stream():
        body = {"model": MODEL, "prompt": ids, "max_tokens": 300, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    streaming.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert streaming.wait(30)
    r = _reload(url, heads["b"])
    assert r.status_code == 200 and r.json()["kept_in_flight"] == 1, r.text
    reader.join(120)
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == tiny_target.tokenizer.decode(want, skip_special=True)
    assert events[-1]["usage"]["completion_tokens"] == 300


def test_a_reload_under_load_drops_or_changes_no_answer(tiny_gguf, tiny_target, heads, monkeypatch):
    """16 clients streaming into 4 slots (12 queued) while the head is swapped: every answer arrives whole and
    equals plain greedy decoding."""
    cfg = parse_config({"model": str(tiny_gguf), "quant": "none", "parallel": 4, "context": 512,
                        "speculators": [{"type": "mtp", "head": str(heads["a"]), "cost_trim": False}]})
    eng = build_engine(cfg, target=tiny_target)
    real = eng.step
    monkeypatch.setattr(eng, "step", lambda: time.sleep(0.005) or real())
    app = create_app(eng, MODEL, speculators=cfg.speculators, admin_key=ADMIN, max_queue=16)
    prompts = _texts(tiny_target, repetitive_prompts(16, seed=23))
    want = [tiny_target.tokenizer.decode(w, skip_special=True) for w in _plain(tiny_target, prompts, 60)]
    got: dict[int, str] = {}
    errors: list[str] = []

    def client(i: int) -> None:
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 60, "ignore_eos": True, "temperature": 0,
                "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as resp:
                got[i] = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in resp.iter_lines()
                                 if ln.startswith("data: {"))
        except Exception as exc:  # reported below, with the others
            errors.append(f"client {i}: {type(exc).__name__}: {exc}")

    with running(app) as url:
        clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(16)]
        for t in clients:
            t.start()
        wait_for(lambda: eng.n_running == 4, "the clients did not fill the slots")
        r = _reload(url, heads["b"])
        assert r.status_code == 200 and r.json()["kept_in_flight"] >= 1, r.text
        for t in clients:
            t.join(120)
    assert not errors and sorted(got) == list(range(16))
    assert [got[i] for i in range(16)] == want
    assert app.state.worker.heads == {"mtp": _identity(heads["b"])}


@pytest.mark.parametrize("bad, status, says", [
    ("cut", 400, "cut.gguf: mtp: head:"),
    ("other", 400, "not compatible"),
    ("missing", 400, "head file not found"),
], ids=["corrupt", "incompatible", "missing"])
def test_a_bad_file_is_refused_and_the_old_head_keeps_serving(served, heads, tiny_target, bad, status, says):
    url, app = served
    path = heads.get(bad, Path("/nonexistent/head.gguf"))
    r = _reload(url, path)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == "head_refused"
    assert app.state.worker.heads == {"mtp": _identity(heads["a"])}
    ids = _texts(tiny_target, ["the dog ran"])[0]
    (want,) = _plain(tiny_target, [ids], 16)
    assert _completion(url, ids, 16)["choices"][0]["text"] == tiny_target.tokenizer.decode(want, skip_special=True)
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert f'head="{_identity(heads["a"])}"' in metrics and 'specplug_spec_enabled{speculator="mtp"} 1.0' in metrics


def test_reload_needs_the_admin_key_and_names_what_is_wrong(served, heads, tiny_gguf, tiny_target):
    url, _ = served
    assert _reload(url, heads["b"], key=None).status_code == 401
    assert _reload(url, heads["b"], key="wrong").json()["error"]["code"] == "invalid_admin_key"
    r = _reload(url, heads["b"], speculator="eagle")
    assert r.status_code == 404 and "No speculator named 'eagle'; this server has 'mtp'" in r.json()["error"]["message"]
    r = httpx.post(url + "/admin/reload", json={"speculator": "mtp"}, headers={"Authorization": f"Bearer {ADMIN}"},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "head"
    cfg = _cfg(tiny_gguf, heads["a"])
    app = create_app(build_engine(cfg, target=tiny_target), MODEL, speculators=cfg.speculators)  # no admin key
    with running(app) as other:
        r = _reload(other, heads["b"])
        assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]
        assert app.state.worker.heads == {"mtp": _identity(heads["a"])}


def test_sighup_reloads_the_head_the_yaml_now_names(tmp_path, tiny_gguf, heads, launch):
    cfg = write_config(tmp_path / "serve.yaml", tiny_gguf, f"speculators:\n  - type: mtp\n    head: {heads['a']}\n",
                       context=256, parallel=1)
    served = launch.serve(cfg)
    a, b = _identity(heads["a"]), _identity(heads["b"])
    assert f'head="{a}"' in httpx.get(served.url + "/metrics", timeout=10).text
    served.proc.send_signal(signal.SIGHUP)  # nothing changed
    wait_for(lambda: "no head file changed" in served.proc.stderr, "SIGHUP did not say that nothing changed", 30)
    cfg.write_text(cfg.read_text().replace(str(heads["a"]), str(heads["b"])))
    served.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: f'head="{b}"' in httpx.get(served.url + "/metrics", timeout=10).text,
             f"SIGHUP did not swap in the new head:\n{served.proc.stderr}", 60)
    r = httpx.post(served.url + "/v1/completions", json={"model": tiny_gguf.stem, "prompt": "the cat",
                                                         "max_tokens": 8}, timeout=30)
    assert r.status_code == 200
    cfg.write_text(cfg.read_text().replace(str(heads["b"]), str(heads["cut"])))
    served.proc.send_signal(signal.SIGHUP)  # a bad file: refused, logged, the server serves on
    wait_for(lambda: "refused" in served.proc.stderr, "a bad head on SIGHUP was not refused", 60)
    assert f'head="{b}"' in httpx.get(served.url + "/metrics", timeout=10).text
    assert served.proc.stop(signal.SIGTERM) == 0
    assert "replaces" in served.proc.stderr and "Traceback" not in served.proc.stderr
