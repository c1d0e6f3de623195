"""eval.best_by's tracker (tether.run.best.BestPolicy) on scripted periodic-evaluation rows."""

from __future__ import annotations

import json

import torch

from tests.conftest import make_tiny_llama
from tether.models.policy import PolicyWithValue
from tether.run.best import BestPolicy, qualifies


def policy() -> PolicyWithValue:
    return PolicyWithValue(make_tiny_llama(16))


def row(step: int, gold: float, **extra) -> dict:
    return {"step": step, "eval/gold_score": gold, "eval/kl": 0.1 * step, **extra}


def tracker(tmp_path, p, **kw) -> BestPolicy:
    return BestPolicy(run_dir=tmp_path, policy=p, best_by="gold", **kw)


def meta(tmp_path) -> dict:
    return json.loads((tmp_path / "best" / "meta.json").read_text())


def test_saves_each_new_best_and_stops_after_patience(tmp_path):
    best = tracker(tmp_path, policy(), patience=3)
    # gold 0.1, 0.3 (new bests: saved), then 0.2, 0.25, 0.2: 1, 2, 3 evaluations since step 1
    assert best.consider(0, row(0, 0.1)) is None and meta(tmp_path)["step"] == 0
    assert best.consider(1, row(1, 0.3)) is None and meta(tmp_path)["step"] == 1
    assert best.consider(2, row(2, 0.2)) is None
    assert best.consider(3, row(3, 0.25)) is None
    why = best.consider(4, row(4, 0.2))
    assert why == "eval/gold_score has not improved on step 1's 0.300 in 3 evaluations (eval.patience=3)"
    assert meta(tmp_path) == {"step": 1, "metric": "eval/gold_score", "score": 0.3, "kl": 0.1}
    # a row without the metric (no periodic evaluation at that step) changes nothing
    assert best.consider(5, {"step": 5, "objective/kl": 1.0}) is None and len(best.evals) == 5


def test_a_row_that_breaks_a_condition_never_counts(tmp_path):
    best = tracker(tmp_path, policy(), fluency_margin=0.5, patience=2)
    ok = {"eval/fluency_nll": 2.4, "eval/ref_fluency_nll": 2.0}  # 0.4 above the reference
    bad = {"eval/fluency_nll": 2.6, "eval/ref_fluency_nll": 2.0}  # 0.6 above: fails the margin
    assert best.consider(0, row(0, 0.9, **bad)) is None and best.saved() is None
    assert best.consider(1, row(1, 0.2, **ok)) is None and meta(tmp_path)["step"] == 1
    assert best.consider(2, row(2, 0.95, **bad)) is None and meta(tmp_path)["step"] == 1
    assert "in 2 evaluations" in best.consider(3, row(3, 0.1, **ok))
    # a condition whose numbers the row lacks fails; no condition, any row qualifies
    assert not qualifies({"eval/gold_score": 1.0}, 0.5, None) and qualifies({}, None, None)
    assert not qualifies({"eval/distinct_2": 0.5, "eval/ref_distinct_2": 0.8}, None, 0.9)


def test_a_resumed_tracker_counts_the_history_and_the_saved_best(tmp_path):
    p = policy()
    first = tracker(tmp_path, p)
    first.consider(0, row(0, 0.2))
    first.consider(1, row(1, 0.5))  # saved; suppose a resume then goes back to step 0
    resumed = tracker(tmp_path, p, patience=1, history=[row(0, 0.2)])
    # 0.4 beats the history's 0.2 but not the 0.5 <run>/best holds from a discarded step: kept.
    # Patience counts the evaluations after the best's step (1), and there are none yet
    assert resumed.consider(1, row(1, 0.4)) is None
    assert meta(tmp_path)["step"] == 1 and meta(tmp_path)["score"] == 0.5
    assert "on step 1's 0.500 in 1 evaluations" in resumed.consider(2, row(2, 0.45))


def test_restore_loads_the_best_weights_unless_they_are_the_last_steps(tmp_path):
    p = policy()
    best = tracker(tmp_path, p)
    best.consider(0, row(0, 0.5))
    saved = {k: v.clone() for k, v in p.lm.state_dict().items()}
    with torch.no_grad():
        for w in p.lm.parameters():
            w.add_(1.0)  # training moves the policy on after step 0
    assert best.restore(last_step=0)["step"] == 0  # the best is the last step's: nothing loaded
    assert not torch.equal(p.lm.state_dict()["model.norm.weight"], saved["model.norm.weight"])
    assert best.restore(last_step=3) == {"step": 0, "metric": "eval/gold_score", "score": 0.5, "kl": 0.0}
    assert all(torch.equal(p.lm.state_dict()[k], v) for k, v in saved.items())
    assert tracker(tmp_path / "none", p).restore(last_step=3) is None  # no best policy
