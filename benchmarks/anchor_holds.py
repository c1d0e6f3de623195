"""Does the text anchor keep the capability probe, and at what cost in gain? (issue 54)

Usage:
    python benchmarks/anchor_holds.py --out runs/anchor \\
        --arm off="" --arm fkl="anchor.coef=1" --arm ptx="anchor.coef=1 anchor.kind=ptx" \\
        [--algo ppo] [--seeds 0,1,2] [--interpolate 0.25,0.5,0.75] [overrides]

Each arm is the demo's command (``python -m tether train``, the embedded SmolLM2 on VADER) with
its overrides, ``eval.capability_texts=200`` (the probe at 200 sentences),
``train.checkpoint_every=0`` and the given overrides, once per seed; arms interleave per seed, so
a slow stretch of the machine falls on all. A run folder holding an ``eval.json`` is read, not
re-run. ``--interpolate`` also runs ``tether interpolate`` on the first arm's runs at those alphas
(the zero-training-cost baseline; needs ``train.save_model`` left on; alphas a run's
``interpolate.json`` already holds are kept, not evaluated again). Each other arm is then set
against it at equal gain, seed by seed: the capability change of the first arm's interpolation
where its gain reaches the arm's (linear between the alphas around the first crossing).

Printed per arm (mean ± SE over the seeds, from the spread of the seeds): the held-out VADER
gain and its share of the first arm's, the gold gain, the capability change (policy - reference
NLL on the probe's sentences, nats per token), the held-out KL, and the median ``time/update``
and ``time/step``. Numbers are printed, never asserted; ``OUT/anchor_holds.json`` and
``OUT/anchor_holds.png`` (capability change against gain, one point per run and per alpha).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path


def run_one(out: Path, algo: str, seed: int, overrides: list[str]) -> None:
    if (out / "eval.json").exists():
        return
    cmd = [
        sys.executable,
        "-m",
        "tether",
        "train",
        f"train.algo={algo}",
        f"train.seed={seed}",
        f"train.output_dir={out}",
        "train.checkpoint_every=0",
        "eval.capability_texts=200",
        *overrides,
    ]
    print(f"{algo} seed {seed} -> {out}: {' '.join(overrides)}", flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = statistics.fmean(xs)
    return m, (statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else float("nan"))


def summarize(out: Path) -> dict:
    ev = json.loads((out / "eval.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "gain": ev["gain"],
        "gold_gain": ev.get("gold_gain", float("nan")),
        "capability": ev.get("capability_nll_change", float("nan")),
        "capability_se": ev.get("capability_nll_change_se", float("nan")),
        "heldout_kl": ev["policy"]["kl"],
        "update_s": statistics.median(r["time/update"] for r in rows if "time/update" in r),
        "step_s": statistics.median(r["time/step"] for r in rows if "time/step" in r),
        "anchor_fkl": [r.get("anchor/forward_kl") for r in rows],
        "anchor_coef": [r.get("anchor/coef") for r in rows],
    }


def capability_at_gain(curve: list[tuple[float, float, float]], gain: float) -> float | None:
    """The capability change where a seed's interpolation reaches ``gain``: ``curve`` its
    ``(alpha, gain, capability)`` points from alpha 0 (the reference: 0, 0) to 1 (the trained
    run), taken in order of alpha; linear between the two points around the first crossing. None
    when the curve never reaches ``gain`` (the anchor gained more than the run it is set against)."""
    for (_, g0, c0), (_, g1, c1) in zip(curve, curve[1:]):
        if (g0 - gain) * (g1 - gain) <= 0 and g1 != g0:
            return c0 + (gain - g0) / (g1 - g0) * (c1 - c0)
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/anchor")
    ap.add_argument("--arm", action="append", required=True, help='LABEL="overrides" (the first is the base)')
    ap.add_argument("--algo", default="ppo")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--interpolate", default="", help="alphas for tether interpolate on the first arm's runs")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    arms = {k: shlex.split(v) for k, v in (a.split("=", 1) for a in args.arm)}
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    for seed in seeds:
        for label, extra in arms.items():
            run_one(out / label / f"{args.algo}-{seed}", args.algo, seed, [*extra, *args.overrides])
    interpolated: list[dict] = []
    if args.interpolate:
        base = next(iter(arms))
        wanted = {float(a) for a in args.interpolate.split(",")}
        for seed in seeds:
            folder = out / base / f"{args.algo}-{seed}"
            path = folder / "interpolate.json"
            kept = json.loads(path.read_text()) if path.exists() else {"rows": []}
            missing = sorted(wanted - {r["alpha"] for r in kept["rows"]})
            if missing:  # only the alphas not yet evaluated; the file then holds them all
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "tether",
                        "interpolate",
                        str(folder),
                        "--alpha",
                        ",".join(map(str, missing)),
                    ],
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                new = json.loads(path.read_text())
                new["rows"] = sorted(kept["rows"] + new["rows"], key=lambda r: r["alpha"])
                path.write_text(json.dumps(new, indent=1))
            rows = json.loads(path.read_text())["rows"]
            interpolated += [dict(r, seed=seed) for r in rows]

    table: dict = {}
    first = None
    print(
        "\n| arm | VADER gain | share of base | gold gain | capability change | held-out KL | update | step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label in arms:
        runs = [summarize(out / label / f"{args.algo}-{seed}") for seed in seeds]
        gain = mean_se([r["gain"] for r in runs])
        first = first or gain[0]
        gold = mean_se([r["gold_gain"] for r in runs])
        cap = mean_se([r["capability"] for r in runs])
        kl = mean_se([r["heldout_kl"] for r in runs])
        upd = statistics.median(r["update_s"] for r in runs)
        step = statistics.median(r["step_s"] for r in runs)
        table[label] = {"gain": gain, "gold_gain": gold, "capability": cap, "heldout_kl": kl, "runs": runs}
        print(
            f"| {label} | {gain[0]:+.3f} ± {gain[1]:.3f} | {gain[0] / first:.2f} | "
            f"{gold[0]:+.2f} ± {gold[1]:.2f} | {cap[0]:+.3f} ± {cap[1]:.3f} | "
            f"{kl[0]:.2f} ± {kl[1]:.2f} | {upd:.2f} s | {step:.2f} s |"
        )
    if interpolated:
        print("\n| alpha | VADER gain | capability change | held-out KL |  (tether interpolate, first arm)")
        print("|---|---|---|---|")
        for a in sorted({r["alpha"] for r in interpolated}):
            rs = [r for r in interpolated if r["alpha"] == a]
            g = mean_se([r["gain"] for r in rs])
            c = mean_se([r.get("capability_nll_change", float("nan")) for r in rs])
            k = mean_se([r["kl"] for r in rs])
            print(f"| {a:g} | {g[0]:+.3f} ± {g[1]:.3f} | {c[0]:+.3f} ± {c[1]:.3f} | {k[0]:.2f} |")
    if interpolated:
        base = next(iter(arms))
        print("\n| arm | capability change | interpolation at its gain | anchor - interpolation |")
        print("|---|---|---|---|")
        for label in list(arms)[1:]:
            diffs, at = [], []
            for seed, run in zip(seeds, table[label]["runs"]):
                own = table[base]["runs"][seeds.index(seed)]
                points = [
                    (r["alpha"], r["gain"], r["capability_nll_change"])
                    for r in interpolated
                    if r["seed"] == seed
                ]
                curve = sorted({(0.0, 0.0, 0.0), *points, (1.0, own["gain"], own["capability"])})
                cap = capability_at_gain(curve, run["gain"])
                if cap is not None:
                    at.append(cap)
                    diffs.append(run["capability"] - cap)
            if diffs:
                c, a, d = (
                    mean_se([r["capability"] for r in table[label]["runs"]]),
                    mean_se(at),
                    mean_se(diffs),
                )
                table[label]["vs_interpolation"] = {"at_gain": a, "diff": d, "n": len(diffs)}
                print(
                    f"| {label} | {c[0]:+.3f} ± {c[1]:.3f} | {a[0]:+.3f} ± {a[1]:.3f} | "
                    f"{d[0]:+.3f} ± {d[1]:.3f} ({len(diffs)} seeds) |"
                )
    (out / "anchor_holds.json").write_text(
        json.dumps({"arms": table, "interpolated": interpolated}, indent=1)
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for label, t in table.items():
        ax.scatter([r["gain"] for r in t["runs"]], [r["capability"] for r in t["runs"]], label=label)
    if interpolated:
        ax.scatter(
            [r["gain"] for r in interpolated],
            [r.get("capability_nll_change", float("nan")) for r in interpolated],
            marker="x",
            color="grey",
            label="interpolated (first arm)",
        )
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xlabel("held-out VADER gain")
    ax.set_ylabel("capability NLL change (nats/token)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "anchor_holds.png", dpi=100)
    print(f"wrote {out / 'anchor_holds.png'} and {out / 'anchor_holds.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
