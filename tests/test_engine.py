"""The draft -> verify -> rollback loop: lossless greedy, batching, faulty plugins, adaptivity."""
from __future__ import annotations

import pytest
import torch

from specplug.engine import Request
from specplug.hooks import hookimpl
from specplug.pricing import Pricing
from specplug.testing import (
    Faulty,
    Oracle,
    RandomDrafts,
    Scripted,
    assert_greedy_equal,
    greedy_outputs,
    make_engine,
    speculator,
)
from specplug.types import Draft, EmbeddingRequest

TEXTS = ["hello there the", "in the beginning was", "a", "on the other hand, the", "xyz 123",
         "the the the", "she sells sea shells", "onion"]


@pytest.fixture(scope="module")
def prompts(tiny_target):
    return [tiny_target.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def plain(tiny_target, prompts):
    return greedy_outputs(tiny_target, [], prompts, 40)[0]


def test_plain_decoding_is_deterministic_and_varied(tiny_target, prompts, plain):
    again, _ = greedy_outputs(tiny_target, [], prompts, 40, n_parallel=3)
    assert again == plain
    assert all(len(set(p)) > 5 for p in plain)  # the tiny model is not degenerate


def test_sequence_times_split_prefill_from_decoding(tiny_target, prompts):
    eng = make_engine(tiny_target, [], n_parallel=2)
    res = eng.run([Request(p, 12) for p in prompts[:3]])
    for r in res:
        assert 0 < r.stats.time_prefill_s < r.stats.time_s <= eng.stats.time_total_s
        assert r.stats.to_dict()["time_s"]["prefill"] == round(r.stats.time_prefill_s, 4)


@pytest.mark.parametrize("n_parallel", [1, 3, 8])
def test_random_drafts_never_change_greedy_output(tiny_target, prompts, n_parallel):
    vocab = tiny_target.model.config.vocab_size
    eng = assert_greedy_equal(tiny_target, [RandomDrafts(vocab, seed=n_parallel)], prompts, 40, n_parallel=n_parallel)
    assert eng.stats.speculators["RandomDrafts"].drafted_tokens > 0


@pytest.mark.parametrize("n_parallel", [1, 4])
def test_oracle_is_fully_accepted_and_lossless(tiny_target, prompts, plain, n_parallel):
    oracle = Oracle({tuple(p): g for p, g in zip(prompts, plain)})
    eng = assert_greedy_equal(tiny_target, [oracle], prompts, 40, n_parallel=n_parallel)
    st = eng.stats.speculators["Oracle"]
    assert st.accepted_tokens == st.drafted_tokens > 0
    assert eng.stats.target_forwards < sum(len(p) for p in plain) / 3  # many tokens per forward


def test_corrupted_oracle_partial_acceptance_is_lossless(tiny_target, prompts, plain):
    oracle = Oracle({tuple(p): g for p, g in zip(prompts, plain)}, corrupt_every=2)
    eng = assert_greedy_equal(tiny_target, [oracle], prompts, 40, n_parallel=4)
    st = eng.stats.speculators["Oracle"]
    assert 0 < st.accepted_tokens < st.drafted_tokens


def test_scripted_drafts_and_chaining_picks_best(tiny_target, prompts, plain):
    vocab = tiny_target.model.config.vocab_size
    oracle = Oracle({tuple(p): g for p, g in zip(prompts, plain)})
    specs = [Scripted([(5, 6, 7), (), (9,)]), RandomDrafts(vocab, seed=1), oracle]
    eng = assert_greedy_equal(tiny_target, specs, prompts, 40, n_parallel=3, allow_unverified=True)
    s = eng.stats.speculators
    # the oracle's measured acceptance makes it win nearly every sequence after a few steps
    assert s["Oracle"].drafts > 3 * (s["Scripted"].drafts + s["RandomDrafts"].drafts)


def test_each_sequence_in_a_batch_equals_its_solo_run(tiny_target, prompts):
    vocab = tiny_target.model.config.vocab_size
    batched, _ = greedy_outputs(tiny_target, [RandomDrafts(vocab, seed=7)], prompts, 30, n_parallel=8)
    for p, b in zip(prompts, batched):
        solo, _ = greedy_outputs(tiny_target, [RandomDrafts(vocab, seed=7)], [p], 30)
        assert solo[0] == b


@pytest.mark.parametrize("mode", ["raise", "oov", "too_long", "bad_len", "bad_probs"])
def test_faulty_speculator_is_disabled_and_text_unchanged(tiny_target, prompts, plain, mode):
    vocab = tiny_target.model.config.vocab_size
    bad = speculator(Faulty(mode, vocab), name="faulty")
    eng = assert_greedy_equal(tiny_target, [bad], prompts, 40, n_parallel=3, allow_disabled=True)
    assert "faulty" in eng.stats.disabled
    assert not bad.enabled


def test_dead_drafts_back_off(tiny_target, prompts):
    vocab = tiny_target.model.config.vocab_size
    rnd = RandomDrafts(vocab, seed=3)
    eng = make_engine(tiny_target, [rnd])
    eng.run([Request(prompts[0], 60)])
    drafts = eng.stats.speculators["RandomDrafts"].drafts
    assert drafts < 30  # paused after repeated rejections instead of drafting every step


def test_max_tokens_and_stop_tokens(tiny_target, prompts, plain):
    oracle = Oracle({tuple(p): g for p, g in zip(prompts, plain)})
    eng = make_engine(tiny_target, [oracle])
    res = eng.run([Request(p, 7) for p in prompts])
    assert all(len(r.token_ids) == 7 and r.finish_reason == "length" for r in res)
    assert [r.token_ids for r in res] == [p[:7] for p in plain]
    # a stop token inside an accepted draft ends the sequence there
    stop = plain[0][5]
    eng = make_engine(tiny_target, [Oracle({tuple(prompts[0]): plain[0]})])
    eng.stop_ids = frozenset({stop})
    r = eng.run([Request(prompts[0], 40)])[0]
    assert r.finish_reason == "stop" and r.token_ids == plain[0][: plain[0].index(stop)]


class Recorder:
    """Asks for embeddings and records what process_batch / remove receive."""

    @classmethod
    def make(cls, n_layer):
        self = cls()
        self.n_layer = n_layer
        self.batches, self.removed, self.results, self.encoded = [], [], [], []
        return self

    @hookimpl
    def request_embeddings(self, target):
        return EmbeddingRequest(layers=(1,), final=True)

    @hookimpl
    def encode(self, batch):
        return batch.embeddings["final"] * 2

    @hookimpl
    def process_batch(self, batch, encoded):
        self.batches.append(batch)
        self.encoded.append(encoded)

    @hookimpl
    def draft(self, requests):
        return [Draft((7, 8, 9)[: r.n_max]) for r in requests]

    @hookimpl
    def verified(self, results):
        self.results.extend(results)

    @hookimpl
    def remove(self, seq_id, p0):
        self.removed.append((seq_id, p0))


def test_process_batch_sees_exactly_the_committed_context(tiny_target, prompts):
    rec = Recorder.make(tiny_target.model.config.n_layer)
    eng = make_engine(tiny_target, [rec], n_parallel=2)
    res = eng.run([Request(prompts[1], 20), Request(prompts[3], 20)])
    for slot, (p, r) in enumerate(zip([prompts[1], prompts[3]], res)):
        toks, pos = [], []
        for b in rec.batches:
            mask = b.seq_ids == slot
            toks += b.token_ids[mask].tolist()
            pos += b.positions[mask].tolist()
        # positions 0..n-1, contiguous and in order; tokens = prompt + generated (minus the last,
        # which was never fed back to the target)
        assert pos == list(range(len(pos)))
        full = p + r.token_ids
        assert toks == full[: len(toks)] and len(toks) >= len(full) - 1
    # embeddings: per batch, aligned with rows, and equal to a fresh forward's hidden states
    m = tiny_target.model
    first = rec.batches[0]
    assert set(first.embeddings) == {1, "final"}
    ref = m.forward(first.token_ids.tolist(), first.positions.tolist(), [0] * len(first), m.new_cache(1, 64),
                    taps={1, m.config.n_layer})
    torch.testing.assert_close(first.embeddings[1], ref.hidden[1])
    torch.testing.assert_close(rec.encoded[0], ref.hidden[m.config.n_layer] * 2)
    assert any(p0 > 0 for _, p0 in rec.removed)  # rejected drafts were rolled back
    assert {(0, 0), (1, 0)} <= set(rec.removed)  # sequence ends
    assert rec.results and all(v.n_accepted <= v.n_drafted for v in rec.results)


def test_stochastic_run_is_reproducible_with_a_seed(tiny_target, prompts, plain):
    from specplug.sampling import SamplingParams

    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    vocab = tiny_target.model.config.vocab_size
    outs = []
    for _ in range(2):
        # unpriced: priced drafting decides from measured times, and which drafts are verified
        # changes how the sampling stream is consumed (the distribution is the same, the text not)
        eng = make_engine(tiny_target, [speculator(RandomDrafts(vocab, seed=2), cost_trim=False)], sampling=sp,
                          n_parallel=2)
        outs.append([r.token_ids for r in eng.run([Request(p, 20) for p in prompts[:4]])])
    assert outs[0] == outs[1]
    assert outs[0] != [p[:20] for p in plain[:4]]  # it really sampled


def test_empty_and_too_long_prompts(tiny_target):
    from specplug.errors import SpecplugError

    eng = make_engine(tiny_target, [], max_ctx=32)
    with pytest.raises(SpecplugError, match="prompt is empty"):
        eng.run([Request([], 5)])
    with pytest.raises(SpecplugError, match="token id 999999 is outside the vocabulary"):
        eng.run([Request([5, 999999], 5)])
    with pytest.raises(SpecplugError, match="context size 32"):
        eng.run([Request(list(range(40)), 5)])


class _Confident(Oracle):
    """The oracle's drafts with confidences: conf[seq_id][i] for token i."""

    def __init__(self, cont, conf):
        super().__init__(cont)
        self.conf = conf

    @hookimpl
    def draft(self, requests):
        out = super().draft(requests)
        return [Draft(d.token_ids, confidence=tuple(self.conf[r.seq_id][:len(d)])) if d else None
                for r, d in zip(requests, out)]


def _linear_cost(monkeypatch, target, per_row):
    monkeypatch.setattr(Pricing, "cost", lambda self, n: 1.0 + per_row * (n - 1))


def test_confidences_trim_drafts_to_the_rows_that_pay(tiny_target, prompts, plain, monkeypatch):
    _linear_cost(monkeypatch, tiny_target, 0.3)
    cont = {tuple(p): g for p, g in zip(prompts, plain)}
    # cumulative 0.9, 0.81, 0.16: the third row costs 0.3 and is expected to save 0.16
    conf = {0: [0.9, 0.9, 0.2] + [1.0] * 20}
    eng = assert_greedy_equal(tiny_target, [_Confident(cont, conf)], prompts[:1], 30)
    st = eng.stats.speculators["_Confident"]
    assert st.drafts > 0 and len(st.drafted_at) == 2 and st.accepted_tokens == st.drafted_tokens
    # the host policy cost_trim: false verifies them whole
    eng = assert_greedy_equal(tiny_target, [speculator(_Confident(cont, conf), cost_trim=False)], prompts[:1], 30)
    assert len(eng.stats.speculators["_Confident"].drafted_at) > 3
    # confident drafts are kept whole; hopeless ones are not verified at all
    eng = assert_greedy_equal(tiny_target, [_Confident(cont, {0: [0.97] * 30})], prompts[:1], 30)
    assert len(eng.stats.speculators["_Confident"].drafted_at) >= 8
    eng = assert_greedy_equal(tiny_target, [_Confident(cont, {0: [0.2] * 30})], prompts[:1], 30, allow_unverified=True)
    assert eng.stats.speculators["_Confident"].drafts == 0 and eng.stats.target_forwards == 30


def test_trimming_gives_rows_to_the_likeliest_tokens_of_the_batch(tiny_target, prompts, plain, monkeypatch):
    # rows 3 and 4 of a forward are cheap (0.1 each), a fifth costs more than any token saves
    monkeypatch.setattr(Pricing, "cost", lambda self, n: 1.0 + 0.1 * (n - 1) if n <= 4 else 10.0 * n)
    cont = {tuple(p): g for p, g in zip(prompts, plain)}
    conf = {0: [0.9] * 40, 1: [0.5] * 40}  # cumulative 0.9, 0.81, ... vs 0.5, 0.25, ...
    eng = make_engine(tiny_target, [_Confident(cont, conf)], n_parallel=2)
    res = eng.run([Request(prompts[0], 30), Request(prompts[1], 5)])  # the second ends first
    assert [r.token_ids for r in res] == [plain[0][:30], plain[1][:5]]
    # while both ran, both cheap rows went to the likelier sequence, none to the other (alone, its
    # 0.5 would have paid for a 0.1 row); alone, the first one took all three cheap rows
    assert res[1].stats.drafted_tokens == 0
    assert res[0].stats.by_speculator["_Confident"].drafted_at[:3] == [8, 8, 4]


@pytest.mark.parametrize("conf", [(0.5,), (0.5, 1.5, 0.5), (0.5, float("nan"), 0.5), ("high", 0.5, 0.5)])
def test_bad_confidences_disable_the_speculator(tiny_target, prompts, plain, conf, caplog):
    class Bad(Oracle):
        @hookimpl
        def draft(self, requests):
            return [Draft((1, 2, 3), confidence=conf) for _ in requests]

    eng = assert_greedy_equal(tiny_target, [Bad({})], prompts[:2], 10, allow_disabled=True, allow_unverified=True)
    assert "confidence" in eng.stats.disabled["Bad"] and "3 numbers in [0, 1]" in eng.stats.disabled["Bad"]


def test_drafts_expected_to_cost_more_than_they_save_are_not_verified(tiny_target, prompts, monkeypatch):
    _linear_cost(monkeypatch, tiny_target, 0.3)
    vocab = tiny_target.model.config.vocab_size
    # random drafts: once the measured acceptance is below a row's cost (0.3), none is verified
    eng = assert_greedy_equal(tiny_target, [RandomDrafts(vocab, max_len=1)], prompts[:4], 40)
    st = eng.stats.speculators["RandomDrafts"]
    assert 0 < st.drafts <= 4  # the prior (1 of 2 accepted) pays for the first couple of tries
    eng = assert_greedy_equal(tiny_target, [speculator(RandomDrafts(vocab, max_len=1), cost_trim=False)],
                              prompts[:4], 40)
    assert eng.stats.speculators["RandomDrafts"].drafts > 20  # only the dead-draft back-off
