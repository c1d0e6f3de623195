"""PPO with the KL leash in the reward (Ziegler et al. 2019; Stiennon et al. 2020).

The step is :class:`tether.trainers.base.OnPolicyTrainer`'s; PPO adds a value head, GAE
advantages (step 6) and the clipped surrogate plus clipped value loss (step 7). Sources:
Schulman et al. 2017 (arXiv 1707.06347), Schulman et al. 2016 (GAE, arXiv 1506.02438).
"""

from __future__ import annotations

import torch
from torch import Tensor

from tether.core import distributed as D
from tether.core.advantages import gae
from tether.core.losses import clipped_value_loss, ppo_policy_loss
from tether.models.sampling import Rollout
from tether.models.scoring import score_logprobs
from tether.trainers.base import Experience, OnPolicyTrainer
from tether.trainers.common import ScoredBatch


class PPOTrainer(OnPolicyTrainer):
    uses_values = True
    name = "ppo"

    def advantages(self, rewards: Tensor, scored: ScoredBatch, mask: Tensor) -> tuple[Tensor, Tensor]:
        p = self.cfg.ppo
        out = gae(rewards, scored.values, mask, p.gamma, p.gae_lambda)
        adv = D.whiten(out.advantages, mask) if p.whiten_advantages else out.advantages
        return adv, out.returns

    def minibatch_loss(
        self, exp: Experience, idx: Tensor, part: Rollout, kl_coef: float
    ) -> tuple[Tensor, dict]:
        c, mask = self.cfg, part.response_mask
        new = score_logprobs(self.model, part, c.rollout.temperature, with_values=True)
        pl = ppo_policy_loss(new.logprobs, exp.old_logprobs[idx], exp.advantages[idx], mask, c.ppo.clip_eps)
        vl = clipped_value_loss(new.values, exp.values[idx], exp.returns[idx], mask, c.ppo.clip_eps_value)
        stats = {
            "policy/loss": pl.loss,
            "policy/clipfrac": pl.clipfrac,
            "policy/approx_kl": pl.approx_kl,
            "value/loss": vl.loss,
            "value/clipfrac": vl.clipfrac,
            "_ratio_dev": torch.where(mask, (pl.ratio - 1).abs(), 0.0).max(),
        }
        loss = self.add_kl_loss(
            pl.loss + c.ppo.vf_coef * vl.loss, stats, new.logprobs, exp, idx, mask, kl_coef
        )
        return loss, stats

    def metrics(self, step: int, exp: Experience, scored: ScoredBatch, update: dict, kl_coef: float) -> dict:
        """The shared metrics plus the value head's: its mean prediction and how much of the
        returns' variance it explains (both at rollout time, before this step's update)."""
        row = super().metrics(step, exp, scored, update, kl_coef)
        mask = exp.rollout.response_mask
        row["value/mean"] = D.token_mean(exp.values, mask)
        row["value/explained_variance"] = D.explained_variance(exp.values, exp.returns, mask)
        return row
