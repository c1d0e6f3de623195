"""training.png's KL panel shows the update guard: its kept KL, its cuts and its ceiling."""

from __future__ import annotations

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
