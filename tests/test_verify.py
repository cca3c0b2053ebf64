"""Stochastic verification leaves the output distribution unchanged (chi-square on a joint
distribution of two tokens), and the test has the power to see a 2% bias."""
from __future__ import annotations

import pytest
import torch

from specplug.sampling import SamplingParams, target_probs
from specplug.verify import verify

V = 6
CRIT_DF35_P001 = 66.62  # chi-square critical value, 35 degrees of freedom, p = 0.001


def _tables(seed):
    g = torch.Generator().manual_seed(seed)
    p1 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    p2 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)  # p(x2 | x1)
    q1 = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q2 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, -1)
    p3 = torch.softmax(torch.randn(V, generator=g), -1)
    return p1, p2, q1, q2, p3


def _joint_counts(n, seed, token_only: bool, verifier=verify):
    p1, p2, q1, q2, p3 = _tables(seed)
    sp = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(seed + 1)
    # draws that do not depend on the verifier are made up front, vectorized
    d1s = torch.multinomial(q1, n, replacement=True, generator=gen)
    d2_by_d1 = torch.multinomial(q2, n, replacement=True, generator=gen)  # [V, n]: a q2 draw per x1
    x2_by_x1 = torch.multinomial(p2, n, replacement=True, generator=gen)  # plain draws from p(x2 | x1)
    logits_by_d1 = [torch.stack([p1, p2[d], p3]).log() for d in range(V)]
    dprobs_by_d1 = [None if token_only else torch.stack([q1, q2[d]]) for d in range(V)]
    counts = torch.zeros(V, V)
    for i, d1 in enumerate(d1s.tolist()):
        d2 = int(d2_by_d1[d1, i])
        v = verifier(logits_by_d1[d1], [d1, d2], dprobs_by_d1[d1], sp, gen)
        out = [d1, d2][: v.n_accepted] + [v.next_token]
        if len(out) < 2:  # the next token comes from plain sampling
            out.append(int(x2_by_x1[out[0], i]))
        counts[out[0], out[1]] += 1
    expected = (p1.unsqueeze(1) * p2) * n
    return counts, expected


def _chi2(counts, expected):
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("token_only", [False, True])
def test_rejection_sampling_preserves_the_joint_distribution(token_only):
    counts, expected = _joint_counts(30_000, seed=5, token_only=token_only)
    chi2 = _chi2(counts, expected)
    assert chi2 < CRIT_DF35_P001, f"chi2 {chi2:.1f}"
    assert float((counts / counts.sum() - expected / expected.sum()).abs().sum() / 2) < 0.015


def test_a_two_percent_bias_is_detected():
    """Power check: a verifier that over-accepts just 2% of the time must fail the same test."""
    g = torch.Generator().manual_seed(99)

    def biased(logits, draft, dprobs, sp, gen):
        v = verify(logits, draft, dprobs, sp, gen)
        if v.n_accepted < len(draft) and torch.rand(1, generator=g).item() < 0.02:
            return type(v)(len(draft), int(target_probs(logits[-1:], sp)[0].argmax()))
        return v

    counts, expected = _joint_counts(30_000, seed=5, token_only=False, verifier=biased)
    assert _chi2(counts, expected) > CRIT_DF35_P001


def test_greedy_accepts_the_argmax_prefix():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    v = verify(logits, [1, 0], None, SamplingParams(), None)
    assert (v.n_accepted, v.next_token) == (2, 2)
    v = verify(logits, [1, 2], None, SamplingParams(), None)
    assert (v.n_accepted, v.next_token) == (1, 0)
    v = verify(logits[:1], [], None, SamplingParams(), None)
    assert (v.n_accepted, v.next_token) == (0, 1)


def test_sampling_filters():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


@pytest.mark.parametrize("temperature,top_p", [(0.5, 0.9), (3.0, 0.99)])  # nucleus inside / beyond the top 256
def test_top_p_matches_a_full_sort_on_a_large_vocabulary(temperature, top_p):
    torch.manual_seed(0)
    logits = torch.randn(3, 49152) * 4
    got = target_probs(logits, SamplingParams(temperature=temperature, top_p=top_p))
    p = torch.softmax(logits / temperature, -1)
    sp, idx = torch.sort(p, -1, descending=True)
    ref = p.scatter(-1, idx, sp.masked_fill(sp.cumsum(-1) - sp >= top_p, 0.0))
    torch.testing.assert_close(got, ref / ref.sum(-1, keepdim=True), rtol=0, atol=1e-7)
