"""Measured verification curves kept between runs, so `verify_curve: auto` times a model once per machine.

`specplug.pricing.measure_curve` takes ~2 s (SmolLM2-135M, 2 threads), and on a busy machine one
minute can read a third slower than the next. So `auto` measures when an engine is set up until this
machine holds AUTO_MEASUREMENTS measurements of the same model on the same kernels and threads, then
prices with the median of the stored ones, row count by row count, and measures no more; `measure`
always times the curve anew (and stores it: the newest KEEP stay). The key is everything the curve depends
on: the CPU, the kernels' build (their sources, flags, torch and Python: `native.build_key`) and
instruction set, the page size and prefetch distance, the threads, the measured row counts, and the
model file (its resolved path, size and modification time).

The file is `verify-curves.json` in $SPECPLUG_CACHE_DIR, else $XDG_CACHE_HOME/specplug, else
~/.cache/specplug; delete it to forget every curve. It is written whole to a temporary file and
renamed over the old one, under a lock (several workers may start at once); a file that cannot be
read is set aside with a warning and rebuilt, and one that cannot be written costs a warning and
the 2 s again next time, never the run.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import statistics
import tempfile
import warnings
from pathlib import Path

from specplug import machine
from specplug.pricing.curves import MEASURE_K, Curve, check_curve, never_falling
from specplug.runtime import native

ENV = "SPECPLUG_CACHE_DIR"
FILE = "verify-curves.json"
VERSION = 1
AUTO_MEASUREMENTS = 3  # `auto` measures until a key has this many, then reads their median
KEEP = 5  # the newest measurements kept a key


def cache_dir() -> Path:
    """$SPECPLUG_CACHE_DIR, else $XDG_CACHE_HOME/specplug, else ~/.cache/specplug."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "specplug"


def curve_key(model) -> tuple[str, dict]:
    """(a short hash, what it hashes) for `model`'s curve on this machine as it is set up now."""
    import torch

    info = machine.describe()
    st = Path(model.path).resolve().stat()
    what = {"cpu": info["cpu"], "cores": info["cores"], "threads": torch.get_num_threads(), "isa": model.isa,
            "build": native.build_key(model.isa) if model.isa else None, "pages": info.get("pages"),
            "prefetch_rows": info.get("kernel_prefetch_rows"), "pair_rows": info.get("kernel_pair_rows"),
            "rows": list(MEASURE_K), "model": str(Path(model.path).resolve()), "size": st.st_size,
            "mtime_ns": st.st_mtime_ns}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16], what


def median_curve(curves: list) -> Curve:
    """The median of several curves at each row count (they share their row counts), never falling."""
    return never_falling([(k, statistics.median(c[i][1] for c in curves)) for i, (k, _) in enumerate(curves[0])])


def _read(path: Path) -> dict:
    """The file's curves, {key: {"what": ..., "measured": [{"when": ..., "points": ...}, ...]}}; an
    unreadable file is renamed to *.bad (kept for a look) with a warning, and reads as empty."""
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("curves"), dict):
            raise ValueError(f"not a version {VERSION} curve cache")
        return doc["curves"]
    except (OSError, ValueError) as exc:
        bad = path.with_suffix(".bad")
        with contextlib.suppress(OSError):
            os.replace(path, bad)
        warnings.warn(f"{path}: unreadable verification-curve cache ({exc}); moved to {bad.name}, measuring anew",
                      stacklevel=3)
        return {}


def _valid(entry) -> list:
    """The stored measurements of one key that still check (check_curve), oldest first."""
    out = []
    for m in entry.get("measured", []) if isinstance(entry, dict) else []:
        try:
            out.append({"when": str(m["when"]), "points": check_curve(m["points"])})
        except (KeyError, TypeError, ValueError):
            continue  # a hand-edited or damaged measurement: left out
    return out


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on path's `.lock` neighbour for read-modify-write (none where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: a lost update costs one more measurement, nothing else
        yield
        return
    with open(path.with_suffix(".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def stored(key: str) -> list[tuple]:
    """The curves stored under `key` (curve_key), oldest first."""
    return [m["points"] for m in _valid(_read(cache_dir() / FILE).get(key))]


def store(key: str, what: dict, curve) -> None:
    """Add `curve`, measured now, to the ones stored under `key` (curve_key; `what` it hashes), the newest
    KEEP kept; a warning, not an error, when the cache cannot be written."""
    path = cache_dir() / FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _locked(path):
            curves = _read(path)
            measured = _valid(curves.get(key)) + [{"when": datetime.datetime.now().isoformat(timespec="seconds"),
                                                   "points": tuple(curve)}]
            curves[key] = {"what": what, "measured": [{"when": m["when"], "points": [list(p) for p in m["points"]]}
                                                      for m in measured[-KEEP:]]}
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".verify-curves-", suffix=".json")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"version": VERSION, "curves": curves}, f, indent=1)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
    except OSError as exc:
        warnings.warn(f"verification curve not cached ({exc}); set {ENV} to a writable folder to keep it",
                      stacklevel=3)
