"""Issue #31 item 1: the built-in verifiable task (data.prompts=arithmetic) and its checker
(reward.scorer=integer-answer), through the same TRL-style contract as a user's checker."""

from __future__ import annotations

import json

import pytest

from tests.conftest import metric_rows
from tether import load_config
from tether.cli import main
from tether.data.tasks import SHOTS, arithmetic_problems
from tether.judges.contract import checked_scores
from tether.judges.scorers import make_scorer
from tether.judges.verifiers import integer_answer, leading_integer


def test_the_parsing_rule_by_example():
    # the module docstring's examples, answer 75
    right = [" 75\n41 + 17", "75 apples", "+075", "75", "\t75."]
    wrong = ["The sum is 75", "7 5", "76", "", "750", "-75", "x75"]
    assert integer_answer(right, ["75"] * len(right)) == [1.0] * len(right)
    assert integer_answer(wrong, ["75"] * len(wrong)) == [0.0] * len(wrong)
    assert leading_integer("  -12 + 3") == -12 and leading_integer("1" * 31) is None
    # a conversation's completion: its last message's content (TRL's conversational form)
    convo = [[{"role": "assistant", "content": " 75"}], [{"role": "assistant", "content": "no"}]]
    assert integer_answer(convo, [75, 75]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="the answer '7.5' is not an integer"):
        integer_answer(["7"], ["7.5"])
    with pytest.raises(ValueError, match="2 answers for 1 completions"):
        integer_answer(["7"], ["7", "8"])


def test_the_task_is_fixed_and_its_held_out_problems_are_stable():
    data = arithmetic_problems()
    assert len(data) == 90 * 90 and len(set(data.prompts)) == len(data)
    operands = [
        tuple(int(x) for x in p.removeprefix(SHOTS).removesuffix(" =").split(" + ")) for p in data.prompts
    ]
    assert set(operands) == {(a, b) for a in range(10, 100) for b in range(10, 100)}
    assert [int(x) for x in data.columns["answer"]] == [a + b for a, b in operands]
    assert data.prompts == arithmetic_problems().prompts  # the shuffle is fixed
    c = load_config(None, ["data.prompts=arithmetic"]).for_run()
    assert c.reward.scorer == "integer-answer" and c.eval.judge == "none"
    from tether.run.setup import load_prompts

    train, held = load_prompts(c)
    train2, held2 = load_prompts(load_config(None, ["data.prompts=arithmetic", "train.seed=7"]).for_run())
    assert held.prompts == held2.prompts and len(train) + len(held) == len(data)
    assert 0.03 < len(held) / len(data) < 0.07  # data.heldout_fraction=0.05, by hash
    assert set(held.columns) == {"answer"}
    # eval.n_prompts takes the first N held-out problems, so they must be a uniform sample. The
    # first operand is uniform on [10, 99]: mean 54.5, sd sqrt((90**2 - 1) / 12) = 26.0, so the
    # mean of 128 has SE 26.0 / sqrt(128) = 2.3; in operand order it was 24, 13 SE off.
    first = [int(p.removeprefix(SHOTS).split(" + ")[0]) for p in held.prompts[:128]]
    assert abs(sum(first) / 128 - 54.5) < 4 * 2.3


def test_the_checker_goes_through_the_trl_contract(tmp_path):
    scorer = make_scorer("integer-answer")
    data = arithmetic_problems().select([0, 1])
    right, wrong = f" {data.columns['answer'][0]}", f" {int(data.columns['answer'][1]) + 1} + 1"
    scores = checked_scores(scorer, [right, wrong], 0, data.prompts, data.columns)
    assert scores == [1.0, 0.0]


def test_grpo_trains_on_the_task_end_to_end(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = [
        "train",
        "data.prompts=arithmetic",
        f"model.name={tiny_model_dir}",
        "train.algo=grpo",
        "rollout.batch_size=8",
        "optim.minibatch_size=4",
        "rollout.max_new_tokens=4",
        "train.steps=2",
        "eval.n_prompts=4",
        "eval.fluency_model=none",
        "train.progress=false",
        "train.save_model=false",
        f"train.output_dir={out}",
    ]
    assert main(args) == 0
    said = capsys.readouterr().out
    assert "VADER" not in said  # the task's checker is its reward, not the demo's
    rows = metric_rows(out, timings=True)
    assert all(r["objective/scores"] in (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0) for r in rows)
    assert all("rollout/groups_all_worst" in r for r in rows)  # a 0/1 reward: the shares are logged
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["score"] in (0.0, 1.0) and "answer" in s["columns"] for s in samples)


def test_a_non_integer_answer_is_refused_before_the_model_loads(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "sums.jsonl"
    rows = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(30)] + [
        {"prompt": "x =", "answer": "15.0"}
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        "train",
        f"data.prompts={data}",
        "reward.scorer=integer-answer",
        f"model.name={tiny_model_dir}",
        "train.steps=1",
        "eval.n_prompts=0",
        "train.progress=false",
        f"train.output_dir={tmp_path / 'run'}",
    ]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "has answer '15.0', not an integer" in err, err
    assert not (tmp_path / "run").exists()
