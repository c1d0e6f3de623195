"""Results travel (issue 33): trackers named by project and run, alarms and the final evaluation
in every tracker, callbacks from Python (with a stop that resumes), a held-out set of one's own."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import RecordingTracker, metric_rows, tiny_run_args
from tether.cli import main
from tether.run.files import read_jsonl
from tether.run.reporting import numbers

# KL stuck fires after 2 steps whatever the numbers: every KL is below 100 nats and the score's
# half-window means differ by less than 100
ALARMING = {"health.window": 2, "health.kl_stuck_below": 100, "health.score_flat_tol": 100}


def _reset_tracker():
    RecordingTracker.rows, RecordingTracker.tables, RecordingTracker.finished = [], [], False
    RecordingTracker.project = RecordingTracker.run_name = None


def test_a_tracker_gets_its_project_run_name_every_alarm_and_the_final_evaluation(
    tiny_model_dir, prompt_file, tmp_path
):
    _reset_tracker()
    out = tmp_path / "run-a"
    overrides = {
        **ALARMING,
        "train.steps": 3,
        "eval.n_prompts": 4,
        "train.report_to": "tests.conftest:RecordingTracker",
        "train.project": "leash-study",
    }
    assert main(tiny_run_args(tiny_model_dir, prompt_file, out, overrides, command=True)) == 0
    # the project as set; the run's name defaults to the run folder's
    assert (RecordingTracker.project, RecordingTracker.run_name) == ("leash-study", "run-a")
    assert RecordingTracker.config["train.project"] == "leash-study" and RecordingTracker.finished
    fired = read_jsonl(out / "warnings.jsonl")
    assert fired and "kl_stuck" in {a["rule"] for a in fired}
    got = RecordingTracker.rows
    for a in fired:  # each alarm: a number at its step, and its text
        assert (a["step"], {f"alarm/{a['rule']}": 1.0}) in got, a
        texts = [v["alarms"] for s, v in got if s == a["step"] and "alarms" in v]
        assert any(a["rule"] in t and a["fix"] in t for t in texts), (a, texts)
    # the final evaluation, with its SEs, at the policy's step: the very numbers of eval.json
    ev = json.loads((out / "eval.json").read_text())
    final = [v for s, v in got if any(k.startswith("final/") for k in v)]
    assert len(final) == 1
    assert final[0]["final/gain"] == ev["gain"] and final[0]["final/gain_se_paired"] == ev["gain_se_paired"]
    assert final[0]["final/policy/proxy_mean"] == ev["policy"]["proxy_mean"]
    # every finite number of eval.json, and nothing else (a z of a zero SE is not a number)
    want = {f"final/{k}": v for k, v in numbers(ev).items() if math.isfinite(v)}
    assert final[0] == want
    # the metric rows are still the very rows of metrics.jsonl
    rows = metric_rows(out, timings=True)
    steps = [(s, v) for s, v in got if not any(k.startswith(("alarm", "final/")) for k in v)]
    assert [s for s, _ in steps] == [r["step"] for r in rows]
    for (_, values), row in zip(steps, rows):
        assert values == {k: v for k, v in row.items() if k != "step"}


def test_run_name_is_passed_as_each_tracker_expects():
    """accelerate names a run through init_kwargs, under a key of each tracker's own."""
    from tether.run.reporting import RUN_NAME_KWARGS

    assert RUN_NAME_KWARGS["wandb"] == "name"  # wandb.init(project=..., name=...)
    assert RUN_NAME_KWARGS["mlflow"] == "run_name"  # MLflowTracker(experiment_name, run_name=...)
    assert RUN_NAME_KWARGS["trackio"] == "name"


def test_train_tensorboard_is_an_alias_of_report_to_tensorboard(
    tiny_model_dir, prompt_file, tmp_path, caplog
):
    pytest.importorskip("tensorboard")
    from tether.run.config import load_config

    c = load_config(None, ["train.tensorboard=true"])
    assert c.train.report_to == ["tensorboard"]
    assert any("train.tensorboard=true is deprecated" in w for w in c.placement.warnings)
    out = tmp_path / "run"
    overrides = {"train.tensorboard": "true", "train.steps": 2}
    assert main(tiny_run_args(tiny_model_dir, prompt_file, out, overrides, command=True)) == 0
    events = list(out.rglob("events.out.tfevents.*"))
    # one path, one copy: the scalars in <run>/tensorboard (accelerate's hparams in a folder below)
    assert events and all(e.is_relative_to(out / "tensorboard") for e in events)
    assert (out / "tensorboard") in {e.parent for e in events}


