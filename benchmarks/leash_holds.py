"""Does the default leash hold its budget? PPO, GRPO and RLOO at their defaults, several seeds,
two checkouts of tether side by side (issue 52's measurement).

Usage:
    python benchmarks/leash_holds.py --out runs/leash \\
        --src before=/path/to/old/checkout/src --src after=src [--algos ppo,grpo,rloo] \\
        [--seeds 0,1,2] [overrides]

Each (trainer, seed) runs once per checkout, interleaved (before, after, before, ...) so a slow
stretch of the machine falls on both; each run is ``python -m tether train`` with that checkout
first on ``PYTHONPATH``, ``train.save_model=false train.checkpoint_every=0`` (no 1.7 GB
checkpoints; neither changes training) and the given overrides. A run folder holding an
``eval.json`` is read, not re-run.

Printed per checkout and trainer (KL in nats per sequence, as multiples of ``kl.budget``):

- ``train KL max``: the largest exact KL on a training batch at any step, over the seeds
  (``objective/kl_exact``, read before the step's update: the policy after the previous step);
- ``kept KL max``: the largest exact KL of the weights the update guard kept, on the step's own
  batch (``guard/kl_kept``; ``-`` without the guard);
- ``held-out KL``: each seed's final held-out KL (``eval.json``, k1 on 64 prompts x 2 samples);
- the held-out VADER gain and gold gain, mean over seeds with the SE of that mean (from the
  spread of the seeds), and the gain per nat of held-out KL the same way;
- the median ``time/step`` over all steps of all seeds.

Writes ``OUT/leash_holds.png`` (the exact training KL against step, every run, with the budget)
and ``OUT/leash_holds.json`` (the numbers). Numbers are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def run_one(src: Path, out: Path, algo: str, seed: int, overrides: list[str]) -> None:
    if (out / "eval.json").exists():
        return
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [
        sys.executable,
        "-m",
        "tether",
        "train",
        f"train.algo={algo}",
        f"train.seed={seed}",
        f"train.output_dir={out}",
        "train.save_model=false",
        "train.checkpoint_every=0",
        *overrides,
    ]
    print(f"[{src}] {algo} seed {seed} -> {out}", flush=True)
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = statistics.fmean(xs)
    return m, (statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan"))


def summarize(out: Path) -> dict:
    ev = json.loads((out / "eval.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    import yaml

    budget = float(yaml.safe_load((out / "config.yaml").read_text())["kl"]["budget"])
    kept = [r["guard/kl_kept"] for r in rows if "guard/kl_kept" in r]
    return {
        "budget": budget,
        "kl_exact": [r["objective/kl_exact"] for r in rows],
        "kl_coef": [r["objective/kl_coef"] for r in rows],
        "kept": kept,
        "fraction": [r["guard/fraction"] for r in rows if "guard/fraction" in r],
        "heldout_kl": ev["policy"]["kl"],
        "gain": ev["gain"],
        "gold_gain": ev.get("gold_gain", float("nan")),
        "step_times": [r["time/step"] for r in rows if "time/step" in r],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/leash")
    ap.add_argument("--src", action="append", required=True, help="LABEL=PATH of a checkout's src/")
    ap.add_argument("--algos", default="ppo,grpo,rloo")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    srcs = dict(s.split("=", 1) for s in args.src)
    algos = args.algos.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)

    for algo in algos:
        for seed in seeds:
            for label, src in srcs.items():
                run_one(Path(src).resolve(), out / label / f"{algo}-{seed}", algo, seed, args.overrides)

    table: dict = {}
    print(
        "\n| checkout | trainer | train KL max / budget | kept KL max / budget | held-out KL / budget "
        "(per seed) | VADER gain | gold gain | gain per nat | median step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label in srcs:
        for algo in algos:
            runs = [summarize(out / label / f"{algo}-{seed}") for seed in seeds]
            b = runs[0]["budget"]
            train_max = max(max(r["kl_exact"]) for r in runs) / b
            kept = [k for r in runs for k in r["kept"]]
            held = [r["heldout_kl"] / b for r in runs]
            gain, gain_se = mean_se([r["gain"] for r in runs])
            gold, gold_se = mean_se([r["gold_gain"] for r in runs])
            per_nat, per_nat_se = mean_se([r["gain"] / r["heldout_kl"] for r in runs])
            step = statistics.median(t for r in runs for t in r["step_times"])
            table.setdefault(label, {})[algo] = {
                "train_kl_max_over_budget": train_max,
                "kept_kl_max_over_budget": max(kept) / b if kept else None,
                "heldout_kl_over_budget": held,
                "gain": [gain, gain_se],
                "gold_gain": [gold, gold_se],
                "gain_per_nat": [per_nat, per_nat_se],
                "median_step_s": step,
                "runs": runs,
            }
            print(
                f"| {label} | {algo} | {train_max:.2f} | "
                + (f"{max(kept) / b:.3f}" if kept else "-")
                + f" | {', '.join(f'{h:.2f}' for h in held)} | {gain:+.3f} ± {gain_se:.3f} | "
                f"{gold:+.2f} ± {gold_se:.2f} | {per_nat:+.4f} ± {per_nat_se:.4f} | {step:.1f} s |"
            )
    (out / "leash_holds.json").write_text(json.dumps(table, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(algos), figsize=(5 * len(algos), 4), squeeze=False)
    colors = dict(zip(srcs, ("tab:red", "tab:blue", "tab:green", "tab:orange")))
    for ax, algo in zip(axes[0], algos):
        for label in srcs:
            for i in range(len(seeds)):
                r = table[label][algo]["runs"][i]
                ax.plot(r["kl_exact"], color=colors[label], alpha=0.7, label=label if i == 0 else None)
        b = table[next(iter(srcs))][algo]["runs"][0]["budget"]
        ax.axhline(b, color="k", ls="--", lw=1, label="budget")
        ax.set_title(f"{algo}: exact KL on the training batch")
        ax.set_xlabel("step")
        ax.set_ylabel("nats per sequence")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "leash_holds.png", dpi=100)
    print(f"wrote {out / 'leash_holds.png'} and {out / 'leash_holds.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
