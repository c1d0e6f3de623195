"""The training driver: build a run, evaluate the reference, train, watch its health, evaluate, plot."""

from __future__ import annotations

import logging
import signal
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tether.core import distributed as D
from tether.judges.contract import Scorer, ScorerFailed, ScorerStopped
from tether.judges.scorers import builds_a_model, check_scorer_spec, make_scorer
from tether.models.sharding import gathered
from tether.models.turns import EnvFailed
from tether.run.announce import announce_start
from tether.run.best import BestPolicy
from tether.run.checkpoint import latest_checkpoint
from tether.run.config import Config, ConfigError
from tether.run.console import say
from tether.run.evaluation import Evaluator, fluency_judge, reference_eval, reference_periodic
from tether.run.files import resume_hint
from tether.run.lifecycle import (
    Unmeasured,
    raise_stopped_in_step,
    raise_unmeasured,
    resume_run,
    start_run,
    state_before_step,
    write_checkpoint,
)
from tether.run.lock import release as release_lock
from tether.run.metrics import flat_config, sample_rows
from tether.run.monitor import HealthMonitor, health_thresholds
from tether.run.passed import passed_objects
from tether.run.reporting import Reporter, ReportingError, check_callbacks
from tether.run.session import Session, StepLog, evaluates, finish, log_step
from tether.run.setup import Run, build_run, discard_failed_start
from tether.run.signals import Interrupted, install_signal_handlers
from tether.run.trainer_callbacks import RunContext
from tether.trainers.common import UnmeasuredUpdate
from tether.trainers.registry import TRAINERS as TRAINERS  # re-exported: the registry's own dict
from tether.trainers.registry import trainer_class

log = logging.getLogger(__name__)


