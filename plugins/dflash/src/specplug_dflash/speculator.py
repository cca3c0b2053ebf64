"""`dflash`: a block drafter that proposes a whole block of tokens in one forward.

In step with the target: `encode` puts the tapped target states of committed rows side by side;
`process_batch` queues them per sequence (the newest `catch_up` only); `draft` first turns a
sequence's queued rows into context features (`fc`) and writes every drafter layer's K/V of them
at their positions, then runs one batched forward of one block per sequence, [x_c, mask, ..., mask]
at positions c.., attending to the context and bidirectionally inside the block, and returns up to
block - 1 tokens with calibrated confidences, walked by the toolkit's `DraftLoop`: a block longer
than the host's n_max is cut to it, and the draft is cut after an end of turn or where the
cumulative confidence falls below the host's break-even (`DraftRequest.break_even`: the host would
trim those tokens). `remove(seq, p0)` drops positions >= p0. The position check is the toolkit's
`StateKeeper`; which head, its checks and the start-up hooks (the taps asked for are the head file's)
are `specplug.heads.HeadSpeculator`'s.

Reading only the newest `catch_up` (32) unread rows at a draft: a sequence's first draft reads the
newest 32 rows of its prompt, and a probe after a pause the newest 32 of the rows the pause held
back; older unread cells stay empty (attention skips empty cells). A head drafting on every step
reads 1-3 rows a draft and is unaffected. `catch_up: null` reads every row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specplug.errors import ConfigError
from specplug.heads import Calibrator, DraftLoop, HeadSpeculator, StateKeeper, check_head_params
from specplug.heads.lookup import chain_lookup
from specplug.hooks import hookimpl
from specplug.runtime.layers import Backend
from specplug.types import Batch, Draft, DraftRequest, TargetInfo, Verified
from specplug_dflash.head import METHOD, VERSION, DFlashConfig, DFlashRuntime


class DFlash(HeadSpeculator):
    """Speculator for a trained DFlash block drafter."""

    method, versions, package, title = METHOD, (VERSION,), "specplug_dflash", "DFlash"
    get_one = "train one (`specplug train dflash`) and set `head:`"

    @dataclass(frozen=True)
    class Params:
        head: str | None = None  # head .gguf; default: the head shipped for this target
        block_size: int | None = None  # tokens per block, the last committed one included (default: as trained)
        temperature: float = 0.0  # 0 = greedy, token-only drafts; > 0 = sampled drafts with probs
        calibrate: bool = True  # learn confidences from verification outcomes
        catch_up: int | None = 32  # a draft reads at most this many committed rows not read yet (newest; None: all)

        def __post_init__(self):
            check_head_params(METHOD, self)
            if self.block_size is not None and not 2 <= self.block_size <= 64:
                raise ConfigError(f"dflash: block_size must be in [2, 64], got {self.block_size!r}")

    config_class = DFlashConfig  # the head's config (a subclass reads more of it)
    runtime_class = DFlashRuntime  # the inference form built from the head

    def __init__(self, params: "DFlash.Params", target: TargetInfo):
        self.params = params
        cfg = self.open_head(params.head, target, self.config_class.from_dict)
        self.taps = cfg.taps
        self.block = params.block_size or cfg.block
        if self.problem:
            return  # are_compatible reports it; nothing is built for a wrong target
        with self.head_errors():
            self.rt = self.runtime_class(self.head, target, Backend.for_target(target), target.n_seq, target.max_ctx)
        self.catch_up = params.catch_up
        # per sequence: committed rows not read yet, as (positions, taps side by side [n, k d]) chunks in order
        self.pending: list[list[tuple[list[int], torch.Tensor]]] = [[] for _ in range(target.n_seq)]
        self.keeper = StateKeeper(target.n_seq, on_reset=self._reset)
        self.calib = Calibrator(self.calibrates(), depths=8)
        self.loop = DraftLoop(target, self.rt.d2t, params.temperature, 0.0, self.calib)

    def calibrates(self) -> bool:
        """Whether the drafts' confidences are calibrated online by outcomes (`calibrate`)."""
        return self.params.calibrate

    @property
    def received(self) -> list[int]:
        """Per sequence: committed positions [0, received) delivered (in the drafter's cache once read)."""
        return self.keeper.received

    def _reset(self, s: int) -> None:
        self.rt.cache.seq_rm(s, 0)
        self.pending[s] = []

    @hookimpl
    def encode(self, batch: Batch) -> torch.Tensor:
        """The tapped states of every committed row side by side [n, k d]; `fc` runs at `draft`, on the
        rows the drafter reads only."""
        return self.rt.taps_side_by_side([batch.embeddings["final" if t == "final" else int(t)] for t in self.taps])

    @hookimpl
    def process_batch(self, batch: Batch, encoded: torch.Tensor) -> None:
        keep, _ = self.keeper.receive(batch)
        if not keep:
            return
        pos, seqs = batch.positions.tolist(), batch.seq_ids.tolist()
        rows: dict[int, list[int]] = {}
        for i in keep:
            mine = rows.setdefault(seqs[i], [])
            if mine and pos[i] <= pos[mine[-1]]:  # the slot started over inside this batch
                mine.clear()
            mine.append(i)
        for s, mine in rows.items():
            if self.catch_up is not None:
                mine = mine[-self.catch_up:]
            self._queue(s, [pos[i] for i in mine], encoded[torch.tensor(mine, device=encoded.device)])

    def _queue(self, s: int, positions: list[int], rows: torch.Tensor) -> None:
        q = self.pending[s]
        q.append((positions, rows))
        if self.catch_up is None:
            return
        n = sum(len(p) for p, _ in q)
        while n - len(q[0][0]) >= self.catch_up:
            n -= len(q.pop(0)[0])
        if n > self.catch_up:
            cut = n - self.catch_up
            q[0] = (q[0][0][cut:], q[0][1][cut:])

    def read_pending(self, seq_ids: Sequence[int]) -> None:
        """Write the queued committed rows of these sequences into the drafter's cache, in one `fc`
        and one context step for all of them (what `draft` does first)."""
        pos, seqs, rows = [], [], []
        for s in seq_ids:
            for p, r in self.pending[s]:
                pos += p
                seqs += [s] * len(p)
                rows.append(r)
            self.pending[s] = []
        if rows:
            self.rt.add_context(self.rt.fuse(torch.cat(rows)), pos, seqs)

    @hookimpl
    def remove(self, seq_id: int, p0: int) -> None:
        # p0 > 0 can only take back draft cells: committed rows taken back break the sequence (no drafts,
        # so nothing queued is read) until it starts over, which clears the queue
        self.rt.cache.seq_rm(seq_id, max(0, p0))
        self.keeper.remove(seq_id, p0)

    @hookimpl
    def draft(self, requests: Sequence[DraftRequest]) -> list[Draft | None]:
        live, last, starts, seqs, sizes = [], [], [], [], []
        for i, r in enumerate(requests):
            c = len(r.tokens) - 1
            size = min(self.block, r.n_max + 1, self.rt.cache.max_ctx - c)
            if size < 2 or not self.keeper.ready(r):
                continue
            live.append(i)
            last.append(r.tokens[-1])
            starts.append(c)
            seqs.append(r.seq_id)
            sizes.append(size)
        if not live:
            return [None] * len(requests)
        self.read_pending(seqs)
        chains = None
        if self.rt.reads_lookup:  # each block's rows read the context's chained proposal
            chains = [chain_lookup(requests[i].tokens, size - 1, self.rt.lookup_n) for i, size in zip(live, sizes)]
        return self.draft_blocks(requests, live, last, starts, seqs, sizes, chains)

    def draft_blocks(self, requests: Sequence[DraftRequest], live: list[int], last: list[int], starts: list[int],
                     seqs: list[int], sizes: list[int], chains: list | None) -> list[Draft | None]:
        """The drafts of one block per live request (requests[live[j]]: its last token, position,
        sequence, block size and chained lookups at j), the drafter's cache up to date."""
        logits = self.rt.draft(last, starts, seqs, sizes, chains)  # [sum(size - 1), draft vocab]
        return self.loop.run_block(requests, live, logits, [size - 1 for size in sizes])

    @hookimpl
    def verified(self, results: Sequence[Verified]) -> None:
        self.calib.verified(results)


shipped_heads, find_head = DFlash.shipped_heads, DFlash.find_head  # the heads this package ships, and a target's
