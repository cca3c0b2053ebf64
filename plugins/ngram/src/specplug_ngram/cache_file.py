"""N-gram count tables and the cache file that stores them (static corpus caches, dynamic caches).

A `Table` holds, for one n-gram size n, every n-gram seen and the counts of the tokens that
followed it, as sorted numpy arrays; a dict index from n-gram to row is built on first lookup.

File format (little-endian), version 1:

    offset  size  field
    0       8     magic b"SPNGCACH"
    8       4     u32 format version (1)
    12      4     u32 vocab size of the tokenizer the cache was built with
    16      8     vocab fingerprint: sha256 of the JSON list of token texts, first 8 bytes
    24      4     u32 n_min   smallest n-gram size stored
    28      4     u32 n_max   largest n-gram size stored (one table per size in [n_min, n_max])
    32      8     u64 payload size in bytes
    40      32    sha256 of bytes [0, 40) followed by the payload
    72      ...   payload: per size n = n_min..n_max:
                    u64 K (n-grams), u64 T (n-gram/follower pairs),
                    i32 ngrams[K * n], i32 n_followers[K], i32 followers[T], i32 counts[T]

Followers of n-gram r are followers[sum(n_followers[:r]) : ... + n_followers[r]]. A file that is
truncated, corrupt, of another version or built for another vocabulary is refused with one
PluginError naming the file; saving writes a temporary file and renames it over the old one.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specplug.errors import PluginError
from specplug.outputs import OutputWriteError, describe_os_error, replacing

MAGIC = b"SPNGCACH"
VERSION = 1
MAX_N = 16  # no sane cache stores longer n-grams; larger values in a header mean corruption
_HEAD = struct.Struct("<8sII8sIIQ")  # everything before the checksum
_HEADER_SIZE = _HEAD.size + 32
_I32_MAX = np.iinfo(np.int32).max
_PART_CACHE_MAX = 1 << 16

# A part is [total count, most frequent follower, its count, {follower: count}]; context caches
# build the same lists incrementally, so drafting treats both alike.
Part = list


def vocab_fingerprint(token_texts: Sequence[str]) -> bytes:
    """8 bytes identifying a vocabulary by its token texts (same size but other texts differ)."""
    text = json.dumps(list(token_texts), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8]


def ngram_keys(ngrams: np.ndarray, vocab_size: int) -> list[int]:
    """Exact int keys of n-gram rows: the tokens as digits in base vocab_size (first = most significant)."""
    k, n = ngrams.shape
    if vocab_size ** n < (1 << 63):
        keys = np.zeros(k, dtype=np.int64)
        for col in range(n):
            keys = keys * vocab_size + ngrams[:, col]
        return keys.tolist()
    keys = np.zeros(k, dtype=object)  # Python ints: exact for any vocab and n
    for col in range(n):
        keys = keys * vocab_size + ngrams[:, col].astype(object)
    return keys.tolist()


class Table:
    """Follower counts of every n-gram of size n, as arrays sorted by n-gram."""

    def __init__(self, n: int, vocab_size: int, ngrams: np.ndarray, n_followers: np.ndarray,
                 followers: np.ndarray, counts: np.ndarray):
        self.n, self.vocab_size = n, vocab_size
        self.ngrams = ngrams.reshape(-1, n).astype(np.int32, copy=False)  # [K, n]
        self.n_followers = n_followers.astype(np.int32, copy=False)  # [K]
        self.followers = followers.astype(np.int32, copy=False)  # [T]
        self.counts = counts.astype(np.int32, copy=False)  # [T]
        self.offsets = np.concatenate([[0], np.cumsum(self.n_followers, dtype=np.int64)])  # [K + 1]
        self._index: dict[int, int] | None = None
        self._parts: dict[int, Part] = {}

    def __len__(self) -> int:
        return int(self.ngrams.shape[0])

    @classmethod
    def empty(cls, n: int, vocab_size: int) -> "Table":
        """A table with no n-grams."""
        z = np.zeros(0, dtype=np.int32)
        return cls(n, vocab_size, np.zeros((0, n), dtype=np.int32), z, z, z)

    @classmethod
    def from_rows(cls, n: int, vocab_size: int, rows: np.ndarray, counts: np.ndarray) -> "Table":
        """A table from (n-gram + follower) rows [R, n + 1] with a count each (repeats are summed)."""
        if rows.shape[0] == 0:
            return cls.empty(n, vocab_size)
        uniq, inverse = np.unique(rows, axis=0, return_inverse=True)
        summed = np.bincount(inverse.ravel(), weights=counts, minlength=uniq.shape[0])
        summed = np.minimum(summed, _I32_MAX)  # counts are int32 on disk
        # rows are sorted with the n-gram columns first, so equal n-grams are contiguous
        starts = np.concatenate([[True], np.any(uniq[1:, :n] != uniq[:-1, :n], axis=1)])
        first = np.flatnonzero(starts)
        n_followers = np.diff(np.append(first, uniq.shape[0]))
        return cls(n, vocab_size, uniq[first, :n], n_followers, uniq[:, n], summed)

    def rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The (n-gram + follower) rows [T, n + 1] and their counts [T]."""
        ngrams = np.repeat(self.ngrams, self.n_followers, axis=0)
        return np.column_stack([ngrams, self.followers]).astype(np.int32), self.counts.astype(np.int64)

    def merged(self, rows: np.ndarray, counts: np.ndarray) -> "Table":
        """A new table with `rows` (counts added to what this one holds)."""
        own_rows, own_counts = self.rows()
        return Table.from_rows(self.n, self.vocab_size, np.concatenate([own_rows, rows]),
                               np.concatenate([own_counts, counts]))

    def prepare(self) -> "Table":
        """Build the lookup index now (ValueError if an n-gram is stored twice); returns self."""
        if self._index is None:
            keys = ngram_keys(self.ngrams, self.vocab_size)
            index = dict(zip(keys, range(len(keys))))
            if len(index) != len(keys):
                raise ValueError(f"n={self.n}: the same n-gram is stored twice")
            self._index = index
        return self

    def get(self, key: int) -> Part | None:
        """The part of the n-gram with int key `key` (see `ngram_keys`), or None if unseen."""
        if self._index is None:
            self.prepare()
        row = self._index.get(key)
        if row is None:
            return None
        part = self._parts.get(row)
        if part is None:
            a, b = int(self.offsets[row]), int(self.offsets[row + 1])
            toks, cnts = self.followers[a:b].tolist(), self.counts[a:b].tolist()
            best = max(range(len(cnts)), key=cnts.__getitem__)  # first maximum
            part = [sum(cnts), toks[best], cnts[best], dict(zip(toks, cnts))]
            if len(self._parts) >= _PART_CACHE_MAX:  # bound memory on huge caches
                self._parts.clear()
            self._parts[row] = part
        return part


