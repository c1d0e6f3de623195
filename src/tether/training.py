"""The training driver: build a run, evaluate the reference, train, watch its health, evaluate, plot."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from tether.core import distributed as D
from tether.core.health import Alarm, HealthThresholds
from tether.core.kl import masked_sum, sequence_kl
from tether.data.capability import capability_texts
from tether.data.tasks import TASKS
from tether.judges.contract import Scorer, ScorerStopped, checked_scores
from tether.judges.scorers import builds_a_model, check_scorer_spec, make_scorer
from tether.models.reference import fingerprint
from tether.models.sharding import full_state_dict, gathered, is_sharded, local_bytes
from tether.run.checkpoint import (
    SHARDED,
    best_folder,
    latest_checkpoint,
    load_checkpoint,
    load_policy_weights,
    load_sharded_state,
    policy_tensors,
    resume_checkpoint,
    rng_state,
    save_best,
    save_checkpoint,
    save_sharded_state,
    set_rng_state,
    sharded_folder,
)
from tether.run.config import Config
from tether.run.evaluation import CapabilityProbe, EvalResult, compare, evaluate, evaluation_state
from tether.run.files import (
    atomic_write_text,
    read_json,
    read_jsonl,
    resume_hint,
    write_error,
    write_json_file,
)
from tether.run.lock import release as release_lock
from tether.run.metrics import sample_table
from tether.run.monitor import HELDOUT_RULES, HealthMonitor
from tether.run.plots import plot_score_vs_kl, plot_training
from tether.run.setup import Run, build_run, discard_failed_start
from tether.run.signals import Interrupted, install_signal_handlers
from tether.trainers.dpo import DPOTrainer
from tether.trainers.group import GRPOTrainer, RLOOTrainer
from tether.trainers.ppo import PPOTrainer

log = logging.getLogger(__name__)

TRAINERS = {"ppo": PPOTrainer, "grpo": GRPOTrainer, "rloo": RLOOTrainer, "dpo": DPOTrainer}
"""``train.algo`` -> trainer class; each has ``step(step) -> dict`` and ``last_experience``."""


def _say(msg: str, progress: bool) -> None:
    if D.is_main():  # one voice for all processes
        (tqdm.write if progress else print)(msg)


class Evaluator:
    """Held-out evaluation with the proxy (training scorer), the gold judge and the fluency judge,
    the same samples for each; the reference's numbers on the periodic prompts are kept, so that
    every periodic row carries them (``eval/ref_*``) for the health rules and eval.best_by."""

    def __init__(self, run: Run, judge: Scorer | None, fluency=None):
        self.run, c = run, run.config
        self.scorers: dict[str, Scorer] = {"proxy": run.scorer}
        if judge is not None:
            self.scorers["gold"] = judge
        self.fluency = fluency
        # every judging call's trainer_state: the end of training (reference and policies alike)
        self.state = evaluation_state(
            c.train.steps, c.rollout.batch_size / (c.rollout.group_size or 1), len(run.train_prompts)
        )
        self.periodic = run.heldout_prompts[: c.eval.periodic_prompts]
        # eval.best_by chooses the policy on the periodic prompts: the final evaluation then uses
        # the held-out prompts after them, so the kept policy's numbers are not biased up by the
        # choice (the periodic set has the luck the choice selected for)
        start = len(self.periodic) if c.eval.best_by != "none" else 0
        left = len(run.heldout_prompts) - start
        if start and c.eval.n_prompts and left < c.eval.n_prompts and D.is_main():
            log.warning(
                "tether: warning: eval.best_by: %d held-out prompts after the %d periodic ones the best "
                "step is chosen on; %s (more data, or a larger data.heldout_fraction)",
                max(left, 0),
                start,
                f"the final evaluation has {left} of eval.n_prompts={c.eval.n_prompts}"
                if left > 0
                else "the final evaluation uses the periodic prompts too, so its numbers for the kept "
                "policy are biased up by the choice",
            )
        self.use_window(start if left > 0 else 0)
        self.reference_periodic: dict | None = None
        n = c.eval.capability_texts or 0
        reference = getattr(run, "reference", None)
        # the alignment tax: NLL of human text no run trains on, policy against reference
        self.capability = (
            CapabilityProbe(capability_texts(n), run.tokenizer, reference, c.eval.batch_size)
            if n and reference is not None and D.is_main()
            else None
        )

    def measure_capability(self) -> dict:
        """:meth:`CapabilityProbe.measure` of the policy now. The reference's per-sentence NLLs are
        kept in eval_reference_capability.json, so that a resumed run does not score (and count,
        ``kl/reference_forwards``) the reference again."""
        probe, path = self.capability, self.run.writer.run_dir / "eval_reference_capability.json"
        if probe.ref_nll is None and path.exists():
            saved = read_json(path)
            if saved.get("texts") == len(probe.prefixes):
                probe.ref_nll = saved["nll"]
        fresh = probe.ref_nll is None
        m = probe.measure(self.run.policy.lm)
        if fresh:
            write_json_file(path, {"texts": len(probe.prefixes), "nll": probe.ref_nll})
        return m

    def capability_row(self) -> dict:
        """``eval/capability_nll``, ``eval/ref_capability_nll`` and
        ``eval/capability_nll_change_se`` of the policy now ({} when eval.capability_texts=0)."""
        if self.capability is None:
            return {}
        m = self.measure_capability()
        return {
            "eval/capability_nll": m["capability_nll"],
            "eval/ref_capability_nll": m["ref_capability_nll"],
            "eval/capability_nll_change_se": m["capability_nll_change_se"],
        }

    def use_window(self, start: int) -> None:
        """Take the final evaluation's eval.n_prompts held-out prompts from index ``start``."""
        self.start = start
        self.heldout = self.run.heldout_prompts[start : start + self.run.config.eval.n_prompts]

    def __call__(self, name: str, prompts: list[str]):
        c, run = self.run.config, self.run
        return evaluate(
            name,
            run.policy.lm,
            run.reference,
            run.tokenizer,
            prompts,
            self.scorers,
            c.rollout.max_new_tokens,
            c.rollout.temperature,
            c.eval.seed,
            c.eval.batch_size,
            c.rollout.max_prompt_tokens,
            c.eval.samples_per_prompt,
            self.fluency,
            c.eval.fluency_samples,
            state=self.state,
        )

    def set_reference(self, before: EvalResult | None) -> None:
        """The reference's summary on the periodic prompts: the first of its full held-out
        evaluation's (the same seeds give the same samples), or evaluated now when the periodic
        set is the larger. Call before training moves the policy."""
        if not self.run.config.eval.every or not self.periodic:
            return
        if self.covers_periodic(before):
            self.reference_periodic = before.head(len(self.periodic)).summary()
        else:
            self.reference_periodic = self("reference", self.periodic).summary()

    def covers_periodic(self, before: EvalResult | None) -> bool:
        """Whether the reference's full evaluation holds every sample of the periodic prompts (it
        starts with them unless eval.best_by moved the final evaluation past them)."""
        return (
            before is not None
            and self.start == 0
            and len(before.responses) >= len(self.periodic) * before.samples_per_prompt
        )

    def periodic_row(self) -> dict:
        return (
            eval_row(self("periodic", self.periodic).summary(), self.reference_periodic)
            | self.capability_row()
        )


