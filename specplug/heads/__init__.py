"""Trained speculator heads as GGUF files: one format for every method (MTP, Eagle3, DFlash, ...).

A head file is a GGUF whose `general.architecture` is `specplug-head`. Its metadata says what
the head is and what it was trained for, so a loader can refuse a wrong file with a message
instead of drafting garbage:

    specplug.head.method               "mtp" | "eagle3" | "dflash" | ...
    specplug.head.version              format version of that method's tensors
    specplug.head.target.arch          the target architecture (llama, qwen2, ...)
    specplug.head.target.name          the target model's name (for messages)
    specplug.head.target.n_embd        the target's hidden size
    specplug.head.target.vocab_size    the target's vocabulary size
    specplug.head.target.token_table_sha256   sha256 of the target's token table (token_table_sha256)
    specplug.head.taps                 target hidden states the head reads ("final", "3", "15", ...)
    specplug.head.config               JSON: the method's hyper-parameters (layer sizes, rope base, ...)
    specplug.head.recipe               JSON: how it was trained (data manifest hash, steps, validation figures)

Tensors are named by the method; linear weights are stored Q8_0 (or F16/F32), vectors F32, and a
draft-vocabulary map (e.g. `d2t`, draft row -> target token id) as I32.

Drafting toolkit (each part usable on its own):

    HeadSpeculator       a head speculator's start-up: which head file (`head:`, else the one shipped for
                         the target), opening and checking it, `are_compatible`, `request_embeddings` from
                         its taps; `check_head_params` checks the YAML keys head speculators share
    StateKeeper          committed rows per sequence in step, the newest state, `remove`, the position check
    DraftLoop            the batched drafting loop over per-depth logits: picking, calibrated confidences,
                         the stop rule (stop_below, and the host's `DraftRequest.break_even`)
    ChainDrafter         a recursive pair head (MTP, Eagle3) built on both
    ParallelHeadsDrafter parallel heads (Medusa-style: every depth from the newest state in one forward)
    SequentialHeadsDrafter sequential heads (Hydra-style: head k also reads the tokens drafted before it)
    NewestStateDrafter   the hooks both share (the newest committed state per sequence); subclass it for
                         another drafting rule from that state
    PairStep             a pair head's whole greedy draft step (embedding, layer, output head, top-1) in one
                         native call on the GGUF kernels
    Calibrator, pick_tokens   confidences from outcomes; one token per row of logits
    masks                which training rows a chain or parallel head is scored on
"""
from specplug.heads.calibrate import Calibrator
from specplug.heads.chain import ChainDrafter, ChainHead
from specplug.heads.file import (
    HEAD_ARCH,
    HeadError,
    HeadFile,
    HeadMeta,
    layer_from_head,
    token_table_sha256,
    write_head,
)
from specplug.heads.loop import DraftLoop
from specplug.heads.pairstep import PairStep
from specplug.heads.parallel import NewestStateDrafter, ParallelHead, ParallelHeadsDrafter
from specplug.heads.pick import pick_tokens
from specplug.heads.sequential import SequentialHead, SequentialHeadsDrafter
from specplug.heads.speculator import HeadSpeculator, check_head_params
from specplug.heads.state import StateKeeper, assert_draft_aligned, newest_state_position

__all__ = ["Calibrator", "ChainDrafter", "ChainHead", "DraftLoop", "HEAD_ARCH", "HeadError", "HeadFile", "HeadMeta",
           "HeadSpeculator", "NewestStateDrafter", "PairStep", "ParallelHead", "ParallelHeadsDrafter",
           "SequentialHead", "SequentialHeadsDrafter", "StateKeeper", "assert_draft_aligned", "check_head_params",
           "layer_from_head", "newest_state_position", "pick_tokens", "token_table_sha256", "write_head"]
