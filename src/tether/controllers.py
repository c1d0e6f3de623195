"""KL coefficient controllers: fixed and adaptive. Torch free, pure Python scalars.

A controller holds ``kl_coef`` (beta) and updates it from the measured KL once per rollout
batch. The measured KL's unit must match the target's unit; the trainer passes the number
named by ``kl.target_unit`` in the config (nats per sequence by default, as in Ziegler et al.).

Source: Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences",
arXiv 1909.08593, section 2.2: e_t = clip(KL_t / KL_target - 1, -0.2, 0.2),
beta_{t+1} = beta_t (1 + K_beta e_t), K_beta = n_steps / horizon.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal, Protocol

ControllerName = Literal["fixed", "adaptive"]

# The proportional error is clipped to +-0.2, as in Ziegler et al. 2019, section 2.2.
ADAPTIVE_ERROR_CLIP = 0.2


class KLController(Protocol):
    kl_coef: float

    def update(self, kl: float, n_steps: int) -> float:
        """Update from a measured KL and the number of samples it covers; return new kl_coef."""

    def state_dict(self) -> dict: ...


@dataclass
class FixedKLController:
    """beta never changes."""

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
            raise ValueError(f"n_steps={n_steps} > horizon/0.2={self.horizon / ADAPTIVE_ERROR_CLIP}: "
                             "kl_coef could turn negative; raise kl.horizon")
        error = min(max(kl / self.target - 1.0, -ADAPTIVE_ERROR_CLIP), ADAPTIVE_ERROR_CLIP)
        self.kl_coef = self.kl_coef * (1.0 + error * n_steps / self.horizon)
        return self.kl_coef

    def state_dict(self) -> dict:
        return asdict(self)


def make_controller(
    name: ControllerName, kl_coef: float, target: float | None = None, horizon: float = 10_000
) -> KLController:
    """Build a controller by name (``"fixed"`` or ``"adaptive"``).

    Raises:
        ValueError: unknown name, or ``"adaptive"`` without a positive target.
    """
    if name == "fixed":
        return FixedKLController(kl_coef=kl_coef)
    if name == "adaptive":
        if target is None:
            raise ValueError("kl.controller=adaptive needs kl.target (> 0)")
        return AdaptiveKLController(kl_coef=kl_coef, target=target, horizon=horizon)
    raise ValueError(f"unknown KL controller {name!r}; choose 'fixed' or 'adaptive'")