PERIODIC_KEYS = {
    "proxy_score": "proxy_mean",
    "gold_score": "gold_mean",
    "fluency_nll": "fluency_nll_mean",
    "fluency_nll_se": "fluency_nll_se",
    "distinct_1": "distinct_1",
    "distinct_2": "distinct_2",
    "distinct_2_se": "distinct_2_se",
    "self_bleu": "self_bleu",
    "repetition": "repetition",
    "repetition_se": "repetition_se",
}
"""Metric name after ``eval/`` (or ``eval/ref_``) -> key of :meth:`EvalResult.summary`."""


def periodic_numbers(summary: dict, prefix: str) -> dict:
    """The periodic evaluation's metrics from an evaluation summary, names prefixed."""
    return {prefix + name: summary[key] for name, key in PERIODIC_KEYS.items() if key in summary}


def eval_row(policy: dict, reference: dict | None) -> dict:
    """The ``eval/*`` metrics of a policy's evaluation summary (:meth:`EvalResult.summary`) beside
    the reference's on the same prompts (``eval/ref_*``), NaN dropped (no reference, no self-BLEU):
    a periodic row, or the final evaluation's row for :data:`tether.run.monitor.HELDOUT_RULES`."""
    row = {"eval/kl": policy["kl"], **periodic_numbers(policy, "eval/")}
    if reference is not None:
        row.update(periodic_numbers(reference, "eval/ref_"))
    return {k: v for k, v in row.items() if v == v}


