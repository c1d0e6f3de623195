"""The stages around the training loop: what a run holds while it runs (:class:`Session`), the
log of each step (:func:`log_step`: periodic evaluation, metrics, health alarms, samples and their
gold scores) and the end of a run (:func:`finish`: final evaluation, plots, the saved policy and
its card). The loop itself is :func:`tether.training.train`'s."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import NamedTuple, NoReturn

import torch

from tether.core import distributed as D
from tether.judges.contract import checked_scores
from tether.models.loading import is_hub_id
from tether.models.sharding import full_state_dict, gathered, is_sharded
from tether.run.best import BestPolicy
from tether.run.card import write_model_card
from tether.run.checkpoint import latest_checkpoint, save_policy
from tether.run.config import Config
from tether.run.console import say
from tether.run.evaluation import Evaluator, final_evaluation
from tether.run.files import read_json, resume_hint, write_error
from tether.run.lifecycle import (
    USER_CODE_STOPS,
    Unmeasured,
    UserCodeStop,
    check_reference,
    raise_stopped,
    write_checkpoint,
)
from tether.run.metrics import sample_table
from tether.run.monitor import HealthMonitor, leash_kl
from tether.run.plots import plot_score_vs_kl, plot_training
from tether.run.reporting import Reporter
from tether.run.rngs import derived_seed, forked_rngs
from tether.run.setup import Run


@dataclasses.dataclass
class Session:
    """What a training run holds while it runs, handed whole to the driver's stages."""

    run: Run
    trainer: object
    """The :data:`tether.trainers.registry.TRAINERS` instance: ``step(step) -> dict``,
    ``last_experience``, state dicts."""
    evaluator: Evaluator
    monitor: HealthMonitor
    reporter: Reporter
    """The run's trackers and callbacks (:mod:`tether.run.reporting`)."""
    best: BestPolicy | None
    """eval.best_by's tracker, or None (eval.best_by=none)."""


def evaluates(c: Config, step: int) -> bool:
    """Whether ``step`` ends with a periodic held-out evaluation (eval.every)."""
    return bool(c.eval.every) and (step % c.eval.every == 0 or step == c.train.steps - 1)


class StepLog(NamedTuple):
    """What :func:`log_step` tells the loop."""

    early: str | None = None
    """Why to stop early (eval.patience), or None."""
    unmeasured: Unmeasured | None = None
    """User code that failed in what measures the step (the step is logged without it), or None."""
    save: bool = False
    """A callback asked for a checkpoint after this step (``control.should_save``), or asked the run
    to end (then the step is checkpointed too)."""


def log_step(
    session: Session,
    bar,
    *,
    step: int,
    row: dict,
    rows: list[dict] | None,
    unmeasured: Unmeasured | None = None,
) -> StepLog:
    """Rank 0: periodic evaluation (and the best policy), metrics.jsonl, TensorBoard, health
    alarms, samples. The step is done (its update applied) whatever its measurements do: when the
    reward or the environment fails in the periodic evaluation or in judging the samples, or
    failed in the trainer's own measurement (``unmeasured``: DPO's probe), the row is logged
    without what failed (and nothing after it measured), and the failure returned for the loop to
    checkpoint the step and stop."""
    run, evaluator, monitor = session.run, session.evaluator, session.monitor
    c, w, show = run.config, run.writer, run.config.train.progress
    evaluated = evaluates(c, step) and unmeasured is None
    if evaluated:
        try:
            row.update(evaluator.periodic_row())
        except USER_CODE_STOPS as e:
            evaluated, unmeasured = False, Unmeasured(e, "its periodic evaluation")
    w.log(row)
    early = session.best.consider(step, w.history[-1]) if evaluated and session.best is not None else None
    session.reporter.step_end(step, w.history[-1])  # every row to every tracker and callback
    bar.set_postfix(
        {
            k: f"{row[key]:.3f}"
            for k, key in (
                ("score", "objective/scores"),
                ("kl", "objective/kl"),
                ("beta", "objective/kl_coef"),
            )
            if key in row
        }
    )
    for alarm in monitor.check(w.history):
        say(
            f"tether: WARNING [{alarm.rule}] step {alarm.step}: {alarm.message}.\n"
            f"  likely cause: {alarm.cause}\n  fix: {alarm.fix}",
            show,
        )
        session.reporter.alarm(alarm)
    if rows is not None and unmeasured is None:
        try:
            log_samples(session, step, rows)
        except USER_CODE_STOPS as e:
            unmeasured = Unmeasured(e, "its samples (samples.jsonl)")
    ending = session.reporter.end_request()  # a TrainerCallback's control.should_training_stop
    early = early or ending
    return StepLog(early, unmeasured, save=bool(ending) or session.reporter.save_request())


