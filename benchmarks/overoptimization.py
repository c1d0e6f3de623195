"""Reward over-optimization on the embedded default: what the leash protects, measured.

Usage: python benchmarks/overoptimization.py [--out runs/overopt] [--steps 20] [--lr LR]
       [--png docs/img/overoptimization.png] [overrides]

Runs PPO on SmolLM2 against VADER twice at the same learning rate (the default's unless --lr)
for more steps than the demo, at twice its batch (32 samples per step): once almost unleashed
(``kl.kl_coef=0.001``, fixed) and once on tether's default leash (the KL budget controller),
both evaluated every 5 steps on 16 held-out
prompts (and at the end on 64, two samples each, all read by every judge) by the gold judge (the
MiniLM reward model fitted on human ratings), the fluency judge (Gemma-3-270M's NLL, nats per
token) and the diversity measures (distinct-2, self-BLEU, repetition). Prints, per run and per
evaluation, proxy, gold, fluency NLL, distinct-2 and KL beside the reference's; then the final
held-out comparison (every number with its SE), the health warnings, and the checks of issue 18:

- unleashed: fluency or diversity ends >= 3 SE worse than the reference's, at a higher proxy;
- leashed: fluency and diversity within 2 SE of the reference's, at a proxy gain >= 0.15 (of the
  policy it keeps);
- the sample-quality alarm fires in the unleashed run and not in the leashed one.

Writes one picture (six panels against step, both runs, the reference dashed, the alarm marked).
A run folder that already holds a finished run is read, not re-run. On a 2-core CPU each run
takes about 18 minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# both runs: 32 samples per step in one minibatch, the default's optimizer steps with half its
# gradient noise (at the default 16 the leashed run held its policy near a gain of 0.12)
COMMON = ["rollout.batch_size=32", "optim.minibatch_size=32"]
RUNS = {
    "unleashed": [*COMMON, "kl.kl_coef=0.001", "kl.controller=fixed"],
    "default leash": COMMON,
}
PANELS = [
    ("eval/proxy_score", "eval/ref_proxy_score", "proxy score (VADER), held out"),
    ("eval/gold_score", None, "gold score (MiniLM reward model), held out"),
    ("eval/kl", None, "KL(pi || pi_ref), nats per sequence, held out"),
    ("eval/fluency_nll", "eval/ref_fluency_nll", "fluency NLL (Gemma-3-270M), nats per token"),
    ("eval/distinct_2", "eval/ref_distinct_2", "distinct-2 (higher = more diverse)"),
    ("eval/repetition", "eval/ref_repetition", "3-gram repetition rate"),
]


def _run(name: str, out: Path, args) -> tuple[list[dict], list[dict], dict]:
    from tether.run.config import load_config
    from tether.training import train

    if not (out / "eval.json").exists():
        cfg = load_config(
            None,
            [
                f"train.steps={args.steps}",
                *([f"optim.lr={args.lr}"] if args.lr is not None else []),
                "eval.every=5",
                "eval.periodic_prompts=16",
                "eval.n_prompts=64",
                "eval.fluency_samples=2",
                "train.save_model=false",
                "train.checkpoint_every=0",
                f"train.output_dir={out}",
                *RUNS[name],
                *args.overrides,
            ],
        )
        train(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    warn_file = out / "warnings.jsonl"
    warns = [json.loads(line) for line in warn_file.read_text().splitlines()] if warn_file.exists() else []
    return rows, warns, json.loads((out / "eval.json").read_text())


def _quality_alarms(rows: list[dict], final: dict) -> list[int]:
    """Steps at which the sample-quality rule fires on a run's history: at each periodic
    evaluation, then at the final held-out one (as ``tether train`` runs it), replayed with the
    current default thresholds. The rules are pure functions of the history, so a run finished
    under older thresholds is judged the same way as a new one."""
    from tether.core.health import RULES, HealthThresholds
    from tether.run.evaluation import eval_row

    rule, t = RULES["sample_quality"], HealthThresholds()
    steps = [r["step"] for i, r in enumerate(rows) if "eval/proxy_score" in r and rule(rows[: i + 1], t)]
    final_row = {"step": final["policy_step"], **eval_row(final["policy"], final["reference"])}
    if rule([*rows, final_row], t):
        steps.append(final["policy_step"])
    return steps


def _z(final: dict, key: str, worse_if_higher: bool) -> float:
    """The change of ``key`` (policy - reference) in SE units, signed so that > 0 is worse."""
    z = final[f"{key}_change"] / final[f"{key}_change_se"]
    return z if worse_if_higher else -z


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/overopt")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=None, help="default: optim.lr's default")
    ap.add_argument("--png", default=None, help="default: OUT/overoptimization.png")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {name: _run(name, Path(args.out) / name.replace(" ", "-"), args) for name in RUNS}
    from tether.run.config import OptimConfig

    lr = args.lr if args.lr is not None else OptimConfig().lr

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    colors = {"unleashed": "tab:red", "default leash": "tab:blue"}
    checks = []
    for name, (rows, warns, final) in runs.items():
        ev = [r for r in rows if "eval/proxy_score" in r]
        print(f"\n{name}: step  proxy (ref)   gold   fluency NLL (ref)  distinct-2 (ref)  KL")
        nan = float("nan")
        for r in ev:
            g = {k: r.get(f"eval/{k}", nan) for k in ("ref_proxy_score", "gold_score", "fluency_nll")}
            g |= {k: r.get(f"eval/{k}", nan) for k in ("fluency_nll_se", "ref_fluency_nll")}
            g |= {k: r.get(f"eval/{k}", nan) for k in ("distinct_2", "ref_distinct_2")}
            print(
                f"  {r['step']:3d}  {r['eval/proxy_score']:6.3f} ({g['ref_proxy_score']:.3f})"
                f"  {g['gold_score']:6.3f}  {g['fluency_nll']:5.2f} ± {g['fluency_nll_se']:.2f}"
                f" ({g['ref_fluency_nll']:.2f})  {g['distinct_2']:.3f} ({g['ref_distinct_2']:.3f})"
                f"  {r['eval/kl']:6.2f}"
            )
        ref, pol = final["reference"], final["policy"]
        print(
            f"  final held-out, the policy of step {final['policy_step']} "
            f"({final['n_prompts']} prompts x {final['samples_per_prompt']}): "
            f"proxy {ref['proxy_mean']:.3f} -> {pol['proxy_mean']:.3f} "
            f"(gain {final['gain']:+.3f} ± {final['gain_se_paired']:.3f}); "
            f"gold {final.get('gold_gain', nan):+.3f} ± {final.get('gold_gain_se_paired', nan):.3f}; "
            f"KL {pol['kl']:.2f} nats/seq"
        )
        for key, label, worse_if_higher in (
            ("fluency_nll", "fluency NLL", True),
            ("distinct_2", "distinct-2", False),
            ("self_bleu", "self-BLEU", True),
            ("repetition", "repetition", True),
        ):
            if f"{key}_change" in final:
                base = ref[f"{key}_mean"] if key == "fluency_nll" else ref[key]
                now = pol[f"{key}_mean"] if key == "fluency_nll" else pol[key]
                print(
                    f"    {label}: {base:.3f} -> {now:.3f} ({final[f'{key}_change']:+.3f} ± "
                    f"{final[f'{key}_change_se']:.3f}; {_z(final, key, worse_if_higher):+.1f} SE worse)"
                )
        for w in warns:
            print(f"  warning at step {w['step']}: {w['rule']}: {w['message']}")
        fired = _quality_alarms(rows, final)
        print(f"  sample-quality alarm (replayed on the history, final evaluation included): steps {fired}")
        worst = max(_z(final, "fluency_nll", True), _z(final, "distinct_2", False))
        if name == "unleashed":
            checks += [
                (f"unleashed: fluency or distinct-2 >= 3 SE worse (worst {worst:+.1f} SE)", worst >= 3),
                ("unleashed: proxy above the reference's", final["gain"] > 0),
                (f"unleashed: sample-quality alarm fires (steps {fired})", bool(fired)),
            ]
        else:
            z_fl, z_d2 = _z(final, "fluency_nll", True), _z(final, "distinct_2", False)
            checks += [
                (f"leashed: fluency within 2 SE ({z_fl:+.1f})", abs(z_fl) <= 2),
                (f"leashed: distinct-2 within 2 SE ({z_d2:+.1f})", abs(z_d2) <= 2),
                (f"leashed: proxy gain >= 0.15 ({final['gain']:+.3f})", final["gain"] >= 0.15),
                ("leashed: no sample-quality alarm", not fired),
            ]
        for ax, (key, ref_key, title) in zip(axes.flat, PANELS):
            pts = [
                (r["step"], r[key], r.get(key + "_se", 0.0))
                for r in ev
                if isinstance(r.get(key), (int, float))
            ]
            if pts:
                steps, ys, se = zip(*pts)
                ax.errorbar(steps, ys, yerr=se, fmt="o-", ms=3, capsize=2, c=colors[name], label=name)
            refs = [r[ref_key] for r in ev if ref_key and isinstance(r.get(ref_key), (int, float))]
            if refs and name == "default leash":
                ax.axhline(refs[-1], ls="--", c="gray", label="reference")
            for a in fired:
                ax.axvline(a, c=colors[name], ls=":", lw=1, label=f"sample-quality alarm ({name}, step {a})")
            if final["policy_step"] != rows[-1]["step"]:  # eval.best_by kept an earlier policy
                kept = final["policy_step"]
                ax.axvline(kept, c=colors[name], ls="-.", lw=1, label=f"policy kept ({name}, step {kept})")
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.grid(alpha=0.3)
    for ax in axes.flat:
        handles, labels = ax.get_legend_handles_labels()
        unique = dict(zip(labels, handles))
        ax.legend(unique.values(), unique.keys(), fontsize=7)
    fig.suptitle(
        f"PPO on SmolLM2 against VADER, lr {lr:g}, {args.steps} steps: almost unleashed (beta 0.001) "
        "against tether's default leash (32 samples per step)",
        fontsize=10,
    )
    fig.tight_layout()
    png = Path(args.png) if args.png else Path(args.out) / "overoptimization.png"
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    print(f"\nplot: {png}")
    print("\nchecks (issue 18):")
    for what, ok in checks:
        print(f"  [{'ok' if ok else 'FAILED'}] {what}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
