"""The drafting policy: which speculator is asked to draft for which sequence, what a draft is
worth, and which draft is verified.

Everything is priced in one unit: the time of a one-row target forward, T(1). An accepted draft
token saves a sequence's share of a step, T(B)/B for B sequences; a draft token costs its extra
verification row, T(R+1) - T(R) on the run's curve (`cost`: specplug.pricing), plus what the speculator
took to draft it, measured online (seconds of its `draft` hook per drafted token, divided by the
measured seconds of T(1)). That drafting cost is measured on calls for sequences it was also asked
for the step before (steady drafting). A call that resumes a sequence (its first, or the first
after a pause) also pays for catching up with the rows it missed (a head reads them, a draft model
prefills them): that is the price of the pause and of the probe, not of a drafted token, so it
counts in the call's realized value and in how far apart probes come, not in the break-even.
(Charged to the drafted tokens, it would make a head that pays when drafting steadily look too dear
to draft at all: docs/results/heads.md.) From these:

- every `DraftRequest` carries `break_even[i]`, the probability that tokens 0..i are all accepted
  below which token i would not be verified; a drafter stops before computing such a token, and
  the host does not call `draft` at all where even a certain first token could not pay;
- drafts with confidences are trimmed to the prefix with the most expected tokens less rows
  (drafts without confidences are valued with the speculator's measured acceptance per position);
- per sequence, the realized value of each call (tokens saved less rows and drafting time) is
  averaged; a speculator whose calls lose time for a sequence beyond their noise (`note_value`) is
  not asked for it, except by sparse probes (4, 8, ... 64 steps apart) that switch it back on when
  they pay; probes are never so close that they cost more than PROBE_SHARE (1%) of the steps
  between them (a probe costing 5 steps, a draft model's, comes at most every 500 steps). While
  its calls lose on average over all sequences, a new sequence starts paused, for what was left of
  the pause of the last sequence to end: a speculator that does not pay here is not asked at every
  sequence's first step, and a pause longer than a sequence runs on across sequences to its probe.
  (Were each new sequence to start the whole pause again, then once the pause outgrew the answers,
  64 steps for 64-token answers or a costly probe's 130 for 128-token ones, the speculator would never
  be asked again, even where it would pay: docs/results/heads.md.)
Speculators with `cost_trim: false` are asked on every step and their drafts verified whole.

The times that price a speculator are robust to one slow call: a speculator's first `draft` call in
an engine is its set-up (lazy allocation, a first kernel build) and is not counted, and a later call
counts at most TIME_CLIP times the median of its kind's recent calls (steady or resuming, per
request). Counted whole, one such call (a collection pause, a neighbour's burst) made a speculator
so dear that its probes came hundreds of steps apart, and it was not asked again for the rest of
a run (Eagle3 after a 13-22 ms first call, a cascade's ngram-simple after one slow step:
docs/results/ngram.md). A speculator that is slow on every call is still priced out after its
second call: the median follows it.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from specplug.contract import check_drafts
from specplug.kv_view import KVViews
from specplug.metrics import SpecStats
from specplug.plugins import HookCaller
from specplug.types import NO_KV, Draft, DraftRequest, EmbeddingRequest, Verified

PROBE_MIN, PROBE_MAX = 4, 64  # steps between probes of a speculator that does not pay for a sequence
PROBE_SHARE = 0.01  # ... and at least a probe's own cost (T(1) units) / PROBE_SHARE steps
VALUE_MARGIN = 0.02  # a speculator is paused for a sequence when its calls lose more than this (units of T(1))
SEQ_WINDOW = 20  # calls a sequence's average looks back over (weight max(1/n, 1/SEQ_WINDOW) for its n-th call)
SPEC_ALPHA = 0.05  # weight of a new call in the speculator's average and spread over all sequences
PAUSE_Z = 1.5  # ... and a sequence pauses only when its average is below -VALUE_MARGIN by PAUSE_Z standard errors
TIME_CLIP = 4.0  # a draft call counts at most this times the median of the recent calls of its kind ...
TIME_WINDOW = 15  # ... (the last TIME_WINDOW, once TIME_MIN_CALLS are known)
TIME_MIN_CALLS = 3


@dataclass(frozen=True)
class DraftPolicy:
    """Host-side limits on one speculator's drafts (YAML keys next to `type`)."""

    n_max: int = 16  # longest draft verified
    n_min: int = 1  # shorter drafts are not worth a verification row
    p_min: float = 0.0  # cut a draft at its first token whose draft probability is below this
    backoff: int = 6  # consecutive fully rejected drafts before a sequence pauses this speculator
    # price drafts (rows and drafting time) and draft only where it pays; false: verify every draft whole
    cost_trim: bool = True


