"""`specplug train prompts --self N`: user requests the target writes itself (the Magpie method).

The target is given only its chat template up to where a user message's text begins (the
system turn the template adds by itself included) and samples what follows until its end-of-turn
token: a user request in the voice of the traffic it was tuned on. With `turns=2` the target then
answers each kept request (greedy, as `train data` will), and the template up to the next user
turn after that answer gives a follow-up request.

Every sample goes through the same filters, in this order, each counted:

  finished   the request ended with the end-of-turn token within `max_request_tokens`
             (a cut-off request is usually a run-on that never became a question)
  length     min_chars..max_chars characters and at least 3 words
  template   no special-token text (the tokenizer's control tokens, `<|...|>`), no role markers
             ("user:", "assistant:" at a line start): the model playing both sides
  printable  >= 98% printable characters, no U+FFFD, >= 60% of the non-space characters letters
  overlap    shares no 13-token n-gram with an evaluation prompt (prompts.OverlapFilter)
  logprob    mean log-probability of the request's tokens (the end-of-turn token left out) under
             the target, at temperature 1, within [min_logprob, max_logprob]: below, the sample
             wandered into text the model itself finds unlikely (made-up words, a language
             switch); above, it is a near-deterministic template phrase
  exact_dup  the same text as a kept request once lower-cased, with punctuation and runs of
             spaces dropped
  near_dup   word-3-shingle Jaccard similarity >= near_dup with a kept request (MinHash, below)

Sampling is deterministic for (seed, candidate index, turn): each request has its own generator
seeded from them and the runtime's kernels are batch-invariant, so `--seed S --offset K --self N`
makes candidates K..K+N-1 exactly as one larger run would, and pieces can be run apart (`--against`
dedupes a piece against files already made).
"""
from __future__ import annotations

import hashlib
import re
import string
import sys
import unicodedata
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from specplug.api import prompt_ids
from specplug.engine import Engine, Request
from specplug.errors import SpecplugError
from specplug.sampling import SamplingParams

FILTERS = ("finished", "length", "template", "printable", "overlap", "logprob", "exact_dup", "near_dup")
_USER_MARK = "SPECPLUGUSERTURN"
_SPECIAL_LIKE = re.compile(r"<\|[^<>|]{1,40}\|>")
_ROLE_LINE = re.compile(r"(?im)^\s*(user|assistant|system|human|gpt|ai|bot)\s*:")


def user_turn_prefix(tok, history: Sequence[dict], system: str | None = None) -> list[int]:
    """Token ids of the chat template rendered up to where the next user message's text begins,
    after `history` (a list of messages; empty for the first turn). The ids of prefix + request
    text are the ids `specplug.api.prompt_ids` gives the same conversation, up to the request's end."""
    messages = ([{"role": "system", "content": system}] if system else []) + list(history)
    text = tok.apply_chat_template(messages + [{"role": "user", "content": _USER_MARK}], add_generation_prompt=False)
    if text.count(_USER_MARK) != 1:
        raise SpecplugError("the chat template does not show a user message's text verbatim; the target cannot be "
                            "asked to write a user turn with it")
    ids = tok.encode(text[:text.index(_USER_MARK)])
    if len(ids) > 1 and ids[0] == ids[1] == tok.bos_id:  # the template wrote BOS itself (as prompt_ids)
        ids = ids[1:]
    return ids