def train(
    config: Config,
    scorer: Scorer | None = None,
    judge: Scorer | None = None,
    resume: bool = False,
    model=None,
    tokenizer=None,
    train_dataset=None,
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
    ``reward_funcs``), ``model`` and ``tokenizer`` (instead of ``model.name``),
    ``train_dataset`` (a ``datasets.Dataset``, row dicts or prompts, instead of ``data.prompts``);
    see :func:`tether.run.setup.build_run`.

    Raises:
        Interrupted: after Ctrl-C or SIGTERM, once a checkpoint is written.
        RuntimeError: on resume, the reference no longer matches its recorded fingerprint.
    """
    t_start = time.perf_counter()
    spec = config.reward.scorer
    if scorer is None and (callable(spec) or (isinstance(spec, list) and any(callable(x) for x in spec))):
        # a TRL user's reward_funcs put in the config: the objects are the scorer, and config.yaml
        # names them (python_scorer_spec)
        scorer, config = spec, copy.deepcopy(config)
        config.reward.scorer = None
    # the config as the run starts it: rebuilt and checked whole, its defaults filled for this
    # train.algo and this data (a Python edit after load_config counts, config.yaml records it)
    config = config.for_run(
        data="(a train_dataset passed to train)" if train_dataset is not None else None,
        model=(getattr(model, "name_or_path", "") or "(a model object passed to train)")
        if model is not None
        else None,
    )
    c = config
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
        judges=judges,
    )
    try:
        if wants_judge and judge is None:  # after every check and the model load: no fit for a run
            judge = make_scorer(c.eval.judge)  # that cannot start
        return _train(run, judge, resume, t_start, scorer_given=scorer is not None)
    except BaseException:
        if not resume and D.is_main() and not run.writer.history:
            # nothing was trained: leave no half-made run that would block the same command
            discard_failed_start(run.writer.run_dir, run.run_dir_existed)
        raise
    finally:
        release_lock(run.writer.lock)  # the run folder is free for the next writer


def _train(run: Run, judge: Scorer | None, resume: bool, t_start: float, scorer_given: bool = False) -> Path:
    c = run.config
    w, show = run.writer, c.train.progress
    trainer = TRAINERS[c.train.algo](run)
    evaluator = Evaluator(run, judge, _fluency_judge(run))
    monitor = HealthMonitor(_health_thresholds(c), w.run_dir / "warnings.jsonl")
    start = _resume(run, trainer, monitor) if resume else _start(run)
    weight = next(run.policy.lm.parameters())
    _say(
        f"tether: run directory {w.run_dir}"
        + (f", resuming after step {start - 1}" if resume else "")
        + f"; {weight.device.type} weights in {str(weight.dtype).removeprefix('torch.')}"
        + (f"; {D.world_size()} processes (data parallel)" if D.is_distributed() else ""),
        show,
    )
    if is_sharded(run.policy):
        held, ref = local_bytes(run.policy), local_bytes(run.reference) if run.reference else None
        _say(
            f"tether: policy{' and reference' if ref else ''} sharded (FSDP) over {D.world_size()} "
            "processes: rank 0 holds "
            f"{held['params'] / 2**20:.1f} MiB of the policy's {held['numel'] * 4 / 2**20:.1f} MiB of "
            "float32 weights (and the same share of the trained ones' gradients and AdamW moments)"
            + (f", {ref['params'] / 2**20:.1f} MiB of the reference's" if ref else ""),
            show,
        )
    _say(f"tether: {len(run.train_prompts)} training prompts, {len(run.heldout_prompts)} held out", show)
    for line in task_defaults_lines(
        c, has_judge=judge is not None, scorer_given=scorer_given, n_heldout=len(run.heldout_prompts)
    ):
        _say(line, show)
    if c.model.layers_to_train is not None:
        trained = sum(p.numel() for p in run.policy.lm.parameters() if p.requires_grad)
        total = sum(p.numel() for p in run.policy.lm.parameters())
        _say(
            f"tether: training the last {c.model.layers_to_train} transformer blocks "
            f"({trained / 1e6:.1f}M of {total / 1e6:.1f}M weights; model.trainable_layers=all "
            "trains every one)",
            show,
        )
    if getattr(trainer, "beta_in_reward_std", False):
        _say(
            f"tether: note: GRPO divides the advantages by each group's reward std but not the KL term "
            f"(grpo.scale_by_std=true, KL in the loss), so kl.kl_coef={c.kl.kl_coef:g} counts in group "
            "reward standard deviations, not reward units per nat (objective/kl_coef_effective logs beta "
            "x the mean group std). For beta in reward units: grpo.scale_kl_by_std=true, "
            "grpo.scale_by_std=false or kl.kl_in_reward=true",
            show,
        )
    if resume and start >= c.train.steps:
        _say(
            f"tether: the run already has its train.steps={c.train.steps} steps (raise train.steps to train "
            "on); evaluating its policy again",
            show,
        )
    if not run.heldout_prompts and (c.eval.n_prompts or c.eval.every):
        _say(
            f"tether: warning: no held-out prompts (data.heldout_fraction={c.data.heldout_fraction:g} "
            f"of {len(run.train_prompts)} prompts picked none), so no held-out evaluation, gold score "
            "or eval.json; "
            "raise data.heldout_fraction or add prompts",
            show,
        )
    tb = _tensorboard(w.run_dir) if c.train.tensorboard else None
    if run.accelerator is not None and run.accelerator.log_with:  # train.report_to
        run.accelerator.project_configuration.set_directories(str(w.run_dir))
        run.accelerator.init_trackers("tether", config=flat_config(c))

    with gathered(run.policy, run.reference):  # FSDP: whole weights while rank 0 evaluates alone
        before = _reference_eval(evaluator, w.run_dir, show) if D.is_main() else None
        if D.is_main():
            _reference_periodic(evaluator, before, w.run_dir, resume)
    D.barrier()
    stop, previous_handlers = install_signal_handlers()
    try:
        last = _loop(run, trainer, evaluator, monitor, tb, start, stop)
    finally:
        for sig, h in previous_handlers.items():
            signal.signal(sig, h)
    return _finish(run, evaluator, monitor, tb, before, t_start, last)


def _loop(
    run: Run, trainer, evaluator: Evaluator, monitor: HealthMonitor, tb, start: int, stop: list[str]
) -> int:
    """Train from step ``start``; returns the last step run (earlier than the last of
    ``train.steps`` when eval.patience stopped it)."""
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
    for step in bar:
        before = _before_step(run, trainer)
        try:
            row = trainer.step(step)  # every process; the row holds the global metrics
        except ScorerStopped as e:
            _stopped_in_step(run, trainer, step, before, e)
        except FloatingPointError as e:  # a non-finite gradient norm: name what sets its scale
            raise FloatingPointError(
                f"step {step}: {e}. The settings that scale the gradients: optim.lr={c.optim.lr:g}, "
                f"rollout.temperature={c.rollout.temperature:g}, "
                f"optim.max_grad_norm={c.optim.max_grad_norm}; "
                "lower optim.lr (or raise rollout.temperature), then "
                + resume_hint(w.run_dir).replace(
                    "continue with:", "continue (the last checkpoint is kept) with:"
                )
            ) from None
        sample_step = (
            step % c.train.sample_every == 0 or step == c.train.steps - 1
        ) and trainer.last_experience is not None
        # the sample table holds the samples of every process
        rows = (
            [r for part in D.gather_objects(sample_rows(trainer.last_experience)) for r in part]
            if sample_step
            else None
        )
        # rank 0 evaluates alone; under FSDP on weights every process gathered (then goes on to
        # the all-reduce below and waits there)
        with gathered(run.policy, run.reference) if _evaluates(c, step) else nullcontext():
            try:
                early = _log_step(run, evaluator, monitor, tb, bar, step, row, rows) if main else None
            except ScorerStopped as e:  # in the periodic evaluation: the step's row is not logged
                raise ScorerStopped(
                    f"{e} (in the evaluation after step {step}; {resume_hint(w.run_dir)})"
                ) from None
        # every process asks: did any process get a signal, or rank 0's evaluation say stop?
        # (so that all stop after the same step)
        stopping, stop_early = (
            bool(x) for x in D.all_reduce_max(torch.tensor([float(bool(stop)), float(bool(early))]))
        )
        every = c.train.checkpoint_every
        # also after the last step, so that --resume with a larger train.steps extends the run
        if stopping or (every and ((step + 1) % every == 0 or step + 1 == c.train.steps or stop_early)):
            path = _checkpoint(run, trainer, step)
            if stopping:
                _say(
                    f"tether: stopped by {(stop or ['a signal to another process'])[0]} after step {step}; "
                    f"checkpoint {path}. Continue with: tether train --resume {w.run_dir}",
                    show,
                )
                raise Interrupted(str(w.run_dir))
        if stop_early:
            _say(f"tether: stopping early after step {step}: {early}", show)
            break
    bar.close()
    return step


def _before_step(run: Run, trainer) -> dict | None:
    """What an on-policy step moves before it scores (the prompt sampler; the RNGs, which a scorer
    may draw from): copied, so that a scorer that ends the step (:class:`ScorerStopped`) leaves a
    checkpoint of the step before, exactly as it was. None for DPO, whose probe scores after the
    update."""
    if not hasattr(trainer, "sampler"):
        return None
    return {
        "sampler": trainer.sampler.state_dict(),
        "generator": trainer.generator.get_state(),
        "rng": rng_state(),
        "reference_forwards": run.reference_forwards[0],
    }


def _stopped_in_step(run: Run, trainer, step: int, before: dict | None, e: ScorerStopped):
    """A scorer raised SystemExit or KeyboardInterrupt inside step ``step``: an on-policy step
    scores before it updates, so the policy and the optimizer are those after step ``step - 1``;
    with the sampler and RNGs put back as they were, that checkpoint is written (a resume then
    runs step ``step`` as an uninterrupted run would). Raises the error with what was kept."""
    w = run.writer
    if before is not None and step > 0:
        trainer.sampler.load_state_dict(before["sampler"])
        trainer.generator.set_state(before["generator"])
        set_rng_state(before["rng"])
        run.reference_forwards[0] = before["reference_forwards"]
        path = _checkpoint(run, trainer, step - 1)
        raise ScorerStopped(
            f"{e} (checkpoint {path} holds the run after step {step - 1}; {resume_hint(w.run_dir)})"
        ) from None
    if step == 0 and not w.history:  # a fresh run's first step: train() removes the folder
        raise ScorerStopped(
            f"{e} (no step completed, so the run folder is removed: start the run again)"
        ) from None
    kept = latest_checkpoint(w.run_dir)
    raise ScorerStopped(
        f"{e} ({f'the last checkpoint, {kept}, is kept; ' if kept else ''}{resume_hint(w.run_dir)})"
    ) from None


def _evaluates(c: Config, step: int) -> bool:
    """Whether ``step`` ends with a periodic held-out evaluation (eval.every)."""
    return bool(c.eval.every) and (step % c.eval.every == 0 or step == c.train.steps - 1)


def _log_step(
    run: Run,
    evaluator: Evaluator,
    monitor: HealthMonitor,
    tb,
    bar,
    step: int,
    row: dict,
    rows: list[dict] | None,
) -> str | None:
    """Rank 0: periodic evaluation (and the best policy), metrics.jsonl, TensorBoard, health
    alarms, samples. Returns why to stop early (eval.patience), or None."""
    c, w, show = run.config, run.writer, run.config.train.progress
    evaluated = _evaluates(c, step)
    if evaluated:
        row.update(evaluator.periodic_row())
    w.log(row)
    early = _keep_best(run, step) if evaluated and c.eval.best_by != "none" else None
    if tb is not None:
        for k, v in w.history[-1].items():
            if isinstance(v, (int, float)) and k != "step":
                tb.add_scalar(k, v, step)
    if run.accelerator is not None and run.accelerator.log_with:  # every row to every tracker
        numbers = {k: v for k, v in w.history[-1].items() if isinstance(v, (int, float)) and k != "step"}
        run.accelerator.log(numbers, step=step)
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
        _say(
            f"tether: WARNING [{alarm.rule}] step {alarm.step}: {alarm.message}.\n"
            f"  likely cause: {alarm.cause}\n  fix: {alarm.fix}",
            show,
        )
    if rows is not None:
        ids = [r.pop("completion_ids") for r in rows]  # for the judge; samples.jsonl keeps the texts
        if "gold" in evaluator.scorers:
            names = list(rows[0].get("columns", {}))
            golds = checked_scores(
                evaluator.scorers["gold"],
                [r["response"] for r in rows],
                f"step {step} samples (gold judge)",
                [r["prompt"] for r in rows],
                {k: [r["columns"][k] for r in rows] for k in names},
                completion_ids=ids,
                state=evaluator.state,
            )
            for r, g in zip(rows, golds):
                r["gold"] = float(g)
        w.samples(step, rows)
        _log_sample_table(run, step, rows)
        _say(f"\nstep {step}\n" + sample_table(rows[:4]), show)
    return early


BEST_KEYS = {"gold": "eval/gold_score", "proxy": "eval/proxy_score"}
"""``eval.best_by`` -> the periodic evaluation's metric it maximizes."""


