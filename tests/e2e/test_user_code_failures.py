"""User code that fails after a step was trained (issue 50's adversarial review): the reward in the
periodic evaluation, in DPO's probe after its update, in the final evaluation. Nothing trained is
lost: the step is checkpointed, its row logged without what failed, ``--resume`` named, and the
resumed run logs the rows an uninterrupted run logs."""

from __future__ import annotations

import json

import pytest

from tests.conftest import metric_rows, tiny_run_args
from tether.cli import main
from tether.run.checkpoint import latest_checkpoint

CALLS = {"evaluations": 0, "fail_at": 0, "probe_fails": False}
"""What the rewards below count and when they fail; each test sets it before each run."""


def fails_in_one_evaluation(completions, trainer_state, **kwargs) -> list[float]:
    """Length / 100; raises in the ``CALLS["fail_at"]``-th held-out evaluation call of the run
    (1-based: the reference's is the first), told from training calls by their trainer_state
    (every evaluation gets the end of training, ``global_step == max_steps``)."""
    if trainer_state.global_step == trainer_state.max_steps:
        CALLS["evaluations"] += 1
        if CALLS["evaluations"] == CALLS["fail_at"]:
            raise ConnectionError("the reward service is down")
    return [len(c) / 100 for c in completions]


def fails_in_the_probe_after_step_1(completions, trainer_state, **kwargs) -> list[float]:
    """Length / 100; raises in DPO's probe after step 1's update (``global_step`` 2: the probe
    follows the update) while ``CALLS["probe_fails"]``."""
    if trainer_state.global_step == 2 and CALLS["probe_fails"]:
        raise ConnectionError("the reward service is down")
    return [len(c) / 100 for c in completions]


def _set(fail_at: int = 0, probe_fails: bool = False) -> None:
    CALLS.update(evaluations=0, fail_at=fail_at, probe_fails=probe_fails)


def _args(model_dir, prompts, out, **overrides) -> list[str]:
    return tiny_run_args(
        model_dir, prompts, out, {k.replace("__", "."): v for k, v in overrides.items()}, command=True
    )


PERIODIC = {
    "reward__scorer": "tests.e2e.test_user_code_failures:fails_in_one_evaluation",
    "train__steps": 4,
    "eval__every": 2,
    "eval__periodic_prompts": 3,
    "train__checkpoint_every": 10,
}
"""Periodic evaluations after steps 0, 2 and 3 (the reference's on the periodic prompts before)."""


def test_a_reward_failing_in_the_periodic_evaluation_keeps_the_step_and_resumes_exactly(
    tiny_model_dir, prompt_file, tmp_path, capsys
):
    """The reward failing in the evaluation after step 2 (its third evaluation call) said "no
    checkpoint was written ... start the run again", and the two trained steps since the start
    were lost: step 2 was complete. Now its row is logged without the evaluation, step 2 is
    checkpointed, --resume named; the resumed run goes on at step 3 and logs an uninterrupted
    run's rows, the failed evaluation aside."""
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    _set()
    assert main(_args(tiny_model_dir, prompt_file, full, **PERIODIC)) == 0
    _set(fail_at=3)
    capsys.readouterr()
    assert main(_args(tiny_model_dir, prompt_file, stopped, **PERIODIC)) == 1
    err = capsys.readouterr().err
    assert (
        "held-out evaluation (periodic, proxy scorer): the scorer failed on 6 texts (ConnectionError" in err
    )
    assert (
        "after step 2, whose update is kept: its row is logged without its periodic evaluation; "
        f"checkpoint {stopped / 'checkpoints' / 'step-000002'} holds the run after step 2; "
        f"continue with: tether train --resume {stopped}"
    ) in err, err
    assert latest_checkpoint(stopped).name == "step-000002"
    assert [r["step"] for r in metric_rows(stopped)] == [0, 1, 2]
    assert main(["train", "--resume", str(stopped)]) == 0
    expected = metric_rows(full)
    expected[2] = {k: v for k, v in expected[2].items() if not k.startswith("eval/")}
    assert metric_rows(stopped) == expected


def test_a_reward_failing_in_dpos_probe_keeps_the_updated_step(tiny_model_dir, prompt_file, tmp_path, capsys):
    """DPO samples and scores the policy after its update (the probe): a reward failing there
    lost the step, and with it every step since the last checkpoint ("the last checkpoint ... is
    kept", or none). The step's update is done: now its row is logged without the probe's
    metrics, the step is checkpointed, and the resumed run logs an uninterrupted run's rows."""
    settings = {
        "reward__scorer": "tests.e2e.test_user_code_failures:fails_in_the_probe_after_step_1",
        "train__algo": "dpo",
        "dpo__n_pairs": 8,
        "train__steps": 3,
        "train__checkpoint_every": 10,
    }
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    _set()
    assert main(_args(tiny_model_dir, prompt_file, full, **settings)) == 0
    _set(probe_fails=True)
    capsys.readouterr()
    assert main(_args(tiny_model_dir, prompt_file, stopped, **settings)) == 1
    err = capsys.readouterr().err
    assert "step 1: the scorer failed on" in err and "(ConnectionError: the reward service is down)" in err
    assert (
        "after step 1, whose update is kept: its row is logged without its probe's metrics" in err
        and f"continue with: tether train --resume {stopped}" in err
    ), err
    assert latest_checkpoint(stopped).name == "step-000001"
    _set()
    assert main(["train", "--resume", str(stopped)]) == 0
    expected, got = metric_rows(full), metric_rows(stopped)
    probe = set(expected[1]) - set(got[1])  # the probe's: the score and KL of the policy's samples
    assert {"objective/scores", "objective/kl"} <= probe and not [k for k in probe if k.startswith("dpo/")]
    expected[1] = {k: v for k, v in expected[1].items() if k not in probe}
    assert got == expected


