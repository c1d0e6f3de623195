"""PNG plots of a run: training curves and score against KL (matplotlib, headless)."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from tether.run.files import replace_whole  # noqa: E402


def save_png(fig, out: Path, dpi: int = 110) -> None:
    """Lay ``fig`` out (``tight_layout``), write it to ``out`` whole and never through a link
    (:func:`tether.run.files.replace_whole`), and close it. Every figure tether draws goes out
    through here (the tests stand a cheap writer in for it: tests/conftest.py, ``real_plots``).

    Raises:
        OSError: the write failed; ``out`` is as it was.
    """
    png = io.BytesIO()
    try:
        fig.tight_layout()
        fig.savefig(png, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    replace_whole(Path(out), png.getvalue())


_PANELS = [
    ("objective/scores", "score (mean)"),
    ("objective/kl", "KL, nats per sequence"),
    ("objective/kl_coef", "kl_coef (beta)"),
    ("objective/rlhf_reward", "score - beta KL"),
    ("objective/entropy", "entropy, nats per token"),
    ("response/length", "response length, tokens"),
    ("eval/fluency_nll", "fluency NLL (held out), nats per token"),
    ("eval/capability_nll", "capability NLL (human text), nats per token"),
    ("response/distinct_2", "distinct-2 (diversity)"),
    ("response/repetition", "3-gram repetition rate"),
    ("anchor/forward_kl", "text anchor: forward KL, nats per token"),
]

_HELD_OUT = {
    "eval/fluency_nll": "eval/fluency_nll",
    "eval/capability_nll": "eval/capability_nll",
    "response/distinct_2": "eval/distinct_2",
    "response/repetition": "eval/repetition",
}
"""Panel -> the periodic evaluation's metric drawn in it, with the reference's (``eval/ref_*``)."""


def _held_out(ax, history: list[dict], key: str) -> None:
    """The periodic evaluation's values of ``key`` (squares, SE bars when logged) and the
    reference's on the same prompts (a dashed line)."""
    rows = [r for r in history if isinstance(r.get(key), (int, float))]
    if rows:
        # its SE, or (capability) the SE of the paired difference from the reference
        se = [r.get(key + "_se", r.get(key + "_change_se", 0.0)) or 0.0 for r in rows]
        ax.errorbar(
            [r["step"] for r in rows],
            [r[key] for r in rows],
            yerr=se,
            fmt="s-",
            lw=1,
            ms=4,
            capsize=2,
            label="held out",
        )
    ref_key = key.replace("eval/", "eval/ref_")
    refs = [r[ref_key] for r in history if isinstance(r.get(ref_key), (int, float))]
    if refs:
        ax.axhline(refs[-1], ls="--", c="gray", label="reference (held out)")


def _empty_note(ax, text: str) -> None:
    """A panel with nothing to draw: why, in gray at its centre."""
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="gray", fontsize=8)


def _anchor(ax, history: list[dict], budget: float | None) -> None:
    """The text anchor's panel: its budget (a dashed line) and its weight (``anchor/coef``, a
    second axis), or a note that the run had no anchor."""
    if not ax.has_data():
        _empty_note(ax, "no text anchor\n(anchor.coef, anchor.budget)")
        return
    if budget is not None:
        ax.axhline(budget, ls="--", c="gray", label="anchor.budget")
    coef = [(r["step"], r["anchor/coef"]) for r in history if isinstance(r.get("anchor/coef"), (int, float))]
    if coef:
        twin = ax.twinx()
        twin.plot(*zip(*coef), c="tab:orange", lw=1, label="weight (anchor/coef)")
        twin.tick_params(labelsize=7)
        twin.legend(fontsize=7, loc="lower right")
    ax.legend(fontsize=7, loc="upper left")


