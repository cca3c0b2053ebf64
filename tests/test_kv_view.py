"""`DraftRequest.kv`: a speculator that names target layers in `EmbeddingRequest.kv_layers` reads, at
each draft, those layers' keys and values of the committed positions: views of the target's own cache
(no copy), read-only, that follow rollback, and for sliding-window rings the cells with the positions
they hold."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specplug.engine import Request
from specplug.hooks import hookimpl
from specplug.kv_view import KVViews, ReadOnlyError, read_only
from specplug.runtime import load_target
from specplug.testing import RandomDrafts, assert_greedy_equal, make_engine, speculator, write_tiny_gguf
from specplug.types import EmbeddingRequest

PROMPTS = ["the cat sat on the mat and the cat", "one two three four one two three"]


class KVReader(RandomDrafts):
    """Random drafts (mostly rejected, so rows are rolled back), checking the KV views it is given."""

    def __init__(self, vocab: int, layers=(0, 1)):
        super().__init__(vocab, seed=3)
        self.layers, self.seen = layers, []

    @hookimpl
    def request_embeddings(self, target):
        return EmbeddingRequest(kv_layers=self.layers)

    @hookimpl
    def draft(self, requests):
        for r in requests:
            assert set(r.kv) == set(self.layers)
            # copies: the views are valid during this call only
            self.seen.append((list(r.tokens), {li: (kv.k.clone(), kv.v.clone(), kv.positions, kv.window,
                                                    kv.k.untyped_storage().data_ptr()) for li, kv in r.kv.items()}))
        return super().draft(requests)


@pytest.fixture(scope="module")
def prompts(tiny_target):
    return [tiny_target.tokenizer.encode(p) for p in PROMPTS]


def prefill_kv(model, tokens: list[int]):
    """The keys and values a fresh prefill of `tokens` stores: what the committed positions hold."""
    cache = model.new_cache(1, 512)
    model.forward(tokens, list(range(len(tokens))), [0] * len(tokens), cache, logits_rows=[])
    return cache


def test_views_are_the_committed_positions_of_the_cache_itself(tiny_target, prompts):
    reader = KVReader(tiny_target.model.config.vocab_size)
    eng = assert_greedy_equal(tiny_target, [speculator(reader, "kv", cost_trim=False, backoff=10**6)], prompts, 24,
                              n_parallel=2, allow_unverified=True)
    assert len(reader.seen) > 10
    storages = {eng.cache.k[li].untyped_storage().data_ptr() for li in (0, 1)}
    for tokens, kv in reader.seen[::4]:
        ref = prefill_kv(tiny_target.model, tokens[:-1])
        for li, (k, v, positions, window, storage) in kv.items():
            assert positions is None and window == 0
            assert k.shape == (2, len(tokens) - 1, 16)  # n_head_kv, committed positions, head_dim
            # exactly the rows a plain prefill of the history stores: no rejected row is in the view
            torch.testing.assert_close(k, ref.k[li][0, :, : len(tokens) - 1], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, ref.v[li][0, :, : len(tokens) - 1], rtol=1e-4, atol=1e-4)
            assert storage in storages  # a view of the engine's cache, not a copy


def test_target_info_describes_the_attention(tiny_target_info):
    a = tiny_target_info.attention
    assert (a.n_head, a.n_head_kv, a.head_dim) == (4, 2, 16)
    assert a.scale == pytest.approx(16 ** -0.5) and a.windows == (0, 0) and a.rope_of(1) == (a.rope_base, 1.0)


WRITES = {
    "k.zero_()": lambda k: k.zero_(),
    "k[0] = 0": lambda k: k.__setitem__(0, 0.0),
    "k += 1": lambda k: k.__iadd__(1.0),
    "a slice's add_": lambda k: k[:, :1].add_(1.0),
    "a transpose's fill_": lambda k: k.transpose(0, 1).fill_(0.0),
    "detach().mul_": lambda k: k.detach().mul_(2.0),
    "out=": lambda k: torch.add(k, 1.0, out=k),
    "copy_ into it": lambda k: k.copy_(torch.zeros_like(k)),
    "a reshape's index_put_": lambda k: k[0].reshape(-1).index_put_((torch.tensor([0]),), torch.tensor(9.0)),
}


@pytest.mark.parametrize("how", sorted(WRITES))
def test_no_operation_writes_through_a_view(how):
    cache = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    before = cache.clone()
    k = read_only(cache[:, :2])
    with pytest.raises(ReadOnlyError, match="read-only"):
        WRITES[how](k)
    assert torch.equal(cache, before)


def test_numpy_of_a_view_is_not_writeable_and_computing_gives_plain_tensors():
    cache = torch.ones(2, 3, 4)
    k = read_only(cache)
    arr = k.numpy()
    with pytest.raises(ValueError, match="read-only"):
        arr[0, 0, 0] = 5.0
    with pytest.raises(ValueError, match="read-only"):
        np.asarray(k)[0, 0, 0] = 5.0
    q = torch.randn(2, 1, 4)
    scores = q @ k.transpose(-1, -2)  # computed: a tensor of its own, writable
    assert type(scores) is torch.Tensor
    scores.mul_(2.0)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, k)
    assert type(out) is torch.Tensor and out.shape == (2, 1, 4)
    assert type(k.clone()) is torch.Tensor and torch.equal(cache, torch.ones(2, 3, 4))


class Writer(KVReader):
    @hookimpl
    def draft(self, requests):
        requests[0].kv[0].k.zero_()
        return super().draft(requests)


def test_a_speculator_writing_the_view_is_disabled_and_the_text_is_the_targets(tiny_target, prompts):
    writer = Writer(tiny_target.model.config.vocab_size)
    plain = make_engine(tiny_target).run([Request(p, 24) for p in prompts])
    eng = make_engine(tiny_target, [writer])
    got = eng.run([Request(p, 24) for p in prompts])
    assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    why = next(iter(eng.stats.disabled.values()))
    assert "ReadOnlyError" in why and "read-only" in why


def test_a_ring_layer_shows_its_cells_with_the_positions_they_hold(tmp_path):
    """Gemma 3's sliding layers: a ring of window + slack cells; after a rollback the rolled-back
    cells hold no position, and every cell marked with a position holds that position's row."""
    path = write_tiny_gguf(tmp_path / "g.gguf", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=96,
                           context=128, arch="gemma3", window=4, window_pattern=2, rope_base_window=100.0, scale=2.0)
    model = load_target(str(path), device="cpu", dtype="float32", quant="none").model
    assert model.config.layer_window(0) == 4 and model.config.layer_window(1) == 0
    tokens = [(7 * i + 3) % 200 + 30 for i in range(30)]
    ring = model.new_cache(1, 128, slack=6)  # layer 0: 10 cells
    full = model.new_cache(1, 128, slack=128)  # the same model, every position kept
    for cache in (ring, full):
        model.forward(tokens[:24], list(range(24)), [0] * 24, cache, logits_rows=[])
        model.forward(tokens[24:28], list(range(24, 28)), [0] * 4, cache, logits_rows=[])  # a draft's rows ...
        cache.seq_rm(0, 25)  # ... three of them rejected
    kv = KVViews(ring).views((0, 1), 0, 25)[0]
    assert kv.window == 4 and kv.k.shape[1] == 10
    held = kv.positions.tolist()
    assert sorted(p for p in held if p >= 0) == list(range(18, 25))  # cells 5-7 were overwritten by rows 25-27
    for cell, p in enumerate(held):
        if p >= 0:
            assert p % 10 == cell
            torch.testing.assert_close(kv.k[:, cell], full.k[0][0, :, p])
    whole = KVViews(full).views((1,), 0, 25)[1]
    assert whole.positions is None and whole.k.shape[1] == 25
