"""Reductions across data-parallel ranks, so that every logged number is the global one.

Under ``accelerate launch`` each process (rank) holds a contiguous shard of the step's global
batch. A mean over a shard is not a shard of the mean: with per-token KL ``[1, 1]`` on rank 0,
``[1]`` on rank 2 and no valid token on ranks 1 and 3, the mean of the four rank means is
``(1 + 0 + 1 + 0) / 4 = 0.5`` while the KL of the batch is 1.0. The helpers here all-reduce the
sufficient statistics instead: ``(masked sum, token count)`` for a token-weighted mean, where a
rank with no valid token contributes ``(0, 0)`` and so is left out rather than counted as a zero;
``(sum, count)`` for a sequence-weighted mean; two passes for a variance.

Torch only (``torch.distributed``, set up by accelerate's ``PartialState``); imports only
:mod:`tether.core.kl` and :mod:`tether.core.advantages`. Every function works without an initialised
process group, as one rank of a world of size 1, and then equals its single-process twin
(``tests/e2e/test_distributed.py``). Sums are reduced in float64 so that the result does not depend
on how the batch is split beyond float64 rounding.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from tether.core.advantages import WHITEN_EPS
from tether.core.kl import sequence_kl
from tether.core.masked import at_least_fp32, masked_sum


def is_distributed() -> bool:
    """True when a ``torch.distributed`` process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Number of ranks; 1 without an initialised process group."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in ``[0, world_size())``; 0 without an initialised process group."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    """True on rank 0, the only rank that writes the run directory."""
    return rank() == 0


def barrier() -> None:
    """Wait for every rank (no-op in one process)."""
    if is_distributed():
        dist.barrier()


def _reduce(x: Tensor, op: str) -> Tensor:
    """``x`` in float64, reduced over ranks with ``op``, on ``x``'s device. NCCL reduces only CUDA
    tensors: under it a host value travels through this rank's GPU and comes back."""
    x = torch.as_tensor(x).detach()
    out = x.to(torch.float64).clone()
    if is_distributed():
        if dist.get_backend() == "nccl" and out.device.type != "cuda":
            out = out.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(out, op=getattr(dist.ReduceOp, op))
    return out.to(x.device)


def all_reduce_sum(x: Tensor) -> Tensor:
    """Element-wise sum over ranks, float64 (a copy; ``x`` is not changed)."""
    return _reduce(x, "SUM")


def all_reduce_max(x: Tensor) -> Tensor:
    """Element-wise max over ranks, float64."""
    return _reduce(x, "MAX")


def token_max(values: Tensor, mask: Tensor) -> Tensor:
    """The largest of ``values`` (B, R) where ``mask`` is True, over every process, float64; the
    masked slots read 0, so for a non-negative quantity it is its maximum, and 0 for a batch
    without a valid token (or without rows)."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return all_reduce_max(kept.max() if kept.numel() else kept.sum())


def all_reduce_min(x: Tensor) -> Tensor:
    """Element-wise min over ranks, float64."""
    return _reduce(x, "MIN")


def gather_objects(obj) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (picklable objects; ``[obj]`` in one process)."""
    if not is_distributed():
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


