"""Data that crosses the plugin boundary. Frozen dataclasses; tensors carry a shape comment.

A speculator sees the target only through these: what the target is (`TargetInfo`),
the batches the target ran (`Batch`), the draft requests (`DraftRequest`) and the
verification outcome (`Verified`). It answers with `EmbeddingRequest` and `Draft`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping, Protocol, Sequence, runtime_checkable

import torch

NO_KV: Mapping = MappingProxyType({})  # DraftRequest.kv of a speculator that reads no target KV


@dataclass(frozen=True)
class TargetInfo:
    """The target model as a speculator may inspect it (given once, at start-up)."""

    model_path: str
    arch: str
    n_layer: int
    n_embd: int
    vocab_size: int
    token_texts: Sequence[str]  # raw GGUF token strings, index = token id
    token_types: Sequence[int]  # GGUF token types (1 normal, 3 control, 4 user-defined, 6 byte)
    bos_id: int | None
    eos_id: int | None
    eot_ids: frozenset[int]  # every id that ends a turn
    device: torch.device
    dtype: torch.dtype
    n_seq: int  # parallel sequences the run may have in flight (sequence ids are 0..n_seq-1)
    max_ctx: int  # positions per sequence
    # [vocab, n_embd] the target's input embedding table (shared, read-only): index it like a tensor,
    # `token_embeddings[ids]` -> float rows [..., n_embd]; on CPU a specplug.runtime.TokenEmbeddings
    # (the file's quantized blocks, rows dequantized as looked up; `.dense()` for the whole table)
    token_embeddings: Any = field(default=None, repr=False)
    # the target's output norm + vocabulary projection (specplug.runtime.OutputHead): heads that share
    # them (MTP, DFlash) take `output_head.linear(rows)` for logits over all or some vocabulary rows
    output_head: Any = field(default=None, repr=False)
    quant: str = "none"  # the target's weight path: gguf (GGUF-block kernels, CPU) | none | int8
    rms_eps: float = 1e-5  # the target's RMSNorm epsilon
    # the host's verification curve: verify_cost(k) is the time of a target forward of k new rows in
    # units of a one-row forward (verify_cost(1) == 1); what a draft's extra rows cost
    verify_cost: Callable[[int], float] | None = field(default=None, repr=False)
    # the target's specplug.runtime.static.StaticOptions when it runs static-shape (compiled, on CUDA
    # graph-captured) steps, else None: a head on the torch backend builds its draft step the same way
    # with specplug.runtime.static.head_steps
    static: Any = field(default=None, repr=False)
    # how the target attends: what a speculator reading its KV cache (EmbeddingRequest.kv_layers) needs
    attention: TargetAttention | None = field(default=None, repr=False)


@dataclass(frozen=True)
class TargetAttention:
    """The target's attention, as its KV cache stores it (`DraftRequest.kv`).

    Keys are stored as the target's attention reads them: after its k-norm (qwen3, gemma3) and RoPE.
    RoPE rotates interleaved pairs (dims 2i, 2i+1) by position * rope_scale * rope_base^(-2i/head_dim)
    (`specplug.runtime.layers.Rope(head_dim, base, device, scale)` builds the same tables; files with
    NeoX-layout rows are permuted to this layout at load). Query heads h read key/value head
    h // (n_head // n_head_kv), scaled by `scale` before the softmax.
    """

    n_head: int
    n_head_kv: int
    head_dim: int
    scale: float  # q.k scale
    rope_base: float  # full-attention layers
    rope_scale: float  # full-attention layers: position * rope_scale
    rope_base_window: float  # sliding-window layers (scale 1)
    windows: tuple[int, ...]  # per layer: 0 = attends to every position; w = to (q - w, q]

    def rope_of(self, layer: int) -> tuple[float, float]:
        """(base, scale) of layer `layer`'s RoPE."""
        return (self.rope_base_window, 1.0) if self.windows[layer] else (self.rope_base, self.rope_scale)


@dataclass(frozen=True)
class EmbeddingRequest:
    """Which target hidden states a speculator needs for every token the target processes.

    `layers`: the *input* hidden state of each listed layer (Eagle3: low/mid/high layers).
    `final`: the pre-norm final hidden state, i.e. the input of the output norm (MTP).
    `kv_layers`: target layers whose keys and values this speculator reads at `draft`, from the
    target's own KV cache (`DraftRequest.kv`; a Gemma 4-style drafter attends to them). Taps cost a
    copy per committed row; a KV view costs nothing, the cache holds it anyway.
    """

    layers: tuple[int, ...] = ()
    final: bool = False
    kv_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class TargetKV:
    """One target layer's keys and values of one sequence, committed positions only (`DraftRequest.kv`).

    Views of the target's KV cache, not copies, valid during the `draft` call only, and read-only:
    an in-place operation, `out=` or item assignment on them (or on a slice of them) raises
    `specplug.kv_view.ReadOnlyError`, which disables the speculator. Rows rejected at verification are
    never in them. Layout and RoPE: `TargetInfo.attention`.
    """

    k: torch.Tensor  # [n_head_kv, cells, head_dim] keys (after k-norm and RoPE), in the cache's dtype (float16
    #                  on the GGUF kernels): cast what you compute with
    v: torch.Tensor  # [n_head_kv, cells, head_dim] values
    # None: cell i holds position i, cells = the committed positions (a full-attention layer). Else [cells]
    # int64, the position each cell holds, -1 for a cell that holds none: a sliding-window layer's ring
    # (cell p % cells holds position p, the newest it kept) or a sequence with a range removed
    positions: torch.Tensor | None
    window: int  # 0: the target attends to every position here; w: a query at q reads (q - w, q]


