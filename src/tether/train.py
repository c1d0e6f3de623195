"""The training driver: build a run, evaluate the reference, train, evaluate, plot, save."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from tether.config import Config
from tether.evaluation import compare, evaluate
from tether.metrics import sample_table
from tether.plots import plot_score_vs_kl, plot_training
from tether.scorers import Scorer
from tether.trainers.common import build_run
from tether.trainers.dpo import DPOTrainer
from tether.trainers.group import GRPOTrainer, RLOOTrainer
from tether.trainers.ppo import PPOTrainer

log = logging.getLogger(__name__)

TRAINERS = {"ppo": PPOTrainer, "grpo": GRPOTrainer, "rloo": RLOOTrainer, "dpo": DPOTrainer}
"""``train.algo`` -> trainer class; each has ``step(step) -> dict`` and ``last_experience``."""


def _say(msg: str, progress: bool) -> None:
    (tqdm.write if progress else print)(msg)


def train(config: Config, scorer: Scorer | None = None) -> Path:
    """Run ``config`` end to end; returns the run directory.

    Writes into the run directory: ``config.yaml``, ``metrics.jsonl``, ``samples.jsonl``,
    ``eval.json`` (held-out score of reference and final policy), ``training.png``,
    ``score_vs_kl.png`` and ``policy/`` (``save_pretrained`` of the final policy plus
    ``value_head.safetensors``).
    """
    t_start = time.perf_counter()
    run = build_run(config, scorer)
    c, w = config, run.writer
    show = c.train.progress
    _say(f"tether: run directory {w.run_dir}", show)
    _say(f"tether: {len(run.train_prompts)} training prompts, {len(run.heldout_prompts)} held out", show)
    trainer = TRAINERS[c.train.algo](run)
    heldout = run.heldout_prompts[: c.eval.n_prompts]

    def run_eval(name: str):
        return evaluate(name, run.policy.lm, run.reference, run.tokenizer, heldout, run.scorer,
                        c.rollout.max_new_tokens, c.rollout.temperature, c.eval.seed, c.eval.batch_size,
                        c.rollout.max_prompt_tokens)

    before = run_eval("reference") if heldout else None
    if before:
        _say(f"tether: reference held-out score {before.score_mean:.3f} ± {before.score_se:.3f} "
             f"(n={len(heldout)})", show)

    bar = tqdm(range(c.train.steps), desc=f"tether {c.train.algo}", disable=not show, unit="step")
    for step in bar:
        row = trainer.step(step)
        w.log(row)
        bar.set_postfix({k: f"{row[key]:.3f}" for k, key in (("score", "objective/scores"),
                         ("kl", "objective/kl"), ("beta", "objective/kl_coef")) if key in row})
        if (step % c.train.sample_every == 0 or step == c.train.steps - 1) and trainer.last_experience:
            rows = sample_rows(trainer.last_experience)
            w.samples(step, rows)
            _say(f"\nstep {step}\n" + sample_table(rows[:4]), show)

    evals = [before.summary()] if before else []
    if before:
        after = run_eval("policy")
        result = compare(before, after)
        w.write_json("eval.json", result)
        evals.append(after.summary())
        _say(f"tether: held-out score {before.score_mean:.3f} -> {after.score_mean:.3f} "
             f"(gain {result['gain']:+.3f} ± {result['gain_se_unpaired']:.3f} SE, "
             f"z = {result['gain_z_unpaired']:.1f}); held-out KL {after.kl:.2f} nats/seq", show)

    target = c.kl.target if c.kl.controller == "adaptive" and c.kl.target_unit == "nats_per_sequence" else None
    plot_training(w.history, w.run_dir / "training.png", kl_target=target)
    plot_score_vs_kl(w.history, w.run_dir / "score_vs_kl.png", evals)
    if c.train.save_model:
        save_policy(run.policy, run.tokenizer, w.run_dir / "policy")
    _say(f"tether: done in {time.perf_counter() - t_start:.0f} s; plots and metrics in {w.run_dir}", show)
    return w.run_dir


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
