"""Token log-probabilities, entropies and response masks from logits. Torch only.

One function, :func:`logprobs_from_logits`, gives ``log pi(y_t | x, y_<t)`` for the policy,
the old policy and the reference alike, so the three can never disagree on temperature or
precision (two of the seeds' common bugs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; set rollout.temperature > 0")


def logprobs_from_logits(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, chunk_size: int = 2048
) -> Tensor:
    """log softmax(logits / temperature) gathered at ``tokens``, in float32.

    Computed as ``z[y] - logsumexp(z)`` with ``z = logits / temperature`` upcast to float32
    ``chunk_size`` positions at a time (float64 stays float64), so no float32 (B, R, V) copy of
    bf16 logits is held.
    Slow equivalent (tested equal)::

        torch.log_softmax(logits.float() / temperature, -1).gather(-1, tokens[..., None])[..., 0]

    Args:
        logits: (B, R, V) logits at the positions that predict ``tokens`` (already shifted).
        tokens: (B, R) long, the sampled tokens.
        temperature: the sampling temperature used to draw ``tokens`` (> 0).
        chunk_size: positions per float32 chunk.

    Returns:
        (B, R) log-probabilities, nats (<= 0); float32 (float64 for float64 logits).

    Raises:
        ValueError: temperature <= 0 or shape mismatch.
    """
    _check_temperature(temperature)
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match tokens {tuple(tokens.shape)}")
    B, R, V = logits.shape
    flat = logits.reshape(B * R, V)  # (N, V)
    flat_tokens = tokens.reshape(B * R, 1)  # (N, 1)
    dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16/fp16 -> fp32; fp64 stays
    out = torch.empty(B * R, dtype=dtype, device=logits.device)
    for s in range(0, B * R, chunk_size):
        z = flat[s : s + chunk_size].to(dtype) / temperature  # (n, V)
        out[s : s + chunk_size] = z.gather(-1, flat_tokens[s : s + chunk_size])[:, 0] - z.logsumexp(-1)
    return out.view(B, R)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, chunk_size: int = 2048) -> Tensor:
    """Per-position entropy H(pi(. | x, y_<t)) = -sum_v p log p of the tempered distribution.

    Args:
        logits: (B, R, V).
        temperature: > 0.
        chunk_size: positions per float32 chunk.

    Returns:
        (B, R) float32 entropy, nats. Unmasked.
    """
    _check_temperature(temperature)
    B, R, V = logits.shape
    flat = logits.reshape(B * R, V)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    out = torch.empty(B * R, dtype=dtype, device=logits.device)
    for s in range(0, B * R, chunk_size):
        logp = torch.log_softmax(flat[s : s + chunk_size].to(dtype) / temperature, dim=-1)
        p = logp.exp()
        # a -inf logit has p = 0 and contributes 0 (0 * -inf would be NaN)
        out[s : s + chunk_size] = -torch.where(p == 0, torch.zeros_like(p), p * logp).sum(-1)
    return out.view(B, R)


def response_mask_from_tokens(response_tokens: Tensor, eos_token_id: int | Sequence[int] | None) -> Tensor:
    """``response_mask``: True up to and including the first end token, False after it.

    Works when the pad token equals EOS: everything after the first end token is False, whatever
    it holds. A response with no end token (truncated at ``max_new_tokens``) is all True; a
    response whose first token ends it counts exactly that one token.

    Args:
        response_tokens: (B, R) long, generated tokens (right side of the sequence).
        eos_token_id: the id that ends a response, or several (a chat model's end-of-turn ids
            beside its EOS: any of them ends it), or None (then every position counts).

    Returns:
        (B, R) bool.

    Example:
        tokens [t0, t1, EOS, PAD, PAD] and [t0, t1, EOS, EOS, EOS] both give [1, 1, 1, 0, 0];
        with end ids {0, 7}, tokens [5, 6, 7, 3, 0] give [1, 1, 1, 0, 0].
    """
    if eos_token_id is None or (not isinstance(eos_token_id, int) and len(eos_token_id) == 0):
        return torch.ones_like(response_tokens, dtype=torch.bool)
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    ends = torch.tensor(ids, dtype=response_tokens.dtype, device=response_tokens.device)
    is_eos = torch.isin(response_tokens, ends).long()  # (B, R)
    # eos_before[t] = number of end tokens strictly before t; t counts iff none came before it.
    eos_before = torch.cumsum(is_eos, dim=-1) - is_eos
    return eos_before == 0


def last_token_index(response_mask: Tensor) -> Tensor:
    """Index of the last True position of each row (the last real token), shape (B,) long.

    Rows with no True position return 0 (the empty response counts its first token).
    """
    R = response_mask.shape[-1]
    positions = torch.arange(R, device=response_mask.device).expand_as(response_mask)
    return torch.where(response_mask.bool(), positions, torch.zeros_like(positions)).max(-1).values
