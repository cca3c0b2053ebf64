"""Issue 26: no plugin can change the text. One plugin per rule of the hook contract
(specplug/hooks.py), each breaking it, through the engine `specplug run` builds: the greedy text
equals plain decoding, the speculator is disabled with a warning naming it and the rule, and
sampled tokens are distributed as the target samples them. Then the contract kit plugin authors
use (specplug.testing.check_speculator) and the host's draft checks (specplug.contract) one by one."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from specplug.contract import check_drafts
from specplug.engine import Request, target_info
from specplug.errors import PluginError
from specplug.hooks import hookimpl
from specplug.sampling import SamplingParams
from specplug.testing import (
    CONTRACT_SAMPLING,
    RandomDrafts,
    greedy_outputs,
    make_engine,
    sampled_like_target,
    speculator,
)
from specplug.types import Draft, DraftRequest, EmbeddingRequest

SAMPLING = SamplingParams(temperature=0.7, top_k=5)
PROMPTS = ["the sea and the sky", "a cat sat on a mat", "one two three", "the"]
N_PARALLEL = 4


def _sampled(target, specs, n: int = 8, max_tokens: int = 16):
    """Every prompt n times (seeds from the request index, as `specplug run` gives them), sampled."""
    tok = target.tokenizer
    eng = make_engine(target, specs, n_parallel=N_PARALLEL, sampling=SAMPLING, ignore_eos=True)
    res = eng.run([Request(tok.encode(p), max_tokens, (i, k)) for k in range(n) for i, p in enumerate(PROMPTS)])
    return res, eng


def _disabled_warning(caplog, name: str) -> str:
    msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    hits = [m for m in msgs if f"speculator {name!r} disabled" in m]
    assert hits, f"no warning names speculator {name!r}: {msgs}"
    return hits[0]


# ---------------------------------------------------------------------------------------------
# the defect: a draft whose probs give the drafted token no mass was always accepted


class OneHotElsewhere:
    """Drafts `token` and says it was sampled from a q one-hot on token 0."""

    @dataclass(frozen=True)
    class Params:
        token: int = 100

    def __init__(self, params, target):
        self.params, self.vocab = params, target.vocab_size

    @hookimpl
    def draft(self, requests):
        q = torch.zeros(1, self.vocab)
        q[0, 0] = 1.0
        return [Draft((self.params.token,), q) for _ in requests]


def test_a_draft_its_own_probs_cannot_produce_is_refused_and_the_text_is_the_targets(tiny_target, caplog):
    """Before the fix every drafted token was accepted (u * q_d <= p_d holds for q = 0), here a
    token the target's sampling at temperature 0.7 top_k 5 did not produce on these prompts."""
    plain, _ = _sampled(tiny_target, [], n=2)
    token = next(t for t in range(3, 267) if not any(t in r.token_ids for r in plain))
    info = target_info(tiny_target, N_PARALLEL, 512)
    spec = speculator(OneHotElsewhere(OneHotElsewhere.Params(token), info), "elsewhere", target=info,
                      cost_trim=False)
    with caplog.at_level(logging.WARNING, logger="specplug"):
        got, eng = _sampled(tiny_target, [spec], n=2)
    assert eng.stats.speculators["elsewhere"].accepted_tokens == 0
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]  # the same seeds: the same text
    why = eng.stats.disabled["elsewhere"]
    assert f"give drafted token {token} (position 0) zero probability" in why
    assert why in _disabled_warning(caplog, "elsewhere")


# ---------------------------------------------------------------------------------------------
# the bad-plugin zoo: one plugin per rule of hooks.py, each breaking it after one good call


def _probs(vocab: int, ids, **entries: float) -> torch.Tensor:
    """[len(ids), vocab] rows one-hot on `ids`, then entries "t9=x" (token 9 of every row) set to x."""
    q = torch.zeros(len(ids), vocab)
    q[torch.arange(len(ids)), torch.tensor(ids)] = 1.0
    for key, x in entries.items():
        q[:, int(key[1:])] = x
    return q