@dataclass
class SeqDraftState:
    """One speculator's drafting state for one sequence."""

    n_cur: int  # current cap on its draft length (grows after full acceptance, shrinks after a rejection)
    dead: int = 0  # consecutive drafts with no token accepted
    skip: int = 0  # steps left before this sequence asks the speculator again
    value: float | None = None  # average value of its calls (T(1) units); None: not asked yet
    calls: int = 0  # calls averaged into `value`
    probe: int = PROBE_MIN  # steps between probes while the value is negative
    asked_at: int = -2  # the host's step number when this speculator was last asked for this sequence


@dataclass
class Speculator:
    """A configured speculator instance as the engine drives it."""

    name: str
    caller: HookCaller
    policy: DraftPolicy = field(default_factory=DraftPolicy)
    embeddings: EmbeddingRequest = field(default_factory=EmbeddingRequest)
    enabled: bool = True
    stats: SpecStats = field(default_factory=SpecStats)
    value: float = 0.0  # average value of one call over all sequences (a new sequence starts paused below 0)
    spread: float = 0.0  # average squared deviation of a call's value from `value`
    probe: int = PROBE_MIN  # pause of a new sequence while `value` is negative: that of the last one to end
    wait: int | None = None  # steps of that pause left when it ended (None: none ended paused yet)
    _draft_s: float = 0.0  # decayed sums: seconds of `draft` and tokens it returned, steady calls
    _draft_tokens: float = 0.0
    _all_s: float = 0.0  # the same over every call (the drafting cost until a steady call is measured)
    _all_tokens: float = 0.0
    _resume_s: float = 0.0  # decayed sums: seconds and requests of calls that resumed a sequence
    _resume_reqs: float = 0.0
    _timed: bool = False  # a `draft` call was seen (the first is set-up and not counted)
    _recent: tuple[deque, deque] = field(  # seconds per request of recent steady calls, resuming calls
        default_factory=lambda: (deque(maxlen=TIME_WINDOW), deque(maxlen=TIME_WINDOW)))
    _seq: dict[int, SeqDraftState] = field(default_factory=dict)

    @property
    def acceptance(self) -> float:
        """Per-token acceptance estimate with a weak prior (so a new speculator gets tried)."""
        return (self.stats.accepted_tokens + 1) / (self.stats.drafted_tokens + 2)

    def position_acceptance(self, n: int) -> tuple[float, ...]:
        """Measured acceptance of draft tokens 0..n-1, each given the ones before it were accepted,
        with a weak prior of 1/2 (so positions not yet tried get tried)."""
        st = self.stats
        return tuple((st.accepted_at[i] + 1) / (st.reached_at[i] + 2) if i < len(st.reached_at) else 0.5
                     for i in range(n))

    def state(self, seq: int) -> SeqDraftState:
        st = self._seq.get(seq)
        if st is None:
            st = self._seq[seq] = SeqDraftState(self.policy.n_max)
            if self.policy.cost_trim and self.value < -VALUE_MARGIN:
                # calls have been losing time over the sequences before: this one goes on with the
                # pause the last one to end was in (its first probe comes when that pause is over)
                st.probe = self.probe
                st.skip = self.probe if self.wait is None else self.wait
        return st

    def forget(self, seq: int) -> None:
        """A sequence ended: the next one starts from its pause (what is left of it) and probe interval."""
        st = self._seq.pop(seq, None)
        if st is None:
            return
        if st.value is not None:
            self.probe = st.probe if st.value < -VALUE_MARGIN else PROBE_MIN
        self.wait = st.skip

    def draft_cost(self, t_row: float) -> float:
        """Measured drafting time per drafted token while drafting steadily, in units of a one-row
        target forward (over every call until a steady one is measured; 0 until any is)."""
        s, n = (self._draft_s, self._draft_tokens) if self._draft_tokens > 0 else (self._all_s, self._all_tokens)
        if t_row <= 0 or n <= 0:
            return 0.0
        return s / n / t_row

    def probe_cost(self, t_row: float) -> float:
        """Measured time of a call per sequence it resumed (catching up included), T(1) units;
        the drafting cost of one token until such a call is measured."""
        if t_row <= 0 or self._resume_reqs <= 0:
            return self.draft_cost(t_row)
        return self._resume_s / self._resume_reqs / t_row

    def counted_seconds(self, seconds: float, n_requests: int, resumed: int = 0) -> float | None:
        """What a `draft` call that took `seconds` for `n_requests` sequences counts in the pricing:
        None for the speculator's first call (set-up), else at most TIME_CLIP times the median per
        request of the recent calls of its kind (steady; resuming when `resumed`) times `n_requests`."""
        if not self._timed:
            self._timed = True
            return None
        recent = self._recent[1 if resumed else 0]
        per = seconds / max(1, n_requests)
        counted = min(per, TIME_CLIP * statistics.median(recent)) if len(recent) >= TIME_MIN_CALLS else per
        recent.append(per)
        return counted * max(1, n_requests)

    def note_draft_time(self, seconds: float, n_tokens: int, resumed: int = 0, n_requests: int = 1) -> None:
        """A `draft` call took `seconds` and returned `n_tokens`; `resumed` of its `n_requests`
        sequences were not asked the step before (the call then also caught up for them)."""
        # decayed sums: recent calls count most, and a call that drafted nothing still costs its time
        self._all_s = 0.9 * self._all_s + seconds
        self._all_tokens = 0.9 * self._all_tokens + n_tokens
        if resumed:
            self._resume_s = 0.9 * self._resume_s + seconds
            self._resume_reqs = 0.9 * self._resume_reqs + n_requests
        else:
            self._draft_s = 0.9 * self._draft_s + seconds
            self._draft_tokens = 0.9 * self._draft_tokens + n_tokens

    def note_value(self, st: SeqDraftState, value: float, call_cost: float = 0.0) -> None:
        """Average in what one call was worth for a sequence (`call_cost`: what the call took, T(1)
        units); pause or resume the speculator for it.

        A call's value is noisy: a head's one-token draft is worth about +0.7 of a step when accepted
        and -0.3 when not. A sequence is paused only when its calls lose beyond that noise: when its
        average plus PAUSE_Z standard errors (the spread measured over all calls, over the calls
        averaged) is still below -VALUE_MARGIN. A head that pays on average is not paused by a few
        rejections in a row; a drafter whose every call loses the same is paused at its first."""
        st.calls += 1
        w = max(1.0 / st.calls, 1.0 / SEQ_WINDOW)
        st.value = value if st.value is None else st.value + w * (value - st.value)
        d = value - self.value
        self.value += SPEC_ALPHA * d
        self.spread = (1 - SPEC_ALPHA) * (self.spread + SPEC_ALPHA * d * d)
        if not self.policy.cost_trim:
            return
        if st.value + PAUSE_Z * math.sqrt(self.spread / min(st.calls, SEQ_WINDOW)) < -VALUE_MARGIN:
            pause(st, call_cost)
        else:
            st.probe = PROBE_MIN


