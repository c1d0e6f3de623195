"""A TRL user's ``transformers.TrainerCallback`` runs unchanged (issue 55): its events in order,
``state``/``control`` as transformers keeps them, ``should_training_stop`` ending the run (final
evaluation, checkpoint, resumable) and ``should_save`` checkpointing."""

from __future__ import annotations

import json
import logging

import pytest
from transformers import TrainerCallback, TrainerControl

from tests.conftest import metric_rows, tiny_run_args
from tether.run.reporting import ReportingError
from tether.run.trainer_callbacks import TRL_LOG_NAMES, trl_logs


def _config(model_dir, prompts, out, overrides):
    from tether import load_config

    return load_config(None, tiny_run_args(model_dir, prompts, out, overrides))


class Events(TrainerCallback):
    """Records each event with the state it saw; optionally asks to stop or save at a step."""

    def __init__(self, stop_at: int | None = None, save_at: int | None = None):
        self.seen: list[tuple[str, int, float]] = []
        self.stop_at, self.save_at = stop_at, save_at
        self.kwargs: dict = {}
        self.logs: list[dict] = []
        self.metrics: list[dict] = []
        self.lr = None

    def _note(self, name, args, state, kwargs):
        self.seen.append((name, state.global_step, state.epoch))
        self.kwargs = kwargs
        self.lr = args.learning_rate

    def on_init_end(self, args, state, control, **kwargs):
        self._note("init_end", args, state, kwargs)

    def on_train_begin(self, args, state, control, **kwargs):
        self._note("train_begin", args, state, kwargs)

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._note("epoch_begin", args, state, kwargs)

    def on_step_begin(self, args, state, control, **kwargs):
        self._note("step_begin", args, state, kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        self._note("step_end", args, state, kwargs)
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True  # transformers' way: set it on control
        if self.save_at is not None and state.global_step == self.save_at:
            return {"should_save": True}  # the docs' other way: a dict of control's fields
        return None

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._note("log", args, state, kwargs)
        self.logs.append(dict(logs))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self._note("evaluate", args, state, kwargs)
        self.metrics.append(dict(metrics))

    def on_save(self, args, state, control, **kwargs):
        self._note("save", args, state, kwargs)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._note("epoch_end", args, state, kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        self._note("train_end", args, state, kwargs)


def test_trl_and_transformers_callbacks_run_unchanged(tiny_model_dir, prompt_file, tmp_path, capsys):
    """TRL's own RichProgressCallback and transformers' PrinterCallback, as a TRL user passes
    them, beside one that records every event: the events in transformers' order, global_step
    counting steps done, logs with TRL's names, the model and optimizer reachable."""
    from transformers import PrinterCallback
    from trl.trainer.callbacks import RichProgressCallback

    from tether import train

    out = tmp_path / "run"
    rec = Events()
    overrides = {"train.steps": 2, "eval.n_prompts": 4, "eval.every": 0, "optim.lr": 2e-4}
    train(
        _config(tiny_model_dir, prompt_file, out, overrides),
        callbacks=[RichProgressCallback(), PrinterCallback(), rec],
    )
    names = [n for n, _, _ in rec.seen]
    assert names == [
        "init_end",
        "train_begin",
        "epoch_begin",
        "step_begin",
        "step_end",
        "log",
        "step_begin",
        "step_end",
        "log",
        "evaluate",  # the final held-out evaluation
        "epoch_end",
        "train_end",
    ]
    # global_step: steps done (0 before the first, 1 after it), as transformers counts them
    assert [s for n, s, _ in rec.seen if n in ("step_begin", "step_end")] == [0, 1, 1, 2]
    # epoch: passes over the 62 training prompts, 4 prompts a step (PPO: rollout.batch_size=4)
    assert [e for n, _, e in rec.seen if n == "step_end"] == [4 / 62, 8 / 62]
    rows = metric_rows(out, timings=True)
    assert len(rec.logs) == 2
    for logs, row in zip(rec.logs, rows):
        for ours, value in row.items():
            if ours != "step" and isinstance(value, float):
                assert logs[ours] == value
        for trl, ours in TRL_LOG_NAMES.items():
            assert logs[trl] == row[ours]
    ev = json.loads((out / "eval.json").read_text())
    assert rec.metrics[-1]["gain"] == ev["gain"]
    assert rec.lr == 2e-4
    import torch
    from transformers import PreTrainedModel

    assert isinstance(rec.kwargs["model"], PreTrainedModel)
    assert isinstance(rec.kwargs["optimizer"], torch.optim.Optimizer)
    assert rec.kwargs["processing_class"] is not None
    # PrinterCallback printed each step's logs (its on_log pops total_flos and prints the dict)
    printed = capsys.readouterr().out
    assert printed.count("'objective/kl':") >= 2


def test_should_training_stop_ends_the_run_evaluated_and_checkpointed(tiny_model_dir, prompt_file, tmp_path):
    """control.should_training_stop after step 1 (global_step 2) of 4: the run ends as if
    train.steps were 2 (final evaluation, policy saved, a checkpoint of step 1), and a resume goes
    on to step 3."""
    from tether import train

    out = tmp_path / "run"
    overrides = {"train.steps": 4, "eval.n_prompts": 4, "train.checkpoint_every": 0, "train.save_model": True}
    rec = Events(stop_at=2)
    train(_config(tiny_model_dir, prompt_file, out, overrides), callbacks=[rec])
    assert [r["step"] for r in metric_rows(out)] == [0, 1]
    assert (out / "eval.json").exists() and (out / "policy").is_dir()
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000001"]
    assert [n for n, _, _ in rec.seen][-4:] == ["save", "evaluate", "epoch_end", "train_end"]
    train(_config(tiny_model_dir, prompt_file, out, overrides), resume=True, callbacks=[Events()])
    assert [r["step"] for r in metric_rows(out)] == [0, 1, 2, 3]


def test_should_save_checkpoints_that_step_and_calls_on_save(tiny_model_dir, prompt_file, tmp_path):
    from tether import train

    out = tmp_path / "run"
    rec = Events(save_at=1)  # returns {"should_save": True} after the first step
    train(
        _config(tiny_model_dir, prompt_file, out, {"train.steps": 3, "train.checkpoint_every": 0}),
        callbacks=[rec],
    )
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-000000"]
    assert [(n, s) for n, s, _ in rec.seen if n == "save"] == [("save", 1)]


def test_a_bad_return_value_stops_the_run_naming_the_callback(tiny_model_dir, prompt_file, tmp_path):
    from tether import train

    class Wrong(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            return {"should_stop": True}  # not a TrainerControl field

    out = tmp_path / "run"
    with pytest.raises(ReportingError, match=r"Wrong.on_step_end returned .*should_stop"):
        train(_config(tiny_model_dir, prompt_file, out, {"train.steps": 3}), callbacks=[Wrong()])
    assert [r["step"] for r in metric_rows(out)] == [0]  # the step is kept, checkpointed
    assert any((out / "checkpoints").iterdir())


def test_events_tether_never_calls_are_said(caplog):
    from tether.run.reporting import check_callbacks

    class Inside(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            pass

    with caplog.at_level(logging.WARNING, logger="tether"):
        (hooks,) = check_callbacks([Inside()])
    assert "Inside defines on_optimizer_step, which a tether run never calls" in caplog.text
    with pytest.raises(TypeError, match="Inside is a class; pass an instance"):
        check_callbacks([Inside])
    assert hooks.control is None and hooks.end_reason is None


def test_a_returned_control_replaces_it():
    from tether.run.trainer_callbacks import TrainerCallbackHooks

    class Fresh(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            new = TrainerControl()
            new.should_training_stop = True
            return new

    hooks = TrainerCallbackHooks(Fresh())
    hooks.control = TrainerControl()
    hooks.on_step_begin(0)
    assert hooks.end_reason == "a callback set control.should_training_stop (after Fresh's events)"


def test_trl_logs_add_trl_names_beside_tethers():
    # the row's numbers under tether's names, TRL's names for the same numbers, epoch; no step,
    # no strings or booleans
    row = {
        "step": 3,
        "optim/lr": 1e-5,
        "objective/scores": 0.25,
        "policy/grad_norm": 2.0,
        "note": "x",
        "b": True,
    }
    assert trl_logs(row, 0.5) == {
        "optim/lr": 1e-5,
        "objective/scores": 0.25,
        "policy/grad_norm": 2.0,
        "learning_rate": 1e-5,
        "reward": 0.25,
        "grad_norm": 2.0,
        "epoch": 0.5,
    }


@pytest.mark.parametrize("algo", ["grpo", "dpo"])
def test_each_trainer_drives_a_trainer_callback(tiny_model_dir, prompt_file, tmp_path, algo):
    """GRPO (groups: rollout.batch_size / group_size prompts a step) and DPO (pairs a step): the
    epoch of on_log's logs is the state's, growing by the same share each step."""
    from tether import train

    rec = Events()
    out = tmp_path / algo
    train(_config(tiny_model_dir, prompt_file, out, {"train.algo": algo, "train.steps": 2}), callbacks=[rec])
    epochs = [e for n, _, e in rec.seen if n == "step_end"]
    assert [log["epoch"] for log in rec.logs] == epochs
    assert epochs[0] > 0 and epochs[1] == pytest.approx(2 * epochs[0], rel=1e-12)
    assert [r["step"] for r in metric_rows(out)] == [0, 1]


def test_transformers_semantics_log_history_shared_control_and_failures(
    tiny_model_dir, prompt_file, tmp_path
):
    """As transformers' Trainer: on_log sees its own entry last in state.log_history; every
    TrainerCallback shares one control (one's stop request is the other's to read); a callback
    that fails in on_train_begin stops the run before any step, named by its own class;
    EarlyStoppingCallback is refused with tether's way to stop early."""
    from transformers import EarlyStoppingCallback

    from tether import train

    class LastLog(TrainerCallback):
        def __init__(self):
            self.last = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.last.append(state.log_history[-1]["step"])

    class Stopper(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = True

    class Reader(TrainerCallback):
        def __init__(self):
            self.saw, self.state = [], None

        def on_step_end(self, args, state, control, **kwargs):
            self.saw.append(control.should_training_stop)
            self.state = state

        def on_train_end(self, args, state, control, **kwargs):
            self.log_history = list(state.log_history)

    last, reader = LastLog(), Reader()
    out = tmp_path / "run"
    train(_config(tiny_model_dir, prompt_file, out, {"train.steps": 3}), callbacks=[last, Stopper(), reader])
    assert last.last == [1]  # the step's own entry (global_step 1), and the run ended after it
    assert reader.saw == [True]  # the Stopper's request, on the one control
    # one state for the run's callbacks, one log_history entry per step
    assert [e["step"] for e in reader.log_history] == [1]

    class Broken(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            raise RuntimeError("no tracker")

    with pytest.raises(
        ReportingError, match=r"callback Broken.on_train_begin failed: RuntimeError: no tracker"
    ):
        train(
            _config(tiny_model_dir, prompt_file, tmp_path / "broken", {"train.steps": 2}),
            callbacks=[Broken()],
        )
    assert not (tmp_path / "broken").exists()  # nothing trained, nothing left
    with pytest.raises(TypeError, match="eval.best_by .* with eval.patience"):
        train(_config(tiny_model_dir, prompt_file, tmp_path / "es", {}), callbacks=[EarlyStoppingCallback()])
