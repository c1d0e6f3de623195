"""Tests for tether.core.losses: PPO clipped surrogate and clipped value loss."""

from __future__ import annotations

import math

import pytest
import torch

from tether.core.losses import clipped_value_loss, ppo_policy_loss

F64 = torch.float64
INF, NAN = float("inf"), float("nan")


def _t(rows, grad=False):
    return torch.tensor(rows, dtype=F64, requires_grad=grad)


def test_ratio_one_when_logprobs_equal_old():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=g, dtype=F64) - 2
    logprobs = old.clone().requires_grad_(True)
    adv = torch.randn(3, 5, generator=g, dtype=F64)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 2, 4])[:, None]
    out = ppo_policy_loss(logprobs, old, adv, mask, clip_eps=0.2)
    assert torch.equal(out.ratio, torch.ones_like(out.ratio))  # exp(0) = 1 exactly
    assert out.clipfrac.item() == 0.0
    assert out.approx_kl.item() == 0.0
    # loss = -masked mean of advantages
    assert out.loss.item() == pytest.approx(-adv[mask].mean().item(), abs=1e-14)
    # gradient at ratio 1 is -A / n_valid on valid tokens, 0 on masked ones
    out.loss.backward()
    want = torch.where(mask, -adv / mask.sum(), torch.zeros_like(adv))
    torch.testing.assert_close(logprobs.grad, want, rtol=0, atol=1e-15)