def qualifies(row: dict, fluency_margin: float | None, distinct_share: float | None) -> bool:
    """Whether a periodic evaluation's row meets eval.best_by's conditions: its fluency NLL at most
    ``fluency_margin`` nats per token above the reference's, its distinct-2 at least
    ``distinct_share`` of the reference's (a condition whose numbers the row lacks fails)."""
    if fluency_margin is not None:
        nll, ref = row.get("eval/fluency_nll"), row.get("eval/ref_fluency_nll")
        if not (
            isinstance(nll, (int, float)) and isinstance(ref, (int, float)) and nll - ref <= fluency_margin
        ):
            return False
    if distinct_share is not None:
        d, ref = row.get("eval/distinct_2"), row.get("eval/ref_distinct_2")
        if not (isinstance(d, (int, float)) and isinstance(ref, (int, float)) and d >= distinct_share * ref):
            return False
    return True


def _keep_best(run: Run, step: int) -> str | None:
    """After a periodic evaluation: save the policy to <run>/best if its score beats every earlier
    one, those in the history and the one <run>/best holds (which may come from steps a resumed
    run discarded: <run>/best always holds the best policy the run has produced); return why to
    stop when eval.patience evaluations in a row brought no new best. With
    eval.best_fluency_margin or eval.best_distinct_share, only evaluations that meet them count
    (the seeds' "peak of held-out quality": a gold score bought with broken text is no peak)."""
    c, w = run.config, run.writer
    key = BEST_KEYS[c.eval.best_by]
    cond = (c.eval.best_fluency_margin, c.eval.best_distinct_share)
    evals = [
        (r["step"], r[key] if qualifies(r, *cond) else -math.inf, r.get("eval/kl"))
        for r in w.history
        if isinstance(r.get(key), (int, float))
    ]
    if not evals or evals[-1][0] != step:
        return None
    saved = _best_meta(run)
    prior = [(s, v) for s, v, _ in evals[:-1]] + ([(saved["step"], saved["score"])] if saved else [])
    best_step, best_score = max(prior, key=lambda sv: sv[1]) if prior else (None, -math.inf)
    if best_score == -math.inf:
        best_step = None  # nothing has qualified yet
    if evals[-1][1] > best_score:
        save_best(
            w.run_dir, run.policy, {"step": step, "metric": key, "score": evals[-1][1], "kl": evals[-1][2]}
        )
        return None
    since = sum(s > best_step for s, _, _ in evals) if best_step is not None else len(evals)
    if c.eval.patience and since >= c.eval.patience:
        return (
            f"{key} has not improved on step {best_step}'s {best_score:.3f} in {since} "
            f"evaluations (eval.patience={c.eval.patience})"
            if best_step is not None
            else f"no evaluation met eval.best_by's conditions in {since} evaluations "
            f"(eval.patience={c.eval.patience})"
        )
    return None


