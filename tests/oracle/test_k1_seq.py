"""k1_seq, the sequence-level KL-in-loss surrogate, by exact enumeration (float64).

On the 3-token, 5-symbol bed every sequence is enumerated, so the *expected* gradient of a
surrogate under the sampling policy is a finite sum: sum_y p_sample(y) * grad(sum_t term_t(y)).
It must equal autograd's gradient of the exact KL(pi_theta || pi_ref) over whole sequences.
Tolerance 1e-10: float64 sums of 125 x 3 terms of size ~1 round at ~1e-14; 1e-10 leaves four
orders of magnitude and still catches any missing term (those are ~1e-2, see the last test).
"""

from __future__ import annotations

import pytest
import torch

from tether.core.losses import k1_seq_terms, kl_loss_terms
from tether.testing import testbed as tb

F64 = torch.float64
V, T = 5, 3


def _tables(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    P = tb.num_prefixes(V, T)
    theta = torch.randn(P, V, generator=g, dtype=F64).requires_grad_(True)
    ref = torch.randn(P, V, generator=g, dtype=F64)
    old = (theta.detach() + 0.3 * torch.randn(P, V, generator=g, dtype=F64)).detach()  # pi_old != pi
    return theta, ref, old


def _exact_kl_grad(theta, ref) -> torch.Tensor:
    kl = tb.exact_kl(tb.sequence_logprobs(theta, V, T), tb.sequence_logprobs(ref, V, T))
    return torch.autograd.grad(kl, theta)[0]


def _expected_surrogate_grad(theta, ref, sampler, terms_fn) -> torch.Tensor:
    """sum_y p_sampler(y) * grad sum_t term_t(y): the surrogate's gradient in expectation."""
    ys = tb.all_sequences(V, T)
    lp = tb.token_logprobs(theta, ys, V)  # (125, 3) with grad
    ref_lp = tb.token_logprobs(ref, ys, V)
    weights = tb.sequence_logprobs(sampler, V, T).exp().detach()  # (125,)
    mask = torch.ones_like(lp, dtype=torch.bool)
    old_lp = tb.token_logprobs(sampler, ys, V).detach()
    terms = terms_fn(lp, ref_lp, mask, old_lp)  # (125, 3)
    return torch.autograd.grad((weights * terms.sum(-1)).sum(), theta)[0]


def test_k1_seq_expected_gradient_is_the_sequence_kl_gradient_on_policy():
    theta, ref, _ = _tables()
    exact = _exact_kl_grad(theta, ref)
    # on-policy: samples of pi_theta itself, no old log-probs (rho = 1)
    got = _expected_surrogate_grad(theta, ref, theta.detach(), lambda lp, r, m, old: k1_seq_terms(lp, r, m))
    err = float((got - exact).abs().max())
    print(
        f"on-policy: max |E grad k1_seq - grad KL| = {err:.2e} (grad KL max {float(exact.abs().max()):.3f})"
    )
    assert err < 1e-10
    # with old log-probs equal to the current ones, rho = 1 exactly: the same gradient
    same = _expected_surrogate_grad(
        theta, ref, theta.detach(), lambda lp, r, m, old: k1_seq_terms(lp, r, m, old)
    )
    assert float((same - exact).abs().max()) < 1e-10


def test_k1_seq_expected_gradient_is_exact_off_policy():
    theta, ref, old = _tables(1)
    exact = _exact_kl_grad(theta, ref)
    got = _expected_surrogate_grad(theta, ref, old, lambda lp, r, m, o: kl_loss_terms(lp, r, "k1_seq", o, m))
    err = float((got - exact).abs().max())
    print(f"off-policy: max |E_old grad k1_seq - grad KL| = {err:.2e}")
    assert err < 1e-10


def test_per_token_surrogates_miss_the_future_kl():
    # the surrogates tether offered before k1_seq (k3+, k3_is) differentiate each position's
    # next-token KL: on this bed their expected gradient is off by ~1e-1, far beyond rounding
    theta, ref, old = _tables(2)
    exact = _exact_kl_grad(theta, ref)
    for name in ("k2", "k3+", "k3_is"):
        got = _expected_surrogate_grad(
            theta, ref, theta.detach(), lambda lp, r, m, o, name=name: kl_loss_terms(lp, r, name, o)
        )
        err = float((got - exact).abs().max())
        print(f"{name}: max |E grad - grad KL| = {err:.3e}")
        assert err > 1e-2, name

    # and a per-token importance ratio instead of rho(y) is not exact off-policy
    def per_token_ratio(lp, r, m, o):
        k1 = (lp - r).detach()
        to_come = k1.flip(-1).cumsum(-1).flip(-1)
        return torch.exp(lp.detach() - o) * to_come * (lp - lp.detach())

    got = _expected_surrogate_grad(theta, ref, old, per_token_ratio)
    assert float((got - exact).abs().max()) > 1e-3


def test_k1_seq_value_is_k1_and_masked_tokens_count_nowhere():
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.4, -0.2, -1.0]], dtype=F64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    terms = k1_seq_terms(lp, ref, mask)
    # value: k1 = lp - ref on valid tokens: 0.5, -1.0, 0.0 and 0.1, -0.5; 0 on the masked one
    assert torch.allclose(terms.detach(), torch.tensor([[0.5, -1.0, 0.0], [0.1, -0.5, 0.0]], dtype=F64))
    # gradient: d/d lp_t = G_t, the KL still to come: row 0: 0.5 - 1 + 0 = -0.5, -1.0, 0.0;
    # row 1 (the masked k1 of -8.0 never counts): 0.1 - 0.5 = -0.4, -0.5, and 0 on the masked token
    (g,) = torch.autograd.grad(terms.sum(), lp)
    assert torch.allclose(g, torch.tensor([[-0.5, -1.0, 0.0], [-0.4, -0.5, 0.0]], dtype=F64))
    with pytest.raises(ValueError, match="response_mask"):
        kl_loss_terms(lp, ref, "k1_seq")