# ---- means over the global batch --------------------------------------------------------------
def token_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Token-weighted mean over every valid token of every rank.

    ``sum_r masked_sum_r / sum_r count_r``: one all-reduce of ``(masked sum, count)``. A rank with
    no valid token adds ``(0, 0)``: it changes neither the sum nor the count. With no valid token
    anywhere the result is 0 (as :func:`tether.core.masked.masked_mean`'s clamp), never NaN.

    Args:
        values: (B, R) float, this rank's values; masked slots never contribute (even inf/NaN).
        mask: (B, R) bool, ``response_mask``.

    Returns:
        float64 scalar, the same on every rank.
    """
    total, count = all_reduce_sum(
        torch.stack([masked_sum(values.to(torch.float64), mask), mask.bool().sum().double()])
    )
    return total / count.clamp(min=1)


def sequence_mean(values: Tensor) -> Tensor:
    """Mean of one value per sequence over the global batch: ``sum_r sum_i x_i / sum_r B_r``.

    Args:
        values: (B,) float, one value per sequence of this rank (B may be 0).

    Returns:
        float64 scalar; 0 when the global batch is empty.
    """
    total, count = all_reduce_sum(
        torch.stack(
            [
                values.to(torch.float64).sum(),
                torch.tensor(float(values.numel()), dtype=torch.float64, device=values.device),
            ]
        )
    )
    return total / count.clamp(min=1)


def sequence_std(values: Tensor) -> Tensor:
    """Unbiased standard deviation of one value per sequence over the global batch.

    Two passes (global mean, then the global sum of squared deviations), as ``torch.std``;
    0 when the global batch holds fewer than two sequences.

    Args:
        values: (B,) float.

    Returns:
        float64 scalar.
    """
    mean = sequence_mean(values)
    sq, n = all_reduce_sum(
        torch.stack(
            [
                (values.to(torch.float64) - mean).pow(2).sum(),
                torch.tensor(float(values.numel()), dtype=torch.float64, device=values.device),
            ]
        )
    )
    return (sq / (n - 1)).sqrt() if n > 1 else torch.zeros((), dtype=torch.float64, device=values.device)


def token_shares(masks: list[Tensor]) -> list[Tensor]:
    """Each part's fraction of the valid tokens of a minibatch split over ranks and, within a
    rank, into micro-batches: ``n_(r,m) / sum_r n_r``. The shares of one rank sum to its
    fraction of the minibatch's valid tokens; a token-mean loss of each part times its share
    sums (over parts and ranks) to the token-mean loss of the whole minibatch.

    Args:
        masks: (B_m, R) bool, this rank's micro-batches of the minibatch, in order.

    Returns:
        one float32 scalar per mask; ``[1.0]`` for one mask in one process.
    """
    local = torch.stack([m.bool().sum().double() for m in masks])
    total = all_reduce_sum(local.sum()).clamp(min=1)
    return [(n / total).float() for n in local]


def kl_stats(kl: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """The two aggregations of a per-token KL that tether logs and controls on, over the global
    batch: per sequence (the Ziegler et al. 2019 controller's unit) and per token.

    Returns:
        ``{"kl_per_sequence": ..., "kl_per_token": ...}``, float64 scalars: the mean over every
        sequence of every rank of the per-sequence sum (nats per sequence), and the token-weighted
        mean over every valid token of every rank (nats per token).
    """
    return {"kl_per_sequence": sequence_mean(sequence_kl(kl, mask)), "kl_per_token": token_mean(kl, mask)}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """How much of the returns' variance the value head explains, over the global batch.

    ``1 - Var(returns - values) / Var(returns)`` over every valid token of every rank (both
    variances with the same normalization, so it cancels), as cleanrl's ``explained_var``: 1 is
    a perfect value head, 0 one no better than the returns' mean, negative worse than it.

    Args:
        values: (B, R) value predictions at rollout time.
        returns: (B, R) their targets (GAE returns).
        mask: (B, R) bool, ``response_mask``.

    Returns:
        float64 scalar; NaN when the returns do not vary (or no token is valid).
    """
    v, r = values.to(torch.float64), returns.to(torch.float64)
    mean_r, mean_d = token_mean(r, mask), token_mean(r - v, mask)
    var_r, var_d = (token_mean((r - mean_r).pow(2), mask), token_mean((r - v - mean_d).pow(2), mask))
    return (
        1 - var_d / var_r
        if var_r > 0
        else torch.tensor(float("nan"), dtype=torch.float64, device=values.device)
    )


def whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """Normalize to zero mean and unit variance over the valid tokens of the global batch.

    ``(x - mean) / sqrt(var + WHITEN_EPS)`` where mean and unbiased variance are over the valid
    tokens of every rank (two all-reduces); masked slots are 0.

    Args:
        values: (B, R) float, this rank's values.
        mask: (B, R) bool.
        shift_mean: subtract the mean (True) or only rescale (False).

    Returns:
        (B, R), the dtype of ``values`` upcast to at least float32.
    """
    x = at_least_fp32(values)
    mean = token_mean(x, mask)
    sq, n = all_reduce_sum(
        torch.stack([masked_sum((x.to(torch.float64) - mean).pow(2), mask), mask.bool().sum().double()])
    )
    var = sq / (n - 1).clamp(min=1)
    out = (x - mean.to(x.dtype)) * torch.rsqrt(var.to(x.dtype) + WHITEN_EPS)
    if not shift_mean:
        out = out + mean.to(x.dtype)
    return torch.where(mask.bool(), out, 0.0)


# ---- how the global batch is split ------------------------------------------------------------
def shard(n: int, world: int | None = None, at: int | None = None) -> slice:
    """Rows ``[at * n / world, (at + 1) * n / world)`` of ``n``: rank ``at``'s contiguous shard.

    Raises:
        ValueError: ``n`` is not a multiple of ``world`` (the config check names the field first).
    """
    world = world_size() if world is None else world
    at = rank() if at is None else at
    if n % world:
        raise ValueError(f"{n} rows cannot be split evenly over {world} processes")
    size = n // world
    return slice(at * size, (at + 1) * size)


def stratified_minibatches(
    batch_size: int,
    minibatch_size: int,
    generator: torch.Generator,
    world: int | None = None,
    at: int | None = None,
    *,
    device: torch.device | str = "cpu",
) -> list[Tensor]:
    """Random minibatches whose membership does not depend on the number of processes.

    The global batch of ``batch_size`` rows is cut into ``minibatch_size`` contiguous segments of
    ``n = batch_size / minibatch_size`` rows; minibatch ``k`` takes row ``perm_s[k]`` of every
    segment ``s``, with one random permutation ``perm_s`` of ``[0, n)`` per segment drawn from
    ``generator`` (the same draws on every rank). Every epoch visits every row once and every
    minibatch is random, as with a plain permutation; unlike one, a rank's contiguous shard (whole
    segments when ``world`` divides ``minibatch_size``) holds exactly ``minibatch_size / world``
    rows of every minibatch, and these are the same rows whatever ``world`` is. So 1 and N
    processes take the same gradient steps. (Departure from a uniform shuffle: two rows of the
    same segment never share a minibatch.)

    Args:
        batch_size: global rows B.
        minibatch_size: global rows per minibatch, divides B and is a multiple of ``world``.
        generator: shared minibatch RNG (its state is checkpointed).
        world, at: number of ranks and this rank (default: the running process group).
        device: where the returned indices go (the rollout's device). The permutations are
            drawn on the host from ``generator``, so the minibatches are the same on any device.

    Returns:
        ``batch_size / minibatch_size`` long tensors of ``minibatch_size / world`` row indices
        into this rank's shard.
    """
    world = world_size() if world is None else world
    at = rank() if at is None else at
    n = batch_size // minibatch_size
    perms = torch.stack(
        [torch.randperm(n, generator=generator, device="cpu") for _ in range(minibatch_size)]
    )  # (mb, n)
    segments = torch.arange(minibatch_size, device="cpu")[:, None] * n
    rows = perms + segments  # (mb, n) global row of minibatch k, segment s
    mine = rows[shard(minibatch_size, world, at)] - at * (batch_size // world)  # (mb / world, n) local rows
    mine = mine.to(device)
    return [mine[:, k] for k in range(n)]


def full_tensor(t: Tensor) -> Tensor:
    """A sharded ``DTensor`` (FSDP) gathered whole (collective: every process calls it); any other
    tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local_optimizer_state(state: dict, params: list) -> dict:
    """An unsharded optimizer ``state_dict()`` (whole tensors) for this process: each state tensor of a
    sharded parameter (``params[i]``, the optimizer's order) cut to the parameter's own shard, the
    rest (step counts, unsharded parameters) as saved. No communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = {}
    for i, s in state["state"].items():
        p = params[int(i)]
        out[i] = {
            k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
            if isinstance(p, DTensor)
            and torch.is_tensor(v)
            and not isinstance(v, DTensor)
            and v.shape == p.shape
            else v
            for k, v in s.items()
        }
    return {**state, "state": out}
