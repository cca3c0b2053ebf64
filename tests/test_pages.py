"""Weights and KV caches on 2 MB pages (specplug.runtime.pages): the same values in memory that asks
the OS for huge pages, a model that computes the same bits either way, and SPECPLUG_HUGE_PAGES.

Where the OS cannot give 2 MB pages (not Linux, THP "never") `place` and `zeros` fall back to
torch's memory; the tests that need the mappings skip there and say so.
"""
from __future__ import annotations

import gc
import mmap
import os
import weakref

import numpy as np
import pytest
import torch

from specplug.errors import ModelError
from specplug.runtime import load_target, native, pages
from specplug.testing import write_tiny_gguf

huge_available = pytest.mark.skipif(
    not pages.enabled(), reason=f"place/zeros return torch's memory here (THP mode {pages.thp_mode()!r}, "
                                f"{pages.ENV}={os.environ.get(pages.ENV)!r})")


def _ptrs_in_one_chunk(ts) -> bool:
    lo = min(t.data_ptr() for t in ts)
    hi = max(t.data_ptr() + t.nbytes for t in ts)
    return hi - lo <= pages.CHUNK


@huge_available
def test_place_copies_the_values_into_aligned_arena_memory():
    g = torch.Generator().manual_seed(0)
    ts = [torch.randint(0, 256, (37, 18, 128), dtype=torch.uint8, generator=g),
          torch.randn(5, 7, generator=g).half(), torch.randn(3, generator=g), torch.arange(10, dtype=torch.int32)]
    placed = [pages.place(t) for t in ts]
    for t, p in zip(ts, placed):
        assert p.dtype == t.dtype and p.shape == t.shape and torch.equal(p, t)
        assert p.data_ptr() != t.data_ptr() and p.data_ptr() % pages.ALIGN == 0 and p.is_contiguous()
    assert _ptrs_in_one_chunk(placed)  # small tensors share a chunk
    ts[0][0, 0, 0] ^= 1
    assert not torch.equal(placed[0], ts[0])  # a copy, not a view of the original


@huge_available
def test_a_large_tensor_gets_its_own_2mb_aligned_mapping_and_zeros_are_zeros():
    big = torch.ones(pages.CHUNK // 2 + 4096, dtype=torch.uint8)
    p = pages.place(big)
    assert p.data_ptr() % pages.HUGE == 0 and torch.equal(p, big)
    z = pages.zeros((3, 2, 4000, 64), torch.float16)
    assert z.shape == (3, 2, 4000, 64) and z.dtype == torch.float16 and z.data_ptr() % pages.HUGE == 0
    assert not z.any()
    small = pages.zeros((3, 2, 100, 64), torch.float16)  # under one 2 MB page: torch's memory
    assert small._base is None and not small.any()


@huge_available
def test_written_memory_is_on_2mb_pages_where_the_os_gives_them():
    """What the feature is for: memory made here is backed by huge pages once touched (the OS can
    refuse under heavy fragmentation; a CI machine that does is told so by this failure)."""
    z = pages.zeros((4 << 20,), torch.uint8)
    z.fill_(1)
    huge, total = pages.huge_page_bytes([z])
    assert total == 4 << 20 and huge >= 2 << 20, (huge, total)
    if pages.thp_mode() == "madvise":  # ("always" gives memory that does not ask huge pages too)
        # memory that does not ask gets none: a mapping of its own, as glibc's heap may hold ranges
        # numpy has asked for (it madvises its large arrays; once glibc serves those from the heap,
        # a later torch tensor there is on 2 MB pages too)
        mm = mmap.mmap(-1, 4 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        plain = torch.frombuffer(mm, dtype=torch.uint8).fill_(1)
        assert pages.huge_page_bytes([plain]) == (0, 4 << 20)


def test_a_mapping_is_released_with_its_last_tensor(monkeypatch):
    monkeypatch.delenv(pages.ENV, raising=False)
    if not pages.enabled():
        pytest.skip("no transparent huge pages here")
    z = pages.zeros((4 << 20,), torch.uint8)
    addr = z.data_ptr()
    ref = weakref.ref(z._base)
    assert _mapped(addr)
    del z
    gc.collect()
    assert ref() is None and not _mapped(addr)


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def test_specplug_huge_pages_0_gives_torchs_memory_and_a_wrong_value_is_one_clear_error(tmp_path, monkeypatch):
    t = torch.randn(100)
    monkeypatch.setenv(pages.ENV, "0")
    assert not pages.enabled() and pages.place(t) is t
    z = pages.zeros((4, 4), torch.float32)
    assert not z.any() and z._base is None
    monkeypatch.setenv(pages.ENV, "sometimes")
    with pytest.raises(ModelError, match="SPECPLUG_HUGE_PAGES='sometimes': use 1"):
        pages.enabled()
    path = write_tiny_gguf(tmp_path / "m.gguf", tensor_type="F32", seed=2)
    with pytest.raises(ModelError, match="SPECPLUG_HUGE_PAGES"):
        load_target(str(path), device="cpu", quant="none")


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="gguf kernels unavailable")
def test_a_model_on_2mb_pages_computes_the_same_bits(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "q.gguf", tensor_type="Q4_1", seed=4, n_layer=3)
    tokens = list(np.random.default_rng(0).integers(3, 200, 40))
    outs, models = [], []
    for env in ("0", "1"):
        monkeypatch.setenv(pages.ENV, env)
        m = load_target(str(path), device="cpu", quant="gguf").model
        cache = m.new_cache(2, 128)
        out = m.forward(tokens + tokens[:7], list(range(40)) + list(range(7)), [0] * 40 + [1] * 7, cache,
                        taps=frozenset({1}))
        outs.append((out.logits, out.hidden[1], cache.k[1][:, :, :40].clone()))
        models.append(m)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    # SPECPLUG_HUGE_PAGES=0: each weight in torch's own memory (whether glibc's heap around it has a
    # 2 MB page depends on what else shares that heap, numpy's madvised arrays for one: not checked)
    assert all(layer.qkv.qs.untyped_storage().nbytes() == layer.qkv.qs.nbytes for layer in models[0].layers)
    if pages.enabled():
        placed = [layer.qkv.qs for layer in models[1].layers]
        assert _ptrs_in_one_chunk(placed) and pages.huge_page_bytes(placed)[0] > 0  # an arena chunk
