"""The MTP speculator and its trainer on a tiny random target."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from specplug_mtp.head import MTPRuntime
from specplug_mtp.speculator import MTP
from specplug_mtp.train import MTPTrainer

from specplug.api import build_speculators
from specplug.config import parse_config
from specplug.engine import Request, target_info
from specplug.errors import ConfigError, PluginError
from specplug.testing import (
    HeadKit,
    assert_greedy_equal,
    check_lookup_step,
    check_native_step,
    drafted_lookups,
    fine_tune_with_lookup,
    greedy_outputs,
    speculator,
    write_tiny_gguf,
)
from specplug.train.loop import LoopOptions, train

KIT = HeadKit(MTPTrainer, MTP, options=dict(draft_vocab=0))
work, tiny, data, trained = KIT.fixtures("mtp")  # the tiny target, its data set, a head trained 150 steps
_train, _target, _mtp, _ids = KIT.train, KIT.target, KIT.build, KIT.prompt_ids


@pytest.fixture(scope="module")
def untrained(data, work) -> Path:
    _train(data, work / "untrained.gguf", 1, init_layer=-2)
    return work / "untrained.gguf"


@pytest.mark.parametrize("quant", ["gguf", "none"])
def test_greedy_output_equals_plain_with_parallel_sequences(tiny, trained, quant):
    target = _target(tiny, quant)
    spec = _mtp(target, trained, stop_below=0.0)
    # unpriced: on the tiny target a head forward costs about a target step, so the host would pause it
    eng = assert_greedy_equal(target, [speculator(spec, "MTP", cost_trim=False)], _ids(target), max_tokens=40,
                              n_parallel=3)
    st = eng.stats.speculators["MTP"]
    assert st.drafted_tokens > 50 and 0 < st.accepted_tokens < st.drafted_tokens  # rejections happened
    assert not eng.stats.disabled


def test_trained_head_beats_untrained_head(tiny, trained, untrained):
    target = _target(tiny, "gguf")
    acc = {}
    for name, head in (("trained", trained), ("untrained", untrained)):
        _, eng = greedy_outputs(target, [_mtp(target, head, calibrate=False, stop_below=0.0)], _ids(target),
                                max_tokens=40, n_parallel=2, max_ctx=512)
        st = eng.stats.speculators["MTP"]
        acc[name] = st.accepted_tokens / st.drafted_tokens
    assert acc["trained"] > 0.5 and acc["trained"] > acc["untrained"] + 0.3, acc


def test_head_cache_after_rejections_equals_a_fresh_replay(tiny, trained):
    target = _target(tiny, "gguf")
    spec = _mtp(target, trained, stop_below=0.0)
    prompts = _ids(target)[:3]
    _, eng = greedy_outputs(target, [spec], prompts, max_tokens=30, n_parallel=3)
    # run again, stopping mid-generation: inspect the state of live sequences
    from specplug.testing import make_engine

    spec = _mtp(target, trained, stop_below=0.0, catch_up=None)  # reads every row, the prompt's too
    # every draft verified
    eng = make_engine(target, [speculator(spec, "mtp", cost_trim=False)], n_parallel=3, max_ctx=512)
    for r in [Request(p, 30) for p in prompts]:
        eng.add(r)
    for _ in range(9):  # nine draft-verify steps (all three admitted at the first), then stop mid-generation
        eng.step()
    seqs = {q.slot: list(q.tokens) for q in eng._active.values()}
    assert seqs  # the sequences still running (a finished one has been cleared)
    # rejections seen
    assert spec.calib.table[..., 1].sum() > 0 and (spec.calib.table[..., 1] > spec.calib.table[..., 0]).any()
    m = target.model
    for slot, toks in seqs.items():
        st = spec.state[slot]
        done = st.done
        assert 0 < done <= len(toks) - 1
        # replay: the target's final states for the committed history, then the head over all pairs
        committed = toks[:-1]
        out = m.forward(committed, list(range(len(committed))), [0] * len(committed), m.new_cache(1, 512),
                        taps={m.config.n_layer})
        h = out.hidden[m.config.n_layer]
        h_prev = torch.cat([torch.zeros(1, h.shape[1]), h[:-1]])
        fresh = MTPRuntime(spec.head, target_info(target, 1, 512), spec.backend, 1, 512)
        fresh.forward(h_prev[:done], committed[:done], list(range(done)), [0] * done, [])
        for kv in ("k", "v"):
            got = getattr(spec.rt.cache, kv)[0, slot, :, :done]
            ref = getattr(fresh.cache, kv)[0, 0, :, :done]
            assert torch.equal(got, ref), f"slot {slot}: head {kv} cache differs from a fresh replay"
        assert spec.rt.cache.valid[slot, :done].all()


def test_runtime_matches_the_training_module_at_every_unroll_step(tiny, data, work):
    """Export with float32 weights, run the runtime (torch backend) as it drafts, and compare with the
    training form's unrolled logits: the training-time-test mask is the cache the head has."""
    from specplug.train.dataset import TrainData

    out = work / "f32.gguf"
    _train(data, out, 20, weights="f32")
    target = _target(tiny, "none")
    d = TrainData(data, ["final"], 0.1)
    tr = MTPTrainer(MTPTrainer.Options(draft_vocab=0), d, torch.device("cpu"))
    rt_spec = _mtp(target, out)
    tr.module.load_state_dict({k: v for k, v in torch.load(out.with_name("f32.train") / "checkpoint.pt",
                                                           weights_only=False)["module"].items()}, strict=False)
    b = d.collate(d.split["val"][:1])
    n = int(b.valid[0].sum())
    steps = {r: tr.module.logits(out)[0] for r, out in tr.module.unroll(b.tokens, b.positions, b.taps["final"], 3)}
    toks = b.tokens[0, :n].tolist()
    h = b.taps["final"][0, :n]
    a = int(b.dist_start[0]) + 2  # an anchor inside the answer
    rt = MTPRuntime(rt_spec.head, target_info(target, 1, 512), rt_spec.backend, 1, 512)
    h_prev = torch.cat([torch.zeros(1, h.shape[1]), h[:-1]])
    states, logits = rt.forward(h_prev[:a + 1], toks[:a + 1], list(range(a + 1)), [0] * (a + 1), [a])
    d2t_rows = rt.d2t
    assert torch.equal(d2t_rows, tr.d2t)
    torch.testing.assert_close(logits[0], steps[0][a], rtol=1e-3, atol=1e-3)
    prev = states[a:a + 1]
    for r in (1, 2):
        prev, logits = rt.forward(prev, [toks[a + r]], [a + r], [0], [0])
        torch.testing.assert_close(logits[0], steps[r][a + r], rtol=1e-3, atol=1e-3)


