"""training.png: the KL panel shows the update guard (its kept KL, its cuts, its ceiling), the anchor
panel its budget and weight."""

from __future__ import annotations

import pytest

from tether.run import plots


def test_the_kl_panel_draws_the_guards_ceiling_its_kept_kl_and_its_cuts(monkeypatch, tmp_path):
    figs = []
    monkeypatch.setattr(plots, "save_png", lambda fig, out: figs.append(fig))
    history = [
        {
            "step": 0,
            "objective/kl": 0.0,
            "guard/kl_kept": 1.0,
            "guard/kl_updated": 1.0,
            "guard/fraction": 1.0,
        },
        {
            "step": 1,
            "objective/kl": 1.0,
            "guard/kl_kept": 2.5,
            "guard/kl_updated": 4.0,
            "guard/fraction": 0.5,
        },
    ]
    plots.plot_training(
        history, tmp_path / "t.png", kl_target=2.5, target_label="budget", guard_ceiling=2.625
    )
    (kl_ax,) = [ax for ax in figs[0].axes if ax.get_title() == dict(plots._PANELS)["objective/kl"]]
    lines = {line.get_label(): line for line in kl_ax.lines}
    assert list(lines["the guard's ceiling"].get_ydata()) == [2.625, 2.625]
    assert list(lines["budget"].get_ydata()) == [2.5, 2.5]
    assert list(lines["after the update (guarded)"].get_ydata()) == [1.0, 2.5]
    (cuts,) = kl_ax.collections  # the one cut update, at the KL it wanted
    assert cuts.get_offsets().tolist() == [[1.0, 4.0]]
    # without the guard: no ceiling drawn
    plots.plot_training(history[:1], tmp_path / "u.png", kl_target=2.5, target_label="budget")
    (kl_ax,) = [ax for ax in figs[1].axes if ax.get_title() == dict(plots._PANELS)["objective/kl"]]
    assert "the guard's ceiling" not in {line.get_label() for line in kl_ax.lines}


def test_the_anchor_panel_draws_its_forward_kl_budget_and_weight(monkeypatch, tmp_path):
    figs = []
    monkeypatch.setattr(plots, "save_png", lambda fig, out: figs.append(fig))
    title = dict(plots._PANELS)["anchor/forward_kl"]
    history = [
        {"step": 0, "anchor/forward_kl": 0.0, "anchor/coef": 0.0},
        {"step": 1, "anchor/forward_kl": 0.04, "anchor/coef": 1.5},
    ]
    plots.plot_training(history, tmp_path / "a.png", anchor_budget=0.03)
    plots.plot_training([{"step": 0, "objective/kl": 0.0}], tmp_path / "b.png")  # no anchor
    (ax,) = [a for a in figs[0].axes if a.get_title() == title]
    assert list(ax.lines[0].get_ydata()) == [0.0, 0.04]  # the training batches' forward KL
    assert list({line.get_label(): line for line in ax.lines}["anchor.budget"].get_ydata()) == [0.03, 0.03]
    (twin,) = [a for a in figs[0].axes if a is not ax and a.bbox.bounds == ax.bbox.bounds]
    assert list(twin.lines[0].get_ydata()) == [0.0, 1.5]  # the weight on its own axis
    (ax,) = [a for a in figs[1].axes if a.get_title() == title]
    assert "no text anchor" in " ".join(t.get_text() for t in ax.texts)


def test_score_vs_kl_says_why_it_is_empty(monkeypatch, tmp_path):
    """No point to draw: without a reference (no KL) it says so; with KL but no sample scored (the
    reward returned None for all) it says that, not that there was no reference."""
    figs = []
    monkeypatch.setattr(plots, "save_png", lambda fig, out: figs.append(fig))
    plots.plot_score_vs_kl([{"step": 0, "objective/scores": 0.5}], tmp_path / "a.png")
    plots.plot_score_vs_kl([{"step": 0, "objective/kl": 0.1, "objective/scores": None}], tmp_path / "b.png")
    said = [" ".join(t.get_text() for t in fig.axes[0].texts) for fig in figs]
    assert "no KL measured: no reference model" in said[0]
    assert "no batch was scored" in said[1] and "no reference" not in said[1]


@pytest.mark.real_plots
def test_the_real_writer_lays_out_and_never_writes_through_a_link(tmp_path):
    """The real save_png (not the tests' stand-in): a PNG of the figure's size, and a link planted
    at its path is replaced, its target untouched."""
    from PIL import Image

    outside = tmp_path / "outside.png"
    outside.write_bytes(b"kept")
    out = tmp_path / "run" / "training.png"
    out.parent.mkdir()
    out.symlink_to(outside)
    plots.plot_training([{"step": 0, "objective/kl": 0.0, "objective/scores": 0.1}], out)
    assert not out.is_symlink() and outside.read_bytes() == b"kept"
    assert Image.open(out).size == (1430, 1408)  # 13 x 12.8 inches at 110 dpi
