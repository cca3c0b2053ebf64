"""The DFlash block speculator and its trainer on a tiny random target."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from specplug_dflash.head import DFlashRuntime
from specplug_dflash.speculator import DFlash
from specplug_dflash.train import DFlashTrainer

from specplug.api import build_speculators
from specplug.config import parse_config
from specplug.engine import Request, target_info
from specplug.errors import ConfigError, PluginError
from specplug.testing import (
    HeadKit,
    assert_greedy_equal,
    fine_tune_with_lookup,
    greedy_outputs,
    make_engine,
    speculator,
    write_tiny_gguf,
)
from specplug.train.loop import LoopOptions, train
from specplug.types import Batch, DraftRequest

TAPS = "1,2,final"


KIT = HeadKit(DFlashTrainer, DFlash, n_layer=3, taps="final,1,2", lr=1e-2,
              options=dict(taps=TAPS, draft_vocab=200, block=6, n_layers=1, init_layers="random"))
work, tiny, data, trained = KIT.fixtures("dflash")  # the tiny target, its data set, a head trained 150 steps
_train, _target, _dflash, _ids = KIT.train, KIT.target, KIT.build, KIT.prompt_ids


@pytest.mark.parametrize("quant", ["gguf", "none"])
def test_greedy_output_equals_plain_with_parallel_sequences(tiny, trained, quant):
    target = _target(tiny, quant)
    eng = assert_greedy_equal(target, [speculator(_dflash(target, trained), "DFlash", cost_trim=False)], _ids(target),
                              max_tokens=40, n_parallel=3)
    st = eng.stats.speculators["DFlash"]
    assert st.drafted_tokens > 50 and 0 < st.accepted_tokens < st.drafted_tokens and not eng.stats.disabled


def test_trained_drafter_beats_untrained(tiny, data, trained, work):
    _train(data, work / "untrained.gguf", 1)
    target = _target(tiny, "gguf")
    acc = {}
    for name in ("trained", "untrained"):
        spec = speculator(_dflash(target, work / f"{name}.gguf", calibrate=False), "DFlash", cost_trim=False)
        _, eng = greedy_outputs(target, [spec], _ids(target), max_tokens=40, n_parallel=2)
        st = eng.stats.speculators["DFlash"]
        acc[name] = (st.accepted_tokens / st.drafted_tokens, st.accepted_at[0] / st.drafted_at[0])
    # (acceptance rate, first-position acceptance): the first position is the hard one here; deeper
    # positions of a repetitive answer follow once it is right
    assert acc["trained"][0] > acc["untrained"][0] + 0.2 and acc["trained"][1] > acc["untrained"][1] + 0.2, acc


def test_context_after_rejections_equals_a_fresh_replay(tiny, trained):
    target = _target(tiny, "gguf")
    spec = _dflash(target, trained, catch_up=None)  # reads every row, the prompt's too
    eng = make_engine(target, [speculator(spec, "DFlash", cost_trim=False)], n_parallel=3, max_ctx=512)
    for r in [Request(p, 30) for p in _ids(target, 3)]:
        eng.add(r)
    for _ in range(9):  # nine draft-verify steps (all three admitted at the first), then stop mid-generation
        eng.step()
    seqs = {q.slot: list(q.tokens) for q in eng._active.values()}
    assert seqs  # the sequences still running (a finished one has been cleared)
    assert any(spec.pending[s] for s in seqs)  # the last verification's rows wait for the next draft
    spec.read_pending(list(seqs))
    assert (spec.calib.table[..., 1] > spec.calib.table[..., 0]).any()  # some drafts were rejected
    m = target.model
    for slot, toks in seqs.items():
        committed = toks[:-1]
        assert spec.received[slot] == len(committed)
        out = m.forward(committed, list(range(len(committed))), [0] * len(committed), m.new_cache(1, 512),
                        taps={1, 2, m.config.n_layer})
        fresh = DFlashRuntime(spec.head, target_info(target, 1, 512), spec.rt.backend, 1, 512)
        ctx = fresh.encode([out.hidden[1], out.hidden[2], out.hidden[m.config.n_layer]])
        fresh.add_context(ctx, range(len(committed)), [0] * len(committed))
        n = len(committed)
        for kv in ("k", "v"):
            assert torch.equal(getattr(spec.rt.cache, kv)[:, slot, :, :n], getattr(fresh.cache, kv)[:, 0, :, :n])
        assert spec.rt.cache.valid[slot, :n].all() and not spec.rt.cache.valid[slot, n:].any()


def test_a_draft_reads_only_the_newest_unread_rows_and_stays_lossless(tiny, trained):
    target = _target(tiny, "gguf")
    spec = _dflash(target, trained, catch_up=3, n_seq=1)
    m, layers = target.model, [1, 2, target.model.config.n_layer]
    toks = _ids(target, 1)[0] + list(range(40, 60))
    p = len(_ids(target, 1)[0])
    cache = m.new_cache(1, 512)

    def deliver(a: int, b: int) -> None:  # committed rows [a, b) with their taps, as the host sends them
        out = m.forward(toks[a:b], list(range(a, b)), [0] * (b - a), cache, taps=set(layers))
        emb = {1: out.hidden[1], 2: out.hidden[2], "final": out.hidden[layers[-1]]}
        batch = Batch(torch.tensor(toks[a:b]), torch.arange(a, b), torch.zeros(b - a, dtype=torch.long), emb)
        spec.process_batch(batch, spec.encode(batch))

    def draft(n: int) -> None:
        assert spec.draft([DraftRequest(0, toks[:n + 1], 4)])[0] is not None

    deliver(0, p)
    assert p > 3 and [x for q, _ in spec.pending[0] for x in q] == [p - 3, p - 2, p - 1]  # only 3 rows kept
    valid = spec.rt.cache.valid[0]
    assert not valid.any()  # nothing runs until a draft
    draft(p)  # the first draft reads the prompt's newest 3 rows; older cells stay empty, the block is dropped
    assert not valid[:p - 3].any() and valid[p - 3:p].all() and not valid[p:].any()
    deliver(p, p + 5)  # a pause of 12 steps, delivered in two batches
    deliver(p + 5, p + 12)
    draft(p + 12)  # it reads the newest 3 rows; the 9 before them stay empty
    assert valid[p - 3:p].all() and not valid[p:p + 9].any() and valid[p + 9:p + 12].all() and not valid[p + 12:].any()
    # and in the engine (pauses come from the host's pricing), output is plain greedy output
    eng = assert_greedy_equal(target, [speculator(_dflash(target, trained, catch_up=2), "DFlash")], _ids(target),
                              max_tokens=40, n_parallel=3)
    assert not eng.stats.disabled and eng.stats.speculators["DFlash"].drafts > 0


def test_runtime_block_matches_the_training_module(tiny, data, work):
    from specplug.train.dataset import TrainData

    out = work / "f32.gguf"
    _train(data, out, 20, weights="f32", n_layers=2)
    target = _target(tiny, "none")
    d = TrainData(data, TAPS.split(","), 0.1)
    tr = DFlashTrainer(DFlashTrainer.Options(taps=TAPS, draft_vocab=200, block=6, n_layers=2), d, torch.device("cpu"))
    tr.module.load_state_dict(torch.load(work / "f32.train" / "checkpoint.pt", weights_only=False)["module"],
                              strict=False)
    b = d.collate(d.split["val"][:1])
    n = int(b.valid[0].sum())
    c = int(b.dist_start[0]) + 3
    taps = [b.taps[t] for t in TAPS.split(",")]
    want = tr.module.logits(tr.module(b.tokens, taps, torch.tensor([[c]]))[0, 0, 1:])
    spec = _dflash(target, out)
    rt = DFlashRuntime(spec.head, target_info(target, 1, 512), spec.rt.backend, 1, 512)
    rt.add_context(rt.encode([t[0, :c] for t in taps]), range(c), [0] * c)
    got = rt.draft([int(b.tokens[0, c])], [c], [0], [6])
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    assert not rt.cache.valid[0, c:].any()  # the block is not context
    assert n > c + 5


def test_a_block_longer_than_n_max_is_cut(tiny, trained):
    target = _target(tiny, "gguf")
    spec = _dflash(target, trained, block_size=16)
    _, eng = greedy_outputs(target, [speculator(spec, "DFlash", n_max=3, cost_trim=False)], _ids(target, 2),
                            max_tokens=30)
    st = eng.stats.speculators["DFlash"]
    assert st.drafts > 0 and len(st.drafted_at) <= 3 and not eng.stats.disabled


def test_bad_heads_are_clear_errors(tiny, trained, work):
    from specplug.heads import HeadFile, HeadMeta, write_head

    target = _target(tiny, "gguf")
    data = trained.read_bytes()
    (work / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="dflash: head: .*cut.gguf"):
        _dflash(target, work / "cut.gguf")
    h = HeadFile(trained)
    tensors = {n: h.tensor(n) for n in h.gguf.tensors}
    write_head(work / "taps.gguf", HeadMeta(**{**h.meta.__dict__, "taps": ("0", "final")}), tensors)
    with pytest.raises(ConfigError, match=r"config says taps \['1', '2', 'final'\] but its metadata says"):
        _dflash(target, work / "taps.gguf")
    write_head(work / "mtp.gguf", HeadMeta(**{**h.meta.__dict__, "method": "mtp"}), tensors)
    with pytest.raises(ConfigError, match="this is a 'mtp' head, not a 'dflash' head"):
        _dflash(target, work / "mtp.gguf")
    with pytest.raises(ConfigError, match="block_size must be in"):
        DFlash.Params(block_size=1)
    with pytest.raises(ConfigError, match="catch_up must be an integer >= 1 or null"):
        DFlash.Params(catch_up=0)
    other = write_tiny_gguf(work / "other.gguf", n_layer=3, n_embd=96, tensor_type="Q8_0", scale=1.5)
    cfg = parse_config({"model": str(other), "speculators": [{"type": "dflash", "head": str(trained)}]})
    with pytest.raises(PluginError, match=r"trained for tiny \(llama, n_embd 64.*not for the target other.gguf"):
        build_speculators(cfg, target_info(_target(other, "gguf"), 1, 256))


def _beside_a_static_target(tiny: Path, head: Path, lookup: bool) -> None:
    """A runtime of `head` next to a target on the static step against one without static steps: the
    same logits for two blocks of two sequences (with chained lookups when `lookup`), the same context
    cells, and greedy output equal to plain."""
    import dataclasses

    from specplug.runtime.static import StaticOptions

    target = _target(tiny, "none")
    target.model.use_static(StaticOptions(compile=True, backend="aot_eager", fixed_tokens=8))
    spec = _dflash(target, head)
    info = target_info(target, 2, 512)
    eager = DFlashRuntime(spec.head, dataclasses.replace(info, static=None), spec.rt.backend, 2, 512)
    static = DFlashRuntime(spec.head, info, spec.rt.backend, 2, 512)
    assert eager.static is None and static.static is not None and static.cache.spare == 1
    assert static.reads_lookup == lookup
    d2t = spec.rt.d2t
    chains = [[int(d2t[3]), int(d2t[5]), -1, -1, -1], [int(d2t[8]), -1, -1]] if lookup else None
    taps = [torch.randn(30, target.model.config.n_embd) for _ in range(3)]
    got = []
    for rt in (eager, static):
        ctx = rt.encode(taps)
        rt.add_context(ctx[:20], range(20), [0] * 20)
        rt.add_context(ctx[20:], range(10), [1] * 10)
        got.append(rt.draft([7, 9], [20, 10], [0, 1], [6, 4], chains))
        assert rt.cache.valid[0, :20].all() and not rt.cache.valid[0, 20:].any()
        assert rt.cache.valid[1, :10].all() and not rt.cache.valid[1, 10:].any()
    torch.testing.assert_close(got[1], got[0], rtol=1e-4, atol=1e-4)
    assert got[0].shape[0] == 5 + 3
    eng = assert_greedy_equal(target, [speculator(spec, "DFlash", cost_trim=False)], _ids(target, 3), max_tokens=24,
                              n_parallel=2)
    assert eng.stats.speculators["DFlash"].accepted_tokens > 0


def test_context_and_draft_steps_on_static_steps_next_to_a_static_target(tiny, trained):
    """Next to a target on the static step, DFlash's context and block-draft steps run on static
    steps too (head_steps; the blocks' bidirectional attention as per-row limits on the device),
    compute what its eager steps compute, leave the same context cells, and greedy output still
    equals plain."""
    _beside_a_static_target(tiny, trained, lookup=False)


@pytest.fixture(scope="module")
def with_lookup(data, trained, work) -> Path:
    """The trained head fine-tuned into one whose masked rows read the chained pair lookup."""
    return fine_tune_with_lookup(DFlashTrainer, trained, data, work / "lookup.gguf", weights="f32")


def test_a_head_reading_the_chained_lookup_drafts_losslessly_and_as_trained(tiny, data, trained, with_lookup):
    """Lossless with parallel sequences; the runtime's block given the chained lookups equals the
    training module's; the drafter hands each block the chain of its sequence's history."""
    from specplug.heads import HeadFile
    from specplug.heads.lookup import anchor_chains, chain_lookup, lookup_draft_rows
    from specplug.train.dataset import TrainData
    from specplug.train.eval import evaluate_head

    h = HeadFile(with_lookup)
    assert h.meta.config["lookup"] is True and abs(float(h.tensor("lookup.gate_bias")[0])) > 0
    before, after = (evaluate_head(p, data)["overall"]["top1"][0] for p in (trained, with_lookup))
    assert after >= before - 0.02, (before, after)
    target = _target(tiny, "gguf")
    spec = _dflash(target, with_lookup)
    assert spec.rt.reads_lookup and not _dflash(target, trained).rt.reads_lookup
    seen = []
    real = spec.rt.draft

    def spy(last, starts, seqs, sizes, chains=None):
        seen.append((list(starts), list(seqs), list(sizes), chains))
        return real(last, starts, seqs, sizes, chains)

    spec.rt.draft = spy
    eng = assert_greedy_equal(target, [speculator(spec, "DFlash", cost_trim=False)], _ids(target), max_tokens=40,
                              n_parallel=3)
    st = eng.stats.speculators["DFlash"]
    assert st.drafted_tokens > 50 and st.accepted_tokens > 0 and not eng.stats.disabled
    assert all(ch is not None and [len(x) for x in ch] == [z - 1 for z in sizes] for _, _, sizes, ch in seen)
    assert any(x >= 0 for *_, ch in seen for c in ch for x in c)

    # the runtime form (torch, f32 weights) against the training form, at a block whose chain proposes
    target = _target(tiny, "none")
    d = TrainData(data, TAPS.split(","), 0.1)
    tr = DFlashTrainer(DFlashTrainer.Options(taps=TAPS, draft_vocab=200, block=6, n_layers=1, lookup=True), d,
                       torch.device("cpu"), init=h)
    b = d.collate(d.split["val"][:1])
    n = int(b.valid[0].sum())
    toks = b.tokens[0, :n].tolist()
    c = next(c for c in range(int(b.dist_start[0]) + 3, n - 6) if chain_lookup(toks[:c + 1], 5)[1] >= 0)
    chains = anchor_chains(b.tokens, [n], torch.tensor([[c]]), 5)
    assert chains[0, 0].tolist() == chain_lookup(toks[:c + 1], 5)
    taps = [b.taps[t] for t in TAPS.split(",")]
    out = tr.module(b.tokens, taps, torch.tensor([[c]]), chains)[0, 0, 1:]
    want = tr.module.logits(out, lookup_draft_rows(chains, tr.t2d)[0, 0])
    spec = _dflash(target, with_lookup)
    rt = DFlashRuntime(spec.head, target_info(target, 1, 512), spec.rt.backend, 1, 512)
    rt.add_context(rt.encode([t[0, :c] for t in taps]), range(c), [0] * c)
    got = rt.draft([toks[c]], [c], [0], [6], [chains[0, 0].tolist()])
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    rt.add_context(rt.encode([t[0, :c] for t in taps]), range(c), [0] * c)
    plain = rt.draft([toks[c]], [c], [0], [6])  # the same head without its lookups: other logits
    assert not torch.allclose(plain, want, rtol=1e-3, atol=1e-3)


def test_a_lookup_head_next_to_a_static_target_drafts_eagerly_and_the_same(tiny, with_lookup):
    """On a target on the static step, a head reading the chained lookup keeps the static context
    step but drafts its blocks eagerly (the gate reads the rows' states): the same logits as a runtime
    without static steps, the same context cells, and greedy output equal to plain."""
    _beside_a_static_target(tiny, with_lookup, lookup=True)


def test_a_head_whose_chain_matches_longer_ngrams_records_it_and_drafts_with_those_chains(tiny, data, with_lookup,
                                                                                          work, monkeypatch):
    """`--lookup-n 4`: recorded in the head's config and kept by a fine-tune from it; training chains the
    longest-match lookup (`anchor_chains(..., 4)` equals `chain_lookup(..., 4)` at every anchor, and it
    is not the pair's chain everywhere); the drafter hands each block the chain of its sequence's
    history under the head's n; lossless."""
    from specplug.heads import HeadFile
    from specplug.heads.lookup import anchor_chains, chain_lookup
    from specplug.train.finetune import BaseHead

    out = work / "lookup-n4.gguf"
    loop = LoopOptions(steps=3, lr=1e-3, warmup=1, batch_tokens=2048, val_every=3, save_every=10 ** 6, val_fraction=0.1)
    base = BaseHead(HeadFile(with_lookup), DFlashTrainer)
    assert base.options().lookup_n == 2
    train(DFlashTrainer, base.options({"lookup_n": 4}), loop, data, out, quiet=True, restart=True, init=base)
    head = HeadFile(out)
    assert head.meta.config["lookup_n"] == 4 and BaseHead(head, DFlashTrainer).options().lookup_n == 4
    from specplug.train.dataset import TrainData

    d = TrainData(data, TAPS.split(","), 0.1)
    b = d.collate(d.split["train"][:6])
    lengths = b.valid.sum(1).tolist()
    anchors = torch.stack([torch.arange(0, 60, 3)] * len(lengths))
    chains = anchor_chains(b.tokens, lengths, anchors, 5, 4)
    for r, n in enumerate(lengths):
        toks = b.tokens[r, :n].tolist()
        for k, c in enumerate(anchors[r].tolist()):
            if c < n:
                assert chains[r, k].tolist() == chain_lookup(toks[:c + 1], 5, 4), (r, c)
    assert not torch.equal(chains, anchor_chains(b.tokens, lengths, anchors, 5)), "n = 4 chains as the pair"

    target = _target(tiny, "gguf")
    spec = _dflash(target, out)
    assert spec.rt.lookup_n == 4
    import specplug_dflash.speculator as drafter

    asked = []

    def chain(history, n, lookup_n=2):
        asked.append((list(history), n, lookup_n))
        return chain_lookup(history, n, lookup_n)

    monkeypatch.setattr(drafter, "chain_lookup", chain)
    seen = []
    real = spec.rt.draft

    def spy(last, starts, seqs, sizes, chains=None):
        seen.append(chains)
        return real(last, starts, seqs, sizes, chains)

    spec.rt.draft = spy
    eng = assert_greedy_equal(target, [speculator(spec, "DFlash", cost_trim=False)], _ids(target), max_tokens=32,
                              n_parallel=3)
    assert eng.stats.speculators["DFlash"].accepted_tokens > 0 and not eng.stats.disabled
    assert asked and all(n_look == 4 for *_, n_look in asked)
    # each block's chain is its sequence's history chained under n = 4, in the order the blocks were asked
    assert [c for chains in seen for c in chains] == [chain_lookup(h, n, 4) for h, n, _ in asked]
