"""The training driver: build a run, evaluate the reference, train, watch its health, evaluate, plot."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tether.config import Config
from tether.evaluation import compare, evaluate
from tether.health import HealthMonitor
from tether.metrics import sample_table
from tether.plots import plot_score_vs_kl, plot_training
from tether.scorers import Scorer, make_scorer
from tether.trainers.common import Run, build_run
from tether.trainers.dpo import DPOTrainer
from tether.trainers.group import GRPOTrainer, RLOOTrainer
from tether.trainers.ppo import PPOTrainer

log = logging.getLogger(__name__)

TRAINERS = {"ppo": PPOTrainer, "grpo": GRPOTrainer, "rloo": RLOOTrainer, "dpo": DPOTrainer}
"""``train.algo`` -> trainer class; each has ``step(step) -> dict`` and ``last_experience``."""


def _say(msg: str, progress: bool) -> None:
    (tqdm.write if progress else print)(msg)


class Evaluator:
    """Held-out evaluation with the proxy (training scorer) and the gold judge, same sampling."""

    def __init__(self, run: Run, judge: Scorer | None):
        self.run, c = run, run.config
        self.scorers: dict[str, Scorer] = {"proxy": run.scorer}
        if judge is not None:
            self.scorers["gold"] = judge
        self.heldout = run.heldout_prompts[: c.eval.n_prompts]
        self.periodic = run.heldout_prompts[: c.eval.periodic_prompts]

    def __call__(self, name: str, prompts: list[str]):
        c, run = self.run.config, self.run
        return evaluate(name, run.policy.lm, run.reference, run.tokenizer, prompts, self.scorers,
                        c.rollout.max_new_tokens, c.rollout.temperature, c.eval.seed, c.eval.batch_size,
                        c.rollout.max_prompt_tokens)

    def periodic_row(self) -> dict:
        s = self("periodic", self.periodic).summary()
        row = {"eval/proxy_score": s["proxy_mean"], "eval/kl": s["kl"]}
        if "gold_mean" in s:
            row["eval/gold_score"] = s["gold_mean"]
        return {k: v for k, v in row.items() if v == v}  # drop NaN (no reference)


def train(config: Config, scorer: Scorer | None = None, judge: Scorer | None = None) -> Path:
    """Run ``config`` end to end; returns the run directory.

    Writes into the run directory: ``config.yaml``, ``metrics.jsonl``, ``samples.jsonl``,
    ``eval.json`` (held-out proxy and gold scores of reference and final policy),
    ``warnings.jsonl`` (health alarms), ``training.png``, ``score_vs_kl.png`` and ``policy/``.
    """
    t_start = time.perf_counter()
    c = config
    if judge is None and c.eval.judge != "none" and (c.eval.n_prompts or c.eval.every):
        judge = make_scorer(c.eval.judge)  # before the model loads: a bad judge fails fast
    run = build_run(config, scorer)
    w, show = run.writer, c.train.progress
    _say(f"tether: run directory {w.run_dir}", show)
    _say(f"tether: {len(run.train_prompts)} training prompts, {len(run.heldout_prompts)} held out", show)
    trainer = TRAINERS[c.train.algo](run)
    evaluator = Evaluator(run, judge)
    monitor = HealthMonitor(c.health, w.run_dir / "warnings.jsonl")
    tb = _tensorboard(w.run_dir) if c.train.tensorboard else None

    before = evaluator("reference", evaluator.heldout) if evaluator.heldout else None
    if before:
        s = before.summary()
        _say(f"tether: reference held-out proxy score {s['proxy_mean']:.3f} ± {s['proxy_se']:.3f}"
             + (f", gold {s['gold_mean']:.3f} ± {s['gold_se']:.3f}" if "gold_mean" in s else "")
             + f" (n={len(evaluator.heldout)})", show)

    bar = tqdm(range(c.train.steps), desc=f"tether {c.train.algo}", disable=not show, unit="step")
    for step in bar:
        row = trainer.step(step)
        if c.eval.every and (step % c.eval.every == 0 or step == c.train.steps - 1):
            row.update(evaluator.periodic_row())
        w.log(row)
        if tb is not None:
            for k, v in w.history[-1].items():
                if isinstance(v, (int, float)) and k != "step":
                    tb.add_scalar(k, v, step)
        bar.set_postfix({k: f"{row[key]:.3f}" for k, key in (("score", "objective/scores"),
                         ("kl", "objective/kl"), ("beta", "objective/kl_coef")) if key in row})
        for alarm in monitor.check(w.history):
            _say(f"tether: WARNING [{alarm.rule}] step {alarm.step}: {alarm.message}.\n"
                 f"  likely cause: {alarm.cause}\n  fix: {alarm.fix}", show)
        if (step % c.train.sample_every == 0 or step == c.train.steps - 1) and trainer.last_experience:
            rows = sample_rows(trainer.last_experience)
            if "gold" in evaluator.scorers:
                golds = evaluator.scorers["gold"]([r["response"] for r in rows])
                for r, g in zip(rows, golds):
                    r["gold"] = float(g)
            w.samples(step, rows)
            _say(f"\nstep {step}\n" + sample_table(rows[:4]), show)

    evals = [before.summary()] if before else []
    if before:
        after = evaluator("policy", evaluator.heldout)
        result = compare(before, after)
        w.write_json("eval.json", result)
        evals.append(after.summary())
        gold = (f"; gold {result['gold_gain']:+.3f} ± {result['gold_gain_se_unpaired']:.3f}"
                if "gold_gain" in result else "")
        _say(f"tether: held-out proxy score {before.summary()['proxy_mean']:.3f} -> "
             f"{after.summary()['proxy_mean']:.3f} (gain {result['gain']:+.3f} ± "
             f"{result['gain_se_unpaired']:.3f} SE, z = {result['gain_z_unpaired']:.1f}){gold}; "
             f"held-out KL {after.kl:.2f} nats/seq", show)

    target = c.kl.target if c.kl.controller == "adaptive" and c.kl.target_unit == "nats_per_sequence" else None
    plot_training(w.history, w.run_dir / "training.png", kl_target=target)
    plot_score_vs_kl(w.history, w.run_dir / "score_vs_kl.png", evals)
    if tb is not None:
        tb.close()
    if c.train.save_model:
        save_policy(run.policy, run.tokenizer, w.run_dir / "policy")
    if monitor.fired:
        _say(f"tether: {len(monitor.fired)} health warning(s), see {w.run_dir / 'warnings.jsonl'}", show)
    _say(f"tether: done in {time.perf_counter() - t_start:.0f} s; plots and metrics in {w.run_dir}", show)
    return w.run_dir


def _tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise RuntimeError("train.tensorboard=true needs the tensorboard package: pip install tensorboard") from e
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


def sample_rows(exp) -> list[dict]:
    """One dict per sample: prompt, response, score, kl (nats/seq), reward (score - beta KL)."""
    mask = exp.rollout.response_mask
    kl_seq = torch.where(mask, exp.kl, 0.0).sum(-1) if exp.kl is not None else torch.zeros(len(mask))
    rew_seq = torch.where(mask, exp.rewards, 0.0).sum(-1)
    return [
        {"prompt": p, "response": r, "score": float(s), "kl": float(k), "reward": float(rw)}
        for p, r, s, k, rw in zip(exp.rollout.prompts, exp.rollout.responses, exp.scores, kl_seq, rew_seq)
    ]


def save_policy(policy, tokenizer, out: Path) -> None:
    from safetensors.torch import save_file

    policy.lm.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in policy.value_head.state_dict().items()},
              str(out / "value_head.safetensors"))
