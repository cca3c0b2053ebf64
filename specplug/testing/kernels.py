"""Kernel checks: the kernel path chosen for a block of code, and a chain head's one-call native step
(with and without the pair lookup) against its Python form."""
from __future__ import annotations

import contextlib
import os
from typing import Sequence

import torch

from specplug.heads.lookup import pair_lookup
from specplug.testing.engine import greedy_outputs, speculator


@contextlib.contextmanager
def isa_env(isa: str | None):
    """Load models (and pair-head steps) on the kernel path `isa` (SPECPLUG_ISA) inside the block:
    a model keeps the kernels it was built with, so it runs on that path afterwards too."""
    old = os.environ.get("SPECPLUG_ISA")
    if isa is None:
        os.environ.pop("SPECPLUG_ISA", None)
    else:
        os.environ["SPECPLUG_ISA"] = isa
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("SPECPLUG_ISA", None)
        else:
            os.environ["SPECPLUG_ISA"] = old



def check_native_step(rt, seed: int = 0, lookup: Sequence[int] | None = None) -> dict:
    """For a chain head's inference form `rt` whose `native_step` is set (`specplug.heads.PairStep`):
    its one-call step agrees with its Python form on the same kernels (`rt.native_step = None`) to
    float tolerance; `forward_pick`'s greedy picks are exactly the argmax (through d2t) of the logits
    that step returns, with the softmax probability; and a row's result never depends on the other
    rows of its batch (bitwise). Uses sequences 0 and 1 of rt's cache and clears them. Returns the
    largest differences seen, for the test's report. lookup: the 5 rows' pair lookups, for a head
    that reads them (`rt.reads_lookup`)."""
    assert rt.native_step is not None, "the head has no native step here (not on the gguf kernels?)"
    g = torch.Generator().manual_seed(seed)
    d, vocab = rt.native_step.norm_a.numel(), rt.native_step.table.shape[0]
    seqs, pos = [0, 0, 0, 1, 1], [0, 1, 2, 0, 1]
    h = torch.randn(len(seqs), d, generator=g)
    toks = torch.randint(0, vocab, (len(seqs),), generator=g).tolist()
    rows = [2, 4]
    kw = {} if lookup is None else {"lookup": list(lookup)}
    kw_alone = {} if lookup is None else {"lookup": list(lookup)[3:]}

    def clear():
        for s in (0, 1):
            rt.cache.seq_rm(s, 0)

    clear()
    out_n, logits_n = rt.forward(h, toks, pos, seqs, rows, **kw)
    clear()
    saved, rt.native_step = rt.native_step, None
    try:
        out_p, logits_p = rt.forward(h, toks, pos, seqs, rows, **kw)
    finally:
        rt.native_step = saved
    clear()
    states, ids, probs = rt.forward_pick(h, toks, pos, seqs, rows, **kw)
    assert torch.equal(states, out_n), "forward_pick's states differ from forward's"
    assert ids == rt.d2t[logits_n.argmax(-1)].tolist(), (ids, rt.d2t[logits_n.argmax(-1)].tolist())
    torch.testing.assert_close(torch.tensor(probs), torch.softmax(logits_n, -1).max(-1).values, rtol=1e-4, atol=1e-6)
    clear()
    alone, logits_alone = rt.forward(h[3:], toks[3:], pos[3:], seqs[3:], [1], **kw_alone)
    clear()
    assert torch.equal(alone, out_n[3:]) and torch.equal(logits_alone[0], logits_n[1]), "not batch-invariant"
    scale = lambda t: float(t.abs().max())  # noqa: E731
    diff = {"states": float((out_n - out_p).abs().max()) / scale(out_p),
            "logits": float((logits_n - logits_p).abs().max()) / scale(logits_p)}
    assert diff["states"] < 0.02 and diff["logits"] < 0.02, f"native step differs from the Python form: {diff}"
    return diff


