"""`--ray` on a real local Ray cluster (started here on 127.0.0.1, stopped at the end): data
generation and bench give one process's content, a worker killed mid-job loses and duplicates
nothing, and a 2-replica Serve deployment answers the OpenAI client as `specplug serve` does.
Skip them with `-m 'not ray'`."""
from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from specplug.cli import main
from specplug.testing import repetitive_prompts, write_tiny_gguf
from specplug.train.dataset import manifest_sha256

ray = pytest.importorskip("ray", reason="the specplug[ray] extra is not installed")
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("ray") / "tiny-q8.gguf", tensor_type="Q8_0", scale=1.5)


def _data_args(model: Path, tmp: Path, n_prompts: int) -> list[str]:
    src = tmp / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in repetitive_prompts(n_prompts, seed=5)))
    return ["train", "data", "--model", str(model), "--prompts", str(src), "--taps", "final,0", "--max-tokens", "24",
            "--shard-prompts", "4", "--parallel", "2", "--keep-overlap", "--threads", "1"]


def _shards(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name.startswith("shard-")}


def test_data_on_ray_is_the_single_process_data_set(cluster, tiny, tmp_path):
    args = _data_args(tiny, tmp_path, 12)
    assert main(args + ["-o", str(tmp_path / "one")]) == 0
    assert main(args + ["-o", str(tmp_path / "ray"), "--ray", "--ray-workers", "2"]) == 0
    one = json.loads((tmp_path / "one" / "manifest.json").read_text())
    on_ray = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert on_ray["settings"]["ray"] == {"address": "", "workers": 2}  # it did run on Ray
    assert manifest_sha256(on_ray) == manifest_sha256(one)
    assert len(on_ray["shards"]) == 3 and all(s["sha256"] for s in on_ray["shards"])
    assert _shards(tmp_path / "ray") == _shards(tmp_path / "one")  # byte for byte, content-named
    # a re-run finds every shard and writes nothing
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ray").iterdir() if p.name.startswith("shard-")}
    assert main(args + ["-o", str(tmp_path / "ray"), "--ray", "--ray-workers", "2"]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ray").iterdir() if p.name.startswith("shard-")} == before


def test_a_worker_killed_mid_job_loses_and_duplicates_nothing(cluster, tiny, tmp_path):
    args = _data_args(tiny, tmp_path, 48)
    assert main(args + ["-o", str(tmp_path / "one")]) == 0
    out = tmp_path / "ray"
    rc: list[int] = []
    job = threading.Thread(target=lambda: rc.append(main(args + ["-o", str(out), "--ray", "--ray-workers", "2"])))
    job.start()
    killed = None
    deadline = time.time() + 120
    while killed is None and time.time() < deadline and job.is_alive():
        done = [p for p in out.glob("shard-*")] if out.is_dir() else []
        if done:  # the job is under way: kill one worker's process
            worker = ray.get_actor(f"specplug-data-{os.getpid()}-0")
            pid = ray.get(worker.pid.remote())
            os.kill(pid, signal.SIGKILL)
            killed = (pid, len(done))
        time.sleep(0.02)
    job.join(300)
    assert killed is not None, "the job finished before a worker could be killed"
    assert killed[1] < 12, "the kill came after the last shard"
    assert rc == [0]
    man = json.loads((out / "manifest.json").read_text())
    assert sorted(s["index"] for s in man["shards"]) == list(range(12))  # none lost, none twice
    assert (sorted(p.name for p in out.iterdir() if p.name != "manifest.json")
            == sorted(s["file"] for s in man["shards"]))
    assert manifest_sha256(man) == manifest_sha256(json.loads((tmp_path / "one" / "manifest.json").read_text()))
    assert _shards(out) == _shards(tmp_path / "one")


def _bench_config(tmp: Path, model: Path) -> Path:
    cfg = tmp / "bench.yaml"
    # cost_trim: false: drafting decisions that do not depend on timings, so that accepted lengths
    # repeat exactly from run to run (priced drafting reads the clock, on one machine as on Ray)
    cfg.write_text(f"model: {model}\nchat: false\nmax_tokens: 24\nthreads: 1\n"
                   "speculators:\n  - {type: ngram-simple, cost_trim: false}\n"
                   "  - {type: ngram-map-k, cost_trim: false}\n")
    return cfg


def test_bench_on_ray_gives_each_prompt_the_single_process_result(cluster, tiny, tmp_path):
    from specplug.bench.cli import _run_here
    from specplug.bench.ray_bench import run_on_ray
    from specplug.config import load_config

    cfg = load_config(_bench_config(tmp_path, tiny))
    records = [{"id": i, "category": "c", "turns": [p]} for i, p in enumerate(repetitive_prompts(6, seed=2))]
    args = argparse.Namespace(config="bench.yaml", chain=True, chains=[], repeats=2, ray="", ray_workers=2)
    here, _ = _run_here(args, cfg, records, Path("p.jsonl"))
    there, info = run_on_ray(args, cfg, records, Path("p.jsonl"))
    assert info["ray"] == {"workers": 2, "threads_per_worker": 1}
    assert len(here) == len(there) == 2
    for a_pass, b_pass in zip(here, there):
        assert [(r.id, r.turn) for r in a_pass] == [(r.id, r.turn) for r in b_pass]
        for a, b in zip(a_pass, b_pass):
            assert a.runs.keys() == b.runs.keys() == {"plain", "ngram-simple", "ngram-map-k", "chain"}
            for name in a.runs:
                x, y = a.runs[name], b.runs[name]
                assert (x.token_ids, x.drafted, x.accepted, x.accepted_at, x.forwards) == \
                       (y.token_ids, y.drafted, y.accepted, y.accepted_at, y.forwards), (a.id, name)
    assert any(r.runs["ngram-simple"].accepted for p in there for r in p)  # the speculators did draft

    # the command end to end: the report is written from the same per-prompt records
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["bench", str(_bench_config(tmp_path, tiny)), "--data", str(src), "--out", str(tmp_path / "b"),
                 "--ray", "--ray-workers", "2"]) == 0
    rep = json.loads((tmp_path / "b" / "results.json").read_text())
    assert rep["settings"]["ray"]["workers"] == 2 and rep["mismatches"] == []