class Recorder:
    """A callback with every hook, keeping what each got; stops at ``stop_at`` if given."""

    def __init__(self, stop_at: int | None = None):
        self.calls: list[tuple] = []
        self.stop_at = stop_at

    def on_step_end(self, step, metrics):
        self.calls.append(("step", step, metrics))
        if step == self.stop_at:
            from tether import StopTraining

            raise StopTraining("enough")

    def on_evaluate(self, step, row):
        self.calls.append(("evaluate", step, row))

    def on_alarm(self, alarm):
        self.calls.append(("alarm", alarm.step, alarm))

    def on_train_end(self, run_dir):
        self.calls.append(("end", None, run_dir))


def _config(model_dir, prompts, out, overrides):
    from tether import load_config

    return load_config(None, tiny_run_args(model_dir, prompts, out, overrides))


def test_callbacks_get_every_hook_with_its_data(tiny_model_dir, prompt_file, tmp_path):
    from tether import train

    out = tmp_path / "run"
    rec = Recorder()
    overrides = {
        **ALARMING,
        "train.steps": 3,
        "eval.n_prompts": 4,
        "eval.every": 2,
        "eval.periodic_prompts": 4,
    }
    train(_config(tiny_model_dir, prompt_file, out, overrides), callbacks=[rec])
    rows = metric_rows(out, timings=True)
    assert [(s, m) for kind, s, m in rec.calls if kind == "step"] == [(r["step"], r) for r in rows]
    evaluations = [(s, r) for kind, s, r in rec.calls if kind == "evaluate"]
    # periodic at steps 0 and 2 (eval.every=2), with the eval/ numbers of their rows; then the final
    assert [s for s, _ in evaluations] == [0, 2, 2]
    assert evaluations[0][1] == {k: v for k, v in rows[0].items() if k.startswith("eval/")}
    ev = json.loads((out / "eval.json").read_text())
    assert evaluations[-1][1]["final"] and evaluations[-1][1]["gain"] == ev["gain"]
    alarms = [a for kind, _, a in rec.calls if kind == "alarm"]
    assert [(a.rule, a.step) for a in alarms] == [
        (a["rule"], a["step"]) for a in read_jsonl(out / "warnings.jsonl")
    ]
    assert rec.calls[-1] == ("end", None, out)


def test_a_callback_stops_the_run_checkpointed_and_resumable(tiny_model_dir, prompt_file, tmp_path):
    from tether import Interrupted, train

    out = tmp_path / "run"
    overrides = {"train.steps": 4}
    with pytest.raises(Interrupted):
        train(_config(tiny_model_dir, prompt_file, out, overrides), callbacks=[Recorder(stop_at=1)])
    assert [r["step"] for r in metric_rows(out)] == [0, 1]
    assert any((out / "checkpoints").iterdir())
    rec = Recorder()
    train(_config(tiny_model_dir, prompt_file, out, overrides), resume=True, callbacks=[rec])
    assert [r["step"] for r in metric_rows(out)] == [0, 1, 2, 3]
    assert [s for kind, s, _ in rec.calls if kind == "step"] == [2, 3]


def test_bad_callbacks_are_refused_naming_the_hooks(tiny_model_dir, prompt_file, tmp_path):
    from tether import train

    config = _config(tiny_model_dir, prompt_file, tmp_path / "run", {})
    with pytest.raises(
        TypeError,
        match="on_train_begin, on_step_begin, on_step_end, on_evaluate, on_save, on_alarm, on_train_end",
    ):
        train(config, callbacks=[object()])
    with pytest.raises(TypeError, match="takes a list"):
        train(config, callbacks=Recorder())
    assert not (tmp_path / "run").exists()


def _scorer_seeing_prompts(seen: list):
    def scorer(prompts, completions, **kwargs):
        seen.extend(prompts)
        return [len(c) / 10 for c in completions]

    return scorer


