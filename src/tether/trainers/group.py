"""GRPO and RLOO: G completions per prompt, a baseline from the group, no value head.

* GRPO (Shao et al. 2024, arXiv 2402.03300): group-normalized outcome advantages
  ``(r - mean_g) / (std_g + eps)``, clipped surrogate, KL in the loss by default
  (``k3+``: k3's value, k2's gradient; see docs/kl.md).
* RLOO (Ahmadian et al. 2024, arXiv 2402.14740): leave-one-out baseline over the k completions,
  KL in the reward by default: each sequence's reward is ``score - kl_coef * sum_t k1_t``.

The step is :class:`tether.trainers.base.OnPolicyTrainer`'s. Advantages are per sequence and
broadcast to every valid token; the loss is a token-level mean over ``response_mask``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tether.core.advantages import group_normalized_advantages, rloo_advantages
from tether.core.kl import masked_sum
from tether.core.losses import ppo_policy_loss
from tether.models.sampling import Rollout
from tether.trainers.base import Experience, OnPolicyTrainer
from tether.trainers.common import ScoredBatch


class GroupTrainer(OnPolicyTrainer):
    """Shared by GRPO and RLOO; subclasses choose the sequence advantage."""

    def sequence_advantages(self, sequence_rewards: Tensor) -> Tensor:
        raise NotImplementedError

    def advantages(self, rewards: Tensor, scored: ScoredBatch, mask: Tensor) -> tuple[Tensor, None]:
        seq_rewards = masked_sum(rewards, mask, dim=-1)  # (B,) score (- beta * KL if in the reward)
        adv = self.sequence_advantages(seq_rewards)  # (B,)
        return torch.where(mask, adv[:, None], 0.0), None  # (B, R)

    def minibatch_loss(
        self, exp: Experience, idx: Tensor, part: Rollout, kl_coef: float
    ) -> tuple[Tensor, dict]:
        c, mask = self.cfg, part.response_mask
        logprobs = self.policy_logprobs(part)  # (B, R), with grad
        pl = ppo_policy_loss(logprobs, exp.old_logprobs[idx], exp.advantages[idx], mask, c.ppo.clip_eps)
        stats = {
            "policy/loss": pl.loss,
            "policy/clipfrac": pl.clipfrac,
            "policy/approx_kl": pl.approx_kl,
            "_ratio_dev": torch.where(mask, (pl.ratio - 1).abs(), 0.0).max(),
        }
        return self.add_kl_loss(pl.loss, stats, logprobs, exp, idx, mask, kl_coef), stats


class GRPOTrainer(GroupTrainer):
    name = "grpo"

    def sequence_advantages(self, sequence_rewards: Tensor) -> Tensor:
        return group_normalized_advantages(sequence_rewards, self.group_size, self.cfg.grpo.scale_by_std)


class RLOOTrainer(GroupTrainer):
    name = "rloo"

    def sequence_advantages(self, sequence_rewards: Tensor) -> Tensor:
        return rloo_advantages(sequence_rewards, self.group_size)
