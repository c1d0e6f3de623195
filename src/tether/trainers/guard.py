"""The update guard: the KL to the reference of the updated policy, checked before it is kept.

The budget controller sets beta from the KL it reads; an update can still cross the budget in one
step (a large learning rate, a sharp reward). The guard measures, after an update (one epoch of
minibatch steps), the exact KL of the updated policy to the reference at the prefixes of the
step's own batch (:func:`tether.trainers.steps.updated_kl`), with its standard error. When that
KL plus ``z`` standard errors passes its limit by more than the tolerance, the trainable
weights step back toward the ones before the update by halves,
``theta_old + alpha (theta_new - theta_old)`` with ``alpha = 1/2, 1/4, ...``, and back to
``theta_old`` when no fraction fits: the backtracking line search of TRPO (Schulman et al. 2015,
"Trust Region Policy Optimization", arXiv 1502.05477, appendix C), here on the KL to the
reference rather than to the previous policy. Torch and :mod:`tether.core` only, so the test bed
runs the same guard on its tables.

**What is acceptable.** A KL whose prediction bound ``kl + z * sqrt(2) * se`` is at most ``limit
* (1 + tol)``, or a KL at most the one the update started from (an update that brings an
over-budget policy closer is kept): ``alpha = 0`` is always acceptable, so the search ends. The
bound is for the number a user sees next, the next batch's reading of the kept policy: a mean
over a fresh batch of the same size, whose standard error is ``se`` too, differs from this batch's
mean by the noise of both, variance ``2 se^2`` (the prediction interval of a new mean). So the
next reading stays under the ceiling with about the one-sided normal confidence of ``z`` (97.7%
at 2). (Bounding only the expectation, ``kl + z * se``, lets a policy sit just under the
ceiling, and then every other next reading passes it.)

**The optimizer's state after a partial step** (derived in docs/kl.md, "The update guard"). AdamW
keeps ``m`` and ``v``, exponential averages of the gradients and their squares at the points the
optimizer visited, and a step count for their bias correction. A backtrack changes where the
weights are, not what was observed: each gradient was taken at a point the kept weights'
segment starts from, so ``m``, ``v`` and the count stay as they are. (For heavy-ball momentum,
whose buffer is the last step itself, the buffer would be scaled by ``alpha``; Adam's moments are
not steps.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from tether.trainers.update import UpdateStats


@dataclass(frozen=True, kw_only=True)
class GuardSettings:
    """The guard of a run (``kl.guard``), built once.

    Attributes:
        limit: the KL the update may not pass, in the controller's unit (``kl.budget``; nats per
            sequence or per token, as ``kl.target_unit``).
        tol: the relative slack past ``limit`` before the guard acts (``kl.guard_tol``), >= 0.
        max_halvings: backtracks before the weights are restored (``kl.guard_halvings``), >= 1.
        z: standard errors of the difference between the next batch's mean and this one's
            (``sqrt(2) * se``) added before comparing with the ceiling (``kl.guard_z``), >= 0; 0
            compares the batch mean alone.
    """

    limit: float
    tol: float = 0.05
    max_halvings: int = 10
    z: float = 2.0

    @property
    def ceiling(self) -> float:
        """``limit * (1 + tol)``: the largest KL kept without backtracking."""
        return self.limit * (1.0 + self.tol)

    def bound(self, kl: float, se: float) -> float:
        """``kl + z * sqrt(2) * se``: the upper prediction bound of the next batch's reading of a
        policy whose KL reads ``kl`` with standard error ``se`` on this batch (module docstring)."""
        return kl + self.z * math.sqrt(2.0) * se


class GuardResult(NamedTuple):
    """What one guarded update did (every value the same on every process)."""

    kl_updated: float
    """The KL of the update as the optimizer left it (before any backtrack), the limit's unit."""
    kl_kept: float
    """The KL of the weights kept."""
    fraction: float
    """``alpha`` of the kept weights: 1 (the update whole), 1/2^k, or 0 (restored)."""
    backtracks: int
    """How many halvings were measured."""
    se_kept: float = 0.0
    """The standard error of ``kl_kept`` (its batch's sampling noise), the limit's unit."""


