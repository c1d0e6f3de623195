"""Where the KL term goes, checked once: in the reward, in the loss, neither, never both by accident.

Pure Python; no torch. The trainers call :func:`check_placement` before anything loads.

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

REWARD_ESTIMATOR_OK = ("k1",)
REWARD_ESTIMATOR_BIASED = {
    "k3": "k3 in the reward: E[grad log pi * k3] is not grad KL(pi || pi_ref); it biases the "
    "update toward the forward KL (Tang & Munos 2025, arXiv 2506.09477)",
    "k2": "k2 in the reward: E[grad log pi * k2] is not grad KL(pi || pi_ref) "
    "(Tang & Munos 2025, arXiv 2506.09477)",
    "abs": "abs(k1) in the reward is biased upward and its gradient is not grad KL (Schulman 2020)",
}
LOSS_ESTIMATOR_OK = ("k2", "k3+", "k3_is", "k1_seq")
LOSS_ESTIMATOR_BIASED = {
    "k1": "k1 in the loss has expected gradient 0 on-policy (E[grad log pi] = 0): the leash pulls "
    "nothing (Tang & Munos 2025, arXiv 2506.09477)",
    "k3": "k3 in the loss differentiates to grad KL(pi_ref || pi), the forward KL, not the "
    "reverse KL of the objective (Tang & Munos 2025, arXiv 2506.09477)",
}


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
    for on, est, ok, biased, field in (
        (kl_in_reward, reward_estimator, REWARD_ESTIMATOR_OK, REWARD_ESTIMATOR_BIASED, "kl.estimator"),
        (kl_in_loss, loss_estimator, LOSS_ESTIMATOR_OK, LOSS_ESTIMATOR_BIASED, "kl.loss_estimator"),
    ):
        if not on or est in ok:
            continue
        if est not in biased:
            raise ValueError(f"{field}={est!r} is unknown for this placement; choose one of {list(ok)}")
        if not allow_biased_estimator:
            raise ValueError(
                f"{field}={est!r}: {biased[est]}. Use one of {list(ok)}, "
                "or set kl.allow_biased_estimator=true to run it anyway."
            )
        warnings.append(f"{field}={est!r}: {biased[est]} (allowed by kl.allow_biased_estimator)")
    uses_kl = (kl_in_reward or kl_in_loss) and kl_coef > 0
    return Placement(kl_in_reward, kl_in_loss, uses_kl or monitor_kl, warnings)