def train(
    config: Config,
    scorer: Scorer | None = None,
    judge: Scorer | None = None,
    resume: bool = False,
    model=None,
    *,
    tokenizer=None,
    train_dataset=None,
    eval_dataset=None,
    callbacks=None,
    env=None,
    reward_funcs: Scorer | None = None,
    tools=None,
    environment_factory=None,
) -> Path:
    """Run ``config`` end to end (or continue it from its last checkpoint); returns the run directory.

    Under ``accelerate launch`` every process runs this; only rank 0 writes the run directory,
    evaluates and prints (docs/distributed.md).

    Writes into the run directory: ``config.yaml``, ``metrics.jsonl``, ``samples.jsonl``,
    ``eval.json`` (held-out proxy and gold scores of reference and final policy),
    ``warnings.jsonl`` (health alarms), ``training.png``, ``score_vs_kl.png``, ``checkpoints/``
    and ``policy/``.

    Objects may stand in for names (TRL's way): ``scorer`` (a callable, a sequence classifier, a
    ``(model, tokenizer)`` pair, or a list of them, weighted by ``reward.weights``: TRL's
    ``reward_funcs``, also taken by that name), ``model`` and ``tokenizer`` (instead of ``model.name``),
    ``train_dataset`` (a ``datasets.Dataset``, row dicts or prompts, instead of ``data.prompts``);
    see :func:`tether.run.setup.build_run`. ``env``: the multi-turn rollout's environment as a
    callable (``rollout.env``'s signature; TRL passes its tools as objects too), or set
    ``config.rollout.env`` to one; config.yaml records its name, and a resume asks for it again.
    ``tools``: TRL's ``tools=[...]``, Python functions the policy calls (``rollout.tools``,
    :mod:`tether.models.tools`), recorded and asked for again as ``env`` is;
    ``environment_factory``: TRL's, a class made once per rollout row (``reset(**row)``, its
    methods as tools, ``get_reward``; ``rollout.environment_factory``).
    ``eval_dataset`` (the same kinds as ``train_dataset``,
    or ``data.eval_prompts``) is the held-out set, instead of the hash share of the training
    prompts; a training prompt that is also in it is left out of training (said). ``callbacks``:
    objects with any of ``on_step_end(step, metrics)``, ``on_evaluate(step, row)``,
    ``on_alarm(alarm)``, ``on_train_end(run_dir)``, called on rank 0; a hook raising
    :class:`tether.run.reporting.StopTraining` stops the run after that step, checkpointed and
    resumable (:mod:`tether.run.reporting`).

    Raises:
        Interrupted: after Ctrl-C or SIGTERM, once a checkpoint is written.
        RuntimeError: on resume, the reference no longer matches its recorded fingerprint.
        TypeError: both ``scorer`` and ``reward_funcs`` are given.
    """
    t_start = time.perf_counter()
    if reward_funcs is not None:  # TRL's name for the reward (GRPOTrainer(reward_funcs=...))
        if scorer is not None:
            raise TypeError(
                "train() got both scorer=... and reward_funcs=..., two names of one argument; give one"
            )
        scorer = reward_funcs
    callbacks = check_callbacks(callbacks)
    config, scorer, env = passed_objects(
        config, scorer=scorer, env=env, tools=tools, environment_factory=environment_factory
    )  # objects for names
    # the config as the run starts it: rebuilt and checked whole, its defaults filled for this
    # train.algo and this data (a Python edit after load_config counts, config.yaml records it)
    config = config.for_run(
        data="(a train_dataset passed to train)" if train_dataset is not None else None,
        model=(getattr(model, "name_or_path", "") or "(a model object passed to train)")
        if model is not None
        else None,
    )
    c = config
    if c.train.hub_model_id:  # the upload at the end needs the network: said before any step
        from tether.run.publish import offline

        if offline():
            raise ConfigError(
                f"train.hub_model_id={c.train.hub_model_id}: HF_HUB_OFFLINE is set, so the policy could "
                "not be pushed when the run ends; unset it, or drop train.hub_model_id and push later "
                "with tether push RUN ORG/NAME"
            )
    # before anything loads: a train.algo with a row of defaults needs its class (and advantage)
    trainer_class(c.train.algo, samples=c.trainer.samples)
    evaluating = bool(c.eval.n_prompts or c.eval.every)
    wants_judge = judge is None and c.eval.judge != "none" and evaluating
    judges = {}
    if wants_judge:  # a bad judge spec fails here, in seconds; its fit (minutes) comes later
        check_scorer_spec(c.eval.judge, "eval.judge")
        if not builds_a_model(c.eval.judge):  # a module:function: built now, its columns checked
            judge = judges["eval.judge"] = make_scorer(c.eval.judge)
    elif judge is not None:
        judges["eval.judge"] = judge
    run = build_run(
        config,
        scorer,
        resume=resume,
        model=model,
        tokenizer=tokenizer,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        judges=judges,
        env=env,
    )
    try:
        if wants_judge and judge is None:  # after every check and the model load: no fit for a run
            judge = make_scorer(c.eval.judge)  # that cannot start
        return _train(run, judge, resume, t_start, scorer_given=scorer is not None, callbacks=callbacks)
    except BaseException:
        if not resume and D.is_main() and not run.writer.history:
            # nothing was trained: leave no half-made run that would block the same command
            discard_failed_start(run.writer.run_dir, run.run_dir_existed)
        raise
    finally:
        release_lock(run.writer.lock)  # the run folder is free for the next writer


