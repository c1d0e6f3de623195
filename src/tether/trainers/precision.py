"""Float32 master weights for a model whose weights are bfloat16 or float16. Torch only.

A bf16 weight cannot take a small update: bf16 keeps 8 significant bits, so adding
``lr * step`` to a weight ``w`` is lost to rounding whenever ``|lr * step| < |w| * 2**-9``
(at ``lr = 1e-6`` and Adam's step of about 1, every weight above ``5e-4`` would never move).
:class:`MasterWeights` therefore keeps a float32 copy of every low-precision trainable
weight, lets AdamW keep its moments beside that copy (float32) and step it, and rounds the
result back into the model's weights after each step (Micikevicius et al. 2018, "Mixed
Precision Training", arXiv 1710.03740, section 3.1). Float32 weights are their own masters:
with a float32 model this is plain AdamW, the same numbers.

Memory per low-precision trainable weight: 2 bytes (the weight) + 2 (its gradient) + 4 (the
master) + 8 (AdamW's two moments) = 16 bytes, as in mixed-precision training; the reference's
weights stay in the low precision and take no optimizer state.

Gradients: the backward writes them in the weights' dtype. In one process they are moved into
float32 after every micro-batch (:meth:`MasterWeights.accumulate`), so gradient accumulation
sums in float32; under DDP they are summed in the weights' dtype across micro-batches (DDP
all-reduces ``param.grad`` at the last one) and moved to float32 once per step.

float16 also gets a dynamic loss scale (Micikevicius et al. 2018, section 3.2): the loss is
multiplied by ``loss_scale`` before the backward so small gradients do not flush to zero in
float16, the float32 gradients are divided by it, and a step whose gradients overflow is
skipped and the scale halved; after :data:`SCALE_GROWTH_INTERVAL` good steps it doubles.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tether.core import distributed as D

INITIAL_LOSS_SCALE = 2.0**16
"""float16's first loss scale (``torch.amp.GradScaler``'s default)."""
SCALE_GROWTH_INTERVAL = 2000
"""Good steps in a row after which the float16 loss scale doubles."""
MIN_LOSS_SCALE = 1.0
"""Below this scale an overflow is no longer the scale's fault: the step raises instead."""


class MasterWeights:
    """An optimizer that steps float32 masters of low-precision weights (see the module docstring).

    Args:
        params: the model's trainable parameters, any floating dtype.
        make_optimizer: builds the inner optimizer over a list of float32 tensors.
        dynamic_loss_scale: scale the loss (float16); default: when any weight is float16.

    Attributes:
        masters: one float32 tensor per parameter: the parameter itself when it is float32,
            else a float32 copy that the optimizer steps.
        loss_scale: the factor the backward's loss is multiplied by (1.0 without loss scaling).
    """

    def __init__(
        self,
        params: list[Tensor],
        make_optimizer: Callable[[list[Tensor]], torch.optim.Optimizer],
        dynamic_loss_scale: bool | None = None,
    ):
        self.params = list(params)
        self.masters = [
            p if p.dtype == torch.float32 else p.detach().float().requires_grad_(True) for p in self.params
        ]
        self.optimizer = make_optimizer(self.masters)
        if dynamic_loss_scale is None:
            dynamic_loss_scale = any(p.dtype == torch.float16 for p in self.params)
        self.dynamic = dynamic_loss_scale
        self.loss_scale = INITIAL_LOSS_SCALE if dynamic_loss_scale else 1.0
        self.good_steps = 0
        self.skipped_steps = 0

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients of the parameters and of the masters."""
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def accumulate(self) -> None:
        """Add each low-precision parameter's gradient, in float32 and divided by the loss scale,
        to its master's, and free it. Float32 parameters keep their own gradient (divided by the
        loss scale when there is one)."""
        for p, m in zip(self.params, self.masters):
            if p.grad is None:
                continue
            if m is p:
                if self.loss_scale != 1.0:
                    p.grad.div_(self.loss_scale)
                continue
            g = p.grad.float()
            if self.loss_scale != 1.0:
                g.div_(self.loss_scale)
            m.grad = g if m.grad is None else m.grad.add_(g)
            p.grad = None

    def overflowed(self) -> bool:
        """After a non-finite gradient norm: with a dynamic loss scale, halve it, drop the
        gradients and return True (skip this step); without one (or below
        :data:`MIN_LOSS_SCALE`) return False, the caller raises."""
        if not self.dynamic or self.loss_scale / 2 < MIN_LOSS_SCALE:
            return False
        self.loss_scale /= 2
        self.good_steps = 0
        self.skipped_steps += 1
        self.zero_grad()
        return True

    def step(self) -> None:
        """Step the masters, then round them into the low-precision parameters."""
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    p.copy_(m)
        if self.dynamic:
            self.good_steps += 1
            if self.good_steps % SCALE_GROWTH_INTERVAL == 0:
                self.loss_scale *= 2

    @torch.no_grad()
    def write_back(self) -> None:
        """Round the masters into the low-precision parameters (after they were set from outside:
        the update guard's backtrack)."""
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)

    def state_dict(self) -> dict:
        """The inner optimizer's state, the float32 masters of low-precision parameters (a
        resumed run goes on from them, not from the rounded weights) and the loss scale."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "masters": {
                i: m.detach().clone() for i, (p, m) in enumerate(zip(self.params, self.masters)) if m is not p
            },
            "loss_scale": self.loss_scale,
            "good_steps": self.good_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; a plain optimizer state dict (a checkpoint from before master
        weights, always float32) is the inner optimizer's."""
        # an unsharded run's whole tensors; a sharded policy (FSDP) keeps its own shard of each
        if "masters" not in state:
            self.optimizer.load_state_dict(D.local_optimizer_state(state, self.masters))
            return
        self.optimizer.load_state_dict(D.local_optimizer_state(state["optimizer"], self.masters))
        with torch.no_grad():
            for i, saved in state["masters"].items():
                self.masters[int(i)].copy_(saved)
                self.params[int(i)].copy_(saved)
        self.loss_scale = state["loss_scale"]
        self.good_steps = state["good_steps"]
        self.skipped_steps = state["skipped_steps"]