def test_an_eval_dataset_is_the_held_out_set_and_never_trained_on(tiny_model_dir, tmp_path):
    from tether import train

    train_only = [f"the movie number {i} was" for i in range(4)]
    both = ["a film that both sets hold", "another prompt in both sets"]
    eval_only = [f"a held-out film {i} that" for i in range(4)]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(train_only + both) + "\n")
    seen: list = []
    out = tmp_path / "run"
    overrides = {
        "train.algo": "ppo",  # 4 prompts a step: all 4 training prompts are drawn
        "train.steps": 3,
        "train.sample_every": 1,
        "eval.n_prompts": 6,
        "reward.scorer": None,
    }
    train(
        _config(tiny_model_dir, prompts, out, overrides),
        scorer=_scorer_seeing_prompts(seen),
        eval_dataset=eval_only + both,
    )
    trained = {s["prompt"] for s in read_jsonl(out / "samples.jsonl")}
    assert trained == set(train_only)  # every training prompt drawn, none of the held-out set
    ev = json.loads((out / "eval.json").read_text())
    assert ev["n_prompts"] == 6
    assert set(eval_only + both) <= set(seen)  # the evaluations scored the held-out set
    assert "an eval_dataset passed to train" in (out / "config.yaml").read_text()


def test_data_eval_prompts_from_the_cli(tiny_model_dir, tmp_path, caplog):
    lines = [f"the movie number {i} was" for i in range(6)]
    prompts, held = tmp_path / "prompts.txt", tmp_path / "held.txt"
    prompts.write_text("\n".join(lines) + "\n")
    held.write_text("\n".join(lines[:3] + ["a film only held out"]) + "\n")  # three also trained on
    out = tmp_path / "run"
    overrides = {
        "train.algo": "ppo",  # 4 prompts a step: the 3 left are all drawn
        "data.eval_prompts": held,
        "eval.n_prompts": 4,
        "train.sample_every": 1,
        "train.steps": 2,
    }
    assert main(tiny_run_args(tiny_model_dir, prompts, out, overrides, command=True)) == 0
    assert "3 training prompt(s) are also in the held-out set" in caplog.text
    trained = {s["prompt"] for s in read_jsonl(out / "samples.jsonl")}
    assert trained == set(lines[3:])
    assert json.loads((out / "eval.json").read_text())["n_prompts"] == 4
    # every prompt held out: nothing to train on, said before anything is written
    bad = tmp_path / "bad"
    assert (
        main(tiny_run_args(tiny_model_dir, prompts, bad, {"data.eval_prompts": prompts}, command=True)) == 1
    )
    assert not bad.exists()


# ---- what a second look found (issue 33's review) ------------------------------------------------
class Failing:
    def on_step_end(self, step, metrics):
        if step == 1:
            raise ValueError("a bug in the callback")


def test_a_failing_callback_stops_the_run_checkpointed_and_named(tiny_model_dir, prompt_file, tmp_path):
    from tether import train
    from tether.run.reporting import ReportingError

    out = tmp_path / "run"
    config = _config(tiny_model_dir, prompt_file, out, {"train.steps": 4})
    with pytest.raises(ReportingError, match=r"callback Failing.on_step_end failed: ValueError: a bug") as e:
        train(config, callbacks=[Failing()])
    assert "stopped after step 1 with a checkpoint" in str(e.value) and "--resume" in str(e.value)
    assert isinstance(e.value.__cause__, ValueError)
    train(_config(tiny_model_dir, prompt_file, out, {"train.steps": 4}), resume=True)  # nothing lost
    assert [r["step"] for r in metric_rows(out)] == [0, 1, 2, 3]


class Quitting:
    """A callback that ends the process its own way at step 1 (issue 50's fault campaign)."""

    def __init__(self, how):
        self.how = how

    def on_step_end(self, step, metrics):
        if step == 1:
            raise self.how


