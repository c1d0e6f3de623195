"""Health rules on synthetic metric histories: each fires on its pattern, none on a healthy run."""

from __future__ import annotations

import dataclasses
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
                "rollout/env_tokens": 0.0 if s == 0 else 4.0,  # a tool called from step 1 on
                "guard/fraction": 0.0 if s in (9, 10) else 1.0,  # two restored updates, not three
                "guard/kl_kept": 2.0,
            }
        )
        if s % 2 == 0:  # eval points: proxy and gold rise together
            rows[-1]["eval/proxy_score"] = 0.2 + 0.02 * s
            rows[-1]["eval/gold_score"] = 0.1 + 0.01 * s
            # what the leash protects, against the reference's numbers on the same prompts
            rows[-1].update(
                {
                    "eval/ref_proxy_score": 0.2,
                    "eval/fluency_nll": 3.2 + 0.01 * s,  # +0.2 nats/token at most: within 0.5
                    "eval/ref_fluency_nll": 3.2,
                    "eval/distinct_2": 0.90 - 0.002 * s,  # 0.862 at least: above 0.9 * 0.92 = 0.828
                    "eval/ref_distinct_2": 0.92,
                    "eval/repetition": 0.01 + 0.001 * s,  # +0.02 at most: within 0.1
                    "eval/ref_repetition": 0.01,
                    "eval/capability_nll": 3.0 + 0.001 * s,  # +0.019 at most: within 0.05
                    "eval/ref_capability_nll": 3.0,
                    "eval/capability_nll_change_se": 0.005,
                }
            )
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
        if rule == "env_never_answered":
            r["rollout/env_tokens"] = 0.0  # no turn ever stopped for the tool
        if rule == "budget_spent" and s >= 17:
            r["guard/fraction"] = 0.0  # the guard restored the weights in the last 3 steps
        if rule == "logprob_mismatch" and s == 19:
            r["rollout/logprob_mismatch"] = 0.028  # bf16 sampling scored in float32
        if rule == "sampler_correction" and s == 19:
            r["rollout/is_clipped_fraction"] = 1.0  # mis dropped every sequence of the step
        if rule == "sample_quality" and "eval/fluency_nll" in r and s >= 12:
            r["eval/fluency_nll"] = 4.0  # 0.8 nats/token above the reference's 3.2
        if rule == "capability_loss" and "eval/capability_nll" in r and s >= 12:
            r["eval/capability_nll"] = 3.2  # +0.2 nats/token, 40 SE of 0.005
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


@pytest.mark.parametrize(
    "change, what",
    [
        ({"eval/fluency_nll": 3.71}, "fluency NLL 3.20 -> 3.71"),  # 0.51 > 0.5 above 3.2
        ({"eval/repetition": 0.111}, "3-gram repetition 0.010 -> 0.111"),  # 0.101 > 0.1 above 0.01
        ({"eval/distinct_2": 0.827}, "distinct-2 0.920 -> 0.827"),  # < 0.9 * 0.92 = 0.828
    ],
)
def test_sample_quality_names_what_worsened(change, what):
    rows = healthy()
    rows[-2].update(change)  # step 18, the last eval point
    alarm = RULES["sample_quality"](rows, T)
    assert alarm is not None and alarm.step == 18 and what in alarm.message
    assert "raise kl.kl_coef" in alarm.fix and "stop earlier" in alarm.fix
    # just inside each margin: silent
    inside = {"eval/fluency_nll": 3.69, "eval/repetition": 0.109, "eval/distinct_2": 0.829}
    rows[-2].update({k: inside[k] for k in change})
    assert RULES["sample_quality"](rows, T) is None


def test_sample_quality_needs_the_proxy_to_have_risen():
    rows = healthy()
    rows[-2].update({"eval/fluency_nll": 5.0, "eval/proxy_score": 0.21})  # proxy +0.01 <= 0.02
    assert RULES["sample_quality"](rows, T) is None
    rows[-2]["eval/proxy_score"] = 0.23  # +0.03 > 0.02
    assert RULES["sample_quality"](rows, T) is not None
    for r in rows:  # no reference numbers (an older run, or eval.every=0): silent
        r.pop("eval/ref_proxy_score", None)
    assert RULES["sample_quality"](rows, T) is None


