"""The math of a trainer's step as pure functions: tensors and scalars in, tensors out.

Torch and :mod:`tether.core` only (no models, no config objects). The trainers call these
functions with their models' log-probabilities, and the tabular test bed
(:mod:`tether.testing.testbed`) calls the very same ones with its logit tables', so its
exact-optimum tests check the code that trains:

* :class:`StepSettings` and :class:`ClipSettings`, the per-run constants of steps 5 to 10, built
  by name;
* step 5, :func:`kl_reading` (:func:`controller_input` of a record): the one number the KL
  controller reads, before the update (step 6 sets beta from it);
* :func:`make_experience`, steps 7 and 8 in one call: :class:`Experience`, the record of one
  rollout batch from scoring to update (and its :meth:`Experience.select`);
* step 7, :func:`kl_and_rewards`: the per-token KL estimate and the leashed rewards;
* step 8, :data:`ADVANTAGES`, one signature per algorithm over :func:`ppo_advantages` (GAE),
  :func:`grpo_advantages` and :func:`rloo_token_advantages`;
* step 9, the minibatch losses: :func:`clipped_policy_loss` (PPO, GRPO, RLOO) and
  :func:`dpo_pair_loss` (DPO);
* step 10, :func:`updated_kl`: the update guard's measure of an updated policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

import torch
from torch import Tensor

from tether.core import distributed as D
from tether.core.advantages import (
    GROUP_STD_EPS,
    gae,
    group_all_equal,
    group_normalized_advantages,
    group_std,
    return_scale,
    rloo_advantages,
)
from tether.core.correction import CorrectionWeights, correction_weights
from tether.core.kl import estimate_kl, kl_k1, sequence_kl
from tether.core.leash import KLLeash
from tether.core.losses import clipped_value_loss, dpo_loss, ppo_policy_loss
from tether.core.masked import at_least_fp32, masked_sum
from tether.trainers.update import MicroLoss


class Samples(Protocol):
    """The sampled sequences of a batch: a :class:`tether.models.sampling.Rollout` in the trainers,
    the test bed's token table in :mod:`tether.testing.testbed`."""

    response_mask: Tensor
    """(B, R) bool, True on the tokens that count."""

    def select(self, idx: Tensor) -> Samples: ...


def _rows(t: Tensor | None, idx: Tensor) -> Tensor | None:
    """Rows ``idx`` of a per-row tensor, or None."""
    return t[idx] if t is not None else None


class Forwards(NamedTuple):
    """Step 4's per-token numbers of a rollout batch, what steps 5 to 7 read; each (B, R), log-probs
    and KL in nats, values in reward units.

    The trainers take them from their no-grad forwards
    (:meth:`tether.trainers.common.RolloutLogprobs.step_forwards`), the test bed from its tables.
    """

    old_logprobs: Tensor
    """log pi_old(y_t | ...) of the sampled tokens, no grad."""
    ref_logprobs: Tensor | None = None
    """log pi_ref(y_t | ...); None without a reference model (no KL)."""
    values: Tensor | None = None
    """the value head's predictions at rollout time (PPO), else None."""
    exact_kl: Tensor | None = None
    """exact full-vocabulary KL(pi_old(.|s_t) || pi_ref(.|s_t)) at each sampled position, or None
    when not computed (``kl.exact=false``)."""
    reused_logprobs: Tensor | None = None
    """log-probs of the rollout under the current policy, with grad: step 4's forward, kept for
    step 7's only update (``optim.reuse_forward``), or None."""
    ref_logits: Tensor | None = None
    """(B, R, V) the reference's logits at the response positions, for a leash holding another
    divergence than the reverse KL (``kl.divergence``), else None."""
    sampler_logprobs: Tensor | None = None
    """log q(y_t | ...) of the sampled tokens under the sampler's distribution, where the sampler is
    not the learner (``rollout.dtype=bf16``), else None: the tokens are then the learner's own."""
    correction: CorrectionWeights | None = None
    """The sampler's importance weights (:func:`tether.core.correction.correction_weights`), set by
    :func:`make_experience` from ``sampler_logprobs``; None without them."""

    def select(self, idx: Tensor) -> Forwards:
        """Rows ``idx`` ((n,) long) of every tensor."""
        return Forwards(
            old_logprobs=self.old_logprobs[idx],
            ref_logprobs=_rows(self.ref_logprobs, idx),
            values=_rows(self.values, idx),
            exact_kl=_rows(self.exact_kl, idx),
            reused_logprobs=_rows(self.reused_logprobs, idx),
            ref_logits=_rows(self.ref_logits, idx),
            sampler_logprobs=_rows(self.sampler_logprobs, idx),
            correction=self.correction._replace(
                weights=self.correction.weights[idx],
                departed=self.correction.departed[idx],
                log_ratio=self.correction.log_ratio[idx],
            )
            if self.correction
            else None,
        )