@pytest.mark.parametrize(
    "how,said",
    [
        (SystemExit(0), r"raised SystemExit\(0\) \(sys.exit"),
        (KeyboardInterrupt(), "raised KeyboardInterrupt"),
    ],
)
def test_a_callback_that_exits_stops_the_run_checkpointed_and_named(
    how, said, tiny_model_dir, prompt_file, tmp_path
):
    """sys.exit() or a KeyboardInterrupt from a hook left the loop with no checkpoint (a
    SystemExit(0) even ended the CLI with status 0, silently): the trained steps were lost. Now
    they stop the run as any exception from a callback does: a checkpoint after the step, the
    callback named, --resume."""
    from tether import train
    from tether.run.checkpoint import latest_checkpoint
    from tether.run.reporting import ReportingError

    out = tmp_path / "run"
    config = _config(tiny_model_dir, prompt_file, out, {"train.steps": 3})
    with pytest.raises(ReportingError, match=rf"callback Quitting.on_step_end {said}") as e:
        train(config, callbacks=[Quitting(how)])
    assert "stopped after step 1 with a checkpoint" in str(e.value) and f"--resume {out}" in str(e.value)
    assert isinstance(e.value.__cause__, type(how)) and latest_checkpoint(out).name == "step-000001"
    train(_config(tiny_model_dir, prompt_file, out, {"train.steps": 3}), resume=True)  # nothing lost
    assert [r["step"] for r in metric_rows(out)] == [0, 1, 2]


def test_an_async_hook_is_awaited(tiny_model_dir, prompt_file, tmp_path):
    """An ``async def`` hook's coroutine was never awaited: the hook did nothing, with only a
    RuntimeWarning to tell."""
    from tether import train

    seen = []

    class Async:
        async def on_step_end(self, step, metrics):
            seen.append(step)

    train(_config(tiny_model_dir, prompt_file, tmp_path / "run", {"train.steps": 2}), callbacks=[Async()])
    assert seen == [0, 1]


def test_callbacks_of_the_wrong_shape_are_refused_before_anything_runs(tiny_model_dir, prompt_file, tmp_path):
    from tether import train

    class TwoArgs:
        def on_step_end(self, step):  # misses metrics
            pass

    config = _config(tiny_model_dir, prompt_file, tmp_path / "run", {})
    with pytest.raises(TypeError, match="Recorder is a class; pass an instance"):
        train(config, callbacks=[Recorder])
    with pytest.raises(TypeError, match=r"TwoArgs.on_step_end must take 2 argument\(s\) \(step, metrics\)"):
        train(config, callbacks=[TwoArgs()])
    assert not (tmp_path / "run").exists()


def test_a_stop_after_the_loop_is_said_and_ignored(tiny_model_dir, prompt_file, tmp_path, caplog):
    from tether import StopTraining, train

    class LateStop:
        def on_train_end(self, run_dir):
            raise StopTraining("too late")

    out = train(_config(tiny_model_dir, prompt_file, tmp_path / "run", {}), callbacks=[LateStop()])
    assert "asked to stop after the run had ended: nothing to stop" in caplog.text
    assert [r["step"] for r in metric_rows(out)] == [0]


def test_the_final_evaluation_is_logged_at_the_last_step_under_best_by(tiny_model_dir, prompt_file, tmp_path):
    _reset_tracker()
    out = tmp_path / "run"
    overrides = {
        "train.steps": 3,
        "eval.n_prompts": 4,
        "eval.every": 1,
        "eval.periodic_prompts": 4,
        "eval.best_by": "proxy",
        "train.report_to": "tests.conftest:RecordingTracker",
    }
    assert main(tiny_run_args(tiny_model_dir, prompt_file, out, overrides, command=True)) == 0
    steps = [s for s, _ in RecordingTracker.rows]
    assert steps == sorted(steps)  # never below a step already logged (W&B would drop the row)
    final = [s for s, v in RecordingTracker.rows if "final/gain" in v]
    assert final == [2]


