"""KL coefficient controllers: fixed, adaptive and budget. Torch free, pure Python scalars.

A controller holds ``kl_coef`` (beta) and updates it from the measured KL once per rollout
batch. The measured KL's unit must match the target's unit; the trainer passes the number
named by ``kl.target_unit`` in the config (nats per sequence by default, as in Ziegler et al.).

Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
arXiv 1909.08593, section 2.2: e_t = clip(KL_t / KL_target - 1, -0.2, 0.2),
beta_{t+1} = beta_t (1 + K_beta e_t), K_beta = n_steps / horizon (adaptive); the Lagrangian
dual of ``max E[r] s.t. KL <= epsilon`` (budget, see :class:`BudgetKLController`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import ClassVar, Literal, Protocol

ControllerName = Literal["fixed", "adaptive", "budget"]

# The proportional error is clipped to +-0.2, as in Ziegler et al. 2019, section 2.2.
ADAPTIVE_ERROR_CLIP = 0.2


class KLController(Protocol):
    kl_coef: float
    name: ClassVar[str]
    """The ``kl.controller`` name of the class (a key of :data:`CONTROLLERS`)."""

    def update(self, kl: float, n_steps: int) -> float:
        """Update from a measured KL and the number of samples it covers; return new kl_coef."""

    def state_dict(self) -> dict: ...


@dataclass
class FixedKLController:
    """beta never changes."""

    name: ClassVar[str] = "fixed"
    kl_coef: float

    def __post_init__(self) -> None:
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")

    def update(self, kl: float, n_steps: int) -> float:
        return self.kl_coef

    def state_dict(self) -> dict:
        return asdict(self)


@dataclass
class AdaptiveKLController:
    """Proportional controller of Ziegler et al. 2019 that holds KL near ``target``.

    Attributes:
        kl_coef: current beta (>= 0).
        target: KL target (> 0) in the same unit as the measured KL passed to :meth:`update`.
        horizon: time constant in samples (> 0); larger is slower.

    Example:
        kl_coef 0.1, target 1.0, horizon 10000, measured 2.0, n_steps 256:
        e = clip(2.0/1.0 - 1, -0.2, 0.2) = 0.2; beta = 0.1 * (1 + 0.2 * 256/10000)
        = 0.1 * 1.00512 = 0.100512.
    """

    name: ClassVar[str] = "adaptive"

    kl_coef: float
    target: float
    horizon: float = 10_000

    def __post_init__(self) -> None:
        if self.target <= 0:
            raise ValueError(f"kl target must be > 0, got {self.target}")
        if self.horizon <= 0:
            raise ValueError(f"kl horizon must be > 0, got {self.horizon}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")

    def update(self, kl: float, n_steps: int) -> float:
        """Raises ValueError on a non-finite KL or on n_steps > 5 * horizon (beta would go < 0)."""
        if not math.isfinite(kl):
            raise ValueError(f"measured KL is {kl}; the adaptive controller needs a finite KL")
        if n_steps > self.horizon / ADAPTIVE_ERROR_CLIP:
            raise ValueError(
                f"n_steps={n_steps} > horizon/0.2={self.horizon / ADAPTIVE_ERROR_CLIP}: "
                "kl_coef could turn negative; raise kl.horizon"
            )
        error = min(max(kl / self.target - 1.0, -ADAPTIVE_ERROR_CLIP), ADAPTIVE_ERROR_CLIP)
        self.kl_coef = self.kl_coef * (1.0 + error * n_steps / self.horizon)
        return self.kl_coef

    def state_dict(self) -> dict:
        return asdict(self)


def adaptive_reach(n_steps: int, horizon: float, updates: int) -> float:
    """The most the adaptive controller can multiply beta by over ``updates`` updates.

    Each update multiplies beta by at most ``1 + 0.2 * n_steps / horizon`` (the error clipped at
    +-0.2, Ziegler et al. 2019), so over a run by at most ``(1 + 0.2 * n_steps / horizon) **
    updates`` (and divides it by at most ``1 / (1 - 0.2 * n_steps / horizon) ** updates``).

    Example:
        32 samples per step, horizon 10000, 16 steps: 1.00064 ** 16 = 1.0103: beta moves by at
        most 1% over the run, a fixed beta in all but name.
    """
    return (1.0 + ADAPTIVE_ERROR_CLIP * n_steps / horizon) ** updates


def adaptive_horizon_for(n_steps: int, updates: int) -> float:
    """A horizon (two significant digits, rounded down, at least ``0.2 * n_steps``) over which the
    adaptive controller can double beta in ``updates`` updates: the inverse of
    :func:`adaptive_reach` at 2, ``0.2 * n_steps / (2 ** (1 / updates) - 1)``.

    Example:
        32 samples per step, 16 steps: 6.4 / (2 ** (1/16) - 1) = 144.6 -> 140.
    """
    h = ADAPTIVE_ERROR_CLIP * n_steps / (2 ** (1 / updates) - 1)
    digits = 10 ** (math.floor(math.log10(h)) - 1)
    return max(math.floor(h / digits) * digits, ADAPTIVE_ERROR_CLIP * n_steps)  # update() needs >= 0.2 n


@dataclass
class BudgetKLController:
    """Projected dual ascent on beta for the KL-constrained objective ``max E[r] s.t. KL <= budget``.

    The constrained problem ``max_pi E_pi[r]`` subject to ``KL(pi || pi_ref) <= epsilon`` has the
    Lagrangian ``L(pi, beta) = E_pi[r] - beta * (KL(pi || pi_ref) - epsilon)`` with ``beta >= 0``.
    For a fixed beta the inner maximization is the usual KL-regularized objective
    ``J = E[r] - beta * KL`` that the trainers optimize; its dual function
    ``g(beta) = max_pi L(pi, beta)`` is convex in beta with (sub)gradient
    ``dg/dbeta = epsilon - KL(pi_beta || pi_ref)``. Projected (sub)gradient descent on g, i.e.
    ascent on the constraint violation, projected onto ``beta >= 0``::

        beta <- max(0, beta + eta * (KL - epsilon))

    raises beta while the measured KL is over budget and lowers it (never below 0) while it is
    under. At a fixed point with beta > 0 the measured KL equals epsilon (complementary
    slackness); beta = 0 means the budget is not binding. Source: Boyd & Vandenberghe,
    "Convex Optimization" (2004), section 5.2 (the Lagrange dual) and the projected subgradient
    method; applied to the KL-constrained RLHF objective as in the constrained-policy-optimization
    literature (e.g. Tessler et al. 2019, "Reward Constrained Policy Optimization",
    arXiv 1805.11074, which updates the multiplier the same way).

    **Proportional term** (``kp > 0``; 0 in this class and :func:`make_controller`, while the
    config's ``kl.budget_kp`` defaults to 3.0 with ``kl.budget_eta`` 0.3). On a real language
    model beta acts on the KL only through later optimizer steps (AdamW momentum, several
    minibatches per rollout), so the plant lags and the pure integral rule rings: beta keeps
    rising while the KL is already falling, overshoots, and the KL swings around epsilon instead
    of settling on it (measured on SmolLM2: last-half mean 27% under a 2-nat budget with
    ``eta=1``). The PID-Lagrangian fix
    (Stooke, Achiam & Abbeel 2020, "Responsive Safety in Reinforcement Learning by PID Lagrangian
    Methods", arXiv 2007.03964, eq. 5) adds the current error on top of the projected integral::

        dual  <- max(0, dual + eta * (KL - epsilon))     # the dual variable above
        beta  =  max(0, dual + kp * (KL - epsilon))

    so beta answers an overshoot at once and lets go as soon as the KL is back, while ``dual``
    still settles at the beta that holds the budget (at a fixed point the error is 0 and
    beta = dual). ``kp = 0`` is exactly the projected dual ascent above.

    **Derivative term** (``kd > 0``; 0 by default here, in :func:`make_controller` and in the
    config's ``kl.budget_kd``). The KL this controller reads at step t is
    that of the policy *before* step t's update, and the beta it returns acts on step t + 1's
    update, which starts from a policy one update further on: while beta is 0 and the KL rises
    by ``d`` per step, the policy the next beta acts on is already near ``KL + d``, and the KL
    the run ends with overshoots the budget by up to two steps' rise (measured on SmolLM2 with
    GRPO's defaults: a held-out KL peak 30% over the budget, 22% with ``kd = kp``). Stooke et
    al. (2020, eq. 5, the same paper) add the rise of the constraint's cost, positive part only::

        beta = max(0, dual + kp * (KL - epsilon) + kd * max(0, KL - KL_prev))

    With ``kd = kp`` this is the proportional term applied to the one-step extrapolation
    ``KL + max(0, KL - KL_prev)``: beta starts before the KL reaches the budget. A falling KL
    adds nothing (so the term never pushes beta below what the error asks), the first call has
    no ``KL_prev`` and adds nothing, and at a fixed point (no rise) beta = dual as before.

    Unlike :class:`AdaptiveKLController` the step does not scale with the number of samples:
    ``n_steps`` is accepted for the :class:`KLController` protocol and ignored, so one call is
    one dual step of size ``eta`` per rollout batch.

    Attributes:
        kl_coef: current beta (>= 0), reward units per nat.
        budget: epsilon (> 0), the KL the run may spend, in the same unit as the measured KL
            passed to :meth:`update` (nats per sequence or nats per token).
        eta: dual step size (> 0), in beta units per unit of KL error (reward units per nat^2).
        kp: proportional gain (>= 0), same unit as ``eta``; 0 = pure projected dual ascent.
        kd: derivative gain (>= 0), same unit, on the KL's rise since the last call; 0 = none.
        last_kl: the KL of the previous call (state, checkpointed); None before the first.
        dual: the projected integral (the Lagrange multiplier estimate, >= 0); None at
            construction means "start at ``kl_coef``".

    Example:
        kl_coef 0.1, budget 1.0, eta 0.1: measured 1.5 gives max(0, 0.1 + 0.1 * 0.5) = 0.15;
        measured 0.0 afterwards gives max(0, 0.15 + 0.1 * (-1.0)) = max(0, 0.05) = 0.05; measured
        0.0 again gives max(0, 0.05 - 0.1) = 0 (projected).
        With kp 1.0 (same start): measured 1.5 gives dual 0.15 and beta 0.15 + 1.0 * 0.5 = 0.65.
        With kp 1.0 and kd 1.0, starting at kl_coef 0, budget 1.0, eta 0.1: measured 0.2 gives
        dual max(0, 0 - 0.08) = 0 and beta max(0, 0 - 0.8 + 0) = 0 (no previous KL); measured 0.7
        next gives dual 0, beta max(0, 0 + 1.0 * (-0.3) + 1.0 * 0.5) = 0.2: the KL is still under
        budget, but one more step's rise would take it to 1.2.
    """

    name: ClassVar[str] = "budget"

    kl_coef: float
    budget: float
    eta: float = 0.1
    kp: float = 0.0
    dual: float | None = None
    kd: float = 0.0
    last_kl: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.budget) and self.budget > 0):
            raise ValueError(f"kl budget must be finite and > 0, got {self.budget}")
        if not (math.isfinite(self.eta) and self.eta > 0):
            raise ValueError(f"budget controller eta must be finite and > 0, got {self.eta}")
        if not (math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ValueError(f"kl_coef must be finite and >= 0, got {self.kl_coef}")
        if not (math.isfinite(self.kp) and self.kp >= 0):
            raise ValueError(f"budget controller kp must be finite and >= 0, got {self.kp}")
        if not (math.isfinite(self.kd) and self.kd >= 0):
            raise ValueError(f"budget controller kd must be finite and >= 0, got {self.kd}")
        if self.dual is None:
            self.dual = self.kl_coef

    def update(self, kl: float, n_steps: int) -> float:
        """One projected dual step (plus the proportional and derivative terms); ``n_steps`` is
        ignored.

        Args:
            kl: measured KL in the unit of ``budget``; may be negative (a sampled k1 mean).
            n_steps: samples behind ``kl``; unused, kept for the :class:`KLController` protocol.

        Returns:
            The new kl_coef (>= 0).

        Raises:
            ValueError: if ``kl`` is not finite.
        """
        if not math.isfinite(kl):
            raise ValueError(f"measured KL is {kl}; the budget controller needs a finite KL")
        error = kl - self.budget
        dual = self.kl_coef if self.dual is None else self.dual  # None only before __post_init__
        rise = 0.0 if self.last_kl is None else max(0.0, kl - self.last_kl)
        self.dual = max(0.0, dual + self.eta * error)
        self.kl_coef = max(0.0, self.dual + self.kp * error + self.kd * rise)
        self.last_kl = kl
        return self.kl_coef

    def state_dict(self) -> dict:
        return asdict(self)


def make_controller(
    name: ControllerName,
    kl_coef: float,
    target: float | None = None,
    horizon: float = 10_000,
    budget: float | None = None,
    *,
    eta: float = 0.1,
    kp: float = 0.0,
    kd: float = 0.0,
) -> KLController:
    """Build a controller by name (``"fixed"``, ``"adaptive"`` or ``"budget"``).

    Args:
        name: which controller.
        kl_coef: initial (or fixed) beta, >= 0.
        target: adaptive only, the KL target (> 0).
        horizon: adaptive only, time constant in samples (> 0).
        budget: budget only, epsilon (> 0), same unit as the measured KL.
        eta: budget only, dual step size (> 0).
        kp: budget only, proportional gain (>= 0; 0 = pure projected dual ascent).
        kd: budget only, derivative gain on the KL's rise (>= 0; 0 = none).

    Raises:
        ValueError: unknown name, ``"adaptive"`` without a positive target, ``"budget"``
            without a positive budget, or any invalid parameter.
    """
    if name not in CONTROLLERS:
        raise ValueError(f"unknown KL controller {name!r}; choose one of {list(CONTROLLERS)}")
    return CONTROLLERS[name](kl_coef, target=target, horizon=horizon, budget=budget, eta=eta, kp=kp, kd=kd)


def _adaptive(kl_coef: float, target: float | None, horizon: float, **_) -> AdaptiveKLController:
    if target is None:
        raise ValueError("kl.controller=adaptive needs kl.target (> 0)")
    return AdaptiveKLController(kl_coef=kl_coef, target=target, horizon=horizon)


def _budget(
    kl_coef: float, budget: float | None, eta: float, kp: float, kd: float = 0.0, **_
) -> BudgetKLController:
    if budget is None:
        raise ValueError("kl.controller=budget needs a KL budget (epsilon > 0)")
    return BudgetKLController(kl_coef=kl_coef, budget=budget, eta=eta, kp=kp, kd=kd)


CONTROLLERS: dict[str, Callable[..., KLController]] = {
    "fixed": lambda kl_coef, **_: FixedKLController(kl_coef=kl_coef),
    "adaptive": _adaptive,
    "budget": _budget,
}
"""``kl.controller`` -> builder taking ``kl_coef`` and the keywords of :func:`make_controller`."""