def _draft_modes(vocab: int):
    """mode -> (result of `draft` for the requests, a fragment of the rule's message)."""
    ok = lambda reqs, d: [d for _ in reqs]  # noqa: E731
    one = (5,)
    modes = {
        "result not a sequence": (lambda reqs: 42, "draft returned int"),
        "result too short": (lambda reqs: [Draft(one)] * (len(reqs) - 1), "draft returned list of length"),
        "result too long": (lambda reqs: [Draft(one)] * (len(reqs) + 1), "draft returned list of length"),
        "element not a Draft": (lambda reqs: ok(reqs, (5, 6)), "is a tuple, not a specplug.types.Draft"),
        "longer than n_max": (lambda reqs: [Draft((5,) * (r.n_max + 1)) for r in reqs], "more than n_max"),
        "token id >= vocab": (lambda reqs: ok(reqs, Draft((vocab + 7,))), "outside the vocabulary"),
        "token id 2**62": (lambda reqs: ok(reqs, Draft((2 ** 62,))), "outside the vocabulary"),
        "token id negative": (lambda reqs: ok(reqs, Draft((-1,))), "token id -1 outside"),
        "token id float": (lambda reqs: ok(reqs, Draft((5.0,))), "token id 5.0 outside"),
        "token id str": (lambda reqs: ok(reqs, Draft(("5",))), "token id '5' outside"),
        "token id None": (lambda reqs: ok(reqs, Draft((None,))), "token id None outside"),
        "probs wrong shape": (lambda reqs: ok(reqs, Draft(one, torch.ones(1, 3) / 3)), "have shape (1, 3)"),
        "probs a numpy array": (lambda reqs: ok(reqs, Draft(one, np.full((1, vocab), 1 / vocab, np.float32))),
                                "must be a floating-point torch.Tensor, got a ndarray"),
        "probs an integer tensor": (lambda reqs: ok(reqs, Draft(one, _probs(vocab, one).long())),
                                    "must be a floating-point torch.Tensor, got a torch.int64 tensor"),
        "probs NaN": (lambda reqs: ok(reqs, Draft(one, _probs(vocab, one, t9=np.nan))),
                      "are not all finite"),
        "probs inf": (lambda reqs: ok(reqs, Draft(one, _probs(vocab, one, t9=np.inf))),
                      "are not all finite"),
        "probs negative": (lambda reqs: ok(reqs, Draft(one, _probs(vocab, one, t9=-0.5, t8=0.5))), "negative entry"),
        "probs not summing to 1": (lambda reqs: ok(reqs, Draft(one, _probs(vocab, one) * 2)),
                                   "row 0 sums to 2"),
        "probs zero mass on the drafted token": (
            lambda reqs: ok(reqs, Draft(one, _probs(vocab, (0,)))), "zero probability"),
        "confidence above 1": (lambda reqs: ok(reqs, Draft(one, None, (1.5,))), "draft confidence"),
        "confidence NaN": (lambda reqs: ok(reqs, Draft(one, None, (float("nan"),))), "draft confidence"),
        "confidence wrong length": (lambda reqs: ok(reqs, Draft(one, None, (0.5, 0.5))), "draft confidence"),
    }
    return modes


class Bad:
    """Keeps the rules for `after` calls of each hook (token-only drafts (5, 6)), then breaks `mode`."""

    @dataclass(frozen=True)
    class Params:
        mode: str = "token id >= vocab"
        after: int = 1

    HOOK_RAISES = ("draft", "encode", "process_batch", "verified", "remove")

    def __init__(self, params, target):
        self.params, self.vocab = params, target.vocab_size
        self.calls: dict[str, int] = {}
        self.modes = _draft_modes(self.vocab)

    def _broken(self, hook: str) -> bool:
        self.calls[hook] = self.calls.get(hook, 0) + 1
        broken = self.calls[hook] > self.params.after
        if broken and self.params.mode == f"{hook} raises":
            raise RuntimeError(f"{hook} exploded")
        return broken

    @hookimpl
    def request_embeddings(self, target):
        if self.params.mode.startswith("writes DraftRequest.kv"):
            return EmbeddingRequest(kv_layers=(0,))
        wants = self.params.mode in ("encode raises", "writes batch embeddings")
        return EmbeddingRequest(final=True) if wants else None

    @hookimpl
    def draft(self, requests):
        if not self._broken("draft"):
            return [Draft((5, 6)[:r.n_max]) for r in requests]
        mode = self.params.mode
        if mode == "writes DraftRequest.tokens":
            for r in requests:
                r.tokens[-1] = 0
        if mode == "appends to DraftRequest.tokens":
            for r in requests:
                r.tokens.append(0)
        if mode == "writes DraftRequest.kv keys":
            requests[0].kv[0].k.zero_()
        if mode == "writes DraftRequest.kv values, a slice":
            requests[0].kv[0].v[:, -1:] = 0.0
        if mode in self.modes:
            return self.modes[mode][0](requests)
        return [Draft((5, 6)[:r.n_max]) for r in requests]

    @hookimpl
    def encode(self, batch):
        if not batch.is_prompt:  # counted from the first step's rows on
            self._broken("encode")
        return batch.embeddings["final"]

    @hookimpl
    def process_batch(self, batch, encoded):
        if not batch.is_prompt and self._broken("process_batch"):
            if self.params.mode == "writes batch token ids":
                batch.token_ids.fill_(7)
            elif self.params.mode == "writes batch positions":
                batch.positions.add_(3)
            elif self.params.mode == "writes batch embeddings":
                batch.embeddings["final"].mul_(0.0)

    @hookimpl
    def verified(self, results):
        self._broken("verified")

    @hookimpl
    def remove(self, seq_id, p0):
        self._broken("remove")