@dataclass(frozen=True)
class Batch:
    """Entries the target has just committed to its context, for all sequences at once.

    Row i is token `token_ids[i]` of sequence `seq_ids[i]` at position `positions[i]`.
    For one sequence the rows are in position order and start exactly where that
    sequence's committed context ended, so a speculator's own context for that sequence
    stays in step by appending them (anything it held at those positions or later is stale).
    `embeddings[tap][i]` is the target hidden state computed *at* row i (it has seen tokens
    <= position i). MTP/Eagle3 pair h(t-1) with x_t: they keep the last hidden state of each
    sequence between batches, and use zeros before position 0.
    """

    token_ids: torch.Tensor  # [n] int64, CPU
    positions: torch.Tensor  # [n] int64, CPU
    seq_ids: torch.Tensor  # [n] int64, CPU
    # tap -> [n, n_embd] float32 on the target device; tap = layer index, or "final"
    embeddings: Mapping[int | str, torch.Tensor] = field(default_factory=dict)
    is_prompt: bool = False  # True for prompt chunks, False for tokens accepted after verification

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])


@dataclass(frozen=True)
class DraftRequest:
    """Ask for a draft continuing one sequence.

    `tokens` is the sequence's whole history (prompt + generated); its last token is not yet
    in the target's cache: the draft continues *after* it, at position len(tokens).
    """

    seq_id: int
    tokens: Sequence[int]  # the sequence's history, read-only, valid during the `draft` call only: copy what you keep
    n_max: int  # longest draft the host will verify now
    # break_even[i]: the probability that draft tokens 0..i are *all* accepted below which the host
    # will not verify token i (its verification row, plus what drafting one more token costs, is worth
    # more than the tokens it is expected to save). Cumulative probabilities only fall along a draft,
    # so a drafter whose running product of confidences is already below break_even[i] can stop
    # before computing token i. Empty: no advice (draft up to n_max as the method sees fit).
    break_even: tuple[float, ...] = ()
    # layer -> the target's keys and values of this sequence at its committed positions 0..len(tokens)-2,
    # for each layer in the speculator's EmbeddingRequest.kv_layers (read-only views: TargetKV); else empty
    kv: Mapping[int, TargetKV] = field(default_factory=lambda: NO_KV)


@dataclass(frozen=True)
class Draft:
    """A proposed continuation: `token_ids[0]` is the guess for position len(tokens)."""

    token_ids: tuple[int, ...]
    # [len(token_ids), vocab] float32: the draft distribution each token was sampled from;
    # None = token-only (treated as one-hot)
    probs: torch.Tensor | None = None
    # Optional, one per token: the drafter's estimate of the probability that the target accepts
    # token i given that tokens before it were accepted. With it the host trims the draft to the
    # length where one more verification row costs more than it is expected to save, and
    # compares drafts of several speculators by expected tokens; without it the host does the same
    # with the speculator's measured acceptance per draft position.
    confidence: tuple[float, ...] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Verified:
    """The outcome of verifying one sequence's draft from this speculator."""

    seq_id: int
    # tokens verified from this speculator's draft (the host may have trimmed it);
    # when not chosen, tokens proposed (0 if none)
    n_drafted: int
    n_accepted: int  # of those, accepted by the target; 0 when another speculator's draft was verified
    chosen: bool  # whether this speculator's draft was the one verified


@runtime_checkable
class Speculator(Protocol):
    """What an entry point of group `specplug.speculators` must load: a class like this.

    The host builds it as `cls(params, target)`, where `params` is an instance of the class
    attribute `Params` (a dataclass: its fields are the YAML keys, with types and defaults;
    the keys type, name, n_max, n_min, p_min, backoff and cost_trim belong to the host and may
    not be Params fields: `specplug.plugins.HOST_KEYS`), then registers the instance with
    pluggy. Its methods decorated with `specplug.hookimpl` implement the hooks in
    `specplug.hooks` (a public method named like a hook without the decorator gets a warning
    at load: pluggy would silently ignore it).

    Optional, not a hook: a plain method `summary(self) -> str | None` gives one line for the
    run summary (`specplug run` prints it under the speculator's statistics), e.g. the files
    the speculator wrote.
    """

    Params: ClassVar[type]

    def __init__(self, params: Any, target: TargetInfo) -> None: ...