def pause(st: SeqDraftState, call_cost: float) -> None:
    """Pause a sequence after a call that did not pay: for `st.probe` steps, the next pause twice
    that (at most PROBE_MAX), and never fewer steps than make a call of `call_cost` (T(1) units)
    PROBE_SHARE of them."""
    floor = min(math.ceil(call_cost / PROBE_SHARE), 1 << 20)
    st.skip = max(st.skip, st.probe, floor)
    st.probe = max(min(2 * st.probe, PROBE_MAX), floor)


@dataclass(frozen=True)
class Proposal:
    """The draft chosen for a sequence in a step, and the speculator that drafted it."""

    spec: Speculator
    draft: Draft


class History(SequenceABC):
    """A read-only view of a sequence's tokens for plugins (no copy per step; slices are copies)."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: list[int]):
        self._tokens = tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, i):
        return self._tokens[i]  # an int, or for a slice a new list

    def __iter__(self) -> Iterator[int]:
        return iter(self._tokens)

    def __repr__(self) -> str:
        return f"History({self._tokens!r})"


@dataclass
class _Asked:
    """One speculator's call in this step."""

    spec: Speculator
    proposed: dict[int, Draft | None]  # slot -> what it returned (before the host cut it)
    share: float  # its drafting time per sequence asked (T(1) units)


