"""Swapping a speculator's head file while serving: `POST /admin/reload` or SIGHUP (issue 39.3).

A reload builds the new speculator off the engine thread (the configured Params with the new
`head:`, the plugin's constructor, then `are_compatible` and `request_embeddings` as at start-up),
then hands it to the engine thread. There, between two steps, one short smoke request runs through
a throwaway engine on the same target with the new speculator alone: a hook that raises, or a draft
the host refuses, refuses the file. Then `Engine.replace_speculator` puts it in place: requests in
flight are kept and go on without it, requests admitted from then on are drafted by it.

A refused file changes nothing: the old head keeps serving, and the error is logged and returned.
/metrics labels acceptance with each head's identity (the first 12 hex digits of its file's sha256),
and keeps the replaced head's figures, so a before/after is visible.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from pathlib import Path
from typing import Callable, Sequence

from specplug.api import start_speculator
from specplug.drafting import Speculator
from specplug.engine import Engine, Request, target_info
from specplug.errors import SpecplugError
from specplug.plugins import get_type, new_plugin_manager
from specplug.server.worker import EngineDown, EngineWorker

log = logging.getLogger("specplug.server")

SMOKE_TEXT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
SMOKE_TOKENS = 8


class ReloadError(SpecplugError):
    """A reload that was refused; the old head keeps serving. `status`/`code`: the HTTP answer."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def file_identity(path: str | Path) -> str:
    """A head file's identity: the first 12 hex digits of its sha256."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:12]


def head_identity(spec: Speculator) -> str:
    """The identity of the head file `spec` drafts with ("" without one). Reads the plugin's
    `head.path` (the HeadFile of the mtp, eagle3 and dflash speculators)."""
    path = getattr(getattr(spec.caller.plugin, "head", None), "path", None)
    return "" if path is None else file_identity(path)


def smoke_draft(engine: Engine, spec: Speculator) -> str | None:
    """Run `spec` alone on one short greedy request through a throwaway engine on `engine`'s target
    (engine thread only: it uses the target); why it fails, or None. `spec`'s hooks see slot 0 and
    fewer positions than its TargetInfo allows; the request's end removes its rows again."""
    tok = engine.target.tokenizer
    probe = Engine(engine.target, [spec], n_parallel=1, max_ctx=min(engine.max_ctx, 128), pricing=engine.pricing)
    probe.run([Request(tok.encode(SMOKE_TEXT)[:64], SMOKE_TOKENS, ignore_eos=True)])
    if spec.name in probe.stats.disabled:
        return f"the smoke draft failed: {probe.stats.disabled[spec.name]}"
    if not spec.stats.hook_calls.get("draft"):
        return "the smoke request never got to ask it for a draft"
    return None


