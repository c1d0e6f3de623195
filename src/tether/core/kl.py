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
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from tether.core.masked import at_least_fp32, masked_sum

KLEstimator = Literal["k1", "abs", "k2", "k3"]
"""The built-in sampled per-token estimators' names (:data:`ESTIMATORS` holds every registered
one, the loss surrogates of :mod:`tether.core.losses` too)."""

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


# ---- an estimator is one record ---------------------------------------------------------------
class Standing(NamedTuple):
    """What is true of an estimator in one placement (Tang & Munos 2025, arXiv 2506.09477)."""

    exact: bool
    """Its expected gradient there is ``grad KL(pi_theta || pi_ref)`` (on-policy)."""
    why: str
    """The reason, with its source: for an estimator that is not exact, the refusal's text."""


LossTerms = Callable[[Tensor, Tensor, "Tensor | None", "Tensor | None"], Tensor]
"""A KL-in-the-loss surrogate: ``(logprobs with grad, ref_logprobs, old_logprobs or None,
response_mask or None) -> (B, R) terms``, unmasked, nats (:func:`tether.core.losses.kl_loss_terms`)."""


@dataclass(frozen=True)
class Estimator:
    """One KL estimator and everything tether relies on about it, read by the placement check
    (:func:`tether.core.placement.check_placement`), the config's rules and the trainers.

    Attributes:
        name: the ``kl.estimator`` / ``kl.loss_estimator`` value.
        value: the per-token estimate of a sampled token, ``(logprobs, ref_logprobs) -> (B, R)``
            nats (logged, shaped into the reward, read by the controller), or None for a loss
            surrogate only.
        mean_is_kl: its mean over the policy's samples is KL(pi_theta || pi_ref) (unbiased).
        reward: its standing as ``-beta * kl`` in the reward (score-function gradient), or None
            when it cannot be placed there.
        loss: its standing differentiated in the loss, or None when it is no loss surrogate.
        loss_terms: the surrogate of the loss placement (:data:`LossTerms`), or None.
        off_policy: the loss surrogate stays exact on samples of an older policy pi_old (the
            update's later minibatches and epochs): importance-weighted.
    """

    name: str
    value: Callable[[Tensor, Tensor], Tensor] | None = None
    mean_is_kl: bool = False
    reward: Standing | None = None
    loss: Standing | None = None
    loss_terms: LossTerms | None = None
    off_policy: bool = False


ESTIMATORS: dict[str, Estimator] = {}
"""Every registered estimator by name (:func:`register_estimator`): the sampled ones here, the
loss surrogates (k3+, k3_is, k1_seq) in :mod:`tether.core.losses`."""


def register_estimator(estimator: Estimator) -> Estimator:
    """Add ``estimator`` to :data:`ESTIMATORS`.

    Raises:
        ValueError: its name is registered already (a built-in would otherwise be replaced for
            every run of the process), or a loss standing without loss terms, or the other way.
    """
    if ESTIMATORS.get(estimator.name, estimator) != estimator:
        raise ValueError(f"a KL estimator named {estimator.name!r} is registered already")
    if (estimator.loss is None) != (estimator.loss_terms is None):
        raise ValueError(
            f"estimator {estimator.name!r}: give both a loss standing and its loss_terms, or neither"
        )
    ESTIMATORS[estimator.name] = estimator
    return estimator


def sampled_estimators() -> list[str]:
    """The names ``kl.estimator`` takes: the registered estimators with a per-token value."""
    return [n for n, e in ESTIMATORS.items() if e.value is not None]


def _of_log_ratio(fn: Callable[[Tensor], Tensor]) -> LossTerms:
    """A surrogate that is a function of ``log pi - log pi_ref`` alone (the reference detached)."""
    return lambda logprobs, ref_logprobs, old_logprobs, mask: fn(logprobs - ref_logprobs.detach())


TANG_MUNOS = "Tang & Munos 2025, arXiv 2506.09477"
register_estimator(
    Estimator(
        "k1",
        value=kl_k1,
        mean_is_kl=True,
        reward=Standing(
            True, "E[grad log pi * k1] is exactly grad KL(pi || pi_ref) (Ziegler et al. 2019, eq. 2)"
        ),
        loss=Standing(
            False,
            "k1 in the loss has expected gradient 0 on-policy (E[grad log pi] = 0): the leash pulls "
            f"nothing ({TANG_MUNOS})",
        ),
        loss_terms=_of_log_ratio(lambda r: r),
    )
)
register_estimator(
    Estimator(
        "abs",
        value=kl_abs,
        reward=Standing(
            False, "abs(k1) in the reward is biased upward and its gradient is not grad KL (Schulman 2020)"
        ),
    )
)
register_estimator(
    Estimator(
        "k2",
        value=kl_k2,
        reward=Standing(
            False, f"k2 in the reward: E[grad log pi * k2] is not grad KL(pi || pi_ref) ({TANG_MUNOS})"
        ),
        loss=Standing(
            True, f"k2's gradient k1 * grad log pi has expectation grad KL on-policy ({TANG_MUNOS})"
        ),
        loss_terms=_of_log_ratio(lambda r: 0.5 * r.pow(2)),
    )
)
register_estimator(
    Estimator(
        "k3",
        value=kl_k3,
        mean_is_kl=True,
        reward=Standing(
            False,
            "k3 in the reward: E[grad log pi * k3] is not grad KL(pi || pi_ref); it biases the "
            f"update toward the forward KL ({TANG_MUNOS})",
        ),
        loss=Standing(
            False,
            "k3 in the loss differentiates to grad KL(pi_ref || pi), the forward KL, not the "
            f"reverse KL of the objective ({TANG_MUNOS})",
        ),
        loss_terms=_of_log_ratio(lambda r: k3_from_log_ratio(r)),
    )
)


