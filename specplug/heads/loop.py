"""`DraftLoop`: the batched drafting loop every head shares, over per-depth logits, with the stop rule.

Depth by depth, for all live requests at once: pick a token per row (argmax, or a sample with
its distribution), give it a calibrated confidence, and decide whether the request goes one
token further. Where the next depth needs a forward (a recursive head), the loop asks for it
only for the rows that go on; where every depth came out of one forward (parallel heads, a
block drafter), it only walks the picks.

The stop rule, before token i (i >= 1) of a request, with cum = the product of the confidences
of tokens 0..i-1: stop when i reaches n_max, the context end or the method's own depth limit;
after an end-of-turn token; when cum < stop_below; and when cum < break_even[i] (the host's
advice, `DraftRequest.break_even`): confidences are at most 1, so token i could only have a
cumulative probability below what the host would verify. No forward is spent on a token the
host would trim.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from specplug.heads.calibrate import Calibrator
from specplug.heads.pick import pick_tokens
from specplug.types import Draft, DraftRequest, TargetInfo

Picks = tuple[list[int], list[float], torch.Tensor | None]  # (target ids, their probabilities, [rows, vocab] or None)
# advance(depth, rows, tokens, requests) -> Picks: draft token `depth` (>= 1) for the requests that go
# on. `rows`: which rows of the previous depth's picks go on (indices into them, in order); `tokens`:
# the target ids those rows drafted (the input of this depth); `requests`: the index in `requests`
# of each. The picks it returns have one row per entry of `rows`, in that order.
Advance = Callable[[int, list[int], list[int], list[int]], Picks]


class DraftLoop:
    """The drafting loop of one speculator: picking, confidences, the stop rule, the Drafts."""

    def __init__(self, target: TargetInfo, d2t: torch.Tensor, temperature: float = 0.0, stop_below: float = 0.15,
                 calibrator: Calibrator | None = None, seed: int = 0):
        """d2t: [draft vocab] int64, draft row -> target token id (`torch.arange(vocab)` for the whole
        vocabulary); stop_below: the cumulative confidence under which a draft stops."""
        self.d2t, self.vocab, self.temperature, self.stop_below = d2t, target.vocab_size, temperature, stop_below
        self.eot = frozenset(target.eot_ids)
        self.max_ctx, self.out_device = target.max_ctx, target.device
        self.calib = calibrator if calibrator is not None else Calibrator()
        self.gen = torch.Generator().manual_seed(seed)  # sampled drafts never touch the host's streams

    def pick(self, logits: torch.Tensor) -> Picks:
        """One token per row of `logits` [rows, draft vocab] (see `pick_tokens`)."""
        return pick_tokens(logits, self.d2t, self.vocab, self.temperature, self.gen)

    def run(self, requests: Sequence[DraftRequest], live: list[int], picks: Picks, advance: Advance | None = None,
            depths: Sequence[int] | None = None) -> list[Draft | None]:
        """Drafts for `requests` (None where not live): `picks` are token 0 of requests[live[j]] in row j;
        `advance` gives the next depth's picks for the rows that go on (None: one depth only);
        `depths[j]`: at most that many tokens for live[j] (the method's limit, e.g. its heads).

        The contract of `advance(depth, rows, tokens, requests)` (the `Advance` type): it is called
        once per depth >= 1 while any request goes on, only for those (the stop rule has dropped the
        others: no forward for a token the host would trim). `rows[m]` is the row of the previous
        depth's picks that request `requests[m]` continues from, `tokens[m]` the target id it drafted
        there; the returned picks have row m for requests[m]. A head keeping per-row state selects
        it with `rows` (`SequentialHeadsDrafter` and `ChainDrafter` do)."""
        out: list[Draft | None] = [None] * len(requests)
        n = len(live)
        if not n:
            return out
        lim = [min(requests[i].n_max, self.max_ctx - len(requests[i].tokens)) for i in live]
        if depths is not None:
            lim = [min(a, b) for a, b in zip(lim, depths)]
        be = [requests[i].break_even for i in live]
        ids: list[list[int]] = [[] for _ in range(n)]
        conf: list[list[float]] = [[] for _ in range(n)]
        probs: list[list[float]] = [[] for _ in range(n)]
        dists: list[list[torch.Tensor]] | None = None
        cum = [1.0] * n
        confidence, eot, stop_below = self.calib.confidence, self.eot, self.stop_below
        slots = list(range(n))  # row j of the current picks drafts for live[slots[j]]
        toks, p_tok, q = picks
        depth = 0
        while True:
            if q is not None and dists is None:
                dists = [[] for _ in range(n)]
            rows: list[int] = []
            nxt: list[int] = []
            nxt_toks: list[int] = []
            d1 = depth + 1
            for j, a in enumerate(slots):
                t, p = toks[j], p_tok[j]
                c = confidence(depth, p)
                ids[a].append(t)
                conf[a].append(c)
                probs[a].append(p)
                if q is not None:
                    dists[a].append(q[j])
                cm = cum[a] = cum[a] * c
                if d1 < lim[a] and cm >= stop_below and t not in eot and (d1 >= len(be[a]) or cm >= be[a][d1]):
                    rows.append(j)
                    nxt.append(a)
                    nxt_toks.append(t)
            if not rows or advance is None:
                break
            depth, slots = d1, nxt
            toks, p_tok, q = advance(depth, rows, nxt_toks, [live[a] for a in nxt])
        for a, i in enumerate(live):
            self.calib.record_probs(requests[i].seq_id, probs[a])
            pr = torch.stack(dists[a]).to(self.out_device) if dists is not None and dists[a] else None
            out[i] = Draft(tuple(ids[a]), pr, tuple(conf[a]))
        return out

    def run_block(self, requests: Sequence[DraftRequest], live: list[int], logits: torch.Tensor,
                  lengths: Sequence[int]) -> list[Draft | None]:
        """Drafts from every depth's logits at once (parallel heads, a block drafter): `logits`
        [sum(lengths), draft vocab], lengths[j] consecutive rows (depths 0..) for requests[live[j]]."""
        toks, p_tok, q = self.pick(logits)
        starts, at = [], 0
        for k in lengths:
            starts.append(at)
            at += k
        cur = starts

        def advance(depth: int, rows: list[int], tokens: list[int], reqs: list[int]) -> Picks:
            nonlocal cur
            cur = [cur[j] for j in rows]
            at = [s + depth for s in cur]
            return [toks[x] for x in at], [p_tok[x] for x in at], q[at] if q is not None else None

        return self.run(requests, live, ([toks[s] for s in starts], [p_tok[s] for s in starts],
                                         q[starts] if q is not None else None), advance, lengths)
