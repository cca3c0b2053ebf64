"""Fake speculators for the host's own tests: random, oracle, scripted and misbehaving drafts."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from specplug.hooks import hookimpl
from specplug.types import Draft, DraftRequest, EmbeddingRequest, TargetInfo


class _Base:
    @dataclass(frozen=True)
    class Params:
        pass

    def __init__(self, params=None, target: TargetInfo | None = None):
        self.params = params
        self.target = target


class RandomDrafts(_Base):
    """Proposes random tokens of random length: almost always rejected."""

    def __init__(self, vocab_size: int, seed: int = 0, max_len: int = 6):
        super().__init__()
        self.vocab, self.rng, self.max_len = vocab_size, random.Random(seed), max_len

    @hookimpl
    def draft(self, requests):
        return [Draft(tuple(self.rng.randrange(self.vocab)
                           for _ in range(self.rng.randint(1, min(self.max_len, r.n_max)))))
                for r in requests]


class Oracle(_Base):
    """Knows the plain greedy continuation of each prompt: proposes it (optionally corrupted)."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], corrupt_every: int = 0):
        super().__init__()
        self.cont = continuations  # prompt ids -> greedy generated ids
        self.corrupt_every = corrupt_every
        self.calls = 0

    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]):
        out = []
        for r in requests:
            self.calls += 1
            toks = list(r.tokens)
            for prompt, gen in self.cont.items():
                n = len(prompt)
                if tuple(toks[:n]) == prompt and toks[n:] == gen[: len(toks) - n]:
                    d = gen[len(toks) - n: len(toks) - n + r.n_max]
                    if self.corrupt_every and d and self.calls % self.corrupt_every == 0:
                        d = d[:-1] + [(d[-1] + 1) % 256 + 3]
                    out.append(Draft(tuple(d)) if d else None)
                    break
            else:
                out.append(None)
        return out


class Scripted(_Base):
    """Proposes a fixed list of drafts in turn (per call, the same for every sequence)."""

    def __init__(self, script: list[tuple[int, ...]]):
        super().__init__()
        self.script, self.i = script, 0

    @hookimpl
    def draft(self, requests):
        d = self.script[self.i % len(self.script)]
        self.i += 1
        return [Draft(tuple(d[: r.n_max])) if d else None for r in requests]


class Faulty(_Base):
    """Misbehaves after `after` calls: mode 'raise', 'oov' (token id out of vocabulary),
    'too_long' (more than n_max tokens), 'bad_len' (wrong number of results), 'bad_probs',
    'writes_kv' (writes the target's layer-0 keys it reads through DraftRequest.kv)."""

    def __init__(self, mode: str, vocab_size: int, after: int = 2):
        super().__init__()
        self.mode, self.vocab, self.after, self.calls = mode, vocab_size, after, 0

    @hookimpl
    def draft(self, requests):
        self.calls += 1
        if self.calls <= self.after:
            return [Draft((5, 6)) if r.n_max >= 2 else None for r in requests]
        if self.mode == "raise":
            raise RuntimeError("faulty speculator exploded")
        if self.mode == "oov":
            return [Draft((self.vocab + 7,)) for _ in requests]
        if self.mode == "too_long":
            return [Draft(tuple([5] * (r.n_max + 1))) for r in requests]
        if self.mode == "bad_len":
            return [None] * (len(requests) + 1)
        if self.mode == "bad_probs":
            import torch

            return [Draft((5,), torch.ones(1, 3)) for _ in requests]
        if self.mode == "writes_kv":
            requests[0].kv[0].k.zero_()
        raise ValueError(self.mode)

    @hookimpl
    def request_embeddings(self, target):
        return EmbeddingRequest(kv_layers=(0,)) if self.mode == "writes_kv" else None

    @hookimpl
    def process_batch(self, batch, encoded):
        if self.mode == "raise" and self.calls > self.after:
            raise RuntimeError("process_batch exploded too")

