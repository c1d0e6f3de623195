"""The minibatch update every trainer runs: micro-batches, weighted losses, one optimizer step each.

Torch and :mod:`tether.core` only (no models, no config), so the tabular test bed
(:mod:`tether.testing.testbed`) runs this very loop on its logit tables.

A trainer hands :func:`minibatch_update` a *record* (its batch: an
:class:`tether.trainers.steps.Experience` for PPO, GRPO and RLOO, the preference pairs for DPO),
the rows of each minibatch, a hook ``minibatch_loss(part, first_micro=...) -> MicroLoss`` and
its :class:`Optimization` (the optimizer, its clipping, schedule and processes).
The record says how a micro-batch is weighted (its ``share_by``):

* ``"tokens"``: the loss is a token mean over ``response_mask`` (PPO, GRPO, RLOO); a micro-batch
  weighs its fraction of the minibatch's valid tokens over every process
  (:func:`tether.core.distributed.token_shares`);
* ``"rows"``: the loss is a mean over rows (DPO: pairs); a micro-batch weighs its fraction of the
  minibatch's rows over every process.

A micro-batch's loss times its share sums, over micro-batches and processes, to the loss of the
whole minibatch; DDP averages gradients over processes, hence the extra factor ``world``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from tether.core import distributed as D
from tether.trainers.precision import MasterWeights

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch import nn

log = logging.getLogger(__name__)


class MicroLoss(NamedTuple):
    """What a trainer's ``minibatch_loss`` hook returns for one micro-batch."""

    loss: Tensor
    """scalar with grad: the micro-batch's mean loss (token mean or row mean, see ``share_by``)."""
    stats: dict[str, Tensor]
    """logged statistics, each a scalar mean over the micro-batch (losses in nats or reward units,
    clip fractions in [0, 1])."""
    ratio_dev: Tensor | None = None
    """scalar ``max_t |pi / pi_old - 1|`` over the valid tokens (on-policy only), else None."""


StepTerm = Callable[[], tuple[MicroLoss, "Tensor | float"]]
"""A term added once to every optimizer step's loss (the text anchor,
:meth:`tether.trainers.anchor.TextAnchor.term`): it returns its :class:`MicroLoss`, a mean over
this process's part of its own batch, and that part's share of the batch over every process."""


class UpdateStats(NamedTuple):
    """What :func:`minibatch_update` returns: every value is the same on every process."""

    stats: dict[str, float]
    """each statistic's mean over the gradient steps, each step's value the minibatch's (all
    processes)."""
    grad_norm: float
    """the mean over gradient steps of the global gradient norm before clipping."""
    first_ratio_dev: float | None
    """``max |ratio - 1|`` over the first minibatch (before any update, exactly 0 when the old
    log-probs were scored as the update scores them), or None when the hook gives no ratio."""
    steps: int = 0
    """The optimizer steps taken (what the means are over)."""
    skipped: int = 0
    """Minibatches with no valid token on any process: no step taken (:func:`nothing_to_learn`)."""

    def metrics(self) -> dict[str, float]:
        """The logged row: the statistics (sorted by name), ``optim/skipped_steps`` when a
        minibatch was skipped, ``policy/grad_norm`` and, when there is one,
        ``policy/ratio_max_dev_first``."""
        row = {**self.stats}
        if self.skipped:
            row["optim/skipped_steps"] = float(self.skipped)
        row["policy/grad_norm"] = self.grad_norm
        if self.first_ratio_dev is not None:
            row["policy/ratio_max_dev_first"] = self.first_ratio_dev
        return row


@dataclass(frozen=True, kw_only=True)
class Optimization:
    """How a trainer takes its optimizer steps, by name: what :func:`optimizer_step` needs besides
    the loss (:func:`tether.trainers.common.trainer_optimization` builds it).

    Attributes:
        optimizer: the optimizer (or :class:`tether.trainers.precision.MasterWeights`).
        params: the trainable parameters, whose gradient norm is clipped.
        max_grad_norm: the clip of the global gradient norm (``optim.max_grad_norm``).
        name: the trainer's name, for messages.
        accelerator, model: accelerate's handle and the module it wraps (DDP), or None.
        scheduler: the learning-rate schedule, stepped once per optimizer step, or None.
    """

    optimizer: torch.optim.Optimizer | MasterWeights
    params: list
    max_grad_norm: float
    name: str
    accelerator: Accelerator | None = None
    model: nn.Module | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None