class Experience(NamedTuple):
    """A scored rollout batch, from step 4 to the update epochs: the rollout, its scores and the
    record of each step (:class:`Forwards`, :class:`KLRewards`, :class:`Advantages`); tensors
    (B, R) unless noted.

    Minibatch code takes its rows once, ``mb = exp.select(idx)``, and reads ``mb.old_logprobs``,
    ``mb.advantages``, ... (every per-row tensor, by its name, and the rollout restricted to those
    rows).
    """

    rollout: Samples
    scores: Tensor
    """(B,) scorer values; NaN where no reward scored the sample (``scored`` False)."""
    forwards: Forwards
    """step 4: old and reference log-probs, values, the exact KL, the reused forward."""
    leashed: KLRewards
    """step 5: the per-token KL estimate (the one logged, shaped and controlled on) and the
    rewards shaped from it."""
    adv: Advantages
    """step 6: advantages, PPO's value targets, its return scale and update mask, GRPO's KL weights."""
    minibatches: list[Tensor]
    """this process's rows of each epoch-0 minibatch (also the groups scored in step 4); empty
    for a record returned by :meth:`select`."""
    scored: Tensor | None = None
    """(B,) bool: False on a sample no reward scored (every reward returned None, TRL's
    "unscorable"), or None when every sample was scored (:func:`make_experience`)."""

    share_by = "tokens"
    """The losses are token means: a micro-batch weighs its share of the valid tokens
    (:func:`tether.trainers.update.micro_shares`)."""

    @property
    def old_logprobs(self) -> Tensor:
        """log pi_old(y_t | ...), nats, no grad."""
        return self.forwards.old_logprobs

    @property
    def ref_logprobs(self) -> Tensor | None:
        """log pi_ref(y_t | ...), nats; None without a reference model."""
        return self.forwards.ref_logprobs

    @property
    def values(self) -> Tensor | None:
        """the value head's predictions at rollout time (PPO), else None."""
        return self.forwards.values

    @property
    def exact_kl(self) -> Tensor | None:
        """exact per-position KL of the sampling policy, nats, or None (``kl.exact=false``)."""
        return self.forwards.exact_kl

    @property
    def is_weights(self) -> Tensor | None:
        """(B, R) the sampler's importance weights the losses multiply (``rollout.correction``; 1
        on every policy token for ``none``), or None: the learner sampled."""
        c = self.forwards.correction
        return c.weights if c is not None else None

    @property
    def reused_logprobs(self) -> Tensor | None:
        """step 4's forward of the current policy, with grad (``optim.reuse_forward``), or None."""
        return self.forwards.reused_logprobs

    @property
    def kl(self) -> Tensor | None:
        """per-token KL estimate, nats (the one logged, shaped and controlled on); None without a
        reference."""
        return self.leashed.kl

    @property
    def rewards(self) -> Tensor:
        """per-token shaped rewards (score on the last token, ``-kl_coef * kl_t`` if in the reward)."""
        return self.leashed.rewards

    @property
    def non_score_reward(self) -> Tensor:
        """``-kl_coef * kl_t`` on valid tokens when the KL is in the reward, else 0."""
        return self.leashed.non_score_reward

    @property
    def advantages(self) -> Tensor:
        """per-token advantages, 0 where masked."""
        return self.adv.advantages

    @property
    def returns(self) -> Tensor | None:
        """value targets (PPO), else None."""
        return self.adv.returns

    @property
    def return_scale(self) -> Tensor | None:
        """() float64: what PPO divided the rewards by (``ppo.scale_returns``; 1 without), reward
        units; None for GRPO and RLOO."""
        return self.adv.return_scale

    @property
    def update_mask(self) -> Tensor | None:
        """(B, R) bool: the tokens the update's losses count when that is not the response mask
        (PPO leaves its unscored samples out of the update), else None."""
        return self.adv.update_mask

    @property
    def kl_weights(self) -> Tensor | None:
        """(B,) weight of each row's KL-in-loss terms (GRPO with ``grpo.scale_kl_by_std``), or
        None (weight 1)."""
        return self.adv.kl_weights

    @property
    def mask(self) -> Tensor:
        """(B, R) bool: the tokens the update counts, ``update_mask`` where set (PPO with unscored
        samples), else the rollout's ``response_mask``. What the policy sampled, for the KL the
        controller reads and the metrics, is always ``rollout.response_mask``."""
        return self.update_mask if self.update_mask is not None else self.rollout.response_mask

    def select(self, idx: Tensor) -> Experience:
        """This record restricted to rows ``idx`` ((n,) long): the rollout and each step's record.

        ``minibatches`` refer to the whole batch's rows, so the selection has none.
        """
        return Experience(
            rollout=self.rollout.select(idx),
            scores=self.scores[idx],
            forwards=self.forwards.select(idx),
            leashed=self.leashed.select(idx),
            adv=self.adv.select(idx),
            minibatches=[],
            scored=_rows(self.scored, idx),
        )