def _train(
    run: Run,
    judge: Scorer | None,
    resume: bool,
    t_start: float,
    *,
    scorer_given: bool = False,
    callbacks: list | None = None,
) -> Path:
    c = run.config
    w, show = run.writer, c.train.progress
    trainer = trainer_class(c.train.algo, samples=c.trainer.samples)(run)
    evaluator = Evaluator(run, judge, fluency_judge(run))
    monitor = HealthMonitor(health_thresholds(c), w.run_dir / "warnings.jsonl")
    start = resume_run(run, trainer, monitor) if resume else start_run(run)
    best = (
        BestPolicy(
            run_dir=w.run_dir,
            policy=run.policy,
            best_by=c.eval.best_by,
            fluency_margin=c.eval.best_fluency_margin,
            distinct_share=c.eval.best_distinct_share,
            patience=c.eval.patience,
            history=w.history,
        )
        if c.eval.best_by != "none"
        else None
    )
    announce_start(
        run,
        resume=resume,
        start=start,
        has_judge=judge is not None,
        scorer_given=scorer_given,
        beta_in_reward_std=getattr(trainer, "beta_in_reward_std", False),
    )
    stop, previous_handlers = install_signal_handlers()
    reporter = Reporter(run.accelerator if D.is_main() else None, callbacks, stop)
    if D.is_main():
        reporter.start(
            report_to=c.train.report_to,
            project=c.train.project,
            run_name=c.train.run_name or w.run_dir.name,
            run_dir=w.run_dir,
            config=flat_config(c),
        )

    with gathered(run.policy, run.reference):  # FSDP: whole weights while rank 0 evaluates alone
        before = reference_eval(evaluator, w.run_dir, show) if D.is_main() else None
        if D.is_main():
            reference_periodic(evaluator, before, w.run_dir, resume)
    D.barrier()
    session = Session(
        run=run, trainer=trainer, evaluator=evaluator, monitor=monitor, reporter=reporter, best=best
    )
    # rank 0's callbacks begin; one that fails stops every process before the first step
    began: BaseException | None = None
    if D.is_main():
        try:
            reporter.train_begin(run_context(run, trainer, start))
        except ReportingError as e:
            began = e
    if D.all_reduce_max(torch.tensor([float(began is not None)]))[0].item() > 0:
        raise began or ReportingError("a callback failed in on_train_begin on rank 0")
    try:
        last, saved = _loop(session, start=start, stop=stop)
    except KeyboardInterrupt:  # a second signal (user code tells its own apart): stopped at once
        say(_stopped_at_once(run, stop, resume), show)
        raise Interrupted(str(w.run_dir)) from None
    finally:
        for sig, h in previous_handlers.items():
            signal.signal(sig, h)
    reporter.end_loop()
    return finish(session, before=before, t_start=t_start, last=last, saved=saved)


def run_context(run: Run, trainer, start: int) -> RunContext:
    """What the callbacks' ``on_train_begin(context)`` gets (:class:`RunContext`)."""
    c = run.config
    state = trainer.trainer_state  # epochs: passes over the training prompts (DPO: over its pairs)
    return RunContext(
        run_dir=run.writer.run_dir,
        config=c,
        model=run.policy.peft if run.policy.peft is not None else run.policy.lm,
        tokenizer=run.tokenizer,
        # the torch optimizer (under master weights: the one that steps the float32 masters)
        optimizer=getattr(trainer.optimizer, "optimizer", trainer.optimizer),
        lr_scheduler=getattr(trainer, "scheduler", None),
        start_step=start,
        history=list(run.writer.history),
        epoch_at=lambda step: float(state(step).epoch),
        device=next(run.policy.parameters()).device,
    )


def _stopped_at_once(run: Run, stop: list[str], resume: bool) -> str:
    """What tether says when a second signal (or a KeyboardInterrupt) ended the step at once."""
    w = run.writer
    what = f"a second {stop[0]}" if stop else "KeyboardInterrupt"
    if not resume and not w.history:  # train() removes the folder of a run that trained nothing
        return (
            f"tether: stopped at once by {what}; no step completed, so the run folder is removed (files "
            "tether did not write are kept)"
        )
    kept = latest_checkpoint(w.run_dir)
    return (
        f"tether: stopped at once by {what}: "
        + (f"the last checkpoint, {kept}, is kept; " if kept else "")
        + resume_hint(w.run_dir)
    )


