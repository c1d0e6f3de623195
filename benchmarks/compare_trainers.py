"""Run PPO, GRPO, RLOO and DPO at their defaults on the embedded default; print one table.

Usage: python benchmarks/compare_trainers.py [--out runs/compare] [--algos ppo,grpo,rloo,dpo] [overrides]

For each trainer: held-out proxy (VADER) and gold score gains over the reference (same prompts,
same sampling seed; SE paired by prompt), the final held-out KL (k1, nats per sequence), the
changes of fluency NLL (nats per token) and distinct-2 with their SEs, the last training-batch
KL, and the median step time. A trainer folder that already holds a finished run is read, not
re-run (``make demo`` is the PPO row: copy its run folder to OUT/ppo). Numbers are printed,
never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/compare")
    ap.add_argument("--algos", default="ppo,grpo,rloo,dpo")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    from tether.run.config import load_config
    from tether.training import train

    rows = []
    for algo in args.algos.split(","):
        out = Path(args.out) / algo
        if not (out / "eval.json").exists():
            cfg = load_config(
                None,
                [f"train.algo={algo}", f"train.output_dir={out}", "train.save_model=false", *args.overrides],
            )
            train(cfg)
        ev = json.loads((out / "eval.json").read_text())
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        rows.append(
            {
                "algo": algo,
                "gain": f"{ev['gain']:+.3f} ± {ev['gain_se_paired']:.3f}",
                "gold gain": f"{ev['gold_gain']:+.3f} ± {ev['gold_gain_se_paired']:.3f}"
                if "gold_gain" in ev
                else "-",
                "held-out KL": f"{ev['policy']['kl']:.2f}",
                **{
                    label: f"{ev[f'{key}_change']:+.3f} ± {ev[f'{key}_change_se']:.3f}"
                    if f"{key}_change" in ev
                    else "-"
                    for key, label in (
                        ("fluency_nll", "fluency NLL change"),
                        ("distinct_2", "distinct-2 change"),
                    )
                },
                "train KL (last)": f"{metrics[-1].get('objective/kl', float('nan')):.2f}",
                "step s (median)": f"{statistics.median(m['time/step'] for m in metrics):.1f}",
            }
        )
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(r[c] for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