def optimizer_step(
    optimizer: torch.optim.Optimizer | MasterWeights,
    params: list,
    loss: Tensor | Sequence[Callable[[], Tensor]],
    max_grad_norm: float,
    name: str,
    *,
    accelerator: Accelerator | None = None,
    model: nn.Module | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> Tensor:
    """Backward, clip the global gradient norm, refuse a non-finite one, step; returns the norm.

    ``loss`` is the minibatch's loss, or one callable per micro-batch (``optim.micro_batch_size``)
    returning that micro-batch's share of it: each runs its forward and backward in turn, the
    gradients add up, and the optimizer steps once, as for the whole minibatch (gradient
    accumulation). With an ``accelerator`` the backward and the clipping are accelerate's: under
    DDP the backward all-reduces (averages) the gradients over the processes, so every process
    clips and steps with the same gradient; with micro-batches only the last one all-reduces
    (``accelerator.no_sync(model)`` around the others).

    With a :class:`tether.trainers.precision.MasterWeights` optimizer (low-precision weights) the
    loss is multiplied by its loss scale, the gradients move to the float32 masters (after every
    micro-batch in one process, after the last under DDP), and the norm is that of the float32
    gradients; a float16 step whose gradients overflow is skipped and its loss scale halved.
    A learning-rate ``scheduler`` steps after each optimizer step taken (not after a skipped one).

    Raises:
        FloatingPointError: the gradient norm is NaN or inf (the step is not taken, so the
            weights and the last checkpoint stay good).
    """
    master = optimizer if isinstance(optimizer, MasterWeights) else None
    scale = master.loss_scale if master is not None else 1.0
    distributed = accelerator is not None and accelerator.num_processes > 1
    optimizer.zero_grad(set_to_none=True)
    parts = [lambda: loss] if torch.is_tensor(loss) else list(loss)
    for i, part in enumerate(parts):
        defer = accelerator is not None and model is not None and i < len(parts) - 1
        with _no_sync(accelerator, model) if defer else nullcontext():
            last = part()
            scaled = last * scale if scale != 1.0 else last
            if accelerator is None:
                scaled.backward()
            else:
                accelerator.backward(scaled)
        if master is not None and (not distributed or i == len(parts) - 1):
            master.accumulate()  # float32 sums; under DDP after the all-reduce of the last one
    clipped = master.masters if master is not None else params
    if accelerator is None:
        grad_norm = torch.nn.utils.clip_grad_norm_(clipped, max_grad_norm, foreach=True)
    else:
        grad_norm = accelerator.clip_grad_norm_(clipped, max_grad_norm)
    if isinstance(grad_norm, DTensor):  # FSDP: the norm over every process's shards, made whole
        grad_norm = grad_norm.full_tensor()
    if not torch.isfinite(grad_norm):
        if master is not None and master.overflowed():
            log.warning(
                "tether: float16 gradients overflowed in the %s update; step skipped, loss scale now %g",
                name,
                master.loss_scale,
            )
            return grad_norm
        raise FloatingPointError(
            f"non-finite gradient norm {float(grad_norm)} in the {name} update "
            f"(loss {float(last.detach())}); stopping before the weights change"
        )
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    # free the gradients now, not at the next step's zero_grad: otherwise a full copy of the
    # trainable weights stays resident through the next generation and forward, the step's peak
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


@contextmanager
def _no_sync(accelerator: Accelerator, model: nn.Module) -> Iterator[None]:
    """Gradients of this backward kept local (summed into the next): DDP's ``no_sync`` through
    accelerate, or for an FSDP2 module (``train.sharding=fsdp``) no reduce-scatter until the last."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with accelerator.no_sync(model):
            yield


def micro_batches(rows: Tensor, micro_batch_size: int | None) -> list[Tensor]:
    """``rows`` (this process's rows of a minibatch) in consecutive chunks of
    ``micro_batch_size`` (``optim.micro_batch_size``); one chunk when it is None."""
    return [rows] if micro_batch_size is None else list(rows.split(micro_batch_size))


def micro_shares(parts: Sequence) -> list[Tensor] | list[float]:
    """Each micro-batch's fraction of its minibatch (over every process), as its record weighs it.

    Args:
        parts: this process's micro-batches of one minibatch, records with ``share_by``:
            ``"tokens"`` (and a (B_m, R) bool ``mask``) or ``"rows"`` (and ``num_rows``).

    Returns:
        ``"tokens"``: float32 scalars ``n_tokens(part) / n_tokens(minibatch)``
        (:func:`tether.core.distributed.token_shares`, one all-reduce); ``"rows"``: floats
        ``n_rows(part) / n_rows(minibatch)``, the minibatch split evenly over the processes
        (:func:`tether.core.distributed.shard`), so no communication. Either sums to this
        process's share of the minibatch, 1 in one process.
    """
    if parts[0].share_by == "tokens":
        return D.token_shares([p.mask for p in parts])
    total = sum(p.num_rows for p in parts) * D.world_size()
    return [p.num_rows / total for p in parts]


def nothing_to_learn(parts: Sequence) -> bool:
    """Whether a minibatch holds no valid token on any process (``share_by == "tokens"``: e.g.
    PPO's minibatch of unscored samples, which its update mask leaves out). Its loss would be 0,
    and an optimizer step would still move the weights by the optimizer's momentum and weight
    decay: no step is taken (one all-reduce, so every process agrees). A row-shared record
    (DPO's pairs) always has something."""
    if parts[0].share_by != "tokens":
        return False
    local = sum(int(p.mask.sum()) for p in parts)
    return (
        float(D.all_reduce_sum(torch.tensor(float(local), dtype=torch.float64, device=parts[0].mask.device)))
        == 0
    )


def _weighted_loss(
    minibatch_loss: Callable[..., MicroLoss],
    part,
    first_micro: bool,
    share: Tensor | float,
    *,
    weighted: dict[str, float],
    devs: list[Tensor | None],
) -> Tensor:
    """One micro-batch's forward: its loss scaled by ``share * world`` (for the backward); its
    statistics added to ``weighted`` times ``share`` and its ratio deviation to ``devs``."""
    out = minibatch_loss(part, first_micro=first_micro)
    devs.append(out.ratio_dev)
    for k, v in out.stats.items():
        value = float(v.detach() if torch.is_tensor(v) else v)
        weighted[k] = weighted.get(k, 0.0) + value * float(share)
    return out.loss * (share * D.world_size())


def _weighted_term(step_term: StepTerm, *, weighted: dict[str, float]) -> Tensor:
    """A :data:`StepTerm`'s forward: its loss scaled by ``share * world``, its statistics added to
    ``weighted`` times ``share``."""
    out, share = step_term()
    for k, v in out.stats.items():
        weighted[k] = weighted.get(k, 0.0) + float(v) * float(share)
    return out.loss * (share * D.world_size())


def minibatch_update(
    record,
    minibatches: Iterable[Tensor],
    minibatch_loss: Callable[..., MicroLoss],
    optimization: Optimization,
    micro_batch_size: int | None = None,
    *,
    step_term: StepTerm | None = None,
) -> UpdateStats:
    """One optimizer step per minibatch, gradients accumulated over its micro-batches.

    For each minibatch: cut this process's rows into micro-batches (:func:`micro_batches`), take
    ``record.select(rows)`` of each, weigh each by :func:`micro_shares`, and hand
    :func:`optimizer_step` one callable per micro-batch that calls
    ``minibatch_loss(part, first_micro=j == 0)`` and returns ``loss * share * world``.
    ``first_micro`` is true for the first micro-batch of each gradient step only, so a term
    counted once per step (the KL leash's loss count) is counted once. The statistics are
    weighted the same way and reduced over processes once, at the end (one all-reduce); the
    first minibatch's ratio deviation is reduced (max) after its step. A minibatch with no valid
    token on any process takes no step (:func:`nothing_to_learn`; counted as
    ``optim/skipped_steps``).

    Source: gradient accumulation as in Ott et al. 2018 (arXiv 1806.00187); DDP's gradient
    average, Li et al. 2020 (arXiv 2006.15704).

    Args:
        record: the batch, with ``select(idx)`` (the record restricted to rows ``idx``) and
            ``share_by`` (see :func:`micro_shares`).
        minibatches: this process's rows of each minibatch, in update order (every epoch); an
            iterator is consumed lazily, one minibatch per step.
        minibatch_loss: the trainer's hook, ``(part, first_micro=bool) -> MicroLoss``.
        optimization: the optimizer and the rest of :func:`optimizer_step`'s settings
            (:class:`Optimization`).
        micro_batch_size: rows per micro-batch (``optim.micro_batch_size``), None for one.
        step_term: a term added once to each optimizer step's loss (:data:`StepTerm`: the text
            anchor), its forward and backward first, before the micro-batches' (under DDP its
            gradients are then all-reduced with the last micro-batch's); None for none.

    Returns:
        :class:`UpdateStats`.
    """
    o = optimization
    weighted: dict[str, float] = {}  # sum over gradient steps of share * statistic
    grad_norms: list[float] = []
    first_dev = None
    skipped = 0
    for n, rows in enumerate(minibatches):
        parts = [record.select(m) for m in micro_batches(rows, micro_batch_size)]
        if nothing_to_learn(parts):  # no step: no momentum, no decay, no schedule step
            skipped += 1
            continue
        shares = micro_shares(parts)
        devs: list[Tensor | None] = []
        losses = [
            partial(_weighted_loss, minibatch_loss, part, j == 0, share, weighted=weighted, devs=devs)
            for j, (part, share) in enumerate(zip(parts, shares))
        ]
        if step_term is not None:  # once per optimizer step, never per micro-batch
            losses.insert(0, partial(_weighted_term, step_term, weighted=weighted))
        norm = optimizer_step(
            o.optimizer,
            o.params,
            loss=losses,
            max_grad_norm=o.max_grad_norm,
            name=o.name,
            accelerator=o.accelerator,
            model=o.model,
            scheduler=o.scheduler,
        )
        grad_norms.append(float(norm))
        if n == 0 and devs[0] is not None:
            # before any update the ratio must be exactly 1 (same inputs, same weights)
            first_dev = float(D.all_reduce_max(torch.stack(devs).max()))
    keys = sorted(weighted)
    host = torch.tensor([weighted[k] for k in keys], dtype=torch.float64, device="cpu")  # Python floats
    totals = D.all_reduce_sum(host)
    taken = max(1, len(grad_norms))  # every minibatch skipped: no statistic, a norm of 0
    stats = {k: float(t) / taken for k, t in zip(keys, totals)}
    # after the backward the gradients are the same on every process, and so is their norm
    return UpdateStats(stats, sum(grad_norms) / taken, first_dev, steps=len(grad_norms), skipped=skipped)
