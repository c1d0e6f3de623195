"""Per-token estimators of KL(pi_theta || pi_ref) and their masked aggregations.

Torch only; imports nothing from tether. Every function takes tensors and scalars.

Sign convention, written once for the whole project::

    log_ratio        = logprobs - ref_logprobs            # log pi_theta - log pi_ref, nats
    non_score_reward = -kl_coef * kl                      # the leash, a reward <= 0 in expectation

All estimators are evaluated on tokens ``y_t`` sampled from ``pi_theta`` (on-policy), so that
``E_{y_t ~ pi_theta}[k(y_t)]`` is compared with the exact per-token KL
``sum_v pi_theta(v) (log pi_theta(v) - log pi_ref(v))``.

Sources:
    J. Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html
    (k1, k2, k3); Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
    arXiv 1909.08593, eq. 2 (k1 in the reward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch
from torch import Tensor

from tether.core.masked import at_least_fp32, masked_sum

KLEstimator = Literal["k1", "abs", "k2", "k3"]
"""Names of the sampled per-token estimators, see :data:`ESTIMATORS`."""

# A log-ratio r = log pi_ref - log pi_theta above this (nats) means the policy gives the token a
# probability below exp(-20) ~ 2e-9 of the reference's. k3 = exp(r) - 1 - r is clamped there, from
# above only, so one outlier token cannot overflow exp() to inf (exp(88) overflows float32); below,
# exp(r) only vanishes and k3 = -1 - r stays exact, which is the reward-hacking side (the policy
# far above the reference) where the KL must not be capped. The clamp applies only to k3's exp();
# k1, abs and k2 use the raw ratio. Documented in docs/kl.md.
K3_LOG_RATIO_CLAMP = 20.0


def _log_ratio(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} "
            "must have the same shape (B, R)"
        )
    return at_least_fp32(logprobs) - at_least_fp32(ref_logprobs)


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log pi_theta(y_t) - log pi_ref(y_t): unbiased, can be negative per token.

    Args:
        logprobs: (B, R) float, log pi_theta(y_t | x, y_<t) in nats.
        ref_logprobs: (B, R) float, log pi_ref(y_t | x, y_<t) in nats.

    Returns:
        (B, R) float32, nats. Unmasked: apply :func:`masked_mean` / :func:`masked_sum`.

    Raises:
        ValueError: if the shapes differ.
    """
    return _log_ratio(logprobs, ref_logprobs)


def kl_abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """|k1|: non-negative but biased upward (a monitoring estimator, not a KL gradient).

    Shapes and units as :func:`kl_k1`.
    """
    return _log_ratio(logprobs, ref_logprobs).abs()


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = 0.5 * (log pi_theta - log pi_ref)^2: non-negative, biased, low variance.

    Its on-policy expectation is KL + O(third moment); the bias is exactly
    ``E[k2] - KL`` which ``tests/oracle/test_kl.py`` computes by enumeration. Its gradient on-policy
    equals the reverse-KL gradient (Tang & Munos 2025, arXiv 2506.09477).
    Shapes and units as :func:`kl_k1`.
    """
    return 0.5 * _log_ratio(logprobs, ref_logprobs).pow(2)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(r) - 1 - r with r = log pi_ref - log pi_theta: unbiased and non-negative.

    Schulman (2020). ``r`` is clamped from above at ``K3_LOG_RATIO_CLAMP`` (20 nats) before
    ``exp`` so that a token the policy gives almost no mass cannot overflow to inf; at r <= 20 the
    result is exact, however far the policy's log-probability is above the reference's. Shapes
    and units as :func:`kl_k1`.
    """
    return k3_from_log_ratio(_log_ratio(logprobs, ref_logprobs))


def k3_from_log_ratio(log_ratio: Tensor) -> Tensor:
    """k3 of ``log_ratio = log p - log q`` on samples of p: ``expm1(r) - r`` with ``r = -log_ratio``.

    The one k3 of the code: :func:`kl_k3` (p = pi_theta, q = pi_ref), the KL-loss surrogates of
    :mod:`tether.core.losses`, and the clipped loss's ``approx_kl`` (p = pi_old, q = pi_theta).
    ``r`` is clamped from above at ``K3_LOG_RATIO_CLAMP`` (20 nats; exact below it). Any shape;
    float, nats.
    """
    r = (-log_ratio).clamp(max=K3_LOG_RATIO_CLAMP)
    return torch.expm1(r) - r


ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "abs": kl_abs,
    "k2": kl_k2,
    "k3": kl_k3,
}
assert set(ESTIMATORS) == set(get_args(KLEstimator))


def estimate_kl(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k1") -> Tensor:
    """Per-token KL estimate by name, looked up in :data:`ESTIMATORS`.

    Args:
        logprobs: (B, R) log pi_theta of the sampled tokens, nats.
        ref_logprobs: (B, R) log pi_ref of the same tokens, nats.
        estimator: one of ``"k1"``, ``"abs"``, ``"k2"``, ``"k3"``.

    Returns:
        (B, R) float32 per-token estimate, nats, not yet masked.

    Raises:
        ValueError: unknown estimator name, or mismatched shapes.
    """
    try:
        fn = ESTIMATORS[estimator]
    except KeyError:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {sorted(ESTIMATORS)}") from None
    return fn(logprobs, ref_logprobs)


def exact_kl_from_logits(
    logits: Tensor,
    ref_logits: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> Tensor:
    """Exact per-token KL(pi_theta || pi_ref) over the whole vocabulary.

    ``KL_t = sum_v p(v) (log p(v) - log q(v))`` with ``p = softmax(logits / temperature)`` and
    ``q = softmax(ref_logits / temperature)``, computed in float32 (float64 input stays float64)
    on at most ``chunk_size`` token positions at a time, so the extra memory is O(chunk_size * V),
    never O(B * R * V).
    Where ``p(v) == 0`` the term is 0 (``xlogy`` convention), so a -inf logit never gives NaN.

    Args:
        logits: (B, R, V) policy logits, any float dtype (upcast per chunk).
        ref_logits: (B, R, V) reference logits.
        temperature: sampling temperature (> 0); both distributions are tempered alike.
        chunk_size: token positions per chunk (> 0).

    Returns:
        (B, R) exact KL per position (float32, or float64 for float64 input), nats, >= 0 up to
        rounding. Unmasked.

    Raises:
        ValueError: shape mismatch, temperature <= 0 or chunk_size <= 0.
    """
    if logits.shape != ref_logits.shape:
        raise ValueError(f"logits {tuple(logits.shape)} != ref_logits {tuple(ref_logits.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    B, R, V = logits.shape
    flat_p = logits.reshape(B * R, V)  # (N, V)
    flat_q = ref_logits.reshape(B * R, V)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    out = torch.empty(B * R, dtype=dtype, device=logits.device)
    for start in range(0, B * R, chunk_size):
        lp = torch.log_softmax(flat_p[start : start + chunk_size].to(dtype) / temperature, dim=-1)
        lq = torch.log_softmax(flat_q[start : start + chunk_size].to(dtype) / temperature, dim=-1)
        p = lp.exp()
        # p * (lp - lq); where p == 0 the product is defined as 0 even if lq is -inf.
        term = torch.where(p > 0, p * (lp - lq), torch.zeros_like(p))
        out[start : start + chunk_size] = term.sum(-1)
    return out.view(B, R)


def sequence_kl(kl: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence KL: sum over the response's valid tokens.

    Args:
        kl: (B, R) per-token KL, nats.
        mask: (B, R) bool ``response_mask``.

    Returns:
        (B,) float32, nats per sequence.
    """
    return masked_sum(kl, mask, dim=-1)
