"""The Eagle3 speculator, its trainer and the EAGLE-3 checkpoint importer on a tiny random target."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from specplug_eagle3.head import Eagle3Runtime
from specplug_eagle3.speculator import Eagle3
from specplug_eagle3.train import Eagle3Trainer

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
    make_engine,
    speculator,
    write_tiny_gguf,
)
from specplug.train.loop import LoopOptions, train
from specplug.types import Batch, DraftRequest

LAYERS = "1,2,3"


KIT = HeadKit(Eagle3Trainer, Eagle3, options=dict(layers=LAYERS, draft_vocab=200), n_layer=4, taps="final,1,2,3")
work, tiny, data, trained = KIT.fixtures("eagle3")  # the tiny target, its data set, a head trained 150 steps
_train, _target, _eagle, _ids = KIT.train, KIT.target, KIT.build, KIT.prompt_ids


@pytest.mark.parametrize("quant", ["gguf", "none"])
def test_greedy_output_equals_plain_with_parallel_sequences(tiny, trained, quant):
    target = _target(tiny, quant)
    # unpriced: on the tiny target a head forward costs about a target step, so the host would pause it
    eng = assert_greedy_equal(target, [speculator(_eagle(target, trained, stop_below=0.0), "Eagle3", cost_trim=False)],
                              _ids(target), max_tokens=40, n_parallel=3)
    st = eng.stats.speculators["Eagle3"]
    assert st.drafted_tokens > 50 and 0 < st.accepted_tokens < st.drafted_tokens and not eng.stats.disabled


def test_trained_head_beats_untrained_head(tiny, data, trained, work):
    _train(data, work / "untrained.gguf", 1)
    target = _target(tiny, "gguf")
    acc = {}
    for name in ("trained", "untrained"):
        spec = _eagle(target, work / f"{name}.gguf", calibrate=False, stop_below=0.0)
        _, eng = greedy_outputs(target, [spec], _ids(target), max_tokens=40, n_parallel=2)
        st = eng.stats.speculators["Eagle3"]
        acc[name] = st.accepted_tokens / st.drafted_tokens
    assert acc["trained"] > 0.5 and acc["trained"] > acc["untrained"] + 0.3, acc


def test_fused_state_pairing_after_rejections_equals_a_fresh_replay(tiny, trained):
    target = _target(tiny, "gguf")
    spec = _eagle(target, trained, stop_below=0.0, catch_up=None)  # reads every row, the prompt's too
    # every draft verified
    eng = make_engine(target, [speculator(spec, "eagle3", cost_trim=False)], n_parallel=3, max_ctx=512)
    for r in [Request(p, 30) for p in _ids(target, 3)]:
        eng.add(r)
    for _ in range(9):  # nine draft-verify steps (all three admitted at the first), then stop mid-generation
        eng.step()
    seqs = {q.slot: list(q.tokens) for q in eng._active.values()}
    assert seqs  # the sequences still running (a finished one has been cleared)
    assert (spec.calib.table[..., 1] > spec.calib.table[..., 0]).any()  # some drafts were rejected
    m, layers = target.model, spec.layers
    for slot, toks in seqs.items():
        done = spec.state[slot].done
        committed = toks[:-1]
        out = m.forward(committed, list(range(len(committed))), [0] * len(committed), m.new_cache(1, 512),
                        taps=set(layers))
        fresh = Eagle3Runtime(spec.head, target_info(target, 1, 512), spec.rt.backend, 1, 512)
        g = fresh.fuse([out.hidden[li] for li in layers])
        g_prev = torch.cat([torch.zeros(1, g.shape[1]), g[:-1]])
        fresh.forward(g_prev[:done], committed[:done], list(range(done)), [0] * done, [])
        for kv in ("k", "v"):
            assert torch.equal(getattr(spec.rt.cache, kv)[0, slot, :, :done], getattr(fresh.cache, kv)[0, 0, :, :done])


def test_runtime_matches_the_training_module_at_every_unroll_step(tiny, data, work):
    from specplug.train.dataset import TrainData

    out = work / "f32.gguf"
    _train(data, out, 20, weights="f32")
    target = _target(tiny, "none")
    d = TrainData(data, LAYERS.split(","), 0.1)
    tr = Eagle3Trainer(Eagle3Trainer.Options(layers=LAYERS, draft_vocab=200), d, torch.device("cpu"))
    tr.module.load_state_dict(torch.load(work / "f32.train" / "checkpoint.pt", weights_only=False)["module"],
                              strict=False)
    b = d.collate(d.split["val"][:1])
    n = int(b.valid[0].sum())
    taps = [b.taps[x] for x in LAYERS.split(",")]
    steps = {r: tr.module.logits(o)[0] for r, o in tr.module.unroll(b.tokens, b.positions, taps, 3)}
    rt = _eagle(target, out).rt
    rt = Eagle3Runtime(_eagle(target, out).head, target_info(target, 1, 512), rt.backend, 1, 512)
    toks = b.tokens[0, :n].tolist()
    g = rt.fuse([t[0, :n] for t in taps])
    g_prev = torch.cat([torch.zeros(1, g.shape[1]), g[:-1]])
    a = int(b.dist_start[0]) + 2
    states, logits = rt.forward(g_prev[:a + 1], toks[:a + 1], list(range(a + 1)), [0] * (a + 1), [a])
    torch.testing.assert_close(logits[0], steps[0][a], rtol=1e-3, atol=1e-3)
    prev = states[a:a + 1]
    for r in (1, 2):
        prev, logits = rt.forward(prev, [toks[a + r]], [a + r], [0], [0])
        torch.testing.assert_close(logits[0], steps[r][a + r], rtol=1e-3, atol=1e-3)


def test_bad_heads_are_clear_errors(tiny, trained, work):
    from specplug.heads import HeadFile, HeadMeta, write_head

    target = _target(tiny, "gguf")
    with pytest.raises(ConfigError, match=r"layers \[0, 1, 2\] differ from the layers the head .* \[1, 2, 3\]"):
        _eagle(target, trained, layers=[0, 1, 2])
    h = HeadFile(trained)
    tensors = {n: h.tensor(n) for n in h.gguf.tensors}
    bad = dict(tensors, d2t=tensors["d2t"].clone())
    bad["d2t"][5] = 100000
    write_head(work / "bad-d2t.gguf", h.meta, bad)
    with pytest.raises(ConfigError,
                       match=r"d2t maps draft rows to token ids \[100000\] outside the target's vocabulary"):
        _eagle(target, work / "bad-d2t.gguf")
    meta = HeadMeta(**{**h.meta.__dict__, "taps": ("0", "2", "3")})
    write_head(work / "bad-taps.gguf", meta, tensors)
    with pytest.raises(ConfigError, match=r"config says layers \[1, 2, 3\] but its taps are \['0', '2', '3'\]"):
        _eagle(target, work / "bad-taps.gguf")
    other = write_tiny_gguf(work / "other.gguf", n_layer=4, n_embd=96, tensor_type="Q8_0", scale=1.5)
    cfg = parse_config({"model": str(other), "speculators": [{"type": "eagle3", "head": str(trained)}]})
    with pytest.raises(PluginError, match=r"trained for tiny \(llama, n_embd 64.*not for the target other.gguf"):
        build_speculators(cfg, target_info(_target(other, "gguf"), 1, 256))


def test_sampled_drafts_are_drawn_from_the_probs_they_return(tiny, trained):
    """The full-vocabulary probs of a sampled draft are exactly what its tokens were drawn from
    (chi-square over many draws), which is what keeps stochastic verification lossless."""
    target = _target(tiny, "gguf")
    spec = _eagle(target, trained, temperature=1.0, stop_below=0.0, calibrate=False)
    ids = _ids(target, 1)[0]
    m = target.model
    out = m.forward(ids, list(range(len(ids))), [0] * len(ids), m.new_cache(1, 512), taps=set(spec.layers))
    batch = Batch(torch.tensor(ids), torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long),
                  {li: out.hidden[li] for li in spec.layers}, True)
    spec.process_batch(batch, spec.encode(batch))
    first = spec.draft([DraftRequest(0, ids + [5], 1)])[0]
    probs = first.probs[0]
    assert probs.shape == (target.model.config.vocab_size,) and abs(float(probs.sum()) - 1) < 1e-5
    assert set(probs.nonzero().flatten().tolist()) <= set(spec.rt.d2t.tolist())
    counts = torch.zeros_like(probs)
    n = 3000
    for _ in range(n):
        d = spec.draft([DraftRequest(0, ids + [5], 1)])[0]
        torch.testing.assert_close(d.probs[0], probs)
        counts[d.token_ids[0]] += 1
    big = probs * n >= 5  # chi-square over the tokens expected at least 5 times, the rest pooled
    exp = torch.cat([probs[big] * n, (probs[~big] * n).sum().view(1)])
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    keep = exp > 0
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 4 * math.sqrt(2 * dof) + 10, (chi2, dof)


# ---- importing a public EAGLE-3 checkpoint --------------------------------------------------------

def _rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


class _RefEagle3:
    """EAGLE-3's draft step written as the published checkpoints define it (Hugging Face layout:
    half-split RoPE, separate q/k/v/o and gate/up/down), with an explicit per-sequence KV list."""

    def __init__(self, sd: dict, conf: dict):
        self.sd, self.c = sd, conf
        self.k, self.v = [], []

    def _norm(self, x, w):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.c["rms_norm_eps"]) * w

    def step(self, h, tok_emb, pos):
        sd, c = self.sd, self.c
        H, Hkv, D = c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"] // c["num_attention_heads"]
        x = torch.cat([self._norm(tok_emb, sd["midlayer.input_layernorm.weight"]),
                       self._norm(h, sd["midlayer.hidden_norm.weight"])], -1)
        q = (sd["midlayer.self_attn.q_proj.weight"] @ x).view(H, D)
        k = (sd["midlayer.self_attn.k_proj.weight"] @ x).view(Hkv, D)
        v = (sd["midlayer.self_attn.v_proj.weight"] @ x).view(Hkv, D)
        inv = c["rope_theta"] ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
        ang = (pos * inv).float()
        cos, sin = torch.cat([ang.cos(), ang.cos()]), torch.cat([ang.sin(), ang.sin()])
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        self.k.append(k)
        self.v.append(v)
        K, V = torch.stack(self.k, 1), torch.stack(self.v, 1)  # [Hkv, n, D]
        K, V = K.repeat_interleave(H // Hkv, 0), V.repeat_interleave(H // Hkv, 0)
        att = torch.softmax((K @ q.unsqueeze(-1)).squeeze(-1) / math.sqrt(D), -1)  # [H, n]
        o = (att.unsqueeze(-1) * V).sum(1).flatten()
        h2 = h + sd["midlayer.self_attn.o_proj.weight"] @ o
        y = self._norm(h2, sd["midlayer.post_attention_layernorm.weight"])
        y = sd["midlayer.mlp.down_proj.weight"] @ (F.silu(sd["midlayer.mlp.gate_proj.weight"] @ y)
                                                   * (sd["midlayer.mlp.up_proj.weight"] @ y))
        out = h2 + y
        logits = sd["lm_head.weight"] @ self._norm(out, sd["norm.weight"])
        return out, logits


def test_a_public_eagle3_checkpoint_drafts_the_same_tokens_after_conversion(tiny, work):
    from safetensors.torch import save_file

    from specplug.cli import main

    target = _target(tiny, "none")
    mc = target.model.config
    d, H, Hkv, D, n_ff, N = mc.n_embd, 4, 2, 16, 80, 150
    g = torch.Generator().manual_seed(3)
    r = lambda *s, scale=1.0: torch.randn(*s, generator=g) * scale / math.sqrt(s[-1])  # noqa: E731
    d2t_abs = torch.randperm(mc.vocab_size, generator=g)[:N].sort().values
    sd = {"fc.weight": r(d, 3 * d), "midlayer.input_layernorm.weight": 1 + 0.1 * torch.randn(d, generator=g),
          "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(d, generator=g),
          "midlayer.self_attn.q_proj.weight": r(H * D, 2 * d, scale=3),
          "midlayer.self_attn.k_proj.weight": r(Hkv * D, 2 * d, scale=3),
          "midlayer.self_attn.v_proj.weight": r(Hkv * D, 2 * d), "midlayer.self_attn.o_proj.weight": r(d, H * D),
          "midlayer.post_attention_layernorm.weight": torch.ones(d), "midlayer.mlp.gate_proj.weight": r(n_ff, d),
          "midlayer.mlp.up_proj.weight": r(n_ff, d), "midlayer.mlp.down_proj.weight": r(d, n_ff),
          "norm.weight": torch.ones(d), "lm_head.weight": r(N, d, scale=8),
          "d2t": d2t_abs - torch.arange(N), "t2d": torch.zeros(mc.vocab_size, dtype=torch.bool)}
    conf = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": d, "num_attention_heads": H,
            "num_key_value_heads": Hkv, "intermediate_size": n_ff, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "vocab_size": mc.vocab_size, "draft_vocab_size": N, "num_hidden_layers": 1,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}}
    ck = work / "public-eagle3"
    ck.mkdir(exist_ok=True)
    save_file(sd, str(ck / "model.safetensors"))
    (ck / "config.json").write_text(json.dumps(conf))
    assert main(["convert", "eagle3", str(ck), "--target", str(tiny), "-o", str(work / "conv.gguf"),
                 "--weights", "f32"]) == 0
    spec = _eagle(target, work / "conv.gguf", stop_below=0.0, calibrate=False, catch_up=None)
    ref = _RefEagle3(sd, conf)
    m = target.model
    for ids in _ids(target, 3, seed=5):
        out = m.forward(ids, list(range(len(ids))), [0] * len(ids), m.new_cache(1, 64), taps={1, 2, 3})
        fused = sd["fc.weight"] @ torch.cat([out.hidden[li] for li in (1, 2, 3)], -1).T  # [d, n]
        ref.k, ref.v = [], []
        h = torch.zeros(d)
        emb = target.model.embed
        for t, tok in enumerate(ids):
            state, logits = ref.step(h, emb[tok], t)
            h = fused[:, t]
        want = []
        for i in range(4):
            want.append(int(d2t_abs[logits.argmax()]))
            if want[-1] in target.tokenizer.eot_ids:  # drafting stops at the end of a turn
                break
            state, logits = ref.step(state, emb[want[-1]], len(ids) + i)
        spec._reset(0)
        body = Batch(torch.tensor(ids[:-1]), torch.arange(len(ids) - 1), torch.zeros(len(ids) - 1, dtype=torch.long),
                     {li: out.hidden[li][:-1] for li in (1, 2, 3)}, True)
        spec.process_batch(body, spec.encode(body))
        got = spec.draft([DraftRequest(0, ids, 4)])[0]
        assert list(got.token_ids) == want
    with pytest.raises(Exception, match="hidden_size 32 != the target's n_embd 64"):
        (ck / "config.json").write_text(json.dumps({**conf, "hidden_size": 32}))
        from specplug_eagle3.convert import convert

        convert(ck, tiny, work / "x.gguf")


def test_native_step_agrees_with_the_python_form_and_picks_its_own_argmax(tiny, trained):
    spec = _eagle(_target(tiny, "gguf"), trained)
    assert spec.rt.native_step is not None  # the gguf kernels run the whole step in one call
    check_native_step(spec.rt)
    # raw states (the three taps side by side) are fused inside the same call, exactly as `fuse` does
    rt = spec.rt
    raw = torch.randn(3, 3 * rt.cfg.n_embd, generator=torch.Generator().manual_seed(5))
    rt.cache.seq_rm(0, 0)
    a = rt.forward(raw, [5, 6, 7], [0, 1, 2], [0, 0, 0], [2], raw=True)
    rt.cache.seq_rm(0, 0)
    b = rt.forward(rt.fuse([raw]), [5, 6, 7], [0, 1, 2], [0, 0, 0], [2])
    rt.cache.seq_rm(0, 0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert _eagle(_target(tiny, "none"), trained).rt.native_step is None  # torch (and CUDA): the Python form


def test_a_draft_reads_only_the_newest_unread_rows_and_stays_lossless(tiny, trained):
    target = _target(tiny, "gguf")
    spec = _eagle(target, trained, stop_below=0.0, catch_up=3, n_seq=1)
    m, layers = target.model, spec.layers
    toks = _ids(target, 1)[0] + list(range(40, 60))
    p = len(_ids(target, 1)[0])

    def deliver(a: int, b: int) -> None:  # committed rows [a, b) with their taps, as the host sends them
        out = m.forward(toks[a:b], list(range(a, b)), [0] * (b - a), cache, taps=set(layers))
        batch = Batch(torch.tensor(toks[a:b]), torch.arange(a, b), torch.zeros(b - a, dtype=torch.long),
                      {li: out.hidden[li] for li in layers})
        spec.process_batch(batch, spec.encode(batch))

    def draft(n: int) -> None:
        assert spec.draft([DraftRequest(0, toks[:n + 1], 2)])[0] is not None

    cache = m.new_cache(1, 512)
    deliver(0, p)
    assert p > 3
    draft(p)  # the first draft reads the prompt's newest 3 rows and the last token; older cells stay empty
    valid = spec.rt.cache.valid[0]
    assert not valid[:p - 3].any() and valid[p - 3:p + 1].all()
    deliver(p, p + 12)  # a pause of 12 steps, delivered in one batch
    draft(p + 12)  # rows p+1..p+11 were missed: it reads the newest 3 and the last token; 8 cells stay empty
    assert valid[p - 3:p + 1].all() and not valid[p + 1:p + 9].any() and valid[p + 9:p + 13].all()
    # and in the engine (pauses come from the host's pricing), output is plain greedy output
    eng = assert_greedy_equal(target, [speculator(_eagle(target, trained, catch_up=2), "Eagle3")], _ids(target),
                              max_tokens=40, n_parallel=3)
    assert not eng.stats.disabled


def test_draft_step_on_static_steps_next_to_a_static_target(tiny, trained):
    """A target on the static step (CUDA's path, traced here with fullgraph on CPU): the head's draft
    step runs on static steps too (StaticRows via head_steps), computes what its eager forward
    computes, and greedy output still equals plain."""
    import dataclasses

    from specplug.runtime.static import StaticOptions

    target = _target(tiny, "none")
    target.model.use_static(StaticOptions(compile=True, backend="aot_eager", fixed_tokens=8))
    spec = _eagle(target, trained, stop_below=0.0)
    assert spec.rt.static is not None and spec.rt.cache.spare == 1
    eager = Eagle3Runtime(spec.head, dataclasses.replace(target_info(target, 1, 512), static=None), spec.rt.backend, 1,
                          512)
    assert eager.static is None
    static = Eagle3Runtime(spec.head, target_info(target, 1, 512), spec.rt.backend, 1, 512)
    g = torch.randn(9, target.model.config.n_embd)
    toks = list(range(40, 49))
    for rt in (eager, static):
        rt.out = rt.forward(g[:7], toks[:7], list(range(7)), [0] * 7, [6])
        rt.out2 = rt.forward(g[7:], toks[7:], [7, 8], [0, 0], [0, 1])
    for a, b in ((eager.out, static.out), (eager.out2, static.out2)):
        torch.testing.assert_close(b[0], a[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b[1], a[1], rtol=1e-4, atol=1e-4)
    assert static.static.graphs >= 2
    eng = assert_greedy_equal(target, [speculator(spec, "Eagle3", cost_trim=False)], _ids(target, 3), max_tokens=24,
                              n_parallel=2)
    assert eng.stats.speculators["Eagle3"].accepted_tokens > 0


@pytest.fixture(scope="module")
def with_lookup(data, trained, work) -> Path:
    """The trained head fine-tuned into one that reads the context's pair lookup."""
    return fine_tune_with_lookup(Eagle3Trainer, trained, data, work / "lookup.gguf")


def test_a_head_reading_the_pair_lookup_starts_as_its_base_and_drafts_losslessly(tiny, data, trained, with_lookup):
    from specplug.heads import HeadFile
    from specplug.train.eval import evaluate_head

    h = HeadFile(with_lookup)
    assert h.meta.config["lookup"] is True and {"lookup.proj", "lookup.gate"} <= set(h.gguf.tensors)
    assert abs(float(h.tensor("lookup.gate_bias")[0])) > 0  # it learned something about trusting the lookup
    before, after = (evaluate_head(p, data)["overall"]["top1"][0] for p in (trained, with_lookup))
    assert after >= before - 0.02, (before, after)
    target = _target(tiny, "gguf")
    spec = _eagle(target, with_lookup, stop_below=0.0)
    assert spec.rt.reads_lookup
    eng = assert_greedy_equal(target, [speculator(spec, "Eagle3", cost_trim=False)], _ids(target), max_tokens=40,
                              n_parallel=3)
    st = eng.stats.speculators["Eagle3"]
    assert st.drafted_tokens > 50 and st.accepted_tokens > 0 and not eng.stats.disabled
    # the native draft step adds the lookup and its gate in the same call as the Python form does
    check_lookup_step(spec.rt)

    from specplug_eagle3.llamacpp import export_llamacpp

    from specplug.errors import SpecplugError

    with pytest.raises(SpecplugError, match=r"reads the context's pair lookup .* export a head trained without"):
        export_llamacpp(with_lookup, tiny, with_lookup.with_name("lookup-lcpp.gguf"))
    assert not with_lookup.with_name("lookup-lcpp.gguf").exists()


def test_the_runtime_reads_the_lookup_as_the_training_module_does(tiny, data, with_lookup, work):
    """Logits of the runtime form given each row's lookup equal the training form's at every unroll
    step (f32 weights, torch runtime), and the drafter hands the runtime the lookups of its history."""
    from specplug.heads import HeadFile
    from specplug.heads.lookup import sequence_lookups, training_lookups
    from specplug.train.dataset import TrainData
    from specplug.train.finetune import BaseHead

    out = work / "lookup-f32.gguf"
    loop = LoopOptions(steps=5, lr=3e-3, warmup=1, batch_tokens=2048, val_every=5, save_every=10 ** 6, val_fraction=0.1)
    base = BaseHead(HeadFile(with_lookup), Eagle3Trainer)
    train(Eagle3Trainer, base.options({"weights": "f32"}), loop, data, out, quiet=True, restart=True, init=base)
    target = _target(tiny, "none")
    d = TrainData(data, LAYERS.split(","), 0.1)
    tr = Eagle3Trainer(Eagle3Trainer.Options(layers=LAYERS, draft_vocab=200, lookup=True), d, torch.device("cpu"),
                       init=HeadFile(out))
    b = d.collate(d.split["val"][:1])
    n = int(b.valid[0].sum())
    look, rows = training_lookups(b.tokens, b.valid, tr.t2d)
    taps = [b.taps[x] for x in LAYERS.split(",")]
    steps = {r: tr.module.logits(o[0], rows[0]) for r, o in tr.module.unroll(b.tokens, b.positions, taps, 3, look)}
    head = _eagle(target, out).head
    rt = Eagle3Runtime(head, target_info(target, 1, 512), _eagle(target, out).rt.backend, 1, 512)
    toks = b.tokens[0, :n].tolist()
    L = sequence_lookups(toks)
    a = next(t for t in range(int(b.dist_start[0]) + 2, n - 3) if L[t] >= 0 and int(rows[0, t]) >= 0)
    g = rt.fuse([t[0, :n] for t in taps])
    g_prev = torch.cat([torch.zeros(1, g.shape[1]), g[:-1]])
    states, logits = rt.forward(g_prev[:a + 1], toks[:a + 1], list(range(a + 1)), [0] * (a + 1), [a], lookup=L[:a + 1])
    torch.testing.assert_close(logits[0], steps[0][a], rtol=1e-3, atol=1e-3)
    prev = states[a:a + 1]
    for r in (1, 2):
        prev, logits = rt.forward(prev, [toks[a + r]], [a + r], [0], [0], lookup=[L[a + r]])
        torch.testing.assert_close(logits[0], steps[r][a + r], rtol=1e-3, atol=1e-3)

    # the drafter: every row it hands the head (the prompt's, committed and drafted ones) carries the
    # lookup of the sequence up to that row, as the head has read it
    drafted_lookups(target, _eagle(target, out, stop_below=0.0, catch_up=None), _ids(target, 2), native=False)


def test_a_head_matching_longer_ngrams_records_it_and_drafts_with_those_lookups(tiny, data, with_lookup, work):
    """`--lookup-n 4`: the head's config records it, a fine-tune from it keeps it (its recipe), training
    reads the longest-match lookups, and the drafter hands the head the same (native step), losslessly."""
    from specplug.heads import HeadFile
    from specplug.heads.lookup import sequence_lookups, training_lookups
    from specplug.train.dataset import TrainData
    from specplug.train.finetune import BaseHead

    out = work / "lookup-n4.gguf"
    loop = LoopOptions(steps=3, lr=1e-3, warmup=1, batch_tokens=2048, val_every=3, save_every=10 ** 6, val_fraction=0.1)
    base = BaseHead(HeadFile(with_lookup), Eagle3Trainer)
    assert base.options().lookup_n == 2  # heads before the option: the pair
    train(Eagle3Trainer, base.options({"lookup_n": 4}), loop, data, out, quiet=True, restart=True, init=base)
    head = HeadFile(out)
    assert head.meta.config["lookup"] is True and head.meta.config["lookup_n"] == 4
    assert BaseHead(head, Eagle3Trainer).options().lookup_n == 4
    d = TrainData(data, LAYERS.split(","), 0.1)
    tr = Eagle3Trainer(BaseHead(head, Eagle3Trainer).options(), d, torch.device("cpu"), init=head)
    b = d.collate(d.split["train"][:8])
    look, _ = tr.lookups(b)
    for r in range(8):
        n = int(b.valid[r].sum())
        assert look[r, :n].tolist() == sequence_lookups(b.tokens[r, :n].tolist(), 4)
    assert not torch.equal(look, training_lookups(b.tokens, b.valid, tr.t2d)[0]), "n = 4 reads as the pair"
    target = _target(tiny, "gguf")
    spec = _eagle(target, out, stop_below=0.0, catch_up=None)
    assert spec.rt.lookup_n == 4 and spec.rt.native_step is not None
    drafted_lookups(target, spec, _ids(target, 2))
    eng = assert_greedy_equal(target, [speculator(_eagle(target, out, stop_below=0.0), "Eagle3", cost_trim=False)],
                              _ids(target), max_tokens=32, n_parallel=3)
    assert eng.stats.speculators["Eagle3"].accepted_tokens > 0 and not eng.stats.disabled
    # a head file whose lookup_n cannot be read is refused, naming the file and the key
    import dataclasses

    from specplug.heads.file import write_head

    bad = work / "lookup-n-bad.gguf"
    write_head(bad, dataclasses.replace(head.meta, config={**head.meta.config, "lookup_n": 1}),
               {k: head.tensor(k) for k in head.gguf.tensors})
    with pytest.raises(ConfigError, match=r"lookup-n-bad.gguf: lookup_n must be an integer in \[2, 16\], got 1"):
        _eagle(target, bad)
