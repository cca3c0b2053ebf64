"""Stochastic verification leaves the output distribution unchanged (chi-square on a joint
distribution of two tokens), and the test has the power to see a 2% bias."""
from __future__ import annotations

import pytest
import torch

from specplug.sampling import SamplingParams, sample, target_probs
from specplug.verify import Verdict, verify

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


# ---------------------------------------------------------------------------------------------
# property test (issue 26): random and degenerate p and q, the emitted tokens are distributed as p

W = 5  # vocabulary of the property cases
N_DRAWS = 2000
ALPHA = 1e-3


def _rows(g: torch.Generator, n: int, zeros: int = 0) -> torch.Tensor:
    """n random distributions over W tokens, each with `zeros` random tokens of probability 0."""
    p = torch.softmax(torch.randn(n, W, generator=g) * 1.5, -1)
    for row in p:
        row[torch.randperm(W, generator=g)[:zeros]] = 0.0
    return p / p.sum(-1, keepdim=True)


def _one_hot(*tokens: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens), W).float()


def _on(support, n: int = 1) -> torch.Tensor:
    """n rows uniform on `support`."""
    row = torch.zeros(W)
    row[list(support)] = 1.0 / len(support)
    return row.expand(n, W).clone()


def _cases():
    """(name, p [3, W] target rows for positions 0..2, q [2, W] or None (token-only), r [2, W]: the
    distribution each draft token is really drawn from; r = q for a drafter keeping the rules)."""
    g = torch.Generator().manual_seed(26)
    rnd = lambda n, zeros=0: _rows(g, n, zeros)  # noqa: E731
    cases = [("random", rnd(3), rnd(2)),
             ("equal", *(lambda p: (p, p[:2].clone()))(rnd(3))),
             ("p one-hot", torch.cat([_one_hot(2, 4), rnd(1)]), rnd(2)),
             ("q one-hot", rnd(3), _one_hot(1, 3)),
             ("p and q one-hot, same token", torch.cat([_one_hot(1, 1), rnd(1)]), _one_hot(1, 1)),
             ("p and q one-hot, other tokens", torch.cat([_one_hot(0, 2), rnd(1)]), _one_hot(3, 4)),
             ("disjoint support", torch.cat([_on({0, 1}, 2), rnd(1)]), _on({2, 3, 4}, 2)),
             ("q without mass where p has it", torch.cat([_on({0, 1, 2}, 2), rnd(1)]), _on({2, 3}, 2)),
             ("p without mass where q has it", rnd(3, zeros=2), rnd(2)),
             ("zeros in both", rnd(3, zeros=2), rnd(2, zeros=2))]
    out = [(name, p, q, q) for name, p, q in cases]
    # token-only drafts (q one-hot on the drafted token): lossless whatever the tokens are drawn from
    out.append(("token-only, tokens drawn anywhere", rnd(3, zeros=1), None, rnd(2)))
    out.append(("token-only, tokens p cannot produce", torch.cat([_on({0, 1}, 2), rnd(1)]), None, _on({3, 4}, 2)))
    # drafts breaking the rules (the host refuses them first): q gives the drafted token no mass,
    # or is NaN; verification still emits exactly p
    out.append(("drafted token outside q, p = 0 there", torch.cat([_on({0, 1}, 2), rnd(1)]), _on({0}, 2),
                _on({3}, 2)))
    out.append(("drafted token outside q, p > 0 there", rnd(3), _one_hot(0, 0), _on({1, 2}, 2)))
    out.append(("NaN q", rnd(3), torch.full((2, W), float("nan")), rnd(2)))
    return out


def _emitted(p, q, r, seed: int, verifier=verify):
    """N_DRAWS verifications of drafts drawn from r; the first and second emitted tokens (the
    second only where the first was an accepted draft token: it is then drawn within the call)."""
    sp = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(seed)
    logits = p.log()  # -inf where p = 0: target_probs gives p back
    drafts = torch.stack([torch.multinomial(r[i], N_DRAWS, replacement=True, generator=gen) for i in range(2)], 1)
    first, second = torch.zeros(W), torch.zeros(W)
    for d in drafts.tolist():
        v = verifier(logits, d, q, sp, gen)
        out = d[:v.n_accepted] + [v.next_token]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


@pytest.mark.parametrize("name,p,q,r", _cases(), ids=[c[0] for c in _cases()])
def test_emitted_tokens_are_distributed_as_the_target_samples(name, p, q, r):
    from specplug.testing import chi_square

    first, second = _emitted(p, q, r, seed=7)
    for pos, counts in ((0, first), (1, second)):
        if counts.sum() == 0:  # the first token is never an accepted draft token (p cannot produce it)
            continue
        stat, df, pv = chi_square(counts, p[pos])
        assert pv >= ALPHA, f"{name}, emitted token {pos}: chi-square {stat:.1f} ({df} df), p = {pv:.2g}: " \
                            f"counts {counts.tolist()} vs p {p[pos].tolist()}"


def test_the_property_test_sees_a_lossy_verifier():
    """The old acceptance test u * q_d <= p_d accepted a drafted token its own q gives no mass;
    the test above fails on it."""
    from specplug.testing import chi_square

    def old(logits, d, q, sp, gen):  # verify's stochastic branch before the fix
        pr, g = target_probs(logits, sp), len(d)
        p_d, q_d = pr[torch.arange(g), torch.tensor(d)], q[torch.arange(g), torch.tensor(d)]
        ok = (torch.rand(g, generator=gen) * q_d <= p_d).tolist()
        for i in range(g):
            if not ok[i]:
                res = (pr[i] - q[i]).clamp_min(0.0)
                total = float(res.sum())
                return Verdict(i, sample(res / total if total > 0 else pr[i], gen))
        return Verdict(g, sample(pr[g], gen))

    (name, p, q, r), = [c for c in _cases() if c[0] == "drafted token outside q, p > 0 there"]
    first, _ = _emitted(p, q, r, seed=7, verifier=old)
    assert chi_square(first, p[0])[2] < ALPHA


def test_a_token_the_target_gives_zero_probability_is_never_accepted():
    """Whatever the draft says: q(d) = 0 with p(d) = 0 (the old test accepted it: 0 <= 0), or a
    one-hot q on d, or token-only."""
    sp = SamplingParams(temperature=1.0)
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 2)
    gen = torch.Generator().manual_seed(0)
    for q in (torch.tensor([[1.0, 0.0, 0.0, 0.0]]), torch.tensor([[0.0, 0.0, 1.0, 0.0]]), None,
              torch.tensor([[0.0, 0.0, 0.0, 0.0]]), torch.tensor([[float("nan")] * 4])):
        for _ in range(200):
            v = verify(p.log(), [2], q, sp, gen)
            assert v.n_accepted == 0 and v.next_token in (0, 1), (q, v)


def test_chi_square_matches_known_values():
    from specplug.testing import chi2_sf, chi_square

    assert chi2_sf(CRIT_DF35_P001, 35) == pytest.approx(0.001, rel=1e-3)
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, rel=1e-3)
    assert chi_square([10, 10, 10], [1, 1, 1]) == (0.0, 2, 1.0)
    assert chi_square([10, 10, 1], [1, 1, 0])[2] == 0.0  # a count where the probability is 0
    stat, df, pv = chi_square([10, 0, 10], [1, 0, 1])
    assert (stat, df, pv) == (0.0, 1, 1.0)
