"""Tests of the `suffix` speculator (suffix decoding): the trees against naive counts, drafts against a
naive suffix decoder, the per-request and global trees, eviction, rollback, the global tree file, and
lossless output through the host's engine."""
from __future__ import annotations

import dataclasses
import random
from collections import Counter
from importlib.metadata import entry_points

import pluggy
import pytest
import torch
from specplug_ngram import _suffix_tree, suffix_file
from specplug_ngram._suffix_tree import NONE, STALE, GlobalTree, SuffixTree
from specplug_ngram.cache_file import vocab_fingerprint
from specplug_ngram.suffix import Suffix

from specplug import hooks
from specplug.errors import ConfigError, PluginError
from specplug.types import Batch, Draft, DraftRequest, TargetInfo

VOCAB = 100


def make_target(vocab: int = VOCAB, texts: list[str] | None = None) -> TargetInfo:
    return TargetInfo(model_path="test.gguf", arch="llama", n_layer=2, n_embd=8, vocab_size=vocab,
                      token_texts=texts or [str(i) for i in range(vocab)], token_types=[1] * vocab,
                      bos_id=None, eos_id=None, eot_ids=frozenset(), device=torch.device("cpu"),
                      dtype=torch.float32, n_seq=4, max_ctx=4096)


def make(vocab: int = VOCAB, **params) -> Suffix:
    return Suffix(Suffix.Params(**params), make_target(vocab))


def ask(spec: Suffix, tokens, seq_id: int = 0, n_max: int = 16, break_even=()) -> Draft | None:
    """The Draft `spec` proposes after `tokens`, checked against the hook's rules."""
    (d,) = spec.draft([DraftRequest(seq_id, list(tokens), n_max, tuple(break_even))])
    if d is not None:
        assert 0 < len(d) <= n_max and all(0 <= t < spec.vocab_size for t in d.token_ids)
        assert d.probs is None and len(d.confidence) == len(d) and all(0 < c <= 1 for c in d.confidence)
    return d


def ids(spec: Suffix, tokens, **kw):
    d = ask(spec, tokens, **kw)
    return None if d is None else d.token_ids


def rows(spec: Suffix, seq_id: int, start: int, tokens, prompt: bool = False) -> None:
    """Deliver committed rows as the host does (process_batch)."""
    n = len(tokens)
    spec.process_batch(Batch(torch.tensor(tokens, dtype=torch.long), torch.arange(start, start + n),
                             torch.full((n,), seq_id, dtype=torch.long), {}, prompt), None)


def run_request(spec: Suffix, seq_id: int, prompt: list[int], output: list[int]) -> None:
    """One request as the engine runs it with one-token steps: prompt rows, then per step a draft
    for the history and the committed row, then the end (remove(seq, 0))."""
    rows(spec, seq_id, 0, prompt, prompt=True)
    hist = prompt + output[:1]
    for t in output[1:]:
        ask(spec, hist, seq_id)
        spec.remove(seq_id, len(hist))  # its draft (if any) was not verified: nothing is cut
        rows(spec, seq_id, len(hist) - 1, [hist[-1]])
        hist.append(t)
    spec.remove(seq_id, 0)


# ---------------------------------------------------------------------------------------------
# the tree, against naive counts


