"""The step-driven engine API (add / step / abort) and per-request settings."""
from __future__ import annotations

import pytest

from specplug.engine import Request
from specplug.errors import SpecplugError
from specplug.sampling import SamplingParams
from specplug.testing import Oracle, RandomDrafts, greedy_outputs, make_engine, speculator

TEXTS = ["hello there the", "in the beginning was", "a", "on the other hand, the", "xyz 123", "the the the"]


@pytest.fixture(scope="module")
def prompts(tiny_target):
    return [tiny_target.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def plain(tiny_target, prompts):
    return greedy_outputs(tiny_target, [], prompts, 30)[0]


def test_requests_join_between_steps_and_equal_their_solo_runs(tiny_target, prompts, plain):
    vocab = tiny_target.model.config.vocab_size
    eng = make_engine(tiny_target, [RandomDrafts(vocab, seed=2)], n_parallel=3)
    got: dict[int, list[int]] = {}
    streamed: dict[int, list[int]] = {}
    first_at: dict[int, int] = {}  # request -> step of its first token
    done_at: dict[int, int] = {}
    steps = 0

    def add(i):
        def tokens(ids):
            first_at.setdefault(i, steps)
            streamed.setdefault(i, []).extend(ids)

        def finish(r):
            got[r.id] = r.token_ids
            done_at[r.id] = steps

        return eng.add(Request(prompts[i], 30, id=i), tokens, finish)

    handles = [add(0)]
    while eng.has_work or len(handles) < len(prompts):
        steps += 1
        done = eng.step()
        assert eng.n_running <= 3
        assert all(r.handle in handles for r in done)
        if steps % 4 == 0 and len(handles) < len(prompts):  # a new request arrives while others run
            handles.append(add(len(handles)))
    assert handles == list(range(len(prompts)))
    assert [got[i] for i in range(len(prompts))] == plain
    assert [streamed[i] for i in range(len(prompts))] == plain
    # late requests joined the running batch: they started while the first one was still running
    assert first_at[1] == 5 and first_at[2] == 9 and done_at[0] > 9


def test_abort_frees_the_slot_for_the_next_request(tiny_target, prompts, plain):
    vocab = tiny_target.model.config.vocab_size
    eng = make_engine(tiny_target, [RandomDrafts(vocab, seed=3)], n_parallel=1)
    finished = []
    h0 = eng.add(Request(prompts[0], 30), on_finish=finished.append)
    h1 = eng.add(Request(prompts[1], 30), on_finish=finished.append)
    h2 = eng.add(Request(prompts[2], 30), on_finish=finished.append)
    for _ in range(3):
        eng.step()
    assert eng.n_running == 1 and eng.n_waiting == 2
    r0 = eng.abort(h0)
    assert r0.finish_reason == "abort" and 0 < len(r0.token_ids) < 30 and r0.token_ids == plain[0][:len(r0.token_ids)]
    r2 = eng.abort(h2)  # still waiting: never ran
    assert r2.finish_reason == "abort" and r2.token_ids == []
    assert eng.abort(h0) is None and eng.abort(12345) is None
    assert eng.n_running == 0 and eng.n_waiting == 1
    while eng.has_work:
        eng.step()
    assert [r.handle for r in finished] == [h0, h2, h1]
    assert finished[-1].token_ids == plain[1]  # the freed slot's cache and speculator state were cleared


def test_per_request_speculators_and_n_max(tiny_target, prompts, plain):
    oracle = speculator(Oracle({tuple(p): g for p, g in zip(prompts, plain)}), name="oracle")
    eng = make_engine(tiny_target, [oracle], n_parallel=3)
    res = eng.run([Request(prompts[0], 30, speculators=()), Request(prompts[1], 30, n_max=2),
                   Request(prompts[2], 30, speculators=["oracle"])])
    assert [r.token_ids for r in res] == plain[:3]
    assert res[0].stats.drafted_tokens == 0 and res[0].stats.target_forwards == 30
    assert 0 < res[1].stats.drafted_tokens and res[1].stats.mean_accepted_length <= 3.0
    assert res[2].stats.mean_accepted_length > 3.0
    with pytest.raises(SpecplugError, match="unknown speculator 'nope'; this engine has 'oracle'"):
        eng.add(Request(prompts[0], 5, speculators=["nope"]))
    with pytest.raises(SpecplugError, match="n_max must be an integer >= 0"):
        eng.add(Request(prompts[0], 5, n_max=-1))
    assert not eng.has_work  # refused requests were never queued


def test_per_request_sampling_and_seed(tiny_target, prompts, plain):
    vocab = tiny_target.model.config.vocab_size
    hot = SamplingParams(temperature=1.0)
    eng = make_engine(tiny_target, [RandomDrafts(vocab, seed=4)], n_parallel=3)
    res = eng.run([Request(prompts[0], 30), Request(prompts[0], 30, sampling=hot, seed=7),
                   Request(prompts[1], 30, sampling=hot, seed=8)])
    assert res[0].token_ids == plain[0]  # the engine's greedy default beside sampled neighbours
    assert res[1].token_ids != plain[0] and len(res[1].token_ids) == 30
    # without drafts (whose random acceptance draws depend on the drafts) a seed fixes the text,
    # whatever runs beside it
    eng = make_engine(tiny_target, [], n_parallel=4)
    res = eng.run([Request(prompts[1], 30, sampling=hot, seed=7), Request(prompts[0], 30, sampling=hot, seed=7),
                   Request(prompts[0], 30), Request(prompts[0], 30, sampling=hot, seed=9)])
    alone = make_engine(tiny_target, [], n_parallel=1).run([Request(prompts[0], 30, sampling=hot, seed=7)])[0]
    assert res[1].token_ids == alone.token_ids != res[3].token_ids
    assert res[2].token_ids == plain[0]


def test_interrupted_run_leaves_the_engine_empty(tiny_target, prompts, plain):
    eng = make_engine(tiny_target, [], n_parallel=2)
    seen = []

    def boom(i, ids):
        seen.append(i)
        if len(seen) == 5:
            raise KeyboardInterrupt

    finished = []
    with pytest.raises(KeyboardInterrupt):
        eng.run([Request(p, 20) for p in prompts[:4]], boom, finished.append)
    assert finished == [] and not eng.has_work  # aborted requests are not reported as answers
    assert [r.token_ids for r in eng.run([Request(p, 30) for p in prompts[:2]])] == plain[:2]
