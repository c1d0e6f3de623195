"""Fully sharded data parallelism (FSDP2, ``torch.distributed.fsdp.fully_shard``) for the policy and
the reference: ``train.sharding=fsdp``.

Each process keeps ``1 / N`` of every weight (dimension 0 of each tensor, a ``DTensor``), of its
gradient and of its AdamW moments; a transformer block's full weights exist only while that block
runs. One FSDP unit per transformer block (the classes the model lists in ``_no_split_modules``)
and one for the rest (embeddings, final norm, LM head, value head) at the root.

How each use of the weights gets them (docs/distributed.md, "Sharded training"):

* the update (forward and backward with autograd) goes through the root's ``forward``: FSDP
  gathers one block at a time and reduce-scatters its gradient in the backward;
* no-grad scoring (old, reference log-probs) calls the trunk and the LM head directly:
  :func:`root_gathered` gathers the root unit's own weights for the call, the blocks are gathered
  one at a time by their hooks (every process runs the same forwards);
* generation (:func:`generation_weights`, ``train.sharded_generation``): by default the root
  unit gathered and each block gathered for each decoded token (every process decodes until all
  are done); or the whole model gathered once for the call (:func:`gathered`: one full copy of
  the weights while it lasts, no collective per token);
* the held-out evaluation (rank 0 alone) runs on :func:`gathered` weights, gathered by every
  process (memory: the whole policy and reference on rank 0 while it evaluates).

Torch only (and ``torch.distributed``); every function is a no-op on a module that is not sharded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from tether.core.distributed import full_tensor

__all__ = [
    "block_classes",
    "full_state_dict",
    "gathered",
    "generation_weights",
    "is_sharded",
    "load_full_state_dict",
    "local_bytes",
    "root_gathered",
    "shard_model",
]


def _fsdp():
    from torch.distributed.fsdp import FSDPModule, fully_shard

    return FSDPModule, fully_shard


def is_sharded(module: nn.Module | None) -> bool:
    """Whether ``module`` (or any submodule) is an FSDP2 unit."""
    if module is None:
        return False
    FSDPModule, _ = _fsdp()
    return any(isinstance(m, FSDPModule) for m in module.modules())


def block_classes(lm: nn.Module) -> set[str]:
    """Names of the transformer-block classes of a transformers model (its ``_no_split_modules``).

    Raises:
        ValueError: the model names none (then there is no block to make an FSDP unit of).
    """
    names = set()
    for m in lm.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(
            f"{type(lm).__name__} lists no transformer block class (_no_split_modules); "
            "train.sharding=fsdp cannot find its units: use train.sharding=none"
        )
    return names


def shard_model(module: nn.Module, lm: nn.Module) -> None:
    """Shard ``module`` in place over the default process group: one FSDP unit per transformer
    block of ``lm`` (a submodule of ``module``, or ``module`` itself), the root unit for the rest.

    Every unit reshards after its forward, the root too (FSDP2 keeps the root's weights gathered by
    default): outside a call, ``module.parameters()`` are always the sharded ``DTensor`` s, which
    the optimizer must hold. The root's lazy initialization runs here, so that any later first call
    (generation, a block run by the trunk directly) finds the root decided.

    Collect ``parameters()`` for the optimizer after this call.
    """
    _, fully_shard = _fsdp()
    names = block_classes(lm)
    for m in list(lm.modules()):
        if type(m).__name__ in names:
            fully_shard(m, reshard_after_forward=True)
    fully_shard(module, reshard_after_forward=True)
    # FSDP2 decides its root at the first forward it sees; tether's first call may be a block run
    # by generate() or the trunk, which would wrongly become a root. Private API (torch 2.13).
    module._get_fsdp_state()._lazy_init()


def _units(modules) -> list[nn.Module]:
    FSDPModule, _ = _fsdp()
    return [m for mod in modules if mod is not None for m in mod.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered(*modules: nn.Module | None) -> Iterator[None]:
    """Every FSDP unit of ``modules`` gathered (full weights) for the block, then sharded again.

    Collective on entry (all-gathers): every process enters it; inside, forwards run without any
    collective, so one process may work alone (rank 0's evaluation) while the others wait.
    Memory: one full copy of the weights while inside. A no-op for unsharded modules.
    """
    with _unsharded(_units(modules)):
        yield
    _forget_forwards(modules)


@contextmanager
def _unsharded(units: list[nn.Module]) -> Iterator[None]:
    """Each of ``units`` (FSDP modules, not recursive) all-gathered and kept so through its
    forwards for the block; resharded after, and set to reshard after each forward again."""
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


def _forget_forwards(modules) -> None:
    """Clear what FSDP recorded of the no-grad forwards just run (``reset_iter_state`` on each root).

    FSDP2 records every unit's forward, with or without autograd, until the next backward, and in
    that backward each block prefetches the unit recorded before its own last forward. Forwards
    that differ between processes (rank 0 evaluating alone, each process generating to its own
    length on gathered weights) would make the processes' backward prefetches differ: a collective
    that only one of them runs, and a hang (found with DPO, whose first backward follows rank 0's
    reference evaluation directly). Call only outside a forward-backward pair.
    """
    FSDPModule, _ = _fsdp()
    for m in modules:
        if isinstance(m, FSDPModule):
            m.reset_iter_state()


@contextmanager
def generation_weights(module: nn.Module | None, mode: str = "blocks") -> Iterator[bool]:
    """The weights :func:`tether.models.sampling.generate` runs on; yields its ``synced`` flag.

    ``mode`` (``train.sharded_generation``) ``whole``: the whole model gathered for the call
    (:func:`gathered`): memory of one full copy of the weights while it lasts, no collective per
    token, each process stops at its own length. Otherwise (``blocks``): the root unit's weights
    gathered (:func:`root_gathered`) and each block gathered for each forward and freed after:
    memory of the shards plus the root unit and one block, an all-gather per block per decoded
    token, and every process decodes until all are done (``synced``). Unsharded: nothing to do.
    """
    if not is_sharded(module):
        yield False
    elif mode == "whole":
        with gathered(module):
            yield False
    else:
        with root_gathered(module):
            yield True
        _forget_forwards([module])  # a token's forward is recorded per block: thousands per rollout


@contextmanager
def root_gathered(*modules: nn.Module | None) -> Iterator[None]:
    """The root unit's own weights (embeddings, norm, LM head, value head) gathered for the block;
    the transformer blocks stay sharded and are gathered one at a time by their own forwards
    (collectives: every process must run the same number of block forwards inside)."""
    FSDPModule, _ = _fsdp()
    with _unsharded([m for m in modules if isinstance(m, FSDPModule)]):
        yield


def full_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """``module.state_dict()`` with every sharded tensor gathered whole (collective under FSDP:
    every process calls it, in the same order, and each gets the full tensors)."""
    return {k: full_tensor(v) for k, v in module.state_dict().items()}


def load_full_state_dict(module: nn.Module, state: dict[str, Tensor], strict: bool = True):
    """``module.load_state_dict`` of full tensors: each process keeps its own shard of every
    sharded tensor (no communication: every process holds the full ``state``).

    Returns:
        ``load_state_dict``'s (missing_keys, unexpected_keys).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    current = module.state_dict()
    local = {}
    for k, v in state.items():
        target = current.get(k)
        if isinstance(target, DTensor):
            v = distribute_tensor(
                v.to(target.device, target.dtype), target.device_mesh, target.placements, src_data_rank=None
            )
        local[k] = v
    return module.load_state_dict(local, strict=strict)


def local_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this process holds of ``module``'s parameters, their gradients and ``optimizer``'s
    state (its shards under FSDP, everything otherwise), and the parameter count of the full model.

    Returns:
        {"params": bytes, "grads": bytes, "optimizer": bytes, "numel": full parameter count}.
    """
    from torch.distributed.tensor import DTensor

    def local(t: Tensor) -> Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    params = list(module.parameters())
    out = {
        "params": sum(local(p).numel() * local(p).element_size() for p in params),
        "grads": sum(local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None),
        "optimizer": 0,
        "numel": sum(p.numel() for p in params),
    }
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    out["optimizer"] += local(v).numel() * local(v).element_size()
    return out
