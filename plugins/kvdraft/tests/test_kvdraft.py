"""The kvdraft speculator and its trainer on a tiny random target (2 layers: the head reads layer 1's K/V)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from specplug_kvdraft.head import KVDraftRuntime
from specplug_kvdraft.speculator import KVDraft
from specplug_kvdraft.train import KVDraftTrainer

from specplug.api import build_speculators
from specplug.config import parse_config
from specplug.engine import Request, target_info
from specplug.errors import PluginError, SpecplugError
from specplug.heads import HeadFile, HeadMeta, write_head
from specplug.kv_view import KVViews, read_only
from specplug.testing import HeadKit, assert_greedy_equal, greedy_outputs, make_engine, speculator, write_tiny_gguf
from specplug.train.dataset import TrainData
from specplug.train.loop import LoopOptions, train
from specplug.train.modules import rope_tables
from specplug.types import TargetKV

KIT = HeadKit(KVDraftTrainer, KVDraft, options=dict(draft_vocab=0), taps="final,1")
work, tiny, data, trained = KIT.fixtures("kvdraft")  # the tiny target, its data set, a head trained 150 steps
_train, _target, _build, _ids = KIT.train, KIT.target, KIT.build, KIT.prompt_ids


@pytest.mark.parametrize("quant", ["gguf", "none"])
def test_greedy_output_equals_plain_with_parallel_sequences(tiny, trained, quant):
    target = _target(tiny, quant)
    spec = _build(target, trained, stop_below=0.0)
    # unpriced: on the tiny target a head forward costs about a target step, so the host would pause it
    eng = assert_greedy_equal(target, [speculator(spec, "kvdraft", cost_trim=False)], _ids(target), max_tokens=40,
                              n_parallel=3)
    st = eng.stats.speculators["kvdraft"]
    assert st.drafted_tokens > 50 and 0 < st.accepted_tokens < st.drafted_tokens  # rejections happened
    assert not eng.stats.disabled


def test_trained_head_beats_its_start(tiny, trained, data, work):
    _train(data, work / "start.gguf", 1)  # one step from the target's layer and a random projection
    target = _target(tiny, "gguf")
    acc = {}
    for name, head in (("trained", trained), ("start", work / "start.gguf")):
        _, eng = greedy_outputs(target, [_build(target, head, calibrate=False, stop_below=0.0)], _ids(target),
                                max_tokens=40, n_parallel=2, max_ctx=512)
        st = eng.stats.speculators["KVDraft"]
        acc[name] = st.accepted_tokens / st.drafted_tokens
    assert acc["trained"] > 0.5 and acc["trained"] > acc["start"] + 0.2, acc


def test_it_keeps_no_cache_of_the_context(tiny, trained):
    """Per sequence it holds the newest final state only; the context is the target's, read at each draft."""
    target = _target(tiny, "gguf")
    spec = _build(target, trained, stop_below=0.0)
    info = target_info(target, 4, 512)
    assert spec.request_embeddings(info).kv_layers == (1,)
    eng = make_engine(target, [speculator(spec, "kvdraft", cost_trim=False)], n_parallel=2)
    eng.run([Request(p, 24) for p in _ids(target)[:2]])
    held = [t for t in vars(spec.rt).values() if isinstance(t, torch.Tensor) and t.numel() >= 512 * 16]
    assert not spec.rt._ctx  # nothing of a draft call outlives it
    assert all(t.shape[0] != 512 and 512 not in t.shape for t in held)  # no [.., max_ctx, ..] tensor


@pytest.fixture(scope="module")
def f32_head(data, work):
    """A head exported with float32 weights, and its training form with the same weights."""
    out = work / "f32.gguf"
    _train(data, out, 20, weights="f32")
    d = TrainData(data, ["final", "1"], 0.1)
    tr = KVDraftTrainer(KVDraftTrainer.Options(draft_vocab=0), d, torch.device("cpu"))
    state = torch.load(out.with_name("f32.train") / "checkpoint.pt", weights_only=False)["module"]
    tr.module.load_state_dict(state, strict=False)
    return out, d, tr


def test_runtime_matches_the_training_module_at_every_unroll_step(tiny, f32_head):
    """The runtime, attending to the target's keys/values of the committed positions and to its scratch,
    gives the training form's unrolled logits: the training-time-test mask is what it reads when drafting."""
    out, d, tr = f32_head
    b = d.collate(d.split["val"][:1])
    with torch.no_grad():
        steps = {r: tr.module.logits(o)[0] for r, o in tr.module.unroll(b.tokens, b.positions, tr.unroll_states(b), 3)}
        cos, sin = rope_tables(b.positions, tr.cfg.head_dim, tr.cfg.rope_base)
        k, v = tr.module.target_kv(b.taps["1"], cos, sin)
    n = int(b.valid[0].sum())
    toks = b.tokens[0, :n].tolist()
    h = b.taps["final"][0, :n].float()
    a = int(b.dist_start[0]) + 2  # an anchor inside the answer
    target = _target(tiny, "none")
    spec = _build(target, out)
    rt = KVDraftRuntime(spec.head, target_info(target, 1, 512), spec.rt.backend)
    assert torch.equal(rt.d2t, tr.d2t)
    rt.begin({0: TargetKV(read_only(k[0, :, :a].contiguous()), read_only(v[0, :, :a].contiguous()), None, 0)})
    states, logits = rt.forward(h[a - 1:a], [toks[a]], [a], [0], [0])
    torch.testing.assert_close(logits[0], steps[0][a], rtol=1e-3, atol=1e-3)
    for r in (1, 2):
        states, logits = rt.forward(states, [toks[a + r]], [a + r], [0], [0])
        torch.testing.assert_close(logits[0], steps[r][a + r], rtol=1e-3, atol=1e-3)
    rt.end()


