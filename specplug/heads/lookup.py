"""The context's own proposal for a head's next token: a pair lookup.

A head reading row t (the token at position t, predicting the token at t + 1) may also read the token
that followed the last earlier occurrence of the row's last two tokens (tokens[t-1], tokens[t]) in
the sequence so far: what a 2-gram prompt lookup proposes. On text that repeats its context
(a summary's names and figures, code's identifiers, an answer quoting its question) that token is
often the target's next one; a one-layer head cannot find it by itself (it would have to attend by
token identity across positions it only sees through the target's states). Measured with Eagle3
(docs/results/heads.md, issue 39): on a summarization + RAG stream the lookup proposes the target's
next token on 59% of the answer rows, where the head alone picks it on 34% of them.

Both sides compute it the same way: training over whole recorded sequences (`sequence_lookups`,
`batch_lookups`), drafting per row from the sequence's history (`pair_lookup`). `NONE` where the pair
has not occurred before. A head made with `lookup_n` = n > 2 (its config; 2 when absent) reads the
longest match instead: the token after the last earlier occurrence of the longest m-gram ending at
the row, 2 <= m <= n. On MT-bench's answers (SmolLM2-135M) n = 6 proposes the target's token on 44.9%
of the rows and another on 11.6%, where the pair proposes it on 41.6% and another on 14.9%.

A block drafter (DFlash) reads the lookup chained over its block instead (`chain_lookup`,
`anchor_chains`): the proposal for c+1, then for c+2 from the pair (or longest m-gram) that proposal
ends, and so on.

What a head does with it is written once, for every head that reads it (Eagle3, MTP, DFlash):
`specplug.train.lookup.LookupTrain` (the training form, a head module's `lookup`), and here
`LookupReader` (the drafting form, from a head file) and `LookupForward` (a pair head runtime's
`forward` / `forward_pick` that hand it to the step).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from specplug.errors import SpecplugError
from specplug.heads.file import HeadError
from specplug.runtime.linear import rms_norm, take_rows

NONE = -1


class _LastEnds:
    """The one-pass forms' memory: each m-gram seen so far (2 <= m <= n) and the last position it ended at."""

    def __init__(self, n: int):
        self.n = n
        self.last: list[dict[tuple[int, ...], int]] = [{} for _ in range(n + 1)]

    def find(self, tail: Sequence[int]) -> int | None:
        """Where the longest m-gram that `tail` ends with last ended, or None."""
        for m in range(min(self.n, len(tail)), 1, -1):
            j = self.last[m].get(tuple(tail[-m:]))
            if j is not None:
                return j
        return None

    def add(self, seq: Sequence[int], t: int) -> None:
        """The m-grams of `seq` that end at t."""
        for m in range(2, min(self.n, t + 1) + 1):
            self.last[m][tuple(seq[t - m + 1:t + 1])] = t


def _follower(a: np.ndarray, first: np.ndarray, second: np.ndarray, tail: Sequence[int], n: int) -> int:
    """The token of `a` after the last of the longest earlier matches (2..n tokens) of what `tail` ends
    with, among the pairs (first[i], second[i]) = (a[i], a[i + 1]) the search may use, or NONE. Every
    m-gram occurrence (m >= 2) is a pair occurrence, so the pairs' hits are extended backwards."""
    ends = np.flatnonzero((first == tail[-2]) & (second == tail[-1])) + 1
    if not len(ends):
        return NONE
    for k in range(2, min(n, len(tail))):  # keep the hits that match one token further back
        longer = ends[ends >= k]
        longer = longer[a[longer - k] == tail[-1 - k]]
        if not len(longer):
            break
        ends = longer
    return int(a[ends[-1] + 1])


def sequence_lookups(tokens: Sequence[int], n: int = 2) -> list[int]:
    """Per position t of one sequence: the token after the last earlier occurrence of the longest
    m-gram ending at t (2 <= m <= n) that has occurred before (ending at some j < t), or NONE. n = 2 is
    the pair lookup: (tokens[t-1], tokens[t]). One pass, O(len * n)."""
    seen = _LastEnds(n)
    out = [NONE] * len(tokens)
    for t in range(1, len(tokens)):
        j = seen.find(tokens[max(0, t - n + 1):t + 1])
        if j is not None:
            out[t] = tokens[j + 1]
        seen.add(tokens, t)
    return out


