"""`SequentialHeadsDrafter`: heads where head k also reads the tokens drafted before it (Hydra-style)
draft through the `start` / `advance` seam, see the tokens their own earlier depths picked, stop
where the stop rule says, and draft losslessly with parallel sequences."""
from __future__ import annotations

import dataclasses

import torch

from specplug.heads import SequentialHeadsDrafter
from specplug.hooks import hookimpl
from specplug.testing import assert_greedy_equal, speculator
from specplug.types import Batch, DraftRequest, EmbeddingRequest


class _RunningSumHeads:
    """A tiny sequential head for the tiny target: the carry is h(c-1) plus the embeddings of x_c and
    of every token drafted so far; head k's logits are the target's embedding table times the carry."""

    def __init__(self, target_info, depths=3):
        self.depths = depths
        self.d2t = torch.arange(target_info.vocab_size)
        self.emb = target_info.token_embeddings[torch.arange(target_info.vocab_size)]
        self.calls: list[tuple[int, list[int]]] = []  # (depth, token ids) of each call

    def start(self, states, token_ids):
        self.calls.append((0, list(token_ids)))
        carry = states + self.emb[torch.tensor(token_ids)]
        return carry, carry @ self.emb.T

    def advance(self, depth, carry, token_ids):
        assert 1 <= depth < self.depths and carry.shape[0] == len(token_ids), (depth, carry.shape, token_ids)
        self.calls.append((depth, list(token_ids)))
        carry = carry + self.emb[torch.tensor(token_ids)]
        return carry, carry @ self.emb.T


class Hydra(SequentialHeadsDrafter):
    @dataclasses.dataclass(frozen=True)
    class Params:
        depths: int = 3

    def __init__(self, params, target, stop_below=0.0):
        self.setup(_RunningSumHeads(target, params.depths), target, target.n_embd, stop_below=stop_below)

    @hookimpl
    def request_embeddings(self, target):
        return EmbeddingRequest(final=True)


def _fed(spec, target_info, tokens, seq=0):
    """Give `spec` committed rows for tokens[:-1] of sequence `seq` (random final states)."""
    n = len(tokens) - 1
    h = torch.randn(n, target_info.n_embd, generator=torch.Generator().manual_seed(seq))
    spec.process_batch(Batch(torch.tensor(tokens[:-1]), torch.arange(n), torch.full((n,), seq), {"final": h}), None)
    return h[-1]


def test_each_depth_reads_the_tokens_drafted_before_it(tiny_target_info):
    spec = Hydra(Hydra.Params(depths=3), tiny_target_info)
    tokens = (5, 9, 2, 7)
    h = _fed(spec, tiny_target_info, tokens)
    (draft,) = spec.draft([DraftRequest(0, tokens, 8)])
    # the same three depths by hand: each pick feeds the next head
    emb = spec.heads.emb
    carry, want = h + emb[7], []
    for _ in range(3):
        want.append(int((carry @ emb.T).argmax()))
        carry = carry + emb[want[-1]]
    assert draft.token_ids == tuple(want)
    assert spec.heads.calls == [(0, [7]), (1, [want[0]]), (2, [want[1]])]  # never beyond `depths`


def test_advance_runs_only_for_the_rows_the_stop_rule_keeps(tiny_target_info):
    spec = Hydra(Hydra.Params(depths=4), tiny_target_info)
    for seq, tokens in enumerate([(5, 9, 2), (3, 3, 3, 1)]):
        _fed(spec, tiny_target_info, tokens, seq)
    reqs = [DraftRequest(0, (5, 9, 2), 1), DraftRequest(1, (3, 3, 3, 1), 3), DraftRequest(2, (4,), 0)]
    out = spec.draft(reqs)
    assert len(out[0]) == 1 and len(out[1]) == 3 and out[2] is None  # n_max 1, 3, and 0: no draft
    assert [(d, len(t)) for d, t in spec.heads.calls] == [(0, 2), (1, 1), (2, 1)]  # depth 1 on: sequence 1 only
    assert spec.heads.calls[1][1] == [out[1].token_ids[0]]


def test_a_sequence_out_of_step_gets_no_draft(tiny_target_info):
    spec = Hydra(Hydra.Params(), tiny_target_info)
    _fed(spec, tiny_target_info, (5, 9, 2))
    assert spec.draft([DraftRequest(0, (5, 9, 2, 4, 4), 3)]) == [None]  # rows 2 and 3 never came
    assert spec.heads.calls == []


def test_sequential_heads_draft_losslessly_with_parallel_sequences(tiny_target, tiny_target_info):
    prompts = [tiny_target.tokenizer.encode(t) for t in ("the cat sat on the mat", "a dog ran", "the the the")]
    spec = speculator(Hydra(Hydra.Params(), tiny_target_info), "hydra", cost_trim=False)
    eng = assert_greedy_equal(tiny_target, [spec], prompts, 24, n_parallel=3)
    st = eng.stats.speculators["hydra"]
    assert st.drafted_tokens > 20
