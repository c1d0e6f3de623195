"""The stages around the training loop: what a run holds while it runs (:class:`Session`), the
log of each step (:func:`log_step`: periodic evaluation, metrics, health alarms, samples and their
gold scores) and the end of a run (:func:`finish`: final evaluation, plots, the saved policy and
its card). The loop itself is :func:`tether.training.train`'s."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

from tether.core import distributed as D
from tether.judges.contract import checked_scores
from tether.models.loading import is_hub_id
from tether.models.sharding import full_state_dict, gathered, is_sharded
from tether.run.best import BestPolicy
from tether.run.card import write_model_card
from tether.run.checkpoint import save_policy
from tether.run.config import Config
from tether.run.console import say
from tether.run.evaluation import Evaluator, final_evaluation
from tether.run.files import read_json, write_error
from tether.run.lifecycle import check_reference
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
    """The ``tether.training.TRAINERS`` instance: ``step(step) -> dict``, ``last_experience``, state dicts."""
    evaluator: Evaluator
    monitor: HealthMonitor
    reporter: Reporter
    """The run's trackers and callbacks (:mod:`tether.run.reporting`)."""
    best: BestPolicy | None
    """eval.best_by's tracker, or None (eval.best_by=none)."""


def evaluates(c: Config, step: int) -> bool:
    """Whether ``step`` ends with a periodic held-out evaluation (eval.every)."""
    return bool(c.eval.every) and (step % c.eval.every == 0 or step == c.train.steps - 1)


def log_step(session: Session, bar, *, step: int, row: dict, rows: list[dict] | None) -> str | None:
    """Rank 0: periodic evaluation (and the best policy), metrics.jsonl, TensorBoard, health
    alarms, samples. Returns why to stop early (eval.patience), or None."""
    run, evaluator, monitor = session.run, session.evaluator, session.monitor
    c, w, show = run.config, run.writer, run.config.train.progress
    evaluated = evaluates(c, step)
    if evaluated:
        row.update(evaluator.periodic_row())
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
    if rows is not None:
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
    return early


def finish(session: Session, *, before, t_start: float, last: int) -> Path:
    run, monitor = session.run, session.monitor
    check_reference(run, f"after the last step ({last})")
    c, w, show = run.config, run.writer, run.config.train.progress
    with gathered(run.policy, run.reference):  # FSDP: whole weights while rank 0 evaluates alone
        if D.is_main():
            final_eval_and_plots(session, before)
    if c.train.save_model:
        # every process: a sharded policy's LM is gathered whole for rank 0 to save
        whole = (
            {"lm": full_state_dict(run.policy.lm), "value_head": full_state_dict(run.policy.value_head)}
            if is_sharded(run.policy)
            else None
        )
        if D.is_main():
            save_final_policy(run, whole)
    if monitor.fired:
        say(f"tether: {len(monitor.fired)} health warning(s), see {w.run_dir / 'warnings.jsonl'}", show)
    session.reporter.train_end(w.run_dir)
    say(f"tether: done in {time.perf_counter() - t_start:.0f} s; plots and metrics in {w.run_dir}", show)
    D.barrier()  # the other processes wait for rank 0's evaluation, so the run ends together
    return run.writer.run_dir


def save_final_policy(run: Run, whole: dict | None) -> None:
    """Rank 0: ``<run>/policy`` (an adapter names a Hub base by id and revision) and its model card."""
    c, w = run.config, run.writer
    base = (c.model.name, c.model.revision) if is_hub_id(c.model.name) else None
    save_policy(run.policy, run.tokenizer, w.run_dir / "policy", whole, base_model=base)
    card = w.run_dir / "policy" / "README.md"
    evaluated = (w.run_dir / "eval.json").exists()
    try:
        write_model_card(
            card.parent,
            run_dir=w.run_dir,
            config=c.to_dict(),
            history=w.history,
            evaluation=read_json(w.run_dir / "eval.json") if evaluated else None,
        )
    except OSError as e:
        raise write_error(card, e, "The policy is saved; its model card is not") from None


def final_eval_and_plots(session: Session, before) -> None:
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
    evals = (
        final_evaluation(
            run=run, evaluator=evaluator, monitor=monitor, before=before, best=best, reporter=session.reporter
        )
        if before
        else []
    )
    target = leash_kl(c)
    png = w.run_dir / "training.png"
    try:
        plot_training(
            w.history,
            png,
            kl_target=target,
            target_label=c.kl.controller_class.held or "target",
        )
        png = w.run_dir / "score_vs_kl.png"
        plot_score_vs_kl(w.history, png, evals)
    except OSError as e:
        raise write_error(png, e, "metrics.jsonl and eval.json are written; the plots are not") from None
