"""`suffix`: suffix decoding (arXiv 2411.04975), as vLLM's `method: suffix` / Arctic Inference's
SuffixDecodingCache, written in Python.

Two kinds of bounded-depth suffix tree with counts (`_suffix_tree`):
- per request: the prompt and the answer so far, built incrementally (O(new tokens x depth) a
  step), dropped when the sequence ends (`remove(seq_id, 0)`);
- global: the outputs (generated tokens) of finished requests, shared by every sequence of this
  speculator instance (an engine holds one, so `run`, `bench` and `serve` share it across
  requests); the oldest output is evicted beyond `max_cached_requests` outputs or
  `max_cached_tokens` tokens; optionally loaded from and saved to `dynamic_path`.

A draft: for each suffix of the history (up to max_tree_depth - 1 tokens) that a tree holds with a
continuation, follow the most frequent child while the cumulative probability (child count /
parent count, multiplied along the path) stays >= min_token_prob (and the host's break_even),
for at most min(n_max, max_spec_tokens, max_spec_factor x match length + max_spec_offset) tokens.
The score of a path is the sum of its cumulative probabilities (its expected accepted tokens); the
best path of the per-request tree is kept unless the global tree's scores higher (as Arctic). Each
token's confidence is its conditional probability child count / parent count.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specplug.errors import ConfigError, PluginError
from specplug.hooks import hookimpl
from specplug.types import Batch, Draft, DraftRequest, TargetInfo
from specplug_ngram._common import check_int, check_number
from specplug_ngram._suffix_tree import GlobalTree, SuffixTree
from specplug_ngram.cache_file import vocab_fingerprint
from specplug_ngram.suffix_file import load_outputs, save_outputs

NAME = "suffix"

log = logging.getLogger(__name__)


class _Seq:
    """One sequence: the tokens it has put in (`toks`), its per-request tree and frontier, where it
    stands in the global tree (`gfront`, found at global `gver` after `gpos` tokens), and how many of
    its tokens are prompt (None until known)."""

    __slots__ = ("toks", "tree", "front", "gfront", "gver", "gpos", "prompt_len")

    def __init__(self, depth: int, use_request: bool):
        self.toks: list[int] = []
        self.tree = SuffixTree(depth) if use_request else None
        self.front: list[int] = []
        self.gfront: list[int] = []
        self.gver = -1
        self.gpos = 0
        self.prompt_len: int | None = None


def _ints(part) -> list[int]:
    # the history may be a list, the host's read-only view (slices are lists), a tuple or a tensor
    return part.tolist() if hasattr(part, "tolist") else [int(t) for t in part]


class Suffix:
    """Suffix-decoding speculator: greedy paths in a per-request and a global suffix tree."""

    @dataclass
    class Params:
        max_tree_depth: int = 24  # longest substring kept; bounds match length + draft length (vLLM: 24)
        max_cached_requests: int = 10000  # outputs in the global tree, oldest evicted first (0: none)
        max_cached_tokens: int = 100_000  # tokens in the global tree (memory: <= this x max_tree_depth nodes)
        max_spec_tokens: int | None = None  # longest draft; null: the host's n_max
        max_spec_factor: float = 1.0  # a draft is at most max_spec_factor x match length + max_spec_offset
        max_spec_offset: float = 0.0
        min_token_prob: float = 0.1  # stop where the path's cumulative probability falls below this
        use_global: bool = True  # draft from the outputs of finished requests
        use_request: bool = True  # draft from the request's own prompt and answer
        dynamic_path: str | None = None  # global tree file: loaded at start if present, saved at each sequence end
        save_dynamic: bool = True  # write dynamic_path when a sequence ends

    def __init__(self, params: "Suffix.Params", target: TargetInfo):
        self.depth = check_int(NAME, params, "max_tree_depth", 2)
        max_requests = check_int(NAME, params, "max_cached_requests", 0)
        max_tokens = check_int(NAME, params, "max_cached_tokens", 1)
        self.max_spec_tokens = None if params.max_spec_tokens is None else check_int(NAME, params, "max_spec_tokens", 1)
        self.factor = _finite(params, "max_spec_factor", 0.0)
        self.offset = _finite(params, "max_spec_offset", -float(self.depth), float(self.depth))
        self.min_token_prob = _finite(params, "min_token_prob", 0.0, 1.0)
        for key in ("use_global", "use_request", "save_dynamic"):
            if not isinstance(getattr(params, key), bool):
                raise ConfigError(f"{NAME}: {key} must be true or false, got {getattr(params, key)!r}")
        if not (params.use_global or params.use_request):
            raise ConfigError(f"{NAME}: use_global and use_request are both false: nothing to draft from")
        self.use_request, self.save_dynamic = params.use_request, params.save_dynamic
        self.use_global = params.use_global and max_requests > 0
        self.dynamic_path = _check_path(params, "dynamic_path")
        self.vocab_size = target.vocab_size
        self._fingerprint = vocab_fingerprint(target.token_texts) if self.dynamic_path else b""
        self.glob = GlobalTree(self.depth, max_requests, max_tokens)
        if self.use_global and self.dynamic_path and Path(self.dynamic_path).exists():
            outputs = load_outputs(self.dynamic_path, self.vocab_size, self._fingerprint)
            for out in outputs[-max_requests:]:
                self.glob.add(out)
        self._seqs: dict[int, _Seq] = {}

    @hookimpl
    def are_compatible(self, target: TargetInfo) -> str | None:
        """Token-only; a global tree file is checked against the target's vocabulary when loaded."""
        return None

    # --- keeping each sequence's tokens and trees ---------------------------------------------

    def _new(self, seq_id: int) -> _Seq:
        st = self._seqs[seq_id] = _Seq(self.depth, self.use_request)
        return st

    def _append(self, st: _Seq, tokens: list[int]) -> None:
        st.toks += tokens
        if st.tree is not None:
            st.front = st.tree.extend(st.front, tokens)

    def _truncate(self, st: _Seq, p0: int) -> None:
        """Forget positions >= p0: their substrings leave the per-request tree."""
        if st.tree is not None:
            if len(st.toks) - p0 > p0:  # most of it goes: building the rest again is cheaper
                st.tree = SuffixTree(self.depth)
                st.front = st.tree.extend([], st.toks[:p0])
            else:
                st.tree.unwind(st.toks, p0)
                st.front = st.tree.frontier(st.toks[:p0])
        del st.toks[p0:]
        st.gver = -1  # the global frontier is found again at the next draft
        if st.prompt_len is not None and st.prompt_len > p0:
            st.prompt_len = p0

    def _feed(self, seq_id: int, p: int, run: list[int], is_prompt: bool) -> None:
        """Committed rows `run` of `seq_id`, from position p on."""
        st = self._seqs.get(seq_id)
        if st is None or (is_prompt and p == 0):
            st = self._new(seq_id)
        n = len(st.toks)
        if p > n:
            return  # rows after a gap (a sequence begun before we came in): drafts catch up from the history
        if p < n:  # the rows start inside what we hold (the history's last token, put in by `draft`)
            overlap = min(n - p, len(run))
            held = st.toks[p:p + overlap]
            if held != run[:overlap]:  # they differ: what we held from there on is stale
                same = next(i for i, (a, b) in enumerate(zip(held, run)) if a != b)
                self._truncate(st, p + same)
                run, p = run[same:], p + same
            else:
                run, p = run[overlap:], p + overlap
        if run:
            self._append(st, run)
        if is_prompt:
            st.prompt_len = max(st.prompt_len or 0, p + len(run))

    @hookimpl
    def process_batch(self, batch: Batch, encoded) -> None:
        """Put the committed rows of each sequence into its tokens and per-request tree (prompt rows
        also mark where its output begins)."""
        toks, seqs, pos = batch.token_ids.tolist(), batch.seq_ids.tolist(), batch.positions.tolist()
        i, n = 0, len(toks)
        while i < n:
            s, j = seqs[i], i + 1
            while j < n and seqs[j] == s and pos[j] == pos[j - 1] + 1:
                j += 1
            self._feed(s, pos[i], toks[i:j], batch.is_prompt)
            i = j

    def _sync(self, req: DraftRequest) -> _Seq:
        """The sequence's state with every token of its history put in."""
        tokens = req.tokens
        size = len(tokens)
        st = self._seqs.get(req.seq_id)
        if st is None:
            st = self._new(req.seq_id)
        n = len(st.toks)
        if n:
            last = min(n, size) - 1
            # O(1): does the history continue what we hold (a reused seq id without remove would not)
            if not all(int(tokens[i]) == st.toks[i] for i in (last, 0, last // 2)):
                st, n = self._new(req.seq_id), 0
            elif size < n:
                self._truncate(st, size)
                n = size
        if size > n:
            self._append(st, _ints(tokens[n:size]))
        if st.prompt_len is None:  # no prompt rows seen: the first draft follows the prompt's first token
            st.prompt_len = max(0, size - 1)
        return st

    # --- drafting -----------------------------------------------------------------------------

    def _draft_one(self, req: DraftRequest) -> Draft | None:
        st = self._sync(req)
        limit = req.n_max if self.max_spec_tokens is None else min(req.n_max, self.max_spec_tokens)
        if limit <= 0:
            return None
        mtp, be = self.min_token_prob, req.break_even
        floor = [max(mtp, b) for b in be[:limit]] + [mtp] * (limit - len(be)) if be else [mtp] * limit
        best, found = 0.0, None
        if st.tree is not None:
            best, found = st.tree.propose(st.front, limit, self.factor, self.offset, floor, best)
        g = self.glob
        if self.use_global and g.tree.n_nodes:
            keep = self.depth - 1
            if st.gver != g.version or len(st.toks) - st.gpos >= keep:
                st.gfront = g.tree.frontier(st.toks)
            elif len(st.toks) > st.gpos:
                st.gfront = g.tree.follow(st.gfront, st.toks[st.gpos:])
            st.gver, st.gpos = g.version, len(st.toks)
            _, from_global = g.tree.propose(st.gfront, limit, self.factor, self.offset, floor, best)
            found = from_global or found
        if found is None:
            return None
        ids, probs = found
        return Draft(token_ids=tuple(ids), confidence=tuple(probs))

    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]) -> Sequence[Draft | None] | None:
        """One proposal per request: the best-scoring greedy path of the per-request or global tree."""
        return [self._draft_one(r) for r in requests]

    # --- sequence end and the global tree -------------------------------------------------------

    @hookimpl
    def remove(self, seq_id: int, p0: int) -> None:
        """Positions >= p0 leave the sequence's tree; at its end (p0 = 0) its output (the tokens after
        the prompt) goes into the global tree, which is saved to dynamic_path."""
        st = self._seqs.get(seq_id)
        if st is None:
            return
        if p0 > 0:
            if p0 < len(st.toks):
                self._truncate(st, p0)
            return
        del self._seqs[seq_id]
        if not self.use_global or st.prompt_len is None or len(st.toks) <= st.prompt_len:
            return
        self.glob.add(st.toks[st.prompt_len:])
        if self.save_dynamic and self.dynamic_path:
            try:
                self.save()
            except PluginError as e:
                # Losing one save must not stop speculation: the old file is intact (atomic rename).
                log.warning("%s", e)

    def save(self) -> None:
        """Write the global tree's outputs to `dynamic_path` (atomically); PluginError naming the file on failure."""
        if self.dynamic_path:
            save_outputs(self.dynamic_path, self.glob.outputs, self.vocab_size, self._fingerprint)

    def summary(self) -> str | None:
        """The run summary's line: the global tree's size, and where it was saved (not a hook)."""
        if not self.use_global:
            return None
        g = self.glob
        line = f"global suffix tree: {len(g.outputs)} outputs, {g.n_tokens} tokens, {g.tree.n_nodes} nodes"
        if not self.dynamic_path:
            return line
        where = os.path.abspath(self.dynamic_path)
        if self.save_dynamic:
            return f"{line}, saved to {where}"
        return f"{line}, read from {where} (save_dynamic: false, not written)"


def _finite(params: object, name: str, minimum: float, maximum: float | None = None) -> float:
    value = check_number(NAME, params, name, minimum, maximum)
    if not math.isfinite(value):
        raise ConfigError(f"{NAME}: {name} must be a finite number, got {value}")
    return value


def _check_path(params: object, name: str) -> str | None:
    value = getattr(params, name)
    if value is None or isinstance(value, (str, os.PathLike)):
        return None if value in (None, "") else os.path.expanduser(os.fspath(value))
    raise ConfigError(f"{NAME}: {name} must be a file path or null, got {value!r}")
