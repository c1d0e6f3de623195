"""Tests for tether.core.controllers: fixed and adaptive (Ziegler et al. 2019) KL controllers."""

from __future__ import annotations

import math

import pytest
import torch

from tether.core.controllers import (
    ADAPTIVE_ERROR_CLIP,
    AdaptiveKLController,
    BudgetKLController,
    FixedKLController,
    make_controller,
)
from tether.core.distributed import kl_stats


def test_issue_example_from_kl_stats():
    # per-token KL [0.5, 0.5, 0.5, 0.5] and [1.0, 1.0, pad, pad]
    # per-sequence sums: 4 * 0.5 = 2.0 and 1.0 + 1.0 = 2.0 -> kl_per_sequence = 2.0
    kl = torch.tensor([[0.5, 0.5, 0.5, 0.5], [1.0, 1.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    measured = kl_stats(kl, mask)["kl_per_sequence"].item()
    assert measured == pytest.approx(2.0, abs=1e-15)
    c = AdaptiveKLController(kl_coef=0.1, target=1.0, horizon=10_000)
    # e = clip(2.0 / 1.0 - 1, -0.2, 0.2) = clip(1.0) = 0.2
    # beta = 0.1 * (1 + 0.2 * 256 / 10000) = 0.1 * 1.00512 = 0.100512
    new = c.update(measured, 256)
    assert new == pytest.approx(0.100512, abs=1e-15)
    assert c.kl_coef == new


@pytest.mark.parametrize(
    "kl,want",
    [
        # e = 1.1 - 1 = 0.1:   0.1 * (1 + 0.1 * 0.0256) = 0.1 * 1.00256 = 0.100256 (raised)
        (1.1, 0.100256),
        # e = 0.9 - 1 = -0.1:  0.1 * (1 - 0.1 * 0.0256) = 0.1 * 0.99744 = 0.099744 (lowered)
        (0.9, 0.099744),
        # e = 0: unchanged
        (1.0, 0.1),
        # e = 1.2 - 1 = 0.2 (the clip edge):  0.1 * 1.00512 = 0.100512
        (1.2, 0.100512),
        # e = 100 - 1 = 99 -> clipped to 0.2: same as 1.2
        (100.0, 0.100512),
        # e = 0 - 1 = -1 -> clipped to -0.2: 0.1 * (1 - 0.00512) = 0.099488
        (0.0, 0.099488),
        # e = -5 (negative measured k1) -> clipped to -0.2
        (-4.0, 0.099488),
    ],
)
def test_adaptive_direction_and_clipping(kl, want):
    c = AdaptiveKLController(kl_coef=0.1, target=1.0, horizon=10_000)
    assert c.update(kl, 256) == pytest.approx(want, abs=1e-15)


def test_adaptive_target_unit_scaling_and_repeated_updates():
    # target 6.0, measured 7.5: e = 7.5/6 - 1 = 0.25 -> clipped 0.2
    # horizon 1000, n_steps 100: K = 0.1; each step beta *= 1 + 0.02
    c = AdaptiveKLController(kl_coef=0.05, target=6.0, horizon=1000)
    for _ in range(3):
        c.update(7.5, 100)
    assert c.kl_coef == pytest.approx(0.05 * 1.02**3, abs=1e-15)
    # measured 5.4: e = 5.4/6 - 1 = -0.1 -> beta *= 1 - 0.01
    before = c.kl_coef
    c.update(5.4, 100)
    assert c.kl_coef == pytest.approx(before * 0.99, abs=1e-15)
    assert ADAPTIVE_ERROR_CLIP == 0.2
    assert c.state_dict() == {"kind": "adaptive", "kl_coef": c.kl_coef, "target": 6.0, "horizon": 1000}


def test_fixed_never_changes():
    c = FixedKLController(kl_coef=0.07)
    for kl in (0.0, 1.0, 100.0, -3.0):
        assert c.update(kl, 256) == 0.07
    assert c.kl_coef == 0.07
    assert c.state_dict() == {"kind": "fixed", "kl_coef": 0.07}


def test_make_controller():
    f = make_controller("fixed", 0.1)
    assert isinstance(f, FixedKLController) and f.kl_coef == 0.1
    a = make_controller("adaptive", 0.2, target=3.0, horizon=500)
    assert isinstance(a, AdaptiveKLController)
    assert (a.kl_coef, a.target, a.horizon) == (0.2, 3.0, 500)


def test_make_controller_errors():
    with pytest.raises(ValueError, match="unknown KL controller"):
        make_controller("pid", 0.1, target=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="target"):
        make_controller("adaptive", 0.1)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="target"):
            make_controller("adaptive", 0.1, target=bad)
    with pytest.raises(ValueError, match="horizon"):
        make_controller("adaptive", 0.1, target=1.0, horizon=0)
    with pytest.raises(ValueError, match="kl_coef"):
        make_controller("adaptive", -0.1, target=1.0)


def test_adaptive_reach_is_the_product_of_the_largest_steps():
    from tether.core.controllers import adaptive_reach

    # 32 samples, horizon 10000: each update at most x(1 + 0.2 * 32 / 10000) = x1.00064
    assert adaptive_reach(32, 10_000, 16) == pytest.approx(1.00064**16, rel=1e-12)  # 1.0103
    # and the controller itself, fed a KL far above target 16 times, moves beta by exactly that
    c = AdaptiveKLController(kl_coef=0.05, target=6.0, horizon=10_000)
    for _ in range(16):
        c.update(100.0, n_steps=32)
    assert c.kl_coef == pytest.approx(0.05 * adaptive_reach(32, 10_000, 16), rel=1e-12)
    # beyond a float (train.steps=1e8 raised "OverflowError: Numerical result out of range"): inf
    assert adaptive_reach(64, 10_000, 10**8) == math.inf


def test_adaptive_horizon_for_can_double_beta():
    from tether.core.controllers import adaptive_horizon_for, adaptive_reach

    # 32 samples, 16 steps: 6.4 / (2 ** (1/16) - 1) = 144.6, two digits rounded down: 140
    assert adaptive_horizon_for(32, 16) == 140
    # 8 samples, 1 step: 1.6 / (2 - 1) = 1.6, which is also the floor 0.2 * 8
    assert adaptive_horizon_for(8, 1) == pytest.approx(1.6)
    for n, steps in [(32, 16), (4, 3), (512, 100), (1, 1)]:
        assert adaptive_reach(n, adaptive_horizon_for(n, steps), steps) >= 2.0 - 1e-12


def test_only_the_budget_controller_learns_from_a_cut_update():
    # a cut means the update wanted more KL than the guard kept. The budget controller takes a
    # second dual step on it: budget 1, eta 0.1, dual 0.2, kp 0: wanted 3.0 gives
    # 0.2 + 0.1 * (3.0 - 1.0) = 0.4. The adaptive and fixed controllers made their one update
    # for the step already: a cut leaves them as they were.
    budget = BudgetKLController(kl_coef=0.2, budget=1.0, eta=0.1)
    budget.cut(3.0, n_steps=16)
    assert budget.kl_coef == pytest.approx(0.4, rel=1e-12)
    adaptive = AdaptiveKLController(kl_coef=0.2, target=1.0, horizon=100)
    fixed = FixedKLController(0.2)
    for c in (adaptive, fixed):
        c.cut(3.0, n_steps=16)
        assert c.kl_coef == 0.2


def test_register_refuses_a_controller_it_could_not_save_or_describe():
    # each of these would run until its first checkpoint, resume or health check and fail there
    from dataclasses import dataclass

    from tether.core.controllers import CONTROLLERS, Controller, register

    class NotADataclass(Controller):
        name = "not_a_dataclass"  # class attributes, unannotated: not dataclass fields

    with pytest.raises(ValueError, match="must be a @dataclass"):
        register(NotADataclass)

    @dataclass
    class HoldsNothing(Controller):
        name = "holds_nothing"
        held = "target"  # no field target
        state = ("kl_coef", "count")  # no field count
        kl_coef: float

    with pytest.raises(ValueError, match=r"\['count', 'target'\]"):
        register(HoldsNothing)
    assert "not_a_dataclass" not in CONTROLLERS and "holds_nothing" not in CONTROLLERS
