"""KL coefficient controllers: fixed, adaptive and budget. Torch free, pure Python scalars.

A controller holds ``kl_coef`` (beta) and updates it from the measured KL once per rollout
batch. The measured KL's unit must match the target's unit; the trainer passes the number
named by ``kl.target_unit`` in the config (nats per sequence by default, as in Ziegler et al.).

**A controller owns its whole story here** (:class:`Controller`): its settings and the config
fields they come from (:attr:`Controller.fields`), what it holds the KL to (:meth:`held_kl`,
read by the health rules and drawn in the plots), how a model card and the console describe it
(:meth:`describe`), its state with its kind (:meth:`state_dict`), what a resume with changed
settings does (:meth:`load_state_dict`, which returns the changes to print), and the facts the
config's rules read (:attr:`reads_kl`, :attr:`raises_from_zero`, :attr:`for_dpo`). Trainers,
the monitor, the card, the plots and the config name no controller: they look it up in
:data:`CONTROLLERS`, where :func:`register` puts each class. Adding one: a class here, registered,
and its config fields (``kl.<field>``) in ``run/config.py``.

Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
arXiv 1909.08593, section 2.2: e_t = clip(KL_t / KL_target - 1, -0.2, 0.2),
beta_{t+1} = beta_t (1 + K_beta e_t), K_beta = n_steps / horizon (adaptive); the Lagrangian
dual of ``max E[r] s.t. KL <= epsilon`` (budget, see :class:`BudgetKLController`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import ClassVar, Literal, TypeVar

ControllerName = Literal["fixed", "adaptive", "budget"]
"""The built-in controllers' names; :data:`CONTROLLERS` holds every registered one."""

# The proportional error is clipped to +-0.2, as in Ziegler et al. 2019, section 2.2.
ADAPTIVE_ERROR_CLIP = 0.2

ADAPTIVE_MIN_REACH = 1.1
"""Below this, the adaptive controller cannot move beta by 10% over the whole run: a warning
(:meth:`AdaptiveKLController.notes`)."""


