"""Tests for tether.core.shaping.shape_rewards (KL in the reward, score on the last real token)."""

from __future__ import annotations

import pytest
import torch

from tether.core.kl import kl_k1
from tether.core.logprobs import response_mask_from_tokens
from tether.core.shaping import shape_rewards, shape_rewards_exact

F64 = torch.float64
EOS = 2


@pytest.mark.parametrize("pad_token", [0, EOS])
def test_issue_example_from_tokens(pad_token):
    # tokens [t0, t1, EOS, PAD, PAD] -> mask [1, 1, 1, 0, 0] (also when PAD == EOS)
    tokens = torch.tensor([[5, 7, EOS, pad_token, pad_token]])
    mask = response_mask_from_tokens(tokens, EOS)
    # per-token k1 [0.1, -0.2, 0.3, 0.7, 0.5] built as logprobs - ref
    ref = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0]], dtype=F64)
    logprobs = ref + torch.tensor([[0.1, -0.2, 0.3, 0.7, 0.5]], dtype=F64)
    kl = kl_k1(logprobs, ref)
    out = shape_rewards(torch.tensor([2.0], dtype=F64), kl, 0.1, mask)
    # non_score = -0.1 * [0.1, -0.2, 0.3] = [-0.01, 0.02, -0.03], masked slots 0
    # rewards   = non_score + score on the last real token (index 2): -0.03 + 2.0 = 1.97
    torch.testing.assert_close(
        out.non_score_reward, torch.tensor([[-0.01, 0.02, -0.03, 0.0, 0.0]], dtype=F64), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        out.rewards, torch.tensor([[-0.01, 0.02, 1.97, 0.0, 0.0]], dtype=F64), rtol=0, atol=1e-12
    )
    # masked slots are exactly zero, not just small
    assert out.rewards[0, 3:].tolist() == [0.0, 0.0]
    assert out.non_score_reward[0, 3:].tolist() == [0.0, 0.0]


def test_issue_example_float32():
    # float32 in, float32 out: same numbers to float32 precision (~1e-7 relative)
    kl = torch.tensor([[0.1, -0.2, 0.3, 0.7, 0.5]])
    mask = torch.tensor([[1, 1, 1, 0, 0]], dtype=torch.bool)
    out = shape_rewards(torch.tensor([2.0]), kl, 0.1, mask)
    assert out.rewards.dtype == torch.float32
    torch.testing.assert_close(out.rewards, torch.tensor([[-0.01, 0.02, 1.97, 0.0, 0.0]]), rtol=0, atol=1e-6)


def test_batch_score_on_last_valid_token_and_nonfinite_pads_ignored():
    kl = torch.tensor(
        [
            [1.0, 2.0, 3.0, 4.0],  # no EOS: all valid, score on index 3
            [1.0, float("nan"), float("inf"), -float("inf")],  # EOS first: only index 0 valid
        ],
        dtype=F64,
    )
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    out = shape_rewards(torch.tensor([0.5, -1.0], dtype=F64), kl, 0.2, mask)
    # row 0: -0.2 * [1, 2, 3, 4] = [-0.2, -0.4, -0.6, -0.8]; + 0.5 on index 3 -> -0.3
    # row 1: -0.2 * 1 = -0.2; + (-1.0) on index 0 -> -1.2; masked slots 0 despite nan/inf
    torch.testing.assert_close(
        out.rewards,
        torch.tensor([[-0.2, -0.4, -0.6, -0.3], [-1.2, 0.0, 0.0, 0.0]], dtype=F64),
        rtol=0,
        atol=1e-12,
    )
    assert torch.isfinite(out.non_score_reward).all()
    # sum of rewards of a row = score - kl_coef * sequence KL
    assert out.rewards[0].sum().item() == pytest.approx(0.5 - 0.2 * 10.0, abs=1e-12)


