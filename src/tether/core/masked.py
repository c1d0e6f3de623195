"""Masked reductions over response tokens: sums, means and variances that masked slots never
reach (padding, post-EOS, prompt positions), even where they hold inf or NaN.

Torch only; every other core module reduces through these.
"""

from __future__ import annotations

import torch
from torch import Tensor


def at_least_fp32(x: Tensor) -> Tensor:
    """Upcast half/bfloat16 to float32; float32 and float64 keep their dtype."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is True; masked slots never contribute, even inf/NaN.

    Args:
        values: (B, R) float.
        mask: (B, R) bool or {0,1}, True where the token counts (``response_mask``).
        dim: reduce this dimension only (``-1``: per sequence), or all if None.

    Returns:
        Reduced tensor (float32, or float64 for float64 input).

    Raises:
        ValueError: ``mask`` and ``values`` differ in shape (no silent broadcasting).
    """
    if mask.shape != values.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must have the shape of values {tuple(values.shape)}")
    values = at_least_fp32(values)
    kept = torch.where(
        mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device)
    )  # (B, R); masked inf/NaN -> 0
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over True slots of ``mask``; masked slots never contribute.

    The count is clamped to at least 1 so an all-masked row gives 0, never NaN (the only
    clamp here; with one or more valid tokens the result is the exact mean).

    Args:
        values: (B, R) float.
        mask: (B, R) bool, True where the token counts.
        dim: reduce this dimension only, or all if None.

    Returns:
        float32 tensor: scalar if ``dim`` is None, else reduced along ``dim``.
    """
    m = mask.bool()
    count = m.sum(dim=dim) if dim is not None else m.sum()
    total = masked_sum(values, m, dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``values`` over the True slots of ``mask`` (scalar, float32).

    With ``unbiased`` the sum of squares is divided by ``n - 1`` (Bessel), clamped to >= 1.
    """
    mean = masked_mean(values, mask)
    sq = masked_sum((at_least_fp32(values) - mean).pow(2), mask)
    n = mask.bool().sum().to(sq.dtype)
    denom = (n - 1).clamp(min=1) if unbiased else n.clamp(min=1)
    return sq / denom