def test_a_reward_failing_in_the_final_evaluation_keeps_the_policy(
    tiny_model_dir, prompt_file, tmp_path, capsys
):
    """With train.checkpoint_every=0 and train.save_model=true, a reward failing in the final
    evaluation left no policy/ and no checkpoint, and the error said nothing of what was kept:
    the trained run was gone. Now the last step is checkpointed (--resume runs the evaluation
    again, and it is the uninterrupted run's) and the policy saved, its card saying why it has no
    held-out results."""
    settings = {
        "reward__scorer": "tests.e2e.test_user_code_failures:fails_in_one_evaluation",
        "train__steps": 2,
        "eval__n_prompts": 4,
        "eval__every": 0,
        "train__save_model": "true",
        "train__checkpoint_every": 0,
    }
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    _set()
    assert main(_args(tiny_model_dir, prompt_file, full, **settings)) == 0
    _set(fail_at=2)  # the reference's evaluation, then the final one
    capsys.readouterr()
    assert main(_args(tiny_model_dir, prompt_file, stopped, **settings)) == 1
    err = capsys.readouterr().err
    assert "held-out evaluation (policy, proxy scorer): the scorer failed on 8 texts (ConnectionError" in err
    kept = stopped / "checkpoints" / "step-000001"
    assert (
        f"in the final evaluation, after the last step (1); checkpoint {kept} "
        f"holds the run after step 1: fix it, then tether train --resume {stopped} runs the final evaluation "
        f"again; the policy is saved to {stopped / 'policy'}, its model card without held-out results"
    ) in err, err
    assert (stopped / "policy" / "model.safetensors").exists() and not (stopped / "eval.json").exists()
    assert "The final held-out evaluation failed" in (stopped / "policy" / "README.md").read_text()
    _set()
    assert main(["train", "--resume", str(stopped)]) == 0
    assert metric_rows(stopped) == metric_rows(full)
    assert json.loads((stopped / "eval.json").read_text()) == json.loads((full / "eval.json").read_text())
    assert "## Held-out results\n\n4 held-out prompts" in (stopped / "policy" / "README.md").read_text()


def judge_fails_on_the_second_samples(texts: list[str]) -> list[float]:
    """A gold judge: length / 100; raises on the second call with 4 texts (a step's samples, at
    rollout.batch_size=4; the held-out evaluations score 8) while ``CALLS["fail_at"]``."""
    if len(texts) == 4 and CALLS["fail_at"]:
        CALLS["evaluations"] += 1
        if CALLS["evaluations"] == CALLS["fail_at"]:
            raise ConnectionError("the judge service is down")
    return [len(t) / 100 for t in texts]


def test_a_judge_failing_on_a_steps_samples_keeps_the_step(tiny_model_dir, prompt_file, tmp_path, capsys):
    """The gold judge failing on step 1's samples (after its row was logged) lost the step as an
    evaluation's failure did; now the step is checkpointed with its row whole, its samples left
    out of samples.jsonl, and the resumed run logs an uninterrupted run's rows."""
    settings = {
        "eval__judge": "tests.e2e.test_user_code_failures:judge_fails_on_the_second_samples",
        "eval__n_prompts": 4,
        "eval__every": 0,
        "train__steps": 3,
        "train__sample_every": 1,
        "train__checkpoint_every": 10,
    }
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    _set()
    assert main(_args(tiny_model_dir, prompt_file, full, **settings)) == 0
    _set(fail_at=2)
    capsys.readouterr()
    assert main(_args(tiny_model_dir, prompt_file, stopped, **settings)) == 1
    err = capsys.readouterr().err
    assert "step 1 samples (gold judge): the scorer failed on 4 texts (ConnectionError" in err, err
    assert (
        "after step 1, whose update is kept: its row is logged without its samples (samples.jsonl)" in err
    ), err
    _set()
    assert main(["train", "--resume", str(stopped)]) == 0
    assert metric_rows(stopped) == metric_rows(full)
    steps = [json.loads(line)["step"] for line in (stopped / "samples.jsonl").read_text().splitlines()]
    assert sorted(set(steps)) == [0, 2]


@pytest.mark.parametrize("reward", ["never_scores", "all_but_one_of_each_prompt"])
def test_dpo_says_when_the_reward_left_candidates_unscored(
    tiny_model_dir, prompt_file, tmp_path, capsys, reward
):
    """DPO's pair sampling said "only 0 of 8 prompts gave candidates with different scores ...
    (ties are skipped)" when the reward had returned None for the candidates: now it counts them."""
    scorer = (
        f"tests.conftest:{reward}"
        if reward == "never_scores"
        else f"tests.e2e.test_user_code_failures:{reward}"
    )
    out = tmp_path / "run"
    args = _args(
        tiny_model_dir,
        prompt_file,
        out,
        reward__scorer=scorer,
        train__algo="dpo",
        dpo__n_pairs=2,
        dpo__candidates=4,
    )
    assert main(args) == 1
    err = capsys.readouterr().err
    unscored = "320 of 320" if reward == "never_scores" else "240 of 320"
    assert (
        "only 0 of 2 prompts gave candidates with different scores after 80 tries (ties are skipped; the "
        f"reward returned None for {unscored} candidates, which are never paired: a prompt needs two "
        "scored ones)"
    ) in err, err


def all_but_one_of_each_prompt(completions, **kwargs) -> list:
    """Scores the first of every 4 candidates (DPO's dpo.candidates=4 of a prompt), None for the rest."""
    return [float(len(c)) if i % 4 == 0 else None for i, c in enumerate(completions)]
