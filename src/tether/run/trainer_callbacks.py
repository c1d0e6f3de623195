"""``transformers.TrainerCallback`` objects (TRL's and the user's) driven by a tether run.

TRL's trainers are ``transformers.Trainer``s: a callback there gets ``(args, state, control,
**kwargs)`` at 16 events and steers the loop through ``control``. :class:`TrainerCallbackHooks`
wraps such a callback into tether's hooks (:mod:`tether.run.reporting`), so that the same object
runs unchanged. Which event comes when, one tether step being one training step
(``state.global_step`` = steps done, ``state.max_steps`` = ``train.steps``):

==========================  ==================================================================
event                       when
==========================  ==================================================================
``on_init_end``             once, when the run is built (before ``on_train_begin``)
``on_train_begin``          before the first step (of this process's run: a resume calls it again)
``on_epoch_begin``          before the first step, and when ``state.epoch`` (passes over the
                            training prompts) crosses an integer
``on_step_begin``           before each step
``on_step_end``             after each step's update
``on_log``                  after ``on_step_end``, ``logs`` = the step's metrics row (below)
``on_evaluate``             after a periodic held-out evaluation (``eval.every``) and the final
                            one, ``metrics`` = its numbers
``on_save``                 after each checkpoint is written
``on_epoch_end``            when ``state.epoch`` crosses an integer, and after the last step
``on_train_end``            at the end of the run, after the policy and plots are written
==========================  ==================================================================

Not called: ``on_substep_end``, ``on_pre_optimizer_step`` and ``on_optimizer_step`` (a tether
step runs several optimizer steps inside its update: ``optim.minibatch_size``,
``optim.epochs``), ``on_predict``, ``on_prediction_step`` and ``on_push_begin``; a callback that
overrides one of these is told so when the run starts.

``control`` (``transformers.TrainerControl``), read after each step's events:
``should_training_stop`` ends the run after that step as ``train.steps`` would (a checkpoint,
the final held-out evaluation, the policy saved; ``tether train --resume`` can go on to
``train.steps``); ``should_save`` writes a checkpoint after that step (then ``on_save``);
``should_log`` is moot (every step is logged); ``should_evaluate`` is not followed (tether
evaluates every ``eval.every`` steps) and is said once. An event may return a ``TrainerControl``
(it replaces ``control``, as in transformers) or a dict of its fields (set on ``control``; the
transformers docs' ``return {"should_training_stop": True}``).

``logs`` holds the step's row as metrics.jsonl has it (tether's names, numbers only), with
TRL's names beside those that mean the same: ``learning_rate`` (``optim/lr``), ``grad_norm``
(``policy/grad_norm``), ``reward`` (``objective/scores``: the mean score) and ``epoch``;
``state.log_history`` collects them with ``step``. The keyword arguments are transformers':
``model`` (the policy's language model, the peft model under LoRA), ``processing_class`` (the
tokenizer), ``optimizer``, ``lr_scheduler``, ``train_dataloader`` and ``eval_dataloader``
(None: tether draws its own batches). ``args`` is a ``transformers.TrainingArguments`` with
the run's values (``output_dir`` the run folder, ``learning_rate``, ``max_steps``, ``seed``,
``per_device_train_batch_size`` = ``rollout.batch_size``, ``logging_steps`` 1, ``save_steps``
and ``eval_steps``, ``report_to`` none: tether reports). Callbacks run on rank 0 only
(``state.is_world_process_zero`` is True there), as every tether hook.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("tether")

CALLED = (
    "on_init_end",
    "on_train_begin",
    "on_epoch_begin",
    "on_step_begin",
    "on_step_end",
    "on_log",
    "on_evaluate",
    "on_save",
    "on_epoch_end",
    "on_train_end",
)
"""The ``TrainerCallback`` events a tether run calls (module docstring)."""
NOT_CALLED = (
    "on_substep_end",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_predict",
    "on_prediction_step",
    "on_push_begin",
)
"""The events a tether run never calls: their moment is inside tether's update, or does not exist."""
TRL_LOG_NAMES = {
    "learning_rate": "optim/lr",
    "grad_norm": "policy/grad_norm",
    "reward": "objective/scores",
}
"""TRL's ``logs`` names given beside tether's, each the same quantity under tether's name."""


@dataclass
class RunContext:
    """What a run's callbacks may reach, handed to ``on_train_begin(context)`` on rank 0.

    Attributes:
        run_dir: the run folder.
        config: the run's :class:`tether.run.config.Config` (read it; changing it changes nothing).
        model: the policy's language model (``transformers`` model; the peft model under LoRA).
        tokenizer: the run's tokenizer.
        optimizer: the policy's ``torch.optim.Optimizer``.
        lr_scheduler: its learning-rate schedule.
        start_step: the first step this process runs (a resumed run's next step).
        history: the metrics rows logged so far (a resumed run's earlier steps).
        epoch_at: ``step -> passes over the training prompts`` after ``step`` steps.
        device: the policy's device.
    """

    run_dir: Path
    config: Any
    model: Any
    tokenizer: Any
    optimizer: Any
    lr_scheduler: Any
    start_step: int
    history: list[dict] = field(default_factory=list)
    epoch_at: Any = None
    device: Any = None