def snapshot(tensors: Sequence[Tensor]) -> list[Tensor]:
    """A copy of ``tensors`` (the trainable weights, or their float32 masters)."""
    return [t.detach().clone() for t in tensors]


class Snapshots:
    """Copies of the trainable weights kept between steps, one list per slot (``before``,
    ``after``): each :meth:`take` copies into the slot's tensors instead of allocating new ones (a
    fresh 540 MB copy of SmolLM2-135M's weights took 0.11 s here, a copy into kept ones 0.03 s).
    The guard's snapshots exist at the update's peak anyway; kept, they add nothing to it."""

    def __init__(self) -> None:
        self.slots: dict[str, list[Tensor]] = {}

    def take(self, slot: str, tensors: Sequence[Tensor]) -> list[Tensor]:
        """``tensors`` copied into ``slot`` (allocated on first use, or where shapes changed)."""
        kept = self.slots.get(slot)
        if (
            kept is None
            or len(kept) != len(tensors)
            or any(k.shape != t.shape or k.dtype != t.dtype for k, t in zip(kept, tensors))
        ):
            kept = self.slots[slot] = snapshot(tensors)
            return kept
        with torch.no_grad():
            for k, t in zip(kept, tensors):
                k.copy_(t)
        return kept


class Ahead(NamedTuple):
    """A measure that keeps its forward for the next epoch (the guard's lookahead).

    The first forward of an epoch's update runs on the weights the previous epoch left, the
    weights the guard measures: with one minibatch of the whole batch, the update's own forward
    (with grad) is that measure, and the next epoch's update takes its backward from it instead of
    running the forward again.
    """

    measure: Callable[[], tuple[float, float]]
    """``(kl, se)`` as ``measure``, from a forward with grad that it keeps for the next epoch."""
    discard: Callable[[], None]
    """Drops a kept forward no update will use (the guard cut, so the weights change)."""
    epochs: int
    """The epochs of the update: the last one's measure is the plain one (no epoch follows)."""


@torch.no_grad()
def guard_update(
    tensors: Sequence[Tensor],
    before: Sequence[Tensor],
    *,
    measure: Callable[[], tuple[float, float]],
    kl_before: float,
    settings: GuardSettings,
    written: Callable[[], None] = lambda: None,
    first: Callable[[], tuple[float, float]] | None = None,
    discard: Callable[[], None] = lambda: None,
    store: Snapshots | None = None,
) -> GuardResult:
    """Keep the update of ``tensors`` from ``before``, or the largest halving of it whose KL is
    acceptable (module docstring), writing the kept weights into ``tensors`` in place.

    Args:
        tensors: the weights the update moved (float32 masters where the model's are lower
            precision), at the updated values.
        before: the same weights before the update (:func:`snapshot`).
        measure: ``(kl, se)``: the KL of the policy the weights in ``tensors`` make now (the
            limit's unit) and its standard error; it must give every process the same numbers.
        kl_before: the KL of the policy at ``before`` (the same measure; for a step's first epoch,
            the rollout's own exact KL).
        settings: the limit, its tolerance, the halvings.
        written: called after each write into ``tensors`` (a low-precision model copies its
            masters into its weights).
        first: the measure of the update as the optimizer left it, when not ``measure``
            (:attr:`Ahead.measure`, which keeps its forward for the next epoch).
        discard: called before the first halving: a forward ``first`` kept is stale from then on.
        store: where the updated weights are copied before the halvings (:class:`Snapshots`),
            or None (a fresh copy).

    Returns:
        :class:`GuardResult`.
    """

    def acceptable(kl: float, se: float) -> bool:
        return settings.bound(kl, se) <= settings.ceiling or kl <= kl_before

    kl, se = (first or measure)()
    if acceptable(kl, se):
        return GuardResult(kl, kl, 1.0, 0, se)
    discard()
    after = store.take("after", tensors) if store is not None else snapshot(tensors)
    alpha = 1.0
    for k in range(1, settings.max_halvings + 1):
        alpha /= 2
        for t, a, b in zip(tensors, before, after):
            t.copy_(a + alpha * (b - a))
        written()
        now, now_se = measure()
        if acceptable(now, now_se):
            return GuardResult(kl, now, alpha, k, now_se)
    for t, a in zip(tensors, before):
        t.copy_(a)
    written()
    return GuardResult(kl, kl_before, 0.0, settings.max_halvings)