def test_sampled_drafts_carry_full_vocabulary_probs(tiny, trained):
    from specplug.sampling import SamplingParams

    target = _target(tiny, "gguf")
    spec = _mtp(target, trained, temperature=1.0, stop_below=0.0)
    seen = []
    orig = spec.draft

    def draft(requests):
        out = orig(requests)
        seen.extend(d for d in out if d is not None)
        return out

    s = speculator(spec, "MTP")
    s.caller._impls["draft"][0].function = draft
    from specplug.testing import make_engine

    eng = make_engine(target, [s], sampling=SamplingParams(temperature=0.8, seed=1), n_parallel=2)
    eng.run([Request(p, 20) for p in _ids(target)[:2]])
    assert seen and not eng.stats.disabled
    for d in seen:
        assert d.probs.shape == (len(d), target.model.config.vocab_size)
        torch.testing.assert_close(d.probs.sum(-1), torch.ones(len(d)), rtol=1e-5, atol=1e-5)
        assert all(d.probs[i, t] > 0 for i, t in enumerate(d.token_ids))


def test_bad_heads_are_clear_errors(tiny, trained, work):
    target = _target(tiny, "gguf")
    other = write_tiny_gguf(work / "other.gguf", n_embd=96, n_head=4, n_head_kv=2, tensor_type="Q8_0", scale=1.5)
    other_target = _target(other, "gguf")
    cfg = parse_config({"model": str(other), "speculators": [{"type": "mtp", "head": str(trained)}]})
    with pytest.raises(PluginError, match=r"not compatible.*trained for tiny \(llama, n_embd 64.*not for the target "
                                          r"other.gguf \(llama, n_embd 96"):
        build_speculators(cfg, target_info(other_target, 1, 256))
    cut = work / "cut.gguf"
    data = trained.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="mtp: head: .*cut.gguf"):
        _mtp(target, cut)
    from specplug.heads import HeadMeta, write_head

    eagle = write_head(work / "eagle.gguf", HeadMeta.for_target(target_info(target, 1, 64), "eagle3", 1, ["1"], {}),
                       {"x": torch.zeros(2)})
    with pytest.raises(ConfigError, match="this is a 'eagle3' head, not a 'mtp' head"):
        _mtp(target, eagle)
    with pytest.raises(ConfigError, match="head file not found"):
        _mtp(target, work / "missing.gguf")
    with pytest.raises(ConfigError, match="no MTP head ships for this target"):
        MTP(MTP.Params(), target_info(target, 1, 64))