class Controller:
    """What every KL controller is and does besides its update rule (module docstring).

    A subclass is a dataclass whose first field is ``kl_coef`` (beta, reward units per nat); its
    other fields are its settings, except the ones named in :attr:`state` (what it learns while
    it runs, carried across a resume).
    """

    name: ClassVar[str]
    """The ``kl.controller`` name (the key of :data:`CONTROLLERS`)."""
    fields: ClassVar[dict[str, str]] = {}
    """Each setting (a dataclass field) -> the ``kl.<field>`` of the config it comes from."""
    state: ClassVar[tuple[str, ...]] = ()
    """The fields a resume carries on from the checkpoint (the rest are the resumed config's)."""
    held: ClassVar[str | None] = None
    """The setting the KL is held to (its value is :meth:`held_kl`), or None."""
    reads_kl: ClassVar[bool] = True
    """Whether beta follows the measured KL (so the KL it reads must be unbiased)."""
    raises_from_zero: ClassVar[bool] = False
    """Whether beta can rise from 0 (then the KL must be measured, and placed, even at kl_coef 0)."""
    guarded: ClassVar[bool] = False
    """Whether the update guard is on by default with it (``kl.guard`` unset): a controller that
    holds a budget, which one update must not cross (:mod:`tether.trainers.guard`)."""
    for_dpo: ClassVar[bool] = False
    """Whether DPO takes it: DPO's leash is its fixed ``dpo.beta``, so only a controller that
    never moves beta is meaningful there."""
    kl_coef: float

    def update(self, kl: float, n_steps: int) -> float:
        """Update from a measured KL and the number of samples it covers; return the new kl_coef."""
        raise NotImplementedError

    def cut(self, kl_wanted: float, n_steps: int) -> None:
        """The update guard cut this step's update: at this beta the update wanted ``kl_wanted``
        (the guard's measure of the update as the optimizer left it, the unit of :meth:`update`).
        Nothing by default: a controller that has read this step's KL has made its one update."""

    @classmethod
    def from_fields(cls: type[C], kl_coef: float, values: Mapping[str, object]) -> C:
        """The controller with beta ``kl_coef`` and its settings read from ``values`` by config
        field name (:attr:`fields`; the config's ``kl`` section as a mapping).

        Raises:
            ValueError: a field :attr:`fields` names is not in ``values`` (a typo would otherwise
                leave the setting at the class's default, silently).
        """
        missing = [key for key in cls.fields.values() if key not in values]
        if missing:
            raise ValueError(
                f"kl.controller={cls.name} reads {['kl.' + k for k in missing]}, which the config does not "
                "have: add the field to KLConfig (run/config.py) or fix the controller's fields"
            )
        return cls(kl_coef, **{arg: values[key] for arg, key in cls.fields.items()})  # type: ignore[call-arg]

    @classmethod
    def refusals(
        cls, values: Mapping[str, object], *, samples_per_update: int
    ) -> list[tuple[str, object, str]]:
        """What the config must refuse for this controller, as ``(kl.<field>, value, why and the
        fix)``; ``values`` are the ``kl`` section's fields, ``samples_per_update`` the rollout's
        batch size. None by default."""
        return []

    @classmethod
    def notes(cls, values: Mapping[str, object], *, samples_per_update: int, updates: int) -> list[str]:
        """Warnings for a run of ``updates`` controller updates of ``samples_per_update`` samples
        each (its settings' consequences a user would not see). None by default."""
        return []

    def held_kl(self) -> float | None:
        """The KL it holds (a target, a budget) in the unit of the KL it reads, or None."""
        return None if self.held is None else float(getattr(self, self.held))

    def describe(self, unit: str) -> str:
        """What it holds, for the model card and the console, e.g. ``budget 2.5 nats per
        sequence`` (``unit`` in words); a fixed beta: ``beta 0.1``."""
        if self.held is None:
            return f"beta {self.kl_coef:g}"
        return f"{self.held} {self.held_kl():g} {unit}"

    def state_dict(self) -> dict:
        """Every field, and ``kind``: the name, so that a resume never guesses it."""
        return {"kind": self.name, **asdict(self)}  # type: ignore[call-overload]

    def adopt(self, kl_coef: float) -> None:
        """Go on from another kind of controller's beta (a resume that changed kl.controller)."""
        self.kl_coef = kl_coef

    def load_state_dict(
        self, saved: dict, *, names: Mapping[str, str] | None = None, whose: str = "the controller's"
    ) -> list[str]:
        """Carry a checkpoint's controller on (a resume); returns the changes, to be printed, each
        setting under its name in ``names`` (field -> the name a user set it by; the field's own
        name where absent) and the settings as ``whose`` (``"anchor.budget's"`` for the anchor's).

        The same kind: the :attr:`state` fields are the checkpoint's, the settings the resumed
        config's (``--resume RUN kl.budget=...`` takes effect), and each setting that differs is
        reported (``budget 2 -> 3``). Another kind: beta carries on (:meth:`adopt`), reported.
        A checkpoint without ``kind`` (written before tether saved it) is read by its fields
        (:func:`legacy_kind`).
        """
        _check_saved(saved, self.state)
        kind = saved.get("kind") or legacy_kind(saved)
        if kind != self.name:
            self.adopt(float(saved["kl_coef"]))
            return [f"kl.controller changed ({kind} -> {self.name})"]
        own = [f.name for f in fields(self) if f.name in saved]  # type: ignore[arg-type]
        names = names or {}
        changed = [
            f"{names.get(name, name)} {saved[name]:g} -> {getattr(self, name):g}"
            for name in own
            if name not in self.state and saved[name] != getattr(self, name) and saved[name] is not None
        ]
        for name in self.state:
            if name in saved:
                setattr(self, name, saved[name])
        self.resumed(saved, changed=bool(changed))
        return [f"{whose} settings changed ({', '.join(changed)})"] if changed else []

    def resumed(self, saved: dict, *, changed: bool) -> None:
        """After :meth:`load_state_dict` of the same kind: what this controller does with a
        checkpoint of its own (``changed``: a setting differs); nothing by default."""


C = TypeVar("C", bound=Controller)


def _check_saved(saved: dict, state: tuple[str, ...]) -> None:
    """Refuse a controller state no tether wrote: beta (``kl_coef``) missing, or a state value
    that is not a finite number >= 0 (``last_kl``, a KL, may be any finite number or None).

    Raises:
        ValueError: naming the field and what it holds.
    """

    def number(x) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

    bad = [] if "kl_coef" in saved else ["kl_coef (missing)"]
    for name in {"kl_coef", *state} & saved.keys():
        x = saved[name]
        if name == "last_kl" and (x is None or number(x)):
            continue
        if not (number(x) and x >= 0) and not (x is None and name == "dual"):
            bad.append(f"{name}={x!r}")
    if bad:
        raise ValueError(
            f"the checkpoint's controller state is not one tether wrote ({', '.join(bad)}); resume from "
            "another checkpoint, or start the run again"
        )


