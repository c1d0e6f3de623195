"""The sampler's importance weights (tether.core.correction): hand-worked values, the extremes of
the log-ratio, masks, and the weighted losses they enter."""

from __future__ import annotations

import math

import pytest
import torch

from tether.core.correction import correction_weights
from tether.core.leash import KLLeash
from tether.core.losses import ppo_policy_loss

F64 = torch.float64


def weights(old, sampler, mask, correction, cap=2.0):
    return correction_weights(
        torch.tensor(old, dtype=F64),
        torch.tensor(sampler, dtype=F64),
        torch.tensor(mask),
        correction=correction,
        cap=cap,
    )


# one row of three policy tokens and a padded slot; log rho = old - sampler = [0.5, -0.2, 1.0, .]
OLD = [[-1.0, -2.0, -0.5, 0.0]]
SAMPLER = [[-1.5, -1.8, -1.5, -9.0]]
MASK = [[True, True, True, False]]


def test_tis_truncates_each_token_at_the_cap():
    w = weights(OLD, SAMPLER, MASK, "tis")
    # rho = [e^0.5, e^-0.2, e^1.0] = [1.648721, 0.818731, 2.718282]; min(rho, 2) = [1.648721, 0.818731, 2]
    want = torch.tensor([[math.exp(0.5), math.exp(-0.2), 2.0, 0.0]], dtype=F64)
    torch.testing.assert_close(w.weights, want, rtol=0, atol=1e-15)
    assert w.departed.tolist() == [[False, False, True, False]]  # only e^1.0 > 2 was cut
    torch.testing.assert_close(
        w.log_ratio, torch.tensor([[0.5, -0.2, 1.0, 0.0]], dtype=F64), rtol=0, atol=1e-15
    )


def test_mis_weighs_each_token_by_its_sequence_and_drops_one_outside_the_band():
    # row 0: sum log rho = 0.5 - 0.2 + 1.0 = 1.3 > log 3 = 1.0986: dropped at cap 3, kept at cap 4
    dropped = weights(OLD, SAMPLER, MASK, "mis", cap=3.0)
    assert dropped.weights.tolist() == [[0.0, 0.0, 0.0, 0.0]]
    assert dropped.departed.tolist() == [[True, True, True, False]]
    kept = weights(OLD, SAMPLER, MASK, "mis", cap=4.0)
    torch.testing.assert_close(
        kept.weights, torch.tensor([[math.exp(1.3)] * 3 + [0.0]], dtype=F64), rtol=1e-15, atol=0
    )
    assert not kept.departed.any()
    # below the band too: sum log rho = -1.3 < -log 3
    low = weights([[-1.5, -1.8, -1.5]], [[-1.0, -2.0, -0.5]], [[True] * 3], "mis", cap=3.0)
    assert low.weights.tolist() == [[0.0] * 3] and low.departed.all()


def test_only_the_sequence_weight_claims_the_prefixes():
    # an exact divergence at a prefix depends on no token drawn there: mis's weight (the whole
    # response's ratio) corrects it, tis's (the token's own) does not, and the losses read this flag
    assert weights(OLD, SAMPLER, MASK, "mis", cap=4.0).per_sequence
    assert not weights(OLD, SAMPLER, MASK, "tis").per_sequence
    assert not weights(OLD, SAMPLER, MASK, "none").per_sequence


def test_none_weighs_one_and_counts_what_leaves_the_band():
    w = weights(OLD, SAMPLER, MASK, "none")
    assert w.weights.tolist() == [[1.0, 1.0, 1.0, 0.0]]
    assert w.departed.tolist() == [[False, False, True, False]]  # |1.0| > log 2 = 0.693


def test_the_same_model_weighs_every_token_one():
    old = torch.randn(3, 5, dtype=F64)
    for correction in ("tis", "mis", "none"):
        w = correction_weights(
            old, old.clone(), torch.ones(3, 5, dtype=torch.bool), correction=correction, cap=2.0
        )
        assert w.weights.eq(1.0).all() and not w.departed.any()


def test_extreme_ratios_stay_finite_and_no_epsilon_divides():
    # a log-ratio of +-1000 (e^1000 overflows float64): tis is exactly the cap or exactly e^-1000 = 0
    w = weights([[0.0, -1000.0]], [[-1000.0, 0.0]], [[True, True]], "tis")
    assert w.weights.tolist() == [[2.0, 0.0]] and torch.isfinite(w.weights).all()
    m = weights([[0.0, -1000.0]], [[-1000.0, 0.0]], [[True, False]], "mis")
    assert m.weights.tolist() == [[0.0, 0.0]]  # sum 1000 is outside the band: dropped, not inf
    # a masked slot holding -inf or NaN reaches nothing
    p = weights([[-1.0, float("nan")]], [[-1.0, -math.inf]], [[True, False]], "tis")
    assert p.weights.tolist() == [[1.0, 0.0]]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown correction"):
        weights(OLD, SAMPLER, MASK, "vtrace")
    for cap in (1.0, 0.5, math.inf, math.nan):
        with pytest.raises(ValueError, match="cap must be finite and > 1"):
            weights(OLD, SAMPLER, MASK, "tis", cap=cap)
    with pytest.raises(ValueError, match="one shape"):
        weights(OLD, [[-1.0]], MASK, "tis")
    with pytest.raises(ValueError, match="not finite"):  # a sampled token the sampler gave probability 0
        weights([[-1.0]], [[-math.inf]], [[True]], "tis")


def test_the_weights_multiply_each_tokens_policy_and_kl_terms():
    torch.manual_seed(0)
    B, R = 2, 3
    logprobs = torch.randn(B, R, dtype=F64, requires_grad=True)
    old, ref = logprobs.detach() + 0.01 * torch.randn(B, R, dtype=F64), torch.randn(B, R, dtype=F64)
    adv, mask = torch.randn(B, R, dtype=F64), torch.tensor([[True, True, False], [True, True, True]])
    w = torch.tensor([[2.0, 0.5, 7.0], [1.0, 0.0, 3.0]], dtype=F64)
    plain = ppo_policy_loss(logprobs, old, adv, mask, 0.2)
    weighted = ppo_policy_loss(logprobs, old, adv, mask, 0.2, is_weights=w)
    # the token means of the same terms, weighted: sum over the 5 valid tokens / 5
    ratio = torch.exp(logprobs.detach() - old)
    terms = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    assert float(weighted.loss.detach()) == pytest.approx(float((terms * w)[mask].sum() / 5), rel=1e-12)
    assert float(plain.loss.detach()) == pytest.approx(float(terms[mask].sum() / 5), rel=1e-12)
    assert float(weighted.clipfrac) == float(plain.clipfrac)  # statistics stay the learner's
    leash = KLLeash(kl_in_reward=False, kl_in_loss=True)
    a = leash.loss(logprobs, ref, 0.1, mask, old)
    b = leash.loss(logprobs, ref, 0.1, mask, old, token_weights=w)
    assert a is not None and b is not None and float(a.detach()) != float(b.detach())
    ones = leash.loss(logprobs, ref, 0.1, mask, old, token_weights=torch.ones(B, R, dtype=F64))
    assert torch.equal(ones, a)  # a weight of 1 changes nothing, bit for bit