def test_interrupted_training_resumes_to_the_same_head(data, work, monkeypatch):
    from specplug.heads import HeadFile

    loop = LoopOptions(steps=20, lr=3e-3, warmup=5, batch_tokens=2048, val_every=10, save_every=5, val_fraction=0.1)
    opts = MTPTrainer.Options(draft_vocab=0)
    train(MTPTrainer, opts, loop, data, work / "straight.gguf", quiet=True, restart=True)
    real = MTPTrainer.loss
    calls = {"n": 0}

    def interrupting(self, batch):
        calls["n"] += 1
        if calls["n"] == 13:
            raise KeyboardInterrupt
        return real(self, batch)

    monkeypatch.setattr(MTPTrainer, "loss", interrupting)
    with pytest.raises(KeyboardInterrupt):
        train(MTPTrainer, opts, loop, data, work / "resumed.gguf", quiet=True, restart=True)
    assert not (work / "resumed.gguf").exists()
    monkeypatch.setattr(MTPTrainer, "loss", real)
    with pytest.raises(Exception, match="add --resume to continue it, or --restart"):
        train(MTPTrainer, opts, loop, data, work / "resumed.gguf", quiet=True)
    m = train(MTPTrainer, opts, loop, data, work / "resumed.gguf", quiet=True, resume=True)
    assert m["recipe"]["steps"] == 20 and len(m["history"]) == 20
    a, b = HeadFile(work / "straight.gguf"), HeadFile(work / "resumed.gguf")
    for name in a.gguf.tensors:
        assert torch.equal(a.tensor(name), b.tensor(name)), name
    assert (work / "resumed.train" / "training.png").is_file()


def test_native_step_agrees_with_the_python_form_and_picks_its_own_argmax(tiny, trained):
    spec = _mtp(_target(tiny, "gguf"), trained)
    assert spec.rt.native_step is not None  # the gguf kernels run the whole step in one call
    check_native_step(spec.rt)
    assert _mtp(_target(tiny, "none"), trained).rt.native_step is None  # torch (and CUDA): the Python form


def test_draft_step_on_static_steps_next_to_a_static_target(tiny, trained):
    """Next to a target on the static step, the MTP head's draft step runs on static steps too
    (head_steps), computes what its eager forward computes, and greedy output still equals plain."""
    import dataclasses

    from specplug.runtime.static import StaticOptions

    target = _target(tiny, "none")
    target.model.use_static(StaticOptions(compile=True, backend="aot_eager", fixed_tokens=8))
    spec = _mtp(target, trained, stop_below=0.0)
    info = target_info(target, 1, 512)
    eager = MTPRuntime(spec.head, dataclasses.replace(info, static=None), spec.backend, 1, 512)
    static = MTPRuntime(spec.head, info, spec.backend, 1, 512)
    assert eager.static is None and static.static is not None and static.cache.spare == 1
    h = torch.randn(9, target.model.config.n_embd)
    toks = list(range(40, 49))
    outs = []
    for rt in (eager, static):
        outs.append((rt.forward(h[:7], toks[:7], list(range(7)), [0] * 7, [6]),
                     rt.forward(h[7:], toks[7:], [7, 8], [0, 0], [0, 1])))
    for (a_out, a_lg), (b_out, b_lg) in zip(*outs):
        torch.testing.assert_close(b_out, a_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b_lg, a_lg, rtol=1e-4, atol=1e-4)
    eng = assert_greedy_equal(target, [speculator(spec, "MTP", cost_trim=False)], _ids(target)[:3], max_tokens=24,
                              n_parallel=2)
    assert eng.stats.speculators["MTP"].accepted_tokens > 0


@pytest.fixture(scope="module")
def with_lookup(data, trained, work) -> Path:
    """The trained head fine-tuned into one that reads the context's pair lookup (`--lookup true`)."""
    return fine_tune_with_lookup(MTPTrainer, trained, data, work / "lookup.gguf")


def test_a_head_reading_the_pair_lookup_starts_as_its_base_and_drafts_losslessly(tiny, data, trained, with_lookup):
    from specplug.heads import HeadFile
    from specplug.train.eval import evaluate_head

    h = HeadFile(with_lookup)
    assert h.meta.config["lookup"] is True and {"lookup.proj", "lookup.gate"} <= set(h.gguf.tensors)
    assert abs(float(h.tensor("lookup.gate_bias")[0])) > 0  # it learned something about trusting the lookup
    before, after = (evaluate_head(p, data)["overall"]["top1"][0] for p in (trained, with_lookup))
    assert after >= before - 0.02, (before, after)
    target = _target(tiny, "gguf")
    spec = _mtp(target, with_lookup, stop_below=0.0)
    assert spec.rt.reads_lookup and not _mtp(target, trained).rt.reads_lookup
    eng = assert_greedy_equal(target, [speculator(spec, "MTP", cost_trim=False)], _ids(target), max_tokens=40,
                              n_parallel=3)
    st = eng.stats.speculators["MTP"]
    assert st.drafted_tokens > 50 and st.accepted_tokens > 0 and not eng.stats.disabled
    # the native draft step adds the lookup and its gate in the same call as the Python form does
    check_lookup_step(spec.rt)


