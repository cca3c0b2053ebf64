"""Issue 39, item 1: recording the traffic (`--record DIR`, `record:`), read back as training data.

A recording is a tokens-only folder: `read_tokens_manifest` reads it and `specplug train data
--from-tokens` rebuilds it; greedy answers rebuild with no disagreement, which proves the recorded
ids are the prompt and the answer, in order. Files are private, sampling keeps a fraction, shards
rotate by size, and a failing disk never fails a request.
"""
from __future__ import annotations

import errno
import io
import json
import logging
import os
import signal

import httpx
import numpy as np
import pytest
from launch import MODEL, prompts_file, run_config, running, wait_for, write_config

import specplug.record as record_mod
from specplug.api import prompt_ids
from specplug.cli import main
from specplug.config import load_config
from specplug.engine import Request
from specplug.errors import SpecplugError
from specplug.outputs import OutputBusyError
from specplug.record import Recorder
from specplug.runtime import load_target
from specplug.server import create_app
from specplug.testing import make_engine, write_tiny_gguf
from specplug.train.tokens import read_tokens_manifest, rebuild_dataset

PROMPTS = [[1, 5, 9, 20], [3, 4], [7, 7, 7, 7, 7, 7], [30, 2, 11]]


def _shards(folder) -> list[dict[str, np.ndarray]]:
    """Every shard of a recording, as the rebuild reads it (sha256 checked against the manifest)."""
    from specplug.train.tokens import _read_token_shard

    man = read_tokens_manifest(folder)
    return [_read_token_shard(folder, sh) for sh in man["shards"]]


def _sequences(folder) -> list[tuple[list[int], int]]:
    """(token ids, prompt length) of every recorded request, in order."""
    out = []
    for a in _shards(folder):
        off = a["offsets"].tolist()
        out += [(a["tokens"][off[s]:off[s + 1]].tolist(), int(a["prompt_lens"][s])) for s in range(len(off) - 1)]
    return out


def _recorder(folder, target, **kw) -> Recorder:
    kw.setdefault("context", 512)
    return Recorder(folder, target, source=kw.pop("source", "run"), start=False, **kw)


def test_a_recording_is_what_was_answered_and_rebuilds_with_no_disagreement(tmp_path, tiny_target):
    results = make_engine(tiny_target, [], n_parallel=2).run([Request(p, 12) for p in PROMPTS])
    rec = _recorder(tmp_path / "rec", tiny_target)
    for r in results:
        assert rec.offer(r.prompt_ids, r.token_ids)
    rec.close()
    assert _sequences(tmp_path / "rec") == [(r.prompt_ids + r.token_ids, len(r.prompt_ids)) for r in results]
    man = read_tokens_manifest(tmp_path / "rec")
    n_tokens = sum(len(r.prompt_ids) + len(r.token_ids) for r in results)
    assert man["totals"] == {"shards": 1, "sequences": 4, "tokens": n_tokens,
                             "answer_tokens": sum(len(r.token_ids) for r in results)}
    assert [p["id"] for p in man["prompts"]] == ["run:0", "run:1", "run:2", "run:3"]
    assert (rec.stats.requests, rec.stats.tokens, rec.stats.failed_writes) == (4, n_tokens, 0)
    data = rebuild_dataset(tiny_target, [tmp_path / "rec"], tmp_path / "data", ["final"], topk=4, parallel=2)
    assert data["totals"]["tokens"] == n_tokens and data["generation"]["disagree"] == 0


def test_recorded_files_are_private(tmp_path, tiny_target):
    old = os.umask(0o022)
    try:
        rec = _recorder(tmp_path / "rec", tiny_target)
        rec.offer([1, 2, 3], [4, 5])
        rec.close()
    finally:
        os.umask(old)
    assert (tmp_path / "rec").stat().st_mode & 0o777 == 0o700
    files = list((tmp_path / "rec").iterdir())
    assert len(files) == 2 and all(f.stat().st_mode & 0o777 == 0o600 for f in files), files


def test_sampling_keeps_a_random_fraction(tmp_path, tiny_target):
    runs = iter(range(100))

    def kept(seed, sample) -> list[int]:
        rec = _recorder(tmp_path / f"rec-{next(runs)}", tiny_target, sample=sample, seed=seed)
        for i in range(400):
            rec.offer([1, 2, 3], [i % 50 + 4])
        rec.close()
        return [t[-1] for t, _ in _sequences(rec.folder)]

    half = kept(1, 0.25)
    assert 60 <= len(half) <= 140  # binomial(400, 0.25): 100 +- 8.7
    assert kept(1, 0.25) == half and kept(2, 0.25) != half  # the seed decides which
    assert len(kept(1, 1.0)) == 400