CONTROLLERS: dict[str, type[Controller]] = {}
"""``kl.controller`` -> class; :func:`register` fills it."""


def register(cls: type[C]) -> type[C]:
    """Class decorator: ``CONTROLLERS[cls.name] = cls``.

    Raises:
        ValueError: the name is registered already by another class (a subclass that did not set
            its own ``name`` would replace its parent for every run of the process); the class is
            not a dataclass (its state is saved field by field); ``fields``, ``state`` or ``held``
            name a field it does not have (each would otherwise fail only at the first resume,
            checkpoint or health check, after training ran).
    """
    if CONTROLLERS.get(cls.name, cls) is not cls:
        raise ValueError(
            f"kl.controller={cls.name!r} is registered already ({CONTROLLERS[cls.name].__name__})"
        )
    if not is_dataclass(cls):
        raise ValueError(f"controller {cls.__name__} must be a @dataclass (register it above @dataclass)")
    own = {f.name for f in fields(cls)}
    named = [*cls.fields, *cls.state, *([cls.held] if cls.held is not None else [])]
    missing = sorted({n for n in named if n not in own})
    if missing:
        raise ValueError(
            f"controller {cls.__name__} names {missing} in fields/state/held, which are not its "
            f"dataclass fields {sorted(own)}"
        )
    CONTROLLERS[cls.name] = cls
    return cls


KLController = Controller  # the name the rest of tether (and its users) type with


def legacy_kind(saved: dict) -> str:
    """The kind of a controller checkpoint written before tether saved ``kind``: told by the
    fields the three controllers of that time had (``budget``, ``target``, neither). Only for
    those checkpoints: every state written since names its kind."""
    return "budget" if "budget" in saved else "adaptive" if "target" in saved else "fixed"


@register
@dataclass
class FixedKLController(Controller):
    """beta never changes. On a resume the configured beta holds (a changed one is reported)."""

    name: ClassVar[str] = "fixed"
    reads_kl: ClassVar[bool] = False
    for_dpo: ClassVar[bool] = True
    kl_coef: float

    def __post_init__(self) -> None:
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")

    def update(self, kl: float, n_steps: int) -> float:
        return self.kl_coef

    def adopt(self, kl_coef: float) -> None:
        """A fixed controller keeps its configured beta whatever the last one was."""


@register
@dataclass
class AdaptiveKLController(Controller):
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
    fields: ClassVar[dict[str, str]] = {"target": "target", "horizon": "horizon"}
    state: ClassVar[tuple[str, ...]] = ("kl_coef",)
    held: ClassVar[str | None] = "target"

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

    @classmethod
    def refusals(
        cls, values: Mapping[str, object], *, samples_per_update: int
    ) -> list[tuple[str, object, str]]:
        """An update of more than ``horizon / 0.2`` samples could make beta negative."""
        horizon = float(values["horizon"])  # type: ignore[arg-type]
        if samples_per_update <= horizon / ADAPTIVE_ERROR_CLIP:
            return []
        return [
            (
                "kl.horizon",
                horizon,
                f"must be >= rollout.batch_size / 5 = {samples_per_update / 5} "
                "or kl_coef could turn negative",
            )
        ]

    @classmethod
    def notes(cls, values: Mapping[str, object], *, samples_per_update: int, updates: int) -> list[str]:
        """It multiplies beta: from 0 it stays 0; and over a short run its horizon may let beta
        move by too little to hold anything (:func:`adaptive_reach`)."""
        kl_coef, horizon, target = (float(values[k]) for k in ("kl_coef", "horizon", "target"))  # type: ignore[arg-type]
        if kl_coef == 0:
            return ["kl.controller=adaptive multiplies beta, so it stays 0"]
        reach = adaptive_reach(samples_per_update, horizon, updates)
        if reach >= ADAPTIVE_MIN_REACH:
            return []
        return [
            f"kl.controller=adaptive with kl.horizon={horizon:g} samples and "
            f"{samples_per_update} samples per step moves beta by at most {(reach - 1) * 100:.2g}% "
            f"over train.steps={updates} (Ziegler et al.'s and TRL's horizon, made for far "
            f"longer runs): beta stays within that of kl.kl_coef={kl_coef:g} whatever the KL does "
            f"against kl.target={target:g}. To hold the target in this run, lower kl.horizon (e.g. "
            f"{adaptive_horizon_for(samples_per_update, updates):g}) or use kl.controller=budget"
        ]


