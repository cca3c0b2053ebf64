"""Run plain decoding and each speculative variant on the same prompts, interleaved.

One target is loaded once; every variant is an Engine around it (plain = no speculators).
For each prompt (and each turn of multi-turn prompts) the variants run back to back in a
rotating order, so slow drift of the machine falls on all of them alike. Multi-turn sets
feed the model's own first answer (from plain decoding) into the second turn.
"""
from __future__ import annotations

import dataclasses
import resource
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from specplug.api import build_engine, prompt_ids
from specplug.config import RunConfig
from specplug.engine import Engine, Request
from specplug.errors import SpecplugError
from specplug.pricing import for_run
from specplug.runtime import Target


@dataclass
class Run:
    """One prompt-turn under one variant."""

    variant: str
    time_s: float  # median over repeats
    token_ids: list[int]
    forwards: int
    drafted: int = 0
    accepted: int = 0
    drafts: int = 0
    accepted_at: list[int] = field(default_factory=list)
    drafted_at: list[int] = field(default_factory=list)
    reached_at: list[int] = field(default_factory=list)
    time_target_s: float = 0.0
    time_speculators_s: float = 0.0
    prefill_s: float = 0.0  # prompt processing and the first token; the rest of time_s is decoding
    emitted: int = 0  # tokens the target produced, the stop token included
    # the drafting policy's view (summed over the variant's speculators)
    seq_steps: int = 0  # decoding steps where a speculator could have drafted
    asked: int = 0  # of those, steps where it was asked (the rest: paused, or no draft could pay)
    draft_s: float = 0.0  # seconds in `draft` hooks
    proposed: int = 0  # drafts returned (verified or not)
    first_hit: int = 0  # of those, drafts whose first token is the one the target committed


@dataclass
class PromptResult:
    id: object
    category: str
    turn: int
    prompt_tokens: int
    runs: dict[str, Run]
    mismatch: dict | None = None  # greedy only: where a variant diverged from plain


def variants(cfg: RunConfig, chain: bool, chains: Sequence[str] = ()) -> dict[str, RunConfig]:
    """variant name -> config: each speculator alone, plus all of them chained (in the config's `chain`
    mode) if asked, plus each of `chains`: names joined by `>` (a cascade, in that order) or `+` (all
    draft, the draft worth most is verified), e.g. "ngram-simple>eagle3"; the variant is named so."""
    out = {}
    for s in cfg.speculators:
        out[s.name] = dataclasses.replace(cfg, speculators=(s,))
    if chain and len(cfg.speculators) > 1:
        out["chain"] = cfg
    by_name = {s.name: s for s in cfg.speculators}
    for spec in chains:
        sep = ">" if ">" in spec else "+"
        names = [n.strip() for n in spec.split(sep)]
        if (">" in spec and "+" in spec) or len(names) < 2 or len(set(names)) < len(names):
            raise SpecplugError(f"chain {spec!r}: write two or more distinct speculator names joined by '>' "
                                f"(a cascade) or '+' (the best draft wins), e.g. ngram-simple>eagle3")
        missing = [n for n in names if n not in by_name]
        if missing:
            raise SpecplugError(f"chain {spec!r}: no speculator named {missing[0]!r} in the config "
                                f"(it has {', '.join(by_name) or 'none'})")
        out[spec] = dataclasses.replace(cfg, speculators=tuple(by_name[n] for n in names),
                                        chain="cascade" if sep == ">" else "best")
    if not out:
        raise ValueError("the config lists no speculators to compare with plain decoding")
    return out


def top2_gap(target: Target, prefix: list[int], ctx: int) -> float:
    """Logit gap between the best and second-best token after `prefix` (near-tie check)."""
    m = target.model
    logits = m.forward(prefix, list(range(len(prefix))), [0] * len(prefix), m.new_cache(1, ctx),
                       logits_rows=[len(prefix) - 1]).logits[0]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


