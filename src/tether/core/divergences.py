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

from tether.core.kl import reverse_kl_rows

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
    return exact_and_divergences(logits, ref_logits, temperature, alpha, chunk_size)[1]


def exact_and_divergences(
    logits: Tensor,
    ref_logits: Tensor,
    temperature: float = 1.0,
    alpha: float = 0.5,
    chunk_size: int = 1024,
) -> tuple[Tensor, Divergences]:
    """The exact reverse KL (equal bit for bit to :func:`tether.core.kl.exact_kl_from_logits`'s)
    and :func:`divergences_from_logits`'s three, from one log-softmax of each side per chunk: the
    scoring pass's way when ``kl.exact`` and ``kl.divergences`` are both on.

    Returns:
        ``(reverse_kl, divergences)``, each (B, R), nats. Same arguments and errors as
        :func:`divergences_from_logits`.
    """
    _check_arguments(logits, ref_logits, temperature=temperature, alpha=alpha, chunk_size=chunk_size)
    B, R, V = logits.shape
    dtype = torch.promote_types(logits.dtype, torch.float32)
    flat_p, flat_q = logits.reshape(B * R, V), ref_logits.reshape(B * R, V)
    out = [torch.empty(B * R, dtype=dtype, device=logits.device) for _ in range(4)]
    for s in range(0, B * R, chunk_size):
        lp = torch.log_softmax(flat_p[s : s + chunk_size].to(dtype) / temperature, dim=-1)
        lq = torch.log_softmax(flat_q[s : s + chunk_size].to(dtype) / temperature, dim=-1)
        p, q = lp.exp(), lq.exp()
        for o, kind in zip(out, ("forward_kl", "js", "alpha", "reverse_kl")):
            o[s : s + chunk_size] = _value(kind, lp, lq, p, q, alpha=alpha)
    return out[3].view(B, R), Divergences(*(o.view(B, R) for o in out[:3]))


def _check_arguments(
    logits: Tensor, ref_logits: Tensor, *, temperature: float, alpha: float, chunk_size: int
) -> None:
    """The checks every function here makes of its arguments.

    Raises:
        ValueError: shapes that differ, temperature <= 0, alpha outside (0, 1), chunk_size <= 0.
    """
    if logits.shape != ref_logits.shape:
        raise ValueError(f"logits {tuple(logits.shape)} != ref_logits {tuple(ref_logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")


def _value(kind: str, lp: Tensor, lq: Tensor, p: Tensor, q: Tensor, *, alpha: float) -> Tensor:
    """Per row of log-softmaxes ``lp``, ``lq`` (N, V) (``p``, ``q`` their exps): the divergence
    ``kind`` of the policy from the reference, nats: the one expression of each, which the logged
    values and the leash's loss share."""
    if kind == "reverse_kl":
        return reverse_kl_rows(lp, lq, p)
    if kind == "forward_kl":
        return _xlog(q, lq - lp).sum(-1)
    if kind == "js":
        lm = torch.logaddexp(lp, lq) - LN2  # log of the mixture (p + q) / 2
        return 0.5 * (_xlog(p, lp - lm) + _xlog(q, lq - lm)).sum(-1)
    if kind == "alpha":
        return _amari(lp, lq, p, q, alpha)
    raise ValueError(f"unknown divergence {kind!r}; choose one of {LEASH_DIVERGENCES}")


def _p_grad(kind: str, lp: Tensor, lq: Tensor, p: Tensor, q: Tensor, *, alpha: float) -> Tensor:
    """``p_v * dD / dp_v`` (N, V), up to a term ``c * p_v`` with ``c`` constant per row (which the
    softmax's Jacobian removes): the divergence's gradient with respect to the logits ``z`` at
    temperature 1 is ``g - p * sum_v g`` with ``g`` this. Derivations (docs/kl.md, "The leash's
    divergence"):

    * reverse KL ``sum p (lp - lq)``: ``dD/dp_v = lp_v - lq_v + 1``, so ``g = p (lp - lq)``;
    * forward KL ``sum q (lq - lp)``: ``dD/dp_v = -q_v / p_v``, so ``g = -q``;
    * JS: ``dD/dp_v = (lp_v - lm_v) / 2`` (the terms of ``d log m`` cancel), ``g = p (lp - lm) / 2``;
    * Amari alpha: ``dD/dp_v = -p_v^(a-1) q_v^(1-a) / (1 - a)``, so ``g = -(p^a q^(1-a)) / (1 - a)``,
      written ``-(p + p expm1((1 - a)(lq - lp))) / (1 - a)`` with the ``p`` part dropped (a
      constant times p) so no ``1 - sum`` cancels near ``a = 1``; where ``(1 - a)(lq - lp) > 20``
      (``p`` tiny against ``p^a q^(1-a)``), or where ``p`` underflows float32 to 0 while
      ``p^a q^(1-a)`` does not (``lp`` finite, below -104; small ``a``), the product is
      ``exp(a lp + (1 - a) lq) - p``, which cannot overflow; only where ``lp`` is -inf (a -inf
      logit) is the term 0.
    """
    if kind == "reverse_kl":
        return _xlog(p, lp - lq)
    if kind == "forward_kl":
        return -q
    if kind == "js":
        lm = torch.logaddexp(lp, lq) - LN2
        return 0.5 * _xlog(p, lp - lm)
    if kind == "alpha":
        c = 1.0 - alpha
        gone = lp == -math.inf
        cd = c * (torch.where(gone, 0.0, lq) - torch.where(gone, 0.0, lp))  # finite where lp = -inf
        far = (cd > 20) | (p == 0)
        small = torch.where(far, torch.zeros_like(cd), cd)  # keeps expm1's unused branch finite
        moved = torch.where(far, torch.exp(lp + cd) - p, p * torch.expm1(small))
        return -torch.where(gone, torch.zeros_like(p), moved) / c
    raise ValueError(f"unknown divergence {kind!r}; choose one of {LEASH_DIVERGENCES}")


