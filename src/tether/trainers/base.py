"""What the on-policy trainers (PPO, GRPO, RLOO) share: rollout, scoring, the leash, metrics.

A subclass supplies ``advantages`` (per-token advantages and returns from shaped rewards) and
``minibatch_loss`` (the loss of one minibatch); ``step`` is the same algorithm for all three:

1. sample prompts (each repeated ``group_size`` times);
2. generate responses from the current policy;
3. score the responses with the reward model;
4. old log-probs (and values), reference log-probs, no grad;
5. per-token KL; rewards (score on the last token, -kl_coef * kl_t if the KL is in the reward);
6. advantages;
7. epochs of minibatch updates (+ kl_coef * KL surrogate if the KL is in the loss);
8. update kl_coef from the same KL numbers that were logged;
9. metrics.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
from torch import Tensor

from tether.controllers import make_controller
from tether.data import PromptSampler
from tether.kl import estimate_kl, kl_stats, masked_mean, sequence_kl
from tether.leash import KLLeash
from tether.rollout import Rollout, generate
from tether.scorers import checked_scores
from tether.trainers.common import Run, ScoredBatch, optimizer_step, score_rollout


class Experience(NamedTuple):
    """A scored rollout batch ready for the update epochs; tensors (B, R) unless noted."""

    rollout: Rollout
    scores: Tensor  # (B,)
    old_logprobs: Tensor
    ref_logprobs: Tensor | None
    values: Tensor | None
    kl: Tensor | None
    rewards: Tensor
    non_score_reward: Tensor
    advantages: Tensor
    returns: Tensor | None
    minibatches: list[Tensor]  # epoch-0 row groups, also used for scoring


class OnPolicyTrainer:
    """Base of PPO, GRPO and RLOO; see the module docstring for the step."""

    uses_values = False
    name = "base"

    def __init__(self, run: Run):
        self.run = run
        c = self.cfg = run.config
        self.group_size = c.rollout.group_size
        self.sampler = PromptSampler(run.train_prompts, c.train.seed)
        self.controller = make_controller(c.kl.controller, c.kl.kl_coef, c.kl.target, c.kl.horizon,
                                          budget=c.kl.budget, eta=c.kl.budget_eta)
        self.leash = KLLeash(c.kl.kl_in_reward, c.kl.kl_in_loss, c.kl.loss_estimator)
        self.params = [p for p in run.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=c.optim.lr, weight_decay=c.optim.weight_decay)
        self.generator = torch.Generator().manual_seed(c.train.seed)
        self.last_experience: Experience | None = None

    # ---- the step --------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        c, run = self.cfg, self.run
        t0 = time.perf_counter()
        # 1. sample prompts, each group_size times (consecutive rows form a group)
        prompts = [p for p in self.sampler.next_batch(c.rollout.batch_size // self.group_size)
                   for _ in range(self.group_size)]
        # 2. generate responses from the current policy
        rollout = generate(run.policy.lm, run.tokenizer, prompts, c.rollout.max_new_tokens,
                           c.rollout.temperature, c.rollout.max_prompt_tokens)
        t_gen = time.perf_counter()
        # 3. score responses with the reward model
        scores = torch.tensor(checked_scores(run.scorer, rollout.responses, step))
        # 4. old log-probs (+ values) and reference log-probs, no grad
        minibatches = self.minibatch_indices()
        scored = score_rollout(run.policy, run.reference, rollout, c.rollout.temperature, minibatches,
                               with_values=self.uses_values, exact_kl=c.kl.exact,
                               exact_chunk_size=c.kl.exact_chunk_size)
        t_score = time.perf_counter()
        # 5. per-token KL and rewards (the leash applies the KL in the reward if placed there)
        kl_coef = self.controller.kl_coef
        kl = (estimate_kl(scored.old_logprobs, scored.ref_logprobs, c.kl.estimator)
              if scored.ref_logprobs is not None else None)
        shaped = self.leash.reward(scores, kl, kl_coef, rollout.response_mask)
        # 6. advantages
        advantages, returns = self.advantages(shaped.rewards, scored, rollout.response_mask)
        exp = Experience(rollout, scores, scored.old_logprobs, scored.ref_logprobs, scored.values, kl,
                         shaped.rewards, shaped.non_score_reward, advantages, returns, minibatches)
        # 7. update epochs
        update = self.update(exp, kl_coef)
        t_update = time.perf_counter()
        # 8. update kl_coef with the KL that was logged (and, if placed there, in the reward)
        if kl is not None:
            stats = kl_stats(kl, rollout.response_mask)
            unit = "kl_per_sequence" if c.kl.target_unit == "nats_per_sequence" else "kl_per_token"
            self.controller.update(float(stats[unit]), n_steps=c.rollout.batch_size)
        # 9. metrics
        row = self.metrics(step, exp, scored, update, kl_coef)
        row.update({"time/step": t_update - t0, "time/generate": t_gen - t0,
                    "time/score": t_score - t_gen, "time/update": t_update - t_score})
        self.last_experience = exp
        return row

    # ---- checkpointing ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Optimizer, controller, minibatch RNG and data position (see :mod:`tether.checkpoint`)."""
        return {"optimizer": self.optimizer.state_dict(), "controller": self.controller.state_dict(),
                "generator": self.generator.get_state(), "sampler": self.sampler.state_dict(),
                "leash_counts": dict(self.leash.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        for k, v in state["controller"].items():
            setattr(self.controller, k, v)
        self.generator.set_state(state["generator"])
        self.sampler.load_state_dict(state["sampler"])
        self.leash.counts.update(state["leash_counts"])

    # ---- to override -----------------------------------------------------------------------
    def advantages(self, rewards: Tensor, scored: ScoredBatch, mask: Tensor) -> tuple[Tensor, Tensor | None]:
        raise NotImplementedError

    def minibatch_loss(self, exp: Experience, idx: Tensor, part: Rollout, kl_coef: float) -> tuple[Tensor, dict]:
        raise NotImplementedError

    # ---- shared pieces ---------------------------------------------------------------------
    def add_kl_loss(self, loss: Tensor, stats: dict, logprobs: Tensor, exp: Experience, idx: Tensor,
                    mask: Tensor, kl_coef: float) -> Tensor:
        """``loss + kl_coef * KL surrogate`` when the KL is placed in the loss (logged once)."""
        ref = exp.ref_logprobs[idx] if exp.ref_logprobs is not None else None
        kl_term = self.leash.loss(logprobs, ref, kl_coef, mask, exp.old_logprobs[idx])
        if kl_term is None:
            return loss
        stats["policy/kl_loss"] = kl_term
        return loss + kl_term

    def minibatch_indices(self) -> list[Tensor]:
        B, mb = self.cfg.rollout.batch_size, self.cfg.optim.minibatch_size
        return list(torch.randperm(B, generator=self.generator).split(mb))

    def update(self, exp: Experience, kl_coef: float) -> dict:
        c = self.cfg
        stats: dict[str, list[float]] = {}
        for epoch in range(c.optim.epochs):
            groups = exp.minibatches if epoch == 0 else self.minibatch_indices()
            for i, idx in enumerate(groups):
                part = exp.rollout.select(idx)
                loss, parts = self.minibatch_loss(exp, idx, part, kl_coef)
                parts["policy/grad_norm"] = optimizer_step(self.optimizer, self.params, loss,
                                                           c.optim.max_grad_norm, self.name)
                if epoch == 0 and i == 0 and "_ratio_dev" in parts:
                    # before any update the ratio must be exactly 1 (same inputs, same weights)
                    stats["policy/ratio_max_dev_first"] = [float(parts["_ratio_dev"])]
                for k, v in parts.items():
                    if not k.startswith("_"):
                        stats.setdefault(k, []).append(float(v.detach()) if torch.is_tensor(v) else float(v))
        return {k: sum(v) / len(v) for k, v in stats.items()}

    def metrics(self, step: int, exp: Experience, scored: ScoredBatch, update: dict, kl_coef: float) -> dict:
        row = {
            "step": step,
            "samples": (step + 1) * self.cfg.rollout.batch_size,
            **sample_metrics(exp.rollout, exp.scores, exp.kl, scored.entropy, scored.exact_kl, kl_coef,
                             self.cfg.kl.estimator),
            "kl/applied_in_reward": self.leash.counts["reward"],
            "kl/applied_in_loss": self.leash.counts["loss"],
            "kl/reference_forwards": self.run.reference_forwards[0],
        }
        row.update(update)
        return row


def sample_metrics(rollout: Rollout, scores: Tensor, kl: Tensor | None, entropy: Tensor,
                   exact_kl: Tensor | None, kl_coef: float, estimator: str) -> dict:
    """The ``objective/*`` and ``response/*`` metrics of a batch of the policy's samples.

    Args:
        rollout: the samples; its ``response_mask`` (B, T) masks every per-token value.
        scores: (B,) scorer values.
        kl: (B, T) per-token KL estimate (nats), or None without a reference.
        entropy: (B, T) policy entropy, nats.
        exact_kl: (B, T) exact per-token KL, or None.
        kl_coef: beta of this step.
        estimator: name of the estimator behind ``kl``.
    """
    mask = rollout.response_mask
    # the objective's two terms per sequence, whatever the placement: J = score - beta * KL
    non_score = -kl_coef * sequence_kl(kl, mask) if kl is not None else torch.zeros_like(scores)  # (B,)
    row = {
        "objective/kl_coef": kl_coef,
        "objective/scores": scores.mean(),
        "objective/scores_std": scores.std() if len(scores) > 1 else 0.0,
        "objective/non_score_reward": non_score.mean(),
        "objective/rlhf_reward": (scores + non_score).mean(),
        "objective/entropy": masked_mean(entropy, mask),
        "response/length": mask.sum(-1).float().mean(),
    }
    if rollout.ended is not None:
        row["response/eos_fraction"] = rollout.ended.float().mean()
    if kl is not None:
        kls = kl_stats(kl, mask)
        row["objective/kl"] = kls["kl_per_sequence"]
        row["objective/kl_per_token"] = kls["kl_per_token"]
        if estimator == "k1":
            row["objective/k1_negative_fraction"] = masked_mean((kl < 0).float(), mask)
    if exact_kl is not None:
        row["objective/kl_exact"] = sequence_kl(exact_kl, mask).mean()
        row["objective/kl_exact_per_token"] = masked_mean(exact_kl, mask)
    return row
