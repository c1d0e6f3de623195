"""The side-by-side divergences (tether.core.divergences) against enumeration and their limits."""

import math

import pytest
import torch

from tether.core.divergences import (
    LEASH_DIVERGENCES,
    divergences_from_logits,
    exact_and_divergences,
    leash_divergence,
)
from tether.core.kl import exact_kl_from_logits


def _enumerated(logits, ref_logits, alpha):
    # the definitions term by term, float64
    lp, lq = torch.log_softmax(logits.double(), -1), torch.log_softmax(ref_logits.double(), -1)
    p, q = lp.exp(), lq.exp()
    m = (p + q) / 2
    forward = (q * (lq - lp)).sum(-1)
    js = 0.5 * (p * (lp - m.log())).sum(-1) + 0.5 * (q * (lq - m.log())).sum(-1)
    amari = (1 - (p**alpha * q ** (1 - alpha)).sum(-1)) / (alpha * (1 - alpha))
    return forward, js, amari


def test_hand_worked_values_on_two_tokens():
    # p = (1/4, 3/4), q = (1/2, 1/2):
    # forward KL(q || p) = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3) = 0.143841
    # m = (3/8, 5/8): JS = 1/2 [1/4 ln(2/3) + 3/4 ln(6/5)] + 1/2 [1/2 ln(4/3) + 1/2 ln(4/5)] = 0.032382
    # alpha 1/2: 4 (1 - sqrt(1/8) - sqrt(3/8)) = 4 (1 - 0.353553 - 0.612372) = 0.136300
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    ref = torch.zeros(1, 1, 2)
    d = divergences_from_logits(logits, ref, alpha=0.5)
    assert d.forward_kl.item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    js = 0.5 * (0.25 * math.log(2 / 3) + 0.75 * math.log(6 / 5)) + 0.5 * (
        0.5 * math.log(4 / 3) + 0.5 * math.log(4 / 5)
    )
    assert d.js.item() == pytest.approx(js, rel=1e-5)
    assert d.alpha.item() == pytest.approx(4 * (1 - math.sqrt(1 / 8) - math.sqrt(3 / 8)), rel=1e-5)


@pytest.mark.parametrize("alpha", [0.1, 0.5, 0.9])
def test_each_equals_enumeration_on_a_small_vocabulary(alpha):
    g = torch.Generator().manual_seed(0)
    logits, ref = torch.randn(3, 4, 9, generator=g) * 2, torch.randn(3, 4, 9, generator=g) * 2
    for chunk in (1, 5, 1024):
        d = divergences_from_logits(logits, ref, temperature=0.7, alpha=alpha, chunk_size=chunk)
        for got, want in zip(d, _enumerated(logits / 0.7, ref / 0.7, alpha)):
            # float32 against float64: terms of O(1) nats over 9 entries, ~1e-6 rounding
            assert torch.allclose(got.double(), want, atol=2e-6)


def test_limits_bounds_and_fixed_point():
    g = torch.Generator().manual_seed(1)
    logits, ref = torch.randn(2, 3, 6, generator=g).double(), torch.randn(2, 3, 6, generator=g).double()
    reverse = exact_kl_from_logits(logits, ref)
    near_one = divergences_from_logits(logits, ref, alpha=1 - 1e-6)
    near_zero = divergences_from_logits(logits, ref, alpha=1e-6)
    # D_a -> KL(p || q) as a -> 1 and KL(q || p) as a -> 0, the gap O(1 - a) resp. O(a) (float64)
    assert torch.allclose(near_one.alpha, reverse, atol=1e-5)
    assert torch.allclose(near_zero.alpha, near_zero.forward_kl, atol=1e-5)
    d = divergences_from_logits(logits, ref)
    swapped = divergences_from_logits(ref, logits)
    assert torch.allclose(d.js, swapped.js) and (d.js <= math.log(2) + 1e-12).all() and (d.js >= 0).all()
    assert torch.allclose(swapped.forward_kl, reverse)  # the forward KL is the reverse one swapped
    same = divergences_from_logits(logits.float(), logits.float())
    for x in same:  # p == q: every divergence 0 to float32 rounding
        assert x.abs().max() < 1e-6