def estimate_kl(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token KL estimate by name: the ``value`` of its record in :data:`ESTIMATORS`.

    Args:
        logprobs: (B, R) log pi_theta of the sampled tokens, nats.
        ref_logprobs: (B, R) log pi_ref of the same tokens, nats.
        estimator: ``"k1"``, ``"abs"``, ``"k2"``, ``"k3"`` or another registered sampled estimator.

    Returns:
        (B, R) float32 per-token estimate, nats, not yet masked.

    Raises:
        ValueError: unknown estimator name, or mismatched shapes.
    """
    fn = ESTIMATORS[estimator].value if estimator in ESTIMATORS else None
    if fn is None:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {sorted(sampled_estimators())}")
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
    Where ``p(v) == 0`` the term is 0 (``xlogy`` convention), so a -inf logit never gives NaN;
    a NaN or +inf logit gives NaN (a broken policy is not read as KL 0).

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
        out[start : start + chunk_size] = reverse_kl_rows(lp, lq, lp.exp())
    return out.view(B, R)


def reverse_kl_rows(lp: Tensor, lq: Tensor, p: Tensor) -> Tensor:
    """``sum_v p (lp - lq)`` per row of log-softmaxes ``lp``, ``lq`` (N, V) and ``p = exp(lp)``: the
    one expression of the exact reverse KL, which :func:`exact_kl_from_logits` and
    :func:`tether.core.divergences.exact_and_divergences` share (so the two agree bit for bit).

    Where ``p == 0`` the term is 0 even if ``lq`` is -inf. A NaN ``p`` (a NaN or +inf logit) is not
    0 and stays NaN: a broken policy must not read as KL 0.
    """
    return torch.where(p == 0, torch.zeros_like(p), p * (lp - lq)).sum(-1)


def sequence_kl(kl: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence KL: sum over the response's valid tokens.

    Args:
        kl: (B, R) per-token KL, nats.
        mask: (B, R) bool ``response_mask``.

    Returns:
        (B,) float32, nats per sequence.
    """
    return masked_sum(kl, mask, dim=-1)


def importance_weighted_kl(
    exact_kl: Tensor, logprobs: Tensor, old_logprobs: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor]:
    """The exact KL of a policy pi to the reference, on samples drawn from another policy pi_old.

    A sequence's KL is the sum of its positions' exact next-token KLs, ``KL(pi || pi_ref) =
    E_{y ~ pi}[sum_t KL_t(y_<t)]``, and ``KL_t`` depends on the prefix ``y_<t`` alone, so
    ``E_{y ~ pi}[KL_t(y_<t)] = E_{y ~ pi_old}[rho_<t(y) KL_t(y_<t)]`` with the prefix's
    importance ratio ``rho_<t = prod_{t' < t} pi(y_t' | y_<t') / pi_old(y_t' | y_<t')`` over the
    policy's tokens before t (an environment's tokens are drawn by the environment under both
    policies alike: they enter no ratio and carry no KL). This is exact in expectation on any
    batch of pi_old's samples; at pi = pi_old every ratio is 1 and it is the batch's exact KL.
    The prefix ratio, not the whole sequence's (``k1_seq``'s), so no position carries the noise of
    the tokens after it. No clamp (a clamp would bias it; an overflow to inf only over-reads the
    KL). Not for a batch an update was fitted to: that update raised exactly these sequences'
    ratios, and on the demo's first step this read 716,872 nats against a next-batch exact KL of
    0.27 (the update guard reads :func:`tether.trainers.steps.updated_kl` instead).

    Args:
        exact_kl: (B, R) exact per-position KL(pi(.|y_<t) || pi_ref(.|y_<t)) of pi, nats.
        logprobs: (B, R) log pi of the sampled tokens, nats.
        old_logprobs: (B, R) log pi_old of the same tokens (the policy that drew them), nats.
        mask: (B, R) bool, True on the policy's tokens.

    Returns:
        ``(per_sequence, weights)``: (B,) ``sum_t rho_<t KL_t`` over the valid tokens (its mean over
        sequences estimates KL(pi || pi_ref) in nats per sequence), and (B, R) ``rho_<t`` (0 where
        masked: their valid sum over the batch estimates the expected length under pi, for a per
        token KL as the ratio of the two sums), float32 or float64 as the inputs.

    Raises:
        ValueError: shapes differ.
    """
    m = mask.bool()
    log_ratio = torch.where(m, _log_ratio(logprobs, old_logprobs), 0.0)  # (B, R)
    prefix = torch.cumsum(log_ratio, dim=-1) - log_ratio  # sum over t' < t
    weights = torch.where(m, torch.exp(prefix), 0.0)  # (B, R)
    kl = torch.where(m, at_least_fp32(exact_kl), 0.0)
    return (weights * kl).sum(-1), weights