def test_the_runtime_reads_the_lookup_as_the_training_module_does(tiny, data, with_lookup, work):
    """Logits of the runtime form given each row's lookup equal the training form's at every unroll
    step (f32 weights, torch runtime)."""
    from specplug.heads import HeadFile
    from specplug.heads.lookup import sequence_lookups, training_lookups
    from specplug.train.dataset import TrainData
    from specplug.train.finetune import BaseHead

    out = work / "lookup-f32.gguf"
    loop = LoopOptions(steps=5, lr=3e-3, warmup=1, batch_tokens=2048, val_every=5, save_every=10 ** 6, val_fraction=0.1)
    base = BaseHead(HeadFile(with_lookup), MTPTrainer)
    train(MTPTrainer, base.options({"weights": "f32"}), loop, data, out, quiet=True, restart=True, init=base)
    target = _target(tiny, "none")
    d = TrainData(data, ["final"], 0.1)
    tr = MTPTrainer(MTPTrainer.Options(draft_vocab=0, lookup=True), d, torch.device("cpu"), init=HeadFile(out))
    b = d.collate(d.split["val"][:1])
    n = int(b.valid[0].sum())
    look, rows = training_lookups(b.tokens, b.valid, tr.t2d)
    steps = {r: tr.module.logits(o[0], rows[0])
             for r, o in tr.module.unroll(b.tokens, b.positions, b.taps["final"], 3, look)}
    toks = b.tokens[0, :n].tolist()
    L = sequence_lookups(toks)
    a = next(t for t in range(int(b.dist_start[0]) + 2, n - 3) if L[t] >= 0 and L[t + 1] >= 0)
    h = b.taps["final"][0, :n]
    rt_spec = _mtp(target, out)
    rt = MTPRuntime(rt_spec.head, target_info(target, 1, 512), rt_spec.backend, 1, 512)
    assert rt.native_step is None  # the torch form
    h_prev = torch.cat([torch.zeros(1, h.shape[1]), h[:-1]])
    states, logits = rt.forward(h_prev[:a + 1], toks[:a + 1], list(range(a + 1)), [0] * (a + 1), [a], lookup=L[:a + 1])
    torch.testing.assert_close(logits[0], steps[0][a], rtol=1e-3, atol=1e-3)
    prev = states[a:a + 1]
    for r in (1, 2):
        prev, logits = rt.forward(prev, [toks[a + r]], [a + r], [0], [0], lookup=[L[a + r]])
        torch.testing.assert_close(logits[0], steps[r][a + r], rtol=1e-3, atol=1e-3)
    # and the lookup matters there: without it the logits differ
    rt.cache.seq_rm(0, 0)
    _, plain = rt.forward(h_prev[:a + 1], toks[:a + 1], list(range(a + 1)), [0] * (a + 1), [a])
    assert not torch.allclose(plain[0], steps[0][a], rtol=1e-3, atol=1e-3)


def test_a_head_matching_longer_ngrams_records_it_and_drafts_with_those_lookups(tiny, data, with_lookup, work):
    """`--lookup-n 5` on MTP: recorded in the head's config, and the drafter hands the head the
    longest-match lookups of its history (native step), losslessly. Options that cannot hold are refused."""
    from specplug.errors import SpecplugError
    from specplug.heads import HeadFile
    from specplug.train.finetune import BaseHead

    out = work / "lookup-n5.gguf"
    loop = LoopOptions(steps=3, lr=1e-3, warmup=1, batch_tokens=2048, val_every=3, save_every=10 ** 6, val_fraction=0.1)
    base = BaseHead(HeadFile(with_lookup), MTPTrainer)
    train(MTPTrainer, base.options({"lookup_n": 5}), loop, data, out, quiet=True, restart=True, init=base)
    assert HeadFile(out).meta.config["lookup_n"] == 5
    target = _target(tiny, "gguf")
    spec = _mtp(target, out, stop_below=0.0, catch_up=None)  # reads every row
    assert spec.rt.lookup_n == 5 and spec.rt.native_step is not None
    drafted_lookups(target, spec, _ids(target)[:2])
    eng = assert_greedy_equal(target, [speculator(_mtp(target, out, stop_below=0.0), "MTP", cost_trim=False)],
                              _ids(target)[:3], max_tokens=32, n_parallel=3)
    assert eng.stats.speculators["MTP"].accepted_tokens > 0 and not eng.stats.disabled
    with pytest.raises(SpecplugError, match="lookup_n 4 needs --lookup true"):
        MTPTrainer.Options(lookup_n=4)
    with pytest.raises(SpecplugError, match=r"lookup_n must be an integer in \[2, 16\], got 1"):
        MTPTrainer.Options(lookup=True, lookup_n=1)