def test_the_native_attention_gives_the_torch_paths_drafts(tiny, trained):
    """On the GGUF kernels every row of a forward attends in one native call over one buffer of all
    sequences; the torch path (CUDA, rings) attends row by row: the same logits, to float error."""
    target = _target(tiny, "gguf")
    m = target.model
    cache = m.new_cache(2, 512)
    prompts = _ids(target)[:2]
    for s, p in enumerate(prompts):
        m.forward(p[:-1], list(range(len(p) - 1)), [s] * (len(p) - 1), cache, logits_rows=[])
    views = {s: KVViews(cache).views((1,), s, len(p) - 1)[1] for s, p in enumerate(prompts)}
    spec = _build(target, trained)
    h = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    got = {}
    for path in ("native", "torch"):
        rt = KVDraftRuntime(spec.head, target_info(target, 2, 512), spec.rt.backend)
        if path == "torch":
            rt._k = None
        rt.begin(views)
        assert (rt._native is not None) == (path == "native")
        states, l0 = rt.forward(h, [p[-1] for p in prompts], [len(p) - 1 for p in prompts], [0, 1], [0, 1])
        _, l1 = rt.forward(states, [5, 6], [len(p) for p in prompts], [0, 1], [0, 1])
        rt.end()
        got[path] = torch.cat([l0, l1])
    torch.testing.assert_close(got["native"], got["torch"], rtol=2e-3, atol=2e-3)


def test_the_trainer_recomputes_the_keys_the_targets_cache_holds(tiny, f32_head):
    """What the trainer derives from the layer-1 taps is what the target's cache holds (its float16
    cells, on the GGUF kernels that made the data set)."""
    _, d, tr = f32_head
    b = d.collate(d.split["val"][:1])
    n = int(b.valid[0].sum())
    with torch.no_grad():
        cos, sin = rope_tables(b.positions, tr.cfg.head_dim, tr.cfg.rope_base)
        k, v = tr.module.target_kv(b.taps["1"], cos, sin)
    m = _target(tiny, "gguf").model
    cache = m.new_cache(1, 512)
    m.forward(b.tokens[0, :n].tolist(), list(range(n)), [0] * n, cache, logits_rows=[])
    view = KVViews(cache).views((1,), 0, n)[1]
    torch.testing.assert_close(view.k.float(), k[0, :, :n], rtol=0.02, atol=0.08)
    torch.testing.assert_close(view.v.float(), v[0, :, :n], rtol=0.02, atol=0.08)


def test_it_passes_the_contract_kit(tiny, trained, speculator_contract):
    target = _target(tiny, "gguf")
    report = speculator_contract(lambda info: KVDraft(KVDraft.Params(head=str(trained)), info), name="kvdraft",
                                 target=target)
    assert report.greedy_drafts > 0


def test_from_mtp_starts_from_an_mtp_heads_weights(data, work):
    """`--from-mtp`: the projection, the layer and the draft vocabulary of an MTP head file (same names)."""
    d = TrainData(data, ["final", "1"], 0.1)
    fresh = KVDraftTrainer(KVDraftTrainer.Options(draft_vocab=64), d, torch.device("cpu"))
    params = {k: (torch.randn_like(v) * 0.1).detach() for k, v in fresh.module.head_params().items()}
    info = fresh.target.info()
    mtp = write_head(work / "mtp.gguf", HeadMeta.for_target(info, "mtp", 1, ["final"], {"n_embd": 64}),
                     {**params, "d2t": torch.arange(100, 164, dtype=torch.int32)})
    tr = KVDraftTrainer(KVDraftTrainer.Options(draft_vocab=64, from_mtp=str(mtp)), d, torch.device("cpu"))
    assert tr.d2t.tolist() == list(range(100, 164))
    for k, v in tr.module.head_params().items():
        torch.testing.assert_close(v.detach(), params[k])
    with pytest.raises(SpecplugError, match="from_mtp: .*not a 'mtp' head|from_mtp: .*'kvdraft'"):
        bad = write_head(work / "kv.gguf", HeadMeta.for_target(info, "kvdraft", 1, ["final"], {}), params)
        KVDraftTrainer(KVDraftTrainer.Options(from_mtp=str(bad)), d, torch.device("cpu"))


def test_a_head_for_another_attention_shape_is_refused(tiny, trained, work):
    other = write_tiny_gguf(work / "other.gguf", n_embd=64, n_head=4, n_head_kv=4, tensor_type="Q8_0", scale=1.5)
    other_target = _target(other, "gguf")
    cfg = parse_config({"model": str(other), "speculators": [{"type": "kvdraft", "head": str(trained)}]})
    with pytest.raises(PluginError, match=r"not compatible|cannot read the target's keys"):
        build_speculators(cfg, target_info(other_target, 1, 256))


def test_interrupted_training_resumes(data, work):
    loop = LoopOptions(steps=6, lr=3e-3, warmup=2, batch_tokens=2048, val_every=3, save_every=2, val_fraction=0.1)
    report = train(KVDraftTrainer, KVDraftTrainer.Options(draft_vocab=0), loop, data, work / "r.gguf", quiet=True,
                   restart=True)
    assert HeadFile(work / "r.gguf", "kvdraft").meta.config["kv_layer"] == 1
    assert Path(work / "r.train").is_dir() and report["recipe"]
