"""Reward over-optimization on the embedded default, and the alarm that catches it.

Usage: python benchmarks/overoptimization.py [--out runs/overopt] [--steps 30] [--lr 2e-4] [overrides]

Runs PPO on SmolLM2 against VADER twice at a high learning rate: once almost unleashed
(``kl.kl_coef=0.001``, fixed) and once on the default leash (``kl.kl_coef=0.05``, adaptive), both
judged every 2 steps on held-out prompts by the MiniLM reward model fitted on human ratings
(the gold judge). Prints, per run, the proxy and gold scores at each evaluation, the gold peak,
and the health warnings, and writes overoptimization.png: proxy and gold against step and
against KL for both runs, with the steps where the over-optimization alarm fired.

A run folder that already holds a finished run is read, not re-run. On a 2-core CPU each run
takes 12-15 minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/overopt")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tether.run.config import load_config
    from tether.training import train

    runs = {}
    for name, extra in (("unleashed", ["kl.kl_coef=0.001", "kl.controller=fixed"]), ("default leash", [])):
        out = Path(args.out) / name.replace(" ", "-")
        if not (out / "eval.json").exists():
            cfg = load_config(
                None,
                [
                    f"train.steps={args.steps}",
                    f"optim.lr={args.lr}",
                    "eval.every=2",
                    "eval.n_prompts=64",
                    "train.save_model=false",
                    "train.checkpoint_every=0",
                    f"train.output_dir={out}",
                    *extra,
                    *args.overrides,
                ],
            )
            train(cfg)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        warn_file = out / "warnings.jsonl"
        warns = (
            [json.loads(line) for line in warn_file.read_text().splitlines()] if warn_file.exists() else []
        )
        runs[name] = (rows, warns, json.loads((out / "eval.json").read_text()))

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for col, (name, (rows, warns, final)) in enumerate(runs.items()):
        ev = [r for r in rows if "eval/gold_score" in r]
        steps = [r["step"] for r in ev]
        proxy = [r["eval/proxy_score"] for r in ev]
        gold = [r["eval/gold_score"] for r in ev]
        kls = [r["eval/kl"] for r in ev]
        peak = max(range(len(gold)), key=gold.__getitem__)
        print(f"\n{name}: step proxy gold eval-KL")
        for s, p, g, k in zip(steps, proxy, gold, kls):
            print(f"  {s:3d} {p:6.3f} {g:7.3f} {k:7.2f}")
        print(
            f"  gold peak {gold[peak]:.3f} at step {steps[peak]} (proxy {proxy[peak]:.3f}, KL "
            f"{kls[peak]:.1f}); "
            f"last eval: proxy {proxy[-1]:.3f}, gold {gold[-1]:.3f}, KL {kls[-1]:.1f}"
        )
        print(
            f"  final held-out ({final['n_prompts']} prompts): proxy gain {final['gain']:+.3f}, "
            f"gold gain {final.get('gold_gain', float('nan')):+.3f}, KL {final['policy']['kl']:.2f} nats/seq"
        )
        for w in warns:
            print(f"  warning at step {w['step']}: {w['rule']}: {w['message']}")
        alarms = [w["step"] for w in warns if w["rule"] == "overoptimization"]
        for row, x, xlabel in ((0, steps, "step"), (1, kls, "held-out KL, nats per sequence")):
            ax = axes[row, col]
            line = "-" if row == 0 else ""  # against KL: points (the KL is not monotone in step)
            ax.plot(x, proxy, line + "o", ms=3, c="tab:blue", label="proxy (VADER)")
            ax.set(xlabel=xlabel, ylabel="proxy score", title=f"{name}")
            ax2 = ax.twinx()
            ax2.plot(x, gold, line + "s", ms=3, c="tab:red", label="gold (MiniLM RM)")
            ax2.set_ylabel("gold score")
            if row == 0:
                for a in alarms:
                    ax.axvline(a, c="k", ls="--", lw=1, label=f"over-optimization alarm (step {a})")
            ax.grid(alpha=0.3)
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = ax2.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="lower right")
    fig.tight_layout()
    png = Path(args.out) / "overoptimization.png"
    fig.savefig(png, dpi=110)
    print(f"\nplot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
