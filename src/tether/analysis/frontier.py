"""The reward-against-KL frontier: a sweep of RL runs and best-of-N, proxy and gold, one picture.

``tether frontier`` trains several short runs (kl_coef values x trainers), each logging held-out
``eval/proxy_score``, ``eval/gold_score``, ``eval/kl``, ``eval/fluency_nll`` and the diversity
numbers every ``eval.every`` steps, samples best-of-N from the reference for N = 1, 2, 4, 8, 16,
and plots proxy score, gold score, fluency NLL and the repetition rate (what the leash protects)
against KL (nats per sequence), proxy and gold with the functional forms of Gao et al. 2022
("Scaling Laws for Reward Model Overoptimization", arXiv 2210.10760, eq. 1-2) fitted,
d = sqrt(KL):

* best-of-N: ``R(d) = d (a - b d)``
* RL:        ``R(d) = d (a - b log d)``

where R is the score gain over the reference. Points go to ``frontier.csv``.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import replace
from pathlib import Path

import torch

from tether.core.bestofn import bon_kl_bound, bon_kl_empirical, bon_scores
from tether.judges.contract import Scorer, score_rollout
from tether.run.config import Config
from tether.run.files import read_jsonl, replace_whole
from tether.run.rngs import forked_rngs

FIT_MIN_POINTS = 6
"""Below this many points with KL > 0, a fit's legend says it is illustrative only."""


def fit_gao(kl: list[float], gain: list[float], form: str) -> tuple[float, float]:
    """Least-squares (a, b) of ``d (a - b d)`` ("bon") or ``d (a - b log d)`` ("rl"), d = sqrt(KL).

    Points with KL <= 0 carry no information about (a, b) (both forms are 0 at d = 0) and are
    dropped, as are points without a gain (NaN: an evaluation in which nothing was scored); fewer
    than 2 usable points give (nan, nan).
    """
    rows = [(math.sqrt(k), g) for k, g in zip(kl, gain) if k > 0 and math.isfinite(g)]
    if len(rows) < 2:
        return float("nan"), float("nan")
    d = torch.tensor([r[0] for r in rows], dtype=torch.float64)
    y = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    second = -d * d if form == "bon" else -d * torch.log(d)
    X = torch.stack([d, second], dim=1)  # (n, 2)
    sol = torch.linalg.lstsq(X, y[:, None]).solution[:, 0]
    return float(sol[0]), float(sol[1])


def gao_curve(a: float, b: float, form: str, kl: torch.Tensor) -> torch.Tensor:
    d = kl.clamp(min=1e-12).sqrt()
    return d * (a - b * d) if form == "bon" else d * (a - b * torch.log(d))


