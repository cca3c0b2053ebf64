"""`draft`: a (smaller) model with the target's vocabulary proposes the next tokens.

The drafter is a specplug `Transformer` with its own KV cache, one slot per target sequence.
That cache mirrors the target's committed context, computed lazily: `process_batch` only notes how
long each prompt is, and `draft` catches up from the request's history before drafting (the prompt
whole, in one forward, at the sequence's first draft; the committed tokens of decoding as they are
needed). A drafter the host has paused, or never asks, costs nothing: SmolLM2 drafting for itself
prefilled every prompt a second time, 0.77x plain end to end on Spec-Bench while never drafting.
`remove` rolls back. `held[s]` records the token id at every cached position of slot s
(positions 0..len-1), so the drafter never recomputes what it already holds (its own accepted
drafts) and recomputes from the first difference whenever the context differs from it.

A draft processes at most the newest `catch_up` committed decoding tokens it has not yet seen:
after a pause of hundreds of steps the probe costs a forward of 32 tokens, not of all of them; the
cells before those (after the prompt) stay empty (HOLE in `held`; attention skips empty cells) and
are never filled in. `catch_up: null` processes every token (the drafter's cache then always equals
a fresh prefill).

Greedy drafting (temperature 0) returns token-only drafts (probs=None, i.e. a one-hot q): the
token was not *sampled* from the softmax, so returning the softmax as q would bias stochastic
verification (accept with min(1, p/q) needs the q the token was actually drawn from). With
temperature > 0 each token is sampled from softmax(logits / temperature), and exactly that
distribution is returned as its probs row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from specplug.errors import ConfigError, ModelError
from specplug.hooks import hookimpl
from specplug.runtime import Tokenizer, Transformer, resolve_model
from specplug.runtime.model import DTYPES, QUANTS, resolve_device
from specplug.types import Batch, Draft, DraftRequest, TargetInfo

NAME = "draft"
HOLE = -1  # `held` at a position whose cell was left empty (see `catch_up`)


def _check(ok: bool, key: str, rule: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{NAME}: {key} must be {rule}, got {value!r}")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class DraftModel:
    """Speculator backed by a draft model sharing the target's vocabulary (batched over sequences)."""

    @dataclass(frozen=True)
    class Params:
        model: str  # known model name or path to a .gguf file: the drafter (required)
        device: str = "auto"  # auto = the target's device | cpu | cuda[:N]
        dtype: str = "float32"  # float32 | bfloat16 | float16
        quant: str = "auto"  # auto (= the runtime default, none) | none | int8 (fast, approximate)
        temperature: float = 0.0  # 0 = greedy, token-only drafts; > 0 = sampled drafts with probs
        # Stop a sequence's draft when the drafter's top probability falls below this (llama.cpp
        # --draft-p-min). Not `p_min`: that YAML key belongs to the host's DraftPolicy, which can only
        # cut drafts after the fact and only those with probs (temperature > 0).
        draft_p_min: float = 0.0
        # a draft processes at most this many committed tokens the drafter has not seen (the newest;
        # null: all of them)
        catch_up: int | None = 32

        def __post_init__(self):
            # checked here so that a bad value is a ConfigError when the YAML is parsed
            _check(isinstance(self.model, str) and self.model.strip() != "", "model",
                   "a known model name or a .gguf path", self.model)
            _check(isinstance(self.device, str) and self.device != "", "device", "auto, cpu or cuda[:N]", self.device)
            _check(isinstance(self.dtype, str) and self.dtype in DTYPES, "dtype", f"one of {', '.join(DTYPES)}",
                   self.dtype)
            _check(isinstance(self.quant, str) and self.quant in QUANTS, "quant", f"one of {', '.join(QUANTS)}",
                   self.quant)
            _check(_number(self.temperature) and self.temperature >= 0, "temperature", ">= 0", self.temperature)
            _check(_number(self.draft_p_min) and 0 <= self.draft_p_min < 1, "draft_p_min", "in [0, 1)",
                   self.draft_p_min)
            _check(self.catch_up is None or (isinstance(self.catch_up, int) and not isinstance(self.catch_up, bool)
                                             and self.catch_up >= 1), "catch_up", "an integer >= 1 or null",
                   self.catch_up)

    def __init__(self, params: "DraftModel.Params", target: TargetInfo):
        self.params = params
        try:
            device = str(target.device) if params.device == "auto" else str(resolve_device(params.device))
        except ModelError as exc:
            raise ConfigError(f"{NAME}: device: {exc}") from None
        try:
            path = resolve_model(params.model)
            self.model = Transformer.load(path, device=device, dtype=params.dtype, quant=params.quant)
            self.tokenizer = Tokenizer.from_metadata(self.model.metadata, source=str(path))
        except ModelError as exc:
            raise ConfigError(f"{NAME}: cannot load model {params.model!r}: {exc}") from None
        self.cache = self.model.new_cache(target.n_seq, target.max_ctx)
        self.max_ctx = target.max_ctx
        self.held: list[list[int]] = [[] for _ in range(target.n_seq)]  # slot -> token id per cached position
        self.prompt_len = [0] * target.n_seq  # slot -> its sequence's prompt length (read whole at a draft)
        self.eot = frozenset(target.eot_ids)
        self.out_device = target.device  # probs are compared with the target's probabilities there
        # own generator: sampling drafts must not consume the host's random streams
        self.gen = torch.Generator(device=self.model.device).manual_seed(0)

    # --- start-up -------------------------------------------------------------------------------
    @hookimpl
    def are_compatible(self, target: TargetInfo) -> str | None:
        """The first difference in vocabulary size, token texts or BOS/EOS ids; None if there is none."""
        mine = self.tokenizer
        if self.model.config.vocab_size != target.vocab_size:
            return f"vocab size: target {target.vocab_size} != draft {self.model.config.vocab_size}"
        theirs = list(target.token_texts)
        if theirs != mine.token_texts:
            for i, (a, b) in enumerate(zip(theirs, mine.token_texts)):
                if a != b:
                    return f"token {i}: target {a!r} != draft {b!r}"
            return f"token list length: target {len(theirs)} != draft {len(mine.token_texts)}"
        for what, a, b in (("bos id", target.bos_id, mine.bos_id), ("eos id", target.eos_id, mine.eos_id)):
            if a != b:
                return f"{what}: target {a} != draft {b}"
        return None

    # --- the drafter's cache ------------------------------------------------------------------
    def _truncate(self, seq: int, p0: int) -> None:
        if p0 < len(self.held[seq]):
            self.cache.seq_rm(seq, p0)
            del self.held[seq][p0:]

    def _align(self, seq: int, start: int, tokens: list[int], limit: int) -> int:
        """How many of `tokens` (for positions start, start+1, ...) slot `seq` already holds, at most
        `limit`; everything the slot holds after those is dropped as stale. Needs start <= len(held)."""
        held = self.held[seq]
        n = max(0, min(len(held) - start, limit))
        if held[start:start + n] != tokens[:n]:  # a rejected or unchosen draft (or holes): find where
            n = next((i for i in range(n) if held[start + i] not in (tokens[i], HOLE)), n)
        self._truncate(seq, start + n)
        return n

    def _forward(self, feed: list[tuple[int, int, list[int]]], logits: bool) -> torch.Tensor | None:
        """One drafter forward over feed = [(seq, start, token ids)], each starting at len(held[seq]);
        returns the logits of each group's last entry when asked, else None."""
        toks, pos, seqs, last = [], [], [], []
        for seq, start, ids in feed:
            toks += ids
            pos += range(start, start + len(ids))
            seqs += [seq] * len(ids)
            last.append(len(toks) - 1)
        out = self.model.forward(toks, pos, seqs, self.cache, logits_rows=last if logits else [])
        for seq, _, ids in feed:
            self.held[seq].extend(ids)
        return out.logits

    # --- hooks ----------------------------------------------------------------------------------
    @hookimpl
    def process_batch(self, batch: Batch, encoded: torch.Tensor | None) -> None:
        """Note each prompt's length (a prompt comes in one batch or in chunks, the first at position 0).
        Nothing is computed here: the next `draft` reads what it needs from the request's history."""
        if not batch.is_prompt:
            return
        for p, s in zip(batch.positions.tolist(), batch.seq_ids.tolist()):
            self.prompt_len[s] = p + 1 if p == 0 else max(self.prompt_len[s], p + 1)

    def _catch_up(self, requests: Sequence[DraftRequest]
                  ) -> tuple[list[tuple[int, int, list[int]]], list[tuple[int, int]]]:
        """Bring every slot up to its request's history, but for the last token and at most the newest
        `catch_up` unseen decoding tokens: a prompt not yet read is read whole in one forward now, and the
        cells of older unseen tokens stay empty. Returns the first drafting forward's feed and, per
        entry, (request index, n_max)."""
        plans, prompts = [], []  # per drafting sequence: (request index, slot, held, cells left empty, history, n_max)
        for i, r in enumerate(requests):
            hist = list(r.tokens)
            n_max = min(r.n_max, self.max_ctx - len(hist))  # never write past the cache
            if n_max < 1 or not hist:
                continue
            # the last token is never taken as held: its logits give the first draft token
            k = self._align(r.seq_id, 0, hist, len(hist) - 1)
            p_end = min(self.prompt_len[r.seq_id], len(hist) - 1)
            unseen = len(hist) - 1 - max(k, p_end)  # decoding tokens not seen (a prompt is read whole)
            gap = unseen - self.params.catch_up if self.params.catch_up is not None else 0
            if gap > 0 and k < p_end:
                prompts.append((r.seq_id, k, hist[k:p_end]))  # read whole, before the cells left empty
                k = p_end
            plans.append((i, r.seq_id, k, max(gap, 0), hist, n_max))
        if prompts:
            self._forward(prompts, logits=False)
        feed, live = [], []
        for i, seq, k, gap, hist, n_max in plans:
            self.held[seq].extend([HOLE] * gap)  # older unseen cells stay empty
            feed.append((seq, k + gap, hist[k + gap:]))
            live.append((i, n_max))
        return feed, live

    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]) -> Sequence[Draft | None]:
        """Draft for every request at once: each step is one drafter forward over the sequences
        still drafting. Drafted tokens that were fed stay cached (they are likely accepted)."""
        feed, live = self._catch_up(requests)  # per drafting sequence: what to feed next, (request index, n_max)
        ids: list[list[int]] = [[] for _ in requests]
        rows: list[list[torch.Tensor]] = [[] for _ in requests]
        p_min = self.params.draft_p_min
        while feed:
            toks, top, q = self._pick(self._forward(feed, logits=True))
            next_feed, next_live = [], []
            for j, ((seq, start, fed), (i, n_max)) in enumerate(zip(feed, live)):
                if p_min > 0 and top[j] < p_min:
                    continue  # the drafter is unsure: stop this sequence, without this token
                ids[i].append(toks[j])
                if q is not None:
                    rows[i].append(q[j])
                if len(ids[i]) < n_max and toks[j] not in self.eot:
                    next_feed.append((seq, start + len(fed), [toks[j]]))
                    next_live.append((i, n_max))
            feed, live = next_feed, next_live
        return [Draft(tuple(d), torch.stack(rows[i]).to(self.out_device) if rows[i] else None) if d else None
                for i, d in enumerate(ids)]

    def _pick(self, logits: torch.Tensor) -> tuple[list[int], list[float] | None, torch.Tensor | None]:
        """Per row: the next token, the drafter's top probability (only when draft_p_min is set) and
        the distribution the token was sampled from (None when greedy)."""
        t = self.params.temperature
        if t == 0:
            top = torch.softmax(logits, -1).amax(-1).tolist() if self.params.draft_p_min > 0 else None
            return logits.argmax(-1).tolist(), top, None
        q = torch.softmax(logits / t, -1)
        toks = torch.multinomial(q, 1, generator=self.gen).squeeze(1).tolist()
        return toks, q.amax(-1).tolist(), q

    @hookimpl
    def remove(self, seq_id: int, p0: int) -> None:
        """Drop positions >= p0 of `seq_id` from the drafter's cache and records."""
        self._truncate(seq_id, p0)
