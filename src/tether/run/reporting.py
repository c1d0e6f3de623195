"""Where a run's results go beyond its own files: accelerate's trackers and the user's callbacks.

One :class:`Reporter` per run, on rank 0 (the process that writes the run folder and evaluates).
It starts every tracker of ``train.report_to`` under ``train.project`` with the run's name
(``train.run_name``, default the run folder's), and hands each of them, and each callback of
``train(..., callbacks=[...])``:

- every metric row (``on_step_end(step, metrics)``; trackers: ``log``),
- every periodic and the final held-out evaluation (``on_evaluate(step, row)``; trackers: the
  numbers under ``eval/`` each step, the final one's under ``final/``, with their SEs),
- every health alarm when it first fires (``on_alarm(alarm)``; trackers: ``alarm/<rule>`` = 1 at
  its step, and its text where the tracker takes text),
- the end of the run (``on_train_end(run_dir)``, after the policy and the plots are written),
- and, to callbacks alone: the start (``on_train_begin(context)``, before the first step this
  process runs; ``context`` a :class:`tether.run.trainer_callbacks.RunContext`: the run folder,
  config, model, tokenizer, optimizer, schedule and history), each step's start
  (``on_step_begin(step)``) and each checkpoint written (``on_save(step, checkpoint)``).

A ``transformers.TrainerCallback`` (TRL's, or a user's written for TRL) is taken as it is and
called with transformers' ``(args, state, control, **kwargs)`` at the matching events, its
``control.should_training_stop`` ending the run after that step
(:mod:`tether.run.trainer_callbacks`).

A callback defines any of these hooks (each optional; an ``async def`` hook is awaited). To stop
the run it raises :class:`StopTraining` from a hook: the run writes a checkpoint after that step
and raises :class:`tether.run.lifecycle.Interrupted`, as after Ctrl-C, and ``tether train --resume
RUN`` continues it. Any other exception from a callback (or a tracker) during the loop, ``SystemExit``
(``sys.exit()``) and ``KeyboardInterrupt`` included, stops the run the same way, checkpointed after
that step, and is then raised as :class:`ReportingError` naming it, the original as its cause: fix
it and resume. A stop request after the loop is said and ignored.
"""

from __future__ import annotations

import inspect
import logging
import math
from pathlib import Path

from tether.models.turns import awaited
from tether.run.trainer_callbacks import RunContext, TrainerCallbackHooks, is_trainer_callback

log = logging.getLogger("tether")

HOOKS = (
    "on_train_begin",
    "on_step_begin",
    "on_step_end",
    "on_evaluate",
    "on_save",
    "on_alarm",
    "on_train_end",
)
"""The callback hooks tether calls, each optional."""
HOOK_SIGNATURES = {
    "on_train_begin": "context",
    "on_step_begin": "step",
    "on_step_end": "step, metrics",
    "on_save": "step, checkpoint",
    "on_evaluate": "step, row",
    "on_alarm": "alarm",
    "on_train_end": "run_dir",
}
HOOK_ARGS = {h: len(a.split(",")) for h, a in HOOK_SIGNATURES.items()}

TEXT_TRACKERS = ("tensorboard", "wandb", "trackio", "comet_ml", "aim", "swanlab", "clearml")
"""Trackers whose ``log`` takes a string value (mlflow and dvclive log numbers alone): alarms reach
them as text too. A ``module:Class`` tracker gets the text as well."""

RUN_NAME_KWARGS = {
    "wandb": "name",
    "trackio": "name",
    "comet_ml": "experiment_name",
    "swanlab": "experiment_name",
    "clearml": "task_name",
    "mlflow": "run_name",
}
"""The ``init_kwargs`` key that names the run for each accelerate tracker that takes one; the
project is ``init_trackers``' first argument (W&B's project, MLflow's experiment, TensorBoard's
folder under the run's). ``aim`` and ``dvclive`` take no run name."""