@dataclass(frozen=True, kw_only=True)
class StepSettings:
    """The per-run constants of an on-policy step's math (steps 5, 6 and 8), by name.

    The trainers build it once from their config (:func:`tether.trainers.base.step_settings`);
    the tabular test bed builds it with these same defaults, which are the CLI's (a test asserts
    it per algorithm), so the oracle proves the configuration users run.

    Attributes:
        algo: "ppo", "grpo" or "rloo": the :data:`ADVANTAGES` entry of step 6.
        estimator: per-token KL estimator logged, shaped and controlled on (``kl.estimator``).
        group_size: G, consecutive rows sharing a prompt (GRPO, RLOO); 1 for PPO.
        gamma, gae_lambda: PPO's GAE discount and lambda, in [0, 1] (``ppo.gamma``, ``ppo.gae_lambda``).
        whiten: PPO whitens its advantages over the global batch (``ppo.whiten_advantages``).
        scale_returns: PPO divides the rewards by the spread of the returns (``ppo.scale_returns``).
        scale_by_std: GRPO divides its advantages by the group std (False: Dr. GRPO).
        scale_kl_by_std: GRPO weighs each group's KL-in-loss term as its advantage
            (``grpo.scale_kl_by_std``, :func:`grpo_kl_weights`).
        controller_signal: the KL the controller reads: "exact" (the full-vocabulary KL) or
            "estimator" (``estimator``'s; ``kl.controller_signal`` resolved).
        target_unit: "nats_per_sequence" or "nats_per_token" (``kl.target_unit``).
        correction, correction_cap: the importance weights of a sampler that is not the learner
            (``rollout.correction``, ``rollout.correction_cap``,
            :func:`tether.core.correction.correction_weights`); read only where the rollout's
            ``Forwards.sampler_logprobs`` are given.
    """

    algo: str
    estimator: str = "k1"
    group_size: int = 1
    gamma: float = 1.0
    gae_lambda: float = 0.95
    whiten: bool = True
    scale_returns: bool = True
    scale_by_std: bool = True
    scale_kl_by_std: bool = False
    controller_signal: Literal["estimator", "exact"] = "exact"
    target_unit: Literal["nats_per_sequence", "nats_per_token"] = "nats_per_sequence"
    correction: str = "tis"
    correction_cap: float = 2.0


@dataclass(frozen=True)
class ClipSettings:
    """PPO's clip ranges and value weight, fixed for a run: what :func:`clipped_policy_loss` reads
    besides the batch (GRPO and RLOO read ``clip_eps`` alone).

    Attributes:
        clip_eps: the ratio's clip range (``ppo.clip_eps``).
        clip_eps_high: its upper range (``ppo.clip_eps_high``, DAPO's clip-higher), None = ``clip_eps``.
        clip_eps_value: the value prediction's clip range (``ppo.clip_eps_value``).
        vf_coef: the value loss's weight (``ppo.vf_coef``).
    """

    clip_eps: float = 0.2
    clip_eps_value: float = 0.2
    vf_coef: float = 0.5
    clip_eps_high: float | None = None


class KLRewards(NamedTuple):
    """Output of :func:`kl_and_rewards`; tensors (B, R)."""

    kl: Tensor | None
    """per-token KL estimate, nats; None without reference log-probs."""
    rewards: Tensor
    """per-token rewards: the score on the last valid token (+ ``-kl_coef * kl_t`` if the leash
    puts the KL in the reward)."""
    non_score_reward: Tensor
    """the KL part of ``rewards``, 0 when the KL is not in the reward."""
    token_correction: Tensor | None = None
    """the exact reward form's ``-kl_coef * (k1_t - KL_t)``, for token t's advantage alone
    (:func:`ppo_advantages`); None otherwise."""

    def select(self, idx: Tensor) -> KLRewards:
        """Rows ``idx`` ((n,) long) of every tensor."""
        return KLRewards(
            kl=_rows(self.kl, idx),
            rewards=self.rewards[idx],
            non_score_reward=self.non_score_reward[idx],
            token_correction=_rows(self.token_correction, idx),
        )


def kl_and_rewards(
    scores: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    mask: Tensor,
    kl_coef: float,
    *,
    estimator: str,
    leash: KLLeash,
    estimate: Callable[[Tensor, Tensor, str], Tensor] = estimate_kl,
    exact_kl: Tensor | None = None,
) -> KLRewards:
    """Step 5: the per-token KL estimate and the rewards the leash shapes from it.

    The same ``kl`` is logged, shaped into the reward (when placed there) and fed to the
    controller. Sources: Ziegler et al. 2019 (arXiv 1909.08593, eq. 2); Schulman 2020,
    "Approximating KL divergence" (k1, k2, k3).

    Args:
        scores: (B,) scorer values.
        old_logprobs: (B, R) log-probs of the sampled tokens under the sampling policy, nats.
        ref_logprobs: (B, R) under the reference, nats; None without a reference (no KL).
        mask: (B, R) bool response mask.
        kl_coef: beta >= 0, reward units per nat.
        estimator: per-token estimator (``kl.estimator``).
        leash: the placement (:class:`tether.core.leash.KLLeash`); its reward count is updated.
        estimate: the estimator function, :func:`tether.core.kl.estimate_kl` (a parameter so a
            test can substitute a wrong one and watch the optimum move).
        exact_kl: (B, R) exact per-position KL of the sampling policy, nats, or None; the leash's
            exact reward form shapes with it (:func:`tether.core.shaping.shape_rewards_exact`).

    Returns:
        :class:`KLRewards`.

    Raises:
        ValueError: the leash's exact reward form without ``exact_kl``.
    """
    kl = estimate(old_logprobs, ref_logprobs, estimator) if ref_logprobs is not None else None
    log_ratio = None
    if ref_logprobs is not None and exact_kl is not None:
        log_ratio = kl_k1(old_logprobs, ref_logprobs)
    shaped = leash.reward(scores, kl, kl_coef, mask, log_ratio=log_ratio, exact_kl=exact_kl)
    return KLRewards(kl, shaped.rewards, shaped.non_score_reward, shaped.token_correction)


