"""Issue 29: two writers, a full disk, a crash: no output is ever corrupted, and no failure is
reported as success. Each test here failed on the code before specplug/outputs.py."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from launch import Process, prompts_file, run_config, wait_for

from specplug.cli import main

# every finished answer takes sys.argv[1] seconds more (the engine's _finish is slowed)
SLOW_FINISH = """
import sys, time
from specplug.engine import Engine
real = Engine._finish
def slow(self, *a, **k):
    time.sleep(float(sys.argv[1]))
    return real(self, *a, **k)
Engine._finish = slow
"""

# claims every path in argv, says so, and holds them until its stdin closes
HOLDER = """
import sys
from specplug.outputs import claim
held = [claim(p) for p in sys.argv[1:]]
print("held", flush=True)
sys.stdin.read()
"""

# the process is killed (SIGKILL) in the middle of writing the third line of the output sys.argv[1]
KILLED_MID_LINE = """
import os, signal, sys
real = os.write
lines = {"n": 0}
def write(fd, data):
    try:
        where = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        where = ""
    if where == sys.argv[1]:
        lines["n"] += 1
        if lines["n"] == 3:
            real(fd, bytes(data)[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
    return real(fd, data)
os.write = write
"""


def _rows(path: Path) -> list[dict]:
    """The output's lines, each of which must be a whole JSON object, ending in a newline."""
    text = path.read_text()
    assert text == "" or text.endswith("\n"), f"a partial last line: {text[-80:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def _error_lines(err: str) -> list[str]:
    return [line for line in err.replace("\r", "\n").splitlines() if line.startswith("specplug: error")]


@pytest.fixture
def holder(launch):
    """Start a process claiming the given paths; returns it once it holds them (its PID is the holder's)."""

    def hold(*paths: Path) -> Process:
        p = launch.python(HOLDER, *paths, stdin=True, name="holder")
        wait_for(lambda: p.stdout.strip() == "held", f"the holder did not claim its paths:\n{p.stderr}", 60)
        return p

    return hold


# ---------------------------------------------------------------------------------------------
# 1. one writer per output


def test_two_runs_racing_on_one_output_exactly_one_proceeds(tmp_path, tiny_gguf, launch):
    cfg, prompts, out = run_config(tmp_path, tiny_gguf), prompts_file(tmp_path, 3), tmp_path / "out.jsonl"
    argv = ["run", str(cfg), "--prompts", str(prompts), "--output", str(out)]
    t0 = time.perf_counter()
    runs = [launch.specplug(*argv, patch=SLOW_FINISH, patch_arg="0.5") for _ in range(2)]  # started at once
    ended = {}
    while len(ended) < 2:
        for i, p in enumerate(runs):
            if i not in ended and p.returncode is not None:
                ended[i] = time.perf_counter() - t0
        time.sleep(0.02)
    errs = [p.stderr for p in runs]
    codes = [p.returncode for p in runs]
    assert sorted(codes) == [0, 2], (codes, errs)
    win, lose = (0, 1) if codes[0] == 0 else (1, 0)
    (line,) = _error_lines(errs[lose])
    assert str(out) in line and f"PID {runs[win].pid}" in line, line
    assert ended[lose] < ended[win] - 1.0  # it failed at once, not after the other finished
    assert [r["id"] for r in _rows(out)] == ["p0", "p1", "p2"]
    assert not Path(str(out) + ".lock").exists()  # the claim is given back


@pytest.mark.parametrize("flags", [[], ["--resume"], ["--force"]], ids=["plain", "resume", "force"])
def test_resume_and_force_take_the_same_claim(tmp_path, tiny_gguf, holder, capsys, flags):
    cfg, prompts = run_config(tmp_path, tiny_gguf), prompts_file(tmp_path, 2)
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    if flags:  # continuing or overwriting an output there is
        out.write_text(json.dumps({"id": "p0", "turn": 0, "text": "kept"}) + "\n")
    before = out.read_bytes() if flags else None
    for held in (out, stats):
        h = holder(held)
        assert main(["run", str(cfg), "--prompts", str(prompts), "--output", str(out), "--stats", str(stats),
                     *flags]) == 2
        (line,) = _error_lines(capsys.readouterr().err)
        assert str(held) in line and f"PID {h.pid}" in line and "another process" in line, line
        h.release()
        h.wait(30)
    assert (out.read_bytes() if out.exists() else None) == before and not stats.exists()


def test_an_output_being_written_names_its_writer_not_that_it_exists(tmp_path, tiny_gguf, holder, capsys):
    """The other run has already written rows: the refusal names that run (it is busy), not the file."""
    cfg, prompts, out = run_config(tmp_path, tiny_gguf), prompts_file(tmp_path, 2), tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "p0", "turn": 0, "text": "written by the other run"}) + "\n")
    before = out.read_bytes()
    h = holder(out)
    assert main(["run", str(cfg), "--prompts", str(prompts), "--output", str(out)]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert f"PID {h.pid}" in line and "another process" in line and "--resume" not in line, line
    h.release()
    h.wait(30)
    assert main(["run", str(cfg), "--prompts", str(prompts), "--output", str(out)]) == 2  # nobody writes it now
    (line,) = _error_lines(capsys.readouterr().err)
    assert "exists; add --resume" in line, line
    assert out.read_bytes() == before


def test_every_writer_claims_its_output_before_the_model_loads(tmp_path, holder, capsys):
    """bench --out, train data -o, a trained head -o and ngram-cache build -o: a held output fails
    at once with the holder's PID (the model path does not exist: loading it would be another error)."""
    prompts = prompts_file(tmp_path, 2)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the sea, the sea\n")
    bench_cfg = tmp_path / "bench.yaml"
    bench_cfg.write_text("model: /no/such/model.gguf\nspeculators:\n  - type: ngram-simple\n")
    cases = [
        (tmp_path / "bench-out", ["bench", str(bench_cfg), "--data", str(prompts)]),
        (tmp_path / "data", ["train", "data", "--model", "/no/such/model.gguf", "--prompts", str(prompts)]),
        (tmp_path / "head.gguf", ["train", "mtp", "--data", str(tmp_path / "no-data"), "--steps", "1"]),
        (tmp_path / "cache.bin", ["ngram-cache", "build", str(corpus), "--model", "/no/such/model.gguf"]),
    ]
    for out, argv in cases:
        h = holder(out)
        flag = "--out" if argv[0] == "bench" else "-o"
        assert main([*argv, flag, str(out)]) == 2, argv
        err = capsys.readouterr().err
        (line,) = _error_lines(err)
        assert str(out) in line and f"PID {h.pid}" in line, line
        assert "no/such" not in err and "no-data" not in err
        h.release()
        h.wait(30)


# ---------------------------------------------------------------------------------------------
# 2. a full disk is an error, in one line, and leaves whole lines


def test_full_disk_injected_ends_in_one_line_exit_1_and_resumes(monkeypatch, tmp_path, tiny_gguf, capsys):
    cfg, prompts = run_config(tmp_path, tiny_gguf), prompts_file(tmp_path, 4)
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    real_write = os.write
    calls = {"n": 0}

    def write(fd, data):  # the third line is written short, then the disk is full
        if os.readlink(f"/proc/self/fd/{fd}") == str(out):
            calls["n"] += 1
            if calls["n"] == 3:
                return real_write(fd, bytes(data)[: len(data) // 2])
            if calls["n"] > 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    argv = ["run", str(cfg), "--prompts", str(prompts), "--output", str(out), "--stats", str(stats)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = _error_lines(err)
    assert str(out) in line and "No space left on device (ENOSPC)" in line, line
    assert "2 answer(s) are safely in it" in line and f"statistics written to {stats}" in line, line
    assert line.endswith(" ".join(argv[1:]) + " --resume") and "specplug run" in line, line
    assert [r["id"] for r in _rows(out)] == ["p0", "p1"]  # the short line was cut back: whole lines only
    assert json.loads(stats.read_text())["generated_tokens"] > 0
    monkeypatch.setattr(os, "write", real_write)
    assert main([*argv, "--resume"]) == 0
    assert [r["id"] for r in _rows(out)] == ["p0", "p1", "p2", "p3"]


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs (skipped where this process cannot mount one)."""
    where = tmp_path / "disk"
    where.mkdir()
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {got.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_full_tmpfs_ends_in_one_line_exit_1_and_resumes(tmp_path, tiny_gguf, small_disk, capsys):
    cfg = tmp_path / "run.yaml"  # answers of 2 tokens to long prompts: ~0.9 KiB a line, ~14 KiB in all
    cfg.write_text(f"model: {tiny_gguf}\ndevice: cpu\nquant: none\nmax_tokens: 2\nparallel: 1\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"the sea number {i}, " * 25}) + "\n"
                               for i in range(16)))
    out, stats = small_disk / "out.jsonl", small_disk / "stats.json"
    filler = small_disk / "filler"
    # 3 pages left: one per lock file (output, stats) and one for ~9 answers; then the disk is full
    filler.write_bytes(b"\0" * (52 * 1024))
    argv = ["run", str(cfg), "--prompts", str(prompts), "--output", str(out), "--stats", str(stats)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = _error_lines(err)
    kept = _rows(out)
    assert 0 < len(kept) < 16 and len({r["id"] for r in kept}) == len(kept)
    assert str(out) in line and "ENOSPC" in line and f"{len(kept)} answer(s) are safely in it" in line, line
    assert f"--stats {stats} could not be written" in line and not stats.exists(), line
    filler.unlink()
    assert main([*argv, "--resume"]) == 0
    assert sorted(r["id"] for r in _rows(out)) == sorted(f"p{i}" for i in range(16))
    assert json.loads(stats.read_text())["generated_tokens"] > 0


# ---------------------------------------------------------------------------------------------
# 3. kill -9 in the middle of a line, then --resume


def test_kill_9_mid_line_then_resume_completes_a_valid_file(tmp_path, tiny_gguf, capsys, launch):
    cfg, prompts = run_config(tmp_path, tiny_gguf), prompts_file(tmp_path, 4)
    out, full = tmp_path / "out.jsonl", tmp_path / "full.jsonl"
    argv = ["run", str(cfg), "--prompts", str(prompts), "--output", str(out)]
    p = launch.specplug(*argv, patch=KILLED_MID_LINE, patch_arg=out)
    assert p.wait(120) == -signal.SIGKILL, p.stderr
    text = out.read_text()
    assert text.count("\n") == 2 and not text.endswith("\n")  # two whole lines and half of the third
    assert Path(str(out) + ".lock").exists()  # left by the killed run: it must not block the next one
    assert main([*argv, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "dropping an incomplete last line" in err and "2 answer(s) already there are skipped" in err
    assert main(["run", str(cfg), "--prompts", str(prompts), "--output", str(full)]) == 0
    got, want = _rows(out), _rows(full)
    assert [(r["id"], r["text"]) for r in got] == [(r["id"], r["text"]) for r in want]


# ---------------------------------------------------------------------------------------------
# 4. replaced files: the old one or the new one, never half of one


class _Target:  # what HeadMeta.for_target reads of a target
    arch, model_path, n_embd, vocab_size, token_texts = "llama", "/m/tiny.gguf", 64, 3, ("a", "b", "c")


def test_a_head_that_cannot_be_written_keeps_the_old_one_and_says_why(tmp_path, monkeypatch):
    import gguf

    from specplug.errors import SpecplugError
    from specplug.heads import HeadMeta, write_head

    path = tmp_path / "head.gguf"
    path.write_bytes(b"the previous head")

    def full_disk(self, *a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full_disk)
    with pytest.raises(SpecplugError, match=r"head\.gguf: No space left on device \(ENOSPC\)"):
        write_head(path, HeadMeta.for_target(_Target(), "mtp", 1, ["final"], {}), {"w": torch.zeros(4, 64)})
    assert path.read_bytes() == b"the previous head" and sorted(os.listdir(tmp_path)) == ["head.gguf"]
