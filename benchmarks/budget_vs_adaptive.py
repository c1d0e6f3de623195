"""The KL-budget controller beside the adaptive controller, same target, on the embedded default.

Usage: python benchmarks/budget_vs_adaptive.py [--out runs/budget] [--kl 2.0] [--steps 40] [overrides]

Runs PPO twice (kl.controller=budget with kl.budget=KL, and kl.controller=adaptive with
kl.target=KL), prints the mean measured KL over the last half of each run against the target,
and writes budget_vs_adaptive.png (KL and beta against step for both).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/budget")
    ap.add_argument("--kl", type=float, default=2.0, help="budget / target, nats per sequence")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tether.run.config import load_config
    from tether.training import train

    runs = {}
    for name, extra in (
        ("budget", ["kl.controller=budget", f"kl.budget={args.kl}"]),
        ("adaptive", ["kl.controller=adaptive", f"kl.target={args.kl}"]),
    ):
        out = Path(args.out) / name
        if not (out / "metrics.jsonl").exists() or not (out / "training.png").exists():
            cfg = load_config(
                None,
                [
                    f"train.steps={args.steps}",
                    f"train.output_dir={out}",
                    "train.save_model=false",
                    "eval.n_prompts=0",
                    "eval.every=0",
                    *extra,
                    *args.overrides,
                ],
            )
            train(cfg)
        runs[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in runs.items():
        steps = [r["step"] for r in rows]
        a1.plot(steps, [r["objective/kl"] for r in rows], "-o", ms=3, label=f"{name}: measured KL (k1)")
        a1.plot(steps, [r["objective/kl_exact"] for r in rows], ":", label=f"{name}: exact KL")
        a2.plot(steps, [r["objective/kl_coef"] for r in rows], "-o", ms=3, label=name)
        half = rows[len(rows) // 2 :]
        kls = [r["objective/kl"] for r in half]
        mean_kl = sum(kls) / len(kls)
        se = (sum((k - mean_kl) ** 2 for k in kls) / (len(kls) - 1) / len(kls)) ** 0.5
        mean_exact = sum(r["objective/kl_exact"] for r in half) / len(half)
        within = sum(abs(k / args.kl - 1) <= 0.10 for k in kls)
        print(
            f"{name:>8}: steps {half[0]['step']}-{half[-1]['step']}: mean measured KL {mean_kl:.3f} "
            f"+- {se:.3f} "
            f"nats/seq (exact {mean_exact:.3f}), target {args.kl}: {100 * (mean_kl / args.kl - 1):+.1f}% "
            f"(exact {100 * (mean_exact / args.kl - 1):+.1f}%); {within}/{len(kls)} single steps within 10%; "
            f"beta {min(r['objective/kl_coef'] for r in half):.4f}.."
            f"{max(r['objective/kl_coef'] for r in half):.4f}, "
            f"final {rows[-1]['objective/kl_coef']:.4f}"
        )
    a1.axhline(args.kl, ls="--", c="gray", label="budget = target")
    a1.set(xlabel="step", ylabel="KL, nats per sequence", title="KL against step")
    a2.set(xlabel="step", ylabel="kl_coef (beta)", title="beta against step")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    png = Path(args.out) / "budget_vs_adaptive.png"
    fig.savefig(png, dpi=110)
    print(f"plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
