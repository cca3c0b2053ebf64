"""The target runtime: GGUF loading, the torch transformer, the KV cache and the tokenizer."""
from __future__ import annotations

from dataclasses import dataclass

from specplug.runtime.gguf_file import GGUFFile, ModelConfig
from specplug.runtime.kv_cache import KVCache
from specplug.runtime.model import ForwardOutput, OutputHead, TokenEmbeddings, Transformer
from specplug.runtime.resolve import resolve_model
from specplug.runtime.tokenizer import Tokenizer

__all__ = ["GGUFFile", "ModelConfig", "KVCache", "ForwardOutput", "Transformer", "OutputHead", "TokenEmbeddings", "Tokenizer",
           "resolve_model",
           "Target", "load_target"]


@dataclass
class Target:
    """A loaded target: the model and its tokenizer."""

    model: Transformer
    tokenizer: Tokenizer


def load_target(model: str, device: str = "auto", dtype: str = "float32", quant: str = "auto",
                threads: int | None = None) -> Target:
    """Resolve a model name or path, load weights and tokenizer; ModelError on any problem."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    path = resolve_model(model)
    m = Transformer.load(path, device=device, dtype=dtype, quant=quant)
    tok = Tokenizer.from_metadata(m.metadata, source=str(path))
    return Target(m, tok)
