"""What the on-policy trainers (PPO, GRPO, RLOO) share: rollout, scoring, the leash, metrics.

A subclass supplies its ``name`` (the :data:`tether.trainers.steps.ADVANTAGES` entry of step 6)
and ``minibatch_loss`` (the loss of one micro-batch, a pure function of
:mod:`tether.trainers.steps` applied to the policy's log-probs); ``step`` is the same algorithm
for all three:

1. sample prompts (each repeated ``group_size`` times): the global batch, of which each process
   keeps its contiguous shard (a group is never split; docs/distributed.md);
2. generate responses from the current policy, sample ``i`` of the step seeded by (seed, step, i);
3. score the responses with the reward model;
4. old log-probs (and values), reference log-probs (and the exact KL), no grad;
5. the KL the batch was drawn at, the number that is logged
   (:func:`tether.trainers.steps.kl_reading`);
6. beta for this step's update, the controller updated from that reading (issue 52: before, the
   reading set the next step's beta);
7. per-token KL; rewards (score on the last token, -kl_coef * kl_t if the KL is in the reward);
8. advantages (7 and 8: :func:`tether.trainers.steps.make_experience`, with the run's
   :func:`step_settings`);
9. epochs of minibatch updates (+ kl_coef * KL surrogate if the KL is in the loss):
   :func:`tether.trainers.update.minibatch_update` with the subclass's ``minibatch_loss``;
10. with ``kl.guard``, each epoch checked before it is kept
    (:func:`tether.trainers.guard.guarded_epochs`), the controller told of a cut
    (:meth:`tether.core.controllers.Controller.cut`);
11. metrics, each reduced over every process (tether.core.distributed).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from functools import partial

import torch
from torch import Tensor

from tether.core import distributed as D
from tether.core.diversity import distinct_n, repetition
from tether.core.kl import estimate_kl, kl_k3, sequence_kl
from tether.core.leash import KLLeash
from tether.data.prompts import PromptSampler
from tether.judges.contract import RewardLog, score_rollout, trainer_state
from tether.models.callables import running
from tether.models.sampling import Rollout, sample_seeds, special_token_ids
from tether.models.scoring import TokenStats, policy_and_reference_logprobs, rollout_logprobs
from tether.models.sharding import is_sharded, root_gathered
from tether.models.turns import EnvFailed
from tether.run.console import say
from tether.run.setup import Run
from tether.trainers.anchor import restore_anchor, text_anchor
from tether.trainers.common import (
    RolloutLogprobs,
    make_optimizer,
    make_scheduler,
    old_and_ref_logprobs,
    optimization_state,
    restore_optimization,
    trainer_optimization,
)
from tether.trainers.guard import Ahead, GuardResult, GuardSettings, Snapshots, guarded_epochs
from tether.trainers.kl_tokens import KLAttribution
from tether.trainers.precision import MasterWeights
from tether.trainers.steps import (
    ClipSettings,
    Experience,
    StepSettings,
    kl_reading,
    make_experience,
    updated_kl,
)
from tether.trainers.update import MicroLoss, UpdateStats, minibatch_update

__all__ = ["OnPolicyTrainer", "sample_metrics", "step_settings"]

log = logging.getLogger(__name__)


def guard_settings(config, controller) -> GuardSettings | None:
    """The update guard of a run (:class:`tether.trainers.guard.GuardSettings`: its limit in
    ``kl.target_unit``, ``kl.guard_tol``, ``kl.guard_halvings``, ``kl.guard_z``), or None with
    ``kl.guard`` off. The limit is what a guarded controller holds (``controller.held_kl()``, the
    budget controller's ``kl.budget``); with a controller the guard is not made for (fixed,
    adaptive, ``kl.guard=true``), ``kl.budget``."""
    k = config.kl
    if not k.guard:
        return None
    held = controller.held_kl() if controller.guarded else None
    limit = k.budget if held is None else held
    return GuardSettings(limit=limit, tol=k.guard_tol, max_halvings=k.guard_halvings, z=k.guard_z)


def guard_metrics(result: GuardResult) -> dict:
    """``guard/*``: the KL of the update as the optimizer left it and of the weights kept (the
    controller's unit), the kept fraction of the last epoch's step (1 whole, 0 restored), the
    halvings measured."""
    return {
        "guard/kl_updated": result.kl_updated,
        "guard/kl_kept": result.kl_kept,
        "guard/kl_kept_se": result.se_kept,
        "guard/fraction": result.fraction,
        "guard/backtracks": float(result.backtracks),
    }


def step_settings(config, algo: str) -> StepSettings:
    """The :class:`tether.trainers.steps.StepSettings` of a run: its config's fields, by name.

    Args:
        config: the run's :class:`tether.run.config.Config`.
        algo: "ppo", "grpo" or "rloo".
    """
    c = config
    return StepSettings(
        algo=algo,
        estimator=c.kl.estimator,
        group_size=c.rollout.group_size,
        gamma=c.ppo.gamma,
        gae_lambda=c.ppo.gae_lambda,
        whiten=c.ppo.whiten_advantages,
        scale_returns=c.ppo.scale_returns,
        scale_by_std=c.grpo.scale_by_std,
        scale_kl_by_std=c.grpo.scale_kl_by_std,
        controller_signal=c.kl.signal,
        target_unit=c.kl.target_unit,
        correction=c.rollout.correction,
        correction_cap=c.rollout.correction_cap,
    )


REF_LOGITS_BYTES = 1 << 30
"""The most memory (1 GiB per process) the update guard spends keeping the reference's logits
of a step's rows for its measures ("where memory allows", issue 52); the demo's 16 rows of 24
tokens over SmolLM2's 49,152 ids take 75 MB. Past it the guard keeps the reference's last hidden
states and runs its LM head per measure."""


class OnPolicyTrainer:
    """Base of PPO, GRPO and RLOO; see the module docstring for the step."""

    uses_values = False
    name = "base"

    def __init__(self, run: Run):
        self.run = run
        c = self.cfg = run.config
        self.group_size = c.rollout.group_size
        self.sampler = PromptSampler(run.train_prompts, c.train.seed)
        self.controller = c.kl.new_controller()  # kl.controller with its settings
        self.leash = KLLeash(
            c.kl.kl_in_reward,
            c.kl.kl_in_loss,
            c.kl.loss_estimator,
            c.kl_reward_form,
            divergence=c.kl.divergence,
            temperature=c.rollout.temperature,
            alpha=c.kl.alpha,
        )
        self.divergence_leash = c.kl.divergence != "reverse_kl" and c.kl.kl_in_loss
        """kl.divergence other than the reverse KL: the loss term needs both models' logits."""
        if self.divergence_leash:
            self.check_ref_logits_bound()
        self.settings = step_settings(c, self.name)
        self.clip = ClipSettings(
            clip_eps=c.ppo.clip_eps,
            clip_eps_high=c.ppo.clip_eps_high,
            clip_eps_value=c.ppo.clip_eps_value,
            vf_coef=c.ppo.vf_coef,
        )
        self.guard = guard_settings(
            c, self.controller
        )  # kl.guard: each epoch's update checked before it is kept
        if not self.uses_values:  # no loss reaches the value head: frozen, so DDP waits for no gradient of it
            run.policy.value_head.requires_grad_(False)
        self.params = [p for p in run.policy.parameters() if p.requires_grad]
        self.accelerator = run.accelerator
        # the module the losses differentiate: under DDP its backward averages gradients over
        # processes; sampling and no-grad scoring use the bare run.policy
        # (an FSDP-sharded policy, train.sharding=fsdp, syncs its own gradients: not wrapped)
        self.model = (
            run.accelerator.prepare(run.policy)
            if run.accelerator and self.params and not is_sharded(run.policy)
            else run.policy
        )
        self.optimizer = make_optimizer(self.params, c.optim.lr, c.optim.weight_decay, c.optim.fused_adamw)
        self.fused = bool(self.optimizer.param_groups[0].get("fused"))  # False where no fused kernel
        self.per_step = per_step = c.optim.epochs * (c.rollout.batch_size // c.optim.minibatch_size)
        self.schedule_steps = c.train.steps * per_step  # optimizer steps; a resume may change it
        self.scheduler = make_scheduler(
            self.optimizer, c.optim.lr_scheduler, c.optim.warmup_steps, self.schedule_steps
        )
        if c.optim.warmup_steps >= c.train.steps * per_step:
            log.warning(
                "tether: warning: optim.warmup_steps=%d is not shorter than the run's %d optimizer steps: "
                "the learning rate never reaches optim.lr",
                c.optim.warmup_steps,
                c.train.steps * per_step,
            )
        self.device = next(run.policy.parameters()).device
        # the minibatch RNG stays on the host: the same minibatches on any device (checkpointed)
        self.generator = torch.Generator(device="cpu").manual_seed(c.train.seed)
        self.last_experience: Experience | None = None
        # the update guard's lookahead: the forward (with grad) that measured the weights, kept for
        # the next epoch's backward (:meth:`measure_ahead`, :meth:`update_forward`)
        self.kept_forward: tuple[Tensor, TokenStats] | None = None
        self.snapshots = Snapshots()  # the guard's copies of the weights, kept between steps
        # kl.attribution: where each step's exact KL went (kl/* metrics, kl_tokens.jsonl records)
        self.attribution = (
            KLAttribution(
                tokenizer=run.tokenizer,
                special_ids=special_token_ids(run.tokenizer, run.policy.lm),
                jump=c.kl.tokens_jump,
                every=c.kl.tokens_every,
                budget=self.controller.held_kl() if self.controller.guarded else None,
            )
            if c.kl.attribution and c.kl.exact and run.reference is not None
            else None
        )
        self.kl_record: dict | None = None
        """The last step's kl_tokens.jsonl record (every process the same), or None."""
        # one update on the whole batch with no value head and no KL in the reward: the policy's
        # old log-probs are those of the update's own forward (optim.reuse_forward)
        self.reuse_forward = (
            c.optim.reuse_forward
            and c.optim.epochs == 1
            and c.optim.minibatch_size == c.rollout.batch_size
            and not self.uses_values
            and not c.kl.kl_in_reward
            and not self.divergence_leash  # its loss reads the logits, which step 4's forward drops
            and (
                c.optim.micro_batch_size is None
                or c.optim.micro_batch_size >= c.optim.minibatch_size // D.world_size()
            )
        )
        self.rollouts = run.sampler  # one turn, or tool turns with rollout.env (models/rollouts.py)
        # anchor.coef > 0 or anchor.budget: human text in every optimizer step's loss (trainers/anchor.py)
        self.anchor = text_anchor(run)

    def trainer_state(self, step: int):
        """The ``trainer_state`` reward functions get at ``step`` (TRL's ``self.state``): the steps
        done, ``train.steps``, and the passes over the training prompts so far."""
        c = self.cfg
        drawn = step * (c.rollout.batch_size // self.group_size)  # prompts drawn before this step
        return trainer_state(step, c.train.steps, drawn / max(1, len(self.run.train_prompts)))

    # ---- the step --------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        t0 = time.perf_counter()
        rollout = self.sample_rollout(step)  # 1-2. prompts (each group_size times), responses
        t_gen = time.perf_counter()
        for line in self.rollouts.choose_decoding(  # rollout.compile, after the first rollout sampled
            self.run.policy, rollout, step=step, steps=self.cfg.train.steps, generate_s=t_gen - t0
        ):
            say(line, self.cfg.train.progress)
        scores, reward_metrics = self.score(rollout, step)  # 3. the reward, called as TRL calls it
        # 4-10 run the frozen lower blocks once (model.replay_frozen_blocks)
        with self.run.policy.replaying():
            minibatches = self.minibatch_indices()
            forwards = self.rollout_forwards(rollout, minibatches)  # 4. old, reference log-probs
            t_score = time.perf_counter()
            reading = self.kl_reading(forwards, rollout)  # 5. the KL the batch was drawn at
            if reading is not None:  # 6. beta from it, for this step's update
                self.controller.update(reading, n_steps=self.cfg.rollout.batch_size)
            kl_coef = self.controller.kl_coef
            exp = make_experience(  # 7-8. per-token KL, leashed rewards, advantages
                rollout=rollout,
                scores=scores,
                # step 4's numbers; optim.reuse_forward: with its forward of the current policy, with grad
                forwards=forwards.step_forwards(
                    with_ref_logits=self.divergence_leash,
                    # rollout.dtype=bf16: the sampler is not the learner; its log-probs weigh the update
                    sampler_logprobs=rollout.sampler_logprobs if rollout.sampler_dtype == "bf16" else None,
                ),
                minibatches=minibatches,
                kl_coef=kl_coef,
                leash=self.leash,
                settings=self.settings,
            )
            lr = self.optimizer.param_groups[0]["lr"]  # the rate of this step's first optimizer step
            # 9-10. epochs of minibatch updates, each checked by the update guard (kl.guard)
            update, guarded = self.update(exp, kl_coef, forwards=forwards)
            cut = guarded is not None and guarded.fraction < 1.0  # the update wanted more KL than it kept
            if cut and math.isfinite(guarded.kl_updated):  # a non-finite one was restored: nothing to learn
                self.controller.cut(guarded.kl_updated, n_steps=self.cfg.rollout.batch_size)
        t_update = time.perf_counter()
        row = self.metrics(step, exp, forwards, update, kl_coef)  # 11. metrics, over every process
        t_attribute = time.perf_counter()
        self.kl_record = None
        if self.attribution is not None and forwards.exact_kl is not None:  # where the KL went
            attributed, self.kl_record = self.attribution.step(
                step,
                reading=reading,
                rollout=rollout,
                exact_kl=forwards.exact_kl,
                old_logprobs=forwards.old_logprobs,
                ref_logprobs=forwards.ref_logprobs,
                top=forwards.top,
            )
            row.update(attributed)
            row["time/attribution"] = time.perf_counter() - t_attribute
        if guarded is not None:
            row.update(guard_metrics(guarded))
        row.update(reward_metrics)
        row.update(
            {
                "optim/lr": lr,
                "time/step": t_update - t0,
                "time/generate": t_gen - t0,
                "rollout/compiled": float(rollout.compiled),
                "time/score": t_score - t_gen,
                "time/update": t_update - t_score,
            }
        )
        self.last_experience = exp
        return row

    def sample_rollout(self, step: int) -> Rollout:
        """Steps 1-2: the step's prompts, each ``group_size`` times (consecutive rows form a
        group; every process draws the same global batch and keeps its contiguous shard), and
        the current policy's responses; sample i of the step is seeded by (seed, step, i), so the
        samples do not depend on the number of processes."""
        c, run = self.cfg, self.run
        rows = [
            i
            for i in self.sampler.next_indices(c.rollout.batch_size // self.group_size)
            for _ in range(self.group_size)
        ]
        mine = D.shard(len(rows))
        prompts = run.train_prompts.select(rows[mine])  # this process's rows, with their columns
        seeds = sample_seeds(c.train.seed, step, range(len(rows))[mine])
        try:
            return self.rollouts.sample_policy(run.policy, prompts, seeds)
        except EnvFailed as e:  # rollout.env failed: the loop writes the checkpoint of the step before
            raise e.retold(f"step {step}: {e}") from e.__cause__

    def score(self, rollout: Rollout, step: int) -> tuple[Tensor, dict]:
        """Step 3: the responses' scores, (B,), from the reward (a reward list: their weighted
        sum), called as TRL calls it (prompts, completions, completion_ids, columns,
        trainer_state, log hooks); and the step's ``reward/<name>`` and ``reward_metric/<name>``
        metrics. A sample every reward returned None for (TRL's "unscorable") is NaN here: it
        leaves every statistic of the step (:func:`tether.trainers.steps.make_experience`), and
        ``reward/unscored_fraction`` counts it."""
        run = self.run
        reward_log = RewardLog()
        with running("the reward (reward.scorer)"):  # named by Ctrl-C's line while it runs
            scored = score_rollout(
                run.scorer, rollout, step, state=self.trainer_state(step), reward_log=reward_log
            )
        scores = torch.tensor(scored.total, device=self.device)  # (B,), NaN where unscored
        metrics = reward_components(scored.parts, self.device)
        metrics.update(reward_log.step_metrics())  # reward_metric/<name>: what log_metric got
        unscored = torch.isnan(scores)
        n_unscored = int(D.all_reduce_sum(unscored.sum()))
        if n_unscored:  # TRL warns too; here the count, and what happens to them
            metrics["reward/unscored_fraction"] = D.sequence_mean(unscored.float())
            log.warning(
                "tether: warning: step %d: %d of %d samples were scored by no reward (it returned None); "
                "they are left out of the step's statistics (advantage 0%s)",
                step,
                n_unscored,
                self.cfg.rollout.batch_size,
                "; PPO: out of the update" if self.name == "ppo" else "",
            )
        return scores, metrics

    def rollout_forwards(self, rollout: Rollout, minibatches: list[Tensor]) -> RolloutLogprobs:
        """Step 4: old log-probs (+ values, the exact KL) and reference log-probs, no grad, in
        the groups of epoch 0's ``minibatches`` (with optim.reuse_forward in one pass: the
        update's own forward, whose graph step 7 reuses)."""
        c, run = self.cfg, self.run
        fit = self.ref_logits_fit(rollout)
        # every process stops together (one alone would leave the others in a collective): with
        # tool turns the environment's tokens can lengthen a step past the bound checked at start
        if self.divergence_leash and D.all_reduce_max(torch.tensor(float(not fit), device=self.device)) > 0:
            B, R = rollout.response_ids.shape
            raise ValueError(
                f"kl.divergence={c.kl.divergence} keeps the reference's logits of the step's rows, {B} x {R} "
                f"positions here, over the {REF_LOGITS_BYTES >> 30} GiB a process allows; lower "
                "rollout.batch_size or rollout.max_new_tokens, use more processes, or "
                "kl.divergence=reverse_kl"
            )
        with root_gathered(run.policy, run.reference):  # FSDP: blocks gathered one at a time
            forwards = old_and_ref_logprobs(
                run.policy,
                run.reference,
                rollout,
                c.rollout.temperature,
                minibatches,
                with_values=self.uses_values,
                exact_kl=c.kl.exact,
                exact_chunk_size=c.kl.exact_chunk_size,
                reuse_forward_of=self.model if self.reuse_forward else None,
                # the guard's measures reuse the reference's logits where they fit, else its
                # hidden states (then only its LM head runs again)
                keep_ref_logits=(self.guard is not None or self.divergence_leash) and fit,
                keep_ref_hidden=self.guard is not None and not fit,
                top_k=5 if self.attribution is not None else 0,  # the records' top-5 next tokens
                divergences_alpha=c.kl.alpha if c.kl.divergences else None,  # logged beside the KL
            )
        return forwards

    def check_ref_logits_bound(self) -> None:
        """Before the first step: the reference's logits a step keeps under ``kl.divergence`` (this
        process's rows x ``rollout.max_new_tokens`` x the vocabulary, float32) fit
        :data:`REF_LOGITS_BYTES`, or the run is refused now, not hours in (tool turns' environment
        tokens can add to it: each step checks again, every process together).

        Raises:
            ValueError: over the bound, naming what to lower.
        """
        c = self.cfg
        rows = c.rollout.batch_size // D.world_size()
        vocab = self.run.policy.lm.get_output_embeddings().weight.shape[0]
        need = rows * c.rollout.max_new_tokens * vocab * 4
        if need > REF_LOGITS_BYTES:
            raise ValueError(
                f"kl.divergence={c.kl.divergence} keeps the reference's logits of a step's rows: {rows} rows "
                f"x {c.rollout.max_new_tokens} positions x {vocab} ids x 4 bytes = {need / 2**30:.2f} GiB a "
                f"process, over the {REF_LOGITS_BYTES >> 30} GiB allowed; lower rollout.batch_size or "
                "rollout.max_new_tokens, use more processes, or kl.divergence=reverse_kl"
            )

    def ref_logits_fit(self, rollout: Rollout) -> bool:
        """Whether the reference's logits of this process's rows fit
        :data:`REF_LOGITS_BYTES` (float32, ``B * R * V``): the update guard then keeps them from
        step 4 for its measures, instead of the reference's hidden states and a head per measure."""
        B, R = rollout.response_ids.shape
        vocab = self.run.policy.lm.get_output_embeddings().weight.shape[0]
        return B * R * vocab * 4 <= REF_LOGITS_BYTES

    # ---- checkpointing ---------------------------------------------------------------------
    def state_dict(self, with_optimizer: bool = True) -> dict:
        """Optimizer, controller, minibatch RNG and data position (see :mod:`tether.run.checkpoint`)."""
        # without the optimizer: a sharded run's checkpoint holds it in its sharded files
        state = {"optimizer": self.optimizer.state_dict()} if with_optimizer else {}
        return state | {
            "controller": self.controller.state_dict(),
            "generator": self.generator.get_state(),
            "sampler": self.sampler.state_dict(),
            "leash_counts": dict(self.leash.counts),
            **({"kl_attribution": self.attribution.state_dict()} if self.attribution is not None else {}),
            **({"anchor": self.anchor.state_dict()} if self.anchor is not None else {}),
            **optimization_state(self),
        }

    def load_state_dict(self, state: dict, next_step: int | None = None) -> None:
        """Restore :meth:`state_dict`; ``next_step``: the step the resumed run trains first.

        The controller's and the optimizer's settings are the resumed config's (a change is
        printed): :meth:`restore_controller`, :func:`tether.trainers.common.restore_optimization`."""
        self.restore_controller(state["controller"])
        self.generator.set_state(state["generator"])
        self.sampler.load_state_dict(state["sampler"])
        self.leash.counts.update(state["leash_counts"])
        if self.attribution is not None and "kl_attribution" in state:  # a run from before it: none
            self.attribution.load_state_dict(state["kl_attribution"])
        restore_anchor(self.anchor, state.get("anchor"))
        restore_optimization(self, state, next_step)  # the optimizer, and its schedule resumed

    def restore_controller(self, saved: dict) -> None:
        """Carry on the checkpoint's controller (:meth:`tether.core.controllers.Controller.load_state_dict`:
        its state, under the resumed config's settings, or beta when kl.controller changed) and
        print what changed."""
        changes = self.controller.load_state_dict(saved)
        if changes:
            log.warning(
                "tether: resuming with %s; beta for the next step: %g",
                "; ".join(changes),
                self.controller.kl_coef,
            )

    # ---- to override -----------------------------------------------------------------------
    def extra_metrics(self, exp: Experience, kl_coef: float) -> dict:
        """Trainer-specific metrics of the step ({} here; GRPO logs its effective beta)."""
        return {}

    def minibatch_loss(self, mb: Experience, kl_coef: float, first_micro: bool = True) -> MicroLoss:
        """The loss of micro-batch ``mb`` (``exp.select(rows)``) under the current policy.

        ``first_micro``: the first micro-batch of its gradient step (the KL term is counted once
        per step). See :func:`tether.trainers.update.minibatch_update`.
        """
        raise NotImplementedError

    # ---- shared pieces ---------------------------------------------------------------------
    def policy_forward(self, mb: Experience) -> TokenStats:
        """Micro-batch ``mb``'s numbers under the current policy, with grad: (B_m, R) log-probs
        from the rows of step 4's forward that the record carries in reuse-forward mode
        (``mb.reused_logprobs``: one update of the whole batch, so each row's is used once), else
        :meth:`update_forward`'s (with the logits under ``kl.divergence``'s leash)."""
        if mb.reused_logprobs is not None:
            return TokenStats(logprobs=mb.reused_logprobs)
        return self.update_forward(mb)

    def divergence_inputs(self, mb: Experience, new: TokenStats) -> dict:
        """What the leash's loss term reads besides log-probs: under ``kl.divergence`` (not the
        reverse KL) the policy's logits of ``new`` and the reference's of ``mb``, else nothing."""
        if not self.divergence_leash:
            return {}
        return {"logits": new.logits, "ref_logits": mb.forwards.ref_logits}

    def update_forward(self, mb: Experience) -> TokenStats:
        """The policy's forward of micro-batch ``mb`` with grad (log-probs, and values when the
        trainer has a value head): the forward the update guard's lookahead kept, when it holds
        these very rows (:meth:`measure_ahead`; taken once), else a fresh one."""
        if self.kept_forward is not None:
            ids, kept = self.kept_forward
            self.kept_forward = None
            if ids.shape != mb.rollout.response_ids.shape or not torch.equal(ids, mb.rollout.response_ids):
                raise RuntimeError(
                    "tether: the update guard kept a forward of other rows than the update's first "
                    "micro-batch; this is a bug in tether (set kl.guard=false to go on)"
                )
            return kept
        return rollout_logprobs(
            self.model,
            mb.rollout,
            self.cfg.rollout.temperature,
            with_values=self.uses_values,
            keep_logits=self.divergence_leash,  # the leash's divergence reads them (with grad)
        )

    def measure_ahead(self, exp: Experience, forwards: RolloutLogprobs) -> tuple[float, float]:
        """The update guard's measure (:meth:`updated_kl`) from the next epoch's own forward: the
        policy's forward of the whole batch with grad, its detached logits against the reference's
        logits kept from step 4 (or its kept hidden states through its LM head, where the logits
        did not fit :data:`REF_LOGITS_BYTES`), and the forward kept for the next epoch's update
        (:meth:`update_forward`; one minibatch of every row, one micro-batch). The same numbers
        as :meth:`updated_kl`'s no-grad forward, one forward fewer per epoch."""
        c = self.cfg
        with torch.enable_grad():
            new = rollout_logprobs(
                self.model, exp.rollout, c.rollout.temperature, with_values=self.uses_values, keep_logits=True
            )
        logits = new.logits.detach()  # (B, R, V), held by the graph anyway
        if not self.divergence_leash:  # kl.divergence's loss term reads them, with grad
            new.logits = None
        self.kept_forward = (exp.rollout.response_ids, new)
        return self.measured_kl(exp, forwards, policy_logits=logits)

    def drop_kept_forward(self) -> None:
        """Frees a forward the guard's lookahead kept that no update will use."""
        self.kept_forward = None

    def lookahead(self, exp: Experience, forwards: RolloutLogprobs) -> Ahead | None:
        """The guard's lookahead (:class:`tether.trainers.guard.Ahead`) where the next epoch's first
        forward is the whole batch at the measured weights: two epochs or more, each one
        minibatch of every row (``optim.minibatch_size`` = ``rollout.batch_size``) in one
        micro-batch, and a policy that is not FSDP-sharded (its forward would gather every block
        for a graph the guard may drop). None elsewhere."""
        c, o = self.cfg, self.cfg.optim
        rows = exp.rollout.response_ids.shape[0]
        one_micro = o.micro_batch_size is None or o.micro_batch_size >= rows
        if o.epochs < 2 or o.minibatch_size != c.rollout.batch_size or not one_micro:
            return None
        if self.run.reference is None or is_sharded(self.run.policy) or is_sharded(self.run.reference):
            return None
        return Ahead(
            measure=partial(self.measure_ahead, exp, forwards),
            discard=self.drop_kept_forward,
            epochs=o.epochs,
        )

    def minibatch_indices(self) -> list[Tensor]:
        """This process's rows of each minibatch of an epoch (the same minibatches for any number
        of processes, see :func:`tether.core.distributed.stratified_minibatches`)."""
        return D.stratified_minibatches(
            self.cfg.rollout.batch_size, self.cfg.optim.minibatch_size, self.generator, device=self.device
        )

    def epoch_minibatches(self, exp: Experience) -> Iterator[Tensor]:
        """This process's rows of every minibatch of every epoch, in update order: epoch 0's are
        the groups step 4 scored; each later epoch draws new ones when it starts."""
        for epoch in range(self.cfg.optim.epochs):
            yield from exp.minibatches if epoch == 0 else self.minibatch_indices()

    def kl_reading(self, forwards: RolloutLogprobs, rollout: Rollout) -> float | None:
        """Step 5: the KL the batch was drawn at, as the controller reads it
        (:func:`tether.trainers.steps.kl_reading`), or None without a reference."""
        kl = None
        if forwards.ref_logprobs is not None:
            kl = estimate_kl(forwards.old_logprobs, forwards.ref_logprobs, self.settings.estimator)
        return kl_reading(
            kl=kl, exact_kl=forwards.exact_kl, mask=rollout.response_mask, settings=self.settings
        )

    def updated_kl(self, exp: Experience, forwards: RolloutLogprobs) -> tuple[float, float]:
        """The exact KL to the reference of the policy as its weights are now, on the step's batch
        (:func:`tether.trainers.steps.updated_kl`), in the controller's unit, with its standard
        error: a no-grad forward of the policy in the groups step 4 scored, against the reference's
        logits kept from step 4 (or its kept hidden states through its LM head, where the logits did
        not fit :data:`REF_LOGITS_BYTES`). The update guard's measure."""
        return self.measured_kl(exp, forwards)

    def measured_kl(
        self, exp: Experience, forwards: RolloutLogprobs, policy_logits: Tensor | None = None
    ) -> tuple[float, float]:
        """:meth:`updated_kl`'s numbers: the policy's exact per-position KL to the reference in
        the groups step 4 scored, reduced by :func:`tether.trainers.steps.updated_kl`. With
        ``policy_logits`` (B, R, V), the policy's logits of the whole batch already computed (the
        lookahead's forward, detached), its trunk does not run."""
        run, c = self.run, self.cfg
        B, R = exp.rollout.response_ids.shape
        exact = torch.zeros(B, R, device=self.device)
        with root_gathered(run.policy, run.reference):
            for idx in exp.minibatches or [torch.arange(B, device=self.device)]:
                _, _, kl = policy_and_reference_logprobs(
                    run.policy,
                    run.reference,
                    exp.rollout.select(idx),
                    c.rollout.temperature,
                    exact_kl=True,
                    policy_logits=policy_logits[idx] if policy_logits is not None else None,
                    kl_chunk_size=c.kl.exact_chunk_size,
                    ref_hidden=forwards.ref_hidden[idx] if forwards.ref_hidden is not None else None,
                    ref_logits=forwards.ref_logits[idx] if forwards.ref_logits is not None else None,
                )
                exact[idx] = kl
        return updated_kl(
            exact_kl=exact,
            mask=exp.rollout.response_mask,
            target_unit=self.settings.target_unit,
            group_size=self.group_size,
        )

    def update(
        self,
        exp: Experience,
        kl_coef: float,
        *,
        forwards: RolloutLogprobs | None = None,
    ) -> tuple[UpdateStats, GuardResult | None]:
        """Steps 9-10: epochs of minibatch steps (:func:`tether.trainers.update.minibatch_update`),
        each epoch checked by the update guard when ``kl.guard`` is on
        (:func:`tether.trainers.guard.guarded_epochs`; ``forwards``, step 4's, hold the exact KL
        the guard starts from, and the reference's kept hidden states its measures reuse).

        Each process holds ``minibatch_size / world`` rows of a minibatch. Its token-mean loss
        ``L_r`` times its share of the minibatch's valid tokens sums over processes to the
        token-mean loss of the whole minibatch; DDP averages the gradients, hence the factor
        ``world``. With ``optim.micro_batch_size`` the process's rows go through forward and
        backward in chunks, each loss scaled by its chunk's share of the minibatch's tokens
        (:func:`tether.core.distributed.token_shares`), the gradients accumulating until the one
        optimizer step: the same update, up to float summation order. The statistics (losses,
        clip fractions, approx_kl: token means) are reduced the same way, once at the end.

        Returns:
            ``(stats, guard)``: the update's statistics, and the guard's account (None without
            the guard).
        """
        o = self.cfg.optim
        self.kept_forward = None  # never a forward of another step's batch (a step that raised)
        run_minibatches = partial(
            minibatch_update,
            exp,
            minibatch_loss=partial(self.minibatch_loss, kl_coef=kl_coef),
            optimization=trainer_optimization(self, self.name),
            micro_batch_size=o.micro_batch_size,
            step_term=self.anchor.term if self.anchor is not None else None,
        )
        if self.guard is None or forwards is None or forwards.exact_kl is None:
            return run_minibatches(self.epoch_minibatches(exp)), None
        # where the guard starts: its own measure of the policy that drew the batch (the exact KL,
        # whatever kl.controller_signal the controller reads), so "no higher than the start" compares
        # like with like
        kl_before, _ = updated_kl(
            exact_kl=forwards.exact_kl,
            mask=exp.rollout.response_mask,
            target_unit=self.settings.target_unit,
            group_size=self.group_size,
        )
        epochs = (exp.minibatches if e == 0 else self.minibatch_indices() for e in range(o.epochs))
        masters = isinstance(self.optimizer, MasterWeights)
        return guarded_epochs(
            epochs,
            update=run_minibatches,
            tensors=self.optimizer.masters if masters else self.params,
            measure=partial(self.updated_kl, exp, forwards),
            kl_before=kl_before,
            settings=self.guard,
            written=self.optimizer.write_back if masters else lambda: None,
            ahead=self.lookahead(exp, forwards),
            store=self.snapshots,
        )

    def metrics(
        self, step: int, exp: Experience, forwards: RolloutLogprobs, update: UpdateStats, kl_coef: float
    ) -> dict:
        row = {
            "step": step,
            "samples": (step + 1) * self.cfg.rollout.batch_size,
            **sample_metrics(
                exp.rollout,
                exp.scores,
                kl=exp.kl,
                forwards=forwards,
                kl_coef=kl_coef,
                estimator=self.cfg.kl.estimator,
            ),
            "kl/applied_in_reward": self.leash.counts["reward"],
            "kl/applied_in_loss": self.leash.counts["loss"],
            "kl/reference_forwards": self.run.reference_forwards[0],
        }
        row.update(sampler_metrics(exp, forwards))
        row.update(update.metrics())
        row.update(self.extra_metrics(exp, kl_coef))
        return row


def sampler_metrics(exp: Experience, forwards: RolloutLogprobs) -> dict:
    """A low-precision sampler's distance from the learner and its correction, over every process
    ({} where the learner sampled):

    * ``rollout/sampler_kl_exact``: the exact KL(sampler || learner) over the vocabulary at each
      sampled position, token mean, nats per token (where the sampler's logits were kept,
      :data:`tether.models.sampling.SAMPLER_LOGITS_BYTES`); ``rollout/sampler_kl_max``, its
      largest at any position;
    * ``rollout/is_clipped_fraction``: the share of policy tokens whose weight is not the exact
      ratio learner / sampler (truncated by ``tis``, in a sequence ``mis`` dropped; for ``none``,
      whose ratio leaves ``[1 / cap, cap]``); ``rollout/is_weight_mean``, the weights' token mean
      (1 for an unbiased sampler; see :func:`tether.core.correction.correction_weights`).
    """
    c, mask, row = exp.forwards.correction, exp.rollout.response_mask, {}
    if forwards.sampler_kl is not None:
        kl = forwards.sampler_kl  # (B, R)
        row["rollout/sampler_kl_exact"] = D.token_mean(kl, mask)
        row["rollout/sampler_kl_max"] = D.token_max(kl, mask)
    if c is not None:
        row["rollout/is_clipped_fraction"] = D.token_mean(c.departed.float(), mask)
        row["rollout/is_weight_mean"] = D.token_mean(c.weights, mask)
    return row


def sample_metrics(
    rollout: Rollout,
    scores: Tensor,
    kl: Tensor | None,
    forwards: RolloutLogprobs,
    *,
    kl_coef: float,
    estimator: str,
) -> dict:
    """The ``objective/*``, ``response/*`` and ``rollout/*`` metrics of a batch of the policy's samples.

    ``response/distinct_2`` (distinct 2-grams over all 2-grams of the batch's responses, in words)
    and ``response/repetition`` (mean share of a response's 3-grams that repeat an earlier one)
    follow what the leash protects from step to step (:mod:`tether.core.diversity`); step 0's
    are the reference's own.

    Every value is over the global batch (all processes): per-token values are token-weighted
    means, per-sequence values means over sequences, the score's spread the global standard
    deviation (:mod:`tether.core.distributed`; in one process these are the plain batch statistics).

    Args:
        rollout: the samples; its ``response_mask`` (B, R) masks every per-token value.
        scores: (B,) scorer values, NaN on an unscored sample (left out of the score's mean, its
            spread and ``objective/rlhf_reward``; its KL and entropy count).
        kl: (B, R) per-token KL estimate (nats), or None without a reference.
        forwards: the learner's forwards of the samples
            (:class:`tether.trainers.common.RolloutLogprobs`): its ``entropy`` (B, R) nats, its
            ``exact_kl`` (B, R) exact per-token KL or None, and its ``old_logprobs`` (B, R), the
            log-probs the update's ratio starts from, nats. With the sampler's own
            (``rollout.sampler_logprobs``) those give ``rollout/logprob_mismatch``: the k3 estimate
            of KL(sampler || learner) on the sampled tokens, nats per token (0 when both compute
            the same numbers; the seeds' "precision mismatch" bug made visible), and
            ``rollout/logprob_diff_max``, the largest ``|sampler - learner|`` log-prob difference
            of any valid token.
        kl_coef: beta of this step.
        estimator: name of the estimator behind ``kl``.
    """
    entropy, exact_kl, logprobs = forwards.entropy, forwards.exact_kl, forwards.old_logprobs
    mask = rollout.response_mask
    # the objective's two terms per sequence, whatever the placement: J = score - beta * KL
    non_score = -kl_coef * sequence_kl(kl, mask) if kl is not None else torch.zeros_like(scores)  # (B,)
    scored = ~torch.isnan(scores)  # (B,) an unscored sample (NaN) counts in no score statistic
    row = {"objective/kl_coef": kl_coef}
    if bool(D.all_reduce_min(scored.all().float())):
        row["objective/scores"], row["objective/scores_std"] = D.sequence_mean(scores), D.sequence_std(scores)
        rlhf_reward = D.sequence_mean(scores + non_score)
    elif (n_scored := float(D.all_reduce_sum(scored.sum()))) > 0:
        row["objective/scores"] = D.token_mean(scores, scored)
        if n_scored >= 2:  # one scored sample has no spread (a 0 would read as one)
            row["objective/scores_std"] = D.sequence_std(scores[scored])
        rlhf_reward = D.token_mean(scores + non_score, scored)
    else:  # no sample of the step was scored: no score to log (a 0 would read as one)
        rlhf_reward = None
    row["objective/non_score_reward"] = D.sequence_mean(non_score)
    if rlhf_reward is not None:
        row["objective/rlhf_reward"] = rlhf_reward
    row["objective/entropy"] = D.token_mean(entropy, mask)
    row["response/length"] = D.sequence_mean(mask.sum(-1).float())
    for name, values in rollout.turn_metrics().items():  # a multi-turn rollout: rollout/env_tokens
        row[f"rollout/{name}"] = D.sequence_mean(values)
    if row.get("rollout/tool_calls"):  # TRL's tools/failure_frequency: failed calls / calls
        row["rollout/tool_failure_fraction"] = row["rollout/tool_failures"] / row["rollout/tool_calls"]
    # diversity of the batch's responses (words, tether.core.diversity), over all processes
    texts = [t for part in D.gather_objects(list(rollout.own_texts)) for t in part]  # the policy's
    row["response/distinct_2"] = distinct_n(texts, 2)
    reps = [v for v in map(repetition, texts) if v is not None]
    if reps:
        row["response/repetition"] = sum(reps) / len(reps)
    if rollout.ended is not None:
        row["response/eos_fraction"] = D.sequence_mean(rollout.ended.float())
    if kl is not None:
        kls = D.kl_stats(kl, mask)
        row["objective/kl"] = kls["kl_per_sequence"]
        row["objective/kl_per_token"] = kls["kl_per_token"]
        if estimator == "k1":
            row["objective/k1_negative_fraction"] = D.token_mean((kl < 0).float(), mask)
    if exact_kl is not None:
        row["objective/kl_exact"] = D.sequence_mean(sequence_kl(exact_kl, mask))
        row["objective/kl_exact_per_token"] = D.token_mean(exact_kl, mask)
    if forwards.divergences is not None:  # kl.divergences: the others, on the same positions
        for name, value in zip(("forward_kl", "js", "alpha"), forwards.divergences):
            row[f"objective/{name}_exact"] = D.sequence_mean(sequence_kl(value, mask))
    if logprobs is not None and rollout.sampler_logprobs is not None:
        sampler = rollout.sampler_logprobs  # (B, R) the distribution the tokens were drawn from
        row["rollout/logprob_mismatch"] = D.token_mean(kl_k3(sampler, logprobs), mask)
        row["rollout/logprob_diff_max"] = D.token_max((sampler - logprobs).abs(), mask)
    return row


def reward_components(parts: dict[str, list[float]], device: torch.device | str = "cpu") -> dict:
    """``reward/<name>``: each reward's mean over the samples it scored (all processes), for a
    reward list's ``parts`` (:class:`tether.judges.contract.Scores`; {} for one scorer: {})."""
    out = {}
    for name, values in parts.items():
        v = torch.tensor(values, dtype=torch.float32, device=device)  # (B,), NaN where None
        scored = ~torch.isnan(v)
        if float(D.all_reduce_sum(scored.sum())) > 0:  # a reward that scored nothing logs nothing
            out[f"reward/{name}"] = D.token_mean(torch.where(scored, v, 0.0), scored)
    return out
