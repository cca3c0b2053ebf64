"""The target's KV cache as speculators read it: per sequence, read-only views of the keys and values
of the layers a speculator named in `EmbeddingRequest.kv_layers`, for the committed positions only
(`DraftRequest.kv`).

Zero-copy: a view is a slice of the cache's own tensors, built for each `draft` call (so it follows
every rollback: after `seq_rm` the rejected cells are outside it). Read-only: the tensors are
`ReadOnlyTensor`s, a torch subclass that refuses every in-place operation, `out=` argument and item
assignment (`ReadOnlyError`, which disables the speculator as any hook exception does), and passes
its protection on to every tensor that aliases it (slices, transposes, `.detach()`, `.numpy()`,
which gives a numpy array with `writeable = False`); what an operation computes is a plain tensor.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from specplug.runtime.kv_cache import KVCache
from specplug.types import TargetKV

_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                              "__irshift__", "__imatmul__", "__set__"})


class ReadOnlyError(RuntimeError):
    """A speculator tried to write the target's KV cache through `DraftRequest.kv`."""


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _writes(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The name of the operation if it would write a read-only tensor among `args` / `out=`."""
    name = getattr(func, "__name__", "") or str(func)
    out = kwargs.get("out")
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if any(isinstance(o, ReadOnlyTensor) for o in outs):
        return f"{name}(out=...)"
    first = args[0] if args else None
    if not isinstance(first, ReadOnlyTensor):
        return None
    if name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__")):
        return name
    return None


def _protect(out: Any, roots: set[int]) -> Any:
    """Outputs that alias a read-only input become read-only too (numpy arrays: not writeable)."""
    if isinstance(out, torch.Tensor):
        if not isinstance(out, ReadOnlyTensor) and out.device.type != "meta" and _storage(out) in roots:
            return out.as_subclass(ReadOnlyTensor)
        return out
    if isinstance(out, (tuple, list)):
        return type(out)(_protect(o, roots) for o in out)
    try:  # .numpy() / __array__: the array shares the cache's memory
        import numpy as np

        if isinstance(out, np.ndarray):
            out.flags.writeable = False
    except ImportError:  # pragma: no cover
        pass
    return out


class ReadOnlyTensor(torch.Tensor):
    """A tensor (a view of the target's KV cache) that no operation may write; see the module docstring."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _writes(func, args, kwargs)
        if what is not None:
            raise ReadOnlyError(f"DraftRequest.kv is the target's KV cache and read-only: `{what}` would write it "
                                f"(compute from it into tensors of your own)")
        with torch._C.DisableTorchFunctionSubclass():
            roots = {_storage(a) for a in args if isinstance(a, ReadOnlyTensor)}
            out = func(*args, **kwargs)
            return _protect(out, roots)

    def numpy(self, *args, **kwargs):  # noqa: D102 - torch's, with the array marked read-only
        with torch._C.DisableTorchFunctionSubclass():
            arr = torch.Tensor.numpy(self, *args, **kwargs)
        arr.flags.writeable = False
        return arr

    def __array__(self, *args, **kwargs):
        return self.numpy()


def read_only(t: torch.Tensor) -> ReadOnlyTensor:
    """`t` (no copy) as a ReadOnlyTensor."""
    return t.as_subclass(ReadOnlyTensor)


class KVViews:
    """Builds `DraftRequest.kv` from the target's cache: `views(layers, seq, n)` -> layer -> TargetKV
    of sequence `seq`'s committed positions [0, n)."""

    def __init__(self, cache: KVCache):
        self.cache = cache

    def views(self, layers: Sequence[int], seq: int, n: int) -> dict[int, TargetKV]:
        cache = self.cache
        n = min(n, cache.seq_len(seq))
        dense = cache.dense[seq]
        out = {}
        for li in layers:
            cells, window = cache.cells[li], cache.windows[li]
            k, v = cache.k[li][seq], cache.v[li][seq]  # [n_head_kv, cells, head_dim]
            if cells == cache.max_ctx:  # cell p holds position p
                positions = None
                if not dense:  # holes (a range removed in the middle): marked -1
                    positions = torch.arange(n, device=cache.device)
                    positions[~cache.valid[seq, :n]] = -1
                out[li] = TargetKV(read_only(k[:, :n]), read_only(v[:, :n]), positions, window)
            else:  # a ring: cell p % cells holds the newest position p written there
                high = cache.high[seq]  # the highest position written (rolled-back rows included)
                i = torch.arange(cells, device=cache.device)
                last = high - (high - i) % cells  # what each cell physically holds
                held = (last >= 0) & (last < n)  # a rolled-back row overwrote the older position: gone
                held &= cache.valid[seq, last.clamp(0, cache.max_ctx - 1)]
                positions = torch.where(held, last, torch.full_like(last, -1))
                out[li] = TargetKV(read_only(k), read_only(v), positions, window)
        return out
