"""Advantage estimators: GAE and whitening. Torch only.

Sources: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
Estimation", arXiv 1506.02438, eq. 11-16; whitening as in lm-human-preferences and
Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO", detail 8; reward scaling
by the spread of the returns as in Engstrom et al. 2020, "Implementation Matters in Deep
Policy Gradients", arXiv 2005.12729, section 3 (there with a running estimate).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from tether.core.masked import at_least_fp32

# Added to the variance before the square root when whitening, so a batch whose valid values
# are all equal gives zeros instead of NaN. 1e-8 is the value of lm-human-preferences and TRL.
WHITEN_EPS = 1e-8


class GAEOutput(NamedTuple):
    advantages: Tensor
    """(B, R) float32 A_t, zero where masked."""
    returns: Tensor
    """(B, R) float32 value targets A_t + V_t, zero where masked."""


def gae(
    rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float = 1.0, gae_lambda: float = 0.95
) -> GAEOutput:
    """Generalized advantage estimation over each response, stepping by policy token.

    ``delta_t = r_t + gamma * V_{n(t)} - V_t`` and ``A_t = delta_t + gamma * lambda * A_{n(t)}``,
    where ``n(t)`` is the next valid position after ``t`` (Schulman et al. 2016, "High-Dimensional
    Continuous Control Using Generalized Advantage Estimation", eq. 16), and ``V_{n(t)} = 0``,
    ``A_{n(t)} = 0`` past the last valid token (the episode ends at the first EOS or at truncation).

    **One rule for masks with holes: discounting by policy step.** A position where
    ``response_mask`` is False is not a step of the policy: post-EOS padding, or inside a response,
    tokens an environment wrote (a tool's output in a multi-turn rollout). They belong to the
    transition from one policy token to the next, so the next valid token is the successor state
    (its value is the bootstrap) and ``gamma`` applies once per policy token, not once per position
    (docs/kl.md, "Masks with holes"). Their rewards and values never reach a valid token; for a
    mask that is a prefix of each row (every single-turn rollout) this is the usual recursion. With
    ``gamma = 1`` (the default) the two rules, by policy step and by position, coincide.

    Args:
        rewards: (B, R) per-token rewards (see :func:`tether.core.shaping.shape_rewards`).
        values: (B, R) value estimates V(x, y_<t) at each response position.
        response_mask: (B, R) bool, True where the policy sampled the token (any pattern).
        gamma: discount in [0, 1], per policy token.
        gae_lambda: GAE lambda in [0, 1].

    Returns:
        :class:`GAEOutput`, zero where masked.

    Example:
        rewards [1, 7, 2], values [0.5, 9, 1.5], mask [1, 0, 1], gamma 0.9, lambda 0.5: A_2 = 2 -
        1.5 = 0.5; position 1 is skipped; A_0 = 1 + 0.9 * 1.5 - 0.5 + 0.45 * 0.5 = 2.075.
    """
    mask = response_mask.bool()
    r = torch.where(mask, at_least_fp32(rewards), 0.0)
    v = torch.where(mask, at_least_fp32(values), 0.0)
    T = r.shape[-1]
    advantages = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    next_adv = torch.zeros_like(r[:, 0])
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv_t = delta + gamma * gae_lambda * next_adv
        valid = mask[:, t]
        advantages[:, t] = torch.where(valid, adv_t, 0.0)
        # a masked slot is no policy step: the next valid token's value and advantage pass through
        # it unchanged to the valid token before it (0 past the last valid token)
        next_value = torch.where(valid, v[:, t], next_value)
        next_adv = torch.where(valid, adv_t, next_adv)
    returns = torch.where(mask, advantages + v, 0.0)
    return GAEOutput(advantages=advantages, returns=returns)


# Returns that spread less than this many reward units over the batch are not scaled up by
# :func:`return_scale`: a small-beta run (returns about the score's spread, under 1 for scores
# in [-1, 1]) computes exactly as without scaling, and a batch of equal returns is not divided
# by a standard deviation near 0.
RETURN_SCALE_FLOOR = 1.0


def return_scale(returns_std: Tensor, floor: float = RETURN_SCALE_FLOOR) -> Tensor:
    """The positive number PPO divides the per-token rewards by before GAE: ``max(floor, std)``.

    Why: the value head fits the returns, whose spread grows with beta (a KL leash at beta 10
    on 4-nat sequences gives returns of about -40, value losses in the hundreds). On a trunk
    shared with the policy, that loss's gradient outgrows the policy's, clipping by global norm
    shrinks the policy's share, and the trunk moves to fit values while the KL drifts. Dividing
    every reward of the batch by one positive number does not change the objective's argmax,
    and with values in the same scaled units the whitened advantages are those without scaling
    (up to ``WHITEN_EPS``); it keeps the value targets at about unit spread whatever beta is.

    Args:
        returns_std: scalar tensor, the standard deviation of the sequence returns
            (sum of the per-token rewards) over the batch, in reward units.
        floor: the smallest scale returned (:data:`RETURN_SCALE_FLOOR`), > 0.

    Returns:
        scalar tensor (the dtype of ``returns_std``), >= ``floor``.
    """
    return returns_std.clamp(min=floor)


# Added to the group standard deviation in GRPO's normalization (Shao et al. 2024 use the same
# form; TRL uses 1e-4). A group whose rewards are all equal gets advantage exactly 0 by
# :func:`group_all_equal`, not by this epsilon (its mean-centered rewards may round to ~1e-17,
# which the division would blow up 10^4 times); for the other groups it bounds 1 / std at 10^4.
GROUP_STD_EPS = 1e-4


def _groups(scores: Tensor, group_size: int) -> Tensor:
    if scores.dim() != 1 or group_size < 1 or scores.shape[0] % group_size != 0:
        raise ValueError(
            f"scores {tuple(scores.shape)} must be (B,) with B divisible by group_size={group_size}"
        )
    return at_least_fp32(scores).view(-1, group_size)  # (B / G, G), consecutive rows form a group


def _wide(g: Tensor, *results: Tensor) -> bool:
    """Whether a group statistic computed in ``g``'s float32 overflowed (inf or NaN in ``results``
    from finite rewards): a reward of 1e20 has a square of 1e40, past float32's 3.4e38. The
    statistics are then taken again in float64 (squares up to 1e77 for float32's largest reward),
    so a huge reward gives its true advantage, not a silent 0."""
    return g.dtype == torch.float32 and not all(bool(torch.isfinite(r).all()) for r in results)


def _scored_groups(scores: Tensor, group_size: int, scored: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(g, s)``: the scores as (B / G, G) float64 groups with unscored slots set to 0 (never
    NaN), and the (B / G, G) bool of the scored slots (all True when ``scored`` is None). Float64,
    so that no square of a float32 reward overflows (:func:`_wide`)."""
    g = _groups(scores, group_size).double()
    if scored is None:
        return g, torch.ones_like(g, dtype=torch.bool)
    if scored.shape != scores.shape:
        raise ValueError(f"scored {tuple(scored.shape)} must have the shape of scores {tuple(scores.shape)}")
    s = scored.bool().view(-1, group_size)
    return torch.where(s, g, 0.0), s


def group_all_equal(scores: Tensor, group_size: int, scored: Tensor | None = None) -> Tensor:
    """Whether each row's group has all its scored rewards exactly equal (max == min over the
    scored rows; a group with fewer than two scored rows counts as equal): (B,) -> (B,) bool.

    Such a group carries no ranking, so every advantage of it is exactly 0 in GRPO, Dr. GRPO and
    RLOO; with 0/1 rewards these are the all-right and all-wrong groups.

    Args:
        scores: (B,) sequence rewards, consecutive groups of ``group_size`` rows.
        group_size: G >= 1.
        scored: (B,) bool, False on a sample no reward scored (its value is ignored), or None
            (every sample scored).

    Raises:
        ValueError: B is not a multiple of ``group_size``; ``scored`` of another shape.
    """
    g, s = _scored_groups(scores, group_size, scored)
    hi = torch.where(s, g, -torch.inf).amax(-1, keepdim=True)
    lo = torch.where(s, g, torch.inf).amin(-1, keepdim=True)
    equal = (hi == lo) | (s.sum(-1, keepdim=True) < 2)
    return equal.expand_as(g).reshape(-1)


def _scored_mean_std(g: Tensor, s: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per group: the count of scored rows n, their mean and their unbiased standard deviation
    (``sqrt(sum (r - mean)^2 / (n - 1))``; 0 where n < 2, where no std exists), each (B / G, 1)."""
    n = s.sum(-1, keepdim=True).to(g.dtype)
    mean = torch.where(s, g, 0.0).sum(-1, keepdim=True) / n.clamp(min=1)
    sq = torch.where(s, (g - mean) ** 2, 0.0).sum(-1, keepdim=True)
    std = torch.where(n >= 2, (sq / (n - 1).clamp(min=1)).sqrt(), 0.0)
    return n, mean, std


def group_normalized_advantages(
    scores: Tensor, group_size: int, scale_by_std: bool = True, scored: Tensor | None = None
) -> Tensor:
    """GRPO outcome advantages: ``(r_i - mean_g r) / (std_g r + GROUP_STD_EPS)`` within each group.

    Source: Shao et al. 2024, "DeepSeekMath", arXiv 2402.03300, section 4.1.2 (outcome
    supervision); ``std`` is the unbiased sample standard deviation of the group, as in TRL.
    With ``scale_by_std=False`` only the mean is removed (Liu et al. 2025, "Dr. GRPO").

    **Unscored samples** (``scored`` False: every reward returned None for it) are left out of
    their group's mean and std and get advantage exactly 0, as TRL 1.16 does (PR #5902:
    ``nanmean``, ``nanstd``, then ``nan_to_num``): a group of rewards ``[-, 1, 0.25, 1]`` has
    mean 0.75 and std ``sqrt((0.0625 + 0.25 + 0.0625) / 2) = 0.4330`` over its three scored
    samples, so its advantages are ``[0, 0.577, -1.155, 0.577]``, not those of ``[0, 1, 0.25, 1]``.
    A group with fewer than two scored samples carries no ranking: all its advantages are 0.

    Args:
        scores: (B,) sequence rewards; rows ``g*G .. g*G + G - 1`` are the G completions of
            prompt g. An unscored row's value is ignored (it may be NaN).
        group_size: G >= 1 (G = 1 gives zeros).
        scale_by_std: divide by the group's std (False: Dr. GRPO).
        scored: (B,) bool, or None (every sample scored).

    Returns:
        (B,) advantages, one per sequence; exactly 0 for a group whose scored rewards are all
        equal and for every unscored sample.

    Raises:
        ValueError: B is not a multiple of ``group_size``; ``scored`` of another shape.
    """
    if scored is not None and bool(scored.all()):
        scored = None  # every sample scored: the plain statistics, bit for bit
    equal = group_all_equal(scores, group_size, scored)
    if scored is None:
        g = _groups(scores, group_size)
        centered = g - g.mean(-1, keepdim=True)
        std = g.std(-1, keepdim=True) if scale_by_std and group_size > 1 else None
        if std is not None:
            centered = centered / (std + GROUP_STD_EPS)
        if not _wide(g, centered, *([std] if std is not None else [])):
            # an all-equal group: exactly 0, not its rounding residue (up to 1e-17 x 10^4 after the division)
            return torch.where(equal, 0.0, centered.reshape(-1))
        scored = torch.ones_like(scores, dtype=torch.bool)  # overflowed: the float64 statistics below
    g, s = _scored_groups(scores, group_size, scored)
    _, mean, std = _scored_mean_std(g, s)
    centered = g - mean
    if scale_by_std and group_size > 1:
        centered = centered / (std + GROUP_STD_EPS)
    out = torch.where(equal | ~s.reshape(-1), 0.0, centered.reshape(-1))
    return out.to(at_least_fp32(scores).dtype)


def group_std(scores: Tensor, group_size: int, scored: Tensor | None = None) -> Tensor:
    """Each row's group standard deviation (unbiased, as :func:`group_normalized_advantages`
    divides by; over the scored rows only when ``scored`` is given, 0 for a group with fewer than
    two), repeated for the group's rows: (B,) -> (B,); zeros for ``group_size`` 1.

    Raises:
        ValueError: B is not a multiple of ``group_size``; ``scored`` of another shape.
    """
    if scored is not None and bool(scored.all()):
        scored = None
    g = _groups(scores, group_size)
    if group_size == 1:
        return torch.zeros_like(scores)
    if scored is None:
        std = g.std(-1, keepdim=True)
        if not _wide(g, std):
            return std.expand_as(g).reshape(-1)
        scored = torch.ones_like(scores, dtype=torch.bool)
    _, _, std = _scored_mean_std(*_scored_groups(scores, group_size, scored))
    return std.expand_as(g).reshape(-1).to(g.dtype)


def rloo_advantages(rewards: Tensor, group_size: int, scored: Tensor | None = None) -> Tensor:
    """RLOO: each sample's reward minus the mean reward of the other k - 1 samples of its prompt.

    ``A_i = r_i - (sum_j r_j - r_i) / (k - 1)``. Source: Ahmadian et al. 2024, "Back to Basics",
    arXiv 2402.14740, eq. 6 (Kool et al. 2019).

    **Unscored samples** (``scored`` False) are left out of their siblings' baselines and get
    advantage exactly 0, as TRL 1.16 does (PR #5902): with n scored samples in a group, ``A_i =
    r_i - (sum_{j scored} r_j - r_i) / (n - 1)``; rewards ``[-, 1, 0.25, 1]`` give ``[0, 1 -
    1.25 / 2, 0.25 - 2 / 2, 0.375] = [0, 0.375, -0.75, 0.375]``. A group with fewer than two
    scored samples has no baseline: all its advantages are 0.

    Args:
        rewards: (B,) sequence rewards (the score, minus beta * KL when the KL is in the reward);
            an unscored row's value is ignored (it may be NaN).
        group_size: k >= 2 samples per prompt, consecutive rows.
        scored: (B,) bool, or None (every sample scored).

    Returns:
        (B,) advantages; exactly 0 for a group whose scored rewards are all equal and for every
        unscored sample.

    Raises:
        ValueError: k < 2, B not a multiple of k, or ``scored`` of another shape.
    """
    if group_size < 2:
        raise ValueError(f"RLOO needs group_size >= 2 samples per prompt, got {group_size}")
    if scored is not None and bool(scored.all()):
        scored = None  # every sample scored: the plain leave-one-out, bit for bit
    equal = group_all_equal(rewards, group_size, scored)
    if scored is None:
        g = _groups(rewards, group_size)
        baseline = (g.sum(-1, keepdim=True) - g) / (group_size - 1)
        if not _wide(g, baseline):
            # an all-equal group: exactly 0 (the leave-one-out mean of equal floats may round off them)
            return torch.where(equal, 0.0, (g - baseline).reshape(-1))
        scored = torch.ones_like(rewards, dtype=torch.bool)  # the sum overflowed: in float64 below
    g, s = _scored_groups(rewards, group_size, scored)
    n = s.sum(-1, keepdim=True).to(g.dtype)
    # (n - 1) clamped at 1: a group of fewer than two scored rows is all-equal, its advantages 0
    baseline = (g.sum(-1, keepdim=True) - g) / (n - 1).clamp(min=1)  # unscored slots hold 0
    out = torch.where(equal | ~s.reshape(-1), 0.0, (g - baseline).reshape(-1))
    return out.to(at_least_fp32(rewards).dtype)
