"""Outputs that stay whole: one writer per output, whole lines, atomic replaces, disk errors as errors.

Every file or folder specplug writes (`run --output/--stats`, `bench --out`, `train data -o`, a
trained head and its `.train/` folder, `ngram-cache build -o`) is claimed with `claim()` before
the model loads and held until the command ends:

- **One writer.** The claim is an advisory `fcntl.flock` on `PATH.lock` beside the output, which
  holds the PID and command line of its owner. A second writer fails at once with one line naming
  the output and that process. The lock sits beside the output, not on it, because a lock on the
  output itself would not survive the outputs that are replaced by a rename (stats, manifests,
  heads, caches: each rename is a new inode, so a lock on the old one guards nothing), cannot be
  taken on a folder the same way, and leaves no place for the owner's PID. `flock` rather than a
  PID file alone because the kernel drops the lock when its process dies, even by `kill -9`: a
  left-over lock file never blocks anyone. The owner deletes the lock file when done; a taker
  re-checks after locking that the file it locked is still the one at the path.
- **Whole lines or nothing** (`LineFile`): each line is one `os.write` of the complete line,
  fsynced; a short write (a full disk) is cut back to the line's start. Only a kill in the middle
  of the write can leave a partial last line, which `specplug run --resume` drops.
- **Atomic replace** (`replacing`, `write_atomic`): a temporary file beside the target, fsynced,
  then `os.replace`, so a reader sees the old file or the new one, never half of one.
- **Disk errors are errors.** A failed write raises `OutputWriteError` (one line: which file,
  which error); commands end with exit code 1 on it (`exit_1_on_write_error`), not 2 like a usage
  error, and never with a traceback.
"""
from __future__ import annotations

import errno
import fcntl
import functools
import os
import re
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from specplug.errors import SpecplugError


class OutputBusyError(SpecplugError):
    """Another process holds the output: the message names the file and that process."""


class OutputWriteError(SpecplugError):
    """A write failed (full disk, I/O error): the message names the file and the error. Exit code 1."""

    exit_code = 1


def describe_os_error(exc: BaseException) -> str:
    """'No space left on device (ENOSPC)' for an OSError, or for an error caused by one."""
    err = os_error_in(exc)
    if err is None:
        return str(exc)
    name = errno.errorcode.get(err.errno or 0, "")
    return f"{err.strerror or err}" + (f" ({name})" if name else "")