def batch_lookups(tokens: torch.Tensor, lengths: Sequence[int], n: int = 2) -> torch.Tensor:
    """[B, T] int64 lookups of a padded batch of sequences (row b's first lengths[b] tokens; NONE after)."""
    out = torch.full(tokens.shape, NONE, dtype=torch.long)
    rows = tokens.tolist()
    for b, length in enumerate(lengths):
        out[b, :length] = torch.tensor(sequence_lookups(rows[b][:length], n), dtype=torch.long)
    return out.to(tokens.device)


def pair_lookup(history: Sequence[int] | np.ndarray, n: int = 2) -> int:
    """The lookup of the last row of `history` (the sequence up to and including the row's token):
    what `sequence_lookups(history, n)[-1]` gives, by a vectorised search (drafting: one row at a time)."""
    a = np.asarray(history)
    t = len(a) - 1
    if t < 2:
        return NONE
    return _follower(a, a[:t - 1], a[1:t], a[max(0, t - n + 1):], n)  # pairs ending at j in [1, t - 1]


def chain_lookup(history: Sequence[int] | np.ndarray, n: int, lookup_n: int = 2) -> list[int]:
    """The lookup chained n tokens past the last row of `history` (a block drafter's proposals for
    positions c+1 .. c+n, c the last row): the first is `pair_lookup(history, lookup_n)`; each next one is
    the lookup of the history extended by the proposals before it, the m-grams (2 <= m <= lookup_n) that
    end there matched among those that end before c (as the first's); NONE from the first break on."""
    a = np.asarray(history)
    t = len(a) - 1
    out = [NONE] * n
    if t < 2:
        return out
    first, second = a[:t - 1], a[1:t]  # pairs (a[j-1], a[j]) for j in [1, t - 1]
    tail = [int(x) for x in a[max(0, t - lookup_n + 1):]]  # the newest tokens, then the proposals
    for i in range(n):
        nxt = _follower(a, first, second, tail, lookup_n)
        if nxt == NONE:
            break
        tail.append(nxt)
        out[i] = nxt
    return out


def anchor_chains(tokens: torch.Tensor, lengths: Sequence[int], anchors: torch.Tensor, n: int,
                  lookup_n: int = 2) -> torch.Tensor:
    """[B, K, n] `chain_lookup(sequence[:c + 1], n, lookup_n)` for every anchor c of anchors [B, K] (a
    trainer's blocks), in one pass per sequence."""
    rows, where = tokens.tolist(), anchors.tolist()
    out = torch.full((*anchors.shape, n), NONE, dtype=torch.long)
    for b, length in enumerate(lengths):
        seq = rows[b][:length]
        at: dict[int, list[int]] = {}
        for k, c in enumerate(where[b]):
            if 0 <= c < length:
                at.setdefault(c, []).append(k)
        seen = _LastEnds(lookup_n)  # m-grams ending before t
        for t in range(1, length):
            for k in at.get(t, ()):
                tail = seq[max(0, t - lookup_n + 1):t + 1]
                for i in range(n):
                    j = seen.find(tail)
                    if j is None:
                        break
                    tail.append(seq[j + 1])
                    out[b, k, i] = seq[j + 1]
            seen.add(seq, t)
    return out.to(tokens.device)


# --- what a head adds from its lookup (written once for every head that reads it: Eagle3, MTP, DFlash) ----
#
#     h      = h + lookup.proj(lookup.norm(embed(L)))           before the head's layer, at every draft step
#     logits[row of L] += lookup.gate . out + lookup.gate_bias   a learned trust in the proposal
#
# `lookup.proj` [d, d], `lookup.norm` [d], `lookup.gate` [1, d], `lookup.gate_bias` [1], float32 in the
# head file; zero (the norm: one) when a head without them is fine-tuned into one, so it starts as that head.

LOOKUP_NAMES = ("lookup.proj", "lookup.norm", "lookup.gate", "lookup.gate_bias")
MAX_LOOKUP_N = 16
LOOKUP_CONFIG_KEYS = ("lookup", "lookup_n")  # head config keys that heads written before them lack (off / 2)