def test_serve_with_two_replicas_answers_as_specplug_serve_does(cluster, tiny, tmp_path):
    import openai
    from prometheus_client.parser import text_string_to_metric_families
    from ray import serve
    from test_server import running

    from specplug.api import build_engine
    from specplug.config import load_config
    from specplug.serve_ray import deploy
    from specplug.server import create_app

    cfg_path = tmp_path / "serve.yaml"
    cfg_path.write_text(f"model: {tiny}\nmax_tokens: 20\nthreads: 1\nparallel: 2\nray: {{replicas: 1}}\n"
                        "speculators:\n  - type: ngram-simple\n")
    cfg = load_config(cfg_path)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = deploy(cfg, "127.0.0.1", port, replicas=2, model_name="tiny")  # --replicas 2 over the YAML's 1
    try:
        texts = ["hello there the", "in the beginning was", "the the the", "onion", "a", "xyz 123"]
        on_ray = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = [on_ray.chat.completions.create(model="tiny", messages=[{"role": "user", "content": t}],
                                              max_tokens=20, temperature=0).choices[0].message.content for t in texts]
        stream = on_ray.chat.completions.create(model="tiny", messages=[{"role": "user", "content": texts[0]}],
                                                max_tokens=20, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        with running(create_app(build_engine(cfg), "tiny")) as one:
            ref = openai.OpenAI(base_url=one + "/v1", api_key="unused", max_retries=0, timeout=60)
            want = [ref.chat.completions.create(model="tiny", messages=[{"role": "user", "content": t}],
                                                max_tokens=20, temperature=0).choices[0].message.content for t in texts]
        assert got == want and streamed == want[0]
        import httpx

        listed = httpx.get(url + "/replicas", timeout=30).json()["replicas"]
        assert len(listed) == 2
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)}
        by_replica = {s.labels["replica"]: s.value for s in fams["specplug_requests"].samples
                      if s.name == "specplug_requests_total" and s.labels["endpoint"] == "/v1/chat/completions"}
        assert set(by_replica) == {r["id"] for r in listed}  # every replica's metrics, labelled
        assert sum(by_replica.values()) == len(texts) + 1 and all(v > 0 for v in by_replica.values())
        for r in listed:  # and each replica's own endpoint
            assert f'replica="{r["id"]}"' in httpx.get(r["metrics"], timeout=30).text
    finally:
        serve.shutdown()