def sample_seed(seed: int, index: int, turn: int) -> int:
    """The sampling seed of candidate `index`'s turn `turn` (1 or 2) in a run with `seed`."""
    digest = hashlib.blake2b(f"{seed}:{index}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: any torch.Generator takes it


# ---- the text filters ------------------------------------------------------------------------------

def normalize(text: str) -> str:
    """Lower case, punctuation dropped, runs of white space as one space (the exact-duplicate key)."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(" " if c in string.punctuation or unicodedata.category(c).startswith("P") else c for c in text)
    return " ".join(text.split())


def shingles(text: str, k: int = 3) -> frozenset[str]:
    """Word k-grams of the normalized text (the whole text as one shingle when it has fewer words)."""
    words = normalize(text).split()
    if len(words) < k:
        return frozenset([" ".join(words)])
    return frozenset(" ".join(words[i:i + k]) for i in range(len(words) - k + 1))


def jaccard(a: frozenset, b: frozenset) -> float:
    return len(a & b) / max(1, len(a | b))


class NearDuplicates:
    """Near-duplicate search by MinHash with banding (locality-sensitive hashing).

    Comparing every request with every kept one is quadratic (10^8 set comparisons at 10^4
    requests); an index of shingles is no better, since most requests share shingles like "can you
    provide". MinHash keeps `bands * rows` minima of hashed shingles per text; two texts with
    Jaccard similarity J agree on a band (all `rows` minima) with probability J^rows, so the ones
    that share a band are the likely near duplicates (at 16 bands of 4 rows: 99% found at J = 0.7,
    64% at J = 0.5). Only those candidates are compared exactly, so the verdict is the exact
    Jaccard similarity; a pair it misses is one that no band caught (at J >= 0.8: under 1e-6).
    """

    _P = (1 << 61) - 1  # a Mersenne prime: ((a * x + b) mod p) are the hash permutations

    def __init__(self, threshold: float, bands: int = 16, rows: int = 4):
        self.threshold, self.bands, self.rows = threshold, bands, rows
        rng = np.random.default_rng(0)
        n = bands * rows
        self.a = [int(x) for x in rng.integers(1, self._P, n, dtype=np.int64)]
        self.b = [int(x) for x in rng.integers(0, self._P, n, dtype=np.int64)]
        self.buckets: dict[tuple, list[int]] = {}
        self.sets: list[frozenset] = []

    def _signature(self, sh: frozenset) -> list[int]:
        xs = [int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little") for s in sh]
        return [min((a * x + b) % self._P for x in xs) for a, b in zip(self.a, self.b)]

    def _keys(self, sig: list[int]) -> Iterable[tuple]:
        r = self.rows
        return ((band, *sig[band * r:(band + 1) * r]) for band in range(self.bands))

    def find(self, text: str) -> float:
        """The highest Jaccard similarity of `text` with an added text among the candidates (0 if none)."""
        sh = shingles(text)
        seen = {i for key in self._keys(self._signature(sh)) for i in self.buckets.get(key, ())}
        return max((jaccard(sh, self.sets[i]) for i in seen), default=0.0)

    def is_near(self, text: str) -> bool:
        return self.find(text) >= self.threshold

    def add(self, text: str) -> None:
        sh = shingles(text)
        i = len(self.sets)
        self.sets.append(sh)
        for key in self._keys(self._signature(sh)):
            self.buckets.setdefault(key, []).append(i)


@dataclass
class FilterSettings:
    min_chars: int = 16
    max_chars: int = 1500
    min_logprob: float = -3.0
    max_logprob: float = -0.3
    near_dup: float = 0.8


@dataclass
class Candidate:
    """One sampled request."""

    index: int  # candidate index in the run (with --offset)
    turn: int  # 1 or 2
    prefix: list[int]  # the template (and conversation) it was sampled after
    ids: list[int]  # its tokens, the end-of-turn token excluded
    finish: str  # the engine's finish reason: "stop" = ended with the end-of-turn token
    text: str = ""
    logprob: float | None = None
    dropped: str | None = None  # the filter that dropped it


@dataclass
class RequestFilter:
    """The filters of the module docstring, with the counts of what each one saw and dropped."""

    tok: object
    overlaps: Callable[[str], bool] | None  # prompts.OverlapFilter.overlaps (None: no evaluation overlap check)
    settings: FilterSettings
    counts: dict[int, dict[str, dict[str, int]]] = field(  # turn -> filter -> {"in", "dropped"}
        default_factory=lambda: {t: {f: {"in": 0, "dropped": 0} for f in FILTERS} for t in (1, 2)})

    examples: dict[int, dict[str, list[str]]] = field(  # turn -> filter -> the first few texts it dropped
        default_factory=lambda: {t: {f: [] for f in FILTERS} for t in (1, 2)})

    def __post_init__(self):
        specials = [t for t, ty in zip(self.tok.token_texts, self.tok.token_type) if ty == 3 and t]  # CONTROL
        self.specials = sorted(set(specials), key=len, reverse=True)
        self.exact: set[str] = set()
        self.near = NearDuplicates(self.settings.near_dup)

    def remember(self, text: str) -> None:
        """A request already kept elsewhere (another piece of the run): its duplicates are dropped."""
        self.exact.add(normalize(text))
        self.near.add(text)

    def _count(self, c: Candidate, name: str, ok: bool) -> bool:
        n = self.counts[c.turn][name]
        n["in"] += 1
        if not ok:
            n["dropped"] += 1
            c.dropped = name
            if len(self.examples[c.turn][name]) < 5:
                self.examples[c.turn][name].append(c.text)
        return ok

    def text_checks(self, c: Candidate) -> bool:
        """finished .. overlap: the checks of one text alone."""
        s, raw = self.settings, self.tok.decode(c.ids)
        c.text = self.tok.decode(c.ids, skip_special=True).strip()
        text = c.text
        body = [ch for ch in text if not ch.isspace()]
        return (self._count(c, "finished", c.finish == "stop")
                and self._count(c, "length", s.min_chars <= len(text) <= s.max_chars and len(text.split()) >= 3)
                and self._count(c, "template", not any(sp in raw for sp in self.specials)
                                and not _SPECIAL_LIKE.search(raw) and not _ROLE_LINE.search(raw))
                and self._count(c, "printable", "\ufffd" not in text
                                and sum(ch.isprintable() or ch in "\n\t" for ch in text) >= 0.98 * len(text)
                                and sum(ch.isalpha() for ch in body) >= 0.6 * len(body))
                and self._count(c, "overlap", self.overlaps is None or not self.overlaps(text)))

    def final_checks(self, c: Candidate) -> bool:
        """logprob and the duplicate checks against what is kept so far; keeps `c` when it passes."""
        s = self.settings
        key = normalize(c.text)
        ok = (self._count(c, "logprob", s.min_logprob <= c.logprob <= s.max_logprob)
              and self._count(c, "exact_dup", key not in self.exact)
              and self._count(c, "near_dup", not self.near.is_near(c.text)))
        if ok:
            self.remember(c.text)
        return ok

    def report(self, turn: int) -> dict[str, dict]:
        """Per filter of one turn's samples: what reached it, what it dropped, the share it kept, and the
        first few texts it dropped."""
        return {f: {**v, "kept_share": round(1 - v["dropped"] / v["in"], 4) if v["in"] else None,
                    "dropped_examples": self.examples[turn][f]} for f, v in self.counts[turn].items()}


# ---- generation and scoring ------------------------------------------------------------------------

def mean_logprobs(model, seqs: Sequence[tuple[list[int], list[int]]], n_seq: int, context: int,
                  row_budget: int = 1024) -> list[float]:
    """Mean log-probability (temperature 1) of each `tokens` after its `prefix`, for (prefix, tokens)
    pairs: batched prefill, up to `n_seq` sequences and `row_budget` rows a forward."""
    cache = model.new_cache(n_seq, context)
    out: list[float] = []
    i = 0
    while i < len(seqs):
        toks, pos, sids, rows, lens = [], [], [], [], []
        while i < len(seqs) and len(lens) < n_seq and (not lens or len(toks) + sum(map(len, seqs[i])) <= row_budget):
            prefix, gen = seqs[i]
            slot = len(lens)
            cache.clear(slot)
            full = list(prefix) + list(gen)
            a = len(toks)
            toks += full
            pos += range(len(full))
            sids += [slot] * len(full)
            rows += range(a + len(prefix) - 1, a + len(full) - 1)
            lens.append(len(gen))
            i += 1
        logits = model.forward(toks, pos, sids, cache, logits_rows=rows).logits
        lp = torch.log_softmax(logits.float(), -1)
        nxt = torch.tensor([toks[r + 1] for r in rows], dtype=torch.long, device=lp.device)
        picked = lp.gather(1, nxt[:, None])[:, 0].cpu()
        j = 0
        for n in lens:
            out.append(float(picked[j:j + n].mean()))
            j += n
    return out


@dataclass
class SelfPromptSettings:
    n: int
    seed: int = 0
    offset: int = 0
    turns: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_request_tokens: int = 128
    answer_tokens: int = 384  # the first answer before a follow-up (train data's default --max-tokens)
    parallel: int = 16
    context: int = 2048
    system: str | None = None


def self_prompts(target, settings: SelfPromptSettings, flt: RequestFilter) -> list[dict]:
    """Sample, filter and (turns=2) extend `settings.n` candidate requests; returns the output records
    {"turns", "source", "seed", "index", "logprob"} in candidate order. `flt.counts` has what each
    filter did."""
    s, tok, model = settings, target.tokenizer, target.model
    engine = Engine(target, [], n_parallel=s.parallel, max_ctx=s.context)
    sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p)

    def run(reqs: list, desc: str) -> list:
        from tqdm import tqdm

        with tqdm(total=len(reqs), unit="seq", file=sys.stderr, desc=desc) as bar:
            return engine.run(reqs, on_finish=lambda _res: bar.update(1))

    def sample(jobs: list[tuple[int, list[int]]], turn: int) -> list[Candidate]:
        """One request per (candidate index, prefix ids), sampled and filtered."""
        reqs = [Request(prefix, s.max_request_tokens, i, sampling=sampling, seed=sample_seed(s.seed, i, turn))
                for i, prefix in jobs]
        results = run(reqs, "first requests" if turn == 1 else "follow-up requests")
        cands = [Candidate(r.id, turn, r.prompt_ids, r.token_ids, r.finish_reason) for r in results]
        ok = [c for c in cands if flt.text_checks(c)]
        scores = mean_logprobs(model, [(c.prefix, c.ids) for c in ok], s.parallel, s.context)
        for c, lp in zip(ok, scores):
            c.logprob = lp
        for c in ok:  # in candidate order: the first of duplicates is kept, whatever the batching
            flt.final_checks(c)
        return cands

    first_prefix = user_turn_prefix(tok, [], s.system)
    firsts = [c for c in sample([(s.offset + k, first_prefix) for k in range(s.n)], 1) if c.dropped is None]
    records = {c.index: {"turns": [c.text], "source": "self", "seed": s.seed, "index": c.index,
                         "logprob": [round(c.logprob, 3)]} for c in firsts}
    if s.turns == 2 and firsts:
        asked = [[{"role": "user", "content": c.text}] for c in firsts]
        greedy = [Request(prompt_ids(tok, msgs, True, s.system), s.answer_tokens, c.index, sampling=SamplingParams())
                  for c, msgs in zip(firsts, asked)]
        fits = [r for r in greedy if len(r.prompt_ids) + 1 < s.context]
        answers = {r.id: r for r in run(fits, "answers")}
        jobs = []
        for c, msgs in zip(firsts, asked):
            if c.index in answers:  # the answer as `specplug bench` and `run` feed it to the next turn
                text = tok.decode(answers[c.index].token_ids, skip_special=True)
                prefix = user_turn_prefix(tok, msgs + [{"role": "assistant", "content": text}], s.system)
                if len(prefix) + s.max_request_tokens < s.context:
                    jobs.append((c.index, prefix))
        for c in sample(jobs, 2):
            if c.dropped is None:
                records[c.index]["turns"].append(c.text)
                records[c.index]["logprob"].append(round(c.logprob, 3))
    return [records[i] for i in sorted(records)]