def _loop(session: Session, *, start: int, stop: list[str]) -> tuple[int, int]:
    """Train from step ``start``; returns the last step run (earlier than the last of
    ``train.steps`` when eval.patience stopped it) and the step the newest checkpoint holds (-1:
    none)."""
    run, trainer = session.run, session.trainer
    c, w, show = run.config, run.writer, run.config.train.progress
    main = D.is_main()
    bar = tqdm(
        range(start, c.train.steps),
        desc=f"tether {c.train.algo}",
        disable=not (show and main),
        unit="step",
        initial=start,
        total=c.train.steps,
    )
    step = start - 1  # a resumed run that has no step left
    saved = start - 1  # the step the newest checkpoint holds: a resumed run's, or none (-1)
    for step in bar:
        if main:
            session.reporter.step_begin(step)
        before = state_before_step(run, trainer)
        unmeasured = None  # user code that failed after the step's update, in what measures it
        try:
            row = trainer.step(step)  # every process; the row holds the global metrics
        except UnmeasuredUpdate as e:  # DPO's probe: the update is done and kept
            row, unmeasured = e.row, Unmeasured(e.error, e.missing)
        except (
            ScorerStopped,
            ScorerFailed,
            EnvFailed,
        ) as e:  # user code ended the step: the one before is kept
            raise_stopped_in_step(run, trainer, step, before, e, saved=saved)
        except FloatingPointError as e:  # a non-finite gradient norm: name what sets its scale
            raise FloatingPointError(
                f"step {step}: {e}. The settings that scale the gradients: optim.lr={c.optim.lr:g}, "
                f"rollout.temperature={c.rollout.temperature:g}, "
                f"optim.max_grad_norm={c.optim.max_grad_norm}"
                + (
                    f", the text anchor's weight (anchor/coef, held to anchor.budget={c.anchor.budget:g} "
                    "nats per token: a budget far under the text's forward KL raises it without bound)"
                    if c.anchor.budget is not None
                    else ""
                )
                + "; lower optim.lr (or raise rollout.temperature), then "
                + resume_hint(w.run_dir).replace(
                    "continue with:", "continue (the last checkpoint is kept) with:"
                )
            ) from None
        sample_step = (
            (step % c.train.sample_every == 0 or step == c.train.steps - 1)
            and trainer.last_experience is not None
            and unmeasured is None
        )
        # the sample table holds the samples of every process
        rows = (
            [r for part in D.gather_objects(sample_rows(trainer.last_experience)) for r in part]
            if sample_step
            else None
        )
        # rank 0 evaluates alone; under FSDP on weights every process gathered (then goes on to
        # the all-reduce below and waits there). The reward or the environment failing in the
        # evaluation, or in the samples' gold judge, is returned: the step is done, so it is kept
        with (
            gathered(run.policy, run.reference)
            if evaluates(c, step) and unmeasured is None
            else nullcontext()
        ):
            logged = (
                log_step(session, bar, step=step, row=row, rows=rows, unmeasured=unmeasured)
                if main
                else StepLog(unmeasured=unmeasured)
            )
        if main and getattr(trainer, "kl_record", None) is not None:  # kl.attribution: where the KL went
            w.kl_tokens(trainer.kl_record)
        # every process asks: did any process get a signal, or rank 0's evaluation say stop, or
        # did user code fail after the update? (so that all stop after the same step)
        # (and did a callback ask for a checkpoint)
        stopping, stop_early, failed, asked = (
            bool(x)
            for x in D.all_reduce_max(
                torch.tensor(
                    [
                        float(bool(stop)),
                        float(bool(logged.early)),
                        float(logged.unmeasured is not None),
                        float(logged.save),
                    ]
                )
            )
        )
        every = c.train.checkpoint_every
        # also after the last step, so that --resume with a larger train.steps extends the run
        if (
            stopping
            or failed
            or asked
            or (every and ((step + 1) % every == 0 or step + 1 == c.train.steps or stop_early))
        ):
            path = write_checkpoint(run, trainer, step)
            saved = step
            if main:
                session.reporter.saved(step, path)
            if failed:  # the step's update is kept, checkpointed; its row lacks what failed
                raise_unmeasured(run, logged.unmeasured, step, path)
            error = session.reporter.error
            if stopping and error is not None:  # a callback or tracker failed: trained steps kept
                raise type(error)(
                    f"{error}; the run stopped after step {step} with a checkpoint ({path}): fix it, "
                    f"then continue with: tether train --resume {w.run_dir} "
                    "(Python: train(config, resume=True))"
                ) from error.__cause__
            if stopping:
                say(
                    f"tether: stopped by {(stop or ['a signal to another process'])[0]} after step {step}; "
                    f"checkpoint {path}. Continue with: tether train --resume {w.run_dir}",
                    show,
                )
                raise Interrupted(str(w.run_dir))
        if stop_early:
            say(f"tether: stopping early after step {step}: {logged.early}", show)
            break
    bar.close()
    return step, saved