def _lookup_n_problem(n) -> str | None:
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= MAX_LOOKUP_N:
        return f"lookup_n must be an integer in [2, {MAX_LOOKUP_N}], got {n!r}"
    return None


def check_lookup_options(method: str, lookup: bool, n: int) -> None:
    """A trainer's `lookup` / `lookup_n` options: one error naming what to fix."""
    problem = _lookup_n_problem(n)
    if problem:
        raise SpecplugError(f"{method} options: {problem}")
    if n != 2 and not lookup:
        raise SpecplugError(f"{method} options: lookup_n {n} needs --lookup true "
                            "(a head without the lookup reads none)")


def lookup_n_of(head) -> int:
    """The longest m-gram a head file's lookup matches (its config's `lookup_n`; 2, the pair, when absent);
    a HeadError naming the file when the value cannot be."""
    n = head.meta.config.get("lookup_n", 2)
    problem = _lookup_n_problem(n)
    if problem:
        raise HeadError(f"{head.path}: {problem}")
    return n


def lookup_defaults(head) -> dict:
    """A trainer's `defaults_of_head` for the lookup (specplug.train.finetune): the `lookup_n` of a head
    that reads the lookup, so a fine-tune or `heads eval` reads it as it was made."""
    return {"lookup_n": lookup_n_of(head)} if head.meta.config.get("lookup") else {}