ZOO = {name: msg for name, (_, msg) in _draft_modes(267).items()}
ZOO.update({f"{h} raises": f"{h} raised RuntimeError: {h} exploded" for h in Bad.HOOK_RAISES})
ZOO.update({"writes DraftRequest.tokens": "draft raised TypeError",
            "appends to DraftRequest.tokens": "draft raised AttributeError",
            "writes DraftRequest.kv keys": "draft raised ReadOnlyError",
            "writes DraftRequest.kv values, a slice": "draft raised ReadOnlyError"})
# in-place writes to a batch: the engine keeps its own lists, so the text cannot change, and the
# plugin is not always disabled (a write to token ids or positions goes unnoticed; one to hidden
# states raises when they are the target's own inference tensors, not when they are a row copy).
# What the plugins after it see: the test after the zoo.
HARMLESS = {"writes batch token ids", "writes batch positions", "writes batch embeddings"}


@pytest.fixture(scope="module")
def plain_greedy(tiny_target):
    tok = tiny_target.tokenizer
    return greedy_outputs(tiny_target, [], [tok.encode(p) for p in PROMPTS], 16, n_parallel=N_PARALLEL)[0]


def _bad(target, mode: str):
    info = target_info(target, N_PARALLEL, 512)
    return speculator(Bad(Bad.Params(mode), info), "bad", target=info, cost_trim=False)


@pytest.mark.parametrize("mode", sorted(ZOO) + sorted(HARMLESS))
def test_a_plugin_breaking_a_rule_is_disabled_and_changes_nothing(mode, tiny_target, plain_greedy, caplog):
    tok = tiny_target.tokenizer
    with caplog.at_level(logging.WARNING, logger="specplug"):
        got, eng = greedy_outputs(tiny_target, [_bad(tiny_target, mode)], [tok.encode(p) for p in PROMPTS], 16,
                                  n_parallel=N_PARALLEL)
    assert got == plain_greedy
    st = eng.stats.speculators["bad"]
    if mode in HARMLESS:
        assert st.drafts > 1
    else:
        why = eng.stats.disabled.get("bad")
        assert why is not None and ZOO[mode] in why, why
        assert why in _disabled_warning(caplog, "bad")
        assert st.drafts >= 1  # its first, good, draft was verified: the rule broke mid-run
    # sampling: every token one the target can produce, distributed as the target samples
    res, eng = _sampled(tiny_target, [_bad(tiny_target, mode)])
    assert mode in HARMLESS or not eng.specs[0].enabled
    assert all(len(r.token_ids) == 16 for r in res)
    pv, line = sampled_like_target(tiny_target, res, SAMPLING)
    assert pv >= 1e-3, line


class Recorder:
    """Keeps what process_batch delivered: (sequence, position) -> (token, its final hidden state)."""

    def __init__(self):
        self.seen: dict[tuple[int, int], tuple[int, list[float]]] = {}

    @hookimpl
    def request_embeddings(self, target):
        return EmbeddingRequest(final=True)

    @hookimpl
    def process_batch(self, batch, encoded):
        rows = zip(batch.token_ids.tolist(), batch.positions.tolist(), batch.seq_ids.tolist(),
                   batch.embeddings["final"].tolist())
        for t, p, q, h in rows:
            self.seen[(q, p)] = (t, h)


@pytest.mark.parametrize("mode", sorted(HARMLESS))
def test_a_plugin_writing_its_batch_does_not_change_what_other_plugins_see(mode, tiny_target):
    prompt = tiny_target.tokenizer.encode(PROMPTS[0])
    alone, with_bad = Recorder(), Recorder()
    greedy_outputs(tiny_target, [alone], [prompt], 12)
    greedy_outputs(tiny_target, [_bad(tiny_target, mode), with_bad], [prompt], 12)
    assert with_bad.seen.keys() == alone.seen.keys()
    for k, (t, h) in alone.seen.items():
        # hidden states to float error: the verification batches differ between the runs
        assert with_bad.seen[k][0] == t and with_bad.seen[k][1] == pytest.approx(h, rel=1e-3, abs=1e-3), k


