"""The draft -> verify -> rollback loop for many sequences at once.

Each step every enabled speculator drafts for every active sequence (one hook call per
speculator, covering all sequences); per sequence the draft with the highest expected
number of accepted tokens (its confidences, or the speculator's measured acceptance per
draft position, less the cost of the extra verification rows) is kept;
one target forward verifies all sequences; rejected positions leave the target's KV cache
and every speculator's context; the committed tokens (with the hidden states speculators
asked for) go to `process_batch`. With no speculators this is plain decoding on the same
runtime, which is what speculative output is compared against.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from specplug.delivery import Delivery
from specplug.drafting import Drafting, DraftPolicy, Proposal, Speculator  # noqa: F401 (DraftPolicy: re-exported)
from specplug.errors import SpecplugError
from specplug.kv_view import KVViews
from specplug.metrics import RunStats, SeqStats, SpecStats
from specplug.pricing import Pricing, builtin
from specplug.runtime import KVCache, Target
from specplug.sampling import SamplingParams, sample, target_probs
from specplug.types import TargetAttention, TargetInfo
from specplug.verify import Verdict, verify

log = logging.getLogger("specplug")


@dataclass
class Request:
    """One generation. The optional fields override the engine's settings for this request only."""

    prompt_ids: list[int]
    max_tokens: int = 128
    id: Any = None
    sampling: SamplingParams | None = None  # None: the engine's sampling parameters
    seed: int | None = None  # seed of this request's sampling generator; None: derived from the engine's seed
    speculators: Sequence[str] | None = None  # names of the speculators that may draft for it; None: all, (): none
    n_max: int | None = None  # caps every speculator's draft length for this request (0: no drafts)
    ignore_eos: bool = False  # generate past end-of-turn tokens (to max_tokens), as the engine's ignore_eos


@dataclass
class SequenceResult:
    """One finished request."""

    id: Any
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens, the stop token excluded
    finish_reason: str  # "stop" | "length" (max_tokens) | "context" (the context size was reached) | "abort"
    stats: SeqStats
    handle: int = -1  # what Engine.add returned for it


@dataclass
class _Pending:
    handle: int
    req: Request
    sampling: SamplingParams
    seed: int
    on_tokens: Callable[[list[int]], None] | None
    on_finish: Callable[[SequenceResult], None] | None


@dataclass
class _Seq:
    slot: int
    req: Request
    handle: int  # what Engine.add returned
    tokens: list[int]  # prompt + generated; tokens[-1] is not yet in the target cache
    gen: torch.Generator | None
    stats: SeqStats
    sampling: SamplingParams
    on_tokens: Callable[[list[int]], None] | None = None
    on_finish: Callable[[SequenceResult], None] | None = None
    t_admit: float = 0.0
    finish: str | None = None

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.req.prompt_ids)


