"""What every trainer shares: the optimizer and scoring rollouts (the update loop: :mod:`.update`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tether.models.sampling import Rollout
from tether.models.scoring import TokenStats, policy_and_reference_logprobs, rollout_logprobs
from tether.trainers.precision import MasterWeights

# the update loop's pieces live in tether.trainers.update (torch only, shared with the test bed)


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


@torch.no_grad()
def old_and_ref_logprobs(
    policy: nn.Module,
    reference: nn.Module | None,
    rollout: Rollout,
    temperature: float,
    row_chunks: list[Tensor],
    with_values: bool,
    exact_kl: bool,
    exact_chunk_size: int = 256,
    reuse_forward_of: nn.Module | None = None,
) -> RolloutLogprobs:
    """Policy and reference log-probabilities (and values, entropy, exact KL) of a rollout.

    Rows are scored in the groups ``row_chunks`` (index tensors covering every row once), so the
    first PPO minibatch sees exactly the inputs its old log-probabilities came from and the
    ratio at step 0 is exactly 1. No-grad logits are held for one LM-head slice at a time
    (:func:`tether.models.scoring.policy_and_reference_logprobs`), never for a whole group.

    With ``reuse_forward_of`` (the module the update differentiates; one group only) the policy's
    forward runs with autograd on and is returned as ``update_forward``; the old log-probs, entropy and
    exact KL are its detached values, the same numbers a no-grad forward gives.
    """
    B, R = rollout.response_ids.shape
    exact_kl = exact_kl and reference is not None
    if reuse_forward_of is not None and len(row_chunks) != 1:
        raise ValueError(f"reuse_forward_of needs one row group, got {len(row_chunks)}")
    device = rollout.response_ids.device
    out = {k: torch.zeros(B, R, device=device) for k in ("old", "ref", "values", "entropy", "exact")}
    update_forward = policy_logits = None
    for idx in row_chunks:
        part = rollout.select(idx)
        if reuse_forward_of is not None:
            with torch.enable_grad():
                update_forward = rollout_logprobs(reuse_forward_of, part, temperature, keep_logits=True)
            policy_logits = update_forward.logits.detach()  # (B, R, V), held by the graph anyway
            update_forward.logits = None  # the graph keeps what the backward needs; drop the reference to it
        pol, ref, exact = policy_and_reference_logprobs(
            policy, reference, part, temperature, with_values, exact_kl, policy_logits, exact_chunk_size
        )
        out["old"][idx], out["entropy"][idx] = pol.logprobs, pol.entropy
        if with_values:
            out["values"][idx] = pol.values
        if reference is not None:
            out["ref"][idx] = ref.logprobs
        if exact_kl:
            out["exact"][idx] = exact
    return RolloutLogprobs(
        out["old"],
        out["ref"] if reference is not None else None,
        out["values"] if with_values else None,
        out["entropy"],
        out["exact"] if exact_kl else None,
        update_forward,
    )