def log_samples(session: Session, step: int, rows: list[dict]) -> None:
    """Rank 0: the step's samples, with their gold scores, to samples.jsonl, the trackers and the
    console."""
    run, evaluator = session.run, session.evaluator
    c, w, show = run.config, run.writer, run.config.train.progress
    ids = [r.pop("completion_ids") for r in rows]  # for the judge; samples.jsonl keeps the texts
    if "gold" in evaluator.scorers:
        names = list(rows[0].get("columns", {}))
        # generators of its own (a judge may draw from them): judging, or judging these steps
        # and not others (train.sample_every), changes no training sample
        with forked_rngs(derived_seed(c.eval.seed, "samples of step", step)):
            golds = checked_scores(
                evaluator.scorers["gold"],
                [r["response"] for r in rows],
                f"step {step} samples (gold judge)",
                [r["prompt"] for r in rows],
                {k: [r["columns"][k] for r in rows] for k in names},
                allow_none=True,  # None: the judge does not apply to that sample
                completion_ids=ids,
                state=evaluator.state,
                completions=[r["messages"] for r in rows] if "messages" in rows[0] else None,
                env_replies=[r["env"] for r in rows] if "env" in rows[0] else None,
            )
        for r, g in zip(rows, golds):
            r["gold"] = None if math.isnan(g) else float(g)
    w.samples(step, rows)
    session.reporter.samples(step, rows)
    say(f"\nstep {step}\n" + sample_table(rows[:4]), show)


class Ending(NamedTuple):
    """What rank 0's end of a run (:func:`final_eval_and_plots`) tells :func:`finish`."""

    failed: UserCodeStop | None = None
    """The reward's or the environment's failure in the final evaluation, or None."""
    best_step: int | None = None
    """The step whose policy eval.best_by put in place of the last one's, or None."""


def finish(session: Session, *, before, t_start: float, last: int, saved: int = -1) -> Path:
    """The end of a run: the final evaluation and the plots (rank 0), the saved policy and its
    card. When the reward or the environment fails in the final evaluation the trained policy is
    kept: checkpointed (unless a checkpoint holds the last step already, ``saved``), so that
    ``--resume`` runs the evaluation again, and saved to ``policy/`` (train.save_model), its card
    without held-out results; then the failure is raised, saying what was kept."""
    run, monitor = session.run, session.monitor
    check_reference(run, f"after the last step ({last})")
    c, w, show = run.config, run.writer, run.config.train.progress
    with gathered(run.policy, run.reference):  # FSDP: whole weights while rank 0 evaluates alone
        ended = final_eval_and_plots(session, before) if D.is_main() else Ending()
    # every process: did rank 0's final evaluation fail, with another step's policy in place?
    failed, moved = (
        bool(x)
        for x in D.all_reduce_max(
            torch.tensor([float(ended.failed is not None), float(ended.best_step is not None)])
        )
    )
    checkpoint = None
    if failed and not moved and saved < last:  # the policy is the last step's: --resume evaluates it
        checkpoint = write_checkpoint(run, session.trainer, last)
    elif failed and saved == last:
        checkpoint = latest_checkpoint(w.run_dir)
    if c.train.save_model:
        # every process: a sharded policy's LM is gathered whole for rank 0 to save
        whole = (
            {"lm": full_state_dict(run.policy.lm), "value_head": full_state_dict(run.policy.value_head)}
            if is_sharded(run.policy)
            else None
        )
        if D.is_main():
            save_final_policy(run, whole, evaluated=not failed)
    if failed:
        raise_unevaluated(run, ended, last, checkpoint)
    if monitor.fired:
        say(f"tether: {len(monitor.fired)} health warning(s), see {w.run_dir / 'warnings.jsonl'}", show)
    session.reporter.train_end(w.run_dir)
    if c.train.hub_model_id and D.is_main():  # after the callbacks' end: a failed upload ends nothing
        push_at_end(w.run_dir, c.train.hub_model_id, private=c.train.hub_private, show=show)
    say(f"tether: done in {time.perf_counter() - t_start:.0f} s; plots and metrics in {w.run_dir}", show)
    D.barrier()  # the other processes wait for rank 0's evaluation, so the run ends together
    return run.writer.run_dir


def push_at_end(run_dir: Path, repo_id: str, *, private: bool, show: bool) -> None:
    """train.hub_model_id: the saved policy and its card to the Hub (:func:`tether.run.publish.push`).

    Raises:
        RuntimeError: the upload failed; the run is whole, and the message says how to retry.
    """
    from tether.run.publish import push

    try:
        url = push(run_dir, repo_id, private=private)
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        raise RuntimeError(
            f"{e}. The run is complete and its policy saved; upload it again with: "
            f"tether push {run_dir} {repo_id}"
        ) from e
    say(f"tether: pushed the policy to {repo_id}: {url}", show)