class Reloader:
    """Reloads the head files of the speculators an engine was built with (see the module docstring).

    speculators: the engine's SpeculatorConfigs (type, Params, policy), rebuilt with a new `head:`.
    on_swap(old, new, head): called in the engine thread after a swap (the metrics keep the old figures)."""

    def __init__(self, worker: EngineWorker, speculators: Sequence, on_swap: Callable | None = None):
        self.worker, self.engine = worker, worker.engine
        self.configs = {sc.name: sc for sc in speculators}
        self.on_swap = on_swap
        eng = self.engine
        self.info = target_info(eng.target, eng.n_parallel, eng.max_ctx, eng.pricing.cost)  # as build_engine told them
        self._lock = threading.Lock()  # one reload at a time

    def reload(self, name: str, head: str, timeout: float = 300.0) -> dict:
        """Swap in `head` for speculator `name`; a report of what was done. Raises ReloadError when
        the file is refused (logged; the old head keeps serving)."""
        with self._lock:
            try:
                report = self._reload(name, head, timeout)
            except ReloadError as exc:
                log.error("speculator %r: reloading %s refused (%s); the old head keeps serving", name, head,
                          exc.message)
                raise
        log.warning("speculator %r: head %s (sha256 %s) replaces %s; %d request(s) in flight kept", name,
                    report["head"], report["identity"], report["previous"] or "(none)", report["kept_in_flight"])
        return report

    def reload_changed(self, speculators: Sequence) -> list[dict]:
        """SIGHUP: for each configured speculator whose `head:` in `speculators` (the YAML read again)
        names another file, or whose file changed, reload it. Other changes need a restart (logged)."""
        reports, tried = [], 0
        for sc in speculators:
            cur = self.configs.get(sc.name)
            head = getattr(sc.params, "head", None)
            if cur is None or cur.type != sc.type:
                log.warning("SIGHUP: speculator %r (type %s) is not one this server runs; restart to add it",
                            sc.name, sc.type)
                continue
            if head is None:
                continue
            if dataclasses.replace(sc.params, head=None) != dataclasses.replace(cur.params, head=None):
                log.warning("SIGHUP: speculator %r: only its head file is reloaded; its other settings change "
                            "at a restart", sc.name)
            same = head == getattr(cur.params, "head", None) and Path(head).is_file()
            if same and file_identity(head) == self.worker.heads.get(sc.name):
                continue
            tried += 1
            try:
                reports.append(self.reload(sc.name, head))
            except ReloadError:
                pass  # logged; the next one may go through
        if not tried:
            log.warning("SIGHUP: no head file changed; nothing was reloaded")
        return reports

    def _reload(self, name: str, head: str, timeout: float) -> dict:
        sc = self.configs.get(name)
        if sc is None:
            raise ReloadError(404, f"No speculator named {name!r}; this server has "
                                   f"{', '.join(map(repr, self.configs)) or 'none'}", "speculator_not_found")
        if "head" not in {f.name for f in dataclasses.fields(sc.params)}:
            raise ReloadError(400, f"Speculator {name!r} (type {sc.type}) has no head file to reload", "no_head")
        path = Path(head).expanduser()
        if not path.is_file():
            raise ReloadError(400, f"head file not found: {path} (a path on the server)", "head_refused")
        params, new = self._build(sc, str(path))
        identity = file_identity(path)
        try:
            old, kept = self.worker.between_steps(lambda engine: self._swap(engine, new, identity, path), timeout)
        except ReloadError:
            raise
        except EngineDown as exc:
            raise ReloadError(503, f"The engine is not serving: {exc}", "engine_unavailable") from None
        except TimeoutError:
            raise ReloadError(503, f"The engine thread did not take the new head within {timeout:g} s",
                              "reload_timeout") from None
        except Exception as exc:  # the smoke request itself broke: the engine in service is untouched
            raise ReloadError(400, f"{path}: the smoke draft failed: {type(exc).__name__}: {exc}",
                              "head_refused") from None
        previous = getattr(sc.params, "head", None)
        self.configs[name] = dataclasses.replace(sc, params=params)
        return {"speculator": name, "head": str(path), "identity": identity, "previous": previous,
                "previous_identity": old, "kept_in_flight": kept}

    def _build(self, sc, path: str):
        """The new speculator, started as at start-up (off the engine thread: it reads only TargetInfo)."""
        try:
            params = dataclasses.replace(sc.params, head=path)
            inst = get_type(sc.type).cls(params, self.info)
            return params, start_speculator(new_plugin_manager(), inst, sc.name, sc.type, sc.policy, self.info)
        except Exception as exc:
            why = str(exc) if isinstance(exc, SpecplugError) else f"{type(exc).__name__}: {exc}"
            raise ReloadError(400, f"{path}: {why}", "head_refused") from None

    def _swap(self, engine: Engine, new: Speculator, identity: str, path: Path) -> tuple[str, int]:
        """Engine thread: smoke-test `new`, then put it in place; (the old head's identity, requests kept)."""
        problem = smoke_draft(engine, new)
        if problem:
            raise ReloadError(400, f"{path}: {problem}", "head_refused")
        fresh = Speculator(new.name, new.caller, new.policy, new.embeddings)  # the smoke run's figures left behind
        kept = engine.n_running
        old = engine.replace_speculator(fresh)
        old_identity = self.worker.heads.get(new.name, "")
        self.worker.heads[new.name] = identity
        if self.on_swap is not None:
            self.on_swap(old, fresh, old_identity)
        return old_identity, kept