def guarded_epochs(
    epochs: Iterable[list[Tensor]],
    *,
    update: Callable[[list[Tensor]], UpdateStats],
    tensors: Sequence[Tensor],
    measure: Callable[[], tuple[float, float]],
    kl_before: float,
    settings: GuardSettings,
    written: Callable[[], None] = lambda: None,
    ahead: Ahead | None = None,
    store: Snapshots | None = None,
) -> tuple[UpdateStats, GuardResult]:
    """Epochs of minibatch updates, each guarded (:func:`guard_update`), stopping at the first
    epoch the guard cut: an epoch that would pass the limit is not followed by another. With
    ``ahead`` each epoch but the last is measured by the next epoch's forward (:class:`Ahead`):
    one forward per epoch saved, the same numbers.

    Args:
        epochs: each epoch's minibatches (this process's rows of each), drawn lazily: an epoch not
            run draws nothing (its permutation is not taken from the generator).
        update: runs one epoch's minibatches (:func:`tether.trainers.update.minibatch_update`).
        tensors, measure, settings, written: as :func:`guard_update`.
        kl_before: the KL of the policy before the first epoch (the rollout's exact KL).
        ahead: the lookahead measure, or None (each epoch measured by ``measure``).
        store: kept copies of the weights (:class:`Snapshots`), or None (fresh ones).

    Returns:
        ``(stats, result)``: the epochs' statistics merged (each a mean over its gradient steps,
        weighted by them), and the guard's account of the whole update: the KL of the last
        epoch's update as the optimizer left it and of the weights kept (with its standard error,
        an earlier epoch's where the last was restored), the share of the epochs run that was
        kept (``(whole epochs + the last one's alpha) / epochs run``: a first epoch kept and a
        second restored is 1/2, not a restore), the halvings of all epochs.
    """
    merged: list[UpdateStats] = []
    result = GuardResult(kl_before, kl_before, 1.0, 0)
    backtracks = 0
    for epoch, minibatches in enumerate(epochs):
        before = store.take("before", tensors) if store is not None else snapshot(tensors)
        merged.append(update(minibatches))
        se = result.se_kept
        last = ahead is None or epoch >= ahead.epochs - 1
        result = guard_update(
            tensors,
            before,
            measure=measure,
            kl_before=result.kl_kept,
            settings=settings,
            written=written,
            first=None if last or ahead is None else ahead.measure,
            discard=ahead.discard if ahead is not None else lambda: None,
            store=store,
        )
        if result.fraction == 0.0:  # restored: the weights (and their SE) are the previous epoch's
            result = result._replace(se_kept=se)
        backtracks += result.backtracks
        if result.fraction < 1.0:
            break
    if ahead is not None:
        ahead.discard()  # nothing kept outlives the update
    kept = (len(merged) - 1 + result.fraction) / len(merged) if merged else 1.0
    return merge_stats(merged), result._replace(fraction=kept, backtracks=backtracks)


def merge_stats(parts: Sequence[UpdateStats]) -> UpdateStats:
    """:class:`tether.trainers.update.UpdateStats` of several calls as one: each statistic and
    the gradient norm averaged over all their gradient steps; the first call's ratio deviation."""
    steps, skipped = sum(p.steps for p in parts), sum(p.skipped for p in parts)
    if steps == 0:
        return parts[0]._replace(skipped=skipped)
    keys = sorted({k for p in parts for k in p.stats})
    stats = {k: sum(p.stats.get(k, 0.0) * p.steps for p in parts) / steps for k in keys}
    norm = sum(p.grad_norm * p.steps for p in parts) / steps
    return UpdateStats(stats, norm, parts[0].first_ratio_dev, steps=steps, skipped=skipped)