def window_rows(docs: Iterable[np.ndarray], n: int) -> np.ndarray:
    """Rows [R, n + 1] of every n-gram followed by its next token, within each document."""
    chunks = [sliding_window_view(np.asarray(d, dtype=np.int32), n + 1) for d in docs if len(d) > n]
    if not chunks:
        return np.zeros((0, n + 1), dtype=np.int32)
    return np.concatenate(chunks).astype(np.int32, copy=False)


def build_tables(docs: Sequence[np.ndarray], n_min: int, n_max: int, vocab_size: int) -> dict[int, Table]:
    """Count tables for sizes n_min..n_max over token documents (n-grams never cross documents)."""
    tables = {}
    for n in range(n_min, n_max + 1):
        rows = window_rows(docs, n)
        tables[n] = Table.from_rows(n, vocab_size, rows, np.ones(rows.shape[0], dtype=np.int64))
    return tables


class CacheWriteError(PluginError, OutputWriteError):
    """Saving a cache failed on the disk: a PluginError (the speculator's dynamic cache warns on it)
    and an OutputWriteError (`ngram-cache build` exits 1 on it)."""


def save_tables(path: str | os.PathLike, tables: dict[int, Table], vocab_size: int, fingerprint: bytes) -> None:
    """Write `tables` to `path` atomically (temp file + rename); PluginError naming the file on failure."""
    path = Path(path)
    n_min, n_max = min(tables), max(tables)
    chunks = []
    for n in range(n_min, n_max + 1):
        t = tables[n] if n in tables else Table.empty(n, vocab_size)
        chunks += [struct.pack("<QQ", len(t), t.followers.shape[0]),
                   t.ngrams.astype("<i4").tobytes(), t.n_followers.astype("<i4").tobytes(),
                   t.followers.astype("<i4").tobytes(), t.counts.astype("<i4").tobytes()]
    payload = b"".join(chunks)
    write_checked(path, "ngram-cache", _HEAD.pack(MAGIC, VERSION, vocab_size, fingerprint, n_min, n_max, len(payload)),
                  payload)


def write_checked(path: Path, who: str, head: bytes, payload: bytes) -> None:
    """Write `head`, the sha256 of head + payload, then `payload` to `path` atomically (temp file +
    rename: readers see the old file or the new); CacheWriteError naming `who` and the file on failure.
    The layout `read_checked` reads back (ngram-cache's and suffix's files)."""
    digest = hashlib.sha256(head + payload).digest()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path, who) as tmp, open(tmp, "wb") as f:
            f.write(head + digest)
            f.write(payload)
    except OutputWriteError as e:
        raise CacheWriteError(f"{who}: cannot save {path} ({e})") from None
    except OSError as e:  # the folder could not be made
        raise CacheWriteError(f"{who}: cannot save {path}: {describe_os_error(e)}") from None