def test_zero_probabilities_and_bad_arguments():
    # the reference puts no mass on token 2, the policy some: forward KL and JS finite, alpha finite
    logits = torch.tensor([[[0.0, 0.0, 0.0]]])
    ref = torch.tensor([[[0.0, 0.0, -math.inf]]])
    d = divergences_from_logits(logits, ref, alpha=0.5)
    # q = (1/2, 1/2, 0), p = (1/3, 1/3, 1/3): forward = ln(3/2); alpha = 4 (1 - 2 sqrt(1/6))
    assert d.forward_kl.item() == pytest.approx(math.log(1.5), rel=1e-6)
    assert d.alpha.item() == pytest.approx(4 * (1 - 2 * math.sqrt(1 / 6)), rel=1e-5)
    assert torch.isfinite(d.js).all()
    assert torch.isnan(
        divergences_from_logits(torch.tensor([[[float("nan"), 0.0]]]), torch.zeros(1, 1, 2)).js
    ).all()
    for kwargs, match in (
        ({"alpha": 1.0}, "alpha"),
        ({"alpha": 0.0}, "alpha"),
        ({"temperature": 0}, "temperature"),
        ({"chunk_size": 0}, "chunk_size"),
    ):
        with pytest.raises(ValueError, match=match):
            divergences_from_logits(logits, logits, **kwargs)


@pytest.mark.parametrize("alpha", [1e-6, 1e-3, 0.3, 0.7, 1 - 1e-3, 1 - 1e-6])
def test_float32_near_the_limits_keeps_the_float64_value(alpha):
    # a vocabulary of 300 and logits of spread 1: the divergences are ~0.03 nats; summed as
    # 1 - sum p^a q^(1-a), float32 at a = 1e-6 gave 0.212 and -0.038 where float64 gives 0.029
    # and 0.014. Written about the distribution with the larger exponent, each term keeps the
    # small factor and the float32 result agrees with float64 to ~1e-6 relative per term, summed
    # over 300 terms: 1e-5 absolute on values of ~0.03 leaves room of 30x the rounding
    g = torch.Generator().manual_seed(7)
    logits, ref = torch.randn(2, 3, 300, generator=g), torch.randn(2, 3, 300, generator=g)
    got = divergences_from_logits(logits, ref, alpha=alpha).alpha
    want = divergences_from_logits(logits.double(), ref.double(), alpha=alpha).alpha
    assert (got >= 0).all()
    assert torch.allclose(got.double(), want, atol=1e-5), (got, want)
    # and the float64 value is the definition's
    _, _, amari = _enumerated(logits, ref, alpha)
    if 1e-3 <= alpha <= 1 - 1e-3:  # the definition's own 1 - sum cancels in float64 past that
        assert torch.allclose(want, amari, atol=1e-9)


def test_one_pass_for_all_four_equals_each_alone_bit_for_bit():
    # the scoring pass's fused loop (kl.exact and kl.divergences on): one log-softmax of each side
    # gives the reverse KL exactly as exact_kl_from_logits does, and the three others as
    # divergences_from_logits does; chunks of 3 over 2 x 5 positions leave a short last chunk
    g = torch.Generator().manual_seed(0)
    logits, ref = torch.randn(2, 5, 11, generator=g), torch.randn(2, 5, 11, generator=g)
    logits[0, 1, 3] = -math.inf  # a zero of the policy: the reverse KL's 0 * log 0 convention
    ref[1, 2, 4] = -math.inf  # a zero of the reference: the forward KL's
    reverse, parts = exact_and_divergences(logits, ref, 0.7, 0.3, 3)
    assert torch.equal(reverse, exact_kl_from_logits(logits, ref, 0.7, 3))
    for fused, alone in zip(parts, divergences_from_logits(logits, ref, 0.7, 0.3, 3)):
        assert torch.equal(fused, alone)
    # each KL is +inf where the other side has a zero its own side has not, and finite elsewhere
    assert reverse[1, 2] == math.inf and parts.forward_kl[0, 1] == math.inf
    assert torch.isfinite(reverse).sum() == 9 and torch.isfinite(parts.forward_kl).sum() == 9


def _definition(kind, logits, ref_logits, temperature, alpha):
    # float64 by autograd: the leash's divergence as written, per position
    lp = torch.log_softmax(logits / temperature, -1)
    lq = torch.log_softmax(ref_logits / temperature, -1)
    p, q = lp.exp(), lq.exp()
    if kind == "reverse_kl":
        return (p * (lp - lq)).sum(-1)
    if kind == "forward_kl":
        return (q * (lq - lp)).sum(-1)
    if kind == "js":
        m = (p + q) / 2
        return 0.5 * (p * (lp - m.log())).sum(-1) + 0.5 * (q * (lq - m.log())).sum(-1)
    return (1 - (p**alpha * q ** (1 - alpha)).sum(-1)) / (alpha * (1 - alpha))


