"""Statistics: is a sample distributed as the target samples? (Pearson's chi-square without scipy,
and a probability integral transform of generated answers under the target.)"""
from __future__ import annotations

from specplug.sampling import target_probs


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X chi-square with `df` degrees of freedom (scipy's chi2.sf, without scipy)."""
    import torch

    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(max(stat, 0.0) / 2, dtype=torch.float64)))


def chi_square(counts, probs) -> tuple[float, int, float]:
    """Pearson's test that `counts` [k] were drawn from `probs` [k] (normalized here):
    (statistic, degrees of freedom, p-value). A count in a cell of probability 0 is impossible:
    statistic inf, p-value 0. Cells of probability 0 and no count are left out."""
    import torch

    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    probs = torch.as_tensor(probs, dtype=torch.float64).flatten()
    probs = probs / probs.sum()
    live = probs > 0
    df = int(live.sum()) - 1
    if float(counts[~live].sum()) > 0:
        return float("inf"), df, 0.0
    expected = probs[live] * counts.sum()
    stat = float(((counts[live] - expected) ** 2 / expected).sum())
    return stat, df, chi2_sf(stat, df)


def target_pit(target, results, sampling, seed: int = 0):
    """Where each generated token falls in the target's own sampling distribution given the
    tokens before it (a randomized probability integral transform: u = P(X before x) + v * P(X = x)
    with v uniform, tokens ordered from the most probable, ties by id). By the chain rule the u of
    all tokens of all answers are independent and uniform on [0, 1) exactly when every token was
    sampled from the target at `sampling`, whatever drafted it. Each answer is run again through
    the target in one forward.

    `results`: SequenceResults (or (prompt_ids, token_ids) pairs) of a run with ignore_eos, so that
    every emitted token is in token_ids. Returns (u [n] float64, impossible), `impossible` listing
    (answer index, position, token id) of tokens the target's sampling gives probability 0."""
    import torch

    model = target.model
    gen = torch.Generator().manual_seed(seed)
    us, impossible = [], []
    cache = None
    for k, r in enumerate(results):
        prompt, toks = (r.prompt_ids, r.token_ids) if hasattr(r, "token_ids") else r
        if not toks:
            continue
        ids = list(prompt) + list(toks)
        if cache is None or cache.max_ctx < len(ids):
            cache = model.new_cache(1, max(512, len(ids)))
        cache.clear(0)
        rows = list(range(len(prompt) - 1, len(ids) - 1))
        n = len(ids) - 1
        logits = model.forward(ids[:-1], list(range(n)), [0] * n, cache, logits_rows=rows).logits
        p = target_probs(logits.float().cpu(), sampling).double()  # [len(toks), vocab]
        x = torch.tensor(toks, dtype=torch.long)[:, None]
        px = p.gather(1, x)[:, 0]
        # tokens ordered most probable first, so a bias toward likely tokens (over-acceptance)
        # gathers u near 0 instead of spreading it over the vocabulary
        sorted_p, order = torch.sort(p, dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(p.shape[1]).expand_as(order))
        below = sorted_p.cumsum(-1).gather(1, rank.gather(1, x))[:, 0] - px
        us.append((below + torch.rand(len(toks), generator=gen, dtype=torch.float64) * px).clamp(0.0, 1.0 - 1e-12))
        impossible += [(k, i, toks[i]) for i in (px <= 0).nonzero()[:, 0].tolist()]
    return (torch.cat(us) if us else torch.zeros(0, dtype=torch.float64)), impossible


def sampled_like_target(target, results, sampling, *, bins: int = 10, seed: int = 0) -> tuple[float, str]:
    """(p-value, one line) of the test that `results` were sampled from the target at `sampling`
    (target_pit, then a chi-square of its u over `bins` equal bins against the uniform). p-value 0
    when a token the target's sampling cannot produce was emitted."""
    import torch

    u, impossible = target_pit(target, results, sampling, seed)
    if impossible:
        k, i, t = impossible[0]
        return 0.0, (f"{len(impossible)} emitted token(s) have probability 0 under the target's sampling, "
                     f"first token {t} at position {i} of answer {k}")
    counts = torch.bincount((u * bins).long().clamp_max(bins - 1), minlength=bins)
    stat, df, pv = chi_square(counts, torch.ones(bins))
    return pv, f"chi-square {stat:.1f} on {df} degrees of freedom over {len(u)} tokens, p = {pv:.2g}"

