"""Tests for tether.core.advantages: GAE, whitening and the group advantages."""

from __future__ import annotations

import math

import pytest
import torch

from tether.core.advantages import WHITEN_EPS, gae
from tether.core.distributed import whiten

F64 = torch.float64


def _t(rows):
    return torch.tensor(rows, dtype=F64)


def test_gae_hand_gamma1_lambda1():
    # rewards [0, 0, 1], values [0.5, 0.6, 0.7], gamma = lambda = 1, V after the end = 0
    # t=2: delta = 1 + 0   - 0.7 = 0.3;  A2 = 0.3
    # t=1: delta = 0 + 0.7 - 0.6 = 0.1;  A1 = 0.1 + 0.3 = 0.4
    # t=0: delta = 0 + 0.6 - 0.5 = 0.1;  A0 = 0.1 + 0.4 = 0.5
    # (check: with gamma = lambda = 1, A_t = sum_{k>=t} r_k - V_t = 1 - V_t)
    # returns = A + V = [1.0, 1.0, 1.0]
    out = gae(_t([[0.0, 0.0, 1.0]]), _t([[0.5, 0.6, 0.7]]), torch.ones(1, 3, dtype=torch.bool), 1.0, 1.0)
    torch.testing.assert_close(out.advantages, _t([[0.5, 0.4, 0.3]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.returns, _t([[1.0, 1.0, 1.0]]), rtol=0, atol=1e-12)


def test_gae_hand_gamma09_lambda05_with_padding():
    # rewards [1, 0, 2 | pad], values [0.5, 1.0, 1.5 | pad], gamma 0.9, lambda 0.5 (gl = 0.45)
    # t=2: delta = 2 + 0.9*0   - 1.5 = 0.5;              A2 = 0.5
    # t=1: delta = 0 + 0.9*1.5 - 1.0 = 1.35 - 1.0 = 0.35; A1 = 0.35 + 0.45*0.5   = 0.575
    # t=0: delta = 1 + 0.9*1.0 - 0.5 = 1.4;              A0 = 1.4  + 0.45*0.575 = 1.65875
    # returns = A + V = [2.15875, 1.575, 2.0]; the padded slot is 0
    # The pad slot holds reward 100 and value 1e9: neither may reach slot 2 (V_3 must be 0).
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    out = gae(_t([[1.0, 0.0, 2.0, 100.0]]), _t([[0.5, 1.0, 1.5, 1e9]]), mask, 0.9, 0.5)
    torch.testing.assert_close(out.advantages, _t([[1.65875, 0.575, 0.5, 0.0]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.returns, _t([[2.15875, 1.575, 2.0, 0.0]]), rtol=0, atol=1e-12)


def test_gae_hand_worked_across_a_hole():
    # rewards [1, 7, 2], values [0.5, 9, 1.5], mask [1, 0, 1] (position 1: a tool's output),
    # gamma 0.9, lambda 0.5 (gl = 0.45); by policy step position 1 is skipped:
    # t=2: delta = 2 + 0.9*0 - 1.5 = 0.5;              A2 = 0.5
    # t=0: delta = 1 + 0.9*1.5 - 0.5 = 1.85;            A0 = 1.85 + 0.45*0.5 = 2.075
    # returns = A + V = [2.575, 0, 2.0]. (Breaking the chain at the hole, as before, gave A0 = 0.5:
    # the final reward never reached the tokens before the tool call.)
    mask = torch.tensor([[1, 0, 1]], dtype=torch.bool)
    out = gae(_t([[1.0, 7.0, 2.0]]), _t([[0.5, 9.0, 1.5]]), mask, 0.9, 0.5)
    torch.testing.assert_close(out.advantages, _t([[2.075, 0.0, 0.5]]), rtol=0, atol=1e-12)
    torch.testing.assert_close(out.returns, _t([[2.575, 0.0, 2.0]]), rtol=0, atol=1e-12)


def test_gae_with_holes_equals_gae_of_the_policy_tokens_alone():
    """Discounting by policy step: GAE on a mask with holes is GAE on the valid tokens squeezed
    together (a per-row Python loop), scattered back; the holes get 0."""
    g = torch.Generator().manual_seed(11)
    B, T = 8, 9
    rewards = torch.randn(B, T, generator=g, dtype=F64)
    values = torch.randn(B, T, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[0] = False  # an empty row
    mask[1] = torch.tensor([1, 0, 0, 1, 1, 0, 1, 0, 0], dtype=torch.bool)
    for gamma, lam in [(0.9, 0.8), (1.0, 0.95), (0.5, 1.0)]:
        out = gae(rewards, values, mask, gamma, lam)
        for b in range(B):
            idx = mask[b].nonzero().flatten()
            want_adv, want_ret = _gae_loop(
                rewards[b : b + 1, idx], values[b : b + 1, idx], [len(idx)], gamma, lam
            )
            torch.testing.assert_close(out.advantages[b, idx], want_adv[0], rtol=0, atol=1e-12)
            torch.testing.assert_close(out.returns[b, idx], want_ret[0], rtol=0, atol=1e-12)
        assert (out.advantages[~mask] == 0).all() and (out.returns[~mask] == 0).all()


def _gae_loop(rewards, values, lengths, gamma, lam):
    """Per-row Python loop over the valid prefix, float64 Python floats."""
    B, T = rewards.shape
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        n = lengths[b]
        r = rewards[b, :n].tolist()
        v = values[b, :n].tolist()
        last = 0.0
        for t in reversed(range(n)):
            v_next = v[t + 1] if t + 1 < n else 0.0
            delta = r[t] + gamma * v_next - v[t]
            last = delta + gamma * lam * last
            adv[b][t] = last
            ret[b][t] = last + v[t]
    return torch.tensor(adv, dtype=F64), torch.tensor(ret, dtype=F64)


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.9), (0.5, 0.0), (1.0, 1.0), (0.0, 0.7)])
def test_gae_matches_python_loop_random_prefix_masks(gamma, lam):
    g = torch.Generator().manual_seed(int(gamma * 100 + lam * 10))
    B, T = 6, 7
    rewards = torch.randn(B, T, generator=g, dtype=F64)
    values = torch.randn(B, T, generator=g, dtype=F64)
    lengths = [0, 1, T, 3, 5, T - 1]  # includes an empty and a full row
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    out = gae(rewards, values, mask, gamma, lam)
    want_adv, want_ret = _gae_loop(rewards, values, lengths, gamma, lam)
    assert out.advantages.dtype == F64
    torch.testing.assert_close(out.advantages, want_adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.returns, want_ret, rtol=0, atol=1e-12)


@pytest.mark.parametrize("fill", [1e9, -1e12, float("inf"), float("nan")])
def test_gae_masked_slots_do_not_leak(fill):
    g = torch.Generator().manual_seed(3)
    B, T = 4, 6
    rewards = torch.randn(B, T, generator=g, dtype=F64)
    values = torch.randn(B, T, generator=g, dtype=F64)
    lengths = torch.tensor([2, 6, 4, 1])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    clean = gae(rewards.masked_fill(~mask, 0.0), values.masked_fill(~mask, 0.0), mask, 0.9, 0.8)
    dirty = gae(rewards.masked_fill(~mask, fill), values.masked_fill(~mask, fill), mask, 0.9, 0.8)
    assert torch.equal(dirty.advantages, clean.advantages)
    assert torch.equal(dirty.returns, clean.returns)
    assert (dirty.advantages[~mask] == 0).all() and (dirty.returns[~mask] == 0).all()


def test_gae_float32_input():
    # float32 in, float32 out, to float32 precision
    out = gae(
        torch.tensor([[0.0, 0.0, 1.0]]),
        torch.tensor([[0.5, 0.6, 0.7]]),
        torch.ones(1, 3, dtype=torch.bool),
        1.0,
        1.0,
    )
    assert out.advantages.dtype == torch.float32
    torch.testing.assert_close(out.advantages, torch.tensor([[0.5, 0.4, 0.3]]), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# whiten
# ---------------------------------------------------------------------------------------------


def _mask_and_values(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 6
    values = torch.randn(B, T, generator=g, dtype=F64) * 3 + 2
    lengths = torch.tensor([6, 3, 1, 5])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return values, mask


def test_whiten_zero_mean_unit_variance_over_valid_slots():
    values, mask = _mask_and_values(0)
    values = values.masked_fill(~mask, float("nan"))  # pads must not matter
    out = whiten(values, mask)
    valid = out[mask]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-12)
    # independent reference: (x - mean) / sqrt(unbiased var + eps) over the valid slots
    x = values[mask]
    var = x.var(unbiased=True).item()
    torch.testing.assert_close(valid, (x - x.mean()) / math.sqrt(var + WHITEN_EPS), rtol=0, atol=1e-12)
    # unbiased variance of the result is var / (var + eps) = 1 up to eps / var ~ 1e-9
    assert valid.var(unbiased=True).item() == pytest.approx(1.0, abs=1e-7)
    assert (out[~mask] == 0).all()


def test_whiten_without_shift_keeps_mean():
    values, mask = _mask_and_values(1)
    out = whiten(values, mask, shift_mean=False)
    x = values[mask]
    assert out[mask].mean().item() == pytest.approx(x.mean().item(), abs=1e-12)
    assert out[mask].var(unbiased=True).item() == pytest.approx(1.0, abs=1e-7)
    assert (out[~mask] == 0).all()


def test_whiten_hand_values():
    # valid [1, 2, 3]: mean 2, unbiased var ((1)^2 + 0 + 1^2) / 2 = 1
    # out = [-1, 0, 1] / sqrt(1 + 1e-8) = [-1, 0, 1] * (1 - 5e-9)
    out = whiten(_t([[1.0, 2.0, 3.0, 99.0]]), torch.tensor([[1, 1, 1, 0]], dtype=torch.bool))
    s = 1.0 / math.sqrt(1.0 + 1e-8)
    torch.testing.assert_close(out, _t([[-s, 0.0, s, 0.0]]), rtol=0, atol=1e-15)


def test_whiten_constant_input_gives_zero_not_nan():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    for dtype in (F64, torch.float32):
        out = whiten(torch.full((2, 3), 3.7, dtype=dtype), mask)
        assert torch.isfinite(out).all()
        assert out.abs().max().item() <= 1e-3  # float32: 3.7 - 3.7 rounds to 0 exactly or ~1e-7 * 1e4
    out = whiten(torch.full((2, 3), 3.7, dtype=F64), mask)
    assert out.abs().max().item() == 0.0
    # a single valid token: n - 1 clamped to 1, var 0 -> 0
    single = whiten(_t([[5.0, 1.0]]), torch.tensor([[1, 0]], dtype=torch.bool))
    assert single.tolist() == [[0.0, 0.0]]


def test_return_scale_hand_values_and_floor():
    from tether.core.advantages import RETURN_SCALE_FLOOR, return_scale

    # sequence returns [0, 2, 4]: mean 2, unbiased var (4 + 0 + 4) / 2 = 4, std 2 -> scale 2
    assert float(return_scale(torch.tensor([0.0, 2.0, 4.0], dtype=F64).std())) == 2.0
    # std 0.5 (returns [0, 1]: var 0.5, std 0.707...) is under the 1-unit floor: left unscaled
    assert float(return_scale(torch.tensor([0.0, 1.0], dtype=F64).std())) == RETURN_SCALE_FLOOR == 1.0
    assert float(return_scale(torch.tensor(0.0, dtype=F64))) == 1.0  # equal returns: no division by 0


def test_scaled_returns_leave_whitened_advantages_unchanged_and_targets_at_unit_spread():
    """PPO's step 6 with ppo.scale_returns: rewards 10x and 40x as large (std of the sequence
    returns above the floor) give the same whitened advantages as the unscaled rewards do when
    the values are in the same scaled units, and value targets of the same unit-spread size."""
    from tether.trainers.steps import ppo_advantages

    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    rewards = torch.where(mask, torch.randn(3, 4, generator=g, dtype=F64), 0.0)
    values = torch.randn(3, 4, generator=g, dtype=F64)
    plain_adv, plain_ret, one = ppo_advantages(rewards, values, mask=mask, gamma=1.0, lam=0.95, whiten=True)
    assert float(one) == 1.0
    seq = (rewards * mask).sum(-1)
    for c in (10.0, 40.0):
        assert float(c * seq.std()) > 1.0  # above the floor, so the scale is c * std
        adv, ret, scale = ppo_advantages(
            c * rewards, values, mask=mask, gamma=1.0, lam=0.95, whiten=False, scale_returns=True
        )
        torch.testing.assert_close(scale, c * seq.std(), rtol=1e-12, atol=0)
        # GAE is linear in (rewards, values): c * rewards / (c * std) with values v is the
        # unscaled rewards with values v * std, divided by std (c cancels exactly)
        want_adv, want_ret, _ = ppo_advantages(
            rewards, values * seq.std(), mask=mask, gamma=1.0, lam=0.95, whiten=False
        )
        torch.testing.assert_close(adv, want_adv / seq.std(), rtol=0, atol=1e-12)
        torch.testing.assert_close(ret, want_ret / seq.std(), rtol=0, atol=1e-12)
        # whitened, the positive factor 1 / std cancels too, up to WHITEN_EPS: whiten(x) and
        # whiten(x / s) differ by |z| * |1 / sqrt(1 + eps / var) - 1 / sqrt(1 + eps s^2 / var)|
        # <= |z| * eps * max(1, s^2) / (2 var) for z the whitened value and var that of x
        white, _, _ = ppo_advantages(
            c * rewards, values, mask=mask, gamma=1.0, lam=0.95, whiten=True, scale_returns=True
        )
        want_white, _, _ = ppo_advantages(
            rewards, values * seq.std(), mask=mask, gamma=1.0, lam=0.95, whiten=True
        )
        var = float(want_adv[mask].var())
        bound = float(want_white.abs().max()) * WHITEN_EPS * max(1.0, float(seq.std()) ** 2) / (2 * var)
        torch.testing.assert_close(white, want_white, rtol=0, atol=bound + 1e-12)
    # below the floor nothing changes: the same numbers as without scaling
    small = rewards * (0.5 / float(seq.std()))  # sequence returns' std 0.5 < 1
    a, r, s = ppo_advantages(small, values, mask=mask, gamma=1.0, lam=0.95, whiten=True, scale_returns=True)
    b, q, _ = ppo_advantages(small, values, mask=mask, gamma=1.0, lam=0.95, whiten=True)
    assert float(s) == 1.0 and torch.equal(a, b) and torch.equal(r, q)
    # the values' units matter (v against v * std): the comparisons above can fail
    assert not torch.allclose(plain_adv, want_white)


def test_ppo_advantages_refuses_a_correction_of_another_shape():
    from tether.trainers.steps import ppo_advantages

    rewards = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="token_correction"):
        ppo_advantages(
            rewards, rewards, mask=mask, gamma=1.0, lam=1.0, whiten=False, token_correction=torch.zeros(2, 2)
        )


def test_all_equal_groups_get_exactly_zero_advantages():
    from tether.core.advantages import group_all_equal, group_normalized_advantages, rloo_advantages

    # (0.1, 0.1, 0.1): in float64 the mean is 0.30000000000000004 / 3 = 0.10000000000000002, so
    # the centred rewards are -1.4e-17 each, which the std division (0 + 1e-4) would make -1.4e-13;
    # the second group (0, 1, 1) is not all-equal: mean 2/3, std sqrt(1/3) = 0.57735
    scores = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 1.0], dtype=F64)
    residue = scores[:3] - scores[:3].mean()
    assert float(residue.abs().max()) > 0  # the formula alone leaves a residue: this test can fail
    assert group_all_equal(scores, 3).tolist() == [True, True, True, False, False, False]
    for adv in (
        group_normalized_advantages(scores, 3),
        group_normalized_advantages(scores, 3, scale_by_std=False),
        rloo_advantages(scores, 3),
    ):
        assert torch.equal(adv[:3], torch.zeros(3, dtype=F64))
    torch.testing.assert_close(
        group_normalized_advantages(scores, 3)[3:],
        torch.tensor([-2 / 3, 1 / 3, 1 / 3], dtype=F64) / (math.sqrt(1 / 3) + 1e-4),
        rtol=1e-12,
        atol=0,
    )
    # RLOO on (0, 1, 1): 0 - 1 = -1, 1 - 0.5 = 0.5, 0.5
    torch.testing.assert_close(rloo_advantages(scores, 3)[3:], torch.tensor([-1.0, 0.5, 0.5], dtype=F64))