@pytest.mark.parametrize("kind", LEASH_DIVERGENCES)
@pytest.mark.parametrize("alpha", [0.5, 0.05, 0.01, 0.999])
def test_the_leash_divergence_and_its_gradient_equal_the_float64_definition(kind, alpha):
    # 2 x 3 positions over 7 tokens, chunks of 4 (a short last one), temperature 0.8
    g = torch.Generator().manual_seed(5)
    logits = (2 * torch.randn(2, 3, 7, generator=g)).requires_grad_()
    ref = 2 * torch.randn(2, 3, 7, generator=g)
    w = torch.rand(2, 3, generator=g)  # a weight per position, as a masked mean gives
    value = leash_divergence(kind, logits, ref, temperature=0.8, alpha=alpha, chunk_size=4)
    (value * w).sum().backward()
    x = logits.detach().double().requires_grad_()
    exact = _definition(kind, x, ref.double(), 0.8, alpha)
    (exact * w.double()).sum().backward()
    # float32 log-softmax of logits O(5): ~1e-6 relative per term, 7 terms: 1e-5 leaves room; the
    # alpha gradient near a = 1 keeps it (no 1 - sum cancels: _p_grad's expm1 form)
    assert torch.allclose(value.double(), exact.detach(), rtol=1e-5, atol=1e-6)
    scale = x.grad.abs().max().item()
    assert torch.allclose(logits.grad.double(), x.grad, rtol=0, atol=1e-5 * scale + 1e-9)
    assert scale > 1e-3  # a gradient that could be wrong


def test_hand_worked_forward_kl_gradient_and_the_leash_values_as_logged():
    # two tokens, p = (0.5, 0.5) (logits 0, 0), q = (0.8, 0.2): forward KL 0.8 ln 1.6 + 0.2 ln 0.4
    # = 0.37601 - 0.18326 = 0.19274; its gradient in the logits is p - q = (-0.3, 0.3)
    z = torch.zeros(1, 1, 2, requires_grad=True)
    ref = torch.log(torch.tensor([[[0.8, 0.2]]]))
    v = leash_divergence("forward_kl", z, ref)
    assert v.item() == pytest.approx(0.8 * math.log(1.6) + 0.2 * math.log(0.4), abs=1e-6)
    v.sum().backward()
    assert torch.allclose(z.grad, torch.tensor([[[-0.3, 0.3]]]), atol=1e-7)
    # the leash's values are the logged ones, bit for bit, at equal logits
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, 3, 9, generator=g), torch.randn(2, 3, 9, generator=g)
    reverse, parts = exact_and_divergences(a, b, 1.0, 0.3, 256)
    assert torch.equal(leash_divergence("reverse_kl", a, b), reverse)
    for kind, logged in zip(("forward_kl", "js", "alpha"), parts):
        assert torch.equal(leash_divergence(kind, a, b, alpha=0.3), logged)


def test_the_leash_divergence_at_far_apart_logits_and_bad_arguments():
    # a logit 200 below the others: p underflows to 0 there; no overflow, no NaN, in value or grad
    z = torch.tensor([[[0.0, 1.0, -200.0]]], requires_grad=True)
    ref = torch.tensor([[[0.0, -200.0, 1.0]]])
    for kind in LEASH_DIVERGENCES:
        z.grad = None
        v = leash_divergence(kind, z, ref, alpha=0.3)
        v.sum().backward()
        assert torch.isfinite(v).all() and torch.isfinite(z.grad).all(), kind
    with pytest.raises(ValueError, match="unknown divergence"):
        leash_divergence("tv", z, ref)
    with pytest.raises(ValueError, match="alpha"):
        leash_divergence("alpha", z, ref, alpha=1.0)
    with pytest.raises(ValueError, match="temperature"):
        leash_divergence("js", z, ref, temperature=0.0)


@pytest.mark.parametrize("alpha", [0.3, 0.05, 0.01])
def test_the_alpha_gradient_keeps_a_token_whose_probability_underflows(alpha):
    # a logit 110 below: p = e^-111 underflows float32 to 0, but p^a q^(1-a) does not at small a
    # (e^-5.6 at a = 0.05): the value keeps that term, and so must the gradient (the pull back
    # toward a token the policy dropped), which the float64 definition gives
    z = torch.tensor([[[0.0, 1.0, -110.0]]], requires_grad=True)
    ref = torch.tensor([[[0.0, -1.0, 1.0]]])
    leash_divergence("alpha", z, ref, alpha=alpha).sum().backward()
    x = z.detach().double().requires_grad_()
    _definition("alpha", x, ref.double(), 1.0, alpha).sum().backward()
    scale = x.grad.abs().max().item()
    assert torch.allclose(z.grad.double(), x.grad, rtol=0, atol=1e-5 * scale), (z.grad, x.grad)
