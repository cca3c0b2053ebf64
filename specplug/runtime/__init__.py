"""The target runtime: GGUF loading, the torch transformer, the KV cache and the tokenizer."""
from __future__ import annotations

from dataclasses import dataclass

from specplug.errors import ModelError
from specplug.runtime.gguf_file import GGUFFile, ModelConfig
from specplug.runtime.governor import ThreadGovernor
from specplug.runtime.kv_cache import KVCache
from specplug.runtime.model import ForwardOutput, OutputHead, TokenEmbeddings, Transformer
from specplug.runtime.resolve import resolve_model
from specplug.runtime.static import StaticOptions, row_bucket
from specplug.runtime.tokenizer import Tokenizer

__all__ = ["GGUFFile", "ModelConfig", "KVCache", "ForwardOutput", "Transformer", "OutputHead", "TokenEmbeddings",
           "Tokenizer", "resolve_model", "Target", "load_target", "resolve_threads"]


@dataclass
class Target:
    """A loaded target: the model and its tokenizer."""

    model: Transformer
    tokenizer: Tokenizer


def resolve_threads(threads: int | str | None) -> int | None:
    """`threads` as a count: "auto" = the cores in this process's affinity mask (what taskset, a
    container's cpuset or a scheduler gave it), an int as given, None = leave torch's choice."""
    import os

    if threads == "auto":
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:  # no affinity masks (macOS, Windows)
            return os.cpu_count() or 1
    return threads


def load_target(model: str, device: str = "auto", dtype: str = "auto", quant: str = "auto",
                threads: int | str | None = None, compile: bool | str = False, cuda_graphs: bool = True,
                step_tokens: int | None = None) -> Target:
    """Resolve a model name or path, load weights and tokenizer; ModelError on any problem.
    `threads`: CPU threads for torch and the native kernels (see resolve_threads); "auto" on a
    CPU with several cores also chooses the count online (specplug.runtime.governor).
    `compile`: run forwards through the static-shape step (specplug.runtime.static); "auto" = on
    CUDA with torch weights. `cuda_graphs`: capture its shapes on CUDA. `step_tokens`: make it
    batch-invariant, every step all sequence slots x this many tokens (rounded up to a bucket).
    Nothing is timed here: how drafts are priced on this target is chosen where drafting is set up
    (specplug.pricing)."""
    import torch

    n = resolve_threads(threads)
    if n:
        torch.set_num_threads(n)
    path = resolve_model(model)
    m = Transformer.load(path, device=device, dtype=dtype, quant=quant)
    if threads == "auto" and n and n > 1 and m.device.type == "cpu":
        m.governor = ThreadGovernor(n)  # auto: the count that is fastest under the load of the moment
    torch_weights = not m.backend.native and m.quant != "int8"
    if compile is True and not torch_weights:
        raise ModelError(f"compile: true runs the torch backend, but this target uses quant: {m.quant} "
                         "(set quant: none, or compile: auto)")
    if compile is True or (compile == "auto" and torch_weights and m.device.type == "cuda" and not m.static_problem()):
        m.use_static(StaticOptions(cuda_graphs=cuda_graphs,
                                   fixed_tokens=None if step_tokens is None else row_bucket(min(step_tokens, 64))))
    tok = Tokenizer.from_metadata(m.metadata, source=str(path))
    return Target(m, tok)
