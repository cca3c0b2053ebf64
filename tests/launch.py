"""Starting specplug as a user does, for tests: `specplug serve` and `specplug run` as subprocesses
(started, waited for until ready, stopped, their output collected), an app served in a thread of
this process, and the small files such runs read (a YAML config, a prompts file).

Tests get a `Launcher` from the `launch` fixture (tests/conftest.py), which kills whatever is still
running when the test ends, passed or failed. A subprocess writes its stdout and stderr to files,
not pipes: a chatty server never blocks on a full pipe, and its output can be read at any time.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from specplug.testing import running  # noqa: F401  (the tests import it from here too)

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny"  # the model name apps serve in tests (`create_app(engine, MODEL)`)


# --- small waits -------------------------------------------------------------------------------
def wait_for(cond, what: str, timeout: float = 15.0) -> None:
    """Poll `cond()` until it is true; fail with `what` after `timeout` seconds."""
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the files a run reads ---------------------------------------------------------------------
def write_config(path: Path, model, extra: str = "", **keys) -> Path:
    """A YAML config for `model` at `path` (a folder: `run.yaml` in it): cpu, no quantization, the
    given top-level keys, then `extra` (raw YAML, e.g. a `speculators:` list)."""
    path = Path(path)
    if path.is_dir():
        path = path / "run.yaml"
    fields = {"model": model, "device": "cpu", "quant": "none", **keys}
    path.write_text("".join(f"{k}: {v}\n" for k, v in fields.items()) + extra)
    return path


def run_config(folder: Path, model, extra: str = "") -> Path:
    """The config of the `specplug run` tests: 10 tokens per answer, one sequence at a time."""
    return write_config(folder, model, extra, max_tokens=10, parallel=1)


def prompts_file(folder: Path, n: int = 4) -> Path:
    """`prompts.jsonl` with n one-line prompts, ids p0, p1, ..."""
    p = Path(folder) / "prompts.jsonl"
    p.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"the sea number {i}"}) + "\n" for i in range(n)))
    return p


# --- an app in a thread of this process (`running`: specplug.testing's) -------------------------
def stream_until_first_token(url: str, body: dict, model: str = MODEL):
    """Open a streaming completion and read until its first text arrives; returns the context manager
    and the line iterator, which must stay referenced (closing it closes the connection)."""
    cm = httpx.stream("POST", url + "/v1/completions", json={"model": model, "stream": True, **body}, timeout=30)
    resp = cm.__enter__()
    assert resp.status_code == 200
    lines = resp.iter_lines()
    for line in lines:
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
            break
    return cm, lines


# --- subprocesses -------------------------------------------------------------------------------
class Process:
    """One subprocess; stdout and stderr go to files, read whole at any time."""

    def __init__(self, argv: list[str], log: Path, stdin: bool = False, name: str = ""):
        self.name = name or " ".join(map(str, argv))
        self._out, self._err = log.with_suffix(".stdout"), log.with_suffix(".stderr")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        with open(self._out, "wb") as out, open(self._err, "wb") as err:
            self.popen = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=err,
                                          stdin=subprocess.PIPE if stdin else subprocess.DEVNULL)
        self.pid = self.popen.pid

    @property
    def stdout(self) -> str:
        return self._out.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self._err.read_text(errors="replace")

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def wait(self, timeout: float = 60.0) -> int:
        """Its exit status, waiting up to `timeout` seconds (then it fails the test)."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self} still runs after {timeout:g} s; stderr:\n{self.stderr[-4000:]}") from None

    def send_signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send `sig` and wait for the exit; its status."""
        self.send_signal(sig)
        return self.wait(timeout)

    def release(self) -> None:
        """Close its stdin (a process that holds something until its stdin closes lets it go)."""
        self.popen.stdin.close()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            self.popen.stdin.close()

    def __repr__(self) -> str:
        return f"<process {self.pid}: {self.name[:200]}>"


class Served:
    """A `specplug serve` subprocess that answered /health."""

    def __init__(self, proc: Process, port: int):
        self.proc, self.port = proc, port
        self.url = f"http://127.0.0.1:{port}"


class Launcher:
    """Starts specplug subprocesses for one test and kills those still running at its end."""

    def __init__(self, folder: Path):
        self.folder = Path(folder) / "launched"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.started: list[Process] = []

    def python(self, code: str, *args, stdin: bool = False, name: str = "") -> Process:
        """`python -c code args...`."""
        log = self.folder / f"p{len(self.started)}"
        proc = Process([sys.executable, "-c", code, *map(str, args)], log, stdin, name or f"python -c ... {args}")
        self.started.append(proc)
        return proc

    def specplug(self, *argv, patch: str | None = None, patch_arg: str = "", stdin: bool = False) -> Process:
        """`specplug argv...`. A `patch` (Python code) runs first in the same process, to slow or
        break a part of it; it reads its one parameter, `patch_arg`, as sys.argv[1]."""
        name = "specplug " + " ".join(map(str, argv)) + (" (patched)" if patch else "")
        if patch is None:
            return self.python("import sys\nfrom specplug.cli import main\nsys.exit(main(sys.argv[1:]))",
                               *argv, stdin=stdin, name=name)
        code = f"{patch}\nimport sys as _sys\nfrom specplug.cli import main as _main\n_sys.exit(_main(_sys.argv[2:]))"
        return self.python(code, patch_arg, *argv, stdin=stdin, name=name)

    def serve(self, config: Path, *flags, patch: str | None = None, patch_arg: str = "",
              timeout: float = 60.0) -> Served:
        """`specplug serve config` on a free port, once its /health answers 200 (warnings logged only)."""
        port = free_port()
        proc = self.specplug("serve", config, "--port", str(port), "--log-level", "warning", *flags,
                             patch=patch, patch_arg=patch_arg)
        served = Served(proc, port)

        def up() -> bool:
            assert proc.returncode is None, f"specplug serve exited with {proc.returncode}:\n{proc.stderr}"
            try:
                return httpx.get(served.url + "/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, f"specplug serve did not come up in {timeout:g} s", timeout)
        return served

    def close(self) -> None:
        for proc in self.started:
            proc.kill()

    def __enter__(self) -> "Launcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
