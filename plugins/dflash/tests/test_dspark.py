"""DSpark (DFlash's block walked through a Markov head, with a confidence head) on a tiny random target."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from specplug_dflash.dspark import DSpark, DSparkRuntime
from specplug_dflash.dspark_train import DSparkTrainer
from specplug_dflash.speculator import DFlash
from specplug_dflash.train import DFlashTrainer

from specplug.engine import target_info
from specplug.errors import ConfigError, SpecplugError
from specplug.heads import HeadFile
from specplug.testing import HeadKit, assert_greedy_equal, greedy_outputs, speculator
from specplug.train.dataset import TrainData
from specplug.train.eval import evaluate_head
from specplug.train.finetune import BaseHead
from specplug.train.loop import LoopOptions, train
from specplug.types import DraftRequest

TAPS = "1,2,final"
OPTIONS = dict(taps=TAPS, draft_vocab=200, block=6, n_layers=1, init_layers="random")
DFLASH = HeadKit(DFlashTrainer, DFlash, n_layer=3, taps="final,1,2", lr=1e-2, options=OPTIONS)
work, tiny, data, trained = DFLASH.fixtures("dspark")  # the tiny target, its data set, a DFlash head (150 steps)
_target, _ids = DFLASH.target, DFLASH.prompt_ids


def _from_dflash(data, trained, out, steps: int, **options) -> dict:
    """`specplug train dspark --init <the DFlash head>` for `steps` steps."""
    base = BaseHead(HeadFile(trained), DSparkTrainer)
    loop = LoopOptions(steps=steps, lr=3e-3, warmup=5, batch_tokens=2048, val_every=max(1, steps), save_every=10 ** 6,
                       val_fraction=0.1)
    return train(DSparkTrainer, base.options(options), loop, data, out, quiet=True, restart=True, init=base)


@pytest.fixture(scope="module")
def vanilla(data, trained, work):
    _from_dflash(data, trained, work / "vanilla.gguf", 80)
    return work / "vanilla.gguf"


@pytest.fixture(scope="module")
def gated(data, trained, work):
    _from_dflash(data, trained, work / "gated.gguf", 40, markov="gated", markov_rank=8, markov_input="embed",
                 weights="f32")
    return work / "gated.gguf"


def _build(target, head, **params):
    return DSpark(DSpark.Params(head=str(head), **params), target_info(target, 4, 512))


def test_a_head_made_from_a_trained_starts_as_it(data, trained):
    """--init from a DFlash head: the backbone as it is, the Markov bias at zero: the same validation."""
    d = TrainData(data, TAPS.split(","), 0.1)
    head = HeadFile(trained)
    fl = DFlashTrainer(BaseHead(head, DFlashTrainer).options(), d, torch.device("cpu"), init=head)
    sp = DSparkTrainer(BaseHead(head, DSparkTrainer).options(), d, torch.device("cpu"), init=head)
    b = d.collate(d.split["val"][:4])
    hit_f, tot_f = fl.evaluate(b)
    hit_s, tot_s = sp.evaluate(b)
    assert torch.equal(hit_f, hit_s) and torch.equal(tot_f, tot_s) and tot_f[0] > 0
    assert sp.module.heads.w2.abs().sum() == 0 and sp.lr_scale[sp.module.heads.w2] == sp.opts.heads_lr


@pytest.mark.parametrize("which", ["vanilla", "gated"])
def test_greedy_output_equals_plain_with_parallel_sequences(tiny, which, request):
    head = request.getfixturevalue(which)
    target = _target(tiny, "gguf")
    spec = _build(target, head)
    assert spec.rt.dcfg.markov == which and spec.rt.dcfg.confidence
    eng = assert_greedy_equal(target, [speculator(spec, "dspark", cost_trim=False)], _ids(target), max_tokens=40,
                              n_parallel=3)
    st = eng.stats.speculators["dspark"]
    assert st.drafted_tokens > 30 and 0 < st.accepted_tokens and not eng.stats.disabled


def test_the_walk_equals_the_training_module_and_its_confidences_are_the_drafts(tiny, data, gated, work):
    """The runtime's walk (f32 head; in torch, and in numpy as on a CPU) against the training form
    teacher-forced along the drafted tokens: the same logits at every position; the Draft's
    confidences are the confidence head's predictions; the Markov bias changes the logits."""
    target = _target(tiny, "none")
    head = HeadFile(gated)
    d = TrainData(data, TAPS.split(","), 0.1)
    tr = DSparkTrainer(BaseHead(head, DSparkTrainer).options(), d, torch.device("cpu"), init=head)
    b = d.collate(d.split["val"][:1])
    toks = b.tokens[0].tolist()
    c = int(b.dist_start[0]) + 3
    taps = [b.taps[t] for t in TAPS.split(",")]
    spec = _build(target, gated, block_size=6)
    rt = DSparkRuntime(spec.head, target_info(target, 1, 512), spec.rt.backend, 1, 512)
    rt.add_context(rt.encode([t[0, :c] for t in taps]), range(c), [0] * c)
    logits, states = rt.draft_states([toks[c]], [c], [0], [6])
    assert rt.host is not None  # a CPU runtime walks in numpy by default
    for host in (False, True):
        walk = rt.walk(logits, states, host=host)
        prev, got, conf = toks[c], [], []
        for i in range(5):
            lg, best, top, cf = walk.step([i], [prev], i)
            assert best[0] == int(lg[0].argmax()) and top[0] == pytest.approx(
                float(torch.log_softmax(lg[0], -1).max()), abs=1e-5)
            got.append(lg[0])
            conf.append(cf[0])
            prev = int(rt.d2t[lg[0].argmax()])
        drafted = [toks[c]] + [int(rt.d2t[g.argmax()]) for g in got]
        out = tr.module(b.tokens, taps, torch.tensor([[c]]))[0, 0, 1:]
        want, want_conf = tr.module.logits(out, torch.tensor(drafted[:5]), torch.arange(5))
        torch.testing.assert_close(torch.stack(got), want, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(torch.tensor(conf), torch.sigmoid(want_conf), rtol=1e-3, atol=1e-3)
        assert not torch.allclose(logits[:5].float(), want, atol=1e-3)  # the bias moved them

    # through the hook: the confidences of the Draft are the head's, for the tokens it drafted
    spec = _build(target, gated, block_size=6, catch_up=None)
    spec.rt = rt
    rt.cache.seq_rm(0, 0)
    rt.add_context(rt.encode([t[0, :c] for t in taps]), range(c), [0] * c)
    dr = spec.draft_blocks([DraftRequest(0, toks[:c + 1], 5)], [0], [toks[c]], [c], [0], [6], None)[0]
    assert dr is not None and list(dr.token_ids) == drafted[1:1 + len(dr)]
    assert dr.confidence == pytest.approx(conf[:len(dr)], abs=1e-4)


def test_the_markov_head_lifts_the_later_positions_and_the_confidence_is_calibrated(data, trained, vanilla):
    """On the repetitive tiny corpus: the DSpark head made from the DFlash head accepts more per block
    (teacher-forced), and `heads eval` reports its confidence head's calibration."""
    before, after = evaluate_head(trained, data), evaluate_head(vanilla, data)
    assert "calibration" not in before
    assert after["overall"]["expected_accepted"] > before["overall"]["expected_accepted"], (before, after)
    cal = after["calibration"]
    assert cal["rows"] == sum(b["rows"] for b in cal["bins"]) == sum(c["rows"] for c in cal["by_depth"])
    assert cal["rows"] == after["overall"]["counted"][0] + sum(after["overall"]["counted"][1:])
    seen = [b for b in cal["bins"] if b["rows"]]
    assert all(b["from"] <= b["predicted"] <= b["to"] for b in seen)
    overall_p = sum(b["rows"] * b["predicted"] for b in seen) / cal["rows"]
    overall_y = sum(b["rows"] * b["observed"] for b in seen) / cal["rows"]
    assert abs(overall_p - overall_y) < 0.1, cal
    assert cal["ece"] < 0.15, cal


def test_the_confidence_head_trims_what_does_not_pay(tiny, vanilla):
    """Priced, the host verifies only the prefix whose confidences pay: lossless, and the drafts'
    confidences are the head's (the calibrator off by default)."""
    target = _target(tiny, "gguf")
    spec = _build(target, vanilla)
    assert not spec.calib.enabled
    _, eng = greedy_outputs(target, [speculator(spec, "dspark")], _ids(target, 3), max_tokens=30)
    assert not eng.stats.disabled


def test_bad_options_and_heads_are_clear_errors(tiny, data, trained, vanilla, work):
    from specplug.heads import write_head

    with pytest.raises(SpecplugError, match="markov"):
        DSparkTrainer.Options(**OPTIONS, markov="lstm")
    with pytest.raises(ConfigError, match="calibrate"):
        DSpark.Params(calibrate="yes")
    target = _target(tiny, "gguf")
    with pytest.raises(ConfigError, match="dspark: head: .*dflash"):  # a DFlash head is not a DSpark head
        _build(target, trained)
    h = HeadFile(vanilla)
    cfg = dict(h.meta.config, markov="lstm")
    meta = dataclasses.replace(h.meta, config=cfg)
    write_head(work / "bad.gguf", meta, {n: h.tensor(n) for n in h.gguf.tensors})
    with pytest.raises(ConfigError, match="dspark: head: .*config is malformed.*markov"):
        _build(target, work / "bad.gguf")
    with pytest.raises(SpecplugError, match="--markov-rank"):  # a DSpark head fixes its heads' shape
        BaseHead(h, DSparkTrainer).options({"markov_rank": 4})


def test_platt_fit_recovers_a_known_miscalibration():
    """`fit_platt` on predictions over-confident by a known scale and per-position shift finds them."""
    from specplug.train.calibrate import apply_platt, fit_platt

    g = torch.Generator().manual_seed(0)
    n, positions = 40000, 3
    z = torch.randn(n, generator=g) * 2.5
    d = torch.randint(0, positions, (n,), generator=g)
    true_b = torch.tensor([-0.8, 0.0, 0.5])
    y = (torch.rand(n, generator=g) < torch.sigmoid(0.5 * z + true_b[d])).float()
    scale, shifts = fit_platt(torch.sigmoid(z), y, d, positions, per_position=True)
    assert scale == pytest.approx(0.5, abs=0.05) and shifts == pytest.approx(true_b.tolist(), abs=0.08)
    fixed = apply_platt(torch.sigmoid(z), d, scale, shifts)
    for k in range(positions):  # per position the fitted predictions average what happened
        assert float(fixed[d == k].mean()) == pytest.approx(float(y[d == k].mean()), abs=0.01)
    shared, one = fit_platt(torch.sigmoid(z), y, d, positions)  # one shift for all positions
    assert len(set(one)) == 1 and len(one) == positions
    fixed = apply_platt(torch.sigmoid(z), d, shared, one)
    assert float(fixed.mean()) == pytest.approx(float(y.mean()), abs=0.01)


def test_heads_calibrate_folds_the_fit_into_the_head(tiny, data, trained, vanilla, work):
    """`specplug heads calibrate`: the written head drafts the same tokens, with the confidence
    head's predictions moved exactly as the fit says; a head without a confidence head is refused."""
    import json

    from specplug.cli import main
    from specplug.train.calibrate import apply_platt, calibrate_head

    out = work / "calibrated.gguf"
    assert main(["heads", "calibrate", str(vanilla), "--data", str(data), "-o", str(out), "--json",
                 str(work / "cal.json")]) == 0
    r = json.loads((work / "cal.json").read_text())
    assert r["data"]["fit_prompts"] > 0 and r["data"]["check_prompts"] > 0 and r["machine"]["cpu"]
    assert r["before"]["rows"] == r["after"]["rows"] > 0
    assert HeadFile(out).meta.recipe["calibration"]["scale"] == pytest.approx(r["fit"]["scale"], abs=1e-6)
    target = _target(tiny, "none")
    toks = _ids(target, 1)[0]
    drafts = []
    for head in (vanilla, out):  # one block each, walked greedily
        rt = _build(target, head, block_size=6).rt
        walk = rt.walk(*rt.draft_states([toks[-1]], [len(toks) - 1], [0], [6]))
        prev, got = toks[-1], []
        for i in range(5):
            _, best, _, conf = walk.step([i], [prev], i)
            prev = rt.d2t_ids[best[0]]
            got.append((prev, conf[0]))
        drafts.append(got)
    assert [t for t, _ in drafts[0]] == [t for t, _ in drafts[1]]
    want = apply_platt(torch.tensor([c for _, c in drafts[0]]), torch.arange(5), r["fit"]["scale"], r["fit"]["shifts"])
    assert [c for _, c in drafts[1]] == pytest.approx(want.tolist(), abs=2e-3)
    with pytest.raises(SpecplugError, match="no confidence head"):
        calibrate_head(trained, data, work / "no.gguf")
