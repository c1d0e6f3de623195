"""Median PPO step time, its split, and peak memory for the default config.

Usage: python benchmarks/step_time.py [--steps N] [--warmup K] [section.field=value ...]

Prints numbers, never asserts: targets are read by people, not by the test suite.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6, help="measured steps")
    ap.add_argument("--warmup", type=int, default=1, help="steps run before measuring")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    from tether.run.config import load_config
    from tether.run.setup import build_run
    from tether.trainers.ppo import PPOTrainer

    out = tempfile.mkdtemp(prefix="tether-bench-")
    config = load_config(
        None, ["eval.n_prompts=0", "train.save_model=false", f"train.output_dir={out}", *args.overrides]
    )
    t0 = time.perf_counter()
    run = build_run(config)
    load_s = time.perf_counter() - t0
    trainer = PPOTrainer(run)
    rows = []
    for step in range(args.warmup + args.steps):
        row = trainer.step(step)
        if step >= args.warmup:
            rows.append(row)
        print(f"step {step}: {row['time/step']:.2f} s", file=sys.stderr)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    c = config
    print(
        f"config: batch {c.rollout.batch_size} x {c.rollout.max_new_tokens} new tokens, "
        f"ppo epochs {c.optim.epochs}, minibatch {c.optim.minibatch_size}, exact KL {c.kl.exact}, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"model load (cached): {load_s:.1f} s")
    print(f"median step time over {len(rows)} steps: {med('time/step'):.2f} s")
    for key, label in (
        ("time/generate", "generation"),
        ("time/score", "policy + reference scoring"),
        ("time/update", "PPO update (fwd+bwd+AdamW)"),
    ):
        print(f"  {label:<30} {med(key):6.2f} s  ({med(key) / med('time/step'):5.1%})")
    print(f"samples per second: {c.rollout.batch_size / med('time/step'):.2f}")
    print(f"peak RSS: {peak_gb:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
