"""The health monitor: runs the rules of :mod:`tether.core.health` after each step and records
each alarm once, when it first fires, in the run's ``warnings.jsonl``."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tether.core.health import RULES, Alarm, HealthThresholds
from tether.run.files import append_lines

HELDOUT_RULES = ("sample_quality", "capability_loss")
"""The rules that read held-out evaluations (``eval/*`` beside ``eval/ref_*``): run once more on the
final evaluation, whose ``eval.n_prompts`` prompts resolve smaller changes than a periodic one's."""


@dataclass
class HealthMonitor:
    """Runs every rule after each step; an alarm is reported once, when it first fires."""

    thresholds: HealthThresholds = field(default_factory=HealthThresholds)
    path: Path | None = None
    fired: list[Alarm] = field(default_factory=list)

    def check(self, history: list[dict], rules: tuple[str, ...] | None = None) -> list[Alarm]:
        """Run ``rules`` (default: all of :data:`RULES`) on ``history``; record and return the new alarms."""
        seen = {a.rule for a in self.fired}
        new = [
            a
            for name, rule in RULES.items()
            if name not in seen and (rules is None or name in rules) and (a := rule(history, self.thresholds))
        ]
        self.fired += new
        if self.path is not None:  # created on the first check, even with no alarm
            append_lines(self.path, [json.dumps(asdict(a)) for a in new])
        return new


def leash_kl(c) -> float | None:
    """The KL (nats per sequence) the run's controller holds
    (:meth:`tether.core.controllers.Controller.held_kl`: a budget, a target) with
    kl.target_unit=nats_per_sequence; None otherwise (a fixed beta; DPO, whose leash is dpo.beta)."""
    if c.kl.target_unit != "nats_per_sequence":
        return None
    return c.kl.new_controller().held_kl()  # DPO's controller is fixed (the config's rule): None


def health_thresholds(c) -> HealthThresholds:
    """``c.health`` with ``kl_leash`` set from the leash (:func:`leash_kl`) when left unset."""
    limit = leash_kl(c)
    if c.health.kl_leash is not None or limit is None:
        return c.health
    return dataclasses.replace(c.health, kl_leash=limit)
