"""Where the KL term goes, checked once: in the reward, in the loss, neither, never both by accident.

The trainers call :func:`check_placement` before anything loads. What is true of each estimator
in each placement, and why, is its record's (:class:`tether.core.kl.Estimator`, in
:data:`tether.core.kl.ESTIMATORS`): this module only reads the records.

Which estimator is gradient-correct depends on the placement (Tang & Munos 2025, "On a few
pitfalls in KL divergence gradient estimation for RL", arXiv 2506.09477; Schulman 2020):

* In the **reward**, only the score-function term ``E[grad log pi * (-beta * kl)]`` reaches the
  policy. With ``k1`` that is exactly ``-beta * grad KL(pi || pi_ref)``. With ``k3`` (or k2,
  abs) it is not: k3 in the reward biases the update toward the forward KL.
* In the **loss**, the estimator is differentiated directly. ``k2`` and ``k3+`` (k3's value,
  k2's gradient) give ``grad KL`` on-policy, ``k3_is`` also off-policy: each the gradient of
  every position's next-token KL, which on multi-token responses is not the sequence KL's.
  ``k1_seq`` (the score function with the KL still to come) gives the sequence KL's gradient,
  on- and off-policy. ``k1`` has expected gradient 0 and ``k3`` gives the forward-KL gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import tether.core.losses  # noqa: F401  (registers the loss surrogates k3+, k3_is, k1_seq)
from tether.core.kl import ESTIMATORS

PLACEMENTS = {"reward": "kl.estimator", "loss": "kl.loss_estimator"}
"""Each placement and the config field naming its estimator."""


def exact_in(placement: str) -> list[str]:
    """The registered estimators whose gradient is exact in ``placement`` (``"reward"`` or
    ``"loss"``), from their records."""
    return [n for n, e in ESTIMATORS.items() if (s := getattr(e, placement)) is not None and s.exact]


class Placement(NamedTuple):
    kl_in_reward: bool
    kl_in_loss: bool
    needs_reference: bool
    """False only when kl_coef is 0 everywhere and KL monitoring is off: no reference is built."""
    warnings: list[str]


def check_placement(
    kl_in_reward: bool,
    kl_in_loss: bool,
    reward_estimator: str,
    loss_estimator: str,
    kl_coef: float,
    *,
    monitor_kl: bool = True,
    allow_double_kl: bool = False,
    allow_biased_estimator: bool = False,
) -> Placement:
    """Validate a KL placement; return it with any warnings.

    Raises:
        ValueError: both placements on without ``allow_double_kl`` (double counting); an
            estimator whose gradient is not the reverse-KL gradient in its placement without
            ``allow_biased_estimator``. Each message names the field and the fix.
    """
    warnings: list[str] = []
    if kl_in_reward and kl_in_loss:
        msg = (
            "kl.kl_in_reward and kl.kl_in_loss are both true: the KL would be counted twice, "
            "as a per-token reward penalty and again as a loss term, so the effective beta is "
            "about 2 * kl_coef and the logged KL no longer matches the objective"
        )
        if not allow_double_kl:
            raise ValueError(msg + ". Turn one off, or set kl.allow_double_kl=true if you mean it.")
        warnings.append(msg + " (allowed by kl.allow_double_kl)")
    for on, est, placement in (
        (kl_in_reward, reward_estimator, "reward"),
        (kl_in_loss, loss_estimator, "loss"),
    ):
        field, ok = PLACEMENTS[placement], exact_in(placement)
        standing = getattr(ESTIMATORS[est], placement) if est in ESTIMATORS else None
        if not on or (standing is not None and standing.exact):
            continue
        if standing is None:
            raise ValueError(f"{field}={est!r} is unknown for this placement; choose one of {ok}")
        if not allow_biased_estimator:
            raise ValueError(
                f"{field}={est!r}: {standing.why}. Use one of {ok}, "
                "or set kl.allow_biased_estimator=true to run it anyway."
            )
        warnings.append(f"{field}={est!r}: {standing.why} (allowed by kl.allow_biased_estimator)")
    uses_kl = (kl_in_reward or kl_in_loss) and kl_coef > 0
    return Placement(kl_in_reward, kl_in_loss, uses_kl or monitor_kl, warnings)
