"""The head toolkit's parts one at a time: the state keeper, the drafting loop's stop rule (the host's
break-even included), parallel heads drafting losslessly, and their training masks."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from specplug.heads import (
    Calibrator,
    DraftLoop,
    ParallelHeadsDrafter,
    StateKeeper,
    assert_draft_aligned,
    newest_state_position,
)
from specplug.heads.masks import ahead, parallel_mask
from specplug.testing import assert_greedy_equal, speculator
from specplug.types import Batch, DraftRequest


def _batch(tokens, positions, seqs, d=3):
    n = len(tokens)
    return Batch(torch.tensor(tokens), torch.tensor(positions), torch.tensor(seqs),
                 {"final": torch.arange(n * d, dtype=torch.float32).view(n, d)})


def test_state_keeper_keeps_the_newest_state_and_breaks_on_a_gap():
    resets = []
    k = StateKeeper(2, on_reset=resets.append)
    b = _batch([5, 6, 7, 9], [0, 1, 2, 0], [0, 0, 0, 1])
    rows, prev = k.receive(b, b.embeddings["final"], with_prev=True)
    assert rows == [0, 1, 2, 3] and prev[0] is None and torch.equal(prev[2], b.embeddings["final"][1])
    assert k.received == [3, 1] and torch.equal(k.last[0], b.embeddings["final"][2])
    req = DraftRequest(0, (5, 6, 7, 8), 4)
    assert k.ready(req) and newest_state_position(req.tokens) == 2
    assert_draft_aligned(k.received[0], req.tokens)
    with pytest.raises(AssertionError, match="needs h"):
        assert_draft_aligned(2, req.tokens, 0)
    k.receive(_batch([1], [5], [1]))  # position 5 after 1: rows were missed
    assert k.broken[1] and not k.ready(DraftRequest(1, (9, 1, 1, 1, 1, 1, 2), 4))
    k.receive(_batch([3], [0], [1]))  # restarts at 0
    assert resets == [1] and not k.broken[1] and k.received[1] == 1
    k.remove(0, 2)  # a committed row taken back
    assert k.broken[0]
    k.remove(0, 0)
    assert k.received[0] == 0 and resets == [1, 0]


class _Target:  # what DraftLoop reads of a TargetInfo
    vocab_size, eot_ids, max_ctx, device = 4, frozenset({3}), 64, torch.device("cpu")


def _loop(stop_below=0.0):
    return DraftLoop(_Target(), torch.arange(4), 0.0, stop_below, Calibrator(enabled=False))


def _count_forwards(loop, reqs, p_first=0.5):
    """Run the loop with token 1 at probability p_first, then certain tokens; count the forwards."""
    calls = []
    logit = torch.tensor([0.0, 0.0, -1e9, -1e9]) if p_first == 0.5 else torch.tensor([-1e9, 0.0, -1e9, -1e9])

    def advance(depth, rows, tokens, live):
        calls.append((depth, list(live)))
        return loop.pick(torch.tensor([[-1e9, 0.0, -1e9, -1e9]]).repeat(len(rows), 1))

    out = loop.run(reqs, list(range(len(reqs))), loop.pick(logit.repeat(len(reqs), 1)), advance)
    return out, calls


def test_the_loop_stops_before_a_forward_the_host_would_trim():
    free = DraftRequest(0, (1, 2), 5)
    priced = DraftRequest(1, (1, 2), 5, break_even=(0.2, 0.6, 0.6, 0.6, 0.6))
    out, calls = _count_forwards(_loop(), [free, priced])
    assert len(out[0]) == 5 and out[0].confidence[0] == pytest.approx(0.5)
    # after token 0 the cumulative probability is 0.5 < break_even[1]: no forward for token 1
    assert len(out[1]) == 1 and all(live == [0] for _, live in calls) and len(calls) == 4
    out, calls = _count_forwards(_loop(stop_below=0.6), [free])  # the plugin's own stop rule
    assert len(out[0]) == 1 and calls == []


def test_the_loop_stops_at_an_end_of_turn_n_max_and_the_context_end():
    loop = _loop()
    eot = torch.tensor([[-1e9, -1e9, -1e9, 0.0]])
    out = loop.run([DraftRequest(0, (1,), 5)], [0], loop.pick(eot), lambda *a: pytest.fail("forward after an EOT"))
    assert out[0].token_ids == (3,)
    out, calls = _count_forwards(loop, [DraftRequest(0, (1,), 2), DraftRequest(1, (1,) * 62, 5)], p_first=1.0)
    assert len(out[0]) == 2 and len(out[1]) == 2  # n_max 2; 64 - 62 positions left


def test_run_block_cuts_where_the_host_would_trim():
    loop = _loop()
    logits = torch.tensor([[0.0, 0.0, -1e9, -1e9], [-1e9, 0.0, -1e9, -1e9], [-1e9, 0.0, -1e9, -1e9]])
    reqs = [DraftRequest(0, (1,), 8, break_even=(0.1, 0.4, 0.4)), DraftRequest(1, (1,), 8, break_even=(0.1, 0.9))]
    out = loop.run_block(reqs, [0, 1], torch.cat([logits, logits]), [3, 3])
    assert out[0].token_ids == (0, 1, 1) and out[1].token_ids == (0,)


def test_parallel_mask_lines_up_head_k_with_the_distribution_of_token_s_plus_2_plus_k():
    from types import SimpleNamespace

    T = 8
    has = torch.zeros(1, T, dtype=torch.bool)
    has[0, 2:T - 1] = True  # the prompt ends at row 2; the last row has no next token
    b = SimpleNamespace(tokens=torch.zeros(1, T, dtype=torch.long), has_dist=has, dist_start=torch.tensor([2]))
    # state row s is scored for head k when row s + 1 + k has a distribution and s + 1 >= 2
    assert parallel_mask(b, 0)[0].nonzero().flatten().tolist() == [1, 2, 3, 4, 5]
    assert parallel_mask(b, 1)[0].nonzero().flatten().tolist() == [1, 2, 3, 4]
    assert ahead(torch.arange(T).view(1, T), 2)[0].tolist() == [2, 3, 4, 5, 6, 7, 0, 0]


class _LinearHeads:
    """Parallel heads for the tiny target: head k = the target's output projection of h + k * e(x)."""

    def __init__(self, target_info, depths=3):
        self.depths = depths
        self.d2t = torch.arange(target_info.vocab_size)
        self.emb = target_info.token_embeddings
        self.w = target_info.token_embeddings[torch.arange(target_info.vocab_size)]

    def logits(self, states, token_ids):
        e = self.emb[torch.tensor(token_ids)]
        return torch.stack([(states + k * e) @ self.w.T for k in range(self.depths)], 1)