def is_trainer_callback(obj) -> bool:
    """True for a ``transformers.TrainerCallback`` instance (or a class of one: then the caller
    says to pass an instance)."""
    try:
        from transformers import TrainerCallback
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(obj, TrainerCallback) or (isinstance(obj, type) and issubclass(obj, TrainerCallback))


def training_arguments(config, run_dir: Path, device=None):
    """A ``transformers.TrainingArguments`` holding the run's values under transformers' names
    (module docstring); nothing reads it back.

    Built without its ``__post_init__``: that sets up devices by resetting accelerate's state, the
    run's own (the run places itself). Every field holds its default but those set here; the
    device is the policy's (``args.device``), the distributed state accelerate's.
    """
    import dataclasses

    import torch
    from accelerate import PartialState
    from transformers import TrainingArguments

    c = config
    args = object.__new__(TrainingArguments)
    for f in dataclasses.fields(TrainingArguments):
        if f.default is not dataclasses.MISSING:
            setattr(args, f.name, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            setattr(args, f.name, f.default_factory())
        else:  # pragma: no cover - every field of transformers 5 has a default
            setattr(args, f.name, None)
    values = {
        "output_dir": str(run_dir),
        "learning_rate": c.optim.lr,
        "max_steps": c.train.steps,
        "seed": c.train.seed,
        "per_device_train_batch_size": c.rollout.batch_size,
        "logging_steps": 1,
        "logging_strategy": "steps",
        "save_steps": c.train.checkpoint_every or c.train.steps,
        "save_strategy": "steps" if c.train.checkpoint_every else "no",
        "eval_steps": c.eval.every or None,
        "eval_strategy": "steps" if c.eval.every else "no",
        "weight_decay": c.optim.weight_decay,
        "max_grad_norm": c.optim.max_grad_norm or 0.0,
        "warmup_steps": c.optim.warmup_steps,
        "report_to": [],
        "run_name": c.train.run_name or Path(run_dir).name,
    }
    for k, v in values.items():
        setattr(args, k, v)
    device = torch.device("cpu") if device is None else torch.device(device)
    args.__dict__["_setup_devices"] = device  # the cached property, filled: never reset the state
    args._n_gpu = 0 if device.type == "cpu" else 1
    args.distributed_state = PartialState() if PartialState._shared_state else None
    return args


def trl_logs(row: dict, epoch: float) -> dict[str, float]:
    """``logs`` of ``on_log``: the row's numbers (tether's names) and TRL's names beside them
    (:data:`TRL_LOG_NAMES`), ``epoch`` included; ``step`` left out (``state.global_step`` holds it)."""
    out = {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    out |= {trl: out[ours] for trl, ours in TRL_LOG_NAMES.items() if ours in out}
    out["epoch"] = float(epoch)
    return out


class TrainerCallbackHooks:
    """A ``transformers.TrainerCallback`` as tether hooks (module docstring).

    Args:
        callback: the ``TrainerCallback`` instance, called unchanged.

    Attributes:
        end_reason: why a callback set ``control.should_training_stop``, once it did (the run
            ends after that step); else None.
    """

    def __init__(self, callback):
        from transformers import EarlyStoppingCallback

        if isinstance(callback, EarlyStoppingCallback):
            raise TypeError(
                "train(callbacks=...): transformers' EarlyStoppingCallback needs a Trainer's "
                "metric_for_best_model and load_best_model_at_end; tether's early stopping is "
                "eval.best_by (gold or proxy) with eval.patience, on the held-out evaluation"
            )
        self.callback = callback
        self.name = type(callback).__name__
        self.shared: dict = {"control": None, "state": None, "args": None}
        """The control, state and arguments, one of each for every TrainerCallback of the run (as
        transformers' one ``CallbackHandler`` holds them): a dict, so that a control replaced by a
        callback's return value is every callback's. :meth:`share_with` joins the holders."""
        self.kwargs: dict = {}
        self.end_reason: str | None = None
        self._said_evaluate = False
        self._epoch_at = None
        from transformers import TrainerCallback

        skipped = [
            e for e in NOT_CALLED if getattr(type(callback), e, None) is not getattr(TrainerCallback, e, None)
        ]
        if skipped:
            log.warning(
                "tether: warning: %s defines %s, which a tether run never calls (a tether step runs its "
                "optimizer steps inside one update; tether.run.trainer_callbacks lists the events called)",
                self.name,
                ", ".join(skipped),
            )

    def __repr__(self) -> str:
        return f"TrainerCallbackHooks({self.callback!r})"

    @property
    def args(self):
        """The run's ``transformers.TrainingArguments`` (:func:`training_arguments`), shared."""
        return self.shared["args"]

    @property
    def state(self):
        """The run's ``transformers.TrainerState``, shared by its TrainerCallbacks."""
        return self.shared["state"]

    @property
    def control(self):
        """The run's ``transformers.TrainerControl`` (shared by its TrainerCallbacks), or None
        before the run begins."""
        return self.shared["control"]

    @control.setter
    def control(self, value) -> None:
        self.shared["control"] = value

    def share_with(self, other: TrainerCallbackHooks) -> None:
        """Use ``other``'s control holder: one control for both, as in transformers."""
        self.shared = other.shared

    # ---- calling ----------------------------------------------------------------------------
    def _event(self, name: str, **extra) -> None:
        """Call ``callback.<name>(args, state, control, **kwargs)`` as transformers'
        ``CallbackHandler`` does; a returned ``TrainerControl`` replaces ``control``, a returned
        dict sets its fields.

        Raises:
            TypeError: a return value that is neither, or a dict naming no ``TrainerControl`` field.
        """
        from transformers import TrainerControl

        result = getattr(self.callback, name)(self.args, self.state, self.control, **self.kwargs, **extra)
        if result is None:
            return
        if isinstance(result, TrainerControl):
            self.control = result
        elif isinstance(result, dict):
            unknown = [k for k in result if not hasattr(self.control, k) or k.startswith("_")]
            if unknown:
                raise TypeError(
                    f"{self.name}.{name} returned {result!r}: {unknown} are not TrainerControl fields "
                    "(should_training_stop, should_epoch_stop, should_save, should_evaluate, should_log)"
                )
            for k, v in result.items():
                setattr(self.control, k, v)
        else:
            raise TypeError(
                f"{self.name}.{name} returned a {type(result).__name__}; return None, the control "
                "(a transformers.TrainerControl) or a dict of its fields"
            )

    def _after_events(self) -> None:
        """Read ``control`` after an event group: the stop request (kept), the moot flags reset."""
        c = self.control
        if c.should_training_stop and self.end_reason is None:
            self.end_reason = f"a callback set control.should_training_stop (after {self.name}'s events)"
        if c.should_evaluate and not self._said_evaluate:
            self._said_evaluate = True
            log.warning(
                "tether: warning: %s set control.should_evaluate; tether evaluates every eval.every steps "
                "(set eval.every), not on request",
                self.name,
            )
        c.should_log = c.should_evaluate = False

    def save_requested(self) -> bool:
        """``control.should_save`` is set: the loop writes a checkpoint after this step."""
        return bool(self.control is not None and self.control.should_save)

    # ---- tether's hooks ---------------------------------------------------------------------
    def on_train_begin(self, context: RunContext) -> None:
        from transformers import TrainerControl

        from tether.judges.contract import trainer_state

        cfg = context.config
        self._epoch_at = context.epoch_at or (lambda step: 0.0)
        self.kwargs = {
            "model": context.model,
            "processing_class": context.tokenizer,
            "optimizer": context.optimizer,
            "lr_scheduler": context.lr_scheduler,
            "train_dataloader": None,
            "eval_dataloader": None,
        }
        if self.state is None:  # the run's first TrainerCallback makes the shared args, state, control
            self.shared["args"] = training_arguments(cfg, context.run_dir, device=context.device)
            self.shared["state"] = trainer_state(
                context.start_step,
                cfg.train.steps,
                self._epoch_at(context.start_step),
                logging_steps=1,
                eval_steps=cfg.eval.every or 0,
                save_steps=cfg.train.checkpoint_every or 0,
                train_batch_size=cfg.rollout.batch_size,
                num_train_epochs=math.ceil(self._epoch_at(cfg.train.steps)),
            )
            for row in context.history:  # a resumed run's earlier steps, as TRL's log_history keeps them
                step = int(row.get("step", 0))
                self.state.log_history.append({**trl_logs(row, self._epoch_at(step + 1)), "step": step + 1})
            self.control = TrainerControl()
        self._event("on_init_end")
        self._event("on_train_begin")
        self._event("on_epoch_begin")
        self._after_events()

    def on_step_begin(self, step: int) -> None:
        self._event("on_step_begin")
        self._after_events()

    def on_step_end(self, step: int, metrics: dict) -> None:
        before = self._epoch_at(step)
        self.state.global_step = step + 1
        self.state.epoch = self._epoch_at(step + 1)
        self._event("on_step_end")
        logs = trl_logs(metrics, self.state.epoch)
        history = self.state.log_history
        if not history or history[-1].get("step") != step + 1:  # once per step for the shared state
            history.append({**logs, "step": step + 1})  # before on_log, as transformers
        self._event("on_log", logs=logs)
        if math.floor(self.state.epoch) > math.floor(before) and step + 1 < self.state.max_steps:
            self._event("on_epoch_end")
            self._event("on_epoch_begin")
        self._after_events()

    def on_evaluate(self, step: int, row: dict) -> None:
        metrics = {
            k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        self._event("on_evaluate", metrics=metrics)
        self._after_events()

    def on_save(self, step: int, checkpoint: Path) -> None:
        self.control.should_save = False
        self._event("on_save")
        self._after_events()

    def on_train_end(self, run_dir: Path) -> None:
        if self.state is None:  # the run ended before it began (nothing to tell)
            return
        self._event("on_epoch_end")
        self._event("on_train_end")
