"""`ngram-cache`: token statistics from three caches, after llama.cpp's `common/ngram-cache`.

- context: per sequence, counts of the token following every 1..4-gram of its own history,
  updated incrementally each step;
- dynamic: the context caches of finished sequences merged together (learnt during the run),
  loaded from `dynamic_path` at start when the file exists, saved back there each time a
  sequence ends (`remove(seq_id, 0)`), so the next run starts from what this one learnt;
- static: counts of the token following each `static_n`-gram of a corpus, built offline with
  `specplug ngram-cache build` and never changed.

Each draft token is chosen as in llama.cpp: the longest n-gram first, the context cache with
lax thresholds, then the dynamic cache with strict thresholds, then the static cache alone;
a candidate's count is weighted by 100 x its static count, when the static cache knows the
current `static_n`-gram, so corpus statistics break ties. Drafting stops at the first
position no cache can fill with enough confidence.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from specplug.errors import ConfigError, PluginError
from specplug.hooks import hookimpl
from specplug.types import Draft, DraftRequest, TargetInfo
from specplug_ngram._common import History, SequenceStates, check_int, make_draft
from specplug_ngram.cache_file import Part, Table, load_tables, save_tables, vocab_fingerprint, window_rows

NAME = "ngram-cache"
MAX_NGRAM = 4
# llama.cpp's thresholds (index n - 1): a cache entry drafts only with at least this many samples
# and its chosen token at least this percentage of them; the dynamic cache is held stricter.
LAX_SIZE, LAX_PCT = (2, 2, 1, 1), (66, 50, 50, 50)
STRICT_SIZE, STRICT_PCT = (4, 3, 2, 2), (75, 66, 66, 66)

log = logging.getLogger(__name__)


def _pick(part: Part | None, static: dict[int, int] | None, min_size: int, min_pct: int) -> int | None:
    """The token `part` drafts under the thresholds, weighting by static counts; None if unsure."""
    if part is None:
        return None
    total, tok, cnt, counts = part
    # the chosen token's count is at most the top count: failing with it fails for all
    if total < min_size or 100 * cnt < min_pct * total:
        return None
    if static:
        score = -1
        for t, c in counts.items():
            s = static.get(t)
            sc = c * 100 * s if s else c
            if sc > score:
                score, tok, cnt = sc, t, c
        if 100 * cnt < min_pct * total:
            return None
    return tok


def _add(table: dict[int, Part], key: int, token: int) -> None:
    part = table.get(key)
    if part is None:
        table[key] = [1, token, 1, {token: 1}]
        return
    counts = part[3]
    c = counts[token] = counts.get(token, 0) + 1
    part[0] += 1
    if c >= part[2]:  # ties: the most recent token
        part[1], part[2] = token, c


class _SeqState:
    __slots__ = ("hist", "ctx")

    def __init__(self, sizes: range, capacity: int):
        self.hist = History(capacity)
        self.ctx: dict[int, dict[int, Part]] = {n: {} for n in sizes}  # size -> n-gram key -> part


def _check_path(params: object, name: str) -> str | None:
    value = getattr(params, name)
    if value is None or isinstance(value, (str, os.PathLike)):
        return None if value in (None, "") else os.path.expanduser(os.fspath(value))
    raise ConfigError(f"{NAME}: {name} must be a file path or null, got {value!r}")


class NgramCache:
    """N-gram cache speculator: context + dynamic (persistent) + static (corpus) statistics."""

    @dataclass
    class Params:
        static_path: str | None = None  # cache file built from a corpus (`specplug ngram-cache build`)
        dynamic_path: str | None = None  # learnt cache: loaded at start if present, saved at each sequence end
        ngram_min: int = 1  # smallest n-gram looked up in the context/dynamic caches
        ngram_max: int = 4  # largest n-gram looked up (at most 4, as llama.cpp)
        static_n: int = 2  # n-gram size used from the static cache (llama.cpp: 2)
        m: int = 8  # longest draft, also capped by the host's n_max
        save_dynamic: bool = True  # write dynamic_path when a sequence ends

    def __init__(self, params: "NgramCache.Params", target: TargetInfo):
        self.ngram_min = check_int(NAME, params, "ngram_min", 1, MAX_NGRAM)
        self.ngram_max = check_int(NAME, params, "ngram_max", self.ngram_min, MAX_NGRAM)
        self.static_n = check_int(NAME, params, "static_n", 1, MAX_NGRAM)
        self.m = check_int(NAME, params, "m", 1)
        if not isinstance(params.save_dynamic, bool):
            raise ConfigError(f"{NAME}: save_dynamic must be true or false, got {params.save_dynamic!r}")
        self.save_dynamic = params.save_dynamic
        self.static_path = _check_path(params, "static_path")
        self.dynamic_path = _check_path(params, "dynamic_path")
        self.vocab_size = target.vocab_size
        self._sizes = range(self.ngram_min, self.ngram_max + 1)
        self._fingerprint = vocab_fingerprint(target.token_texts) if (self.static_path or self.dynamic_path) else b""
        self.static: Table | None = self._load_static() if self.static_path else None
        self.dynamic: dict[int, Table] = self._load_dynamic()
        capacity = min(target.max_ctx, 1 << 16)
        self._seqs: SequenceStates[_SeqState] = SequenceStates(lambda: _SeqState(self._sizes, capacity))

    def _load_static(self) -> Table:
        tables = load_tables(self.static_path, self.vocab_size, self._fingerprint, prepare=[self.static_n])
        if self.static_n not in tables:
            raise PluginError(f"{NAME}: {self.static_path}: holds n-gram sizes {min(tables)}..{max(tables)}, "
                              f"static_n={self.static_n} is not among them (rebuild with --n-max {self.static_n})")
        return tables[self.static_n]

    def _load_dynamic(self) -> dict[int, Table]:
        tables: dict[int, Table] = {}
        if self.dynamic_path and Path(self.dynamic_path).exists():
            tables = load_tables(self.dynamic_path, self.vocab_size, self._fingerprint, prepare=self._sizes)
        for n in self._sizes:  # sizes the file lacks start empty; sizes we do not use are kept for saving
            tables.setdefault(n, Table.empty(n, self.vocab_size))
        return tables

    @hookimpl
    def are_compatible(self, target: TargetInfo) -> str | None:
        """Token-only; cache files are checked against the target's vocabulary when loaded."""
        return None

    def _ingest(self, st: _SeqState, start: int) -> None:
        buf, end, vocab = st.hist.buf, st.hist.n, self.vocab_size
        lo = max(0, start - self.ngram_max)
        toks = buf[lo:end].tolist()
        ctx, n_min = st.ctx, self.ngram_min
        for j in range(max(start, n_min), end):  # j = index of the follower token
            follower, key, scale = toks[j - lo], 0, 1
            for size in range(1, min(self.ngram_max, j) + 1):
                key += toks[j - size - lo] * scale  # key of tokens[j-size:j], oldest token most significant
                scale *= vocab
                if size >= n_min:
                    _add(ctx[size], key, follower)

    def _next_token(self, ctx: dict[int, dict[int, Part]], window: list[int]) -> int | None:
        vocab, length = self.vocab_size, len(window)
        static_part = static_counts = None
        if self.static is not None and length >= self.static_n:
            key = 0
            for t in window[-self.static_n:]:
                key = key * vocab + t
            static_part = self.static.get(key)
            static_counts = static_part[3] if static_part else None
        keys, key, scale = {}, 0, 1
        for size in range(1, min(self.ngram_max, length) + 1):
            key += window[-size] * scale
            scale *= vocab
            keys[size] = key
        sizes = [s for s in reversed(self._sizes) if s in keys]  # longest n-gram first
        for s in sizes:
            tok = _pick(ctx[s].get(keys[s]), static_counts, LAX_SIZE[s - 1], LAX_PCT[s - 1])
            if tok is not None:
                return tok
        for s in sizes:
            table = self.dynamic[s]
            if len(table):
                tok = _pick(table.get(keys[s]), static_counts, STRICT_SIZE[s - 1], STRICT_PCT[s - 1])
                if tok is not None:
                    return tok
        if static_counts is not None:  # the static cache alone, without weighting
            return _pick(static_part, None, LAX_SIZE[self.static_n - 1], LAX_PCT[self.static_n - 1])
        return None

    def _draft_one(self, req: DraftRequest) -> Draft | None:
        st, start = self._seqs.sync(req.seq_id, req.tokens)
        self._ingest(st, start)
        end, limit = st.hist.n, min(self.m, req.n_max)
        if end == 0 or limit <= 0:
            return None
        window = st.hist.buf[max(0, end - max(self.ngram_max, self.static_n)):end].tolist()
        out: list[int] = []
        while len(out) < limit:
            tok = self._next_token(st.ctx, window)
            if tok is None:
                break
            out.append(tok)
            window.append(tok)
        return make_draft(out, req.n_max, self.vocab_size)

    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]) -> Sequence[Draft | None] | None:
        """One proposal per request, token by token from the context, dynamic and static caches."""
        return [self._draft_one(r) for r in requests]

    def learn(self, tokens: Sequence[int]) -> None:
        """Merge the n-gram statistics of a finished sequence's tokens into the dynamic cache."""
        if len(tokens) <= self.ngram_min:
            return
        doc = [np.asarray(tokens, dtype=np.int32)]
        for n in self._sizes:
            rows = window_rows(doc, n)
            if rows.shape[0]:
                self.dynamic[n] = self.dynamic[n].merged(rows, np.ones(rows.shape[0], dtype=np.int64))

    def summary(self) -> str | None:
        """The run summary's line: where the dynamic cache went (not a hook)."""
        if not self.dynamic_path:
            return None
        where = os.path.abspath(self.dynamic_path)
        n = sum(len(t) for t in self.dynamic.values())
        if self.save_dynamic:
            return f"dynamic n-gram cache ({n} n-grams) saved to {where}"
        return f"dynamic n-gram cache read from {where} (save_dynamic: false, not written)"

    def save(self) -> None:
        """Write the dynamic cache to `dynamic_path` (atomically); PluginError naming the file on failure."""
        if self.dynamic_path:
            save_tables(self.dynamic_path, self.dynamic, self.vocab_size, self._fingerprint)

    @hookimpl
    def remove(self, seq_id: int, p0: int) -> None:
        """At a sequence's end (p0 = 0) learn its history into the dynamic cache and save it."""
        st = self._seqs.drop(seq_id, p0)
        if st is None or p0 > 0:
            return  # a rollback: the context is rebuilt from the history on the next draft
        self.learn(st.hist.view())
        if self.save_dynamic and self.dynamic_path:
            try:
                self.save()
            except PluginError as e:
                # Losing one save must not stop speculation: the old file is intact (atomic rename).
                log.warning("%s", e)