class Medusa(ParallelHeadsDrafter):
    @dataclasses.dataclass(frozen=True)
    class Params:
        depths: int = 3

    def __init__(self, params, target):
        self.setup(_LinearHeads(target, params.depths), target, target.n_embd, stop_below=0.0)

    from specplug.hooks import hookimpl

    @hookimpl
    def request_embeddings(self, target):
        from specplug.types import EmbeddingRequest

        return EmbeddingRequest(final=True)


def test_parallel_heads_draft_losslessly_with_parallel_sequences(tiny_target, tiny_target_info):
    prompts = [tiny_target.tokenizer.encode(t) for t in ("the cat sat on the mat", "a dog ran", "the the the")]
    spec = speculator(Medusa(Medusa.Params(), tiny_target_info), "medusa", cost_trim=False)
    eng = assert_greedy_equal(tiny_target, [spec], prompts, 24, n_parallel=3)
    st = eng.stats.speculators["medusa"]
    assert st.drafted_tokens > 20


def test_pair_lookup_proposes_what_followed_the_last_occurrence_of_the_last_two_tokens():
    from specplug.heads.lookup import NONE, batch_lookups, pair_lookup, sequence_lookups

    #        0  1  2  3  4  5  6  7  8
    toks = [5, 6, 7, 5, 6, 8, 5, 6, 9]
    got = sequence_lookups(toks)
    # (5, 6) at 3-4 last occurred at 0-1, followed by 7; at 6-7 last at 3-4, followed by 8
    assert got[4] == 7 and got[7] == 8
    assert got[:4] == [NONE] * 4 and got[5] == got[6] == got[8] == NONE
    assert pair_lookup(toks[:5]) == 7 and pair_lookup(toks[:8]) == 8 and pair_lookup(toks) == NONE
    assert pair_lookup([]) == pair_lookup([1]) == pair_lookup([1, 1]) == NONE
    assert pair_lookup([1, 1, 1]) == 1  # (1, 1) at 0-1, followed by the row's own token
    gen = torch.Generator().manual_seed(0)
    for n in (3, 40, 300):  # the one-pass and the per-row forms agree on every prefix
        seq = torch.randint(0, 4, (n,), generator=gen).tolist()
        assert [pair_lookup(seq[:t + 1]) for t in range(n)] == sequence_lookups(seq)
    batch = torch.tensor([[5, 6, 7, 5, 6, 0, 0], [1, 1, 1, 1, 1, 1, 1]])
    look = batch_lookups(batch, [5, 7])
    assert look[0].tolist() == sequence_lookups([5, 6, 7, 5, 6]) + [NONE, NONE]  # padding has none
    assert look[1].tolist() == sequence_lookups([1] * 7)