LEASH_DIVERGENCES = ("reverse_kl", "forward_kl", "js", "alpha")
"""``kl.divergence``: what the leash in the loss holds, exactly over the vocabulary at each sampled
position (:func:`leash_divergence`)."""


class _Divergence(torch.autograd.Function):
    """Per-position divergence with its exact gradient, ``chunk`` positions at a time in both passes
    (saves only its inputs: no (N, V) intermediates are kept for the backward)."""

    @staticmethod
    def forward(ctx, logits, ref_logits, kind, temperature, alpha, chunk):  # noqa: D102, PLR0917
        N = logits.shape[0]
        dtype = torch.promote_types(logits.dtype, torch.float32)
        out = torch.empty(N, dtype=dtype, device=logits.device)
        for s in range(0, N, chunk):
            lp = torch.log_softmax(logits[s : s + chunk].to(dtype) / temperature, dim=-1)
            lq = torch.log_softmax(ref_logits[s : s + chunk].to(dtype) / temperature, dim=-1)
            out[s : s + chunk] = _value(kind, lp, lq, lp.exp(), lq.exp(), alpha=alpha)
        ctx.save_for_backward(logits, ref_logits)
        ctx.settings = (kind, temperature, alpha, chunk)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        logits, ref_logits = ctx.saved_tensors
        kind, temperature, alpha, chunk = ctx.settings
        dtype = torch.promote_types(logits.dtype, torch.float32)
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            lp = torch.log_softmax(logits[s : s + chunk].to(dtype) / temperature, dim=-1)
            lq = torch.log_softmax(ref_logits[s : s + chunk].to(dtype) / temperature, dim=-1)
            p = lp.exp()
            g = _p_grad(kind, lp, lq, p, lq.exp(), alpha=alpha)
            dz = (g - p * g.sum(-1, keepdim=True)) / temperature  # the softmax's Jacobian, then 1/T
            grad[s : s + chunk] = (dz * grad_out[s : s + chunk, None]).to(logits.dtype)
        return grad, None, None, None, None, None


def leash_divergence(
    kind: str,
    logits: Tensor,
    ref_logits: Tensor,
    *,
    temperature: float = 1.0,
    alpha: float = 0.5,
    chunk_size: int = 256,
) -> Tensor:
    """The leash's divergence ``D(pi(. | s_t), pi_ref(. | s_t))`` at each position, exactly over the
    vocabulary, with its exact gradient with respect to the policy's logits (``kl.divergence``,
    in the loss).

    ``kind``: ``reverse_kl`` ``KL(pi || pi_ref)``, ``forward_kl`` ``KL(pi_ref || pi)``, ``js``
    (Jensen-Shannon) or ``alpha`` (Amari's, of order ``alpha``); values as
    :func:`exact_and_divergences` logs them (the same expressions, bit for bit at equal logits).
    The gradient is ``g - p sum_v g`` per position (:func:`_p_grad`), recomputed a chunk at a time
    in the backward (extra memory O(chunk_size * V)). Both sides tempered by ``temperature``.

    Args:
        kind: one of :data:`LEASH_DIVERGENCES`.
        logits: (B, R, V) the policy's logits, with grad, any float dtype.
        ref_logits: (B, R, V) the reference's, no grad.
        temperature: > 0. alpha: the order for ``alpha``, in (0, 1). chunk_size: positions per chunk.

    Returns:
        (B, R) float32 (float64 for float64 input), nats, unmasked.

    Raises:
        ValueError: an unknown kind, shapes that differ, temperature <= 0, alpha outside (0, 1),
            chunk_size <= 0.
    """
    if kind not in LEASH_DIVERGENCES:
        raise ValueError(f"unknown divergence {kind!r}; choose one of {LEASH_DIVERGENCES}")
    _check_arguments(logits, ref_logits, temperature=temperature, alpha=alpha, chunk_size=chunk_size)
    V = logits.shape[-1]
    flat = _Divergence.apply(
        logits.reshape(-1, V), ref_logits.detach().reshape(-1, V), kind, temperature, alpha, chunk_size
    )
    return flat.view(logits.shape[:-1])


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
