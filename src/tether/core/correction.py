"""Importance weights for a sampler that is not the learner (``rollout.correction``). Torch only.

A run whose rollouts decode on a low-precision copy of the policy (``rollout.dtype=bf16``) draws
its tokens from the sampler's distribution ``q``, not from the learner's ``pi_old`` (the same
weights in the learner's precision, which rescores every sampled token). The policy gradient
and the KL-in-loss gradient are expectations under ``pi_old``; on samples of ``q`` each term is
exact again when weighted by ``rho = pi_old / q`` (importance sampling). The sign convention:
``log rho_t = old_logprobs_t - sampler_logprobs_t``, learner over sampler, in nats.

Three corrections (:data:`CORRECTIONS`), as TRL 1.16 (``vllm_importance_sampling_mode``), verl
and "Your efficient RL framework secretly brings you off-policy RL training" (Yao et al. 2025)
define them:

* ``tis``, token-level truncated IS: ``w_t = min(rho_t, cap)`` on every policy token (TRL's
  ``token_truncate`` with ``clip_min`` None). It corrects which token is drawn at each position,
  not the prefixes (states) the sampler led to: the fixed point of a per-state tabular update is
  still exact where the advantage is (docs/kl.md, "A sampler that is not the learner").
* ``mis``, sequence-level masked IS: ``rho = prod_t rho_t`` over the sequence's policy tokens,
  ``w_t = rho`` on each of them where ``1 / cap <= rho <= cap``, else 0: the sequence is dropped
  (TRL's ``sequence_mask`` with ``clip_min = 1 / cap``). Inside the band the weight is the whole
  trajectory's likelihood ratio, so the gradient is exact in expectation (prefixes included);
  outside it the sequence leaves the update.
* ``none``: weight 1 (the sampler's samples taken as the learner's: biased by the mismatch).

Each is a weight per token, detached, that multiplies the token's policy-gradient term and its
KL-in-loss term (:func:`tether.core.losses.ppo_policy_loss`, :meth:`tether.core.leash.KLLeash.loss`).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, get_args

import torch
from torch import Tensor

Correction = Literal["tis", "mis", "none"]
"""The corrections of ``rollout.correction``."""

CORRECTIONS: tuple[str, ...] = get_args(Correction)


class CorrectionWeights(NamedTuple):
    """Output of :func:`correction_weights`; tensors (B, R)."""

    weights: Tensor
    """float32 (float64 for float64 input), >= 0: each token's weight, 0 off ``response_mask``."""
    departed: Tensor
    """bool: the policy tokens where the weight is not the exact ratio ``rho_t`` (``tis``: truncated
    at the cap; ``mis``: in a sequence outside the band), or for ``none`` where ``rho_t`` leaves
    ``[1 / cap, cap]`` (each token's own ratio, as ``tis`` reads it; ``mis``'s band is on the
    sequence's product, which many tokens near 1 can leave): ``rollout/is_clipped_fraction``."""
    log_ratio: Tensor
    """``old_logprobs - sampler_logprobs`` on the policy's tokens, 0 elsewhere, nats."""
    per_sequence: bool = False
    """The weight is the whole response's (``mis``): it also corrects the prefixes, so it applies to
    a term that depends on no token drawn at its position (an exact divergence over the
    vocabulary at a prefix), which a token's own ratio (``tis``) does not correct."""


def correction_weights(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    response_mask: Tensor,
    *,
    correction: str,
    cap: float,
) -> CorrectionWeights:
    """The importance weight of every sampled token, learner over sampler, truncated or masked.

    ``log rho_t = old_logprobs_t - sampler_logprobs_t``;
    ``tis``: ``w_t = min(exp(log rho_t), cap)``; ``mis``: ``s = sum_t log rho_t`` over the row's
    policy tokens, ``w_t = exp(s)`` where ``|s| <= log(cap)``, else 0; ``none``: ``w_t = 1``.
    No epsilon: the ratio is taken in log space, and ``exp`` of a log-ratio above ``log(cap)`` is
    never formed for ``tis`` (``min`` in log space: a ratio of ``e^1000`` is ``cap``, not inf) nor
    kept for ``mis`` (its sequence is outside the band). Sources: Ionides 2008 (truncated IS);
    TRL 1.16 ``GRPOTrainer`` (``vllm_importance_sampling_mode``); Yao et al. 2025.

    Args:
        old_logprobs: (B, R) log pi_old of the sampled tokens, the learner's, nats.
        sampler_logprobs: (B, R) log q of the same tokens under the distribution they were drawn
            from, nats.
        response_mask: (B, R) bool, True on the policy's tokens (environment tokens, padding and
            post-EOS slots are False: they get weight 0 and enter no ratio).
        correction: ``tis``, ``mis`` or ``none`` (:data:`CORRECTIONS`).
        cap: ``C > 1``: the truncation of ``tis`` and the band ``[1 / C, C]`` of ``mis``.

    Returns:
        :class:`CorrectionWeights`.

    Raises:
        ValueError: an unknown correction, ``cap <= 1`` or not finite, a shape mismatch, or a
            non-finite log-prob on a policy token (NaN, or -inf: a token the sampler could not
            have drawn).
    """
    if correction not in CORRECTIONS:
        raise ValueError(f"unknown correction {correction!r}; choose one of {CORRECTIONS}")
    if not (math.isfinite(cap) and cap > 1):
        raise ValueError(f"the correction's cap must be finite and > 1, got {cap}")
    if old_logprobs.shape != sampler_logprobs.shape or old_logprobs.shape != response_mask.shape:
        raise ValueError(
            f"old_logprobs {tuple(old_logprobs.shape)}, sampler_logprobs {tuple(sampler_logprobs.shape)} "
            f"and response_mask {tuple(response_mask.shape)} must have one shape"
        )
    mask = response_mask.bool()
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    old, sampler = old_logprobs.to(dtype), sampler_logprobs.to(dtype)
    if not bool(torch.isfinite(torch.where(mask, old - sampler, 0.0)).all()):
        raise ValueError("a policy token's learner or sampler log-prob is not finite (NaN or -inf)")
    log_ratio = torch.where(mask, old - sampler, 0.0)  # (B, R)
    log_cap = math.log(cap)
    if correction == "tis":
        weights = torch.exp(log_ratio.clamp(max=log_cap))  # min(rho, C), taken before exp
        departed = mask & (log_ratio > log_cap)
    elif correction == "mis":
        s = log_ratio.sum(-1, keepdim=True)  # (B, 1) log of the sequence's ratio
        inside = s.abs() <= log_cap  # (B, 1)
        weights = torch.where(inside, torch.exp(s.clamp(-log_cap, log_cap)), 0.0).expand_as(log_ratio)
        departed = mask & ~inside
    else:
        weights = torch.ones_like(log_ratio)
        departed = mask & (log_ratio.abs() > log_cap)
    return CorrectionWeights(torch.where(mask, weights, 0.0), departed, log_ratio, correction == "mis")
