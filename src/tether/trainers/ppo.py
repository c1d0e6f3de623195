"""PPO with the KL leash in the reward (Ziegler et al. 2019; Stiennon et al. 2020).

The step is :class:`tether.trainers.base.OnPolicyTrainer`'s; PPO adds a value head, GAE
advantages (step 6, :data:`tether.trainers.steps.ADVANTAGES`) and the clipped surrogate plus
clipped value loss (step 7). Sources:
Schulman et al. 2017 (arXiv 1707.06347), Schulman et al. 2016 (GAE, arXiv 1506.02438).
"""

from __future__ import annotations

from tether.core import distributed as D
from tether.trainers.base import OnPolicyTrainer
from tether.trainers.common import RolloutLogprobs
from tether.trainers.steps import Experience, clipped_policy_loss
from tether.trainers.update import MicroLoss, UpdateStats


class PPOTrainer(OnPolicyTrainer):
    uses_values = True
    name = "ppo"

    def minibatch_loss(self, mb: Experience, kl_coef: float, first_micro: bool = True) -> MicroLoss:
        new = self.update_forward(mb)  # log-probs and values, with grad
        return clipped_policy_loss(
            mb,
            new.logprobs,
            clip=self.clip,
            leash=self.leash,
            kl_coef=kl_coef,
            first_micro=first_micro,
            values=new.values,
            **self.divergence_inputs(mb, new),
        )

    def metrics(
        self, step: int, exp: Experience, forwards: RolloutLogprobs, update: UpdateStats, kl_coef: float
    ) -> dict:
        """The shared metrics plus the value head's: its mean prediction and how much of the
        returns' variance it explains (both at rollout time, before this step's update, in the
        units of the scaled rewards), and the number the rewards were divided by
        (``value/return_scale``, reward units; 1 without ppo.scale_returns)."""
        row = super().metrics(step, exp, forwards, update, kl_coef)
        mask = exp.rollout.response_mask
        row["value/mean"] = D.token_mean(exp.values, mask)
        row["value/explained_variance"] = D.explained_variance(exp.values, exp.returns, mask)
        row["value/return_scale"] = float(exp.return_scale)
        return row
