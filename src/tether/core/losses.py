"""PPO losses: clipped surrogate and clipped value loss. Torch only.

Source: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", arXiv 1707.06347,
eq. 7 (L^CLIP) and eq. 9; value clipping as in OpenAI baselines / lm-human-preferences.
All losses are token-level means over ``response_mask`` (every valid token of the minibatch
weighs the same).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from tether.core.kl import ESTIMATORS, K3_LOG_RATIO_CLAMP, TANG_MUNOS, Estimator, Standing, register_estimator
from tether.core.kl import k3_from_log_ratio as _k3
from tether.core.masked import masked_mean


class PolicyLoss(NamedTuple):
    loss: Tensor
    """scalar, to minimize: -mean_t min(ratio_t A_t, clip(ratio_t, 1 - clip_eps, 1 + clip_eps_high) A_t)."""
    clipfrac: Tensor
    """scalar, fraction of valid tokens where the clipped branch was taken."""
    approx_kl: Tensor
    """scalar, mean k3 estimate of KL(pi_old || pi_theta) on valid tokens (nats per token)."""
    ratio: Tensor
    """(B, R) pi_theta / pi_old, detached."""


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_eps: float = 0.2,
    *,
    clip_eps_high: float | None = None,
    is_weights: Tensor | None = None,
) -> PolicyLoss:
    """PPO clipped surrogate loss (Schulman et al. 2017, eq. 7), negated for minimization.

    ``ratio = exp(logprobs - old_logprobs)``;
    ``loss = mean_valid max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))``.
    An upper range wider than the lower one is DAPO's "clip-higher" (Yu et al. 2025, arXiv
    2503.14476, eq. 10; TRL's ``epsilon_high``): a token whose probability the update raises may
    rise further before its gradient stops, which keeps exploration where the symmetric clip
    collapses entropy.

    Args:
        logprobs: (B, R) log pi_theta of the taken tokens, with grad.
        old_logprobs: (B, R) log pi_old at rollout time, no grad.
        advantages: (B, R) advantages, no grad.
        response_mask: (B, R) bool.
        clip_eps: clip range epsilon > 0 (below 1: the lower bound ``1 - clip_eps``).
        clip_eps_high: the upper range (``1 + clip_eps_high``), > 0; None = ``clip_eps``.
        is_weights: (B, R) importance weights of a sampler that is not the learner, no grad
            (:func:`tether.core.correction.correction_weights`): each token's term is multiplied
            by its weight (TRL's ``per_token_loss * importance_sampling_ratio``); None = 1. The
            ratio and its clip stay pi_theta / pi_old, of the learner.

    Returns:
        :class:`PolicyLoss`.
    """
    log_ratio = logprobs - old_logprobs.detach()
    # masked slots may hold anything (even -inf - -inf); zero them before exp so no NaN/inf
    # reaches a gradient through torch.where's unselected branch.
    log_ratio = torch.where(response_mask.bool(), log_ratio, 0.0)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach()
    unclipped = -adv * ratio
    high = clip_eps if clip_eps_high is None else clip_eps_high
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    terms = torch.maximum(unclipped, clipped)  # (B, R)
    if is_weights is not None:
        terms = terms * is_weights.detach().to(terms.dtype)
    loss = masked_mean(terms, response_mask)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
        # k3 of KL(old || new) on samples of old: log p - log q = old - new = -log_ratio
        approx_kl = masked_mean(_k3(-log_ratio), response_mask)
    return PolicyLoss(loss=loss, clipfrac=clipfrac, approx_kl=approx_kl, ratio=ratio.detach())


class ValueLoss(NamedTuple):
    loss: Tensor
    """scalar: 0.5 * mean_valid max((V - R)^2, (V_clipped - R)^2)."""
    clipfrac: Tensor
    """scalar, fraction of valid tokens where the clipped value loss was larger."""


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip_eps_value: float = 0.2,
) -> ValueLoss:
    """Clipped value-function loss.

    ``V_clipped = old_values + clip(values - old_values, -clip_eps_value, clip_eps_value)``;
    ``loss = 0.5 * mean_valid max((values - returns)^2, (V_clipped - returns)^2)``.

    Args:
        values: (B, R) current value predictions, with grad.
        old_values: (B, R) values at rollout time.
        returns: (B, R) targets (GAE advantages + old values).
        response_mask: (B, R) bool.
        clip_eps_value: clip range for the value change, > 0.

    Returns:
        :class:`ValueLoss`.
    """
    mask = response_mask.bool()
    # zero masked slots first, so NaN/inf there reaches neither the loss nor the gradient
    values = torch.where(mask, values, 0.0)
    old_values = torch.where(mask, old_values.detach(), 0.0)
    returns = torch.where(mask, returns.detach(), 0.0)
    v_clipped = old_values + torch.clamp(values - old_values, -clip_eps_value, clip_eps_value)
    loss_unclipped = (values - returns).pow(2)
    loss_clipped = (v_clipped - returns).pow(2)
    loss = 0.5 * masked_mean(torch.maximum(loss_unclipped, loss_clipped), response_mask)
    with torch.no_grad():
        clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)
    return ValueLoss(loss=loss, clipfrac=clipfrac)


# ---- KL in the loss (GRPO placement) --------------------------------------------------------
# Which per-token surrogate to differentiate so that the expected gradient is the gradient of
# the reverse KL(pi_theta || pi_ref). Tang & Munos 2025, "On a few pitfalls in KL divergence
# gradient estimation for RL", arXiv 2506.09477; Schulman 2020. Exact checks by enumeration are
# in tests/oracle/test_kl_placement.py and the table in docs/kl.md.
# Each is a record of tether.core.kl.ESTIMATORS (its standing, with the reason, and its terms);
# tether.core.placement refuses the ones that are not exact. k1, k2 and k3 are registered in
# tether.core.kl with their sampled values; k3+, k3_is and k1_seq, surrogates only, here.
KLLossEstimator = Literal["k2", "k3+", "k3_is", "k1_seq", "k1", "k3"]
"""The built-in loss surrogates' names (:data:`tether.core.kl.ESTIMATORS` holds every one)."""


def kl_loss_terms(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: str = "k3_is",
    old_logprobs: Tensor | None = None,
    response_mask: Tensor | None = None,
) -> Tensor:
    """Per-token KL surrogate to add (times kl_coef) to the loss; (B, R), unmasked.

    * ``k2``: ``0.5 (log pi - log pi_ref)^2``; on-policy its expected gradient is
      ``grad KL(pi || pi_ref)``.
    * ``k3+``: value of k3 (unbiased, >= 0, what is logged) with the gradient of k2
      (straight-through: ``k2 + stopgrad(k3 - k2)``); on samples of pi_old (after the first
      minibatch) its gradient is ``E_old[k1 grad log pi]``, not ``grad KL``.
    * ``k3_is`` (the default): ``(pi / pi_old) * k3`` for minibatches sampled from ``pi_old``; its
      expectation under pi_old is exactly KL(pi || pi_ref) for every theta, so its gradient,
      ``(pi / pi_old) * k1 * grad log pi``, is exact off-policy too (the update's later
      minibatches and epochs), where k2's and k3+'s are not. On-policy it equals k3+'s. Needs
      ``old_logprobs``.
    * ``k1_seq``: the gradient of the **sequence** KL, :func:`k1_seq_terms`: the per-token
      surrogates above give the gradient of the KL of each position's next-token distribution,
      which on multi-token responses is not the gradient of KL(pi || pi_ref) over sequences.
      Needs ``response_mask`` (and ``old_logprobs`` when the samples are from pi_old).
    * ``k1``, ``k3``: computed only for the tests that show why they are refused.
    * any other name registered with loss terms (:func:`tether.core.kl.register_estimator`).

    Args:
        logprobs: (B, R) log pi_theta with grad.
        ref_logprobs: (B, R) log pi_ref, no grad.
        estimator: see above.
        old_logprobs: (B, R) log pi_old (for ``k3_is``; for ``k1_seq`` off-policy).
        response_mask: (B, R) bool (for ``k1_seq``).

    Raises:
        ValueError: unknown estimator, ``k3_is`` without ``old_logprobs``, ``k1_seq`` without
            ``response_mask``.
    """
    terms = ESTIMATORS[estimator].loss_terms if estimator in ESTIMATORS else None
    if terms is None:
        names = [n for n, e in ESTIMATORS.items() if e.loss is not None]
        raise ValueError(f"unknown kl.loss_estimator {estimator!r}; choose one of {names}")
    return terms(logprobs, ref_logprobs, old_logprobs, response_mask)


def k1_seq_terms(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    response_mask: Tensor,
    old_logprobs: Tensor | None = None,
) -> Tensor:
    """Per-token terms whose gradient, summed over a sequence, is an unbiased estimate of the
    gradient of the sequence KL(pi_theta || pi_ref); their value is k1 (what is logged).

    For sequences ``y`` of pi_theta, with ``k1_t = log pi(y_t | y_<t) - log pi_ref(y_t | y_<t)``
    and the KL still to come ``G_t = sum_{t' >= t} k1_t'`` (valid tokens only)::

        grad KL(pi || pi_ref) = E_y [ sum_t grad log pi(y_t | y_<t) * G_t ]

    (the score-function term ``E[grad log pi(y) * sum_t k1_t]``, whose past terms ``t' < t``
    vanish in expectation because ``E[grad log pi(y_t) | y_<t] = 0``, plus the direct term
    ``E[sum_t grad k1_t] = E[grad log pi(y)] = 0``; Zhang et al. 2025, "On the Design of
    KL-Regularized Policy Gradient Algorithms for LLM Reasoning", arXiv 2505.17508; Tang & Munos
    2025, arXiv 2506.09477, section 3). So the term is ``stopgrad(w * G_t) * log pi(y_t)``, with
    the value ``k1_t`` put back (straight-through: ``k1_t + w G_t (log pi - stopgrad log pi)``).

    Off-policy (samples of pi_old, PPO's later epochs and minibatches), ``w`` is the importance
    weight of the **whole sequence**, ``rho(y) = prod_t pi(y_t | y_<t) / pi_old(y_t | y_<t)``
    (detached), since ``G_t`` depends on the tokens after t: ``E_old[rho * ...] = E_pi[...]``
    exactly. A per-token ratio would reweight only position t and leave the prefix and the
    suffix drawn from pi_old: not the gradient at theta. ``rho = 1`` on-policy. No clamp: ``rho``
    is within a few percent of 1 inside PPO's trust region, and a clamp would bias it.

    Args:
        logprobs: (B, R) log pi_theta of the taken tokens, with grad; finite on valid tokens.
        ref_logprobs: (B, R) log pi_ref, no grad.
        response_mask: (B, R) bool; the KL of masked tokens never counts.
        old_logprobs: (B, R) log pi_old of the tokens, or None (on-policy, ``rho = 1``).

    Returns:
        (B, R): the terms (zero on masked tokens). Summed over a sequence and averaged over
        sequences, their gradient estimates ``grad KL``; averaged over tokens (the trainers'
        ``masked_mean``), ``grad KL`` divided by the mean response length, as the policy loss is.
    """
    mask = response_mask.bool()
    lp = torch.where(mask, logprobs, 0.0)
    k1 = torch.where(mask, lp - ref_logprobs.detach(), 0.0).detach()  # (B, R)
    to_come = k1.flip(-1).cumsum(-1).flip(-1)  # G_t = sum_{t' >= t} k1_t'
    weight = to_come
    if old_logprobs is not None:
        log_rho = torch.where(mask, lp.detach() - old_logprobs.detach(), 0.0).sum(-1, keepdim=True)
        weight = torch.exp(log_rho) * to_come
    return k1 + weight * (lp - lp.detach())


def _k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.pow(2)


def _k3_plus(
    logprobs: Tensor, ref_logprobs: Tensor, old_logprobs: Tensor | None, mask: Tensor | None
) -> Tensor:
    """k3's value (unbiased, >= 0, what is logged) with k2's gradient (straight-through)."""
    lr = logprobs - ref_logprobs.detach()
    return _k2(lr) + (_k3(lr) - _k2(lr)).detach()


def _k3_is(
    logprobs: Tensor, ref_logprobs: Tensor, old_logprobs: Tensor | None, mask: Tensor | None
) -> Tensor:
    """``rho * k3`` with ``rho = pi / pi_old``, and its exact gradient ``rho * k1 * grad log pi``.

    Analytically ``d/dlog pi [rho k3] = rho k3 + rho (1 - pi_ref / pi) = rho (log pi - log pi_ref)``
    = ``rho * k1``: k2's gradient, importance-weighted. It is written so (straight-through: value
    ``rho k3``, gradient ``rho k1``), not left to autograd, which adds two terms of size
    ``exp(r)`` (``r = log pi_ref - log pi``) that cancel: float32 loses the gradient for r above
    ~16 nats, and past k3's clamp (r > 20, whose clamped ``exp`` has no gradient) what is left is
    ``+rho (e^20 - 21)``, the wrong sign (docs/kl.md, "Clamps and epsilons"). ``rho``'s exponent
    is clamped from above at ``K3_LOG_RATIO_CLAMP`` as k3's (a weight of at most e^20); ``k1`` is
    the raw log-ratio, so the gradient is ``rho * k1`` at any ``r``. On-policy (``logprobs ==
    old_logprobs``) ``rho`` is 1.0 exactly and the gradient is k3+'s, bit for bit.
    """
    if old_logprobs is None:
        raise ValueError("kl.loss_estimator=k3_is needs old_logprobs (the sampling policy)")
    log_ratio = logprobs - ref_logprobs.detach()
    rho = torch.exp((logprobs.detach() - old_logprobs.detach()).clamp(max=K3_LOG_RATIO_CLAMP))
    value = rho * _k3(log_ratio.detach())
    return value + (rho * log_ratio.detach()) * (logprobs - logprobs.detach())


def _k1_seq(
    logprobs: Tensor, ref_logprobs: Tensor, old_logprobs: Tensor | None, mask: Tensor | None
) -> Tensor:
    if mask is None:
        raise ValueError("kl.loss_estimator=k1_seq needs the response_mask (the KL still to come)")
    return k1_seq_terms(logprobs, ref_logprobs, mask, old_logprobs)


OFF_POLICY_BIAS = (
    " Exact on-policy only: on samples of an older policy (the update's later minibatches and "
    'epochs) its gradient lacks the weight pi / pi_old (docs/kl.md, "The KL in the loss off-policy").'
)
register_estimator(
    Estimator(
        "k3+",
        mean_is_kl=True,
        loss=Standing(
            True, f"k3's value with k2's gradient, grad KL on-policy ({TANG_MUNOS}).{OFF_POLICY_BIAS}"
        ),
        loss_terms=_k3_plus,
    )
)
register_estimator(
    Estimator(
        "k3_is",
        mean_is_kl=True,
        loss=Standing(
            True,
            "(pi / pi_old) * k3: its expectation under pi_old is KL(pi || pi_ref) for every theta, so its "
            "gradient is exact on- and off-policy (TRL's use_bias_correction_kl)",
        ),
        loss_terms=_k3_is,
        off_policy=True,
    )
)
register_estimator(
    Estimator(
        "k1_seq",
        mean_is_kl=True,
        loss=Standing(
            True,
            "the score function with the KL still to come, weighted by the sequence's importance ratio: "
            "the gradient of the sequence KL (Zhang et al. 2025, arXiv 2505.17508)",
        ),
        loss_terms=_k1_seq,
        off_policy=True,
    )
)


class DPOLoss(NamedTuple):
    loss: Tensor
    """scalar: mean over pairs of -log sigmoid(beta * margin)."""
    chosen_rewards: Tensor
    """(N,) implicit rewards beta * (log pi(y_w) - log pi_ref(y_w)), nats times beta."""
    rejected_rewards: Tensor
    """(N,) beta * (log pi(y_l) - log pi_ref(y_l))."""
    margin: Tensor
    """scalar: mean of chosen_rewards - rejected_rewards."""
    accuracy: Tensor
    """scalar: fraction of pairs with chosen_rewards > rejected_rewards."""


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
) -> DPOLoss:
    """DPO loss (Rafailov et al. 2023, arXiv 2305.18290, eq. 7).

    ``L = -log sigmoid(beta * [(log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))])``
    with sequence log-probabilities (sums over each response's ``response_mask``). beta plays
    the role of the KL coefficient of the objective whose optimum DPO fits.

    Args:
        chosen_logps, rejected_logps: (N,) policy sequence log-probs, nats, with grad.
        ref_chosen_logps, ref_rejected_logps: (N,) reference sequence log-probs, nats.
        beta: > 0.

    Returns:
        :class:`DPOLoss`.
    """
    chosen = beta * (chosen_logps - ref_chosen_logps.detach())
    rejected = beta * (rejected_logps - ref_rejected_logps.detach())
    logits = chosen - rejected
    loss = -torch.nn.functional.logsigmoid(logits).mean()
    with torch.no_grad():
        margin = logits.mean()
        accuracy = (logits > 0).float().mean()
    return DPOLoss(loss, chosen.detach(), rejected.detach(), margin, accuracy)
