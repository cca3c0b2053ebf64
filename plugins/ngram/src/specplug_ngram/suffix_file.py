"""The file that keeps the `suffix` speculator's global tree between runs: the cached outputs
themselves (oldest first), from which the tree is rebuilt at load.

Storing outputs rather than nodes keeps the file small (4 bytes a token), independent of
`max_tree_depth`, and lets eviction after a load take an output out exactly as it went in.

File format (little-endian), version 1:

    offset  size  field
    0       8     magic b"SPSUFFIX"
    8       4     u32 format version (1)
    12      4     u32 vocab size of the target the outputs were generated with
    16      8     vocab fingerprint: sha256 of the JSON list of token texts, first 8 bytes
    24      8     u64 R, outputs stored
    32      8     u64 T, tokens stored (all outputs together)
    40      32    sha256 of bytes [0, 40) followed by the payload
    72      ...   payload: u32 lengths[R], i32 tokens[T] (output r is the next lengths[r] tokens)

A file that is truncated, corrupt, of another version or made for another vocabulary is refused
with one PluginError naming the file; saving writes a temporary file and renames it over the old.
"""
from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import Sequence

import numpy as np

from specplug.errors import PluginError
from specplug.outputs import OutputWriteError, describe_os_error, replacing
from specplug_ngram.cache_file import CacheWriteError

MAGIC = b"SPSUFFIX"
VERSION = 1
_HEAD = struct.Struct("<8sII8sQQ")  # everything before the checksum
_HEADER_SIZE = _HEAD.size + 32


def _fail(path: Path, problem: str) -> PluginError:
    return PluginError(f"suffix: {path}: {problem}")


def save_outputs(path: str | os.PathLike, outputs: Sequence[Sequence[int]], vocab_size: int,
                 fingerprint: bytes) -> None:
    """Write `outputs` to `path` atomically (temp file + rename); PluginError naming the file on failure."""
    path = Path(path)
    lengths = np.asarray([len(o) for o in outputs], dtype="<u4")
    tokens = np.asarray([t for o in outputs for t in o], dtype="<i4")
    payload = lengths.tobytes() + tokens.tobytes()
    head = _HEAD.pack(MAGIC, VERSION, vocab_size, fingerprint, len(lengths), len(tokens))
    digest = hashlib.sha256(head + payload).digest()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path, "suffix") as tmp, open(tmp, "wb") as f:  # readers see the old file or the new
            f.write(head + digest)
            f.write(payload)
    except OutputWriteError as e:
        raise CacheWriteError(f"suffix: cannot save {path} ({e})") from None
    except OSError as e:  # the folder could not be made
        raise CacheWriteError(f"suffix: cannot save {path}: {describe_os_error(e)}") from None


def load_outputs(path: str | os.PathLike, vocab_size: int, fingerprint: bytes) -> list[list[int]]:
    """The outputs stored at `path`, oldest first, checked against the target vocabulary.

    Raises one PluginError naming the file for a file that cannot be read, is not a suffix file,
    has another version, is truncated or corrupt, or was made for another vocabulary.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise _fail(path, f"cannot read: {e.strerror or e}") from None
    if len(data) < _HEADER_SIZE:
        if len(data) == 0 or not MAGIC.startswith(data[:8]):
            raise _fail(path, "not a suffix tree file (empty or bad magic)")
        raise _fail(path, f"truncated: {len(data)} bytes, shorter than the {_HEADER_SIZE}-byte header")
    magic, version, file_vocab, file_fp, n_outputs, n_tokens = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise _fail(path, "not a suffix tree file (bad magic)")
    if version != VERSION:
        raise _fail(path, f"unsupported format version {version} (this plugin reads version {VERSION})")
    found = len(data) - _HEADER_SIZE
    size = 4 * (n_outputs + n_tokens)
    if found < size:
        raise _fail(path, f"truncated: payload has {found} of {size} bytes")
    if found > size:
        raise _fail(path, f"corrupt: {found - size} unexpected bytes after the payload")
    h = hashlib.sha256(memoryview(data)[:_HEAD.size])
    h.update(memoryview(data)[_HEADER_SIZE:])
    if h.digest() != data[_HEAD.size:_HEADER_SIZE]:
        raise _fail(path, "corrupt: checksum mismatch")
    if file_vocab != vocab_size:
        raise _fail(path, f"made for a vocabulary of {file_vocab} tokens, the target has {vocab_size}")
    if file_fp != fingerprint:
        raise _fail(path, f"made for a different vocabulary (token texts differ, same size {vocab_size})")
    lengths = np.frombuffer(data, dtype="<u4", count=n_outputs, offset=_HEADER_SIZE).astype(np.int64)
    tokens = np.frombuffer(data, dtype="<i4", count=n_tokens, offset=_HEADER_SIZE + 4 * n_outputs)
    if int(lengths.sum()) != n_tokens:
        raise _fail(path, f"corrupt: output lengths add up to {int(lengths.sum())}, not {n_tokens} tokens")
    if n_tokens and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise _fail(path, f"corrupt: token id outside [0, {vocab_size})")
    flat = tokens.tolist()
    ends = np.cumsum(lengths).tolist()
    return [flat[a:b] for a, b in zip([0] + ends[:-1], ends)]