class Drafting:
    """Asks the speculators for drafts each step and prices them (see the module docstring).

    `call(spec, hook, **kw)` runs a hook guarded (None when it raised: the speculator is then
    disabled); `disable(spec, why)` turns a speculator off for the run; `before_draft(spec)` runs
    before each `draft` call. `cascade`: the speculators are asked in order, each only for the
    sequences that no speculator before it has a draft worth verifying for (YAML `chain: cascade`);
    else every one is asked and the draft worth most wins.
    """

    def __init__(self, specs: Sequence[Speculator], cost: Callable[[int], float],
                 call: Callable[..., Any], disable: Callable[[Speculator, str], None], vocab: int, max_ctx: int,
                 before_draft: Callable[[Speculator], None] = lambda spec: None, cascade: bool = False,
                 kv_views: KVViews | None = None):
        self.specs, self.cost, self.call, self.disable = list(specs), cost, call, disable
        self.kv_views = kv_views  # DraftRequest.kv for speculators that read the target's KV cache
        self.cascade = cascade
        self.before_draft = before_draft  # brings a speculator's context up to date (rows held back while paused)
        self.vocab, self.max_ctx = vocab, max_ctx
        self.t_row = 0.0  # measured seconds of a one-row target forward
        self._asked: list[_Asked] = []
        self._step = 0  # calls of `propose`: a sequence asked at steps n - 1 and n drafts steadily

    def note_forward(self, seconds: float, rows: int) -> None:
        """A verification forward of `rows` rows took `seconds`: the scale of the cost curve."""
        t = seconds / self.cost(rows)
        self.t_row = t if self.t_row <= 0 else 0.9 * self.t_row + 0.1 * t

    def break_even(self, spec: Speculator, n_seqs: int, n: int) -> tuple[float, ...]:
        """P(tokens 0..i all accepted) below which draft token i does not pay, i < n (>= 1: never)."""
        cost, c = self.cost, spec.draft_cost(self.t_row)
        worth = cost(n_seqs) / n_seqs
        return tuple((cost(n_seqs + i + 1) - cost(n_seqs + i) + c) / worth for i in range(n))

    def propose(self, seqs: Sequence[Any]) -> dict[int, Proposal]:
        """Ask every speculator (in a cascade: only for the sequences still without a draft); keep per
        sequence (slot) the draft with most expected accepted tokens."""
        chosen: dict[int, Proposal] = {}
        score: dict[int, float] = {}  # slot -> the value of its chosen draft (_value)
        self._asked = []
        self._step += 1
        for spec in self.specs:
            if not spec.enabled or not spec.caller.implements("draft"):
                continue
            ask = [q for q in seqs if q.slot not in chosen] if self.cascade else seqs
            reqs, resumed = self._requests(spec, ask, len(seqs))
            if not reqs:
                continue
            self.before_draft(spec)
            t0 = time.perf_counter()
            res = self.call(spec, "draft", requests=reqs)
            seconds = time.perf_counter() - t0
            spec.stats.draft_calls += 1
            spec.stats.draft_s += seconds
            spec.stats.asked += len(reqs)
            counted = spec.counted_seconds(seconds, len(reqs), resumed)  # None: the set-up call
            share = (counted or 0.0) / self.t_row / len(reqs) if self.t_row > 0 else 0.0
            if res is None:
                if spec.enabled:  # no drafts at all this step: the call cost its time all the same
                    if counted is not None:
                        spec.note_draft_time(counted, 0, resumed, len(reqs))
                    for r in reqs:
                        spec.note_value(spec.state(r.seq_id), -share, share)
                continue
            try:
                problem = check_drafts(res, reqs, self.vocab)
            except Exception as exc:  # a draft the checks themselves choke on breaks the rules too
                problem = f"draft returned something the host cannot check ({type(exc).__name__}: {exc})"
            if problem:
                self.disable(spec, problem)
                continue
            if counted is not None:
                spec.note_draft_time(counted, sum(len(d) for d in res if d is not None), resumed, len(reqs))
            self._asked.append(_Asked(spec, {r.seq_id: d for r, d in zip(reqs, res)}, share))
            for r, d in zip(reqs, res):
                scored = self._value(spec, d)
                if scored is None:
                    continue
                value, cut = scored
                if r.seq_id not in chosen or value > score[r.seq_id]:
                    chosen[r.seq_id], score[r.seq_id] = Proposal(spec, cut), value
        _trim(chosen, len(seqs), self.cost)
        return chosen

    def asked_this_step(self, spec: Speculator) -> bool:
        """Whether the last `propose` called `spec`'s `draft`."""
        return any(a.spec is spec for a in self._asked)

    def _requests(self, spec: Speculator, seqs: Sequence[Any], n_batch: int) -> tuple[list[DraftRequest], int]:
        """The requests to `spec` this step for `seqs` (of the `n_batch` sequences in the step), and how
        many of them resume their sequence (not asked the step before)."""
        priced = spec.policy.cost_trim
        break_even: tuple[float, ...] | list[float] | None = None  # computed once a sequence is not paused
        n_pay = 0
        reqs = []
        resumed = 0
        for q in seqs:
            if q.req.speculators is not None and spec.name not in q.req.speculators:
                continue
            st = spec.state(q.slot)
            n_max = min(st.n_cur, q.req.max_tokens - q.generated - 1, self.max_ctx - len(q.tokens) - 1)
            if q.req.n_max is not None:
                n_max = min(n_max, q.req.n_max)
            if n_max < max(1, spec.policy.n_min):
                continue
            spec.stats.seq_steps += 1
            if st.skip > 0:  # paused: dead drafts, or calls that did not pay
                st.skip -= 1
                continue
            if break_even is None:
                break_even = self.break_even(spec, n_batch, spec.policy.n_max) if priced else ()
                # positions where even a certain token cannot pay are not drafted
                n_pay = next((i for i, b in enumerate(break_even) if b >= 1.0), len(break_even))
            advice = break_even[:n_max]
            if priced and n_pay == 0:
                # no token can pay at the drafting cost measured so far: a one-token probe (its cost
                # measured again), then a pause that doubles while that stays so
                n_max, advice = min(n_max, 1), ()
                pause(st, spec.probe_cost(self.t_row))
            elif priced:
                n_max = min(n_max, n_pay)
                advice = break_even[:n_max]
            if n_max >= max(1, spec.policy.n_min):
                kv = NO_KV
                if spec.embeddings.kv_layers and self.kv_views is not None:
                    kv = self.kv_views.views(spec.embeddings.kv_layers, q.slot, len(q.tokens) - 1)
                reqs.append(DraftRequest(q.slot, History(q.tokens), n_max, advice, kv))
                resumed += st.asked_at != self._step - 1
                st.asked_at = self._step
        return reqs, resumed

    def _value(self, spec: Speculator, d: Draft | None) -> tuple[float, Draft] | None:
        """(expected accepted tokens less extra rows, the draft cut to what pays), or None."""
        if d is None or len(d) == 0:
            return None
        pol, cost = spec.policy, self.cost
        if pol.p_min > 0 and d.probs is not None:
            p = d.probs[torch.arange(len(d)), torch.tensor(d.token_ids)].tolist()
            d = _cut(d, next((i for i, x in enumerate(p) if x < pol.p_min), len(d)))
        if len(d) < max(1, pol.n_min):
            return None
        if not pol.cost_trim:
            gain = sum(_cumulative(d.confidence)) if d.confidence is not None else spec.acceptance * len(d)
            return gain - (cost(1 + len(d)) - cost(1)), d
        if d.confidence is None:  # valued with what this speculator's drafts measured per position
            d = Draft(d.token_ids, d.probs, spec.position_acceptance(len(d)))
        k, score = _best_prefix(d.confidence, cost)  # the batch-wide _trim may cut further
        if score <= 0 or k < max(1, pol.n_min):
            return None  # expected to cost more verification time than it saves
        return score, _cut(d, k)

    def settle(self, seqs: Sequence[Any], chosen: dict[int, Proposal],
               outcome: dict[int, tuple[int, int]], first: dict[int, int], rows: int) -> None:
        """After verification: statistics, per-sequence value and draft length, `remove` and `verified`.

        outcome: slot -> (draft tokens verified, accepted); first: slot -> the token the target
        committed right after the sequence's last token; rows: rows of the verification forward.
        """
        worth = self.cost(len(seqs)) / len(seqs)
        by_slot = {q.slot: q for q in seqs}
        for a in self._asked:
            spec = a.spec
            if not spec.enabled:
                continue
            results = []
            for slot, d in a.proposed.items():
                q = by_slot[slot]
                st = spec.state(slot)
                mine = slot in chosen and chosen[slot].spec is spec
                n_d, n_a = outcome[slot] if mine else (len(d) if d is not None else 0, 0)
                if d is not None and len(d):
                    spec.stats.proposed += 1
                    spec.stats.proposed_first_hit += int(d.token_ids[0] == first[slot])
                value = -a.share
                if mine:
                    value += n_a * worth - (self.cost(rows) - self.cost(rows - n_d))
                    _adapt_length(spec, st, n_d, n_a)
                spec.note_value(st, value, a.share)
                results.append(Verified(slot, n_d, n_a, mine))
                if not mine or n_a < n_d:
                    self.call(spec, "remove", seq_id=slot, p0=len(q.tokens) - 1)
            self.call(spec, "verified", results=results)


