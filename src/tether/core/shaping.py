"""Reward shaping: the KL leash as a per-token reward (the "KL in the reward" placement).

Torch only. Sign convention (see :mod:`tether.core.kl`): ``non_score_reward = -kl_coef * kl``.

Source: Ziegler et al. 2019, arXiv 1909.08593, eq. 2, R(x, y) = r(x, y) - beta log(pi/rho);
Stiennon et al. 2020, eq. 1; per-token form as in lm-human-preferences (the score is added on
the last real token, the penalty on every token).

Two forms of the same expected policy gradient:

* :func:`shape_rewards`, **sampled**: ``-kl_coef * k_t`` on every token, propagated by the returns
  to every earlier token. The gradient at token t then carries ``sum_{t' >= t} k1_{t'}``, whose
  sampling noise grows with the response length.
* :func:`shape_rewards_exact`, **exact**: the returns carry the exact per-position KL
  ``KL_t = KL(pi(.|s_t) || pi_ref(.|s_t))`` instead, and token t alone gets the correction
  ``-kl_coef * (k1_t - KL_t)`` on its advantage (not propagated). By the chain rule,
  ``E[sum_t KL_t] = KL(pi || pi_ref)`` over whole responses, and the expected gradient is the
  same: for ``t' > t``, ``E[k1_{t'} - KL_{t'} | s_{t'}] = 0`` while ``grad log pi(y_t | s_t)`` is
  fixed by ``s_{t'}``, so dropping those terms changes the variance only (a Rao-Blackwellization
  of the later tokens' KL); token t's own ``grad log pi(y_t) * k1_t`` is kept, and its mean is
  the direct gradient of ``KL_t``. Tested by exact enumeration in tests/oracle/test_kl_placement.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from tether.core.logprobs import last_token_index
from tether.core.masked import at_least_fp32


class ShapedRewards(NamedTuple):
    """Output of :func:`shape_rewards`; all (B, R) float32 and zero where masked."""

    rewards: Tensor
    """per-token reward r_t = non_score_reward_t (+ score on the last real token)."""
    non_score_reward: Tensor
    """-kl_coef * kl_t on valid tokens (the exact form: -kl_coef * KL_t)."""
    token_correction: Tensor | None = None
    """The exact form only: ``-kl_coef * (k1_t - KL_t)`` on valid tokens, 0 elsewhere, to add to
    token t's advantage alone (:func:`shape_rewards_exact`); None for the sampled form."""


def shape_rewards(scores: Tensor, kl: Tensor, kl_coef: float, response_mask: Tensor) -> ShapedRewards:
    """Per-token rewards: ``-kl_coef * kl_t`` on every response token, score on the last one.

    Args:
        scores: (B,) scorer value of each whole response (e.g. VADER compound in [-1, 1]).
        kl: (B, R) per-token KL estimate, nats (the same tensor that is logged and fed to the
            controller).
        kl_coef: beta >= 0, reward units per nat.
        response_mask: (B, R) bool, True where the token counts.

    Returns:
        :class:`ShapedRewards`; masked positions are exactly 0.

    Raises:
        ValueError: on shape mismatch or negative ``kl_coef``.

    Example:
        k1 [0.1, -0.2, 0.3, 0.7, 0.5], mask [1, 1, 1, 0, 0], kl_coef 0.1, score 2.0 gives
        rewards [-0.01, 0.02, 2.0 - 0.03, 0, 0] = [-0.01, 0.02, 1.97, 0, 0].
    """
    if kl.shape != response_mask.shape or scores.shape != kl.shape[:1]:
        raise ValueError(
            f"scores {tuple(scores.shape)} must be (B,) and kl {tuple(kl.shape)} must match "
            f"response_mask {tuple(response_mask.shape)}"
        )
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    mask = response_mask.bool()
    kl = at_least_fp32(kl)
    non_score = torch.where(mask, -kl_coef * kl, torch.zeros((), dtype=kl.dtype, device=kl.device))  # (B, R)
    rewards = non_score.clone()
    last = last_token_index(mask)  # (B,)
    rows = torch.arange(kl.shape[0], device=kl.device)
    # a row with no valid token (never produced by response_mask_from_tokens) gets no score,
    # so masked positions stay exactly 0
    rewards[rows, last] += torch.where(mask.any(-1), scores.to(rewards.dtype), 0.0)
    return ShapedRewards(rewards=rewards, non_score_reward=non_score)


def shape_rewards_exact(
    scores: Tensor,
    log_ratio: Tensor,
    exact_kl: Tensor,
    kl_coef: float,
    response_mask: Tensor,
) -> ShapedRewards:
    """The exact form of the shaped rewards: exact per-position KL in the returns, token t's own
    sampled correction on its advantage only (see the module docstring for why the expected
    gradient equals :func:`shape_rewards`'s with k1).

    Args:
        scores: (B,) scorer value of each whole response.
        log_ratio: (B, R) k1 = ``logprobs - ref_logprobs`` of the sampled tokens, nats (k1 whatever
            ``kl.estimator`` logs: the correction's mean must be the direct KL gradient).
        exact_kl: (B, R) exact KL(pi(.|s_t) || pi_ref(.|s_t)) at each position, nats, of the same
            tempered distributions ``log_ratio`` was sampled from.
        kl_coef: beta >= 0, reward units per nat.
        response_mask: (B, R) bool, True where the token counts.

    Returns:
        :class:`ShapedRewards` with ``rewards`` = score on the last valid token plus
        ``-kl_coef * exact_kl_t``, ``non_score_reward = -kl_coef * exact_kl_t`` and
        ``token_correction = -kl_coef * (log_ratio_t - exact_kl_t)``; all 0 where masked.

    Raises:
        ValueError: on shape mismatch or negative ``kl_coef``.

    Example:
        k1 [0.5, -0.2], exact KL [0.3, 0.1], kl_coef 0.5, score 1.0 gives rewards
        [-0.15, 1.0 - 0.05] = [-0.15, 0.95] and corrections [-0.5 * 0.2, -0.5 * -0.3] = [-0.1, 0.15].
    """
    if log_ratio.shape != exact_kl.shape:
        raise ValueError(
            f"log_ratio {tuple(log_ratio.shape)} and exact_kl {tuple(exact_kl.shape)} must both be (B, R)"
        )
    shaped = shape_rewards(scores, exact_kl, kl_coef, response_mask)
    mask = response_mask.bool()
    own = at_least_fp32(log_ratio) - at_least_fp32(exact_kl)  # (B, R), mean 0 given s_t
    zero = torch.zeros((), dtype=own.dtype, device=own.device)
    correction = torch.where(mask, -kl_coef * own, zero)
    return shaped._replace(token_correction=correction.to(shaped.rewards.dtype))
