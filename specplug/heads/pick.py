"""`pick_tokens`: one draft token per row of logits over a draft vocabulary."""
from __future__ import annotations

import torch


def pick_tokens(logits: torch.Tensor, d2t: torch.Tensor, vocab: int, temperature: float,
                gen: torch.Generator) -> tuple[list[int], list[float], torch.Tensor | None]:
    """Draft one token per row of `logits` [rows, draft vocabulary]: the argmax (temperature 0)
    or a sample at `temperature` drawn with `gen`. Returns per row the target token id (through
    `d2t`), its probability under the distribution it was picked from, and, when sampling, that
    distribution over the full target vocabulary [rows, vocab] (zero outside the draft vocabulary:
    the `probs` lossless verification needs)."""
    logits = logits.float().cpu()
    if temperature == 0:
        p, best = torch.softmax(logits, -1).max(-1)
        return d2t[best].tolist(), p.tolist(), None
    qd = torch.softmax(logits / temperature, -1)
    pick = torch.multinomial(qd, 1, generator=gen).squeeze(-1)
    full = torch.zeros(qd.shape[0], vocab)
    full[:, d2t] = qd
    return d2t[pick].tolist(), qd.gather(-1, pick.unsqueeze(-1)).squeeze(-1).tolist(), full
