"""One lever at a time, on and off, in the same run: step time and the step's peak memory.

Usage: python benchmarks/levers.py [--levers reuse_forward exact_kl fused_adamw share_prefix
                                             divergences anchor] [--steps 6 --warmup 1]
                                   [--completions 8 --max-new-tokens 24]
                                   [--prompts-per-step 1] [--prompt-prefix TEXT] [--stop-at-eos] [overrides]

The work is ``benchmarks/compare_trl.py``'s (GRPO on the embedded default, ``--completions``
completions of one prompt per step, exactly ``--max-new-tokens`` tokens, beta 0.05 with the KL in
the loss, one update per batch, fp32). For each lever one run alternates the lever off and on
from step to step (the trainer reads it each step), so drift in the machine's load hits both
sides alike; medians over ``--steps`` steps of each after ``--warmup``. Memory is the peak
resident size during the step above the size when the step began (sampled every millisecond,
after ``malloc_trim`` hands freed memory back to the system).

Levers:
    reuse_forward  optim.reuse_forward: the old log-probs from the update's own forward
    exact_kl       kl.exact: the exact full-vocabulary KL (and its extra LM-head pass per slice)
    fused_adamw    optim.fused_adamw: torch's fused AdamW kernel instead of the per-tensor loop
    share_prefix   model.share_prompt_prefix: each group's prompt through the trunk once
    divergences    kl.divergences: the forward KL, JS and alpha-divergence beside the exact KL
    anchor         anchor.coef=1: the text anchor's batch of human text in every optimizer step
                   (the built-in corpus, anchor.batch_size texts; its batches advance only on
                   the steps it is on)

``--prompt-prefix TEXT`` puts TEXT before every training prompt (a long instruction, as chat
prompts have), which is where ``share_prefix`` pays; ``--prompts-per-step`` groups per step.

Prints numbers, never asserts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from exact_kl_cost import PeakRSS  # noqa: E402


def _set_anchor(trainer, on: bool) -> None:
    kept = trainer.__dict__.setdefault("_lever_anchor", trainer.anchor)  # built once, by the config
    trainer.anchor = kept if on else None


def _set_fused(trainer, on: bool) -> None:
    for group in trainer.optimizer.param_groups:
        group["fused"] = on or None  # AdamW reads it every step


LEVERS = {
    "reuse_forward": lambda trainer, config, on: setattr(trainer, "reuse_forward", on),
    "exact_kl": lambda trainer, config, on: setattr(config.kl, "exact", on),
    "fused_adamw": lambda trainer, config, on: _set_fused(trainer, on),
    "share_prefix": lambda trainer, config, on: setattr(trainer.run.policy, "share_prefix", on),
    "divergences": lambda trainer, config, on: setattr(config.kl, "divergences", on),
    "anchor": lambda trainer, config, on: _set_anchor(trainer, on),
}
"""How each lever is switched on a live trainer (the trainer reads each one every step)."""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levers", nargs="+", choices=list(LEVERS), default=list(LEVERS))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--completions", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--prompts-per-step", type=int, default=1)
    ap.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="let responses end at EOS (default: exactly --max-new-tokens)",
    )
    ap.add_argument("--prompt-prefix", default="")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import torch

    import compare_trl
    from tether.data.prompts import PromptSampler
    from tether.run.config import load_config
    from tether.run.setup import build_run
    from tether.trainers.group import GRPOTrainer

    if not args.stop_at_eos:
        compare_trl.force_min_new_tokens_in_tether()
    print(
        f"GRPO, {args.completions} x {args.max_new_tokens} tokens per step ({args.prompts_per_step} prompt(s)"
        + (f", each after a {len(args.prompt_prefix)}-character prefix" if args.prompt_prefix else "")
        + "), "
        f"fp32, {torch.get_num_threads()} threads; medians of {args.steps} steps each side, alternating"
    )
    print("| lever | off: s/step | on: s/step | time on/off | off: step peak MB | on: step peak MB |")
    print("|---|---|---|---|---|---|")
    for lever in args.levers:
        n = args.warmup + 2 * args.steps
        spec = {
            "model": args.model,
            "seed": 0,
            "threads": None,
            "mode": "steps",
            "completions": args.completions,
            "prompts_per_step": args.prompts_per_step,
            "max_new_tokens": args.max_new_tokens,
            "beta": 0.05,
            "tether_kl": "k3+",
            "lr": 1e-5,
            "trainable_layers": "all",  # compare_trl.py's default: every block trains
            "tether": args.overrides,
            "out": tempfile.mkdtemp(prefix=f"tether-lever-{lever}-"),
            "total_steps": n,
        }
        overrides = compare_trl.tether_overrides(spec)
        if lever == "anchor":  # built with the run; the lever switches the trainer's use of it
            overrides = [*overrides, "anchor.coef=1"]
        if args.prompt_prefix:
            overrides = overrides + ["rollout.max_prompt_tokens=256"]
        config = load_config(None, overrides)
        run = build_run(config)
        trainer = GRPOTrainer(run)
        if args.prompt_prefix:
            trainer.sampler = PromptSampler(
                [args.prompt_prefix + p for p in run.train_prompts], config.train.seed
            )
        seen = {False: [], True: []}
        for step in range(n):
            on = bool(step % 2)
            LEVERS[lever](trainer, config, on)
            with PeakRSS() as m:
                row = trainer.step(step)
            if step >= args.warmup:
                seen[on].append((row["time/step"], m.extra / 2**20))
            print(
                f"  {lever} {'on ' if on else 'off'} step {step}: {row['time/step']:.2f} s, "
                f"+{m.extra / 2**20:.0f} MB",
                file=sys.stderr,
            )
        off_t, on_t = (statistics.median(t for t, _ in seen[k]) for k in (False, True))
        off_m, on_m = (statistics.median(mb for _, mb in seen[k]) for k in (False, True))
        print(
            f"| {lever} | {off_t:.2f} | {on_t:.2f} | {on_t / off_t:.3f} | {off_m:.0f} | {on_m:.0f} |",
            flush=True,
        )
        del trainer, run
    return 0


if __name__ == "__main__":
    sys.exit(main())
