"""Verification of one sequence's draft against the target's logits.

Knows nothing of speculators: it takes draft token ids (and the draft distribution when the
method has one) and the target's logits for the rows [last, d_1, ..., d_g], and returns how
many draft tokens are accepted plus the token the target adds (correction or bonus).

Greedy: accept while d_i equals the target's argmax. Stochastic (Leviathan et al. /
Chen et al. rejection sampling): accept d_i with probability min(1, p(d_i) / q(d_i)); on a
rejection draw from norm(max(0, p - q)); after a full acceptance draw the bonus from p.
A token-only draft is a one-hot q. The output distribution equals sampling from p alone.

Whatever the draft claims, a token the target gives zero probability is never accepted, and
a drafted token that its own q gives no mass (or NaN) cannot have been sampled from q: it is
rejected and the target's token drawn from p itself, so that position is still exactly p.
(The host also refuses such drafts before verification: specplug.contract.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specplug.sampling import SamplingParams, sample, target_probs


@dataclass(frozen=True)
class Verdict:
    n_accepted: int  # draft tokens kept
    next_token: int  # the target's own token after them (correction or bonus)


def verify(target_logits: torch.Tensor, draft_ids: list[int], draft_probs: torch.Tensor | None,
           sp: SamplingParams, gen: torch.Generator | None) -> Verdict:
    """target_logits [g+1, vocab] for rows (last, d_1..d_g); draft_ids [g]; draft_probs [g, vocab] or None."""
    g = len(draft_ids)
    assert target_logits.shape[0] == g + 1, (target_logits.shape, g)
    if sp.greedy:
        if target_logits.device.type == "cpu" and target_logits.dtype == torch.float32:
            # numpy's argmax, the same first-maximum rule: ~5 us against torch's ~45 us (its OpenMP
            # region wakes the pool's threads each step)
            best = target_logits.detach().numpy().argmax(-1).tolist()
        else:
            best = target_logits.argmax(-1).tolist()
        a = 0
        while a < g and draft_ids[a] == best[a]:
            a += 1
        return Verdict(a, best[a])
    # sampling happens on the CPU with the sequence's CPU generator, whatever the device
    p = target_probs(target_logits.float().cpu(), sp)  # [g+1, vocab]
    if draft_probs is not None:
        draft_probs = draft_probs.float().cpu()
    if g:
        rows, idx = torch.arange(g), torch.tensor(draft_ids)
        p_d = p[rows, idx]
        u = torch.rand(g, generator=gen)
        # u < p/q without dividing, strictly: p = 0 never passes (u * q >= 0). A q_d that is not a
        # positive number (a draft inconsistent with its own q) never passes either
        if draft_probs is None:  # one-hot q
            sane, ok = [True] * g, (u < p_d).tolist()
        else:
            q_d = draft_probs[rows, idx]
            sane_t = torch.isfinite(q_d) & (q_d > 0)
            sane, ok = sane_t.tolist(), (sane_t & (u * q_d < p_d)).tolist()
        for i in range(g):
            if not ok[i]:
                if not sane[i]:  # no residual can be trusted: the target's own draw
                    return Verdict(i, sample(p[i], gen))
                if draft_probs is None:
                    residual = p[i].clone()
                    residual[draft_ids[i]] = 0.0
                else:
                    residual = (p[i] - draft_probs[i]).clamp_min_(0.0)
                total = float(residual.sum())
                # total == 0 only if p == q exactly, where rejection has probability 0; not finite
                # only for a q holding NaN or inf (refused by the host before it gets here)
                return Verdict(i, sample(residual / total if 0 < total < float("inf") else p[i], gen))
    return Verdict(g, sample(p[g], gen))