def os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`: itself, its cause or context (torch.save wraps it in a RuntimeError),
    or one named in its message ("os error 28", as safetensors reports it)."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    m = re.search(r"os error (\d+)", str(exc))
    if m:
        code = int(m.group(1))
        return OSError(code, os.strerror(code))
    return None


def write_error(path: str | os.PathLike, exc: BaseException, what: str = "") -> OutputWriteError:
    """The OutputWriteError for a failed write of `path`; `what` is appended (what is kept, what to do)."""
    return OutputWriteError(f"cannot write {path}: {describe_os_error(exc)}" + (f"; {what}" if what else ""))


def exit_1_on_write_error(func: Callable[..., int]) -> Callable[..., int]:
    """Wrap a command handler: an OutputWriteError prints its one line and the command exits 1."""
    @functools.wraps(func)
    def run(*args, **kwargs) -> int:
        try:
            return func(*args, **kwargs)
        except OutputWriteError as exc:
            print(f"specplug: error: {exc}", file=sys.stderr)
            return exc.exit_code

    return run


# ---------------------------------------------------------------------------------------------
# one writer per output


class Claim:
    """A held claim on an output (see `claim`); `release()` or leave the `with` block to let go."""

    def __init__(self, path: Path, lock_path: Path, fd: int | None):
        self.path, self.lock_path, self._fd = path, lock_path, fd
        self._depth = 1

    def release(self) -> None:
        """Give the claim up; the outermost release of a nested claim deletes the lock file."""
        self._depth -= 1
        if self._depth > 0 or self._fd is None:
            return
        _held.pop(str(self.lock_path), None)
        try:
            os.unlink(self.lock_path)  # while still locked: a waiter re-checks the inode and retries
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "Claim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


_held: dict[str, Claim] = {}  # lock path -> this process's claim, so that nested claims share it


def lock_path_of(path: str | os.PathLike) -> Path:
    """The lock file of an output: PATH.lock beside it (for a file or a folder alike)."""
    p = Path(os.path.abspath(path))
    return p.with_name(p.name + ".lock")


def claim(path: str | os.PathLike, label: str = "") -> Claim:
    """Claim `path` (a file or folder, existing or not) for this process until released.

    Raises OutputBusyError at once when another process holds it, naming `label path` and the
    holder's PID and command. Claiming a path this process already holds nests (shares the lock).
    The folder holding `path` must exist.
    """
    lock = lock_path_of(path)
    held = _held.get(str(lock))
    if held is not None:
        held._depth += 1
        return held
    name = f"{label} {path}" if label else str(path)
    for _ in range(100):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise OutputBusyError(f"{name}: cannot create its lock file {lock}: {describe_os_error(exc)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputBusyError(f"{name} is being written by another process ({_holder(lock)}); wait for it "
                                  f"to finish, or write somewhere else") from None
        try:
            same = os.stat(lock).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # the owner deleted it between our open and our lock: take the new one
            os.close(fd)
            continue
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n{' '.join(sys.argv)}\n".encode())
        except OSError:
            pass  # a full disk: the lock holds all the same, only the holder's name is missing
        c = Claim(Path(path), lock, fd)
        _held[str(lock)] = c
        return c
    raise OutputBusyError(f"{name}: its lock file {lock} keeps changing; is another process looping on it?")


def _holder(lock: Path) -> str:
    """'PID 1234: specplug run ...' from a lock file (written just after it is locked: retry once)."""
    for _ in range(2):
        try:
            pid, _, cmd = lock.read_text(errors="replace").partition("\n")
        except OSError:
            pid, cmd = "", ""
        if pid.strip():
            cmd = cmd.strip()
            cmd = cmd if len(cmd) <= 100 else cmd[:97] + "..."
            return f"PID {pid.strip()}" + (f": {cmd}" if cmd else "")
        time.sleep(0.05)
    return f"its lock file {lock} is held"


# ---------------------------------------------------------------------------------------------
# whole lines


class LineFile:
    """An output of one complete line per append.

    `mode`: "new" creates the file exclusively (an existing empty file counts as absent, raises
    FileExistsError otherwise), "truncate" empties it, "append" continues it (creating it if absent).
    """

    def __init__(self, path: str | os.PathLike, mode: str = "new"):
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        self.path = Path(path)
        if mode == "new":
            try:
                self._fd = os.open(self.path, flags | os.O_EXCL, 0o666)
            except FileExistsError:
                if os.path.getsize(self.path) > 0:
                    raise
                self._fd = os.open(self.path, flags)
        elif mode in ("truncate", "append"):
            self._fd = os.open(self.path, flags | (os.O_TRUNC if mode == "truncate" else 0), 0o666)
        else:
            raise ValueError(f"mode must be new, truncate or append, got {mode!r}")
        self.lines = 0  # lines this object appended

    def append(self, line: str) -> None:
        """Write `line` plus a newline in one write and fsync it; on any OSError the file is cut back
        to where it was (whole lines or nothing) and the OSError propagates."""
        assert "\n" not in line, f"a line holds a newline at {line.index(chr(10))}"
        data = (line + "\n").encode("utf-8")
        start = os.fstat(self._fd).st_size
        try:
            left = memoryview(data)
            while left:  # one write; a regular file writes short only when the disk fills
                n = os.write(self._fd, left)
                if n == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                left = left[n:]
            os.fsync(self._fd)  # delayed allocation reports a full disk here, not at write()
        except OSError:
            try:
                os.ftruncate(self._fd, start)
            except OSError:
                pass
            raise
        self.lines += 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "LineFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# atomic replace


def _new_file_mode(path: Path) -> int:
    """The mode of the file being replaced, else what a plain open() would create under the umask."""
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync a folder; the rename itself is atomic regardless
    finally:
        os.close(fd)


@contextmanager
def replacing(path: str | os.PathLike, label: str = "") -> Iterator[Path]:
    """Yield a temporary path beside `path` to write; on leaving the block it is fsynced and renamed
    over `path`. On any error the temporary file is deleted and `path` is left as it was; an error
    coming from the disk (an OSError, or one wrapping it) becomes an OutputWriteError."""
    path = Path(path)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        os.fchmod(fd, _new_file_mode(path))  # mkstemp makes 0600; give the usual permissions
        os.close(fd)
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        if isinstance(exc, Exception) and not isinstance(exc, SpecplugError) and os_error_in(exc) is not None:
            name = f"{label} {path}" if label else str(path)
            raise write_error(name, exc, "the previous file, if any, is unchanged") from None
        raise
    _fsync_dir(path.parent)


def write_atomic(path: str | os.PathLike, data: str | bytes, label: str = "") -> None:
    """Replace `path` with `data` (text is UTF-8) atomically; see `replacing`."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with replacing(path, label) as tmp:
        with open(tmp, "wb") as f:
            f.write(raw)
