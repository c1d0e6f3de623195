"""Other divergences between the policy and the reference, exact over the vocabulary, per position.

The leash's KL is the reverse KL ``KL(pi || pi_ref)`` (:func:`tether.core.kl.exact_kl_from_logits`).
Logged beside it on the same positions (the policy's own samples' prefixes), from the same
logits, in one pass:

* the forward KL ``KL(pi_ref || pi) = sum_v q (log q - log p)``: what forgetting tracks (Shenfeld
  et al. 2025, "RL's Razor"), and what the text anchor holds on human text (:mod:`tether.core.anchor`);
* the Jensen-Shannon divergence ``JS = (KL(p || m) + KL(q || m)) / 2`` with ``m = (p + q) / 2``:
  symmetric, bounded by ``ln 2`` nats per position (Lin 1991);
* Amari's alpha-divergence ``D_a = (1 - sum_v p^a q^(1 - a)) / (a (1 - a))`` for ``0 < a < 1``
  (Amari 1985; Cichocki & Amari 2010, eq. 4): ``a -> 1`` is the reverse KL, ``a -> 0`` the forward
  KL, ``a = 1/2`` is ``4 (1 - BC)`` with ``BC = sum_v sqrt(p q)`` the Bhattacharyya coefficient.
  In nats at its limits.

with ``p = softmax(logits / T)``, ``q = softmax(ref_logits / T)``. Torch only.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

LN2 = math.log(2.0)


class Divergences(NamedTuple):
    """Per-position divergences (each (B, R) float32, nats, unmasked)."""

    forward_kl: Tensor
    js: Tensor
    alpha: Tensor


def divergences_from_logits(
    logits: Tensor,
    ref_logits: Tensor,
    temperature: float = 1.0,
    alpha: float = 0.5,
    chunk_size: int = 1024,
) -> Divergences:
    """The forward KL, JS and alpha-divergence of each position (see the module's docstring).

    Float32 (float64 input stays float64), ``chunk_size`` positions at a time (O(chunk_size * V)
    extra memory). Conventions at zero probabilities, so a -inf logit never gives NaN: a term
    ``x log(x / y)`` is 0 where ``x == 0``; the alpha-divergence is summed without the cancellation
    of ``1 - sum`` (:func:`_amari`), exact in float32 also near ``a = 0`` and ``a = 1``. A NaN logit
    gives NaN.

    Args:
        logits, ref_logits: (B, R, V) the policy's and the reference's logits.
        temperature: both tempered alike (> 0).
        alpha: the alpha-divergence's order, in (0, 1).
        chunk_size: positions per chunk (> 0).

    Returns:
        :class:`Divergences`, each (B, R).

    Raises:
        ValueError: shapes differ, temperature <= 0, alpha outside (0, 1), chunk_size <= 0.
    """
    if logits.shape != ref_logits.shape:
        raise ValueError(f"logits {tuple(logits.shape)} != ref_logits {tuple(ref_logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    B, R, V = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)
    flat_p, flat_q = logits.reshape(B * R, V), ref_logits.reshape(B * R, V)
    out = [torch.empty(B * R, dtype=dtype, device=logits.device) for _ in range(3)]
    for s in range(0, B * R, chunk_size):
        lp = torch.log_softmax(flat_p[s : s + chunk_size].to(dtype) / temperature, dim=-1)
        lq = torch.log_softmax(flat_q[s : s + chunk_size].to(dtype) / temperature, dim=-1)
        p, q = lp.exp(), lq.exp()
        out[0][s : s + chunk_size] = _xlog(q, lq - lp).sum(-1)
        lm = torch.logaddexp(lp, lq) - LN2  # log of the mixture (p + q) / 2
        out[1][s : s + chunk_size] = 0.5 * (_xlog(p, lp - lm) + _xlog(q, lq - lm)).sum(-1)
        out[2][s : s + chunk_size] = _amari(lp, lq, p, q, alpha)
    return Divergences(*(o.view(B, R) for o in out))


def _amari(lp: Tensor, lq: Tensor, p: Tensor, q: Tensor, alpha: float) -> Tensor:
    """``(1 - sum_v p^a q^(1-a)) / (a (1 - a))`` per row, without the cancellation of ``1 - sum``.

    Written about the distribution whose exponent is the larger, so the ``expm1`` argument carries
    the small factor: for ``a >= 1/2``, ``-sum_v p expm1((1 - a)(log q - log p))``, which uses
    ``sum p = 1``; for ``a < 1/2``, ``-sum_v q expm1(a (log p - log q))``, which uses ``sum q = 1``.
    (The first form at ``a = 1e-6`` sums terms of size KL to a result of size ``a KL``: float32
    rounding then decides its sign.) A zero of the weighting distribution gives a 0 term; a zero
    of the other gives ``expm1(-inf) = -1``, the weight itself.
    """
    w, d, c = (p, lq - lp, 1 - alpha) if alpha >= 0.5 else (q, lp - lq, alpha)
    term = torch.where(w == 0, torch.zeros_like(w), -w * torch.expm1(c * d))
    return term.sum(-1) / (alpha * (1 - alpha))


def _xlog(x: Tensor, log_ratio: Tensor) -> Tensor:
    """``x * log_ratio`` with 0 where ``x == 0`` (a NaN ``x`` stays NaN)."""
    return torch.where(x == 0, torch.zeros_like(x), x * log_ratio)