def read_checked(path: Path, head: struct.Struct, magic: bytes, version: int, kind: str,
                 payload_size: Callable[[tuple], int], vocab_size: int, fingerprint: bytes, made: str,
                 fail: Callable[[Path, str], PluginError]) -> tuple[tuple, bytes]:
    """Read a file `write_checked` wrote: (the header's fields, the whole file's bytes), after checking
    in turn that it is readable, is `kind` (the magic), has `version`, holds `payload_size(fields)`
    payload bytes, matches its checksum and was `made` for this vocabulary (fields 2 and 3: its size and
    fingerprint). A file failing a check raises `fail(path, problem)`."""
    size = head.size + 32
    try:
        data = path.read_bytes()
    except OSError as e:
        raise fail(path, f"cannot read: {e.strerror or e}") from None
    if len(data) < size:
        if len(data) == 0 or not magic.startswith(data[:8]):
            raise fail(path, f"not {kind} (empty or bad magic)")
        raise fail(path, f"truncated: {len(data)} bytes, shorter than the {size}-byte header")
    fields = head.unpack_from(data)
    if fields[0] != magic:
        raise fail(path, f"not {kind} (bad magic)")
    if fields[1] != version:
        raise fail(path, f"unsupported format version {fields[1]} (this plugin reads version {version})")
    found, want = len(data) - size, payload_size(fields)
    if found < want:
        raise fail(path, f"truncated: payload has {found} of {want} bytes")
    if found > want:
        raise fail(path, f"corrupt: {found - want} unexpected bytes after the payload")
    h = hashlib.sha256(memoryview(data)[:head.size])
    h.update(memoryview(data)[size:])
    if h.digest() != data[head.size:size]:
        raise fail(path, "corrupt: checksum mismatch")
    if fields[2] != vocab_size:
        raise fail(path, f"{made} for a vocabulary of {fields[2]} tokens, the target has {vocab_size}")
    if fields[3] != fingerprint:
        raise fail(path, f"{made} for a different vocabulary (token texts differ, same size {vocab_size})")
    return fields, data


def _fail(path: Path, problem: str) -> PluginError:
    return PluginError(f"ngram-cache: {path}: {problem}")


def load_tables(path: str | os.PathLike, vocab_size: int, fingerprint: bytes,
                prepare: Iterable[int] = ()) -> dict[int, Table]:
    """Read every table of the cache file at `path`, checked against the target vocabulary.

    The tables of the sizes in `prepare` get their lookup index built (and checked) right away.

    Raises one PluginError naming the file for a file that cannot be read, is not a cache file,
    has another version, is truncated or corrupt, or was built for another vocabulary.
    """
    path = Path(path)
    (_, _, _, _, n_min, n_max, _), data = read_checked(
        path, _HEAD, MAGIC, VERSION, "an ngram-cache file", lambda f: f[6], vocab_size, fingerprint, "built", _fail)
    payload = memoryview(data)[_HEADER_SIZE:]
    if not 1 <= n_min <= n_max <= MAX_N:
        raise _fail(path, f"corrupt: n-gram sizes {n_min}..{n_max}")
    try:
        tables = _parse_tables(payload, n_min, n_max, vocab_size)
        for n in prepare:
            if n in tables:
                tables[n].prepare()
        return tables
    except ValueError as e:
        raise _fail(path, f"corrupt: {e}") from None


def _parse_tables(payload: memoryview, n_min: int, n_max: int, vocab_size: int) -> dict[int, Table]:
    tables, pos = {}, 0

    def take(count: int, what: str) -> np.ndarray:
        nonlocal pos
        end = pos + 4 * count
        if count < 0 or end > len(payload):
            raise ValueError(f"{what} run past the end of the payload")
        arr = np.frombuffer(payload, dtype="<i4", count=count, offset=pos).astype(np.int32)
        pos = end
        return arr

    for n in range(n_min, n_max + 1):
        if pos + 16 > len(payload):
            raise ValueError(f"table for n={n} is missing")
        k, t = struct.unpack_from("<QQ", payload, pos)
        pos += 16
        if k > len(payload) or t > len(payload):
            raise ValueError(f"table for n={n} claims {k} n-grams and {t} followers")
        ngrams = take(k * n, f"n={n} n-grams")
        n_followers = take(k, f"n={n} follower counts")
        followers = take(t, f"n={n} followers")
        counts = take(t, f"n={n} counts")
        if k and (n_followers.min() <= 0 or int(n_followers.sum(dtype=np.int64)) != t):
            raise ValueError(f"n={n} follower counts do not add up to {t}")
        if k == 0 and t != 0:
            raise ValueError(f"n={n} has followers but no n-grams")
        for name, arr in (("n-gram", ngrams), ("follower", followers)):
            if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
                raise ValueError(f"n={n} {name} token id outside [0, {vocab_size})")
        if t and counts.min() <= 0:
            raise ValueError(f"n={n} has a non-positive count")
        tables[n] = Table(n, vocab_size, ngrams, n_followers, followers, counts)
    if pos != len(payload):
        raise ValueError(f"{len(payload) - pos} bytes left after the last table")
    return tables
