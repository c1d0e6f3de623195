"""The side-by-side divergences (tether.core.divergences) against enumeration and their limits."""

import math

import pytest
import torch

from tether.core.divergences import divergences_from_logits
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