def test_group_statistics_of_huge_rewards_do_not_overflow_to_zero():
    # A reward of 1e20 squares to 1e40, past float32's 3.4e38: the group std was inf and every
    # advantage a silent 0. The statistics are then taken in float64: [1e20, -1e20, 1e20] has
    # mean 3.33e19 and unbiased std 1.1547e20, advantages [0.5774, -1.1547, 0.5774], as [1, -1, 1]
    # gives (the scale cancels); float32's largest rewards give the same, all scored or not.
    from tether.core.advantages import group_normalized_advantages, group_std, rloo_advantages

    nan = math.nan
    huge = group_normalized_advantages(
        torch.tensor([1e20, -1e20, 1e20, nan]), 4, scored=torch.tensor([1, 1, 1, 0]).bool()
    )
    # the 1e-4 epsilon is nothing beside a std of 1e20: [2, -4, 2] / 3 / 1.1547 = [1, -2, 1] / sqrt(3)
    third = 1 / math.sqrt(3)
    assert huge.dtype == torch.float32
    assert huge.tolist() == pytest.approx([third, -2 * third, third, 0.0], rel=1e-6)
    top = group_normalized_advantages(torch.tensor([3e38, -3e38, 3e38, -3e38]), 4)
    # mean 0, std sqrt(4 * 9e76 / 3) = 3.4641e38: +-3e38 / 3.4641e38 = +-0.8660
    assert top.tolist() == pytest.approx([0.8660254, -0.8660254] * 2, rel=1e-6)
    assert group_std(torch.tensor([1e20, -1e20, 1e20, -1e20]), 4).tolist() == pytest.approx(
        [1.1547e20] * 4, rel=1e-4
    )
    # RLOO of 1e20: 1e20 - (-1e20 + 1e20 - 1e20) / 3 = 1.3333e20 (its sum 1e20 in float32 is fine;
    # of 3e38 the leave-one-out advantage itself is beyond float32: inf, which the gradient guard refuses)
    assert rloo_advantages(torch.tensor([1e20, -1e20, 1e20, -1e20]), 4).tolist() == pytest.approx(
        [4e20 / 3, -4e20 / 3] * 2, rel=1e-6
    )