def raise_unevaluated(run: Run, ended: Ending, last: int, checkpoint: Path | None) -> NoReturn:
    """Raise the final evaluation's failure (rank 0's, :class:`Ending`) with what was kept: the
    checkpoint of the last step (``--resume`` evaluates it again), or why there is none, and the
    saved policy. Collective: every process calls it."""
    ranks = D.gather_objects((ended, checkpoint))
    ended, checkpoint = next(e for e, _ in ranks if e.failed is not None), ranks[0][1]  # rank 0's
    c, run_dir = run.config, run.writer.run_dir
    kept = []
    if checkpoint is not None:
        kept.append(
            f"checkpoint {checkpoint} holds the run after step {last}: fix it, then "
            f"tether train --resume {run_dir} runs the final evaluation again"
        )
    else:
        kept.append(
            f"the last step's policy is not kept (train.checkpoint_every={c.train.checkpoint_every} wrote "
            f"no checkpoint of it, and eval.best_by had put step {ended.best_step}'s in its place, kept in "
            f"{run_dir / 'best'}); {resume_hint(run_dir)}"
        )
    if c.train.save_model:
        of = f" of step {ended.best_step} (eval.best_by)" if ended.best_step is not None else ""
        kept.append(
            f"the policy{of} is saved to {run_dir / 'policy'}, its model card without held-out results"
        )
    raise_stopped(
        run, ended.failed, f"in the final evaluation, after the last step ({last}); " + "; ".join(kept)
    )


def save_final_policy(run: Run, whole: dict | None, *, evaluated: bool = True) -> None:
    """Rank 0: ``<run>/policy`` (an adapter names a Hub base by id and revision) and its model
    card, with the final evaluation's results (eval.json) unless ``evaluated`` is False (it
    failed: an eval.json there is an earlier run's, before a resume extended it)."""
    c, w = run.config, run.writer
    base = (c.model.name, c.model.revision) if is_hub_id(c.model.name) else None
    save_policy(
        run.policy,
        run.tokenizer,
        w.run_dir / "policy",
        whole,
        base_model=base,
        value_head=c.trainer.value_head,
    )
    card = w.run_dir / "policy" / "README.md"
    evaluation = (
        read_json(w.run_dir / "eval.json") if evaluated and (w.run_dir / "eval.json").exists() else None
    )
    try:
        write_model_card(
            card.parent,
            run_dir=w.run_dir,
            config=c.to_dict(),
            history=w.history,
            evaluation=evaluation,
            no_evaluation=None
            if evaluated
            else "The final held-out evaluation failed (the reward or the environment raised), so this "
            "card has no held-out results; `tether train --resume RUN` runs it again.",
        )
    except OSError as e:
        raise write_error(card, e, "The policy is saved; its model card is not") from None


def final_eval_and_plots(session: Session, before) -> Ending:
    """Rank 0: the final evaluation (of eval.best_by's policy, which it loads, when another step's)
    and the plots; the reward's or the environment's failure in the evaluation is returned (the
    plots are drawn all the same)."""
    run, evaluator, monitor = session.run, session.evaluator, session.monitor
    c, w, show = run.config, run.writer, run.config.train.progress
    last_step = w.history[-1]["step"] if w.history else -1
    best = session.best.restore(last_step) if session.best is not None else None
    if best is not None and best["step"] != last_step:
        say(
            f"tether: ending with the policy of step {best['step']}, the best {best['metric']} "
            f"({best['score']:.3f}; eval.best_by={c.eval.best_by})",
            show,
        )
    failed = None
    try:
        evals = (
            final_evaluation(
                run=run,
                evaluator=evaluator,
                monitor=monitor,
                before=before,
                best=best,
                reporter=session.reporter,
            )
            if before
            else []
        )
    except USER_CODE_STOPS as e:  # the trained policy is kept (finish); the plots are drawn
        failed, evals = e, []
    target = leash_kl(c)
    png = w.run_dir / "training.png"
    try:
        plot_training(
            w.history,
            png,
            kl_target=target,
            target_label=c.kl.controller_class.held or "target",
            guard_ceiling=c.kl.budget * (1 + c.kl.guard_tol) if c.kl.guard else None,
            anchor_budget=c.anchor.budget,
        )
        png = w.run_dir / "score_vs_kl.png"
        plot_score_vs_kl(w.history, png, evals)
    except OSError as e:
        raise write_error(png, e, "metrics.jsonl and eval.json are written; the plots are not") from None
    return Ending(failed, best["step"] if best is not None and best["step"] != last_step else None)
