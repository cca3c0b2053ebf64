"""Recording the traffic a deployment serves, opt-in: `specplug serve --record DIR`, `specplug run
--record DIR`, or `record:` in the YAML.

Every finished request's token ids, the prompt as the target read it and the answer it wrote,
are kept in DIR as a tokens-only folder (the format of `specplug train tokens`), so that

    specplug train data --from-tokens DIR -o DATA --taps final,3,15,27

rebuilds a training set of this traffic by prefill, to fine-tune a head on what it serves.

What is stored: token ids only; no text, no client address, no request id. Per request the
manifest's `prompts` holds {"id": "serve:17", "source": "serve" | "run", "time": unix seconds}.
Token ids decode back to text with the model's tokenizer, so the folder does hold the
conversations: a folder it creates is 0700, and every file it writes 0600. The end-of-turn token
that ended an answer is not stored (the engine's results leave it out).

Recording never holds a request up. `offer` (any thread) samples, queues, and never raises; the
recorder's own thread writes every `flush_s` seconds, as soon as the open shard has `max_mb` of
token ids, and at `close`. The open shard is rewritten whole under a new name
(tokens-<shard>-<sequences>.npz), then the manifest is replaced, then the shard's previous file
is removed: a crash at any moment leaves a manifest and the files it names (a kill -9 loses at
most the last `flush_s` seconds). A shard is closed once its token ids reach `max_mb`
(uncompressed; the file is smaller), and the next one begins. A failed write (a full disk, lost
permissions) drops the requests it carried, counts them and the failure, is logged once, and the
next write tries again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import sys
import tempfile
import threading
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from specplug.errors import SpecplugError
from specplug.outputs import claim, describe_os_error

if TYPE_CHECKING:
    from specplug.config import RecordConfig

log = logging.getLogger("specplug.record")

MANIFEST = "manifest.json"  # as in specplug.train.datagen (not imported here: it would load torch)


def lower_priority() -> None:
    """The calling thread yields the CPU to the engine thread and the event loop (Linux: per thread).

    SCHED_IDLE, where the kernel allows it: a waking engine or loop thread then takes the core from
    the worker at once, where a niced worker may keep it for the rest of its slice. That matters to
    the engine's threads, which meet at a barrier after every parallel region. Measured by
    scripts/stall_serve.py (context 8192, a 663 k-character prompt beside small requests, 2 cores,
    3 alternations, median of 3 rounds each): p99 1.35/1.69/1.70x idle, with nice 10 1.45/1.63/2.17x.
    Used by the server's prompt workers and the recorder's writer."""
    if sys.platform.startswith("linux"):
        tid = threading.get_native_id()
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            try:
                os.setpriority(os.PRIO_PROCESS, tid, 10)
            except OSError:
                pass


_ACTIVE: set[str] = set()  # folders a recorder of this process holds
_ACTIVE_LOCK = threading.Lock()


@dataclass
class RecordStats:
    """What a recorder has done (the server's /metrics reads these)."""

    requests: int = 0  # requests written to disk
    tokens: int = 0  # their tokens, prompt and answer
    failed_writes: int = 0
    lost_requests: int = 0  # requests dropped because their write failed
    lost_tokens: int = 0


@dataclass
class _Queued:
    tokens: array  # prompt + answer ids ('i': the stdlib array keeps numpy out of the CLI's start-up)
    prompt_len: int
    time: float


class Recorder:
    """Appends finished requests to a tokens-only folder; see the module docstring.

    folder: created (0700) if missing; an existing one must be empty or a recording of this same
    target (a new shard then continues it). The folder is claimed (specplug.outputs): a second
    process recording into it fails at once. source: "serve" or "run", kept with every request.
    context: the engine's context (the rebuild's prefill needs as many positions). With `start`
    False there is no writer thread: `flush()` writes (tests)."""

    def __init__(self, folder: str | Path, target, *, source: str, context: int, max_mb: float = 16.0,
                 sample: float = 1.0, flush_s: float = 30.0, seed: int | None = None, start: bool = True):
        if not max_mb > 0:
            raise SpecplugError(f"--record-max-mb must be > 0, got {max_mb}")
        if not 0 < sample <= 1:
            raise SpecplugError(f"--record-sample must be in (0, 1], got {sample}")
        self.folder, self.source = Path(folder), source
        self.max_bytes, self.sample, self.flush_s = max(1, int(max_mb * 2 ** 20)), sample, flush_s
        self.stats = RecordStats()
        self._rng = random.Random(seed)
        self._vocab = target.model.config.vocab_size
        self._itemsize = 4 if self._vocab > 65536 else 2  # as the shard stores them
        self._lock = threading.Lock()  # the queue and _closed
        self._io = threading.Lock()  # one write at a time
        self._queue: list[_Queued] = []
        self._queued_bytes = 0
        self._wake = threading.Event()
        self._closed = False
        self._warned = False
        self._thread: threading.Thread | None = None
        if not self.folder.parent.is_dir():
            raise SpecplugError(f"--record {self.folder}: the folder {self.folder.parent} does not exist")
        self._key = str(self.folder.resolve())
        with _ACTIVE_LOCK:
            if self._key in _ACTIVE:  # a claim nests within a process: it cannot tell two recorders apart
                raise SpecplugError(f"--record {self.folder}: another recorder of this process writes there")
            _ACTIVE.add(self._key)
        try:
            self._claim = claim(self.folder, "--record")  # and no other process
            try:
                self._open(target, context)
            except BaseException:
                self._claim.release()
                raise
        except BaseException:
            _ACTIVE.discard(self._key)
            raise
        if start:
            self._thread = threading.Thread(target=self._run, name="specplug-record", daemon=True)
            self._thread.start()

    @classmethod
    def from_config(cls, rec: RecordConfig, engine, source: str, **kw) -> "Recorder | None":
        """The recorder `record:` asks for on this engine's target, or None when recording is off."""
        if not rec.dir:
            return None
        return cls(rec.dir, engine.target, source=source, context=engine.max_ctx, max_mb=rec.max_mb,
                   sample=rec.sample, **kw)

    # --- any thread ---------------------------------------------------------------------------
    def offer(self, prompt_ids, answer_ids) -> bool:
        """Queue one finished request for writing, unless sampling leaves it out. Cheap; never raises
        and never waits for the disk. True when it was queued."""
        try:
            if not len(prompt_ids) or not len(answer_ids):
                return False
            tokens = array("i", prompt_ids)
            tokens.extend(answer_ids)
            with self._lock:
                if self._closed or (self.sample < 1 and self._rng.random() >= self.sample):
                    return False
                self._queue.append(_Queued(tokens, len(prompt_ids), time.time()))
                self._queued_bytes += len(tokens) * self._itemsize
                full = self._open_bytes + self._queued_bytes >= self.max_bytes
            if full:
                self._wake.set()
            return True
        except Exception as exc:  # recording must never fail a request
            self._failed(exc, 1, len(prompt_ids) + len(answer_ids))
            return False

    def flush(self) -> None:
        """Write every queued request now, in the calling thread (shards rotated as they fill)."""
        with self._io:
            with self._lock:
                queued, self._queue, self._queued_bytes = self._queue, [], 0
            size, part = self._open_bytes, []
            for q in queued:
                part.append(q)
                size += len(q.tokens) * self._itemsize
                if size >= self.max_bytes:
                    self._write(part, close=True)
                    size, part = 0, []
            if part:
                self._write(part, close=False)

    def close(self) -> None:
        """Stop taking requests, write what is queued, let go of the folder. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(60)
        self.flush()
        self._claim.release()
        _ACTIVE.discard(self._key)

    # --- the folder -----------------------------------------------------------------------------
    def _open(self, target, context: int) -> None:
        # train.tokens (numpy, torch, the heads) loads once a recorder opens: specplug.cli imports this
        # module at its top for the --record flags
        from specplug.train.tokens import read_tokens_manifest, target_identity

        folder = self.folder
        self._target = target_identity(target)
        self._shards: list[dict] = []  # closed shards
        self._prompts: list[dict] = []
        self._sources: dict = {}
        self._context = context
        if (folder / MANIFEST).is_file():
            man = read_tokens_manifest(folder)
            if "record" not in man.get("settings", {}):
                raise SpecplugError(f"--record {folder}: this folder holds tokens made by `specplug train tokens` or "
                                    "`train data`, not a recording; record into a new folder")
            t = man["target"]
            if (t.get("sha256"), t.get("token_table_sha256")) != (self._target["sha256"],
                                                                  self._target["token_table_sha256"]):
                raise SpecplugError(f"--record {folder}: this folder records the target {t.get('file')} (sha256 "
                                    f"{str(t.get('sha256'))[:12]}), not {self._target['file']} (sha256 "
                                    f"{self._target['sha256'][:12]}); record into another folder")
            self._shards, self._prompts = list(man["shards"]), list(man["prompts"])
            self._sources = dict(man.get("sources", {}))
            self._context = max(context, int(man.get("context", 0)))
            self._remove_leftovers({s["file"] for s in self._shards})
            log.warning("recording into %s: continuing %d recorded requests", folder, len(self._prompts))
        elif folder.exists():
            if not folder.is_dir():
                raise SpecplugError(f"--record {folder} is a file; give a folder")
            if any(folder.iterdir()):
                raise SpecplugError(f"--record {folder} holds files but no recording ({MANIFEST}); give an empty or "
                                    "new folder, or a folder this recorder wrote")
        else:
            try:
                folder.mkdir(mode=0o700)
                os.chmod(folder, 0o700)  # whatever the umask
            except OSError as exc:
                raise SpecplugError(f"--record {folder}: cannot create it: {describe_os_error(exc)}") from None
        self._index = 1 + max((int(s["index"]) for s in self._shards), default=-1)
        self._open_seqs: list[tuple[array, int, int]] = []  # (tokens, prompt length, prompt index)
        self._open_file: str | None = None
        self._open_bytes = 0
        self._settings = {"record": {"source": self.source, "max_mb": self.max_bytes / 2 ** 20,
                                     "sample": self.sample}}

    def _remove_leftovers(self, named: set[str]) -> None:
        """Shard and temporary files a killed writer left behind, which the manifest does not name."""
        for f in self.folder.iterdir():
            ours = f.name.startswith("tokens-") and f.name.endswith(".npz") or \
                f.name.startswith(".") and f.name.endswith(".tmp")
            if ours and f.name not in named:
                f.unlink(missing_ok=True)

    def _write(self, part: list[_Queued], close: bool) -> None:
        """The open shard plus `part`, then the manifest; on success the state moves on, on failure
        nothing does (the files on disk stay as they were) and `part` is counted as lost."""
        from specplug.train.tokens import token_shard_npz, tokens_manifest

        try:
            base = len(self._prompts)
            seqs = self._open_seqs + [(q.tokens, q.prompt_len, base + k) for k, q in enumerate(part)]
            prompts = self._prompts + [{"id": f"{self.source}:{base + k}", "source": self.source, "time": int(q.time)}
                                       for k, q in enumerate(part)]
            blob = token_shard_npz(seqs, self._vocab)
            name = f"tokens-{self._index:05d}-{len(seqs):06d}.npz"
            entry = {"index": self._index, "file": name, "sequences": len(seqs),
                     "tokens": int(sum(len(t) for t, _, _ in seqs)),
                     "answer_tokens": int(sum(len(t) - p for t, p, _ in seqs)),
                     "sha256": hashlib.sha256(blob).hexdigest()}
            sources = {**self._sources}
            sources[self.source] = {"requests": sources.get(self.source, {}).get("requests", 0) + len(part)}
            manifest = tokens_manifest(self._target, prompts, self._shards + [entry], self._context, self._settings,
                                       sources)
            _write_private(self.folder / name, blob)
            try:
                _write_private(self.folder / MANIFEST, json.dumps(manifest, indent=1).encode())
            except BaseException:
                (self.folder / name).unlink(missing_ok=True)
                raise
        except Exception as exc:
            self._failed(exc, len(part), sum(len(q.tokens) for q in part))
            return
        old, self._open_file = self._open_file, name
        if old is not None and old != name:
            (self.folder / old).unlink(missing_ok=True)
        self._open_seqs, self._prompts, self._sources = seqs, prompts, sources
        self._open_bytes = sum(len(t) for t, _, _ in seqs) * self._itemsize
        self.stats.requests += len(part)
        self.stats.tokens += sum(len(q.tokens) for q in part)
        if close:
            self._shards.append(entry)
            self._index += 1
            self._open_seqs, self._open_file, self._open_bytes = [], None, 0

    def _failed(self, exc: BaseException, requests: int, tokens: int) -> None:
        self.stats.failed_writes += 1
        self.stats.lost_requests += requests
        self.stats.lost_tokens += tokens
        if not self._warned:
            self._warned = True
            log.error("recording into %s failed (%s); requests are served as before, but %d of them were not "
                      "recorded; further failures are counted (/metrics: specplug_record_failed_writes_total), not "
                      "logged", self.folder, describe_os_error(exc) if isinstance(exc, OSError) else
                      f"{type(exc).__name__}: {exc}", requests)

    # --- the writer thread ------------------------------------------------------------------------
    def _run(self) -> None:
        lower_priority()
        while True:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            if self._closed:
                return  # close() writes the rest
            if self._queue:
                self.flush()


def _write_private(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically (temporary file beside it, fsync, rename), mode 0600."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # mkstemp: 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --- the command line ---------------------------------------------------------------------------------
def add_record_args(parser) -> None:
    """--record DIR, --record-max-mb, --record-sample (`specplug serve` and `specplug run`)."""
    g = parser.add_argument_group("recording (opt-in; see docs/serving.md)")
    g.add_argument("--record", metavar="DIR", default=None,
                   help="keep every finished request's token ids (prompt and answer) in DIR as token shards, for "
                        "`specplug train data --from-tokens DIR`; the operator must have the right to store them")
    g.add_argument("--record-max-mb", type=float, metavar="MB", default=None,
                   help="start a new shard after this many MB of token ids (default: record.max_mb in the YAML, "
                        "else 16)")
    g.add_argument("--record-sample", type=float, metavar="F", default=None,
                   help="record this random fraction of the requests (default 1: all)")


def with_record_args(cfg, args):
    """`cfg` with the --record flags laid over its `record:` settings."""
    rec = cfg.record
    given = {k: v for k, v in (("dir", args.record), ("max_mb", args.record_max_mb), ("sample", args.record_sample))
             if v is not None}
    if not given:
        return cfg
    if not given.get("dir", rec.dir):
        raise SpecplugError("--record-max-mb and --record-sample need --record DIR (or record: in the YAML)")
    try:
        return dataclasses.replace(cfg, record=dataclasses.replace(rec, **given))
    except ValueError as exc:
        raise SpecplugError(f"--record: {exc}") from None
