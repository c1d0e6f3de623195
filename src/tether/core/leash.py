"""The KL leash applied where the placement says, exactly once per step, and counted.

Torch and tether's math modules only; takes tensors, scalars and two booleans, never a config.
Trainers call :meth:`KLLeash.reward` once per rollout batch and :meth:`KLLeash.loss` once per
minibatch; ``counts`` records how often each placement actually entered the objective, so a test
can prove that the KL is counted once (and a run with both off never touches it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tether.core.divergences import LEASH_DIVERGENCES, leash_divergence
from tether.core.losses import KLLossEstimator, kl_loss_terms
from tether.core.masked import masked_mean
from tether.core.shaping import ShapedRewards, shape_rewards, shape_rewards_exact


class KLLeash:
    """Applies ``-kl_coef * kl`` in the reward and/or ``kl_coef * KL surrogate`` in the loss.

    Args:
        kl_in_reward: shape per-token rewards with the KL (PPO, RLOO).
        kl_in_loss: add the KL surrogate to the loss (GRPO).
        loss_estimator: surrogate for the loss placement (see :func:`tether.core.losses.kl_loss_terms`).
        reward_form: ``"sampled"`` (:func:`tether.core.shaping.shape_rewards`, the estimate on
            every token) or ``"exact"`` (:func:`tether.core.shaping.shape_rewards_exact`, the exact
            per-position KL in the returns and each token's own correction; per-token advantages
            only, PPO's ``ppo.kl_shaping``).
        divergence: what the loss term holds (``kl.divergence``): ``"reverse_kl"`` through
            ``loss_estimator`` on the sampled tokens, or ``"forward_kl"``, ``"js"``, ``"alpha"``
            exactly over the vocabulary at each sampled position
            (:func:`tether.core.divergences.leash_divergence`; needs the logits). In the loss only:
            in the reward a per-sample penalty's policy gradient is the reverse KL's alone
            (docs/kl.md, "The leash's divergence").
        temperature, alpha: the sampling temperature both sides are tempered by, and the order
            of ``"alpha"``, for a divergence other than the reverse KL.

    Raises:
        ValueError: an unknown ``reward_form`` or ``divergence``, or a divergence other than the
            reverse KL in the reward.
    """

    def __init__(
        self,
        kl_in_reward: bool,
        kl_in_loss: bool,
        loss_estimator: KLLossEstimator = "k3_is",
        reward_form: str = "sampled",
        *,
        divergence: str = "reverse_kl",
        temperature: float = 1.0,
        alpha: float = 0.5,
    ):
        if reward_form not in ("sampled", "exact"):
            raise ValueError(f"reward_form must be 'sampled' or 'exact', got {reward_form!r}")
        if divergence not in LEASH_DIVERGENCES:
            raise ValueError(f"unknown divergence {divergence!r}; choose one of {LEASH_DIVERGENCES}")
        if divergence != "reverse_kl" and kl_in_reward:
            raise ValueError(
                f"kl.divergence={divergence} is a loss term: in the reward only the reverse KL's per-sample "
                "penalty has the right policy gradient; set kl.kl_in_reward=false and kl.kl_in_loss=true"
            )
        self.divergence, self.temperature, self.alpha = divergence, temperature, alpha
        self.kl_in_reward = kl_in_reward
        self.kl_in_loss = kl_in_loss
        self.loss_estimator = loss_estimator
        self.reward_form = reward_form
        self.counts = {"reward": 0, "loss": 0}

    def reward(
        self,
        scores: Tensor,
        kl: Tensor | None,
        kl_coef: float,
        response_mask: Tensor,
        log_ratio: Tensor | None = None,
        *,
        exact_kl: Tensor | None = None,
    ) -> ShapedRewards:
        """Per-token rewards: the score on the last real token, plus the KL term if in the reward:
        ``-kl_coef * kl_t`` (sampled form) or ``-kl_coef * exact_kl_t`` with each token's own
        correction (exact form).

        Args:
            scores: (B,) scorer values.
            kl: (B, R) per-token KL estimate (nats), or None when no reference runs (then no KL
                term in either form).
            kl_coef: beta >= 0.
            response_mask: (B, R) bool.
            log_ratio, exact_kl: (B, R) k1 of the sampled tokens and the exact per-position KL,
                nats; the exact reward form needs both.

        Returns:
            :class:`tether.core.shaping.ShapedRewards`, (B, R) each.

        Raises:
            ValueError: the exact form without ``log_ratio`` or ``exact_kl``.
        """
        if self.kl_in_reward and kl is not None:
            self.counts["reward"] += 1
            if self.reward_form == "exact":
                if log_ratio is None or exact_kl is None:
                    raise ValueError(
                        "the exact reward form (ppo.kl_shaping=exact) needs the exact per-position KL: "
                        "set kl.exact=true, or ppo.kl_shaping=sampled"
                    )
                return shape_rewards_exact(scores, log_ratio, exact_kl, kl_coef, response_mask)
            return shape_rewards(scores, kl, kl_coef, response_mask)
        zeros = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
        return shape_rewards(scores, zeros, 0.0, response_mask)

    def loss(
        self,
        logprobs: Tensor,
        ref_logprobs: Tensor | None,
        kl_coef: float,
        response_mask: Tensor,
        old_logprobs: Tensor | None = None,
        *,
        count: bool = True,
        row_weights: Tensor | None = None,
        logits: Tensor | None = None,
        ref_logits: Tensor | None = None,
        token_weights: Tensor | None = None,
    ) -> Tensor | None:
        """``kl_coef * masked_mean(surrogate)`` to add to the loss, or None if not in the loss.

        None (not a zero tensor) when the placement is off or ``kl_coef`` is 0, so the loss of a
        run without the term is bit-identical to the pure policy-gradient loss. ``count``: add
        one to ``counts["loss"]`` (once per gradient step: false for the micro-batches after the
        first of a minibatch, which are parts of the same term). ``row_weights`` (B,): a weight per
        row of its terms (GRPO's ``grpo.scale_kl_by_std``), else 1. ``logits`` (B, R, V) with
        grad and ``ref_logits`` (B, R, V): the policy's and the reference's at the positions, for a
        divergence other than the reverse KL (its per-position value at those states, exact).
        ``token_weights`` (B, R), no grad: a sampler's importance weights
        (:func:`tether.core.correction.correction_weights`), each term multiplied by its own;
        None = 1. The KL stays the learner's: only which samples it is averaged over changes.

        Raises:
            ValueError: a divergence other than the reverse KL without the logits.
        """
        if not self.kl_in_loss or kl_coef == 0 or ref_logprobs is None:
            return None
        self.counts["loss"] += int(count)
        mask = response_mask.bool()
        if self.divergence != "reverse_kl":
            if logits is None or ref_logits is None:
                raise ValueError(
                    f"kl.divergence={self.divergence} needs the policy's and the reference's logits"
                )
            terms = leash_divergence(
                self.divergence, logits, ref_logits, temperature=self.temperature, alpha=self.alpha
            )
            terms = torch.where(mask, terms, 0.0)  # padding's logits are not the policy's choices
            return kl_coef * masked_mean(_weighted(terms, row_weights, token_weights), response_mask)
        # masked slots may hold -inf/NaN; neutral values there keep them out of every gradient
        logprobs = torch.where(mask, logprobs, 0.0)
        ref_logprobs = torch.where(mask, ref_logprobs, 0.0)
        old_logprobs = torch.where(mask, old_logprobs, 0.0) if old_logprobs is not None else None
        terms = kl_loss_terms(logprobs, ref_logprobs, self.loss_estimator, old_logprobs, mask)
        return kl_coef * masked_mean(_weighted(terms, row_weights, token_weights), response_mask)


def _weighted(terms: Tensor, row_weights: Tensor | None, token_weights: Tensor | None) -> Tensor:
    """``terms`` (B, R) times a weight per row (B,) and per token (B, R), each None = 1."""
    if row_weights is not None:
        terms = terms * row_weights.to(terms.dtype)[:, None]
    if token_weights is not None:
        terms = terms * token_weights.detach().to(terms.dtype)
    return terms