def test_hand_worked_clipped_and_unclipped():
    # clip_eps 0.2; three valid tokens and one pad, all ratios set through log-probs:
    #   tok 0: ratio 1.5 (> 1.2), A = +2: unclipped -2*1.5 = -3.0, clipped -2*1.2 = -2.4
    #          max(-3.0, -2.4) = -2.4  -> clipped branch, no gradient
    #   tok 1: ratio 1.5,         A = -1: unclipped  1*1.5 =  1.5, clipped  1*1.2 =  1.2
    #          max(1.5, 1.2) = 1.5     -> unclipped branch, d/dlogp = -A*ratio = 1.5
    #   tok 2: ratio 0.5 (< 0.8), A = -1: unclipped 0.5, clipped 0.8 -> max 0.8, clipped, no grad
    #   tok 3: pad (logprobs nan)
    # loss = (-2.4 + 1.5 + 0.8) / 3 = -0.1 / 3 = -0.0333...
    # clipfrac = 2 / 3 (tokens 0 and 2)
    # grad = [0, 1.5 / 3, 0, 0] = [0, 0.5, 0, 0]
    # approx_kl = mean((ratio - 1) - log ratio)
    #           = [(0.5 - ln 1.5) * 2 + (-0.5 - ln 0.5)] / 3
    #           = [(0.5 - 0.4054651) * 2 + (-0.5 + 0.6931472)] / 3 = (0.1890698 + 0.1931472) / 3
    old = _t([[-1.0, -2.0, -0.5, -1.0]])
    logprobs = (old + _t([[math.log(1.5), math.log(1.5), math.log(0.5), NAN]])).detach().requires_grad_(True)
    adv = _t([[2.0, -1.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    out = ppo_policy_loss(logprobs, old, adv, mask, clip_eps=0.2)
    assert out.loss.item() == pytest.approx(-0.1 / 3, abs=1e-14)
    assert out.clipfrac.item() == pytest.approx(2 / 3, abs=1e-7)  # clipfrac may be float32
    want_kl = (2 * (0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))) / 3
    assert out.approx_kl.item() == pytest.approx(want_kl, abs=1e-14)
    torch.testing.assert_close(out.ratio, _t([[1.5, 1.5, 0.5, 1.0]]), rtol=0, atol=1e-14)
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, _t([[0.0, 0.5, 0.0, 0.0]]), rtol=0, atol=1e-14)


def test_clip_higher_widens_the_upper_range_only():
    # clip_eps 0.2 below, clip_eps_high 0.6 above (DAPO's clip-higher); the tokens of the test above:
    #   tok 0: ratio 1.5 (< 1.6 now), A = +2: unclipped -3.0, clipped -2*1.5 = -3.0 -> -3.0, with
    #          gradient d/dlogp = -A*ratio = -3.0
    #   tok 1: ratio 1.5, A = -1: 1.5 either way (unclipped), d/dlogp = 1.5
    #   tok 2: ratio 0.5 (< 0.8, the lower range unchanged), A = -1: 0.8, clipped, no gradient
    # loss = (-3.0 + 1.5 + 0.8) / 3 = -0.7 / 3; clipfrac 1 / 3; grad [-3, 1.5, 0] / 3 = [-1, 0.5, 0]
    old = _t([[-1.0, -2.0, -0.5, -1.0]])
    logprobs = (old + _t([[math.log(1.5), math.log(1.5), math.log(0.5), NAN]])).detach().requires_grad_(True)
    adv = _t([[2.0, -1.0, -1.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    out = ppo_policy_loss(logprobs, old, adv, mask, clip_eps=0.2, clip_eps_high=0.6)
    assert out.loss.item() == pytest.approx(-0.7 / 3, abs=1e-14)
    assert out.clipfrac.item() == pytest.approx(1 / 3, abs=1e-7)
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, _t([[-1.0, 0.5, 0.0, 0.0]]), rtol=0, atol=1e-14)
    # None is the symmetric range, the same numbers as clip_eps_high = clip_eps
    same = [ppo_policy_loss(logprobs, old, adv, mask, 0.2, clip_eps_high=h).loss.item() for h in (None, 0.2)]
    assert same[0] == same[1] == pytest.approx(-0.1 / 3, abs=1e-14)


def test_ratio_inside_clip_range_never_clips():
    # ratio 1.1 with A = +1: unclipped -1.1, clipped -1.1 (1.1 < 1.2): equal, not counted as clipped
    old = _t([[-1.0]])
    logprobs = (old + math.log(1.1)).detach().requires_grad_(True)
    out = ppo_policy_loss(logprobs, old, _t([[1.0]]), torch.ones(1, 1, dtype=torch.bool), 0.2)
    assert out.loss.item() == pytest.approx(-1.1, abs=1e-14)
    assert out.clipfrac.item() == 0.0
    out.loss.backward()
    # d/dlogp (-A * exp(logp - old)) = -1.1; torch.maximum splits a tie, both branches have
    # the same derivative inside the range, so the total is -1.1
    assert logprobs.grad.item() == pytest.approx(-1.1, abs=1e-14)


@pytest.mark.parametrize(
    "pad_lp,pad_old",
    [(NAN, NAN), (-INF, -INF), (INF, 0.0), (0.0, -INF), (-INF, 0.0), (1e4, -1e4)],
)
def test_policy_loss_masked_nonfinite_logprobs(pad_lp, pad_old):
    old = _t([[-1.0, -2.0, pad_old, pad_old]])
    logprobs = _t([[-0.8, -2.5, pad_lp, pad_lp]], grad=True)
    adv = _t([[1.0, -0.5, 3.0, 3.0]])
    mask = torch.tensor([[1, 1, 0, 0]], dtype=torch.bool)
    out = ppo_policy_loss(logprobs, old, adv, mask)
    for t in (out.loss, out.clipfrac, out.approx_kl):
        assert torch.isfinite(t).all()
    out.loss.backward()
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, 2:].tolist() == [0.0, 0.0]
    # same loss and gradient as with harmless pads
    clean_lp = _t([[-0.8, -2.5, -1.0, -1.0]], grad=True)
    clean = ppo_policy_loss(clean_lp, _t([[-1.0, -2.0, -1.0, -1.0]]), adv, mask)
    clean.loss.backward()
    assert out.loss.item() == clean.loss.item()
    assert torch.equal(logprobs.grad, clean_lp.grad)


def test_value_loss_hand_worked():
    # clip_eps_value 0.2, old values 1.0 everywhere:
    #   tok 0: v 1.5, R 2.0: v_clip = 1.0 + clip(0.5) = 1.2; (1.5-2)^2 = 0.25, (1.2-2)^2 = 0.64
    #          -> max 0.64 (clipped branch; v_clip is saturated so no gradient)
    #   tok 1: v 1.5, R 1.0: v_clip 1.2; (0.5)^2 = 0.25, (0.2)^2 = 0.04 -> max 0.25 (unclipped)
    #   tok 2: v 1.1, R 0.0: v_clip 1.1 (inside range); both 1.21 -> 1.21, not counted clipped
    #   tok 3: pad
    # loss = 0.5 * (0.64 + 0.25 + 1.21) / 3 = 0.5 * 2.1 / 3 = 0.35
    # clipfrac = 1 / 3
    # grad = 0.5 * (1/3) * [0, 2*(1.5-1.0), 2*(1.1-0.0), 0] = [0, 0.5/3, 1.1/3, 0] = [0, 1/6, 0.3667, 0]
    values = _t([[1.5, 1.5, 1.1, 7.0]], grad=True)
    out = clipped_value_loss(
        values,
        _t([[1.0, 1.0, 1.0, 1.0]]),
        _t([[2.0, 1.0, 0.0, -3.0]]),
        torch.tensor([[1, 1, 1, 0]], dtype=torch.bool),
        clip_eps_value=0.2,
    )
    assert out.loss.item() == pytest.approx(0.35, abs=1e-14)
    assert out.clipfrac.item() == pytest.approx(1 / 3, abs=1e-7)
    out.loss.backward()
    torch.testing.assert_close(values.grad, _t([[0.0, 0.5 / 3, 1.1 / 3, 0.0]]), rtol=0, atol=1e-14)


def test_value_loss_unclipped_when_values_unchanged():
    # values == old_values: v_clip == values, loss = 0.5 * mean (V - R)^2
    # (V - R) = [1, -2] -> 0.5 * (1 + 4) / 2 = 1.25
    values = _t([[1.0, 0.0]], grad=True)
    out = clipped_value_loss(
        values, values.detach().clone(), _t([[0.0, 2.0]]), torch.ones(1, 2, dtype=torch.bool)
    )
    assert out.loss.item() == pytest.approx(1.25, abs=1e-14)
    assert out.clipfrac.item() == 0.0


def test_value_loss_masked_nonfinite_targets_forward_finite():
    values = _t([[1.0, NAN]], grad=True)
    out = clipped_value_loss(
        values, _t([[1.0, INF]]), _t([[2.0, NAN]]), torch.tensor([[1, 0]], dtype=torch.bool)
    )
    # only token 0: 0.5 * (1 - 2)^2 = 0.5
    assert out.loss.item() == pytest.approx(0.5, abs=1e-14)
    assert torch.isfinite(out.clipfrac)


def test_value_loss_masked_nonfinite_gradient_is_finite():
    values = _t([[1.0, NAN]], grad=True)
    out = clipped_value_loss(
        values, _t([[1.0, 0.0]]), _t([[2.0, 0.0]]), torch.tensor([[1, 0]], dtype=torch.bool)
    )
    out.loss.backward()
    assert torch.isfinite(values.grad).all()


def test_approx_kl_in_float32_keeps_its_digits_at_small_ratios():
    """approx_kl is the shared k3 (expm1): in float32, a log ratio of 1e-3 keeps its digits.

    k3 = expm1(r) - r ~ r^2 / 2 = 5e-7 at r = 1e-3. expm1 rounds to about eps32 / 2 = 6e-8 of its
    value r (the subtraction of r is then exact), an error of 6e-11, a relative 1.2e-4 of r^2 / 2;
    the bound used, 4 * eps32 / r = 4.8e-4, is four times that. ``(exp(r) - 1) - r`` loses the
    leading digits of exp(r) = 1.001: its rounding, up to eps32 / 2 = 6e-8, is up to 12% of the
    value (0.7% on these tokens); that form fails this test.
    """
    eps32 = torch.finfo(torch.float32).eps
    r = torch.tensor([[1e-3, -1e-3, 2e-3]], dtype=F64)  # log new - log old per token
    old = torch.full_like(r, -2.0)
    mask = torch.ones_like(r, dtype=torch.bool)
    adv = torch.zeros_like(r)
    new32, old32 = (old + r).float(), old.float()
    r32 = new32.double() - old32.double()  # the log ratio float32 holds (exact: Sterbenz)
    # k3 of KL(old || new) on samples of old: ratio - 1 - log ratio = expm1(r) - r, in float64
    want = (torch.expm1(r32) - r32).mean().item()
    got = ppo_policy_loss(new32, old32, adv.float(), mask, clip_eps=0.2).approx_kl.item()
    assert got == pytest.approx(want, rel=4 * eps32 / 1e-3)


def test_k1_seq_terms_across_a_hole_sum_only_the_policy_tokens_still_to_come():
    from tether.core.losses import k1_seq_terms

    # logprobs [-1, -2, -0.5], ref [-1.5, -0.1, -1.0], mask [1, 0, 1] (position 1: a tool's output)
    # k1 on the policy's tokens: [-1 + 1.5, -, -0.5 + 1.0] = [0.5, 0, 0.5]
    # G_t (KL still to come, policy tokens only) = [0.5 + 0.5, -, 0.5] = [1.0, 0, 0.5]
    # values: k1 = [0.5, 0, 0.5]; gradient w.r.t. logprobs: G_t on policy tokens, 0 on the hole
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -0.1, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 1]], dtype=torch.bool)
    terms = k1_seq_terms(lp, ref, mask)
    torch.testing.assert_close(terms.detach(), torch.tensor([[0.5, 0.0, 0.5]], dtype=torch.float64))
    terms.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[1.0, 0.0, 0.5]], dtype=torch.float64))
