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

import os
import struct
from pathlib import Path
from typing import Sequence

import numpy as np

from specplug.errors import PluginError
from specplug_ngram.cache_file import read_checked, write_checked

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
    write_checked(path, "suffix", head, payload)


def load_outputs(path: str | os.PathLike, vocab_size: int, fingerprint: bytes) -> list[list[int]]:
    """The outputs stored at `path`, oldest first, checked against the target vocabulary.

    Raises one PluginError naming the file for a file that cannot be read, is not a suffix file,
    has another version, is truncated or corrupt, or was made for another vocabulary.
    """
    path = Path(path)
    (_, _, _, _, n_outputs, n_tokens), data = read_checked(
        path, _HEAD, MAGIC, VERSION, "a suffix tree file", lambda f: 4 * (f[4] + f[5]), vocab_size, fingerprint,
        "made", _fail)
    lengths = np.frombuffer(data, dtype="<u4", count=n_outputs, offset=_HEADER_SIZE).astype(np.int64)
    tokens = np.frombuffer(data, dtype="<i4", count=n_tokens, offset=_HEADER_SIZE + 4 * n_outputs)
    if int(lengths.sum()) != n_tokens:
        raise _fail(path, f"corrupt: output lengths add up to {int(lengths.sum())}, not {n_tokens} tokens")
    if n_tokens and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise _fail(path, f"corrupt: token id outside [0, {vocab_size})")
    flat = tokens.tolist()
    ends = np.cumsum(lengths).tolist()
    return [flat[a:b] for a, b in zip([0] + ends[:-1], ends)]
