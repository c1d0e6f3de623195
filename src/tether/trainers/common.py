"""What every trainer shares: building a run (models, data, scorer, run dir) and scoring rollouts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from torch import Tensor, nn

from tether.models.sampling import Rollout
from tether.models.scoring import Scored, score_logprobs, score_policy_and_reference


def make_optimizer(params: list, lr: float, weight_decay: float, fused: bool = True) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019) over ``params``; torch's fused kernel when ``fused``.

    The fused kernel updates each weight, its gradient and both moments in one pass (CPU and
    CUDA); it falls back to the per-tensor loop where a parameter's device has no fused kernel.
    """
    fused = fused and all(p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    params: list,
    loss: Tensor | Sequence[Callable[[], Tensor]],
    max_grad_norm: float,
    name: str,
    accelerator: Accelerator | None = None,
    model: nn.Module | None = None,
) -> Tensor:
    """Backward, clip the global gradient norm, refuse a non-finite one, step; returns the norm.

    ``loss`` is the minibatch's loss, or one callable per micro-batch (``optim.micro_batch_size``)
    returning that micro-batch's share of it: each runs its forward and backward in turn, the
    gradients add up, and the optimizer steps once, as for the whole minibatch (gradient
    accumulation). With an ``accelerator`` the backward and the clipping are accelerate's: under
    DDP the backward all-reduces (averages) the gradients over the processes, so every process
    clips and steps with the same gradient; with micro-batches only the last one all-reduces
    (``accelerator.no_sync(model)`` around the others).

    Raises:
        FloatingPointError: the gradient norm is NaN or inf (the step is not taken, so the
            weights and the last checkpoint stay good).
    """
    optimizer.zero_grad(set_to_none=True)
    parts = [lambda: loss] if torch.is_tensor(loss) else list(loss)
    for i, part in enumerate(parts):
        defer = accelerator is not None and model is not None and i < len(parts) - 1
        with accelerator.no_sync(model) if defer else nullcontext():
            last = part()
            if accelerator is None:
                last.backward()
            else:
                accelerator.backward(last)
    if accelerator is None:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm, foreach=True)
    else:
        grad_norm = accelerator.clip_grad_norm_(params, max_grad_norm)
    if not torch.isfinite(grad_norm):
        raise FloatingPointError(
            f"non-finite gradient norm {float(grad_norm)} in the {name} update "
            f"(loss {float(last.detach())}); stopping before the weights change"
        )
    optimizer.step()
    # free the gradients now, not at the next step's zero_grad: otherwise a full copy of the
    # trainable weights stays resident through the next generation and forward, the step's peak
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def micro_batches(rows: Tensor, micro_batch_size: int | None) -> list[Tensor]:
    """``rows`` (this process's rows of a minibatch) in consecutive chunks of
    ``micro_batch_size`` (``optim.micro_batch_size``); one chunk when it is None."""
    return [rows] if micro_batch_size is None else list(rows.split(micro_batch_size))


@dataclass
class ScoredBatch:
    """No-grad quantities of a rollout, each (B, R) float32."""

    old_logprobs: Tensor
    ref_logprobs: Tensor | None
    """None when no reference model is built."""
    values: Tensor | None
    entropy: Tensor
    exact_kl: Tensor | None
    graded: Scored | None = None
    """The policy's forward with its autograd graph, when ``score_rollout`` was given a
    ``graded_policy`` (one minibatch): the update differentiates it instead of a second forward."""


@torch.no_grad()
def score_rollout(
    policy: nn.Module,
    reference: nn.Module | None,
    rollout: Rollout,
    temperature: float,
    row_chunks: list[Tensor],
    with_values: bool,
    exact_kl: bool,
    exact_chunk_size: int = 256,
    graded_policy: nn.Module | None = None,
) -> ScoredBatch:
    """Policy and reference log-probabilities (and values, entropy, exact KL) of a rollout.

    Rows are scored in the groups ``row_chunks`` (index tensors covering every row once), so the
    first PPO minibatch sees exactly the inputs its old log-probabilities came from and the
    ratio at step 0 is exactly 1. No-grad logits are held for one LM-head slice at a time
    (:func:`tether.models.scoring.score_policy_and_reference`), never for a whole group.

    With ``graded_policy`` (the module the update differentiates; one group only) the policy's
    forward runs with autograd on and is returned as ``graded``; the old log-probs, entropy and
    exact KL are its detached values, the same numbers a no-grad forward gives.
    """
    B, R = rollout.response_ids.shape
    exact_kl = exact_kl and reference is not None
    if graded_policy is not None and len(row_chunks) != 1:
        raise ValueError(f"graded_policy needs one row group, got {len(row_chunks)}")
    out = {k: torch.zeros(B, R) for k in ("old", "ref", "values", "entropy", "exact")}
    graded = policy_logits = None
    for idx in row_chunks:
        part = rollout.select(idx)
        if graded_policy is not None:
            with torch.enable_grad():
                graded = score_logprobs(graded_policy, part, temperature, keep_logits=True)
            policy_logits = graded.logits.detach()  # (B, R, V), held by the graph anyway
            graded.logits = None  # the graph keeps what the backward needs; drop the reference to it
        pol, ref, exact = score_policy_and_reference(
            policy, reference, part, temperature, with_values, exact_kl, policy_logits, exact_chunk_size
        )
        out["old"][idx], out["entropy"][idx] = pol.logprobs, pol.entropy
        if with_values:
            out["values"][idx] = pol.values
        if reference is not None:
            out["ref"][idx] = ref.logprobs
        if exact_kl:
            out["exact"][idx] = exact
    return ScoredBatch(
        out["old"],
        out["ref"] if reference is not None else None,
        out["values"] if with_values else None,
        out["entropy"],
        out["exact"] if exact_kl else None,
        graded,
    )
