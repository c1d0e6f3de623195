"""GRPO and RLOO: G completions per prompt, a baseline from the group, no value head.

* GRPO (Shao et al. 2024, arXiv 2402.03300): group-normalized outcome advantages
  ``(r - mean_g) / (std_g + eps)``, clipped surrogate, KL in the loss by default
  (``k3_is``: k3 times pi / pi_old, the reverse KL's gradient on every minibatch; see docs/kl.md).
* RLOO (Ahmadian et al. 2024, arXiv 2402.14740): leave-one-out baseline over the k completions,
  KL in the reward by default: each sequence's reward is ``score - kl_coef * sum_t k1_t``.

The step is :class:`tether.trainers.base.OnPolicyTrainer`'s. Advantages are per sequence and
broadcast to every valid token; the loss is a token-level mean over ``response_mask``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tether.core import distributed as D
from tether.core.advantages import group_all_equal, group_std
from tether.core.masked import masked_sum
from tether.trainers.base import OnPolicyTrainer
from tether.trainers.steps import Experience, clipped_policy_loss
from tether.trainers.update import MicroLoss


class GroupTrainer(OnPolicyTrainer):
    """Shared by GRPO and RLOO; a subclass's ``name`` chooses the advantage of step 6
    (:data:`tether.trainers.steps.ADVANTAGES`)."""

    def extra_metrics(self, exp: Experience, kl_coef: float) -> dict:
        """The groups whose scores are all equal (they carry no ranking: advantage 0), as shares of
        the step's groups over every process: ``rollout/groups_all_equal``, and where every score
        is 0 or 1 (a verifiable reward), ``rollout/groups_all_best`` (all 1) and
        ``rollout/groups_all_worst`` (all 0)."""
        return group_metrics(exp.scores, self.group_size, scored=exp.scored)

    def minibatch_loss(self, mb: Experience, kl_coef: float, first_micro: bool = True) -> MicroLoss:
        new = self.policy_forward(mb)  # (B, R) log-probs, with grad
        return clipped_policy_loss(
            mb,
            new.logprobs,
            clip=self.clip,
            leash=self.leash,
            kl_coef=kl_coef,
            first_micro=first_micro,
            **self.divergence_inputs(mb, new),
        )


def group_metrics(scores: Tensor, group_size: int, scored: Tensor | None = None) -> dict:
    """Shares of the batch's groups (all processes) whose scores are all equal, all 1 and all 0
    (the last two only when every score is 0 or 1). ``scores``: (B,) this process's, whole
    groups of ``group_size`` consecutive rows; ``scored``: (B,) bool, False on an unscored
    sample (its NaN left out: a group is all-equal over its scored samples, as its advantages
    are; one with none scored is neither all 1 nor all 0), or None (all scored)."""
    equal = group_all_equal(scores, group_size, scored)  # (B,): each row flags its group; groups weigh alike
    out = {"rollout/groups_all_equal": D.sequence_mean(equal.float())}
    if scored is None:
        value = scores  # an all-equal group's value, on each of its rows
        binary = D.all_reduce_min(((scores == 0) | (scores == 1)).all().float())
    else:
        s = scored.view(-1, group_size)
        value = torch.where(s, scores.view(-1, group_size), -torch.inf).amax(-1, keepdim=True)
        value = value.expand_as(s).reshape(-1)  # (B,) the group's largest scored value
        binary = D.all_reduce_min(((scores == 0) | (scores == 1) | ~scored).all().float())
    if binary > 0:
        out["rollout/groups_all_best"] = D.sequence_mean((equal & (value == 1)).float())
        out["rollout/groups_all_worst"] = D.sequence_mean((equal & (value == 0)).float())
    return out


class GRPOTrainer(GroupTrainer):
    name = "grpo"

    @property
    def beta_in_reward_std(self) -> bool:
        """The std scaling divides the advantages but not the KL term: beta then counts in group
        reward standard deviations, not reward units (docs/kl.md)."""
        g = self.cfg.grpo
        return self.leash.kl_in_loss and g.scale_by_std and not g.scale_kl_by_std and self.group_size > 1

    def extra_metrics(self, exp: Experience, kl_coef: float) -> dict:
        """The group shares (:meth:`GroupTrainer.extra_metrics`), and ``objective/kl_coef_effective``:
        beta x the batch's mean group reward std (reward units per nat), the exchange rate GRPO
        optimizes while the std divides the advantages only."""
        out = super().extra_metrics(exp, kl_coef)
        if not self.beta_in_reward_std:
            return out
        seq_rewards = masked_sum(exp.rewards, exp.mask, dim=-1)  # (B,)
        std = group_std(seq_rewards, self.group_size, scored=exp.scored)
        return out | {"objective/kl_coef_effective": kl_coef * D.sequence_mean(std)}


class RLOOTrainer(GroupTrainer):
    name = "rloo"