def test_tracker_lists_are_checked(tmp_path):
    from tether.run.config import ConfigError
    from tether.run.reporting import build_tracker, resolve_trackers

    with pytest.raises(ConfigError, match="more than once"):
        resolve_trackers(["tests.conftest:RecordingTracker", "tests.conftest:RecordingTracker"])

    from accelerate.tracking import GeneralTracker

    class Keywords(GeneralTracker):
        name = "keywords"
        requires_logging_directory = False
        tracker = None

        def __init__(self, **kwargs):
            super().__init__()
            self.got = kwargs

    t = build_tracker(Keywords, project="p", run_name="r", logging_dir=tmp_path)
    assert t.got == {"project": "p", "run_name": "r", "logging_dir": str(tmp_path)}
    import types

    module = types.ModuleType("nameless_tracker")

    class NoName(GeneralTracker):
        requires_logging_directory = False

        def __init__(self):
            pass

    module.NoName = NoName
    import sys

    sys.modules["nameless_tracker"] = module
    with pytest.raises(ConfigError, match="has no `name`"):
        resolve_trackers(["nameless_tracker:NoName"])


def test_names_with_control_characters_are_refused():
    from tether.run.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="train.run_name"):
        load_config(None, ["train.run_name=odd\nname"])
    assert load_config(None, ["train.run_name=a run / b"]).train.run_name == "a run / b"


def _chat_model(tiny_model_dir, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from tests.conftest import CHAT

    folder = tmp_path / "chat-model"
    shutil.copytree(tiny_model_dir, folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHAT
    tok.save_pretrained(folder)
    return folder


def test_conversations_held_out_with_the_default_fluency_judge(tiny_model_dir, tmp_path):
    """A conversational held-out set runs the default judges (the fluency judge read the message
    list as text and crashed); a text set beside conversations is refused, naming the field."""
    from tether import train

    convo = [[{"role": "user", "content": f"tell me about film {i}"}] for i in range(12)]
    held = [[{"role": "user", "content": f"a held-out question {i}"}] for i in range(4)]
    model = _chat_model(tiny_model_dir, tmp_path)
    overrides = {"eval.n_prompts": 4, "eval.fluency_model": None, "data.prompts": None}
    out = train(_config(model, None, tmp_path / "run", overrides), train_dataset=convo, eval_dataset=held)
    ev = json.loads((out / "eval.json").read_text())
    assert ev["n_prompts"] == 4 and "fluency_nll_change" in ev
    with pytest.raises(ValueError, match="eval_dataset holds text prompts and data.prompts conversations"):
        train(
            _config(model, None, tmp_path / "run2", overrides), train_dataset=convo, eval_dataset=["a", "b"]
        )
    assert not (tmp_path / "run2").exists()


def test_repeated_held_out_prompts_count_once_and_two_sources_are_refused(
    tiny_model_dir, prompt_file, tmp_path, caplog
):
    from tether import train

    out = tmp_path / "run"
    overrides = {"eval.n_prompts": 8}
    train(_config(tiny_model_dir, prompt_file, out, overrides), eval_dataset=["zz a", "zz a", "zz b", "zz a"])
    assert "holds 2 repeated prompt(s); each is evaluated once (2 held-out prompts)" in caplog.text
    assert json.loads((out / "eval.json").read_text())["n_prompts"] == 2
    held = tmp_path / "held.txt"
    held.write_text("zz c\n")
    both = _config(tiny_model_dir, prompt_file, tmp_path / "run2", {"data.eval_prompts": held})
    with pytest.raises(ValueError, match="both give a held-out set"):
        train(both, eval_dataset=["zz d"])


def test_dpo_pairs_with_an_eval_set_train_on_every_other_pair(tiny_model_dir, tmp_path):
    from tether.run.setup import build_run
    from tether.trainers.dpo import DPOTrainer

    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"the movie number {i} was", "chosen": " good", "rejected": " bad"} for i in range(20)]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = {"train.algo": "dpo", "dpo.pairs": pairs, "data.prompts": None, "data.heldout_fraction": 0.5}
    config = _config(tiny_model_dir, None, tmp_path / "run", overrides)
    run = build_run(config, eval_dataset=[rows[0]["prompt"], rows[1]["prompt"], "a prompt of no pair"])
    try:
        trainer = DPOTrainer(run)
        # 20 pairs, 2 of them held out by the eval set; the hash share (0.5 here) holds out none
        assert len(trainer.pairs.prompts) == 18
        assert rows[0]["prompt"] not in trainer.pairs.prompts
    finally:
        from tether.run.lock import release

        release(run.writer.lock)