def _best_meta(run: Run) -> dict | None:
    """<run>/best's meta.json when it holds a policy chosen by this run's eval.best_by, else None."""
    folder = best_folder(run.writer.run_dir)
    if folder is None:
        return None
    meta = read_json(folder / "meta.json")
    return meta if meta.get("metric") == BEST_KEYS[run.config.eval.best_by] else None


def _finish(
    run: Run, evaluator: Evaluator, monitor: HealthMonitor, tb, before, t_start: float, last: int
) -> Path:
    _check_reference(run, f"after the last step ({last})")
    c, w, show = run.config, run.writer, run.config.train.progress
    with gathered(run.policy, run.reference):  # FSDP: whole weights while rank 0 evaluates alone
        if D.is_main():
            _final_eval_and_plots(run, evaluator, monitor, tb, before)
    if c.train.save_model:
        # every process: a sharded policy's LM is gathered whole for rank 0 to save
        whole = (
            {"lm": full_state_dict(run.policy.lm), "value_head": full_state_dict(run.policy.value_head)}
            if is_sharded(run.policy)
            else None
        )
        if D.is_main():
            save_policy(run.policy, run.tokenizer, w.run_dir / "policy", whole)
    if monitor.fired:
        _say(f"tether: {len(monitor.fired)} health warning(s), see {w.run_dir / 'warnings.jsonl'}", show)
    _say(f"tether: done in {time.perf_counter() - t_start:.0f} s; plots and metrics in {w.run_dir}", show)
    D.barrier()  # the other processes wait for rank 0's evaluation, so the run ends together
    return run.writer.run_dir


def _leash_kl(c) -> float | None:
    """The KL (nats per sequence) the run's controller holds: kl.budget or kl.target of a budget
    or adaptive controller with kl.target_unit=nats_per_sequence; None otherwise (and for DPO)."""
    if c.kl.target_unit != "nats_per_sequence" or c.train.algo == "dpo":
        return None
    return {"budget": c.kl.budget, "adaptive": c.kl.target}.get(c.kl.controller)


def _health_thresholds(c) -> HealthThresholds:
    """``c.health`` with ``kl_leash`` set from the leash (:func:`_leash_kl`) when left unset."""
    limit = _leash_kl(c)
    if c.health.kl_leash is not None or limit is None:
        return c.health
    return dataclasses.replace(c.health, kl_leash=limit)


def _final_eval_and_plots(run: Run, evaluator: Evaluator, monitor: HealthMonitor, tb, before) -> None:
    c, w, show = run.config, run.writer, run.config.train.progress
    best = _restore_best(run) if c.eval.best_by != "none" else None
    evals = []
    if before:
        after = evaluator("policy", evaluator.heldout)
        result = compare(before, after)  # holds both summaries: computed once, here
        result["policy_step"] = best["step"] if best else w.history[-1]["step"]
        result["prompt_offset"] = evaluator.start  # index of its first held-out prompt
        if evaluator.capability is not None:
            result |= evaluator.measure_capability() | {"capability_texts": c.eval.capability_texts}
        w.write_json("eval.json", result)
        evals = [result["reference"], result["policy"]]
        gold = (
            f"; gold {result['gold_gain']:+.3f} ± {result['gold_gain_se_paired']:.3f}"
            if "gold_gain" in result
            else ""
        )
        _say(
            f"tether: held-out proxy score {result['reference']['proxy_mean']:.3f} -> "
            f"{result['policy']['proxy_mean']:.3f} (gain {result['gain']:+.3f} ± "
            f"{result['gain_se_paired']:.3f} SE, z = {_z(result['gain_z_paired'])}){gold}; "
            + (
                f"held-out KL {after.kl:.2f} nats/seq"
                if after.kl == after.kl
                else "held-out KL not measured (no reference model: kl.kl_coef=0 and kl.monitor=false)"
            ),
            show,
        )
        _say(_leash_line(result), show)
        if "capability_nll" in result:
            _say(
                f"tether: capability (NLL of {result['capability_texts']} human sentences no run trains on, "
                f"NYT editorials): {result['ref_capability_nll']:.3f} -> {result['capability_nll']:.3f} "
                f"nats/token ({result['capability_nll_change']:+.3f} ± "
                f"{result['capability_nll_change_se']:.3f}); "
                f"{result['capability_seconds']:.1f} s per evaluation (eval.capability_texts=0 turns it off)",
                show,
            )
        final_row = {"step": result["policy_step"], **eval_row(result["policy"], result["reference"])}
        if "capability_nll" in result:
            final_row |= {
                "eval/capability_nll": result["capability_nll"],
                "eval/ref_capability_nll": result["ref_capability_nll"],
                "eval/capability_nll_change_se": result["capability_nll_change_se"],
            }
        for alarm in monitor.check([*w.history, final_row], HELDOUT_RULES):
            _say(
                f"tether: WARNING [{alarm.rule}] final held-out evaluation (policy of step {alarm.step}): "
                f"{alarm.message}.\n  likely cause: {alarm.cause}\n  fix: {alarm.fix}",
                show,
            )

    target = _leash_kl(c)
    png = w.run_dir / "training.png"
    try:
        plot_training(
            w.history,
            png,
            kl_target=target,
            target_label="budget" if c.kl.controller == "budget" else "target",
        )
        png = w.run_dir / "score_vs_kl.png"
        plot_score_vs_kl(w.history, png, evals)
    except OSError as e:
        raise write_error(png, e, "metrics.jsonl and eval.json are written; the plots are not") from None
    if tb is not None:
        tb.close()
    if run.accelerator is not None and run.accelerator.log_with:
        run.accelerator.end_training()


