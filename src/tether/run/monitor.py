"""The health monitor: runs the rules of :mod:`tether.core.health` after each step and records
each alarm once, when it first fires, in the run's ``warnings.jsonl``."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tether.core.health import RULES, Alarm, HealthThresholds


@dataclass
class HealthMonitor:
    """Runs every rule after each step; an alarm is reported once, when it first fires."""

    thresholds: HealthThresholds = field(default_factory=HealthThresholds)
    path: Path | None = None
    fired: list[Alarm] = field(default_factory=list)

    def check(self, history: list[dict]) -> list[Alarm]:
        seen = {a.rule for a in self.fired}
        new = [
            a for name, rule in RULES.items() if name not in seen and (a := rule(history, self.thresholds))
        ]
        self.fired += new
        if self.path is not None:
            with self.path.open("a") as f:
                for a in new:
                    f.write(json.dumps(asdict(a)) + "\n")
        return new
