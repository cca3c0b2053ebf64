"""Committed rows to the speculators: `encode` + `process_batch` with each step's committed entries
(token, position, sequence) and the hidden states each speculator asked for.

A speculator paused for every running sequence (it will not be asked to draft next step), or a
cascade's member that was not asked this step (Engine._dormant), gets its decoding rows later, in
one batch before its next `draft` (or once it holds BACKLOG_ROWS): the contract only needs each
sequence's rows in position order, and one batched encode/process_batch costs a fraction of one per
step. A speculator put in place while sequences run (Engine.replace_speculator) gets no rows of
those sequences.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from specplug.drafting import Speculator
from specplug.runtime.linear import take_rows
from specplug.types import Batch

BACKLOG_ROWS = 256  # a paused speculator's held-back rows are delivered at the latest at this many
Entries = list[tuple[int, int, int]]  # (token, position, sequence) of each committed row


@dataclass
class _Held:
    """Committed decoding rows held back for a paused speculator: the step's entries (token, position,
    sequence), the committed rows of its forward (None: all) and its hidden states, by reference."""

    entries: Entries
    rows: torch.Tensor | None
    hidden: dict[int, torch.Tensor]


class Delivery:
    """The committed rows each speculator is owed. `call(spec, hook, **kw)` runs a hook guarded (the
    engine's); `dormant(spec)` says whether `spec` is paused for every running sequence it may draft
    for; `n_layer`: the target's layers (its tap for a speculator's `final` embeddings)."""

    def __init__(self, call: Callable[..., Any], dormant: Callable[[Speculator], bool], n_layer: int):
        self.call, self.dormant, self.n_layer = call, dormant, n_layer
        # speculator -> decoding rows not yet delivered (see `committed`), and how many
        self._backlog: dict[str, list[_Held]] = {}
        self._backlog_rows: dict[str, int] = {}
        self._unseen: dict[str, set[int]] = {}  # speculator -> slots whose sequence began before it came in

    def replaced(self, name: str, running: set[int]) -> None:
        """A new speculator named `name` came in while the sequences in slots `running` run: nothing held
        for the old one is delivered, and none of those sequences' rows go to the new one."""
        self._backlog.pop(name, None)
        self._backlog_rows.pop(name, None)
        self._unseen[name] = set(running)

    def finished(self, spec: Speculator, slot: int) -> bool:
        """The sequence in `slot` ended: every row held for `spec` is delivered first. Whether `spec` saw
        that sequence (else it holds nothing of it to remove)."""
        if spec.name in self._backlog:
            self.deliver(spec)
        if slot in self._unseen.get(spec.name, ()):
            self._unseen[spec.name].discard(slot)
            return False
        return True

    def committed(self, specs: Sequence[Speculator], entries: Entries, rows: torch.Tensor | None,
                  hidden: dict[int, torch.Tensor], is_prompt: bool) -> None:
        """process_batch (after encode) on every speculator of `specs`, for the committed entries; `rows`:
        their rows in the forward's hidden states (None: all, in order)."""
        users = [s for s in specs if s.enabled and (s.caller.implements("process_batch")
                                                    or s.caller.implements("encode"))]
        if not users:
            return
        for s in users:
            seen, seen_rows = self._seen_by(s, entries, rows)
            if not seen:
                continue
            if not is_prompt and self.dormant(s):
                # held as references (the step's own tensors, which no plugin received: others got copies
                # or index selections); the batch is built at delivery, so a paused speculator costs a
                # list append per step
                self._backlog.setdefault(s.name, []).append(_Held(seen, seen_rows, hidden))
                n = self._backlog_rows[s.name] = self._backlog_rows.get(s.name, 0) + len(seen)
                if n < BACKLOG_ROWS:
                    continue
                batch = None
            else:
                batch = self._batch(s, seen, seen_rows, hidden, is_prompt, len(users))
            self.deliver(s, batch)

    def deliver(self, spec: Speculator, batch: Batch | None = None) -> None:
        """encode + process_batch for what `spec` has been held back, then `batch`."""
        held = self._backlog.pop(spec.name, [])
        self._backlog_rows.pop(spec.name, None)
        batches = []
        if held:  # one batch of all held decoding rows (tensors made once, by concatenation: its own)
            keys = [(layer, layer) for layer in spec.embeddings.layers] + \
                ([("final", self.n_layer)] if spec.embeddings.final else [])
            emb = {k: torch.cat([h.hidden[li] if h.rows is None else h.hidden[li][h.rows] for h in held])
                   for k, li in keys}
            tok, pos, seq = (torch.tensor(c, dtype=torch.long) for c in zip(*(e for h in held for e in h.entries)))
            batches.append(Batch(tok, pos, seq, emb, False))
        if batch is not None and batches and not batch.is_prompt:
            batches = [_concat([batches[0], batch])]
        elif batch is not None:
            batches.append(batch)
        for b in batches:
            encoded = self.call(spec, "encode", batch=b) if b.embeddings else None
            self.call(spec, "process_batch", batch=b, encoded=encoded)

    def _seen_by(self, spec: Speculator, entries: Entries,
                 rows: torch.Tensor | None) -> tuple[Entries, torch.Tensor | None]:
        """The entries (and their rows of the hidden states; None: all, in order) of sequences `spec`
        has seen from their start (see `replaced`)."""
        unseen = self._unseen.get(spec.name)
        if not unseen:
            return entries, rows
        keep = [k for k, e in enumerate(entries) if e[2] not in unseen]
        if len(keep) == len(entries):
            return entries, rows
        at = torch.tensor(keep, dtype=torch.long)
        return [entries[k] for k in keep], at if rows is None else rows[at]

    def _batch(self, spec: Speculator, entries: Entries, rows: torch.Tensor | None,
               hidden: dict[int, torch.Tensor], is_prompt: bool, n_users: int = 1) -> Batch:
        """The Batch of committed entries for `spec`: tensors of its own (an in-place write reaches no
        other plugin) holding the taps it asked for."""
        tok, pos, seq = (torch.tensor(c, dtype=torch.long) for c in zip(*entries))
        emb = {}
        for layer in spec.embeddings.layers:
            emb[layer] = _own(hidden[layer], rows, n_users)
        if spec.embeddings.final:
            emb["final"] = _own(hidden[self.n_layer], rows, n_users)
        return Batch(tok, pos, seq, emb, is_prompt)


def _own(h: torch.Tensor, rows: torch.Tensor | None, n_users: int) -> torch.Tensor:
    """The rows of hidden state `h` as a tensor of one speculator's own (an index selection is a
    new tensor; the whole of `h` is copied when several speculators receive it)."""
    if rows is not None:
        return take_rows(h, rows)
    return h.clone() if n_users > 1 else h


def _concat(batches: list[Batch]) -> Batch:
    """One batch of the rows of several, in order (each sequence's rows stay in position order)."""
    if len(batches) == 1:
        return batches[0]
    cat = torch.cat
    emb = {k: cat([b.embeddings[k] for b in batches]) for k in batches[0].embeddings}
    return Batch(cat([b.token_ids for b in batches]), cat([b.positions for b in batches]),
                 cat([b.seq_ids for b in batches]), emb, batches[0].is_prompt)