def test_a_longer_lookup_proposes_what_followed_the_last_occurrence_of_the_longest_match():
    from specplug.heads.lookup import NONE, batch_lookups, pair_lookup, sequence_lookups

    #        0  1  2  3  4  5  6  7  8  9 10
    toks = [1, 5, 6, 7, 2, 5, 6, 8, 1, 5, 6]
    # row 10 ends (1, 5, 6): the pair (5, 6) last occurred at 5-6 (then 8), the 3-gram only at 0-2 (then 7)
    assert pair_lookup(toks) == 8 and pair_lookup(toks, 3) == pair_lookup(toks, 6) == 7
    assert sequence_lookups(toks)[10] == 8 and sequence_lookups(toks, 3)[10] == 7
    # without a longer match the pair's proposal stands; a longer one that occurred twice: its last
    assert sequence_lookups(toks, 3)[6] == sequence_lookups(toks)[6] == 7
    assert pair_lookup([3, 1, 2, 9, 3, 1, 2, 8, 3, 1, 2], 4) == 8
    assert pair_lookup([1, 2], 6) == pair_lookup([7, 1, 2, 3], 6) == NONE
    brute_gen = torch.Generator().manual_seed(1)
    for length in (2, 30, 200):
        seq = torch.randint(0, 3, (length,), generator=brute_gen).tolist()
        for n in (2, 3, 5):
            want = []
            for t in range(length):  # the longest m-gram ending at t seen before, its last occurrence
                best = NONE
                for m in range(min(n, t + 1), 1, -1):
                    ends = [j for j in range(m - 1, t) if seq[j - m + 1:j + 1] == seq[t - m + 1:t + 1]]
                    if ends:
                        best = seq[ends[-1] + 1]
                        break
                want.append(best)
            assert sequence_lookups(seq, n) == want and [pair_lookup(seq[:t + 1], n) for t in range(length)] == want
    look = batch_lookups(torch.tensor([toks, toks[::-1]]), [11, 7], 3)
    assert look[0].tolist() == sequence_lookups(toks, 3) and look[1, :7].tolist() == sequence_lookups(toks[::-1][:7], 3)


def test_the_chained_lookup_follows_the_longest_match_through_its_own_proposals():
    from specplug.heads.lookup import NONE, anchor_chains, chain_lookup, sequence_lookups

    gen = torch.Generator().manual_seed(2)
    for length in (3, 25, 60):
        seq = torch.randint(0, 3, (length,), generator=gen).tolist()
        for n in (2, 3, 5):
            for c in range(length):
                want, v = [], seq[:c + 1]
                for _ in range(4):  # the history grows by each proposal; matches end before c
                    best = None
                    for m in range(min(n, len(v)), 1, -1):
                        ends = [j for j in range(m - 1, c) if seq[j - m + 1:j + 1] == v[len(v) - m:]]
                        if ends:
                            best = seq[ends[-1] + 1]
                            break
                    if best is None or c < 2:
                        break
                    v, want = v + [best], want + [best]
                want += [NONE] * (4 - len(want))
                assert chain_lookup(seq[:c + 1], 4, n) == want, (seq, n, c)
                assert want[0] == (sequence_lookups(seq[:c + 1], n)[c] if c >= 2 else NONE)
            chains = anchor_chains(torch.tensor([seq]), [length], torch.arange(length).view(1, -1), 4, n)
            assert [chains[0, c].tolist() for c in range(length)] == [chain_lookup(seq[:c + 1], 4, n)
                                                                     for c in range(length)]