def ppo_advantages(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
    *,
    whiten: bool,
    scale_returns: bool = False,
    token_correction: Tensor | None = None,
    scored: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Step 6 of PPO: GAE advantages (whitened over the global batch) and value targets.

    Source: Schulman et al. 2016, arXiv 1506.02438 (GAE); whitening as in Ziegler et al. 2019;
    reward scaling as in Engstrom et al. 2020 (:func:`tether.core.advantages.return_scale`).

    Args:
        rewards: (B, R) per-token rewards. values: (B, R) value predictions at rollout time
            (in the units of the scaled rewards when ``scale_returns``).
        mask: (B, R) bool. gamma, lam: discount and GAE lambda in [0, 1].
        whiten: normalize the advantages to mean 0, variance 1 over every valid token of every
            process (:func:`tether.core.distributed.whiten`).
        scale_returns: divide the rewards by ``max(1, std of the sequence returns)`` over the
            global batch before GAE (in at least float32): the returns (the value head's
            targets) keep about unit spread; with ``whiten``, advantages from values in the
            same scaled units equal the unscaled ones up to WHITEN_EPS.
        token_correction: (B, R) or None: the exact reward form's own-token term
            (:func:`tether.core.shaping.shape_rewards_exact`), added to A_t after GAE (so it
            reaches no other token and no value target), divided by the same scale, before
            whitening. The scale is that of the rewards alone.
        scored: (B,) bool, False on the rows to leave out of the return scale's spread (PPO's
            unscored samples, which ``mask`` already leaves out), or None (every row counts).

    Raises:
        ValueError: ``token_correction`` of another shape than ``rewards``.

    Returns:
        ``(advantages, returns, scale)``: each (B, R), 0 where masked, and the float64 scalar the
        rewards were divided by (1 without ``scale_returns``).
    """
    scale = torch.ones((), dtype=torch.float64, device=rewards.device)
    if scale_returns:
        returns = masked_sum(rewards, mask, dim=-1)  # (B,)
        scale = return_scale(D.sequence_std(returns if scored is None else returns[scored]))
    r = at_least_fp32(rewards)
    out = gae(r / scale.to(r.dtype), values, mask, gamma, lam)
    advantages = out.advantages
    if token_correction is not None:
        if token_correction.shape != rewards.shape:
            raise ValueError(
                f"token_correction {tuple(token_correction.shape)} must match rewards {tuple(rewards.shape)}"
            )
        own = token_correction.to(r.dtype) / scale.to(r.dtype)
        advantages = advantages + torch.where(mask, own, 0.0)
    return (D.whiten(advantages, mask) if whiten else advantages), out.returns, scale


def broadcast_sequence_advantages(sequence_advantages: Tensor, mask: Tensor) -> Tensor:
    """(B,) per-sequence advantages -> (B, R): the same value on every valid token, 0 elsewhere."""
    return torch.where(mask, sequence_advantages[:, None], 0.0)


def grpo_advantages(
    rewards: Tensor, mask: Tensor, group_size: int, scale_by_std: bool, scored: Tensor | None = None
) -> Tensor:
    """Step 6 of GRPO: group-normalized outcome advantages of the summed reward, on every token.

    Source: Shao et al. 2024, arXiv 2402.03300, section 4.1.2; ``scale_by_std=False`` is
    Dr. GRPO (Liu et al. 2025, arXiv 2503.20783).

    Args:
        rewards: (B, R) per-token rewards; consecutive groups of ``group_size`` rows share a prompt.
        mask: (B, R) bool. group_size: G. scale_by_std: divide by the group's std.
        scored: (B,) bool or None: unscored samples leave the group statistics and get 0
            (:func:`tether.core.advantages.group_normalized_advantages`).

    Returns:
        (B, R) advantages, 0 where masked.
    """
    seq_rewards = masked_sum(rewards, mask, dim=-1)  # (B,) score (- beta * KL if in the reward)
    adv = group_normalized_advantages(seq_rewards, group_size, scale_by_std, scored=scored)
    return broadcast_sequence_advantages(adv, mask)


def grpo_kl_weights(rewards: Tensor, mask: Tensor, group_size: int, scored: Tensor | None = None) -> Tensor:
    """Per-row weights of GRPO's KL-in-loss term (``grpo.scale_kl_by_std``): ``1 / (std_g +
    GROUP_STD_EPS)``, the same division the std-scaled advantages get, so that beta stays in
    reward units per nat: with advantages ``(r - mean_g) / std_g`` and the KL term
    ``beta KL / std_g``, each group's gradient is ``(grad E[r] - beta grad KL) / std_g``, whose
    fixed point is ``pi*`` of the beta the user set.

    A group whose rewards are all equal (std 0: all right or all wrong under a 0/1 reward) has
    advantage 0 and no std to divide by; its KL term gets the mean weight of the batch's other
    groups (over every process), which keeps ``pi*`` the fixed point (docs/kl.md, "All-equal
    groups"), and weight 1 when every group of the batch is all-equal. Every weight is therefore
    at most ``1 / GROUP_STD_EPS`` = 10^4, reached only by a group whose std is below 1e-4 yet not
    0. With unscored samples (``scored``) the std is that of the group's scored rewards, as its
    advantages'; a group with fewer than two scored samples has none and counts as all-equal.

    Args:
        rewards: (B, R) per-token rewards; consecutive groups of ``group_size`` rows share a prompt.
        mask: (B, R) bool. group_size: G >= 2.
        scored: (B,) bool or None (every sample scored).

    Returns:
        (B,) float, each row's group weight.
    """
    seq_rewards = masked_sum(rewards, mask, dim=-1)  # (B,)
    weights = 1.0 / (group_std(seq_rewards, group_size, scored=scored) + GROUP_STD_EPS)
    equal = group_all_equal(seq_rewards, group_size, scored=scored)
    # the mean over the other groups' rows (each group has G rows, so rows weigh as groups)
    n, total = D.all_reduce_sum(torch.stack([(~equal).sum().to(weights.dtype), weights[~equal].sum()]))
    mean = total / n if n > 0 else torch.ones((), dtype=weights.dtype, device=weights.device)
    return torch.where(equal, mean, weights)


def rloo_token_advantages(
    rewards: Tensor, mask: Tensor, group_size: int, scored: Tensor | None = None
) -> Tensor:
    """Step 6 of RLOO: leave-one-out advantages of the summed reward, on every token.

    Source: Ahmadian et al. 2024, arXiv 2402.14740.

    Args:
        rewards: (B, R) per-token rewards; consecutive groups of ``group_size`` rows share a prompt.
        mask: (B, R) bool. group_size: k >= 2.
        scored: (B,) bool or None: unscored samples leave their siblings' baselines and get 0
            (:func:`tether.core.advantages.rloo_advantages`).

    Returns:
        (B, R) advantages, 0 where masked.
    """
    seq_rewards = masked_sum(rewards, mask, dim=-1)  # (B,)
    return broadcast_sequence_advantages(rloo_advantages(seq_rewards, group_size, scored=scored), mask)


class Advantages(NamedTuple):
    """Output of an :data:`ADVANTAGES` entry."""

    advantages: Tensor
    """(B, R) per-token advantages, 0 where masked."""
    returns: Tensor | None
    """(B, R) value targets (PPO), else None."""
    return_scale: Tensor | None
    """() float64 divisor of the rewards (PPO; 1 without ``scale_returns``), else None."""
    update_mask: Tensor | None = None
    """(B, R) bool: the tokens the update counts when not the response mask (PPO leaves its
    unscored samples out), else None."""
    kl_weights: Tensor | None = None
    """(B,) weight of each row's KL-in-loss terms (GRPO with ``grpo.scale_kl_by_std``: one over
    its group's reward std, as its advantage; :func:`make_experience` sets it), or None (weight 1)."""

    def select(self, idx: Tensor) -> Advantages:
        """Rows ``idx`` ((n,) long) of every per-row tensor; ``return_scale`` is the batch's."""
        return Advantages(
            advantages=self.advantages[idx],
            returns=_rows(self.returns, idx),
            return_scale=self.return_scale,
            update_mask=_rows(self.update_mask, idx),
            kl_weights=_rows(self.kl_weights, idx),
        )


def _ppo_step_advantages(
    leashed: KLRewards, mask: Tensor, values: Tensor | None, settings: StepSettings, *, scored: Tensor | None
) -> Advantages:
    """PPO's entry of :data:`ADVANTAGES`: :func:`ppo_advantages` (GAE on the value predictions).

    An unscored sample has no return to learn from (its score is unknown): PPO leaves it out of
    the update, policy and value loss alike (``update_mask``), and out of the whitening and the
    return scale."""
    if values is None:
        raise ValueError("PPO's advantages need the value head's predictions (values), got None")
    update_mask = None if scored is None else mask & scored[:, None]
    mask = mask if update_mask is None else update_mask
    advantages, returns, scale = ppo_advantages(
        leashed.rewards,
        values,
        mask=mask,
        gamma=settings.gamma,
        lam=settings.gae_lambda,
        whiten=settings.whiten,
        scale_returns=settings.scale_returns,
        token_correction=leashed.token_correction,  # ppo.kl_shaping=exact: token t's own KL term
        scored=scored,
    )
    return Advantages(advantages=advantages, returns=returns, return_scale=scale, update_mask=update_mask)


def _grpo_step_advantages(
    leashed: KLRewards, mask: Tensor, values: Tensor | None, settings: StepSettings, *, scored: Tensor | None
) -> Advantages:
    """GRPO's entry of :data:`ADVANTAGES`: :func:`grpo_advantages` (Dr. GRPO without the std);
    unscored samples get advantage 0 and stay in the loss's mask (their KL term counts), as TRL's."""
    advantages = grpo_advantages(
        leashed.rewards, mask, settings.group_size, settings.scale_by_std, scored=scored
    )
    return Advantages(advantages=advantages, returns=None, return_scale=None)


def _rloo_step_advantages(
    leashed: KLRewards, mask: Tensor, values: Tensor | None, settings: StepSettings, *, scored: Tensor | None
) -> Advantages:
    """RLOO's entry of :data:`ADVANTAGES`: :func:`rloo_token_advantages` (leave-one-out);
    unscored samples get advantage 0, as TRL's."""
    return Advantages(
        advantages=rloo_token_advantages(leashed.rewards, mask, settings.group_size, scored=scored),
        returns=None,
        return_scale=None,
    )


class AdvantageFn(Protocol):
    """The signature of an :data:`ADVANTAGES` entry."""

    def __call__(
        self,
        leashed: KLRewards,
        mask: Tensor,
        values: Tensor | None,
        settings: StepSettings,
        *,
        scored: Tensor | None,
    ) -> Advantages: ...


ADVANTAGES: dict[str, AdvantageFn] = {
    "ppo": _ppo_step_advantages,
    "grpo": _grpo_step_advantages,
    "rloo": _rloo_step_advantages,
}
"""Step 6 by algorithm, one signature: ``(leashed, mask, values, settings, *, scored) ->
Advantages``, where ``leashed`` is step 5's :class:`KLRewards`, ``mask`` the (B, R) response
mask, ``values`` the (B, R) value predictions at rollout time (PPO) or None, and ``scored`` the
(B,) bool of the samples some reward scored, or None (all)."""


def uses_kl_weights(settings: StepSettings, leash: KLLeash) -> bool:
    """Whether GRPO's KL-in-loss terms get per-group weights (:func:`grpo_kl_weights`): GRPO, the
    KL in the loss, the std dividing the advantages and ``scale_kl_by_std``, groups of G >= 2."""
    s = settings
    return s.algo == "grpo" and leash.kl_in_loss and s.scale_by_std and s.scale_kl_by_std and s.group_size > 1


def make_experience(
    *,
    rollout: Samples,
    scores: Tensor,
    forwards: Forwards,
    kl_coef: float,
    leash: KLLeash,
    settings: StepSettings,
    minibatches: Sequence[Tensor] = (),
    estimate: Callable[[Tensor, Tensor, str], Tensor] = estimate_kl,
) -> Experience:
    """Steps 5 and 6 of PPO, GRPO and RLOO: the scored batch becomes the record the update reads.

    Step 5 (:func:`kl_and_rewards`): the per-token KL estimate and the leashed rewards (the exact
    reward form shapes with ``forwards.exact_kl``). Step 6 (:data:`ADVANTAGES`): advantages, PPO's
    value targets and return scale; GRPO's per-group KL weights where :func:`uses_kl_weights`.

    A NaN score marks a sample no reward scored (every reward returned None: TRL's
    "unscorable"). Its score enters no statistic: GRPO and RLOO leave it out of its group's
    baseline and give it advantage 0 (TRL 1.16, PR #5902), PPO leaves it out of the update
    (``update_mask``); its tokens still count in the KL the controller reads and the metrics
    (they are the policy's samples) and, with the KL in the loss, in the KL term.

    Args:
        rollout: the samples; its ``response_mask`` (B, R) bool masks everything.
        scores: (B,) scorer values, NaN where the sample is unscored.
        forwards: step 4's :class:`Forwards`: old and reference log-probs (``ref_logprobs`` None
            without a reference: no KL), the values (PPO; required), the exact KL, the reused
            forward; kept in the record.
        kl_coef: beta >= 0 of this step, reward units per nat.
        leash: the KL placement (:class:`tether.core.leash.KLLeash`); its reward count is updated.
        settings: :class:`StepSettings`.
        minibatches: the rows of each epoch-0 minibatch, kept in the record; none where the caller
            draws every epoch's itself (the test bed).
        estimate: the estimator function (a test may substitute a wrong one).

    Returns:
        :class:`Experience`.

    Raises:
        ValueError: the exact reward form without ``forwards.exact_kl``; PPO without
            ``forwards.values``.
    """
    f, mask = forwards, rollout.response_mask
    unscored = torch.isnan(scores)  # (B,)
    scored = ~unscored if bool(unscored.any()) else None
    leashed = kl_and_rewards(
        torch.where(unscored, 0.0, scores),  # finite on every row; an unscored row's 0 reaches no statistic
        f.old_logprobs,
        ref_logprobs=f.ref_logprobs,
        mask=mask,
        kl_coef=kl_coef,
        estimator=settings.estimator,
        leash=leash,
        estimate=estimate,
        exact_kl=f.exact_kl if leash.reward_form == "exact" else None,
    )
    if f.sampler_logprobs is not None:  # the sampler is not the learner: its importance weights
        forwards = forwards._replace(
            correction=correction_weights(
                f.old_logprobs,
                f.sampler_logprobs,
                mask,
                correction=settings.correction,
                cap=settings.correction_cap,
            )
        )
    adv = ADVANTAGES[settings.algo](leashed, mask, f.values, settings, scored=scored)
    if uses_kl_weights(settings, leash):
        adv = adv._replace(
            kl_weights=grpo_kl_weights(leashed.rewards, mask, settings.group_size, scored=scored)
        )
    return Experience(
        rollout=rollout,
        scores=scores,
        forwards=forwards,
        leashed=leashed,
        adv=adv,
        minibatches=list(minibatches),
        scored=scored,
    )


def controller_input(exp: Experience, settings: StepSettings) -> float | None:
    """:func:`kl_reading` of a record: the KL its batch was drawn at (step 5, the controller's)."""
    return kl_reading(kl=exp.kl, exact_kl=exp.exact_kl, mask=exp.rollout.response_mask, settings=settings)


def kl_reading(
    *, kl: Tensor | None, exact_kl: Tensor | None, mask: Tensor, settings: StepSettings
) -> float | None:
    """Step 5: the KL the controller reads (and the guard starts from), the same number that is
    logged: the batch mean over every process of the exact or the estimated KL of the policy that
    drew the batch (``settings.controller_signal``), per sequence (the per-sequence sum, nats) or
    per token (the token-weighted mean, nats per token) as ``settings.target_unit``. Read before
    the step's update, so the beta of that update follows the KL it starts from (issue 52: read
    after it, beta acted one step late).

    Args:
        kl: (B, R) the estimator's per-token KL, nats, or None without a reference.
        exact_kl: (B, R) the exact per-position KL, nats, or None (``kl.exact=false``).
        mask: (B, R) bool, every sample the policy drew (scored or not).
        settings: :class:`StepSettings`.

    Returns:
        The float, or None without a reference (no KL: the controller is not updated).

    Raises:
        ValueError: the exact signal without ``exact_kl``.
    """
    if kl is None:
        return None
    signal = kl
    if settings.controller_signal == "exact":
        if exact_kl is None:
            raise ValueError("controller_signal='exact' needs the exact KL (kl.exact=true), got none")
        signal = exact_kl
    if settings.target_unit == "nats_per_sequence":
        return float(D.sequence_mean(sequence_kl(signal, mask)))
    return float(D.token_mean(signal, mask))


def updated_kl(
    *, exact_kl: Tensor, mask: Tensor, target_unit: str, group_size: int = 1
) -> tuple[float, float]:
    """The exact KL to the reference of an updated policy at the prefixes of the batch the policy
    before it drew, over every process, in ``target_unit``, with the standard error of that batch
    mean. The update guard's measure (:mod:`tether.trainers.guard`).

    Exact over the vocabulary at each prefix; the prefixes are pi_old's, not the updated policy's:
    the state distribution of the policy that drew them, as TRPO's constraint reads it (Schulman
    et al. 2015, eq. 12). Not reweighted by the prefix's importance ratio
    (:func:`tether.core.kl.importance_weighted_kl`, exact in expectation): on the batch the update
    was just fitted to, that ratio is what the update raised (on the demo's first step it read
    716,872 nats where the next batch's exact KL was 0.27; docs/kl.md, "The update guard").

    With ``s_c`` the summed exact KL of a group of ``group_size`` consecutive sequences (the
    samples of one prompt, which share it and so are not independent; a sequence alone with
    ``group_size`` 1), ``n_c`` its policy tokens (its sequences for ``nats_per_sequence``) and
    ``m = sum s_c / sum n_c`` over the ``C`` groups of every process, the standard error is the
    ratio estimator's over groups, ``sqrt(C / (C - 1) * sum_c (s_c - m n_c)^2) / sum_c n_c``
    (Cochran 1977, eq. 6.9; per sequence with ``group_size`` 1 the usual ``std / sqrt(B)``); 0 for
    ``C = 1`` (no spread to read) or no valid token.

    Args:
        exact_kl: (B, R) the updated policy's exact per-position KL, nats.
        mask: (B, R) bool, the policy's tokens.
        target_unit: ``nats_per_sequence`` or ``nats_per_token``.
        group_size: consecutive rows that share a prompt (GRPO's and RLOO's groups; never split
            over processes); it must divide B.

    Returns:
        ``(kl, se)``: the KL, nats per sequence or per token (the reading's reduction,
        :func:`kl_reading`), and its standard error in the same unit.
    """
    m = mask.bool()
    per_sequence = sequence_kl(exact_kl, m)  # (B,)
    kl = (
        float(D.sequence_mean(per_sequence))
        if target_unit == "nats_per_sequence"
        else float(D.token_mean(exact_kl, m))
    )
    s = per_sequence.to(torch.float64)
    n = torch.ones_like(s) if target_unit == "nats_per_sequence" else m.sum(-1).to(torch.float64)
    if len(s) % group_size:
        raise ValueError(f"group_size={group_size} must divide the batch's {len(s)} rows")
    s, n = s.view(-1, group_size).sum(-1), n.view(-1, group_size).sum(-1)  # (C,): one per group
    rows, total_n, ss, sn, nn = D.all_reduce_sum(
        torch.stack(
            [
                torch.tensor(float(len(s)), dtype=torch.float64, device=s.device),
                n.sum(),
                (s * s).sum(),
                (s * n).sum(),
                (n * n).sum(),
            ]
        )
    ).tolist()
    if rows < 2 or total_n <= 0:
        return kl, 0.0
    residual = max(0.0, ss - 2 * kl * sn + kl * kl * nn)  # sum (s_i - m n_i)^2; rounding can dip below 0
    return kl, math.sqrt(rows / (rows - 1) * residual) / total_n


def clipped_policy_loss(
    mb: Experience,
    logprobs: Tensor,
    clip: ClipSettings,
    leash: KLLeash,
    kl_coef: float,
    *,
    first_micro: bool = True,
    values: Tensor | None = None,
    logits: Tensor | None = None,
    ref_logits: Tensor | None = None,
) -> MicroLoss:
    """Step 7 of PPO, GRPO and RLOO: the loss of one micro-batch.

    ``L = L_clip (+ vf_coef * L_value) (+ kl_coef * KL surrogate)``: the clipped surrogate
    (Schulman et al. 2017, arXiv 1707.06347, eq. 7), PPO's clipped value loss when ``values`` is
    given, and the leash's KL term when the KL is placed in the loss (counted in
    ``leash.counts`` only when ``first_micro``: once per gradient step).

    Args:
        mb: the micro-batch's rows of the :class:`Experience` (``exp.select(idx)``); uses its
            old log-probs, advantages, reference log-probs, mask and (with ``values``) its old
            values and returns.
        logprobs: (B_m, R) log-probs of ``mb``'s tokens under the current policy, nats, with grad.
        clip: the ratio's clip range and, with ``values``, the value's and the value loss's weight
            (:class:`ClipSettings`). leash, kl_coef: the KL placement and beta >= 0.
        first_micro: this is the first micro-batch of its gradient step.
        values: (B_m, R) current value predictions with grad (PPO), or None.
        logits, ref_logits: (B_m, R, V) the policy's (with grad) and the reference's logits at the
            positions, for a leash holding another divergence than the reverse KL
            (``leash.divergence``); else None.

    Returns:
        :class:`tether.trainers.update.MicroLoss`: stats ``policy/loss``, ``policy/clipfrac``,
        ``policy/approx_kl`` (nats), ``value/loss``, ``value/clipfrac`` (with values) and
        ``policy/kl_loss`` (when the KL term applies); ``ratio_dev`` = ``max |ratio - 1|``.
    """
    mask = mb.mask
    pl = ppo_policy_loss(
        logprobs,
        mb.old_logprobs,
        mb.advantages,
        mask,
        clip.clip_eps,
        clip_eps_high=clip.clip_eps_high,
        is_weights=mb.is_weights,
    )
    stats = {"policy/loss": pl.loss, "policy/clipfrac": pl.clipfrac, "policy/approx_kl": pl.approx_kl}
    loss = pl.loss
    if values is not None:
        vl = clipped_value_loss(values, mb.values, mb.returns, mask, clip.clip_eps_value)
        stats["value/loss"], stats["value/clipfrac"] = vl.loss, vl.clipfrac
        loss = loss + clip.vf_coef * vl.loss
    kl_term = leash.loss(
        logprobs,
        mb.ref_logprobs,
        kl_coef,
        mask,
        mb.old_logprobs,
        count=first_micro,
        row_weights=mb.kl_weights,
        logits=logits,
        ref_logits=ref_logits,
        # a token's own ratio corrects the sampled-token estimators at its prefix; an exact
        # divergence at a prefix depends on no token drawn there: only a sequence's weight (mis,
        # which also corrects the prefixes) applies to it
        token_weights=mb.is_weights
        if leash.divergence == "reverse_kl"
        or (mb.forwards.correction and mb.forwards.correction.per_sequence)
        else None,
    )
    if kl_term is not None:
        stats["policy/kl_loss"] = kl_term
        loss = loss + kl_term
    return MicroLoss(loss, stats, torch.where(mask, (pl.ratio - 1).abs(), 0.0).max())


def dpo_pair_loss(
    policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, beta: float
) -> MicroLoss:
    """Step 2 of DPO: the loss of one micro-batch of pairs and its logged statistics.

    Source: Rafailov et al. 2023, arXiv 2305.18290, eq. 7 (:func:`tether.core.losses.dpo_loss`).

    Args:
        policy_chosen, policy_rejected: (N,) sequence log-probs (sums over response tokens) of
            the chosen and rejected responses under the policy, nats, with grad.
        ref_chosen, ref_rejected: (N,) the same under the reference, nats.
        beta: DPO's beta > 0, the implicit KL coefficient.

    Returns:
        :class:`tether.trainers.update.MicroLoss` (a mean over pairs; no ``ratio_dev``), stats
        ``dpo/loss``, ``dpo/margin``, ``dpo/accuracy``, ``dpo/chosen_reward``,
        ``dpo/rejected_reward`` (implicit rewards ``beta * log(pi / pi_ref)``).
    """
    out = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)
    stats = {
        "dpo/loss": out.loss,
        "dpo/margin": out.margin,
        "dpo/accuracy": out.accuracy,
        "dpo/chosen_reward": out.chosen_rewards.mean(),
        "dpo/rejected_reward": out.rejected_rewards.mean(),
    }
    return MicroLoss(out.loss, stats)