def _adapt_length(spec: Speculator, st: SeqDraftState, n_drafted: int, n_accepted: int) -> None:
    """Grow the draft cap after a full acceptance, shrink it after a rejection; pause after dead drafts."""
    if n_accepted == n_drafted:
        st.n_cur, st.dead = min(spec.policy.n_max, st.n_cur + 2), 0
        return
    st.n_cur = max(spec.policy.n_min, n_accepted + 1)
    st.dead = st.dead + 1 if n_accepted == 0 else 0
    if st.dead >= spec.policy.backoff:
        st.skip = max(st.skip, 1 << min(st.dead - spec.policy.backoff, 6))


def _trim(chosen: dict[int, Proposal], n_seqs: int, cost: Callable[[int], float]) -> None:
    """Cut drafts that carry confidences where the next row is not worth verifying.

    A draft token is worth its row when its cumulative acceptance probability times what one
    accepted token saves (a sequence's share of a plain step, T(B)/B for B sequences) is at
    least what the row adds to the forward, T(R+1) - T(R), R being the rows taken so far.
    Rows go to the most probable tokens of all sequences first (cumulative probabilities
    only fall along a draft); drafts of speculators with `cost_trim: false` are kept whole.
    """
    def priced(p: Proposal) -> bool:
        return p.draft.confidence is not None and p.spec.policy.cost_trim

    rows = n_seqs + sum(len(p.draft) for p in chosen.values() if not priced(p))
    worth = cost(n_seqs) / n_seqs
    fronts = {slot: _cumulative(p.draft.confidence) for slot, p in chosen.items() if priced(p)}
    keep = dict.fromkeys(fronts, 0)
    while fronts:
        slot = max(fronts, key=lambda k: fronts[k][keep[k]])
        if fronts[slot][keep[slot]] * worth < cost(rows + 1) - cost(rows):
            break
        keep[slot] += 1
        rows += 1
        if keep[slot] == len(fronts[slot]):
            del fronts[slot]
    for slot, k in keep.items():
        p = chosen[slot]
        if k < max(1, p.spec.policy.n_min):
            del chosen[slot]
        elif k < len(p.draft):
            chosen[slot] = Proposal(p.spec, _cut(p.draft, k))


def _cumulative(confidence: Sequence[float]) -> list[float]:
    """P(tokens 0..i all accepted) from per-token conditional acceptance estimates."""
    out, p = [], 1.0
    for c in confidence:
        p *= float(c)
        out.append(p)
    return out


def _best_prefix(confidence: Sequence[float], cost: Callable[[int], float]) -> tuple[int, float]:
    """(k, value) of the draft prefix with the most expected accepted tokens less the cost of
    its extra verification rows, cost(1 + k) - cost(1); (0, 0.0) when no prefix pays."""
    best, gain = (0, 0.0), 0.0
    for k, p in enumerate(_cumulative(confidence), 1):
        gain += p
        value = gain - (cost(1 + k) - cost(1))
        if value > best[1]:
            best = (k, value)
    return best


def _cut(d: Draft, k: int) -> Draft:
    """The first k tokens of a draft, with their probs and confidences."""
    return Draft(d.token_ids[:k], d.probs[:k] if d.probs is not None else None,
                 tuple(d.confidence[:k]) if d.confidence is not None else None)
