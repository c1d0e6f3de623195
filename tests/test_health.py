"""Health rules on synthetic metric histories: each fires on its pattern, none on a healthy run."""

from __future__ import annotations

import json

import pytest

from tether.core.health import RULES, HealthThresholds
from tether.run.monitor import HealthMonitor

T = HealthThresholds(window=6)


def healthy(n: int = 20) -> list[dict]:
    """Score rises slowly, KL rises to ~3 nats and levels off, entropy and length steady."""
    rows = []
    for s in range(n):
        rows.append(
            {
                "step": s,
                "objective/scores": 0.2 + 0.01 * s,
                "objective/kl": min(3.0, 0.2 * s),
                "objective/kl_per_token": min(3.0, 0.2 * s) / 24,
                "objective/k1_negative_fraction": 0.45,
                "objective/entropy": 3.5 - 0.02 * s,
                "response/length": 24.0 - 0.1 * (s % 3),
                "rollout/logprob_mismatch": 2e-6,  # rounding only
            }
        )
        if s % 2 == 0:  # eval points: proxy and gold rise together
            rows[-1]["eval/proxy_score"] = 0.2 + 0.02 * s
            rows[-1]["eval/gold_score"] = 0.1 + 0.01 * s
    return rows


def with_pattern(rule: str) -> list[dict]:
    rows = healthy()
    for r in rows:
        s = r["step"]
        if rule == "kl_exploding" and s >= 14:
            r["objective/kl"] = 3.0 * 2 ** (s - 13)  # 6, 12, 24, ... nats
        if rule == "kl_stuck":
            r["objective/kl"] = 0.01
            r["objective/scores"] = 0.2
        if rule == "entropy_collapse" and s >= 15:
            r["objective/entropy"] = 1.0  # < 0.5 * 3.5
        if rule == "length_runaway" and s >= 15:
            r["response/length"] = 40.0  # > 1.5 * 24
        if rule == "k1_negative" and s >= 12:
            r["objective/kl_per_token"] = -0.02
        if rule == "logprob_mismatch" and s == 19:
            r["rollout/logprob_mismatch"] = 0.028  # bf16 sampling scored in float32
        if rule == "overoptimization" and "eval/gold_score" in r and s >= 8:
            r["eval/gold_score"] = 0.3 - 0.03 * (s - 8)  # gold falls while proxy keeps rising
    return rows


def test_healthy_history_is_silent():
    rows = healthy()
    for i in range(1, len(rows) + 1):
        for name, rule in RULES.items():
            assert rule(rows[:i], T) is None, name


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_rule_fires_on_its_pattern_only(rule):
    rows = with_pattern(rule)
    alarm = RULES[rule](rows, T)
    assert alarm is not None and alarm.rule == rule and alarm.cause and alarm.fix
    others = [name for name, r in RULES.items() if name != rule and r(rows, T) is not None]
    assert others == []  # the pattern is specific


def test_monitor_reports_each_alarm_once_and_records_it(tmp_path):
    mon = HealthMonitor(T, tmp_path / "warnings.jsonl")
    rows = with_pattern("entropy_collapse")
    fired = [a.rule for i in range(1, len(rows) + 1) for a in mon.check(rows[:i])]
    assert fired == ["entropy_collapse"]
    lines = (tmp_path / "warnings.jsonl").read_text().splitlines()
    assert [json.loads(line)["rule"] for line in lines] == ["entropy_collapse"]
    assert json.loads(lines[0])["step"] == 15


def test_k1_rule_ignores_other_estimators():
    rows = with_pattern("k1_negative")
    for r in rows:
        r.pop("objective/k1_negative_fraction")  # the run's estimator is not k1
    assert RULES["k1_negative"](rows, T) is None
