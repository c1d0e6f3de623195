"""Where the demo's KL went, and what the attribution costs (issue 53's measurement).

Usage:
    python benchmarks/kl_attribution.py --out runs/kl_attribution [overrides]

Three runs of the demo's task (``tether train`` at its defaults: PPO, SmolLM2-135M, VADER, 12
steps of 16 samples), each ``train.save_model=false train.checkpoint_every=0`` and the overrides:

- ``on``: ``kl.tokens_every=1`` (a record every step);
- ``off``: ``kl.attribution=false`` (the same run without it: the overhead is ``on``'s median
  ``time/step`` + ``time/attribution`` against ``off``'s median ``time/step``; the top-5 next tokens
  are taken inside step 4, ``time/score``);
- ``ends``: ``on`` with a reward that pays for short responses (:func:`pays_for_ending`: 1 - the
  share of the 24 new tokens used), so the policy learns to end early and puts its KL on the end
  token: ``kl/special_token_share`` against ``on``'s.

Printed: for ``on``, the record of the largest rise of the KL (the step, the rise, the share of the
rise the top 20 token ids carry, the share of the step's KL the top 20 positions carry, and the
top 10 positions); the overhead; the special-token share per step of ``on`` and ``ends``. Writes
``OUT/kl_attribution.png`` (the special-token share and the top-1% share against step) and
``OUT/kl_attribution.json``. A run folder holding an ``eval.json`` is read, not re-run. Numbers are
printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def pays_for_ending(completion_ids, **kwargs) -> list[float]:
    """1 - len(response) / 24: the fewer of the demo's 24 new tokens a response uses (so the
    earlier it samples its end token), the more it is paid."""
    return [1.0 - len(ids) / 24 for ids in completion_ids]


RUNS = {
    "on": ["kl.tokens_every=1"],
    "off": ["kl.attribution=false"],
    "ends": ["kl.tokens_every=1", "reward.scorer=benchmarks.kl_attribution:pays_for_ending"],
}


def run_one(out: Path, extra: list[str], overrides: list[str]) -> None:
    if (out / "eval.json").exists():
        return
    cmd = [
        sys.executable,
        "-m",
        "tether",
        "train",
        f"train.output_dir={out}",
        "train.save_model=false",
        "train.checkpoint_every=0",
        *extra,
        *overrides,
    ]
    print(f"-> {out}", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/kl_attribution")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out = Path(args.out)
    for name, extra in RUNS.items():
        run_one(out / name, extra, args.overrides)
    from tether.analysis.kl_tokens import chosen, console_view, probe_view, read_records

    on, off, ends = (rows(out / n) for n in RUNS)
    record = chosen(read_records(out / "on"))
    rise = record.get("rise") or {}
    print(f"\n## the largest rise of the KL (on): step {record['step']}\n")
    print(console_view(record))
    probe = probe_view(json.loads((out / "on" / "eval.json").read_text()))
    if probe:
        print("\n" + probe)
    step_on = statistics.median(r["time/step"] for r in on)
    attribution = statistics.median(r["time/attribution"] for r in on)
    step_off = statistics.median(r["time/step"] for r in off)
    score_on = statistics.median(r["time/score"] for r in on)
    score_off = statistics.median(r["time/score"] for r in off)
    overhead = (step_on + attribution) / step_off - 1
    print(
        f"\n## overhead\n\nmedian time/step: on {step_on:.3f} s + time/attribution {attribution:.3f} s, "
        f"off {step_off:.3f} s: {100 * overhead:+.1f}% "
        f"(time/score on {score_on:.3f} s, off {score_off:.3f} s)"
    )
    print("\n## kl/special_token_share per step (on | ends), kl/top1pct_share (on | ends)\n")
    for a, b in zip(on, ends):
        print(
            f"step {a['step']:>2}: {a.get('kl/special_token_share', float('nan')):.3f} | "
            f"{b.get('kl/special_token_share', float('nan')):.3f}   "
            f"{a.get('kl/top1pct_share', float('nan')):.3f} | "
            f"{b.get('kl/top1pct_share', float('nan')):.3f}   "
            f"length {a['response/length']:.1f} | {b['response/length']:.1f}"
        )
    summary = {
        "largest_rise": {
            "step": record["step"],
            "kl": record.get("kl"),
            "previous_kl": record.get("previous_kl"),
            "rise_kl_sum": rise.get("kl_sum"),
            "rise_explained_by_top20_ids": rise.get("explained"),
            "top20_positions_share": record.get("top_share"),
        },
        "overhead": {"step_on": step_on, "attribution": attribution, "step_off": step_off, "ratio": overhead},
        "special_token_share": {
            "on": [r.get("kl/special_token_share") for r in on],
            "ends": [r.get("kl/special_token_share") for r in ends],
        },
    }
    (out / "kl_attribution.json").write_text(json.dumps(summary, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for name, rs in (("on (VADER)", on), ("ends (pays for ending)", ends)):
        steps = [r["step"] for r in rs]
        axes[0].plot(steps, [r.get("kl/special_token_share") for r in rs], marker="o", label=name)
        axes[1].plot(steps, [r.get("kl/top1pct_share") for r in rs], marker="o", label=name)
    axes[0].set_title("share of the exact KL on special tokens")
    axes[1].set_title("share of the exact KL on the top 1% of tokens")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "kl_attribution.png", dpi=120)
    print(f"\nwrote {out / 'kl_attribution.png'} and {out / 'kl_attribution.json'}")


if __name__ == "__main__":
    main()