# ---------------------------------------------------------------------------------------------
# start-up rules: are_compatible and request_embeddings (a clean error naming the speculator)


class BadStart:
    @dataclass(frozen=True)
    class Params:
        mode: str = "incompatible"

    def __init__(self, params, target):
        self.params = params

    @hookimpl
    def are_compatible(self, target):
        if self.params.mode == "are_compatible raises":
            raise RuntimeError("no idea")
        return "vocab size 267 != 49152" if self.params.mode == "incompatible" else None

    @hookimpl
    def request_embeddings(self, target):
        if self.params.mode == "request_embeddings raises":
            raise RuntimeError("no taps")
        return {"layer out of range": EmbeddingRequest(layers=(99,)), "not an EmbeddingRequest": [0]}.get(
            self.params.mode)


@pytest.mark.parametrize("mode,msg", [
    ("incompatible", "is not compatible with .*vocab size 267 != 49152"),
    ("are_compatible raises", "failed its start-up hooks: RuntimeError: no idea"),
    ("request_embeddings raises", "failed its start-up hooks: RuntimeError: no taps"),
    ("layer out of range", r"requested embeddings .*layers must be in \[0, 2\)"),
    ("not an EmbeddingRequest", r"requested embeddings \[0\]"),
])
def test_a_plugin_breaking_a_start_up_rule_stops_the_run_with_its_name(mode, msg, tiny_target):
    info = target_info(tiny_target, 1, 512)
    with pytest.raises(PluginError, match=f"speculator 'badstart' .*{msg}"):
        speculator(BadStart(BadStart.Params(mode), info), "badstart", target=info)


# ---------------------------------------------------------------------------------------------
# `specplug run` itself: the plugin loaded from its entry point, the answers those of plain decoding


@pytest.mark.parametrize("mode", ["probs zero mass on the drafted token", "draft raises", "token id 2**62"])
def test_specplug_run_with_a_broken_plugin_answers_as_plain_decoding(mode, monkeypatch, tmp_path, tiny_gguf,
                                                                     capsys, caplog):
    import json
    from importlib.metadata import EntryPoint

    from specplug import plugins
    from specplug.cli import main

    monkeypatch.setattr(plugins, "entry_points", lambda group: [EntryPoint("bad", f"{__name__}:Bad", group)])
    monkeypatch.setattr(plugins, "_cache", None)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(PROMPTS)))
    base = (f"model: {tiny_gguf}\ndevice: cpu\nquant: none\nmax_tokens: 12\nparallel: 2\nignore_eos: true\n"
            "sampling: {temperature: 0.7, top_k: 5, seed: 3}\n")
    texts = {}
    for name, extra in (("plain", ""), ("bad", f"speculators:\n  - type: bad\n    mode: {mode}\n    after: 0\n"
                                               "    cost_trim: false\n")):
        cfg, out = tmp_path / f"{name}.yaml", tmp_path / f"{name}.jsonl"
        cfg.write_text(base + extra)
        with caplog.at_level(logging.WARNING, logger="specplug"):
            assert main(["run", str(cfg), "--prompts", str(prompts), "--output", str(out)]) == 0
        texts[name] = [json.loads(x)["token_ids"] for x in out.read_text().splitlines()]
    err = capsys.readouterr().err  # the run's summary
    assert "bad: DISABLED (" in err and ZOO[mode] in err
    assert ZOO[mode] in _disabled_warning(caplog, "bad")
    assert texts["bad"] == texts["plain"]  # it broke the rule on its first call: the same seeds, the same text
    monkeypatch.undo()
    plugins.speculator_types(refresh=True)


# ---------------------------------------------------------------------------------------------
# specplug.contract.check_drafts on probs, directly


def _req(n_max: int = 4, seq: int = 0) -> DraftRequest:
    return DraftRequest(seq, (1, 2, 3), n_max)