def tree_counts(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    """substring -> count of every node; checks that each `best` is a most frequent child."""
    out: dict[tuple[int, ...], int] = {}

    def walk(n: int, path: tuple[int, ...]) -> None:
        if n == 0:
            kids = [c for key, c in tree.edges.items() if key < (1 << 32)]
        else:
            kids, c = [], tree.first[n]
            while c != NONE:
                kids.append(c)
                c = tree.next[c]
            if kids and tree.best[n] != STALE:
                assert tree.count[tree.best[n]] == max(tree.count[c] for c in kids), f"best child of {path}"
            assert kids or tree.best[n] == NONE
        for c in kids:
            assert tree.count[c] > 0
            out[path + (tree.tok[c],)] = tree.count[c]
            walk(c, path + (tree.tok[c],))

    walk(0, ())
    return out


def naive_counts(docs, depth: int) -> dict[tuple[int, ...], int]:
    c: Counter = Counter()
    for d in docs:
        for i in range(len(d)):
            for k in range(1, min(depth, len(d) - i) + 1):
                c[tuple(d[i:i + k])] += 1
    return dict(c)


@pytest.mark.parametrize("depth", [2, 3, 6])
def test_tree_counts_match_naive_counts_through_growth_and_rollback(depth):
    rng = random.Random(depth)
    tree, front, doc = SuffixTree(depth), [], []
    for step in range(80):
        new = [rng.randrange(4) for _ in range(rng.randrange(1, 7))]
        doc += new
        front = tree.extend(front, new)
        assert tree_counts(tree) == naive_counts([doc], depth)
        assert tree.n_nodes == len(naive_counts([doc], depth))
        assert front == tree.frontier(doc)
        if step % 5 == 2:  # positions >= p0 leave
            p0 = rng.randrange(1, len(doc))
            tree.unwind(doc, p0)
            doc = doc[:p0]
            front = tree.frontier(doc)
            assert tree_counts(tree) == naive_counts([doc], depth), f"after unwind to {p0}"
            assert tree.n_nodes == len(naive_counts([doc], depth))
    tree.unwind(doc, 0)
    assert tree.n_nodes == 0 and tree.edges == {} and tree.count[0] == 0


def test_global_tree_evicts_oldest_and_keeps_nodes_bounded():
    rng = random.Random(5)
    depth, max_tokens = 4, 60
    g = GlobalTree(depth, max_requests=3, max_tokens=max_tokens)
    for i in range(400):
        g.add([rng.randrange(30) for _ in range(rng.randrange(1, 25))])
        kept = list(g.outputs)
        assert len(kept) <= 3 and g.n_tokens == sum(map(len, kept)) <= max_tokens
        assert tree_counts(g.tree) == naive_counts(kept, depth)
        assert g.tree.n_nodes == len(naive_counts(kept, depth)) <= max_tokens * depth
    # freed nodes are reused: what is allocated stays within the bound too
    assert len(g.tree.count) <= max_tokens * depth + 1
    assert g.version == 400


def test_global_tree_caps():
    g = GlobalTree(4, max_requests=0, max_tokens=100)
    g.add([1, 2, 3])
    assert not g.outputs and g.tree.n_nodes == 0  # max_cached_requests: 0 keeps nothing
    g = GlobalTree(4, max_requests=10, max_tokens=5)
    g.add([1, 2, 3, 4, 5, 6, 7])
    assert list(g.outputs) == [[1, 2, 3, 4, 5]]  # an output longer than the cap keeps its start
    g.add([8, 9])
    assert list(g.outputs) == [[8, 9]]


# ---------------------------------------------------------------------------------------------
# drafts, against a naive suffix decoder (Arctic's speculate, written the slow way)


def naive_propose(docs, pattern, depth, limit, factor, offset, min_prob, best=0.0):
    """Counts and last occurrence of every substring; for each match length (longest first) the
    greedy path by (count, most recent); the first with the highest score above `best`."""
    occ: dict[tuple[int, ...], list[int]] = {}
    clock = 0
    for doc in docs:
        for j in range(len(doc)):
            clock += 1
            for d in range(1, min(depth, j + 1) + 1):
                e = occ.setdefault(tuple(doc[j - d + 1:j + 1]), [0, 0])
                e[0] += 1
                e[1] = clock
    found = None
    for d in range(min(len(pattern), depth - 1), 0, -1):
        node = tuple(pattern[-d:])
        if node not in occ:
            continue
        cap = min(limit, int(d * factor + offset + 1e-6), depth - d)
        score, p, toks, probs = 0.0, 1.0, [], []
        for _ in range(max(0, cap)):
            kids = [(occ[s][0], occ[s][1], s[-1]) for s in occ if len(s) == len(node) + 1 and s[:-1] == node]
            if not kids:
                break
            cnt, _, tok = max(kids)
            q = cnt / occ[node][0]
            p *= q
            if p < min_prob:
                break
            toks.append(tok)
            probs.append(q)
            score += p
            node = node + (tok,)
        if score > best:
            best, found = score, (toks, probs)
    return best, found


@pytest.mark.parametrize("factor, offset, min_prob", [(1.0, 0.0, 0.1), (2.0, 1.0, 0.0), (0.5, 0.0, 0.3)])
def test_drafts_match_a_naive_suffix_decoder(factor, offset, min_prob):
    rng = random.Random(int(factor * 10 + offset))
    depth = 7
    spec = make(max_tree_depth=depth, max_spec_factor=factor, max_spec_offset=offset, min_token_prob=min_prob)
    outputs = []
    for request in range(6):
        prompt = [rng.randrange(5) for _ in range(rng.randrange(3, 12))]
        hist = prompt + [rng.randrange(5)]
        rows(spec, 0, 0, prompt, prompt=True)
        for step in range(25):
            n_max = rng.randrange(1, 9)
            d = ask(spec, hist, n_max=n_max)
            local, found = naive_propose([hist], hist, depth, n_max, factor, offset, min_prob)
            _, from_global = naive_propose(outputs, hist, depth, n_max, factor, offset, min_prob, best=local)
            want = from_global or found
            assert (d is None) == (want is None), (request, step)
            if d is not None:
                assert list(d.token_ids) == want[0]
                assert list(d.confidence) == pytest.approx(want[1])
            spec.remove(0, len(hist))
            rows(spec, 0, len(hist) - 1, [hist[-1]])
            hist.append(rng.randrange(5) if rng.random() < 0.6 else hist[-rng.randrange(2, min(6, len(hist) + 1))])
        spec.remove(0, 0)
        outputs.append(hist[len(prompt):-1])  # committed rows after the prompt: the output learnt
        assert list(spec.glob.outputs) == outputs


# ---------------------------------------------------------------------------------------------
# the per-request tree


def test_repeated_text_is_drafted_from_the_request_tree_with_count_confidences():
    s = make(use_global=False)
    # [1 2 3] occurred once before and is the current suffix: count 2, its child 4 count 1
    d = ask(s, [1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert d.token_ids == (4, 5, 9) and d.confidence == (0.5, 1.0, 1.0)  # at most the match length
    assert ids(make(use_global=False), [1, 2, 3, 4, 5, 9, 1, 2, 3], n_max=2) == (4, 5)
    assert ids(make(use_global=False, max_spec_tokens=1), [1, 2, 3, 4, 5, 9, 1, 2, 3]) == (4,)
    assert ids(make(use_global=False), [1, 2, 3, 4, 5, 6]) is None  # nothing repeats
    # with contexts of at most 2 tokens: [7 8] was followed by 1 twice and by 2 once, and is counted
    # 4 times with now; (a longer context, [7 8 1 7 8], would say 2)
    d = ask(make(use_global=False, max_tree_depth=3), [7, 8, 1, 7, 8, 2, 7, 8, 1, 7, 8])
    assert d.token_ids == (1,) and d.confidence == (2 / 4,)


def test_min_token_prob_and_break_even_stop_the_path():
    hist = [5, 1, 2, 3, 4, 0, 9, 1, 2, 3, 4, 0, 8, 1, 2, 3, 4]  # [1 2 3 4]: count 3, then 0 with count 2
    assert ids(make(use_global=False), hist) == (0, 8, 1, 2)  # p = 2/3 then 1/2 of it, then 1, 1
    assert ids(make(use_global=False, min_token_prob=0.5), hist) == (0,)  # 2/3 * 1/2 < 0.5
    assert ids(make(use_global=False, min_token_prob=0.7), hist) is None
    assert ids(make(use_global=False), hist, break_even=(0.1, 0.5, 0.1, 0.1)) == (0,)  # host's advice
    assert ids(make(use_global=False), hist, n_max=0) is None


def test_max_spec_factor_and_offset_scale_the_draft_with_the_match():
    hist = [9, 8, 1, 2, 3, 4, 5, 6, 7, 0, 8]  # [8] matches once before: match length 1
    assert ids(make(use_global=False), hist) == (1,)
    assert ids(make(use_global=False, max_spec_offset=2), hist) == (1, 2, 3)
    assert ids(make(use_global=False, max_spec_factor=4), hist) == (1, 2, 3, 4)
    assert ids(make(use_global=False, max_spec_factor=0, max_spec_offset=1), hist) == (1,)


def test_each_step_costs_only_the_new_tokens(monkeypatch):
    grown = []
    extend = SuffixTree.extend

    def counting(self, front, tokens):
        grown.append(len(tokens))
        return extend(self, front, tokens)

    monkeypatch.setattr(SuffixTree, "extend", counting)
    s = make(use_global=False)
    prompt = list(range(50)) * 20
    rows(s, 0, 0, prompt, prompt=True)
    assert grown == [1000]
    hist = prompt + [0]
    for step in range(5):
        grown.clear()
        d = ask(s, hist)
        assert grown == [1]  # the history's last token, not yet committed
        accepted = list(d.token_ids[:2])
        assert accepted == [(len(hist) + i) % 50 for i in range(2)]
        grown.clear()
        s.remove(0, len(hist) + len(accepted))
        rows(s, 0, len(hist) - 1, [hist[-1]] + accepted)  # the last token again, then what was accepted
        assert grown == [len(accepted)]
        hist += accepted + [hist[len(hist) + len(accepted) - 50]]
    assert s._seqs[0].toks == hist[:-1]


def test_rollback_takes_positions_out_of_the_request_tree():
    s = make(use_global=False, max_tree_depth=6)
    base = [5, 1, 2, 3]
    rows(s, 0, 0, base, prompt=True)
    rows(s, 0, 4, [1, 2, 9, 9])  # rows the tree takes in ...
    s.remove(0, 4)  # ... and positions >= 4 gone again
    st = s._seqs[0]
    assert st.toks == base
    assert tree_counts(st.tree) == naive_counts([base], 6) and st.front == st.tree.frontier(base)
    # [1 2] -> 3 once before (with now: count 2); with [1 2 9] still held it would be a tie won by 9
    d = ask(s, base + [1, 2])
    assert d.token_ids == (3, 1) and d.confidence == (0.5, 1.0)
    assert tree_counts(st.tree) == naive_counts([base + [1, 2]], 6)
    # rows that start inside what is held and differ replace it from there on
    rows(s, 0, 4, [1, 6])
    assert st.toks == [5, 1, 2, 3, 1, 6]
    assert tree_counts(st.tree) == naive_counts([st.toks], 6)
    s.remove(0, 1)  # most of it goes: built again from what is left
    assert st.toks == [5] and tree_counts(st.tree) == {(5,): 1}
    # a history that does not continue what is held (a reused id without remove) starts over
    assert ids(s, [4, 4, 8, 4, 4]) == (8, 4)
    assert st is not s._seqs[0] and s._seqs[0].toks == [4, 4, 8, 4, 4]


def test_tensor_and_tuple_histories():
    s = make(use_global=False)
    (d,) = s.draft([DraftRequest(0, torch.tensor([1, 2, 3, 1, 2]), 8)])
    assert d.token_ids == (3, 1)
    (d,) = s.draft([DraftRequest(0, (1, 2, 3, 1, 2, 3), 8)])
    assert d.token_ids == (1, 2, 3)


# ---------------------------------------------------------------------------------------------
# the global tree


def test_a_finished_output_is_drafted_for_the_next_request():
    s = make(use_request=False)
    prompt_a, output = [90, 91, 92], [10, 11, 12, 13, 14, 15, 16, 17]
    rows(s, 0, 0, prompt_a, prompt=True)
    ask(s, prompt_a + output[:1], seq_id=0)
    rows(s, 1, 0, [50, 51], prompt=True)  # another request, running at the same time
    assert ids(s, [50, 51, 10, 11, 12], seq_id=1) is None  # nothing learnt while the first one runs
    rows(s, 0, 3, output[:-1])  # the rest of its output, committed (the last token never is)
    s.remove(0, 0)  # the first request ends: its output goes into the global tree
    assert list(s.glob.outputs) == [output[:-1]]
    d = ask(s, [50, 51, 10, 11, 12], seq_id=1)
    assert d.token_ids == (13, 14, 15) and d.confidence == (1.0, 1.0, 1.0)  # the match length caps it
    assert ids(s, [50, 51, 91, 92], seq_id=1) is None  # the prompt is not learnt, only the output
    assert s.summary() == "global suffix tree: 1 outputs, 7 tokens, 28 nodes"


def test_the_better_scoring_tree_wins():
    s = make()
    for seq in range(3):  # three finished outputs continue [1 2 3] with 4 4 4
        run_request(s, seq, [60 + seq], [1, 2, 3, 4, 4, 4, 0])
    # the request itself continued [1 2 3] with 7 once: count 2, p 0.5; the global tree has 3 of 3
    d = ask(s, [1, 2, 3, 7, 1, 2, 3], seq_id=3)
    assert d.token_ids == (4, 4, 4) and d.confidence == (1.0, 1.0, 1.0)
    assert ids(make(use_global=False), [1, 2, 3, 7, 1, 2, 3]) == (7, 1, 2)


def test_eviction_after_max_cached_requests():
    s = make(use_request=False, max_cached_requests=2)
    run_request(s, 0, [1], [10, 11, 12, 13, 14])
    run_request(s, 1, [1], [20, 21, 22, 23, 24])
    assert ids(s, [0, 10, 11], seq_id=2) == (12, 13)
    run_request(s, 1, [1], [30, 31, 32, 33, 34])  # the oldest output leaves
    assert ids(s, [0, 10, 11], seq_id=2) is None
    assert ids(s, [0, 20, 21], seq_id=2) == (22, 23) and ids(s, [0, 30, 31], seq_id=2) == (32, 33)
    assert len(s.glob.outputs) == 2


def test_many_requests_keep_the_global_tree_bounded():
    rng = random.Random(0)
    s = make(vocab=1000, max_cached_requests=20, max_cached_tokens=300, max_tree_depth=8)
    for r in range(200):
        out = [rng.randrange(1000) for _ in range(rng.randrange(5, 40))]
        run_request(s, r % 4, [rng.randrange(1000)], out)
        assert len(s.glob.outputs) <= 20 and s.glob.n_tokens <= 300
        assert s.glob.tree.n_nodes <= 300 * 8
    assert len(s.glob.tree.count) <= 300 * 8 + 1  # freed nodes are reused
    assert s.glob.tree.n_nodes == len(naive_counts(s.glob.outputs, 8))
    assert not s._seqs  # every finished request's own tree was dropped


# ---------------------------------------------------------------------------------------------
# the global tree file


def test_save_and_load_round_trip(tmp_path):
    path = tmp_path / "sub" / "global.sfx"
    s = make(dynamic_path=str(path), max_cached_requests=3)
    outs = [[10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34], [40, 41, 42]]
    for i, out in enumerate(outs):
        run_request(s, 0, [1], out)
    assert path.exists()
    fp = vocab_fingerprint([str(i) for i in range(VOCAB)])
    assert suffix_file.load_outputs(path, VOCAB, fp) == [o[:-1] for o in outs[1:]]  # the 3 kept, oldest first
    fresh = make(dynamic_path=str(path), use_request=False)
    assert list(fresh.glob.outputs) == [o[:-1] for o in outs[1:]]
    assert ids(fresh, [5, 30, 31], seq_id=1) == (32, 33)
    assert tree_counts(fresh.glob.tree) == tree_counts(s.glob.tree)
    smaller = make(dynamic_path=str(path), max_cached_requests=1)  # loading keeps the newest that fit
    assert list(smaller.glob.outputs) == [outs[-1][:-1]]
    assert fresh.summary().endswith(f"saved to {path}")
    reader = make(dynamic_path=str(path), save_dynamic=False)
    before = path.read_bytes()
    run_request(reader, 0, [1], [50, 51, 52])
    assert path.read_bytes() == before and "not written" in reader.summary()


def _corruptions(good: bytes):
    yield "truncated", good[:len(good) - 3]
    yield "truncated", good[:40]
    flipped = bytearray(good)
    flipped[-2] ^= 0x10
    yield "checksum", bytes(flipped)
    header = bytearray(good)
    header[13] ^= 1  # vocab size field: caught by the checksum, not misreported
    yield "checksum", bytes(header)
    yield "bad magic", b"definitely not a suffix tree file" * 4
    yield "empty", b""
    yield "unexpected bytes", good + b"\0\0\0\0"
    version = bytearray(good)
    version[8] = 9
    yield "unsupported format version 9", bytes(version)


def test_bad_files_give_one_plugin_error_naming_the_file(tmp_path):
    good = tmp_path / "good.sfx"
    suffix_file.save_outputs(good, [[1, 2, 3], [4, 5]], VOCAB, vocab_fingerprint([str(i) for i in range(VOCAB)]))
    for i, (problem, data) in enumerate(_corruptions(good.read_bytes())):
        bad = tmp_path / f"bad{i}.sfx"
        bad.write_bytes(data)
        with pytest.raises(PluginError) as err:
            make(dynamic_path=str(bad))
        assert str(err.value).startswith(f"suffix: {bad}: ") and problem in str(err.value), str(err.value)
    with pytest.raises(PluginError, match=r"vocabulary of 100 tokens, the target has 120"):
        make(vocab=120, dynamic_path=str(good))
    with pytest.raises(PluginError, match="different vocabulary"):
        Suffix(Suffix.Params(dynamic_path=str(good)), make_target(texts=[f"t{i}" for i in range(VOCAB)]))
    out_of_range = tmp_path / "ids.sfx"
    suffix_file.save_outputs(out_of_range, [[1, 200]], VOCAB, vocab_fingerprint([str(i) for i in range(VOCAB)]))
    with pytest.raises(PluginError, match=r"token id outside \[0, 100\)"):
        make(dynamic_path=str(out_of_range))
    make(dynamic_path=str(tmp_path / "missing.sfx"))  # no file yet: starts empty
    make(dynamic_path=str(tmp_path / "bad0.sfx"), use_global=False)  # the global tree off: not read


def test_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "g.sfx"
    s = make(dynamic_path=str(path))
    run_request(s, 0, [1], [5, 6, 7, 8])
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(suffix_file.os, "replace", broken_replace)  # `replacing` renames with os.replace
    with pytest.raises(PluginError, match="cannot save .*No space left"):
        s.save()
    run_request(s, 0, [1], [9, 10, 11])  # the hook only warns: speculation goes on
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.sfx"]  # no temporary file left behind


# ---------------------------------------------------------------------------------------------
# parameters, entry point, hooks


@pytest.mark.parametrize("params, name", [
    ({"max_tree_depth": 1}, "max_tree_depth"), ({"max_tree_depth": "24"}, "max_tree_depth"),
    ({"max_cached_requests": -1}, "max_cached_requests"), ({"max_cached_tokens": 0}, "max_cached_tokens"),
    ({"max_spec_tokens": 0}, "max_spec_tokens"), ({"max_spec_factor": -1.0}, "max_spec_factor"),
    ({"max_spec_factor": float("inf")}, "max_spec_factor"), ({"max_spec_offset": 100.0}, "max_spec_offset"),
    ({"min_token_prob": 1.5}, "min_token_prob"), ({"min_token_prob": float("nan")}, "min_token_prob"),
    ({"use_global": "yes"}, "use_global"), ({"save_dynamic": 1}, "save_dynamic"),
    ({"dynamic_path": 3}, "dynamic_path"), ({"use_global": False, "use_request": False}, "use_global"),
])
def test_bad_params_raise_config_error_naming_the_key(params, name):
    with pytest.raises(ConfigError) as err:
        make(**params)
    assert str(err.value).startswith(f"suffix: {name} "), str(err.value)


def test_params_do_not_shadow_host_keys():
    from specplug.plugins import HOST_KEYS

    assert not HOST_KEYS & {f.name for f in dataclasses.fields(Suffix.Params)}


def test_entry_point_and_hooks():
    eps = {e.name: e for e in entry_points(group="specplug.speculators")}
    assert "suffix" in eps, "suffix not installed (pip install -e plugins/ngram --no-deps)"
    assert eps["suffix"].load() is Suffix and eps["suffix"].dist.name == "specplug-ngram"
    pm = pluggy.PluginManager("specplug")
    pm.add_hookspecs(hooks)
    pm.register(make(), name="suffix")
    pm.check_pending()
    assert pm.hook.are_compatible(target=make_target()) is None
    assert pm.hook.request_embeddings(target=make_target()) is None
    assert pm.hook.draft(requests=[DraftRequest(0, [1, 2, 3], 4)]) == [None]


def test_module_has_no_object_per_node():
    # the tree's nodes live in int lists: nothing per node for the garbage collector to walk
    tree = SuffixTree(4)
    tree.extend([], list(range(50)) * 3)
    assert {type(v) for v in vars(tree).values()} <= {int, list, dict}
    assert not hasattr(_suffix_tree, "Node")


# ---------------------------------------------------------------------------------------------
# through the host's engine


def test_keeps_the_host_contract(speculator_contract):
    report = speculator_contract(Suffix, Suffix.Params(max_spec_factor=2.0))
    assert report.greedy_drafts > 0 and report.sampling_drafts > 0


def test_greedy_output_unchanged_and_outputs_learnt_across_requests(tiny_target, tmp_path):
    from specplug.engine import Request, target_info
    from specplug.testing import assert_greedy_equal, make_engine, record_drafts, speculator

    tok = tiny_target.tokenizer
    prompts = [tok.encode("the cat sat on the mat. the cat sat on the mat. the cat"),
               tok.encode("in the end, in the end, in the")]
    info = target_info(tiny_target, 2, 512)
    path = tmp_path / "global.sfx"
    spec = Suffix(Suffix.Params(dynamic_path=str(path)), info)
    eng = assert_greedy_equal(tiny_target, [speculator(spec, "suffix", target=info, cost_trim=False)], prompts,
                              max_tokens=24, n_parallel=2)
    assert eng.stats.speculators["suffix"].drafted_tokens > 0
    assert path.exists() and len(spec.glob.outputs) == 2  # both outputs learnt and saved

    # the global tree alone: nothing to draft from for the first request; the same prompt again is
    # drafted from its output, learnt when it finished
    only_global = Suffix(Suffix.Params(use_request=False), info)
    wrapped = speculator(only_global, "suffix", target=info, cost_trim=False)
    log = record_drafts(wrapped)
    eng = make_engine(tiny_target, [wrapped], n_parallel=1)
    first, second = eng.run([Request(prompts[1], 24, 0), Request(prompts[1], 24, 1)])
    assert first.token_ids == second.token_ids
    start = next(i for i in range(1, len(log)) if len(log[i].tokens) < len(log[i - 1].tokens))
    assert all(r.draft is None for r in log[:start])  # the first request: nothing to draft from
    assert all(r.draft is not None for r in log[start:])
    assert eng.stats.speculators["suffix"].accepted_tokens >= len(first.token_ids) // 2
    plain = make_engine(tiny_target, [], n_parallel=1).run([Request(prompts[1], 24, 0)])
    assert plain[0].token_ids == first.token_ids


def test_serve_keeps_the_global_tree_across_requests(tiny_target):
    """`specplug serve` holds one engine, so one suffix instance, for all requests: a second request
    with the first one's prompt is drafted from the first one's answer (the request tree off)."""
    import httpx

    from specplug.engine import target_info
    from specplug.server import create_app
    from specplug.testing import make_engine, running, speculator

    info = target_info(tiny_target, 1, 512)
    spec = Suffix(Suffix.Params(use_request=False), info)
    eng = make_engine(tiny_target, [speculator(spec, "suffix", target=info, cost_trim=False)], n_parallel=1)
    body = {"model": "tiny", "prompt": "in the end, in the end, in the", "max_tokens": 24, "temperature": 0}
    with running(create_app(eng, "tiny")) as base:
        url = base + "/v1/completions"
        first = httpx.post(url, json=body, timeout=30).json()
        assert len(spec.glob.outputs) == 1  # its answer is in the global tree
        second = httpx.post(url, json=body, timeout=30).json()
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["speculative_stats"]["accepted_tokens"] == 0  # nothing to draft from yet
    assert second["speculative_stats"]["accepted_tokens"] >= 12  # drafted from the first answer