SMALL_HELDOUT = 8
"""Fewer held-out prompts than this: a warning that the held-out standard errors are rough."""


def task_defaults_lines(
    c: Config, has_judge: bool, scorer_given: bool = False, n_heldout: int | None = None
) -> list[str]:
    """What the run took as defaults that belong to the demo or to the data, said in its first
    lines: the reward when reward.scorer was left unset on data other than the demo's, and what
    scores the held-out evaluation (the run's own reward; the gold judge only when named)."""
    lines = []
    if (
        not c.embedded_data
        and c.data.prompts not in TASKS
        and c.reward._given("scorer") is None
        and not scorer_given
    ):
        uses = (
            "DPO's per-step probe and the held-out evaluation score with"
            if c.train.algo == "dpo" and c.dpo.pairs != "sampled"
            else "the run trains on"
        )
        lines.append(
            f"tether: note: reward.scorer is unset, so {uses} VADER sentiment, the demo's reward; name "
            "your own with reward.scorer=module:function (or hf:MODEL, a list of them)"
        )
    if c.data.prompts in TASKS and c.reward._given("scorer") is None and not scorer_given:
        lines.append(
            f"tether: data.prompts={c.data.prompts} trains on its checker, reward.scorer={c.reward.scorer} "
            "(1 when the response starts with the row's answer, else 0; tether.judges.verifiers)"
        )
    if c.eval.n_prompts or c.eval.every:
        if has_judge:
            gold = f"and the gold judge eval.judge={c.eval.judge}"
        elif c.eval.judge == "none" and c.eval._given("judge") is None:
            gold = (
                "alone: no gold judge (eval.judge=none, the default on data other than the demo's; name "
                "one with eval.judge=SCORER, e.g. minilm-rm, the demo's)"
            )
        else:
            gold = "alone (eval.judge=none)"
        lines.append(f"tether: the held-out evaluation scores with the run's reward (reward.scorer) {gold}")
        if c.eval.fluency_model != "none":
            lines.append(
                f"tether: the fluency judge is eval.fluency_model={c.eval.fluency_model} (its NLL of each "
                "held-out response; eval.fluency_model=none turns it off)"
            )
        held = n_heldout
        if held is not None and 0 < held < SMALL_HELDOUT:
            lines.append(
                f"tether: warning: only {held} held-out prompt(s): the held-out numbers' standard errors are "
                + ("undefined (nan) with one" if held == 1 else "rough")
                + " (raise data.heldout_fraction or add prompts)"
            )
    return lines


def _z(z: float | None) -> str:
    """A z-score for the log: one decimal, or ``n/a`` where its SE was 0 (None)."""
    return "n/a" if z is None else f"{z:.1f}"


def _leash_line(result: dict) -> str:
    """What the leash protects, reference -> policy on the held-out prompts, with SEs."""
    ref, pol = result["reference"], result["policy"]
    parts = []
    if "fluency_nll_change" in result:
        parts.append(
            f"fluency NLL {ref['fluency_nll_mean']:.2f} -> {pol['fluency_nll_mean']:.2f} nats/token "
            f"({result['fluency_nll_change']:+.2f} ± {result['fluency_nll_change_se']:.2f})"
        )
    for key, label in (
        ("distinct_2", "distinct-2"),
        ("self_bleu", "self-BLEU"),
        ("repetition", "repetition"),
    ):
        if f"{key}_change" in result:
            parts.append(
                f"{label} {ref[key]:.3f} -> {pol[key]:.3f} ({result[f'{key}_change']:+.3f} ± "
                f"{result[f'{key}_change_se']:.3f})"
            )
    return "tether: what the leash protects (held out): " + "; ".join(parts)


def _restore_best(run: Run) -> dict | None:
    """Load <run>/best into the policy if it is not the last step's; return its meta.json."""
    meta = _best_meta(run)
    if meta is None:
        return None
    if meta["step"] != run.writer.history[-1]["step"]:
        load_policy_weights(run.writer.run_dir / "best", run.policy)
        _say(
            f"tether: ending with the policy of step {meta['step']}, the best {meta['metric']} "
            f"({meta['score']:.3f}; eval.best_by={run.config.eval.best_by})",
            run.config.train.progress,
        )
    return meta


def _start(run: Run) -> int:
    if D.is_main():
        write_json_file(run.writer.run_dir / "reference.json", {"fingerprint": run.reference_fingerprint})
        write_json_file(run.writer.run_dir / "data.json", _data_record(run))
    return 0


def _data_record(run: Run) -> dict:
    """The run's prompts, fingerprinted (SHA-256 of the training and held-out prompts with their
    columns, in order): a resume must see the same ones (the checkpoint's prompt order and the
    held-out split index them)."""
    h = hashlib.sha256()
    for part in (run.train_prompts, run.heldout_prompts):
        h.update(json.dumps([part.prompts, part.columns], sort_keys=True, default=str).encode())
    return {
        "prompts_sha256": h.hexdigest(),
        "train": len(run.train_prompts),
        "heldout": len(run.heldout_prompts),
    }