def resolve_trackers(report_to: list[str]) -> tuple[list[str], list[type]]:
    """``train.report_to`` as (accelerate's tracker names, ``module:Class`` tracker classes).

    Raises:
        ConfigError: a named tracker's package is not installed, a class cannot be imported or
            is not an accelerate ``GeneralTracker`` subclass.
    """
    import importlib

    from accelerate.tracking import GeneralTracker, get_available_trackers

    from tether.run.config import ConfigError

    names, classes = [], []
    available = {str(t) for t in get_available_trackers()}
    given = [n for n in report_to if n != "none"]
    twice = sorted({n for n in given if given.count(n) > 1})
    if twice:
        raise ConfigError(f"train.report_to names {twice} more than once: every row would be logged twice")
    for name in given:
        if ":" in name:
            module, _, attr = name.partition(":")
            try:
                cls = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                raise ConfigError(f"train.report_to={name!r}: cannot import ({e})") from None
            if not (isinstance(cls, type) and issubclass(cls, GeneralTracker)):
                raise ConfigError(f"train.report_to={name!r} is not an accelerate GeneralTracker subclass")
            if not isinstance(getattr(cls, "name", None), str) or not cls.name:
                raise ConfigError(
                    f"train.report_to={name!r}: the class has no `name` (a GeneralTracker needs one, "
                    "e.g. name = 'my_tracker')"
                )
            classes.append(cls)
        elif name != "all" and name not in available:
            raise ConfigError(
                f"train.report_to={name!r}: the {name} package is not installed (pip install {name}); "
                f"installed trackers: {sorted(available) or 'none'}"
            )
        else:
            names.append(name)
    return names, classes


def build_tracker(cls: type, *, project: str, run_name: str, logging_dir: Path):
    """A ``module:Class`` tracker, given ``project``, ``run_name`` and ``logging_dir`` where its
    ``__init__`` takes them (as accelerate's own take theirs).

    Raises:
        ConfigError: its ``__init__`` failed (the field named, the cause kept).
    """
    from tether.run.config import ConfigError

    params = inspect.signature(cls.__init__).parameters
    offered = {"project": project, "run_name": run_name, "logging_dir": str(logging_dir)}
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    try:
        return cls(**{k: v for k, v in offered.items() if takes_all or k in params})
    except Exception as e:  # a user's class: name the field, never a bare traceback
        raise ConfigError(
            f"train.report_to={cls.__module__}:{cls.__qualname__}: building the tracker failed "
            f"({type(e).__name__}: {e}); tether calls it with project, run_name and logging_dir "
            "when its __init__ takes them"
        ) from e


class StopTraining(Exception):
    """Raised by a callback hook to stop the run after this step, checkpointed and resumable."""


class ReportingError(RuntimeError):
    """A callback or a tracker raised: the run stopped after the step with a checkpoint (in the
    loop), its message names the callback or tracker, and its cause is the original exception."""


def check_callbacks(callbacks) -> list:
    """The callbacks of ``train(..., callbacks=...)`` as a list, each checked.

    Raises:
        TypeError: not a list of objects, or an object with none of :data:`HOOKS` (names them),
            or a hook that is not callable.
    """
    if callbacks is None:
        return []
    if not isinstance(callbacks, (list, tuple)):
        raise TypeError(
            f"train(callbacks=...) takes a list of callback objects, got {type(callbacks).__name__}"
        )
    callbacks = [
        TrainerCallbackHooks(cb) if is_trainer_callback(cb) and not isinstance(cb, type) else cb
        for cb in callbacks
    ]
    for cb in callbacks:
        if isinstance(cb, type):
            raise TypeError(
                f"train(callbacks=...): {cb.__name__} is a class; pass an instance ({cb.__name__}())"
            )
        hooks = [h for h in HOOKS if hasattr(cb, h)]
        if not hooks:
            raise TypeError(
                f"train(callbacks=...): {cb!r} has none of the hooks {', '.join(HOOKS)}; define at least one"
            )
        for h in hooks:
            fn = getattr(cb, h)
            if not callable(fn):
                raise TypeError(f"train(callbacks=...): {type(cb).__name__}.{h} is not callable")
            try:
                inspect.signature(fn).bind(*(None,) * HOOK_ARGS[h])
            except TypeError:
                raise TypeError(
                    f"train(callbacks=...): {type(cb).__name__}.{h} must take {HOOK_ARGS[h]} argument(s) "
                    f"({HOOK_SIGNATURES[h]})"
                ) from None
            except ValueError:  # a builtin without a signature: called as it is
                pass
    return callbacks


