"""Hook specifications: the contract between the specplug host and a speculator plugin.

A speculator is a class (loaded from the entry-point group `specplug.speculators`; the
entry-point name is its YAML `type`) whose instance implements some of these hooks with
`@specplug.hookimpl`. The host calls each hook *per speculator* (so results are never
mixed between speculators) and in this order:

    start-up:  are_compatible -> request_embeddings
    prompt:    [target forward] -> encode -> process_batch          (per prompt chunk)
    each step: draft -> [target verify forward]
               -> remove  (each sequence it was asked to draft for, unless its own draft
                           was verified and fully accepted: see `remove`)
               -> verified -> encode -> process_batch (the committed rows only)
    finish:    remove(seq_id, 0) when a sequence ends

Every hook is optional. Hooks must not modify tensors they are given, and must not keep
the embedding tensors of a batch beyond what their own state needs (they are per batch,
never accumulated for the whole prompt by the host). Each speculator gets batch tensors of
its own, so a write reaches no other plugin. An exception from any hook, or a
draft that breaks the rules in `draft`, disables that speculator for the rest of the run
with a warning; the generated text is never affected.

What the host guarantees and enforces:
- `DraftRequest.tokens` is a read-only view of the history (writing to it raises, and the
  speculator is disabled); a draft that makes verification itself fail disables its
  speculator, and that sequence takes the target's own token in the same step.
- `DraftRequest.kv` (for the layers a speculator named in `EmbeddingRequest.kv_layers`) holds
  read-only, zero-copy views of the target's keys and values at the committed positions
  (`specplug.types.TargetKV`); a write through one raises `specplug.kv_view.ReadOnlyError` and
  disables the speculator.
- Every hook call is timed per speculator (run statistics `hook_s`, `hook_calls`); one call
  over `hook_warn_ms` (YAML, default 500) logs one warning naming the speculator and hook.
- Drafting is priced (specplug.drafting): the host measures each speculator's seconds in
  `draft` per drafted token against the target's step, tells the drafter per position what a
  token must be worth (`DraftRequest.break_even`), calls no `draft` for a sequence where no
  token could pay (except sparse one-token probes), and pauses a speculator for a sequence
  while its calls lose time (probes switch it back on); its committed rows may then arrive
  late, concatenated in one batch before its next `draft` (each sequence's rows still in
  position order). `cost_trim: false` turns the pricing off.
- `probs` are checked in one pass (finite, non-negative, rows summing to 1, the drafted token
  given mass), and verification never accepts a token the target gives zero probability.
- `specplug.testing.check_speculator` (fixture `speculator_contract`) runs a speculator class
  through these checks on the tiny model.
"""
from __future__ import annotations

from typing import Sequence

import pluggy
import torch

from specplug.types import Batch, Draft, DraftRequest, EmbeddingRequest, TargetInfo, Verified

hookspec = pluggy.HookspecMarker("specplug")
hookimpl = pluggy.HookimplMarker("specplug")


@hookspec(firstresult=True)
def are_compatible(target: TargetInfo) -> str | None:
    """Check that this speculator can serve `target`; called once before anything else.

    Compare whatever the method depends on: vocabulary size, token texts, special tokens,
    hidden size of the layers it reads. Return None when compatible, or a message naming
    the first mismatch (e.g. "vocab size 32000 != target 49152"); the host then refuses to
    run and shows that message with the speculator's name.
    """


@hookspec(firstresult=True)
def request_embeddings(target: TargetInfo) -> EmbeddingRequest | None:
    """Say which target hidden states this speculator needs; called once, after are_compatible.

    Return None (or an empty EmbeddingRequest) for token-only methods (n-gram, draft model).
    The host taps exactly the union of all requests during target forwards, and nothing
    at all when no speculator asks. `kv_layers` costs nothing per forward: the target's KV cache
    holds them anyway, and each `DraftRequest.kv` is a view of it.
    """


@hookspec(firstresult=True)
def encode(batch: Batch) -> torch.Tensor | None:
    """Turn the target embeddings of `batch` into this speculator's own input embeddings.

    Called after every target forward that commits tokens, just before `process_batch`, only
    for speculators that requested embeddings. `batch.embeddings` holds the requested taps,
    each [len(batch), n_embd] float32. Return [len(batch), d_draft] (identity for MTP, the
    3h -> h fusion for Eagle3, a compression for DFlash) or None to pass nothing on.
    """


@hookspec
def process_batch(batch: Batch, encoded: torch.Tensor | None) -> None:
    """Keep the speculator's own context in step with the target's.

    Called after every target forward with the entries it committed (prompt chunks, and after
    each verification the accepted tokens: the verified token that was last plus the accepted
    draft tokens), for all sequences at once. `encoded` is what `encode` returned (or None).
    The rows of one sequence start exactly at that sequence's committed end, so anything the
    speculator holds for those positions or later is stale. Returns nothing.
    """


@hookspec(firstresult=True)
def draft(requests: Sequence[DraftRequest]) -> Sequence[Draft | None] | None:
    """Propose continuations, one per request (one request per active sequence).

    Return a sequence of the same length as `requests`, element i a Draft for requests[i]
    or None for no draft; returning None means no drafts at all this step.
    `requests[i].break_even[i_tok]` (when not empty) is the probability that draft tokens
    0..i_tok are all accepted below which the host will not verify token i_tok: its row and the
    measured cost of drafting it outweigh what it saves. A drafter whose running product of
    per-token acceptance estimates is already below it should stop before computing that token
    (`specplug.heads` drafters do). The history, `requests[i].tokens`, is read-only. Rules, enforced by
    the host (breaking one disables the speculator): at most `requests[i].n_max` tokens;
    every id in [0, vocab_size); `probs`, when given, shaped [len(draft), vocab_size] (any
    device) with rows that are probability distributions giving the drafted token non-zero
    mass. `probs` must be the distribution each token was actually *sampled* from: a method
    that picks tokens by argmax returns probs=None (treated as one-hot), never its softmax,
    or stochastic verification would be biased.
    Drafting should be batched across requests where the method allows it (one forward of a
    draft model for all sequences).
    """


@hookspec
def verified(results: Sequence[Verified]) -> None:
    """Feedback after each verification: for every sequence this speculator was asked to
    draft for, how many tokens it proposed and how many the target accepted. Methods that
    adapt (ngram-mod turning itself off after dead drafts) use it. Returns nothing.
    """


@hookspec
def remove(seq_id: int, p0: int) -> None:
    """Positions >= p0 of sequence `seq_id` are not (or no longer) in the target's context.

    Called right after a verification forward, before `verified`, for every sequence this
    speculator was asked to draft for: when its draft was partly or wholly rejected, when
    another speculator's draft was verified instead, and when it returned no draft for that
    sequence; not when its own draft was verified and fully accepted. p0 is the target's
    committed end *after* the verification (the position of the token the target just
    produced, which is not in its cache yet): anything you hold at p0 or later is stale.
    Also called with p0 = 0 when a sequence finishes and its id may be reused for a new one.

    Rejected draft tokens are never delivered to `process_batch` (it only sees committed
    rows), so a speculator that keeps nothing but what `process_batch` delivered has nothing
    at p0 or later to cut after a rejection; `remove` matters for state the speculator built
    while drafting (a draft model's KV of its own drafted tokens, a head's cache rows).
    Drop your own state for those positions (like `llama_memory_seq_rm(mem, seq_id, p0, -1)`).
    """