def test_shards_rotate_by_size_and_a_new_session_continues_the_folder(tmp_path, tiny_target):
    max_mb = 500 / 2 ** 20  # 500 bytes: 250 token ids of this vocabulary (uint16)
    rec = _recorder(tmp_path / "rec", tiny_target, max_mb=max_mb)
    seqs = [[1 + i % 7] * 40 + [9] * (30 + i) for i in range(12)]  # 70 to 81 ids each
    for k, s in enumerate(seqs):
        rec.offer(s[:40], s[40:])
        if k % 5 == 4:
            rec.flush()  # the open shard is rewritten: it keeps one file
    rec.close()
    man = read_tokens_manifest(tmp_path / "rec")
    sizes = [sh["tokens"] * 2 for sh in man["shards"]]
    assert len(sizes) >= 3 and all(s >= 500 for s in sizes[:-1]), sizes  # closed once full...
    assert all(s - 2 * 81 < 500 for s in sizes), sizes  # ...by the sequence that filled it
    assert sorted(f.name for f in (tmp_path / "rec").iterdir()) == sorted(
        ["manifest.json"] + [sh["file"] for sh in man["shards"]])  # no stale file of a rewritten shard
    assert [t for t, _ in _sequences(tmp_path / "rec")] == seqs
    # a second session (a restarted server) appends new shards; a leftover of a killed write is removed
    (tmp_path / "rec" / "tokens-00099-000001.npz").write_bytes(b"half a shard")
    rec = _recorder(tmp_path / "rec", tiny_target, max_mb=max_mb, source="serve")
    rec.offer([5, 6], [7])
    rec.close()
    again = read_tokens_manifest(tmp_path / "rec")
    assert again["shards"][:-1] == man["shards"] and again["shards"][-1]["index"] == man["shards"][-1]["index"] + 1
    assert again["prompts"][-1]["id"] == f"serve:{len(seqs)}" and again["sources"]["serve"] == {"requests": 1}
    assert not (tmp_path / "rec" / "tokens-00099-000001.npz").exists()
    assert [t for t, _ in _sequences(tmp_path / "rec")] == seqs + [[5, 6, 7]]


def test_a_failing_disk_loses_the_recording_never_the_request(tmp_path, tiny_target, monkeypatch, caplog):
    real = record_mod._write_private
    full = {"on": True}

    def write(path, data):
        if full["on"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, data)

    monkeypatch.setattr(record_mod, "_write_private", write)
    eng = make_engine(tiny_target, [], n_parallel=2)
    rec = _recorder(tmp_path / "rec", tiny_target)
    plain = make_engine(tiny_target, [], n_parallel=1).run([Request([1, 5, 9], 8)])[0]
    with running(create_app(eng, MODEL, recorder=rec)) as url, caplog.at_level(logging.ERROR, "specplug.record"):
        for _ in range(2):
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1, 5, 9], "max_tokens": 8,
                                                          "temperature": 0}, timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == len(plain.token_ids)
            wait_for(lambda: len(rec._queue) == 1, "the finished request was not offered to the recorder")
            rec.flush()
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert "specplug_record_failed_writes_total 2.0" in metrics
        assert f"specplug_record_lost_tokens_total {2.0 * (3 + len(plain.token_ids))}" in metrics
        assert "specplug_recorded_tokens_total 0.0" in metrics
        full["on"] = False  # space again: the next request is recorded
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [1, 5, 9], "max_tokens": 8}, timeout=30)
        wait_for(lambda: len(rec._queue) == 1, "the finished request was not offered to the recorder")
        rec.flush()
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert f"specplug_recorded_tokens_total {float(3 + len(plain.token_ids))}" in metrics
    rec.close()
    said = [r for r in caplog.records if r.name == "specplug.record"]
    assert len(said) == 1 and "No space left on device" in said[0].getMessage()  # logged once
    assert _sequences(tmp_path / "rec") == [([1, 5, 9] + plain.token_ids, 3)]


def test_serve_records_chat_requests_and_counts_them(tmp_path, tiny_target):
    eng = make_engine(tiny_target, [], n_parallel=2)
    rec = _recorder(tmp_path / "rec", tiny_target, source="serve")
    texts = ["hello there", "the sea"]
    with running(create_app(eng, MODEL, recorder=rec)) as url:
        answers = [httpx.post(url + "/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": t}], "max_tokens": 10}, timeout=30).json()
            for t in texts]
        wait_for(lambda: len(rec._queue) == 2, "the finished requests were not offered to the recorder")
        rec.flush()
        metrics = httpx.get(url + "/metrics", timeout=10).text
    rec.close()
    got = _sequences(tmp_path / "rec")
    tok = tiny_target.tokenizer
    want = {tuple(prompt_ids(tok, [{"role": "user", "content": t}], True)) for t in texts}
    assert {tuple(ids[:n]) for ids, n in got} == want  # the templated prompt, as the target read it
    assert sorted(tok.decode(ids[n:], skip_special=True) for ids, n in got) == sorted(
        a["choices"][0]["message"]["content"] for a in answers)
    assert "specplug_recorded_requests_total 2.0" in metrics
    assert f"specplug_recorded_tokens_total {float(sum(len(ids) for ids, _ in got))}" in metrics