def plot_training(
    history: list[dict],
    out: Path,
    *,
    kl_target: float | None = None,
    target_label: str = "target",
    guard_ceiling: float | None = None,
    anchor_budget: float | None = None,
) -> Path:
    """Eleven panels against step: score, KL (with the target or budget, nats per sequence,
    labelled ``target_label``, and the update guard's ceiling ``kl.budget * (1 + kl.guard_tol)``
    where it is on), beta, RLHF reward, entropy, length, and what the leash protects: the
    held-out fluency NLL, the capability NLL of human text no run trains on, distinct-2 and the
    repetition rate, each against the reference's; and the text anchor's forward KL (with
    ``anchor_budget``, ``anchor.budget``, and the anchor's weight on a second axis, where a
    run has the anchor on)."""
    steps = [r["step"] for r in history]
    rows = -(-len(_PANELS) // 3)
    fig, axes = plt.subplots(rows, 3, figsize=(13, 3.2 * rows))
    for ax in axes.flat[len(_PANELS) :]:
        ax.set_visible(False)
    for ax, (key, label) in zip(axes.flat, _PANELS):
        ys = [r.get(key) for r in history]
        pts = [(s, y) for s, y in zip(steps, ys) if isinstance(y, (int, float))]
        if pts and not key.startswith("eval/"):  # an eval/ panel: drawn as held out, below
            series = "the anchor's text batches" if key.startswith("anchor/") else "training batch"
            ax.plot(*zip(*pts), marker=".", lw=1, label=series)
        if key in _HELD_OUT:
            _held_out(ax, history, _HELD_OUT[key])
            if ax.has_data():
                ax.legend(fontsize=7)
            else:
                _empty_note(
                    ax, "no periodic evaluation\n(eval.every, eval.fluency_model, eval.capability_texts)"
                )
        if key == "objective/scores":
            for ekey, elabel in (
                ("eval/proxy_score", "held-out proxy"),
                ("eval/gold_score", "held-out gold"),
            ):
                ev = [(s, r[ekey]) for s, r in zip(steps, history) if isinstance(r.get(ekey), (int, float))]
                if ev:
                    ax.plot(*zip(*ev), marker="s", lw=1, label=elabel)
            if ax.get_legend_handles_labels()[0]:  # none where no sample was scored (all None)
                ax.legend(fontsize=7)
        if key == "response/length":  # a multi-turn run: the environment's tokens beside the policy's
            env = [
                (s, r["rollout/env_tokens"])
                for s, r in zip(steps, history)
                if isinstance(r.get("rollout/env_tokens"), (int, float))
            ]
            if env:
                for line in ax.lines:  # the training batch's line: the policy's tokens
                    line.set_label("policy's tokens")
                ax.plot(*zip(*env), marker=".", lw=1, label="environment's tokens (rollout.env)")
                ax.legend(fontsize=7)
        if key == "anchor/forward_kl":
            _anchor(ax, history, anchor_budget)
        if key == "objective/kl":
            exact = [
                (s, r["objective/kl_exact"])
                for s, r in zip(steps, history)
                if isinstance(r.get("objective/kl_exact"), (int, float))
            ]
            if exact:
                ax.plot(*zip(*exact), lw=1, alpha=0.7, label="exact (full vocab)")
            # the update guard (kl.guard): the KL its kept update reads, and where it cut one
            kept = [
                (s, r["guard/kl_kept"])
                for s, r in zip(steps, history)
                if isinstance(r.get("guard/kl_kept"), (int, float))
            ]
            if kept:
                ax.plot(*zip(*kept), lw=1, ls=":", label="after the update (guarded)")
                cut = [
                    (s, r["guard/kl_updated"])
                    for s, r in zip(steps, history)
                    if r.get("guard/fraction", 1.0) < 1.0
                ]
                if cut:
                    ax.scatter(
                        *zip(*cut),
                        marker="x",
                        c="crimson",
                        s=18,
                        zorder=3,
                        label="update the guard cut (its KL)",
                    )
            if kl_target is not None:
                ax.axhline(kl_target, ls="--", c="gray", label=target_label)
            if guard_ceiling is not None and kept:
                ax.axhline(guard_ceiling, ls=":", c="crimson", lw=1, label="the guard's ceiling")
            if ax.get_legend_handles_labels()[0]:  # nothing to name without a reference
                ax.legend(fontsize=7)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
        ax.grid(alpha=0.3)
    save_png(fig, out)
    return out


def plot_score_vs_kl(history: list[dict], out: Path, evals: list[dict] | None = None) -> Path:
    """Training score against KL (nats per sequence), colored by step; held-out points on top."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    pts = [
        (r["objective/kl"], r["objective/scores"], r["step"])
        for r in history
        if isinstance(r.get("objective/kl"), (int, float))
        and isinstance(r.get("objective/scores"), (int, float))
    ]
    if pts:
        kl, sc, st = zip(*pts)
        s = ax.scatter(kl, sc, c=st, cmap="viridis", s=18, label="training batches")
        fig.colorbar(s, ax=ax, label="step", pad=0.16)  # room for the gold axis
    gold_ax = None
    for e in evals or []:
        if e["kl"] != e["kl"]:  # no reference: no KL
            continue
        ax.errorbar(e["kl"], e["proxy_mean"], yerr=e["proxy_se"], fmt="s", c="crimson", capsize=3)
        ax.annotate(
            f"{e['name']} (held out)",
            (e["kl"], e["proxy_mean"]),
            textcoords="offset points",
            xytext=(-10, 8),
            fontsize=8,
            color="crimson",
        )
        if "gold_mean" in e:  # the gold judge has its own scale: a second y axis
            gold_ax = gold_ax or ax.twinx()
            gold_ax.errorbar(e["kl"], e["gold_mean"], yerr=e["gold_se"], fmt="D", c="goldenrod", capsize=3)
            gold_ax.annotate(
                f"{e['name']} (gold)",
                (e["kl"], e["gold_mean"]),
                textcoords="offset points",
                xytext=(-10, -14),
                fontsize=8,
                color="goldenrod",
            )
    if gold_ax is not None:
        gold_ax.set_ylabel("gold score, held out (diamonds)", color="goldenrod")
    if not pts:
        any_kl = any(isinstance(r.get("objective/kl"), (int, float)) for r in history)
        ax.text(
            0.5,
            0.5,
            "no batch was scored (the reward returned None for every sample)"
            if any_kl
            else "no KL measured: no reference model\n(kl.kl_coef=0 and kl.monitor=false)",
            transform=ax.transAxes,
            ha="center",
            va="center",
            color="gray",
        )
    ax.margins(x=0.15, y=0.1)
    ax.set_xlabel("KL(pi_theta || pi_ref), nats per sequence")
    ax.set_ylabel("proxy score (dots: training batches; squares: held out)")
    ax.set_title("score against KL")
    ax.grid(alpha=0.3)
    save_png(fig, out)
    return out
