"""Reward shaping: the KL leash as a per-token reward (the "KL in the reward" placement).

Torch only. Sign convention (see :mod:`tether.core.kl`): ``non_score_reward = -kl_coef * kl``.

Source: Ziegler et al. 2019, arXiv 1909.08593, eq. 2, R(x, y) = r(x, y) - beta log(pi/rho);
Stiennon et al. 2020, eq. 1; per-token form as in lm-human-preferences (the score is added on
the last real token, the penalty on every token).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from tether.core.kl import at_least_fp32
from tether.core.logprobs import last_token_index


class ShapedRewards(NamedTuple):
    """Output of :func:`shape_rewards`; all (B, R) float32 and zero where masked."""

    rewards: Tensor
    """per-token reward r_t = non_score_reward_t (+ score on the last real token)."""
    non_score_reward: Tensor
    """-kl_coef * kl_t on valid tokens."""


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