def test_grpo_kl_weights_are_one_over_the_group_std():
    from tether.core.advantages import GROUP_STD_EPS
    from tether.trainers.steps import grpo_kl_weights

    # sequence rewards (summed over the mask): group 0 = (1, 3), group 1 = (2, 2), G = 2;
    # unbiased std of (1, 3): sqrt(((1 - 2)^2 + (3 - 2)^2) / 1) = sqrt(2); of (2, 2): 0
    rewards = torch.tensor([[0.0, 1.0], [3.0, 0.0], [2.0, 0.0], [1.0, 1.0]])
    mask = torch.tensor([[True, True], [True, False], [True, False], [True, True]])
    w = grpo_kl_weights(rewards, mask, 2)
    # group 1 is all-equal: not 1 / (0 + 1e-4) = 10^4 but the other groups' mean weight,
    # here group 0's alone: 1 / (sqrt(2) + 1e-4) = 0.70706...
    expected = 1.0 / (torch.tensor([2**0.5, 2**0.5, 2**0.5, 2**0.5]) + GROUP_STD_EPS)
    assert torch.allclose(w, expected, rtol=1e-6)


def test_grpo_kl_weights_at_their_extremes():
    from tether.core.advantages import GROUP_STD_EPS
    from tether.trainers.steps import grpo_kl_weights

    mask = torch.ones(8, 1, dtype=torch.bool)
    # 0/1 rewards, G = 4: (0, 0, 0, 1) has unbiased std sqrt((3 x 0.25^2 + 0.75^2) / 3) = 0.5,
    # weight 1 / 0.5001 = 1.99960...; (1, 1, 1, 1) is all-equal and takes that same weight
    w = grpo_kl_weights(torch.tensor([[0.0], [0.0], [0.0], [1.0], [1.0], [1.0], [1.0], [1.0]]), mask, 4)
    assert torch.allclose(w, torch.full((8,), 1 / (0.5 + GROUP_STD_EPS)), rtol=1e-6)
    # every group all-equal: weight 1 (the KL term as in Dr. GRPO), never 10^4
    w = grpo_kl_weights(torch.zeros(8, 1), mask, 4)
    assert torch.equal(w, torch.ones(8))
    # a group whose std is tiny but not 0 is bounded by 1 / GROUP_STD_EPS = 10^4
    w = grpo_kl_weights(torch.tensor([[0.0], [0.0], [0.0], [1e-12], [0.0], [0.0], [0.0], [1.0]]), mask, 4)
    assert float(w[:4].max()) <= 1 / GROUP_STD_EPS and float(w[:4].min()) > 0.99 / GROUP_STD_EPS