class Engine:
    """Runs requests through a target with zero or more speculators. `pricing`: the verification curve
    drafts are priced with (specplug.pricing; default: the built-in one of the target's kernel path)."""

    def __init__(self, target: Target, speculators: Sequence[Speculator] = (), n_parallel: int = 1,
                 max_ctx: int = 2048, sampling: SamplingParams = SamplingParams(), prefill_chunk: int = 256,
                 ignore_eos: bool = False, strict: bool = False, cache: KVCache | None = None,
                 hook_warn_ms: float = 500.0, pricing: Pricing | None = None, chain: str = "best"):
        self.target = target
        self.model = target.model
        self.pricing = pricing if pricing is not None else builtin(target.model)
        self.specs = list(speculators)
        self.n_parallel = n_parallel
        self.max_ctx = max_ctx
        self.sampling = sampling
        self.prefill_chunk = prefill_chunk
        self.stop_ids = frozenset() if ignore_eos else target.tokenizer.eot_ids
        self.strict = strict  # tests: re-raise speculator errors instead of disabling
        self.hook_warn_ms = hook_warn_ms  # one warning per speculator and hook whose call takes longer
        self._warned_slow: set[tuple[str, str]] = set()
        # engines that never run at the same time (the bench's variants) may share one cache:
        # every sequence's cells are cleared when it finishes
        if cache is not None and (cache.n_seq < n_parallel or cache.max_ctx < max_ctx):
            raise ValueError(f"shared cache holds {cache.n_seq} x {cache.max_ctx}, need {n_parallel} x {max_ctx}")
        self.cache = cache if cache is not None else self.model.new_cache(n_parallel, max_ctx)
        self.vocab = self.model.config.vocab_size
        self.taps = self._taps_of(self.specs)
        self.stats = RunStats()
        self._warned_context = False
        self._pending: deque[_Pending] = deque()
        self._active: dict[int, _Seq] = {}  # slot -> sequence
        self._free = list(range(n_parallel))[::-1]
        self._next_handle = 0
        for s in self.specs:
            self.stats.speculators[s.name] = s.stats
        self.delivery = Delivery(self._call, self._dormant, self.model.config.n_layer)
        self.drafting = Drafting(self.specs, self.pricing.cost, self._call, self._disable, self.vocab, max_ctx,
                                 before_draft=self.delivery.deliver, cascade=chain == "cascade",
                                 kv_views=KVViews(self.cache))

    def _taps_of(self, specs: Sequence[Speculator]) -> frozenset[int]:
        """The target layers whose hidden states `specs` need (n_layer: the pre-norm final state)."""
        taps: set[int] = set()
        for s in specs:
            taps.update(s.embeddings.layers)
            if s.embeddings.final:
                taps.add(self.model.config.n_layer)
        return frozenset(taps)

    def replace_speculator(self, new: Speculator) -> Speculator:
        """Put `new` in the place of the speculator of the same name, between two steps (call it from
        the thread that steps). Returns the one replaced, whose hooks are not called again.

        The sequences running now go on without `new`: its context holds none of their rows, so it
        neither drafts for them nor receives their rows (their output is what it would have been:
        verification decides it). It drafts for every sequence admitted from now on."""
        i = next((k for k, s in enumerate(self.specs) if s.name == new.name), None)
        if i is None:
            raise SpecplugError(f"no speculator named {new.name!r} to replace; this engine has "
                                f"{', '.join(repr(s.name) for s in self.specs) or 'none'}")
        old = self.specs[i]
        self.specs[i] = self.drafting.specs[i] = new
        self.delivery.replaced(new.name, set(self._active))
        for q in self._active.values():  # the running requests: every speculator they had, but this one
            names = [s.name for s in self.specs] if q.req.speculators is None else q.req.speculators
            q.req = dataclasses.replace(q.req, speculators=tuple(n for n in names if n != new.name))
        self.taps = self._taps_of(self.specs)
        self.stats.speculators[new.name] = new.stats
        self.stats.disabled.pop(new.name, None)
        return old

    # --- speculator calls, each guarded so a failing plugin cannot change the output -----------
    def _call(self, spec: Speculator, hook: str, **kw) -> Any:
        if not spec.enabled or not spec.caller.implements(hook):
            return None
        t0 = time.perf_counter()
        try:
            return spec.caller.call(hook, **kw)
        except Exception as exc:
            if self.strict:
                raise
            self._disable(spec, f"{hook} raised {type(exc).__name__}: {exc}", traceback.format_exc())
            return None
        finally:
            dt = time.perf_counter() - t0
            self.stats.time_speculators_s += dt
            st = spec.stats
            st.hook_s[hook] = st.hook_s.get(hook, 0.0) + dt
            st.hook_calls[hook] = st.hook_calls.get(hook, 0) + 1
            if dt * 1000 > self.hook_warn_ms and (spec.name, hook) not in self._warned_slow:
                self._warned_slow.add((spec.name, hook))
                log.warning("speculator %r: one `%s` call took %.0f ms, over hook_warn_ms=%g; every sequence "
                            "waits for it (further slow calls of this hook are not reported)",
                            spec.name, hook, dt * 1000, self.hook_warn_ms)

    def _disable(self, spec: Speculator, why: str, detail: str = "") -> None:
        spec.enabled = False
        self.stats.disabled[spec.name] = why
        log.warning("speculator %r disabled for the rest of the run: %s", spec.name, why)
        if detail:
            log.debug(detail)

    def _dormant(self, spec: Speculator) -> bool:
        """Whether `spec` is paused for every running sequence it may draft for, or in a cascade was
        asked for none of them this step (a later member is asked only where those before it have
        no draft, so on most steps not at all): its rows then wait for its next `draft`."""
        if self.drafting.cascade and spec.caller.implements("draft") and not self.drafting.asked_this_step(spec):
            return True
        return all(spec.state(q.slot).skip > 0 for q in self._active.values()
                   if q.req.speculators is None or spec.name in q.req.speculators)

    # --- the step-driven API: add, step, abort -----------------------------------------------------
    def check_request(self, req: Request, label: Any = None) -> None:
        """Raise SpecplugError naming what is wrong with a request the engine cannot run."""
        label = req.id if label is None else label
        if not req.prompt_ids:
            raise SpecplugError(f"request {label}: the prompt is empty")
        bad = next((t for t in req.prompt_ids if not (isinstance(t, int) and 0 <= t < self.vocab)), None)
        if bad is not None:
            raise SpecplugError(f"request {label}: token id {bad!r} is outside the vocabulary [0, {self.vocab})")
        if len(req.prompt_ids) + 1 > self.max_ctx:
            raise SpecplugError(f"request {label}: the prompt has {len(req.prompt_ids)} tokens, more than the "
                                f"context size {self.max_ctx} allows (raise `context`)")
        if not (isinstance(req.max_tokens, int) and req.max_tokens >= 1):
            raise SpecplugError(f"request {label}: max_tokens must be an integer >= 1, got {req.max_tokens!r}")
        if req.speculators is not None:
            names = [s.name for s in self.specs]
            unknown = [n for n in req.speculators if n not in names]
            if unknown:
                raise SpecplugError(f"request {label}: unknown speculator {unknown[0]!r}; this engine has "
                                    f"{', '.join(map(repr, names)) or 'none'}")
        if req.n_max is not None and not (isinstance(req.n_max, int) and req.n_max >= 0):
            raise SpecplugError(f"request {label}: n_max must be an integer >= 0, got {req.n_max!r}")

    def add(self, req: Request, on_tokens: Callable[[list[int]], None] | None = None,
            on_finish: Callable[[SequenceResult], None] | None = None) -> int:
        """Queue a request; it joins the running batch at the next `step` that finds a free slot.

        `on_tokens(new_ids)` is called (from `step`) as its tokens are committed, the stop token
        left out; `on_finish(result)` once when it ends (also when aborted). Returns its handle.
        """
        handle = self._next_handle
        self.check_request(req, req.id if req.id is not None else handle)
        self._next_handle += 1
        sp = req.sampling or self.sampling
        seed = req.seed if req.seed is not None else _derived_seed(sp, handle)
        self._pending.append(_Pending(handle, req, sp, seed, on_tokens, on_finish))
        return handle

    @property
    def n_waiting(self) -> int:
        """Requests added but not yet in a sequence slot."""
        return len(self._pending)

    @property
    def n_running(self) -> int:
        """Requests in a sequence slot."""
        return len(self._active)

    @property
    def has_work(self) -> bool:
        return bool(self._pending or self._active)

    def step(self) -> list[SequenceResult]:
        """Admit waiting requests into free slots (prefill), then one draft -> verify -> rollback
        step for every running sequence. Returns the requests that finished during this call."""
        t0 = time.perf_counter()
        done: list[SequenceResult] = []
        try:
            while self._pending and self._free:
                p = self._pending.popleft()
                seq = self._admit(self._free.pop(), p)
                if seq.finish:
                    done.append(self._finish(seq))
                else:
                    self._active[seq.slot] = seq
            if self._active:
                self._step(list(self._active.values()))
                for slot in [s for s, q in self._active.items() if q.finish]:
                    done.append(self._finish(self._active.pop(slot)))
        finally:  # also when interrupted: the statistics cover what ran
            self.stats.time_total_s += time.perf_counter() - t0
        return done

    def abort(self, handle: int) -> SequenceResult | None:
        """Stop a request now (between steps): its slot, cache cells and speculator state are freed.
        Returns its result (finish_reason "abort"), or None when the handle is not waiting or running."""
        for p in self._pending:
            if p.handle == handle:
                self._pending.remove(p)
                stats = SeqStats(prompt_tokens=len(p.req.prompt_ids))
                result = SequenceResult(p.req.id, list(p.req.prompt_ids), [], "abort", stats, handle)
                if p.on_finish is not None:
                    p.on_finish(result)
                return result
        for slot, q in self._active.items():
            if q.handle == handle:
                del self._active[slot]
                q.finish = "abort"
                return self._finish(q)
        return None

    def abort_all(self) -> list[SequenceResult]:
        """Abort every waiting and running request."""
        handles = [p.handle for p in self._pending] + [q.handle for q in self._active.values()]
        return [r for r in map(self.abort, handles) if r is not None]

    def run(self, requests: Sequence[Request],
            on_tokens: Callable[[int, list[int]], None] | None = None,
            on_finish: Callable[[SequenceResult], None] | None = None) -> list[SequenceResult]:
        """Generate for every request (all checked before any runs); `on_tokens(request_index, new_ids)`
        streams as tokens come, `on_finish(result)` is called as each request completes."""
        for i, r in enumerate(requests):
            self.check_request(r, r.id if r.id is not None else i)
        results: list[SequenceResult | None] = [None] * len(requests)
        handles: list[int] = []
        try:
            for i, r in enumerate(requests):
                if r.seed is None:  # the seed a request gets from its index in the list, as before
                    r = dataclasses.replace(r, seed=_derived_seed(r.sampling or self.sampling, i))

                def tokens(ids, i=i):
                    if on_tokens is not None:
                        on_tokens(i, ids)

                def finish(res, i=i):
                    if res.finish_reason == "abort":  # run() aborts only when interrupted: not an answer
                        return
                    results[i] = res
                    if on_finish is not None:
                        on_finish(res)

                handles.append(self.add(r, tokens, finish))
            while self.has_work:
                self.step()
        except BaseException:
            for h in handles:  # an interrupted run leaves the engine empty, ready for the next
                self.abort(h)
            raise
        finally:
            self._collect_notes()
        return results  # type: ignore[return-value]

    def _collect_notes(self) -> None:
        """A speculator object may have a plain method `summary() -> str | None` (not a hook): one
        line for the run summary, e.g. which files it wrote."""
        for s in self.specs:
            fn = getattr(s.caller.plugin, "summary", None)
            if not callable(fn):
                continue
            try:
                note = fn()
            except Exception as exc:  # a note is never worth failing a run over
                note = f"summary() raised {type(exc).__name__}: {exc}"
            if note:
                self.stats.notes[s.name] = str(note)

    def _finish(self, seq: _Seq) -> SequenceResult:
        self.cache.clear(seq.slot)
        for s in self.specs:
            s.forget(seq.slot)
            if not self.delivery.finished(s, seq.slot):  # it never saw this sequence: nothing to remove
                continue
            self._call(s, "remove", seq_id=seq.slot, p0=0)
        self._free.append(seq.slot)
        gen = seq.tokens[len(seq.req.prompt_ids):]
        if seq.finish == "stop":
            gen = gen[:-1]
        self.stats.generated_tokens += len(gen)
        seq.stats.generated_tokens = len(gen)
        seq.stats.emitted_tokens = seq.generated  # the stop token included: every token the target produced
        self.stats.emitted_tokens += seq.generated
        if seq.finish == "context" and not self._warned_context:
            self._warned_context = True
            log.warning("request %r was cut at the context size (%d positions) before max_tokens; raise `context` "
                        "(its finish_reason is \"context\"; further cuts are not reported)",
                        seq.req.id if seq.req.id is not None else seq.handle, self.max_ctx)
        seq.stats.time_s = time.perf_counter() - seq.t_admit
        result = SequenceResult(seq.req.id, list(seq.req.prompt_ids), gen, seq.finish or "length", seq.stats,
                                seq.handle)
        if seq.on_finish is not None:
            seq.on_finish(result)
        return result

    def _forward(self, toks, pos, seqs, logits_rows=None):
        t0 = time.perf_counter()
        out = self.model.forward(toks, pos, seqs, self.cache, logits_rows=logits_rows, taps=self.taps)
        self.stats.time_target_s += time.perf_counter() - t0
        return out

    def _admit(self, slot: int, p: _Pending) -> _Seq:
        req, sp = p.req, p.sampling
        gen = None if sp.greedy else torch.Generator().manual_seed(p.seed)
        seq = _Seq(slot, req, p.handle, list(req.prompt_ids), gen, SeqStats(prompt_tokens=len(req.prompt_ids)), sp,
                   p.on_tokens, p.on_finish, t_admit=time.perf_counter())
        seq.stats.by_speculator = {s.name: SpecStats() for s in self.specs}
        self.stats.prompt_tokens += len(req.prompt_ids)
        ids = req.prompt_ids
        logits = None
        try:
            for a in range(0, len(ids), self.prefill_chunk):
                b = min(len(ids), a + self.prefill_chunk)
                last = b == len(ids)
                out = self._forward(ids[a:b], list(range(a, b)), [slot] * (b - a), [b - a - 1] if last else [])
                self.delivery.committed(self.specs, [(ids[i], i, slot) for i in range(a, b)], None, out.hidden, True)
                logits = out.logits
        except BaseException:  # the slot stays usable: nothing of this prompt is left behind
            seq.finish = "abort"
            self._finish(seq)
            raise
        seq.stats.target_forwards += 1  # the forward that produced the first token
        self.stats.target_forwards += 1
        probs = target_probs(logits.float().cpu(), sp) if not sp.greedy else None
        first = int(logits[0].argmax()) if probs is None else sample(probs[0], gen)
        seq.stats.time_prefill_s = time.perf_counter() - seq.t_admit
        self._append(seq, [first])
        return seq

    def _append(self, seq: _Seq, new: list[int]) -> None:
        room = self.max_ctx - 1
        stop_ids = () if seq.req.ignore_eos else self.stop_ids
        out = []
        for t in new:
            seq.tokens.append(t)
            out.append(t)
            if t in stop_ids:
                seq.finish = "stop"
                break
            if seq.generated >= seq.req.max_tokens:
                seq.finish = "length"
                break
            if len(seq.tokens) >= room:
                seq.finish = "context"
                break
        if seq.on_tokens is not None:
            seq.on_tokens([t for t in out if t not in stop_ids])

    def _step(self, seqs: list[_Seq]) -> None:
        chosen = self.drafting.propose(seqs) if self.specs else {}
        toks, pos, sids, spans = [], [], [], []
        for q in seqs:
            p = chosen.get(q.slot)
            ids = [q.tokens[-1], *(p.draft.token_ids if p else ())]
            p0 = len(q.tokens) - 1
            spans.append((len(toks), len(ids)))
            toks += ids
            pos += range(p0, p0 + len(ids))
            sids += [q.slot] * len(ids)
        t0 = time.perf_counter()
        out = self._forward(toks, pos, sids)
        if chosen:  # the scale of the cost curve, for pricing drafting time
            self.drafting.note_forward(time.perf_counter() - t0, len(toks))
        committed: list[tuple[int, int, int]] = []
        rows: list[int] = []
        outcome: dict[int, tuple[int, int]] = {}  # slot -> (n_drafted, n_accepted)
        first: dict[int, int] = {}  # slot -> the token committed after the sequence's last one
        for q, (off, n) in zip(seqs, spans):
            p = chosen.get(q.slot)
            draft_ids = list(p.draft.token_ids) if p else []
            v = self._verify(q, out.logits[off:off + n], draft_ids, p)
            draft_ids = draft_ids[:v.n_accepted]
            p0 = len(q.tokens) - 1
            if v.n_accepted < n - 1:
                self.cache.seq_rm(q.slot, p0 + v.n_accepted + 1)
            for i in range(v.n_accepted + 1):
                committed.append((toks[off + i], p0 + i, q.slot))
                rows.append(off + i)
            n_drafted = n - 1 if p and p.spec.enabled else 0
            outcome[q.slot] = (n_drafted, v.n_accepted)
            first[q.slot] = draft_ids[0] if v.n_accepted else v.next_token
            q.stats.target_forwards += 1
            self.stats.target_forwards += 1
            if n_drafted:
                spec = p.spec
                spec.stats.add(n_drafted, v.n_accepted)
                q.stats.by_speculator[spec.name].add(n_drafted, v.n_accepted)
                q.stats.drafted_tokens += n_drafted
                q.stats.accepted_tokens += v.n_accepted
            self._append(q, draft_ids + [v.next_token])
        if self.specs:
            self.drafting.settle(seqs, {k: p for k, p in chosen.items() if p.spec.enabled}, outcome, first, len(toks))
            # on the hidden states' device once a step (take_rows would otherwise copy a host index
            # there for every tap of every speculator)
            row_t = torch.tensor(rows, dtype=torch.long, device=self.model.device) if len(rows) != len(toks) else None
            self.delivery.committed(self.specs, committed, row_t, out.hidden, False)

    def _verify(self, q: _Seq, logits: torch.Tensor, draft_ids: list[int], p: Proposal | None) -> Verdict:
        """Verify one sequence's draft. A draft that makes verification fail (its probs, say)
        disables its speculator, and the sequence takes the target's own token instead."""
        if not p:
            return verify(logits, [], None, q.sampling, q.gen)
        try:
            return verify(logits, draft_ids, p.draft.probs, q.sampling, q.gen)
        except Exception as exc:
            if self.strict:
                raise
            self._disable(p.spec, f"its draft failed verification ({type(exc).__name__}: {exc})",
                          traceback.format_exc())
            return verify(logits[:1], [], None, q.sampling, q.gen)