def test_zero_kl_coef_gives_score_only():
    kl = torch.tensor([[0.3, 0.4, 0.5]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    out = shape_rewards(torch.tensor([1.5], dtype=F64), kl, 0.0, mask)
    assert out.rewards.tolist() == [[0.0, 1.5, 0.0]]


def test_validation():
    kl = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError):
        shape_rewards(torch.zeros(2), kl, -0.1, mask)
    with pytest.raises(ValueError):
        shape_rewards(torch.zeros(3), kl, 0.1, mask)
    with pytest.raises(ValueError):
        shape_rewards(torch.zeros(2), kl, 0.1, mask[:, :2])


def test_exact_form_by_hand():
    # k1 [0.5, -0.2, nan], exact KL [0.3, 0.1, 9], mask [1, 1, 0], kl_coef 0.5, score 1.0:
    #   rewards     [-0.5 * 0.3, 1.0 - 0.5 * 0.1, 0]      = [-0.15, 0.95, 0]
    #   corrections [-0.5 * (0.5 - 0.3), -0.5 * (-0.2 - 0.1), 0] = [-0.1, 0.15, 0]
    # (the masked slot's NaN and 9 reach nothing); float64 in, float64 out, exact to rounding
    log_ratio = torch.tensor([[0.5, -0.2, float("nan")]], dtype=F64)
    exact = torch.tensor([[0.3, 0.1, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    out = shape_rewards_exact(torch.tensor([1.0], dtype=F64), log_ratio, exact, 0.5, mask)
    torch.testing.assert_close(out.rewards, torch.tensor([[-0.15, 0.95, 0.0]], dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(
        out.non_score_reward, torch.tensor([[-0.15, -0.05, 0.0]], dtype=F64), rtol=0, atol=1e-15
    )
    torch.testing.assert_close(
        out.token_correction, torch.tensor([[-0.1, 0.15, 0.0]], dtype=F64), rtol=0, atol=1e-15
    )
    # rewards + corrections summed over a row = score - beta * sum k1: the sampled form's total
    total = out.rewards.sum() + out.token_correction.sum()
    sampled = shape_rewards(torch.tensor([1.0], dtype=F64), log_ratio.nan_to_num(), 0.5, mask).rewards.sum()
    assert abs(float(total - sampled)) < 1e-15
    assert shape_rewards(torch.tensor([1.0]), exact.float(), 0.5, mask).token_correction is None


def test_exact_form_validation():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="log_ratio"):
        shape_rewards_exact(torch.zeros(2), torch.zeros(2, 3), torch.zeros(2, 2), 0.1, mask)
    with pytest.raises(ValueError, match="kl_coef"):
        shape_rewards_exact(torch.zeros(2), torch.zeros(2, 3), torch.zeros(2, 3), -0.1, mask)


def test_a_hole_in_the_mask_gets_no_kl_and_the_score_goes_on_the_last_policy_token():
    # k1 [0.1, 5.0, 0.3, 0.7], mask [1, 0, 1, 0] (position 1: a tool's output, 3: padding),
    # kl_coef 0.1, score 2.0: rewards [-0.1*0.1, 0, 2.0 - 0.1*0.3, 0] = [-0.01, 0, 1.97, 0]
    mask = torch.tensor([[1, 0, 1, 0]], dtype=torch.bool)
    kl = torch.tensor([[0.1, 5.0, 0.3, 0.7]], dtype=torch.float64)
    out = shape_rewards(torch.tensor([2.0], dtype=torch.float64), kl, 0.1, mask)
    torch.testing.assert_close(out.rewards, torch.tensor([[-0.01, 0.0, 1.97, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(
        out.non_score_reward, torch.tensor([[-0.01, 0.0, -0.03, 0.0]], dtype=torch.float64)
    )
    # the exact form: exact KL [0.2, 9, 0.4, 9], k1 as above: corrections -0.1 * (k1 - KL) on the
    # policy's tokens = [-0.1 * -0.1, 0, -0.1 * -0.1, 0] = [0.01, 0, 0.01, 0]
    exact = torch.tensor([[0.2, 9.0, 0.4, 9.0]], dtype=torch.float64)
    ex = shape_rewards_exact(torch.tensor([2.0], dtype=torch.float64), kl, exact, 0.1, mask)
    torch.testing.assert_close(ex.rewards, torch.tensor([[-0.02, 0.0, 1.96, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(
        ex.token_correction, torch.tensor([[0.01, 0.0, 0.01, 0.0]], dtype=torch.float64)
    )