def lookup_draft_rows(lookup: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Each lookup's draft row (t2d: target id -> draft row, -1 outside the draft vocabulary); -1 where
    there is no lookup or its token is outside the draft vocabulary."""
    return torch.where(lookup >= 0, t2d[lookup.clamp(min=0)], NONE)


def training_lookups(tokens: torch.Tensor, valid: torch.Tensor, t2d: torch.Tensor,
                     n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """A trainer's batch: each row's lookup [B, T] (target ids; n: the longest m-gram matched) and its
    draft row (-1: none or outside the draft vocabulary); valid [B, T] bool marks each sequence's tokens."""
    look = batch_lookups(tokens, valid.sum(1).tolist(), n)
    return look, lookup_draft_rows(look, t2d)


class LookupReader:
    """The drafting form: reads the lookup's tensors from a head file (kept on the host) and gives, per
    draft step, what the step adds (`parts`) for the torch forms; a native step is given them once
    (`PairStep.read_lookup`) and computes the same in its call."""

    KEEP = 4096  # token rows kept (a token's projection is fixed); a native step keeps as many

    def __init__(self, head, embed, d2t: torch.Tensor, vocab_size: int, eps: float):
        d = int(head.meta.config["n_embd"])
        shapes = {"lookup.proj": (d, d), "lookup.norm": (d,), "lookup.gate": (1, d), "lookup.gate_bias": (1,)}
        t = {k.split(".")[1]: head.tensor(k, sh).float() for k, sh in shapes.items()}
        self.d, self.eps, self.embed = d, eps, embed
        self.n = lookup_n_of(head)  # the longest m-gram matched (2: the pair)
        self.proj, self.norm = t["proj"], t["norm"]
        self.gate = (t["gate"].flatten().contiguous(), float(t["gate_bias"][0]))
        # target id -> draft row as the trainer's `specplug.train.distill.invert` maps it (not imported:
        # drafting would then import the training data code, a circle through specplug.heads)
        t2d = torch.full((vocab_size,), NONE, dtype=torch.long)
        t2d[d2t.long()] = torch.arange(len(d2t))
        self.t2d = t2d.tolist()  # a few ids a step: a list beats tensors
        self._rows: dict[int, torch.Tensor] = {}
        self._zero = torch.zeros(d)

    def parts(self, lookup: Sequence[int], logits_rows: Sequence[int]) -> tuple[torch.Tensor | None, tuple | None]:
        """(what each row's lookup adds to its state [n, d], zero where none; the boost of the asked rows:
        (their lookup's draft row [len(logits_rows)], -1: none; gate [d]; bias)).
        (None, None) where no row has a lookup: the step is then the head's step without one."""
        if all(tok < 0 for tok in lookup):
            return None, None
        add = torch.stack([self._row(int(tok)) if tok >= 0 else self._zero for tok in lookup])
        rows = torch.tensor([self.t2d[lookup[i]] if lookup[i] >= 0 else NONE for i in logits_rows], dtype=torch.long)
        return add, (rows, *self.gate)

    def _row(self, tok: int) -> torch.Tensor:
        row = self._rows.get(tok)
        if row is None:
            if len(self._rows) >= self.KEEP:
                self._rows.clear()
            e = rms_norm(self.embed[torch.tensor([tok])].float().cpu(), self.norm, self.eps)[0]
            row = self._rows[tok] = torch.mv(self.proj, e)
        return row

    @staticmethod
    def boost_logits(logits: torch.Tensor, asked: torch.Tensor, boost: tuple) -> None:
        """The boost on logits computed without the native step (in place): asked [m, d] the states of
        the rows the logits are of."""
        rows, gate, bias = boost
        has = torch.nonzero(rows >= 0).flatten()
        sel = asked[has.to(asked.device)].float()
        logits[has, rows[has].to(logits.device)] += (sel @ gate.to(sel.device) + bias).to(logits.dtype)


class LookupForward:
    """`forward` / `forward_pick` of a pair head's runtime that may read the lookup (mixed into it).

    The runtime sets `native_step`, then `read_lookup(LookupReader(...))` for a head that reads one, and
    implements `_forward(h, token_ids, positions, seq_ids, logits_rows, raw)` (its step without the
    lookup) and `_states(h, raw)` (h on its backend, transformed first when raw)."""

    look: LookupReader | None = None  # the head's lookup parts; None: it reads no lookup

    @property
    def reads_lookup(self) -> bool:
        """ChainDrafter passes each row's pair lookup (`lookup=`) when set."""
        return self.look is not None

    @property
    def lookup_n(self) -> int:
        """The longest m-gram the head's lookup matches (`pair_lookup(history, lookup_n)`)."""
        return self.look.n if self.look is not None else 2

    def read_lookup(self, look: LookupReader) -> None:
        """Set the head's lookup parts (`look`), also in its native step where it has one."""
        self.look = look
        if self.native_step is not None:
            self.native_step.read_lookup(look)

    @torch.inference_mode()
    def forward(self, h_prev: torch.Tensor, token_ids: Sequence[int], positions: Sequence[int],
                seq_ids: Sequence[int], logits_rows: Sequence[int], raw: bool = False,
                lookup: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows (h(t-1), x_t, t, seq) -> (output states [n, d], logits over the draft vocabulary for
        `logits_rows`); `lookup`: each row's pair lookup (target ids, -1: none), for a head that reads it."""
        if lookup is None or self.look is None:
            return self._forward(h_prev, token_ids, positions, seq_ids, logits_rows, raw)
        if self.native_step is not None:  # the lookup's parts are computed in the same call
            out, _, _, logits = self.native_step(h_prev, token_ids, positions, seq_ids, logits_rows, want_logits=True,
                                                 raw=raw, lookup=lookup)
            return out, logits
        add, boost = self.look.parts(lookup, logits_rows)
        if add is None:  # no row has one
            return self._forward(h_prev, token_ids, positions, seq_ids, logits_rows, raw)
        h = self._states(h_prev, raw)
        out, logits = self._forward((h + add.to(h.device, h.dtype)).contiguous(), token_ids, positions, seq_ids,
                                    logits_rows)
        if logits is not None:
            LookupReader.boost_logits(logits, take_rows(out, logits_rows), boost)
        return out, logits

    def forward_pick(self, h_prev: torch.Tensor, token_ids: Sequence[int], positions: Sequence[int],
                     seq_ids: Sequence[int], logits_rows: Sequence[int], raw: bool = False,
                     lookup: Sequence[int] | None = None) -> tuple[torch.Tensor, list[int], list[float]]:
        """`forward` with the greedy pick of `logits_rows` made in the same native call: (states, target
        ids, their probabilities). Only where `native_step` is set; the lookup's addition and gate go
        into the same call."""
        out, ids, probs, _ = self.native_step(h_prev, token_ids, positions, seq_ids, logits_rows, raw=raw,
                                              lookup=lookup if self.look is not None else None)
        return out, ids, probs