def _check_data(run: Run) -> None:
    """Refuse a resume whose prompts differ from the run's (data.json; a run from before it has
    none and is not checked)."""
    path = run.writer.run_dir / "data.json"
    if not path.exists():
        return
    saved, now = read_json(path), _data_record(run)
    if saved.get("prompts_sha256") != now["prompts_sha256"]:
        raise RuntimeError(
            f"--resume {run.writer.run_dir}: the prompts differ from the run's "
            f"({saved.get('train')} training and {saved.get('heldout')} held-out prompts then, "
            f"{now['train']} and {now['heldout']} now, "
            f"SHA-256 {str(saved.get('prompts_sha256'))[:12]}... vs {now['prompts_sha256'][:12]}...): "
            f"data.prompts={run.config.data.prompts} was edited since, or train.seed changed the "
            "embedded prompts' prefixes. The checkpoint's prompt order and the held-out split index the "
            "run's prompts: restore the file (and train.seed), or start a new run"
        )


def _resume(run: Run, trainer, monitor: HealthMonitor) -> int:
    """Restore the newest checkpoint; check the rebuilt reference against its fingerprint."""
    w = run.writer
    # rank 0 checks every file's SHA-256 (falling back past a damaged newest checkpoint); all load
    # the folder it chose
    found, notes = resume_checkpoint(w.run_dir) if D.is_main() else (None, [])
    path = D.gather_objects(found)[0]
    for note in notes:
        _say(note, True)
    if path is None:
        raise FileNotFoundError(
            f"--resume {w.run_dir}: no complete checkpoint in {w.run_dir / 'checkpoints'}"
            + (
                " that verifies (each damaged one was moved aside to checkpoints/.damaged-step-N: rename "
                "one back to look at it, or start a new run)"
                if notes
                else ""
            )
        )
    _check_data(run)
    recorded = read_json(w.run_dir / "reference.json").get("fingerprint")
    if recorded != run.reference_fingerprint:
        raise RuntimeError(
            f"--resume {w.run_dir}: the reference rebuilt from {run.config.model.name} does not match "
            f"the fingerprint recorded when the run started ({recorded[:12]}... vs "
            f"{str(run.reference_fingerprint)[:12]}...): the reference would have moved"
        )
    meta, state = load_checkpoint(path, run.policy)
    if (path / SHARDED).exists():  # a sharded run's: weights and AdamW state resharded to this run's
        load_sharded_state(path / SHARDED, run.policy, trainer.optimizer.optimizer)
    # the resumed config's controller and optimizer settings apply from the next step (printed)
    trainer.load_state_dict(state["trainer"], next_step=meta["step"] + 1)
    set_rng_state(state["rng"])
    run.reference_forwards[0] = state["reference_forwards"]
    if not D.is_main():
        return meta["step"] + 1
    w.truncate_after(meta["step"])
    _record_resumed_config(run, meta["step"])
    monitor.fired = [Alarm(**a) for a in read_jsonl(w.run_dir / "warnings.jsonl")]
    return meta["step"] + 1


def _record_resumed_config(run: Run, step: int) -> None:
    """When ``--resume`` changed settings, config.yaml becomes the config the run goes on with (so
    a later plain ``--resume`` keeps them) and the one it had is kept as config.until-step-N.yaml."""
    path = run.writer.run_dir / "config.yaml"
    before = yaml.safe_load(path.read_text())
    now = run.config.to_dict(resolved=False)
    now["train"]["output_dir"] = before["train"]["output_dir"]  # --resume names the folder; not a change
    if now == before:
        return
    kept = path.with_name(f"config.until-step-{step}.yaml")
    atomic_write_text(kept, path.read_text())
    atomic_write_text(path, yaml.safe_dump(now, sort_keys=False))
    changed = [
        f"{sec}.{name}: {(before.get(sec) or {}).get(name)!r} -> {value!r}"
        for sec, fields in now.items()
        if isinstance(fields, dict)
        for name, value in fields.items()
        if (before.get(sec) or {}).get(name) != value
    ]
    _say(
        f"tether: resumed with {len(changed)} changed setting(s), from step {step + 1}: "
        f"{'; '.join(changed)}. "
        f"config.yaml now holds them; the run's earlier config is {kept.name}",
        run.config.train.progress,
    )


def _checkpoint(run: Run, trainer, step: int) -> Path:
    """Rank 0 writes the checkpoint (policy, optimizer and trainer state are the same on every
    process; under FSDP each process writes its shards of weights and AdamW state first). The
    reference is fingerprinted when the run starts, on resume and after the last step, not here:
    hashing copies every weight to the host (seconds for a 7B reference on a GPU)."""
    path = run.writer.run_dir / "checkpoints"
    sharded = sharded_folder(run.writer.run_dir, step) if is_sharded(run.policy) else None
    if sharded is not None:  # every process writes its own shards of weights and AdamW state
        if D.is_main():
            shutil.rmtree(sharded, ignore_errors=True)  # a killed attempt's
        D.barrier()
        save_sharded_state(sharded / SHARDED, run.policy, trainer.optimizer.optimizer)
        weights, trainer_state = None, trainer.state_dict(with_optimizer=False)
    else:
        weights, trainer_state = policy_tensors(run.policy), trainer.state_dict()
    if D.is_main():
        path = save_checkpoint(
            run.writer.run_dir,
            step,
            weights,
            {
                "trainer": trainer_state,
                "rng": rng_state(),
                "reference_forwards": run.reference_forwards[0],
            },
            run.reference_fingerprint,
            sharded,
            keep=run.config.train.keep_checkpoints,
        )
    D.barrier()
    return path


def _check_reference(run: Run, when: str) -> None:
    """Every process checks its reference against the fingerprint taken when the run started;
    all stop if any one moved (before a checkpoint or the final evaluation is written)."""
    moved = run.reference is not None and fingerprint(run.reference) != run.reference_fingerprint
    if D.all_reduce_max(torch.tensor(float(moved))) > 0:
        raise RuntimeError(
            f"{when}: the reference model's weights changed since the run started; "
            "stopping (the last checkpoint is kept)"
        )


