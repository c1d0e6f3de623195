"""What every trainer shares: the optimizer and scoring rollouts (the update loop: :mod:`.update`)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from tether.core import distributed as D
from tether.core.divergences import Divergences
from tether.models.sampling import Rollout
from tether.models.scoring import TokenStats, policy_and_reference_logprobs, rollout_logprobs
from tether.trainers.precision import MasterWeights
from tether.trainers.steps import Forwards
from tether.trainers.update import Optimization

# the update loop's pieces live in tether.trainers.update (torch only, shared with the test bed)


class UnmeasuredUpdate(Exception):
    """User code (the reward, the environment) failed in what a step measures after its update
    (DPO's probe): the update is applied, and the step is kept. The training loop logs ``row``
    (the step's metrics without that measurement), checkpoints the step and raises ``error``
    (:func:`tether.run.lifecycle.raise_unmeasured`).

    Attributes:
        error: the user code's failure (a ``ScorerStopped``, ``ScorerFailed`` or ``EnvFailed``).
        row: the step's metrics row without the measurement.
        missing: what the row lacks, in words (``its probe's metrics``).
    """

    def __init__(self, error: BaseException, row: dict, missing: str):
        super().__init__(str(error))
        self.error, self.row, self.missing = error, row, missing


def make_optimizer(params: list, lr: float, weight_decay: float, fused: bool = True) -> MasterWeights:
    """AdamW (Loshchilov & Hutter 2019) over ``params``; torch's fused kernel when ``fused``.

    Wrapped in :class:`tether.trainers.precision.MasterWeights`: AdamW steps float32 masters of
    bfloat16 or float16 weights (float32 weights are their own masters, plain AdamW). The fused
    kernel updates each weight, its gradient and both moments in one pass (CPU and CUDA); it
    falls back to the per-tensor loop where a parameter's device has no fused kernel.
    """
    fused = fused and all(p.device.type in ("cpu", "cuda") for p in params)
    return MasterWeights(
        params,
        lambda masters: torch.optim.AdamW(masters, lr=lr, weight_decay=weight_decay, fused=fused or None),
    )


def make_scheduler(
    optimizer: MasterWeights | torch.optim.Optimizer, name: str, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """transformers' ``get_scheduler(name)`` over ``optimizer``'s learning rate: ``constant``
    (after a linear warmup of ``warmup_steps`` optimizer steps), ``linear`` or ``cosine`` decay to
    0 over ``total_steps`` optimizer steps."""
    from transformers import get_scheduler

    inner = optimizer.optimizer if isinstance(optimizer, MasterWeights) else optimizer
    kind = "constant_with_warmup" if name == "constant" else name
    return get_scheduler(kind, inner, num_warmup_steps=warmup_steps, num_training_steps=max(total_steps, 1))


def apply_optim_settings(
    optimizer: MasterWeights | torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    lr: float,
    weight_decay: float,
    fused: bool,
) -> dict[str, tuple]:
    """Put a resumed run's optimizer settings over the state its checkpoint loaded.

    ``Optimizer.load_state_dict`` restores every param group's hyperparameters (``lr``,
    ``initial_lr``, ``weight_decay``, ``fused``) and ``LambdaLR.load_state_dict`` the schedule's
    ``base_lrs`` and last rate, all the checkpoint's: without this a run resumed with
    ``optim.lr=...`` goes on at the old rate (prime-rl PRs #1095 and #2088 fix the same bug).
    With ``n = scheduler.last_epoch`` (the optimizer steps taken so far) and ``lambda`` the
    schedule's multiplier (``scheduler`` is the new schedule: name, warmup, total), every param
    group gets::

        initial_lr = lr    lr = lr * lambda(n)    weight_decay = weight_decay    fused = fused

    and ``scheduler.base_lrs = [lr, ...]``: the next optimizer step runs at ``lr * lambda(n)`` and
    ``scheduler.step()`` after it sets ``lr * lambda(n + 1)``, the rates of a run that had these
    settings from its start (the same float expression as ``LambdaLR.get_lr``, so an unchanged
    resume is bit for bit the uninterrupted run). AdamW's moments and step counts are kept; with
    ``fused`` changed each step count moves where that kernel keeps it (the parameter's device
    for the fused kernel, the host for the per-tensor loop).

    Args:
        optimizer: AdamW, or :class:`MasterWeights` over it, with the checkpoint's state loaded.
        scheduler: the new schedule over ``optimizer``, at the checkpoint's position.
        lr: optim.lr, the schedule's peak rate (> 0).
        weight_decay: optim.weight_decay (>= 0).
        fused: whether AdamW runs its fused kernel.

    Returns:
        ``{name: (loaded, now)}`` for each of ``lr``, ``weight_decay``, ``fused`` and ``next_lr``
        (the rate of the next optimizer step) that changed.
    """
    inner = optimizer.optimizer if isinstance(optimizer, MasterWeights) else optimizer
    group = inner.param_groups[0]
    loaded = {
        "lr": scheduler.base_lrs[0],  # the checkpoint's (its state_dict restored them)
        "weight_decay": group["weight_decay"],
        "fused": bool(group.get("fused")),
        "next_lr": scheduler.get_last_lr()[0],  # the rate the checkpoint's schedule had next
    }
    n = scheduler.last_epoch
    scheduler.base_lrs = [lr] * len(inner.param_groups)
    for g, lmbda in zip(inner.param_groups, scheduler.lr_lambdas):
        g["initial_lr"], g["lr"], g["weight_decay"] = lr, lr * lmbda(n), weight_decay
        if bool(g.get("fused")) != fused:
            g["fused"] = fused or None  # as make_optimizer builds it: None, the per-tensor loop
            for p in g["params"]:
                if "step" in inner.state.get(p, {}):
                    step = inner.state[p]["step"]  # () float32
                    inner.state[p]["step"] = step.to(p.device if fused or g.get("capturable") else "cpu")
    scheduler._last_lr = [g["lr"] for g in inner.param_groups]
    now = {"lr": lr, "weight_decay": weight_decay, "fused": fused, "next_lr": group["lr"]}
    return {k: (loaded[k], now[k]) for k in loaded if loaded[k] != now[k]}


class ResumedSchedule(NamedTuple):
    """The learning-rate schedule a resumed run goes on with, and what changed on the way."""

    scheduler: torch.optim.lr_scheduler.LambdaLR
    total_steps: int
    """Optimizer steps the schedule runs over (its decay reaches 0 after the last)."""
    changes: list[str]
    """``"name old -> new"`` for each setting that changed (empty: none)."""


def resume_schedule(
    optimizer: MasterWeights | torch.optim.Optimizer,
    saved: dict,
    settings: dict,
    per_step: int,
    train_steps: int,
    *,
    next_step: int | None,
    fused: bool,
) -> ResumedSchedule:
    """The schedule of the resumed config at the checkpoint's position, its settings applied.

    The schedule's total is the optimizer steps the saved schedule planned for the steps done
    plus those the steps left take now::

        total = saved_total - (saved_train_steps - next_step) * saved_per_step
                + max(train_steps - next_step, 0) * per_step

    so an unchanged resume keeps the saved total exactly; a larger train.steps gives the total
    an uninterrupted run of that length has (a linear or cosine decay stretches: the rate jumps
    up to that run's curve at the next step); a changed optim.epochs or optim.minibatch_size
    counts the steps left at the new rate, so the decay still ends at the run's last step.
    A checkpoint from before the saved record (``saved["schedule"]``), or no ``next_step``:
    ``train_steps * per_step``. Then :func:`apply_optim_settings`.

    Args:
        optimizer: with the checkpoint's state loaded.
        saved: the trainer's checkpoint state; reads ``scheduler`` (LambdaLR's state_dict: the
            position ``last_epoch``), ``schedule`` (``total_steps``, ``train_steps``,
            ``per_step``) and ``optim`` (the optim settings it ran with), each if present.
        settings: the resumed run's optim settings (``dataclasses.asdict`` of them): ``lr``,
            ``weight_decay``, ``lr_scheduler``, ``warmup_steps`` are read.
        per_step: optimizer steps per training step now.
        train_steps: train.steps now.
        next_step: the first step the resumed run trains (None: not known).
        fused: whether AdamW runs its fused kernel now.
    """
    old = saved.get("schedule")
    if old is None or next_step is None:
        total = train_steps * per_step
    else:
        total = (
            old["total_steps"]
            - (old["train_steps"] - next_step) * old["per_step"]
            + max(train_steps - next_step, 0) * per_step
        )
    scheduler = make_scheduler(optimizer, settings["lr_scheduler"], settings["warmup_steps"], total)
    if "scheduler" in saved:  # else a checkpoint from before optim.lr_scheduler: position 0
        scheduler.load_state_dict(saved["scheduler"])  # the position, last_epoch
    applied = apply_optim_settings(optimizer, scheduler, settings["lr"], settings["weight_decay"], fused)
    # what the run had: its saved settings, or (older checkpoints) what its optimizer state says
    names = {"lr": "lr", "weight_decay": "weight_decay", "fused": "fused_adamw"}
    before = saved.get("optim") or {names[k]: v for k, (v, _) in applied.items() if k in names}
    changes = [
        f"{k} {_shown(before[k])} -> {_shown(v)}" for k, v in settings.items() if before.get(k, v) != v
    ]
    if old is not None and total != old["total_steps"] and settings["lr_scheduler"] != "constant":
        changes.append(f"schedule over {old['total_steps']} -> {total} optimizer steps")
    if "next_lr" in applied:
        changes.append("the next optimizer step's rate {} -> {}".format(*map(_shown, applied["next_lr"])))
    return ResumedSchedule(scheduler, total, changes)


def _shown(value) -> str:
    """A setting as a change line shows it: floats in %g, None as null."""
    return "null" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


@dataclass
class RolloutLogprobs:
    """No-grad quantities of a rollout, each (B, R) float32."""

    old_logprobs: Tensor
    ref_logprobs: Tensor | None
    """None when no reference model is built."""
    values: Tensor | None
    entropy: Tensor
    exact_kl: Tensor | None
    update_forward: TokenStats | None = None
    """The policy's forward with its autograd graph, when ``old_and_ref_logprobs`` was given a
    ``reuse_forward_of`` (one minibatch): the update differentiates it instead of a second forward."""
    ref_hidden: Tensor | None = None
    """(B, R, d) the reference's last hidden states at the response positions, when asked
    (``keep_ref_hidden``: the update guard's measures run the LM head on them, not the trunk)."""
    ref_logits: Tensor | None = None
    """(B, R, V) the reference's logits at the response positions, when asked
    (``keep_ref_logits``, where they fit: the guard's measures then run neither its trunk nor its
    LM head)."""
    top: dict[str, tuple[Tensor, Tensor]] | None = None
    """``{"policy": (ids, logprobs), "reference": (ids, logprobs)}``, each (B, R, k): the models'
    k most likely next tokens at each position and their log-probs (nats), when asked (``top_k``:
    the KL attribution)."""
    divergences: Divergences | None = None
    """The forward KL, JS and alpha-divergence at each position (each (B, R), nats), when asked
    (``divergences_alpha``: ``kl.divergences``)."""
    sampler_kl: Tensor | None = None
    """(B, R) the exact KL(sampler || learner) at each position, nats, where the rollout kept its
    low-precision sampler's logits (``Rollout.sampler_logits``), else None."""

    def step_forwards(
        self, with_ref_logits: bool = False, sampler_logprobs: Tensor | None = None
    ) -> Forwards:
        """What steps 5 to 7 read of these (:class:`tether.trainers.steps.Forwards`): the old and
        reference log-probs, the values, the exact KL and, with ``update_forward``, its log-probs
        with grad (``optim.reuse_forward``: step 7's only update differentiates them);
        ``with_ref_logits``: the reference's kept logits too (``kl.divergence``'s leash);
        ``sampler_logprobs``: the rollout's own, where a sampler that is not the learner drew it
        (``rollout.dtype=bf16``: the update's importance weights come from them)."""
        return Forwards(
            old_logprobs=self.old_logprobs,
            ref_logprobs=self.ref_logprobs,
            values=self.values,
            exact_kl=self.exact_kl,
            reused_logprobs=self.update_forward.logprobs if self.update_forward is not None else None,
            ref_logits=self.ref_logits if with_ref_logits else None,
            sampler_logprobs=sampler_logprobs,
        )


@torch.no_grad()
def old_and_ref_logprobs(
    policy: nn.Module,
    reference: nn.Module | None,
    rollout: Rollout,
    temperature: float,
    row_chunks: list[Tensor],
    *,
    with_values: bool,
    exact_kl: bool,
    exact_chunk_size: int = 256,
    reuse_forward_of: nn.Module | None = None,
    keep_ref_hidden: bool = False,
    top_k: int = 0,
    keep_ref_logits: bool = False,
    divergences_alpha: float | None = None,
) -> RolloutLogprobs:
    """Policy and reference log-probabilities (and values, entropy, exact KL) of a rollout.

    Rows are scored in the groups ``row_chunks`` (index tensors covering every row once), so the
    first PPO minibatch sees exactly the inputs its old log-probabilities came from and the
    ratio at step 0 is exactly 1. No-grad logits are held for one LM-head slice at a time
    (:func:`tether.models.scoring.policy_and_reference_logprobs`), never for a whole group.

    With ``reuse_forward_of`` (the module the update differentiates; one group only) the policy's
    forward runs with autograd on and is returned as ``update_forward``; the old log-probs, entropy and
    exact KL are its detached values, the same numbers a no-grad forward gives.
    ``top_k``: also each model's ``top_k`` most likely next tokens at each position (``top``).
    ``keep_ref_logits``: also the reference's logits (B, R, V) (``ref_logits``).
    ``divergences_alpha``: with the exact KL, also the other divergences (``divergences``).
    """
    B, R = rollout.response_ids.shape
    exact_kl = exact_kl and reference is not None
    if reuse_forward_of is not None and len(row_chunks) != 1:
        raise ValueError(f"reuse_forward_of needs one row group, got {len(row_chunks)}")
    device = rollout.response_ids.device
    out = {k: torch.zeros(B, R, device=device) for k in ("old", "ref", "values", "entropy", "exact")}
    update_forward = policy_logits = ref_hidden = ref_logits = sampler_kl = None
    divergences: Divergences | None = None
    tops: dict[str, tuple[Tensor, Tensor]] = {}
    for idx in row_chunks:
        part = rollout.select(idx)
        if reuse_forward_of is not None:
            with torch.enable_grad():
                update_forward = rollout_logprobs(reuse_forward_of, part, temperature, keep_logits=True)
            policy_logits = update_forward.logits.detach()  # (B, R, V), held by the graph anyway
            update_forward.logits = None  # the graph keeps what the backward needs; drop the reference to it
        pol, ref, exact = policy_and_reference_logprobs(
            policy,
            reference,
            rollout=part,
            temperature=temperature,
            with_values=with_values,
            exact_kl=exact_kl,
            policy_logits=policy_logits,
            kl_chunk_size=exact_chunk_size,
            keep_ref_hidden=keep_ref_hidden,
            top_k=top_k,
            keep_ref_logits=keep_ref_logits,
            divergences_alpha=divergences_alpha,
            with_sampler_kl=True,  # rollout/sampler_kl_exact, where the sampler's logits were kept
        )
        if ref is not None and ref.divergences is not None:
            if divergences is None:
                divergences = Divergences(*(torch.zeros(B, R, device=device) for _ in Divergences._fields))
            for whole, part in zip(divergences, ref.divergences):
                whole[idx] = part
        if keep_ref_logits and ref is not None and ref.logits is not None:
            if ref_logits is None:
                ref_logits = ref.logits.new_empty(B, R, ref.logits.shape[-1])  # (B, R, V)
            ref_logits[idx] = ref.logits
        for who, stats in (("policy", pol), ("reference", ref)):
            if stats is not None and stats.top_ids is not None:
                if who not in tops:
                    k = stats.top_ids.shape[-1]
                    tops[who] = (
                        stats.top_ids.new_empty(B, R, k),
                        stats.top_logprobs.new_empty(B, R, k),
                    )
                tops[who][0][idx], tops[who][1][idx] = stats.top_ids, stats.top_logprobs
        if keep_ref_hidden and ref is not None and ref.hidden is not None:
            if ref_hidden is None:
                ref_hidden = ref.hidden.new_empty(B, R, ref.hidden.shape[-1])  # (B, R, d)
            ref_hidden[idx] = ref.hidden
        out["old"][idx], out["entropy"][idx] = pol.logprobs, pol.entropy
        if pol.sampler_kl is not None:
            if sampler_kl is None:
                sampler_kl = torch.zeros(B, R, device=device)
            sampler_kl[idx] = pol.sampler_kl
        if with_values:
            out["values"][idx] = pol.values
        if reference is not None:
            out["ref"][idx] = ref.logprobs
        if exact_kl:
            out["exact"][idx] = exact
    return RolloutLogprobs(
        out["old"],
        out["ref"] if reference is not None else None,
        values=out["values"] if with_values else None,
        entropy=out["entropy"],
        exact_kl=out["exact"] if exact_kl else None,
        update_forward=update_forward,
        ref_hidden=ref_hidden,
        ref_logits=ref_logits,
        top=tops or None,
        divergences=divergences,
        sampler_kl=sampler_kl,
    )


log = logging.getLogger(__name__)


def trainer_optimization(trainer, name: str) -> Optimization:
    """A trainer's :class:`tether.trainers.update.Optimization` as it stands: its optimizer,
    trainable parameters, accelerator, wrapped model and schedule (a resume replaces the schedule:
    :func:`restore_optimization`), and ``optim.max_grad_norm``; ``name`` for messages."""
    return Optimization(
        optimizer=trainer.optimizer,
        params=trainer.params,
        max_grad_norm=trainer.cfg.optim.max_grad_norm,
        name=name,
        accelerator=trainer.accelerator,
        model=trainer.model,
        scheduler=trainer.scheduler,
    )


def optimization_state(trainer) -> dict:
    """What :func:`restore_optimization` reads back, beside the optimizer's own state: the
    scheduler's position, the optim settings the run has (a resume with other ones says what
    changed) and the schedule's length with the train.steps and optimizer steps per step it was
    planned for."""
    return {
        "scheduler": trainer.scheduler.state_dict(),
        "optim": dataclasses.asdict(trainer.cfg.optim),
        "schedule": {
            "total_steps": trainer.schedule_steps,
            "train_steps": trainer.cfg.train.steps,
            "per_step": trainer.per_step,
        },
    }


def restore_optimization(trainer, state: dict, next_step: int | None) -> None:
    """Resume a trainer's optimization from its checkpoint state: load the optimizer's state
    (unless a sharded checkpoint's files held it), then set ``trainer.scheduler`` and
    ``trainer.schedule_steps`` by :func:`resume_schedule` with the run's optim settings. What
    changed is logged once, on rank 0.

    Args:
        trainer: a PPO, GRPO, RLOO or DPO trainer (``optimizer``, ``cfg``, ``per_step``, ``fused``).
        state: the trainer's checkpoint state.
        next_step: the step the run resumes at (None: as :func:`resume_schedule`).
    """
    if "optimizer" in state:  # else loaded from a sharded checkpoint's files
        trainer.optimizer.load_state_dict(state["optimizer"])
    resumed = resume_schedule(
        trainer.optimizer,
        state,
        settings=dataclasses.asdict(trainer.cfg.optim),
        per_step=trainer.per_step,
        train_steps=trainer.cfg.train.steps,
        next_step=next_step,
        fused=trainer.fused,
    )
    trainer.scheduler, trainer.schedule_steps = resumed.scheduler, resumed.total_steps
    if resumed.changes and D.is_main():
        log.warning("tether: resuming with optim settings changed (%s)", ", ".join(resumed.changes))