def test_specplug_run_records_and_train_data_rebuilds_it(tmp_path, tiny_gguf, capsys):
    cfg = run_config(tmp_path, tiny_gguf, "record:\n  dir: rec\n  sample: 1.0\n")  # relative: beside the YAML
    assert load_config(cfg).record.dir == str(tmp_path / "rec")
    out = tmp_path / "o.jsonl"
    assert main(["run", str(cfg), "--prompts", str(prompts_file(tmp_path, 3)), "--output", str(out)]) == 0
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    got = _sequences(tmp_path / "rec")
    assert [ids[n:] for ids, n in got] == [a["token_ids"] for a in answers]
    assert main(["train", "data", "--from-tokens", str(tmp_path / "rec"), "--model", str(tiny_gguf), "--quant", "none",
                 "-o", str(tmp_path / "data"), "--taps", "final"]) == 0
    assert "not the target's greedy choice: 0" in capsys.readouterr().err
    # --record on the command line, over the YAML's folder; flags without a folder are refused
    assert main(["run", str(cfg), "--prompt", "hi", "--record", str(tmp_path / "rec2"), "--record-sample", "1"]) == 0
    assert read_tokens_manifest(tmp_path / "rec2")["totals"]["sequences"] == 1
    plain = write_config(tmp_path / "plain.yaml", tiny_gguf)
    assert main(["run", str(plain), "--prompt", "hi", "--record-sample", "0.5"]) == 2
    assert "--record-sample need --record DIR" in capsys.readouterr().err


def test_specplug_serve_record_flag_writes_on_shutdown(tmp_path, tiny_gguf, launch):
    cfg = write_config(tmp_path / "serve.yaml", tiny_gguf, context=256, parallel=1)
    served = launch.serve(cfg, "--record", tmp_path / "rec")
    r = httpx.post(served.url + "/v1/completions", json={"model": tiny_gguf.stem, "prompt": "the sea",
                                                         "max_tokens": 6, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200
    assert "specplug_recorded" in httpx.get(served.url + "/metrics", timeout=10).text
    assert served.proc.stop(signal.SIGTERM) == 0
    ((ids, n),) = _sequences(tmp_path / "rec")
    assert len(ids) - n == 6 and "recording the token ids" in served.proc.stderr


HOLDER = """
import sys
from specplug.outputs import claim
held = claim(sys.argv[1])
print("held", flush=True)
sys.stdin.read()
"""


def test_a_folder_that_is_not_this_targets_recording_is_refused(tmp_path, tiny_target, launch):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(SpecplugError, match="holds files but no recording"):
        _recorder(tmp_path / "busy", tiny_target)
    with pytest.raises(SpecplugError, match="does not exist"):
        _recorder(tmp_path / "no" / "such", tiny_target)
    rec = _recorder(tmp_path / "rec", tiny_target)
    with pytest.raises(SpecplugError, match="another recorder of this process"):  # one recorder per folder
        _recorder(tmp_path / "rec", tiny_target)
    rec.offer([1, 2], [3])
    rec.close()
    holder = launch.python(HOLDER, tmp_path / "rec", stdin=True)  # ... and one process
    wait_for(lambda: holder.stdout.strip() == "held", f"the holder did not claim the folder:\n{holder.stderr}", 60)
    with pytest.raises(OutputBusyError, match=f"--record {tmp_path / 'rec'} is being written by another process "
                                              f"\\(PID {holder.pid}"):
        _recorder(tmp_path / "rec", tiny_target)
    holder.release()
    holder.wait(30)
    other = load_target(str(write_tiny_gguf(tmp_path / "other.gguf", seed=7)), device="cpu", dtype="float32",
                        quant="none")
    with pytest.raises(SpecplugError, match="records the target tiny.gguf .*, not other.gguf"):
        _recorder(tmp_path / "rec", other)
    man = read_tokens_manifest(tmp_path / "rec")
    del man["settings"]["record"]  # as `specplug train tokens` writes it
    (tmp_path / "rec" / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(SpecplugError, match="not a recording"):
        _recorder(tmp_path / "rec", tiny_target)


def test_the_real_model_rebuilds_its_recorded_answers_exactly(tmp_path, smollm2_gguf):
    eng = make_engine(smollm2_gguf, [], n_parallel=2, max_ctx=256)
    tok = smollm2_gguf.tokenizer
    prompts = [prompt_ids(tok, [{"role": "user", "content": t}], True) for t in ("What is 2+2?", "Name a color.")]
    rec = _recorder(tmp_path / "rec", smollm2_gguf, context=256)
    for r in eng.run([Request(p, 16) for p in prompts]):
        rec.offer(r.prompt_ids, r.token_ids)
    rec.close()
    data = rebuild_dataset(smollm2_gguf, [tmp_path / "rec"], tmp_path / "data", ["final"], topk=4, parallel=2)
    assert data["totals"]["sequences"] == 2 and data["generation"]["disagree"] == 0
    with np.load(io.BytesIO((tmp_path / "rec" / read_tokens_manifest(tmp_path / "rec")["shards"][0]["file"])
                            .read_bytes())) as z:
        assert z["tokens"].dtype == np.uint16  # a 49152-token vocabulary fits 16 bits