# ---- the sweep -------------------------------------------------------------------------------
def best_of_n_points(
    config: Config, proxy: Scorer, gold: Scorer, ns: list[int], n_prompts: int
) -> list[dict]:
    """Sample max(ns) reference completions per held-out prompt; best-of-N points for every N."""
    from tether.data.prompts import unique_prompts
    from tether.models.loading import resolve_model_path
    from tether.models.sampling import sample_seeds
    from tether.run.evaluation import evaluation_state
    from tether.run.setup import (
        config_env,
        config_sampler,
        load_prompts,
        load_run_lm,
        load_run_tokenizer,
        resolve_device,
        resolve_dtype,
    )

    c = config
    train_prompts, held = load_prompts(c)
    # the state of the runs' own evaluations (the end of training), so both share one baseline
    state = evaluation_state(
        c.train.steps, c.rollout.batch_size / (c.rollout.group_size or 1), len(train_prompts)
    )
    prompts = unique_prompts(held, "data.prompts (its held-out share)")[:n_prompts]  # each prompt once
    # the runs' own stages (tether.run.setup): the same tokenizer set-up and weights as a run's
    path = resolve_model_path(c.model.name, c.model.revision)
    device = resolve_device(c.train.device)  # the run's device and weight dtype
    tok = load_run_tokenizer(c, path, tools=getattr(config_env(c), "schemas", None))
    lm = load_run_lm(c, path=path, dtype=resolve_dtype(c.model.dtype, device), device=device)
    m = max(ns)
    # the runs' sampler (tool turns with rollout.env), decoding the reference eagerly
    sampler = config_sampler(c, tok, device=device, eager=True)
    P, G, texts = [], [], []
    with forked_rngs(c.eval.seed):
        per = max(1, c.eval.batch_size // m)
        for i in range(0, len(prompts), per):
            batch = prompts.select([j for j in range(i, min(i + per, len(prompts))) for _ in range(m)])
            with torch.no_grad():
                # sample j of the step seeded by (eval.seed, 0, j), as the evaluations' samples are
                ro = sampler.sample(lm, batch, sample_seeds(c.eval.seed, 0, range(i * m, i * m + len(batch))))
            P.append(
                torch.tensor(
                    # best-of-N ranks every sample: a None is refused, named
                    score_rollout(proxy, ro, "best-of-N (proxy)", state=state, allow_none=False).total,
                    device="cpu",
                ).view(-1, m)
            )
            texts += ro.own_texts  # the policy's own text: what fluency and repetition read
            G.append(
                torch.tensor(
                    # best-of-N ranks every sample: a None is refused, named
                    score_rollout(gold, ro, "best-of-N (gold)", state=state, allow_none=False).total,
                    device="cpu",
                ).view(-1, m)
            )
    proxy_t, gold_t = torch.cat(P), torch.cat(G)
    per_sample = _per_sample_quality(c, prompts, texts, m)  # fluency NLL, repetition: (P, m) each
    points = []
    for n in ns:
        ps, gs = bon_scores(proxy_t, gold_t, n)
        # the same exact rank weights give the pick's expected fluency NLL and repetition rate
        quality = {}
        for key, values in per_sample.items():
            keep = ~values.isnan().any(-1)  # (P,) the prompts with a value (module docstring of the fill)
            quality[key] = bon_scores(proxy_t[keep], values[keep], n)[1] if bool(keep.any()) else math.nan
        points.append(
            {
                "method": "best-of-N",
                "run": f"bon-{n}",
                "N": n,
                "step": "",
                "kl": bon_kl_empirical(n, m),
                "kl_bound": bon_kl_bound(n),
                "proxy": ps,
                "gold": gs,
                **quality,
            }
        )
    return points


def _per_sample_quality(c: Config, prompts, texts: list[str], m: int) -> dict[str, torch.Tensor]:
    """Per reference sample (P, m): the fluency judge's NLL (nats per token; eval.fluency_model)
    and the 3-gram repetition rate; a sample without a value (an empty or too short response)
    gets its prompt's mean of the others, and a prompt where none has one is NaN (left out of that
    number's average: a 0 there would read as a perfectly fluent pick)."""
    from tether.core.diversity import repetition

    values = {"repetition": [repetition(t) for t in texts]}
    if c.eval.fluency_model != "none":
        from tether.judges.fluency import DEFAULT_FLUENCY_MODEL, FluencyJudge
        from tether.run.setup import resolve_device

        # auto: the judge itself; the frontier's points are compared on what the leash protects
        name = DEFAULT_FLUENCY_MODEL if c.eval.fluency_model == "auto" else c.eval.fluency_model
        judge = FluencyJudge(name, resolve_device(c.train.device))
        values["fluency_nll"] = judge([p for p in prompts.prompts for _ in range(m)], texts)
    out = {}
    for key, vals in values.items():
        rows = []
        for i in range(0, len(vals), m):
            row = vals[i : i + m]
            known = [v for v in row if v is not None]
            fill = sum(known) / len(known) if known else math.nan
            rows.append([fill if v is None else v for v in row])
        out[key] = torch.tensor(rows, dtype=torch.float64)
    return out


QUALITY_KEYS = ("fluency_nll", "distinct_2", "repetition")
"""What the leash protects, per frontier point (best-of-N points have no distinct-2: it is a
statistic of a set, not an expectation over the pick)."""


def run_points(run_dir: Path, label: str) -> list[dict]:
    """Held-out (KL, proxy, gold) points of one run: every periodic eval, and eval.json's end point.
    A score no sample had (null in metrics.jsonl: the reward or judge scored nothing) is NaN here,
    as in the run's memory: left out of the fits, a gap in the plot."""

    def number(v) -> float:
        return math.nan if v is None else v

    pts = []
    for r in read_jsonl(run_dir / "metrics.jsonl"):
        if "eval/gold_score" in r and "eval/kl" in r:
            pts.append(
                {
                    "method": "RL",
                    "run": label,
                    "N": "",
                    "step": r["step"],
                    "kl": max(r["eval/kl"], 0.0),
                    "kl_bound": "",
                    "proxy": number(r["eval/proxy_score"]),
                    "gold": number(r["eval/gold_score"]),
                    **{k: number(r[f"eval/{k}"]) for k in QUALITY_KEYS if f"eval/{k}" in r},
                }
            )
    return pts


def frontier(
    base: Config,
    sweep: list[tuple[str, float]],
    ns: list[int],
    out: Path,
    bon_prompts: int | None = None,
) -> Path:
    """Run the sweep ``[(algo, kl_coef), ...]`` and best-of-N; write frontier.csv and frontier.png."""
    from tether.judges.scorers import make_scorer
    from tether.run.setup import config_env
    from tether.training import train

    if base.eval.judge == "none":
        raise ValueError(
            "tether frontier plots a gold score: eval.judge cannot be none (the default on data other "
            "than the demo's; name one, e.g. eval.judge=minilm-rm)"
        )
    configs = sweep_configs(base, sweep, out)  # every run's config checked before anything runs
    config_env(base)  # an environment passed from Python is refused before the folder is made
    out.mkdir(parents=True, exist_ok=True)
    proxy, gold = make_scorer(base.reward.scorer, base.reward.weights), make_scorer(base.eval.judge)
    # the same held-out prompts as the runs' periodic evaluations, so both share one baseline
    points = best_of_n_points(base, proxy, gold, ns, bon_prompts or base.eval.periodic_prompts)
    ref_proxy, ref_gold = points[0]["proxy"], points[0]["gold"]  # N = 1 is the reference
    for (algo, beta), c in zip(sweep, configs):
        # each run builds its reward from reward.scorer, as `tether train` would, so that its
        # config.yaml names it and `tether train --resume RUN` rebuilds it (the object passed as
        # well was refused: "train(scorer=...) and reward.scorer=... both give the reward"); the
        # judge, which may be fitted, is built once and shared
        run_dir = train(c, judge=gold)
        points += run_points(run_dir, f"{algo} beta={beta:g}")
        _write_csv(points, out / "frontier.csv")
    _write_csv(points, out / "frontier.csv")
    plot_frontier(points, ref_proxy, ref_gold, out / "frontier.png")
    return out


def sweep_configs(base: Config, sweep: list[tuple[str, float]], out: Path) -> list[Config]:
    """One config per ``(algo, kl_coef)`` of the sweep: ``base`` with that trainer and a fixed beta.

    The KL placement and group size are what the user gave (``base.unresolved``); those left
    to the trainer's default are resolved again for each trainer (GRPO: KL in the loss, groups
    of 4; PPO: in the reward, no groups).

    Raises:
        ConfigError: a run of the sweep is not a valid config (e.g. ``kl.kl_in_reward=true``
            with a DPO run), before anything is trained.
    """
    given = getattr(base, "unresolved", {})
    return [
        replace(
            base,
            train=replace(
                base.train, algo=algo, output_dir=str(out / f"{algo}-beta{beta:g}"), save_model=False
            ),
            kl=replace(
                base.kl,
                kl_coef=beta,
                controller="fixed",
                kl_in_reward=given.get("kl.kl_in_reward"),
                kl_in_loss=given.get("kl.kl_in_loss"),
            ),
            rollout=replace(base.rollout, group_size=given.get("rollout.group_size")),
        )
        for algo, beta in sweep
    ]


FIELDS = ["method", "run", "N", "step", "kl", "kl_bound", "proxy", "gold", *QUALITY_KEYS]
"""Columns of frontier.csv."""


def _write_csv(points: list[dict], path: Path) -> None:
    """frontier.csv, replaced whole and never written through a link (:func:`replace_whole`)."""
    text = io.StringIO(newline="")
    w = csv.DictWriter(text, fieldnames=FIELDS, restval="")
    w.writeheader()
    w.writerows(points)
    replace_whole(path, text.getvalue().encode())


def plot_frontier(points: list[dict], ref_proxy: float, ref_gold: float, out: Path) -> Path:
    """Proxy and gold score against KL for every run and best-of-N, with the Gao et al. fits; below
    them the fluency NLL and the repetition rate (distinct-2 for the runs) against KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tether.run.plots import save_png

    fig, grid_axes = plt.subplots(2, 2, figsize=(13, 9.5), sharex=True)
    axes = grid_axes[0]
    _plot_quality(points, grid_axes[1], plt.get_cmap("tab10"))
    runs = list(dict.fromkeys(p["run"] for p in points if p["method"] == "RL"))
    cmap = plt.get_cmap("tab10")
    for ax, key, ref in ((axes[0], "proxy", ref_proxy), (axes[1], "gold", ref_gold)):
        bon = [p for p in points if p["method"] == "best-of-N"]
        ax.plot([p["kl"] for p in bon], [p[key] for p in bon], "k--o", label="best-of-N (reference)")
        for n_pt in bon:
            ax.annotate(
                f"N={n_pt['N']}",
                (n_pt["kl"], n_pt[key]),
                textcoords="offset points",
                xytext=(3, -10),
                fontsize=7,
            )
        for i, run in enumerate(runs):
            pts = sorted((p for p in points if p["run"] == run), key=lambda p: p["step"])
            ax.plot([p["kl"] for p in pts], [p[key] for p in pts], "-o", color=cmap(i), ms=4, label=run)
        all_kl = [p["kl"] for p in points]
        grid = torch.linspace(1e-3, max(all_kl + [1.0]) * 1.05, 200, dtype=torch.float64)
        for form, pts, style in (
            ("bon", bon, "k:"),
            ("rl", [p for p in points if p["method"] == "RL"], "r:"),
        ):
            a, b = fit_gao([p["kl"] for p in pts], [p[key] - ref for p in pts], form)
            if a == a:
                used = sum(p["kl"] > 0 for p in pts)
                # two parameters from a handful of points: a shape to look at, not a measurement
                few = f" ({used} points: illustrative)" if used < FIT_MIN_POINTS else ""
                label = f"fit {'d(a-bd)' if form == 'bon' else 'd(a-b log d)'}: a={a:.3f}, b={b:.3f}{few}"
                ax.plot(grid, ref + gao_curve(a, b, form, grid), style, lw=1.5, label=label)
        ax.set_xlabel("KL(pi || pi_ref), nats per sequence (held out)")
        ax.set_ylabel(f"{key} score")
        ax.set_title(f"{key} score against KL")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_png(fig, out)
    return out


def _plot_quality(points: list[dict], axes, cmap) -> None:
    """Fluency NLL and repetition (runs: also distinct-2, on a second axis) against KL."""
    runs = list(dict.fromkeys(p["run"] for p in points if p["method"] == "RL"))
    bon = [p for p in points if p["method"] == "best-of-N"]
    for ax, key, label in (
        (axes[0], "fluency_nll", "fluency NLL, nats per token (lower = more fluent)"),
        (axes[1], "repetition", "3-gram repetition rate"),
    ):
        pts = [p for p in bon if isinstance(p.get(key), float)]
        if pts:
            ax.plot([p["kl"] for p in pts], [p[key] for p in pts], "k--o", label="best-of-N (reference)")
        for i, run in enumerate(runs):
            rp = sorted((p for p in points if p["run"] == run and key in p), key=lambda p: p["step"])
            if rp:
                ax.plot([p["kl"] for p in rp], [p[key] for p in rp], "-o", color=cmap(i), ms=4, label=run)
        if key == "repetition":
            twin = None
            for i, run in enumerate(runs):
                rp = sorted(
                    (p for p in points if p["run"] == run and "distinct_2" in p), key=lambda p: p["step"]
                )
                if rp:
                    twin = twin or ax.twinx()
                    twin.plot([p["kl"] for p in rp], [p["distinct_2"] for p in rp], ":s", color=cmap(i), ms=3)
            if twin is not None:
                twin.set_ylabel("distinct-2 of the runs (dotted squares)")
        ax.set_xlabel("KL(pi || pi_ref), nats per sequence (held out)")
        ax.set_ylabel(label)
        ax.set_title(label.split(",")[0] + " against KL")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=7)