def test_sample_quality_waits_for_a_change_beyond_its_noise():
    rows = healthy()
    # +0.8 nats/token, past the 0.5 margin, but each mean has SE 0.5: the difference's SE is
    # sqrt(0.5^2 + 0.5^2) = 0.707, and 0.8 < 2 * 0.707 = 1.414: silent
    rows[-2].update({"eval/fluency_nll": 4.0, "eval/fluency_nll_se": 0.5, "eval/ref_fluency_nll_se": 0.5})
    assert RULES["sample_quality"](rows, T) is None
    rows[-2]["eval/fluency_nll"] = 4.7  # +1.5 > 1.414: fires, and says how many SE
    alarm = RULES["sample_quality"](rows, T)
    assert alarm is not None and "2.1 SE" in alarm.message


def test_the_final_evaluation_is_checked_by_the_heldout_rules_only(tmp_path):
    """training.py runs HELDOUT_RULES once more on a row built from the final held-out
    evaluation; only those rules run there, and an alarm found so is recorded once."""
    from tether.run.monitor import HELDOUT_RULES, HealthMonitor

    rows = healthy()
    monitor = HealthMonitor(T, tmp_path / "warnings.jsonl")
    assert monitor.check(rows) == []
    final = {**rows[-2], "step": 19, "eval/distinct_2": 0.80}  # < 0.9 * 0.92 = 0.828
    # a row that would also trip another rule (entropy far below its start) is not read by it
    final["objective/entropy"] = 0.0
    new = monitor.check([*rows, final], HELDOUT_RULES)
    assert [a.rule for a in new] == ["sample_quality"] and new[0].step == 19
    assert monitor.check([*rows, final], HELDOUT_RULES) == []  # reported once
    assert len((tmp_path / "warnings.jsonl").read_text().splitlines()) == 1


def test_kl_rising_to_the_leash_budget_is_not_an_explosion():
    """The demo's KL on the default 2.5-nat budget: 0.58 -> 2.26 nats/seq over a 6-step window
    (3.9x, above the 2-nat floor) is the budget being spent, not the policy running away."""
    rows = healthy()
    for r, kl in zip(rows[-6:], [0.27, 0.40, 1.08, 2.05, 1.96, 2.76]):  # halves 0.583 and 2.257
        r["objective/kl"] = kl
    assert RULES["kl_exploding"](rows, T) is not None  # no leash known: 2.257 > 2 and > 3 x 0.583
    assert RULES["kl_exploding"](rows, dataclasses.replace(T, kl_leash=2.5)) is None
    assert RULES["kl_exploding"](rows, dataclasses.replace(T, kl_leash=2.2)) is not None  # past it


def test_the_leash_of_the_run_sets_kl_leash():
    from tether.run.config import load_config
    from tether.run.monitor import health_thresholds

    assert health_thresholds(load_config(None, [])).kl_leash == 2.5  # the default budget
    adaptive = load_config(None, ["kl.controller=adaptive", "kl.target=4"])
    assert health_thresholds(adaptive).kl_leash == 4.0
    assert health_thresholds(load_config(None, ["kl.controller=fixed"])).kl_leash is None
    assert health_thresholds(load_config(None, ["health.kl_leash=1"])).kl_leash == 1.0


def test_an_environment_that_never_answers_is_named_from_the_second_step():
    # step 0 alone without a tool call is no alarm; steps 0 and 1 without one are; a single-turn
    # run (no rollout/env_tokens logged) never
    silent = [{"step": s, "rollout/env_tokens": 0.0} for s in range(3)]
    assert RULES["env_never_answered"](silent[:1], T) is None
    alarm = RULES["env_never_answered"](silent[:2], T)
    assert alarm is not None and alarm.step == 1 and "rollout.stop_strings" in alarm.fix
    assert RULES["env_never_answered"](silent[:2] + [{"step": 2, "rollout/env_tokens": 0.25}], T) is None
    assert RULES["env_never_answered"]([{"step": s} for s in range(3)], T) is None


def test_budget_spent_fires_after_three_restored_updates_in_a_row():
    from tether.core.health import budget_spent

    t = HealthThresholds()
    rows = [
        {"step": i, "guard/fraction": f, "guard/kl_kept": 2.6} for i, f in enumerate([1.0, 0.0, 0.0, 0.0])
    ]
    alarm = budget_spent(rows, t)
    assert alarm is not None and alarm.step == 3 and "kl.budget" in alarm.fix and "2.6" in alarm.message
    assert budget_spent(rows[:3], t) is None  # two in a row
    halved = [*rows[:3], {"step": 3, "guard/fraction": 0.5, "guard/kl_kept": 2.6}]
    assert budget_spent(halved, t) is None  # a half of an update fit: not spent
    assert budget_spent([{"step": 0}], t) is None  # no guard