def check_lookup_step(rt) -> dict:
    """For the inference form `rt` of a chain head that reads the pair lookup (`rt.reads_lookup`) and has
    a native step: `check_native_step` with lookups on the rows (one row without), and the lookup is
    read (a row's logits with a lookup differ from those without). Returns check_native_step's figures."""
    assert rt.reads_lookup and rt.native_step is not None
    looks = [int(rt.d2t[3]), -1, int(rt.d2t[7]), int(rt.d2t[9]), int(rt.d2t[11])]
    diff = check_native_step(rt, lookup=looks)
    h = torch.randn(2, rt.native_step.norm_a.numel(), generator=torch.Generator().manual_seed(3))
    rt.cache.seq_rm(0, 0)
    _, with_gate = rt.forward(h, [5, 6], [0, 1], [0, 0], [1], lookup=[-1, looks[0]])
    rt.cache.seq_rm(0, 0)
    _, without = rt.forward(h, [5, 6], [0, 1], [0, 0], [1], lookup=[-1, -1])
    rt.cache.seq_rm(0, 0)
    assert not torch.equal(with_gate, without), "the head's logits do not depend on its lookup"
    # the native step's boost alone (its lookup projection zeroed): only the asked row's lookup draft row
    # moves, by gate . out + bias
    ns, look = rt.native_step, rt.look
    ns.head.set_lookup(torch.zeros_like(look.proj), look.norm.contiguous(), look.gate[0], look.gate[1], look.eps,
                       torch.tensor(look.t2d, dtype=torch.long), look.KEEP)
    try:
        out, boosted = rt.forward(h, [5, 6], [0, 1], [0, 0], [1], lookup=[-1, looks[0]])
        rt.cache.seq_rm(0, 0)
    finally:
        ns.read_lookup(look)
    col = look.t2d[looks[0]]
    moved = (boosted - without)[0]
    assert torch.count_nonzero(moved) <= 1 and moved[col] != 0, "the boost lands off the lookup's draft row"
    want = float(out[1] @ look.gate[0] + look.gate[1])
    assert abs(float(moved[col]) - want) <= 1e-4 * max(1.0, abs(want)), (float(moved[col]), want)
    return diff


def drafted_lookups(target, spec, prompts: list[list[int]], max_tokens: int = 20, n_parallel: int = 2,
                    native: bool = True) -> list[tuple[list[int], list[int], list[int], list[int]]]:
    """Run `spec` (a chain head that reads the lookup, drafting on every step, made with `catch_up: null`
    so that it reads every row) through greedy generation and check that every row it hands its head
    (the prompt's, committed and drafted ones) carries the lookup of its sequence up to that row:
    `pair_lookup(history, spec.rt.lookup_n)`. native: spy on the native step's path (`forward_pick`),
    else on the logits path. Returns the rows seen: (tokens, positions, sequences, lookups) per head call."""
    rt, seen = spec.rt, []
    name = "forward_pick" if native else "forward"
    real = getattr(rt, name)
    if not native:
        rt.native_step = None  # the logits path

    def spy(h, tok, pos, seq, rows, raw=False, lookup=None):
        seen.append((list(tok), list(pos), list(seq), lookup))
        return real(h, tok, pos, seq, rows, raw=raw, lookup=lookup)

    setattr(rt, name, spy)
    greedy_outputs(target, [speculator(spec, "lookup", cost_trim=False)], prompts, max_tokens=max_tokens,
                   n_parallel=n_parallel)
    hist: dict[int, list[int]] = {}
    for tok, pos, seq, lk in seen:
        assert lk is not None and len(lk) == len(tok)
        for t, p, s, x in zip(tok, pos, seq, lk):
            hist[s] = hist.get(s, [])[:p] + [t]
            assert len(hist[s]) == p + 1 and x == pair_lookup(hist[s], rt.lookup_n), (s, p, x)
    assert any(x >= 0 for *_, lk in seen for x in lk) and any(p[0] > 0 and len(p) == 1 for _, p, _, _ in seen)
    return seen