def numbers(values: dict, prefix: str = "") -> dict[str, float]:
    """The finite-or-not numbers of a (nested) dict, flattened with ``/``; booleans and strings left out."""
    out: dict[str, float] = {}
    for k, v in values.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= numbers(v, key + "/")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


class Reporter:
    """The run's trackers and callbacks (module docstring).

    Args:
        accelerator: the run's ``Accelerator`` (its ``log_with`` holds ``train.report_to``), or None.
        callbacks: checked by :func:`check_callbacks`.
        stop: the run's stop list (the signal handlers'); a :class:`StopTraining` appends to it.
    """

    def __init__(self, accelerator, callbacks: list, stop: list[str]):
        self._accelerator = accelerator
        self.accelerator = accelerator if accelerator is not None and accelerator.log_with else None
        self.callbacks = callbacks
        self.stop = stop
        self.step = -1  # the last step logged to the trackers: a later log never goes below it
        self.error: BaseException | None = None
        """The first exception a callback or a tracker raised in the loop: the run checkpoints after
        that step, then raises it (:class:`ReportingError`), so nothing trained is lost."""
        self.ended = False  # the training loop is over: a stop request has nothing to stop

    # ---- trackers -------------------------------------------------------------------------
    def start(
        self, *, report_to: list[str], project: str, run_name: str, run_dir: Path, config: dict
    ) -> None:
        """``init_trackers(project, config, init_kwargs)`` naming the run for each tracker
        (:data:`RUN_NAME_KWARGS`); TensorBoard writes to ``<run>/tensorboard``; each
        ``module:Class`` tracker is built by :func:`build_tracker`."""
        _, classes = resolve_trackers(report_to)
        acc = self.accelerator
        if acc is None and not classes:
            return
        from accelerate.tracking import TensorBoardTracker

        if acc is None:
            acc = self.accelerator = self._accelerator
        acc.project_configuration.set_directories(str(run_dir))
        trackers = [
            TensorBoardTracker("tensorboard", str(run_dir)) if str(t) == "tensorboard" else t  # one path
            for t in acc.log_with
        ]
        trackers += [
            build_tracker(c, project=project, run_name=run_name, logging_dir=run_dir) for c in classes
        ]
        acc.log_with = trackers
        init_kwargs = {name: {key: run_name} for name, key in RUN_NAME_KWARGS.items()}
        acc.init_trackers(project, config=config, init_kwargs=init_kwargs)

    def _log(self, values: dict, step: int) -> None:
        """Log to every tracker at ``step``, or at the last step logged when that is later (W&B
        drops a row below its current step)."""
        if self.accelerator is None or not values:
            return
        self.step = max(self.step, step)
        self._guarded("a tracker (train.report_to)", lambda: self.accelerator.log(values, step=self.step))

    def _guarded(self, what: str, fn) -> None:
        """Run ``fn`` (an ``async def`` hook's coroutine awaited); in the loop, an exception from it
        stops the run after this step with a checkpoint and is raised then (:attr:`error`); after
        the loop it is raised at once. ``SystemExit`` (``sys.exit()``) and ``KeyboardInterrupt``
        count as exceptions: they would end the run with no checkpoint (or exit 0, silently)."""
        try:
            awaited(fn())
        except StopTraining:
            raise
        except (Exception, SystemExit, KeyboardInterrupt) as e:
            how = (
                f"raised SystemExit({e.code!r}) (sys.exit; raise tether.StopTraining to stop the run)"
                if isinstance(e, SystemExit)
                else "raised KeyboardInterrupt (or was running when Ctrl-C came)"
                if isinstance(e, KeyboardInterrupt)
                else f"failed: {type(e).__name__}: {e}"
            )
            if self.ended:
                raise ReportingError(f"{what} {how}, after the run ended") from e
            if self.error is None:
                self.error = ReportingError(f"{what} {how}")
                self.error.__cause__ = e
                self.stop.append(f"an error in {what}")

    # ---- events ---------------------------------------------------------------------------
    def _call(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is None:
                continue
            name = cb.name if isinstance(cb, TrainerCallbackHooks) else type(cb).__name__
            try:
                self._guarded(f"callback {name}.{hook}", lambda fn=fn: fn(*args))
            except StopTraining as e:
                why = f"a callback ({name}.{hook}: {e or 'StopTraining'})"
                if self.ended:
                    log.warning("tether: %s asked to stop after the run had ended: nothing to stop", why)
                else:
                    self.stop.append(why)

    def train_begin(self, context: RunContext) -> None:
        """Before the first step this process runs: ``on_train_begin(context)``; the run's
        TrainerCallbacks share one control. A callback that fails here stops the run before any
        step (nothing trained; as transformers, whose Trainer raises before training).

        Raises:
            ReportingError: a callback failed in ``on_train_begin`` (or ``on_init_end``).
        """
        hooks = self._trainer_callbacks()
        for h in hooks[1:]:
            h.share_with(hooks[0])
        self._call("on_train_begin", context)
        if self.error is not None:
            error, self.error = self.error, None
            self.stop.clear()
            raise error

    def step_begin(self, step: int) -> None:
        """Before step ``step``: ``on_step_begin(step)``."""
        self._call("on_step_begin", step)

    def saved(self, step: int, checkpoint: Path) -> None:
        """A checkpoint of step ``step`` was written: ``on_save(step, checkpoint)``."""
        self._call("on_save", step, Path(checkpoint))

    def end_request(self) -> str | None:
        """Why a ``TrainerCallback`` asked the run to end (``control.should_training_stop``), or None."""
        return next((cb.end_reason for cb in self._trainer_callbacks() if cb.end_reason), None)

    def save_request(self) -> bool:
        """A ``TrainerCallback`` set ``control.should_save``: checkpoint after this step."""
        return any(cb.save_requested() for cb in self._trainer_callbacks())

    def _trainer_callbacks(self) -> list[TrainerCallbackHooks]:
        return [cb for cb in self.callbacks if isinstance(cb, TrainerCallbackHooks)]

    def step_end(self, step: int, row: dict) -> None:
        """A step's metrics row, as metrics.jsonl holds it."""
        self._log({k: v for k, v in numbers(row).items() if k != "step"}, step)
        self._call("on_step_end", step, dict(row))
        evaluation = {k: v for k, v in row.items() if k.startswith("eval/")}
        if evaluation:
            self._call("on_evaluate", step, evaluation)

    def samples(self, step: int, rows: list[dict]) -> None:
        """The step's sample table to every tracker that takes tables
        (:func:`tether.run.metrics.log_sample_table`), guarded as every other tracker call."""
        if self.accelerator is not None:
            from tether.run.metrics import log_sample_table

            self._guarded(
                "a tracker (train.report_to)",
                lambda: log_sample_table(self.accelerator, max(step, self.step), rows),
            )

    def alarm(self, alarm) -> None:
        """A health alarm (:class:`tether.core.health.Alarm`), when it first fires."""
        text = (
            f"[{alarm.rule}] step {alarm.step}: {alarm.message}. "
            f"Likely cause: {alarm.cause}. Fix: {alarm.fix}"
        )
        if self.accelerator is not None:
            self._log({f"alarm/{alarm.rule}": 1.0}, alarm.step)
            for t in self.accelerator.trackers:
                if t.name in TEXT_TRACKERS or type(t).__module__.split(".")[0] != "accelerate":
                    self._guarded(f"tracker {t.name}", lambda t=t: t.log({"alarms": text}, step=self.step))
        self._call("on_alarm", alarm)

    def final_evaluation(self, result: dict) -> None:
        """The final held-out evaluation, as eval.json holds it (gains with their SEs), logged at
        the run's last step (``policy_step`` names the policy evaluated, an earlier one under
        eval.best_by); the callbacks get it with the policy's step."""
        step = int(result.get("policy_step", 0))
        values = {f"final/{k}": v for k, v in numbers(result).items() if math.isfinite(v)}
        self._log(values, step)
        self._call("on_evaluate", step, {"final": True, **result})

    def end_loop(self) -> None:
        """The training loop is over: a later stop request is said and ignored, a later error raised."""
        self.ended = True

    def train_end(self, run_dir: Path) -> None:
        """The run is over: trackers closed, then ``on_train_end(run_dir)``."""
        self.ended = True
        if self.accelerator is not None:
            self._guarded("a tracker (train.report_to)", self.accelerator.end_training)
        self._call("on_train_end", Path(run_dir))