class Bench:
    def __init__(self, cfg: RunConfig, target: Target, chain: bool = False, chains: Sequence[str] = ()):
        self.cfg = dataclasses.replace(cfg, parallel=1)
        self.target = target
        self.variants = variants(self.cfg, chain, chains)
        self.cache = target.model.new_cache(1, self.cfg.context)  # the variants run one after another
        self.pricing = for_run(target.model, self.cfg)  # resolved once (it may time the target): every variant's
        self.fresh_engines()

    def fresh_engines(self) -> None:
        """New engines with new speculator instances. Called before each pass over the prompts:
        speculators that learn across a run (ngram-mod's pool, ngram-cache's dynamic cache)
        would otherwise have seen a prompt's answer when it is repeated."""
        self.engines: dict[str, Engine] = {"plain": build_engine(self.cfg, self.target, False, self.cache)}
        for name, vcfg in self.variants.items():
            self.engines[name] = build_engine(vcfg, self.target, cache=self.cache, pricing=self.pricing)

    def _once(self, name: str, ids: list[int], max_tokens: int) -> Run:
        eng = self.engines[name]
        before = (eng.stats.time_target_s, eng.stats.time_speculators_s)
        policy_fields = ("seq_steps", "asked", "draft_s", "proposed", "proposed_first_hit")
        policy_before = {f: sum(getattr(s, f) for s in eng.stats.speculators.values()) for f in policy_fields}
        t0 = time.perf_counter()
        res = eng.run([Request(ids, max_tokens)])[0]
        dt = time.perf_counter() - t0
        st = res.stats
        run = Run(name, dt, res.token_ids, st.target_forwards, st.drafted_tokens, st.accepted_tokens,
                  time_target_s=eng.stats.time_target_s - before[0],
                  time_speculators_s=eng.stats.time_speculators_s - before[1],
                  prefill_s=st.time_prefill_s, emitted=st.emitted_tokens)
        (run.seq_steps, run.asked, run.draft_s, run.proposed, run.first_hit) = (
            sum(getattr(s, f) for s in eng.stats.speculators.values()) - policy_before[f] for f in policy_fields)
        for s in st.by_speculator.values():
            run.drafts += s.drafts
            for arr_name in ("accepted_at", "drafted_at", "reached_at"):
                arr, src = getattr(run, arr_name), getattr(s, arr_name)
                arr.extend([0] * (len(src) - len(arr)))
                for i, v in enumerate(src):
                    arr[i] += v
        return run

    def warmup(self, text: str = "Hello!") -> None:
        """One short untimed run per engine: first calls pay for allocations and kernel setup."""
        ids = prompt_ids(self.target.tokenizer, text, self.cfg.chat, self.cfg.system)
        for n in self.engines:
            self._once(n, ids, 8)

    def run_prompt(self, rec: dict, max_tokens: int, index: int,
                   progress: Callable[[], None] | None = None) -> list[PromptResult]:
        """Every variant on one prompt (each turn of it), in an order rotated by `index`."""
        tok = self.target.tokenizer
        names = list(self.engines)
        system = rec.get("system") or self.cfg.system  # a record's own system prompt wins over the run's
        messages: list[dict] = []
        results = []
        for turn, text in enumerate(rec["turns"]):
            messages.append({"role": "user", "content": text})
            ids = prompt_ids(tok, messages, self.cfg.chat, system) if self.cfg.chat else tok.encode(text)
            room = self.cfg.context - len(ids) - 1
            if room < 1:
                break
            mt = min(max_tokens, room)
            # rotate the order per prompt and turn so drift is shared by all variants
            k = (index + turn) % len(names)
            order = names[k:] + names[:k]
            med = {}
            for n in order:
                med[n] = self._once(n, ids, mt)
                if progress:
                    progress()
            med = {n: med[n] for n in names}
            pr = PromptResult(rec["id"], rec["category"], turn, len(ids), med)
            plain = med["plain"].token_ids
            if self.cfg.sampling.greedy:
                for n, r in med.items():
                    if r.token_ids != plain:
                        j = next((i for i, (a, b) in enumerate(zip(plain, r.token_ids)) if a != b),
                                 min(len(plain), len(r.token_ids)))
                        gap = top2_gap(self.target, ids + plain[:j], self.cfg.context) if j < len(plain) else None
                        pr.mismatch = {"variant": n, "index": j, "top2_gap": gap}
                        break
            results.append(pr)
            messages.append({"role": "assistant", "content": tok.decode(plain, skip_special=True)})
        return results


def merge_passes(passes: list[list[PromptResult]]) -> list[PromptResult]:
    """Per prompt-turn and variant, keep the run with the median time over the passes
    (the whole run, so its time and its acceptance figures belong together)."""
    merged = []
    for same in zip(*passes):
        first = same[0]
        runs = {}
        for n in first.runs:
            ordered = sorted((p.runs[n] for p in same), key=lambda r: r.time_s)
            runs[n] = ordered[(len(ordered) - 1) // 2]
        mismatch = next((p.mismatch for p in same if p.mismatch), None)
        merged.append(PromptResult(first.id, first.category, first.turn, first.prompt_tokens, runs, mismatch))
    return merged


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