def _reference_eval(evaluator: Evaluator, run_dir: Path, show: bool):
    """The reference's held-out evaluation, computed once and kept in eval_reference.json."""
    if not evaluator.heldout:
        return None
    path = run_dir / "eval_reference.json"
    if path.exists():
        saved = read_json(path)
        offset = saved.get("prompt_offset", 0)  # files from before eval.best_by moved it: 0
        if offset != evaluator.start:
            # a resume that changed eval.best_by: the policy must be compared on the reference's
            # prompts (the reference can no longer be sampled from the moved policy)
            log.warning(
                "tether: warning: the reference's held-out evaluation (eval_reference.json) used the "
                "held-out prompts from index %d, this config's final evaluation those from %d; the final "
                "evaluation keeps the reference's (%s)",
                offset,
                evaluator.start,
                "prompts the best step is chosen on included" if offset == 0 else "after the periodic ones",
            )
            evaluator.use_window(offset)
        return EvalResult.from_json(saved)
    before = evaluator("reference", evaluator.heldout)  # evaluate() forks the RNG
    write_json_file(path, before.to_json() | {"prompt_offset": evaluator.start})
    s = before.summary()
    _say(
        f"tether: reference held-out proxy score {s['proxy_mean']:.3f} ± {s['proxy_se']:.3f}"
        + (f", gold {s['gold_mean']:.3f} ± {s['gold_se']:.3f}" if "gold_mean" in s else "")
        + f" (n={len(evaluator.heldout)})",
        show,
    )
    return before


def _fluency_judge(run: Run):
    """The fluency judge of eval.fluency_model on rank 0 (the one that evaluates), or None."""
    c = run.config
    if c.eval.fluency_model == "none" or not D.is_main() or not run.heldout_prompts:
        return None
    if not (c.eval.n_prompts or c.eval.every):
        return None
    from tether.judges.fluency import FluencyJudge

    device = run.accelerator.device if run.accelerator is not None else "cpu"
    return FluencyJudge(c.eval.fluency_model, device)


def _reference_periodic(evaluator: Evaluator, before, run_dir: Path, resume: bool) -> None:
    """The reference's numbers on the periodic prompts, computed before the first step and kept
    in eval_reference_periodic.json (a resumed run's policy is no longer the reference)."""
    path = run_dir / "eval_reference_periodic.json"
    if path.exists():
        evaluator.reference_periodic = read_json(path)
        return
    if resume and not evaluator.covers_periodic(before):
        return  # an older run without it, whose policy has moved: no reference numbers
    evaluator.set_reference(before)
    if evaluator.reference_periodic is not None:
        write_json_file(path, evaluator.reference_periodic)


def flat_config(c: Config) -> dict:
    """The config as ``section.field`` -> bool, int, float, str (lists and None as text), what
    trackers take as hyperparameters."""
    flat = {}
    for section, fields in c.to_dict().items():
        for name, v in fields.items():
            flat[f"{section}.{name}"] = v if isinstance(v, (bool, int, float, str)) else str(v)
    return flat


SAMPLE_COLUMNS = ("prompt", "response", "score", "kl", "reward", "gold")


def _log_sample_table(run: Run, step: int, rows: list[dict]) -> None:
    """The step's samples to every tracker that takes tables (wandb, clearml, a custom one with
    ``log_table``)."""
    if run.accelerator is None or not run.accelerator.log_with:
        return
    columns = [k for k in SAMPLE_COLUMNS if k in rows[0]]
    plain = (int, float, str, type(None))
    data = [[r[k] if isinstance(r[k], plain) else json.dumps(r[k]) for k in columns] for r in rows]
    for tracker in run.accelerator.trackers:
        if hasattr(tracker, "log_table"):
            tracker.log_table("samples", columns=columns, data=data, step=step)


def _tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise RuntimeError(
            "train.tensorboard=true needs the tensorboard package: pip install tensorboard"
        ) from e
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


def sample_rows(exp) -> list[dict]:
    """One dict per sample: prompt, response, score, kl (the estimator's, nats/seq) and reward
    (the shaped rewards summed: score - beta * kl; with ppo.kl_shaping=exact the exact KL's sum
    in place of kl, the per-token corrections not included), and completion_ids (the sampled
    token ids, for the gold judge: :func:`_log_step` takes them out before writing)."""
    mask = exp.rollout.response_mask
    kl_seq = (
        sequence_kl(exp.kl, mask).tolist() if exp.kl is not None else [None] * len(mask)
    )  # None: no reference
    rew_seq = masked_sum(exp.rewards, mask, dim=-1)
    rows = [
        {"prompt": p, "response": r, "score": float(s), "kl": k, "reward": float(rw)}
        for p, r, s, k, rw in zip(exp.rollout.prompts, exp.rollout.responses, exp.scores, kl_seq, rew_seq)
    ]
    for i, row in enumerate(rows):  # the row's other dataset columns travel with it
        if exp.rollout.columns:
            row["columns"] = {k: v[i] for k, v in exp.rollout.columns.items()}
    for row, ids in zip(rows, exp.rollout.completion_ids):  # the gold judge's; not written
        row["completion_ids"] = ids
    return rows


def save_policy(policy, tokenizer, out: Path, whole: dict | None = None) -> None:
    """The final policy as a model folder (``save_pretrained``; a LoRA run's adapter as a peft
    folder), its tokenizer and ``value_head.safetensors``. ``whole``: when the policy is sharded,
    ``{"lm": ..., "value_head": ...}``, their whole tensors
    (:func:`tether.models.sharding.full_state_dict`, gathered by every process).

    Written to a temporary folder beside ``out`` and renamed into place, so ``out`` is a whole
    policy or absent (an earlier one is replaced only once the new one is complete).

    Raises:
        tether.run.files.RunFileError: a write failed (a full disk, a file-size limit); names the
            folder, and the last checkpoint is kept.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if whole is not None:
            policy.lm.save_pretrained(tmp, state_dict=whole["lm"])
        else:
            policy.save_pretrained(tmp)  # the model, or for a LoRA run its adapter (a peft folder)
        tokenizer.save_pretrained(tmp)
        head = whole["value_head"] if whole is not None else policy.value_head.state_dict()
        save_file({k: v.detach().contiguous() for k, v in head.items()}, str(tmp / "value_head.safetensors"))
    except (OSError, RuntimeError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(out, e, "The final policy is not saved; the last checkpoint is kept") from None
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