def adaptive_reach(n_steps: int, horizon: float, updates: int) -> float:
    """The most the adaptive controller can multiply beta by over ``updates`` updates.

    Each update multiplies beta by at most ``1 + 0.2 * n_steps / horizon`` (the error clipped at
    +-0.2, Ziegler et al. 2019), so over a run by at most ``(1 + 0.2 * n_steps / horizon) **
    updates`` (and divides it by at most ``1 / (1 - 0.2 * n_steps / horizon) ** updates``).

    Example:
        32 samples per step, horizon 10000, 16 steps: 1.00064 ** 16 = 1.0103: beta moves by at
        most 1% over the run, a fixed beta in all but name.

    Returns:
        The factor, or ``inf`` where it exceeds a float (``train.steps=1e8``: ``x ** updates``
        overflows, and a reach that large is as good as unbounded).
    """
    try:
        return (1.0 + ADAPTIVE_ERROR_CLIP * n_steps / horizon) ** updates
    except OverflowError:
        return math.inf


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


@register
@dataclass
class BudgetKLController(Controller):
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
    that of the policy *before* step t's update, and the beta it returns acts on that update
    (the trainers read it before updating, since issue 52; before, it acted on step t + 1's): while
    beta is 0 and the KL rises by ``d`` per step, the update taken at a reading just under the
    budget ends near ``KL + d``, one step's rise over (the update guard, :mod:`tether.trainers.guard`,
    bounds that step; measured on SmolLM2 with GRPO's defaults and the old one-step lag: a held-out
    KL peak 30% over the budget, 22% with ``kd = kp``). Stooke et
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
    fields: ClassVar[dict[str, str]] = {
        "budget": "budget",
        "eta": "budget_eta",
        "kp": "budget_kp",
        "kd": "budget_kd",
    }
    state: ClassVar[tuple[str, ...]] = ("kl_coef", "dual", "last_kl")
    held: ClassVar[str | None] = "budget"
    raises_from_zero: ClassVar[bool] = True
    guarded: ClassVar[bool] = True

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

    def cut(self, kl_wanted: float, n_steps: int) -> None:
        """A second dual step, on the KL the cut update wanted: the Lagrangian's subgradient at the
        best response to the current beta (docs/kl.md, "The dual after a cut"). Without it the
        guard holds the KL at the ceiling and the dual integrates only the tolerance."""
        self.update(kl_wanted, n_steps)

    def adopt(self, kl_coef: float) -> None:
        """The dual variable starts at the other controller's beta."""
        self.kl_coef = self.dual = kl_coef

    def resumed(self, saved: dict, *, changed: bool) -> None:
        """A checkpoint from before budget_kp ran pure dual ascent, so it goes on with it; a rise
        measured under other settings means nothing to the derivative term."""
        if "dual" not in saved and "kind" not in saved:
            self.kl_coef = self.dual = float(saved["kl_coef"])
            self.kp = self.kd = 0.0
        elif changed:
            self.last_kl = None


def make_controller(name: str, kl_coef: float, **settings: float) -> Controller:
    """Build a registered controller by name (:data:`CONTROLLERS`).

    Args:
        name: ``"fixed"``, ``"adaptive"``, ``"budget"`` or another registered name.
        kl_coef: initial (or fixed) beta, >= 0.
        **settings: that controller's settings by field name (adaptive: ``target``, ``horizon``;
            budget: ``budget``, ``eta``, ``kp``, ``kd``).

    Raises:
        ValueError: an unknown name, a setting the controller does not have, a missing one (an
            adaptive controller's target, a budget controller's budget), or an invalid value.
    """
    if name not in CONTROLLERS:
        raise ValueError(f"unknown KL controller {name!r}; choose one of {list(CONTROLLERS)}")
    cls = CONTROLLERS[name]
    unknown = sorted(set(settings) - {f.name for f in fields(cls)})  # type: ignore[arg-type]
    if unknown:
        raise ValueError(f"kl.controller={name} has no setting {unknown}; its settings: {list(cls.fields)}")
    try:
        return cls(kl_coef, **settings)  # type: ignore[call-arg]
    except TypeError as e:  # a required setting missing
        raise ValueError(f"kl.controller={name} needs {list(cls.fields)} ({e})") from None