def _softmax(n: int, vocab: int = 50, dtype=torch.float32) -> torch.Tensor:
    return torch.softmax(torch.randn(n, vocab, generator=torch.Generator().manual_seed(n)) * 3, -1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_check_drafts_accepts_real_distributions(dtype):
    q = _softmax(3, dtype=dtype)
    assert check_drafts([Draft((4, 5, 6), q), None, Draft((7,))], [_req(), _req(seq=1), _req(seq=2)], 50) is None
    assert check_drafts([Draft((), torch.zeros(0, 50))], [_req()], 50) is None  # an empty draft


@pytest.mark.parametrize("edit,msg", [
    (lambda q: q.__setitem__((1, 3), float("nan")), "draft probs for sequence 1 are not all finite (row 1 holds NaN"),
    (lambda q: q.__setitem__((2, 3), float("-inf")), "are not all finite (row 2"),
    (lambda q: (q[0].__setitem__(3, -0.2), q[0].__setitem__(5, q[0, 5] + 0.2)), "have a negative entry (row 0: -0.2)"),
    (lambda q: q[1].mul_(1.01), "row 1 sums to 1.01, not 1 (within 0.001)"),
    (lambda q: q[2].mul_(0.5), "row 2 sums to 0.5"),
    (lambda q: (q[1].__setitem__(5, 0.0), q[1].div_(q[1].sum())), "give drafted token 5 (position 1) zero probability"),
])
def test_check_drafts_names_the_broken_probs_rule(edit, msg):
    q = _softmax(3)
    edit(q)
    good = Draft((4, 5, 6), _softmax(3))
    got = check_drafts([good, Draft((4, 5, 6), q)], [_req(), _req(seq=1)], 50)
    assert got is not None and msg in got, got


def test_check_drafts_reports_the_first_draft_in_request_order_across_devices():
    """Drafts on the CPU and (where there is one) the GPU: the first bad one in request order."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    bad = _softmax(2) * 2
    for dev in devices:
        drafts = [Draft((4, 5), _softmax(2).to(dev)), Draft((4, 5), bad.to(dev)), Draft((4, 5), bad.to("cpu"))]
        got = check_drafts(drafts, [_req(seq=s) for s in range(3)], 50)
        assert got is not None and got.startswith("draft probs for sequence 1 "), (dev, got)


# ---------------------------------------------------------------------------------------------
# the contract kit (specplug.testing.check_speculator) passes good plugins and names broken rules


def test_the_kit_passes_a_plugin_that_keeps_the_rules(speculator_contract):
    report = speculator_contract(lambda info: RandomDrafts(info.vocab_size), name="random")
    assert report.greedy_drafts > 0 and report.sampling_drafts > 0 and report.sampling_p_value >= 1e-3


class ArgmaxWithSoftmax:
    """Drafts the target's own argmax with the target's sampling distribution as its probs: the
    mistake hooks.py warns of (probs must be the distribution each token was sampled from). Every
    rule the host can check holds and every draft is accepted, so sampling comes out near greedy."""

    def __init__(self, target, sampling: SamplingParams):
        self.model, self.sampling = target.model, sampling

    @hookimpl
    def draft(self, requests):
        from specplug.sampling import target_probs

        toks, pos, seqs, last = [], [], [], []
        for i, r in enumerate(requests):
            toks += list(r.tokens)
            pos += range(len(r.tokens))
            seqs += [i] * len(r.tokens)
            last.append(len(toks) - 1)
        out = self.model.forward(toks, pos, seqs, self.model.new_cache(len(requests), 512), logits_rows=last)
        p = target_probs(out.logits, self.sampling)
        return [Draft((int(row.argmax()),), row[None].clone()) for row in p]


class NeverDrafts:
    def __init__(self, target):
        pass

    @hookimpl
    def draft(self, requests):
        return None


@pytest.mark.parametrize("factory,msg", [
    ("argmax with softmax", "sampling .*not distributed as the target samples them: chi-square"),
    (lambda info: Bad(Bad.Params("probs zero mass on the drafted token", after=0), info),
     "greedy: the host disabled speculator 'k': draft probs .* zero probability"),
    (lambda info: Bad(Bad.Params("verified raises", after=0), info),
     "(?s)greedy: the host disabled speculator 'k': verified raised RuntimeError.*host log:.*Traceback"),
    (lambda info: NeverDrafts(info), "greedy: speculator 'k' never had a draft verified"),
    (lambda info: Bad(Bad.Params("writes DraftRequest.kv keys", after=0), info),
     "greedy: the host disabled speculator 'k': draft raised ReadOnlyError.*wrote the target's KV cache"),
])
def test_the_kit_names_the_rule_a_plugin_breaks(factory, msg, speculator_contract, tiny_target):
    if factory == "argmax with softmax":
        factory = lambda info: ArgmaxWithSoftmax(tiny_target, SamplingParams(**CONTRACT_SAMPLING))  # noqa: E731
    with pytest.raises(AssertionError, match=msg):
        speculator_contract(factory, name="k", max_tokens=12)