def _derived_seed(sp: SamplingParams, index: int) -> int:
    """The sampling seed of a request that gives none: from the engine's seed and its index."""
    return (sp.seed or 0) * 1_000_003 + index


def target_info(target: Target, n_seq: int, max_ctx: int,
                verify_cost: Callable[[int], float] | None = None) -> TargetInfo:
    """What speculators are told about the target; `verify_cost`: the run's pricing (Pricing.cost;
    default: the built-in curve of the target's kernel path)."""
    m, tok, cfg = target.model, target.tokenizer, target.model.config
    return TargetInfo(model_path=str(m.path), arch=cfg.arch, n_layer=cfg.n_layer, n_embd=cfg.n_embd,
                      vocab_size=cfg.vocab_size, token_texts=tok.token_texts, token_types=tok.token_type,
                      bos_id=tok.bos_id, eos_id=tok.eos_id, eot_ids=frozenset(tok.eot_ids), device=m.device,
                      dtype=m.dtype, n_seq=n_seq, max_ctx=max_ctx, token_embeddings=m.embed,
                      output_head=m.output_head, quant=m.quant, rms_eps=cfg.rms_eps,
                      verify_cost=verify_cost or builtin(m).cost, static=None if m.static is None else m.static.options,
                      attention=TargetAttention(cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.scale, cfg.rope_base,
                                                cfg.rope_scale, cfg.rope_base_window,
                                                tuple(cfg.layer_window(i) for i in range(cfg.n_layer))))
