"""Best-of-N KL and the Gao et al. 2022 fits: exact values and recoveries, no sampling."""

from __future__ import annotations

import math

import pytest
import torch

from tether.analysis.frontier import fit_gao, gao_curve
from tether.core.bestofn import (
    bon_kl_bound,
    bon_kl_empirical,
    bon_rank_probs,
    bon_scores,
)


def test_bon_rank_probs_by_hand():
    # n = 2 of m = 2: P(rank 1) = (1/2)^2 = 0.25, P(rank 2) = 1 - 0.25 = 0.75
    assert bon_rank_probs(2, 2).tolist() == [0.25, 0.75]
    for n in (1, 3, 16):
        assert bon_rank_probs(n, 16).sum().item() == pytest.approx(1.0, abs=1e-15)


def test_bon_kl_is_below_the_bound_and_approaches_it():
    assert bon_kl_empirical(1, 16) == pytest.approx(0.0, abs=1e-15) and bon_kl_bound(1) == 0.0
    # n = 2, m = 2: 0.25 log(0.5) + 0.75 log(1.5) = -0.173287 + 0.304099 = 0.130812
    assert bon_kl_empirical(2, 2) == pytest.approx(0.130812, abs=1e-6)
    for n in range(2, 17):
        assert bon_kl_empirical(n, 16) < bon_kl_bound(n)
        # with a continuous reference (m -> inf) the value tends to the bound
        assert bon_kl_empirical(n, 100_000) == pytest.approx(bon_kl_bound(n), abs=1e-3)


def test_bon_scores_pick_by_proxy():
    proxy = torch.tensor([[0.0, 1.0]])
    gold = torch.tensor([[5.0, -5.0]])  # the proxy's favourite is the gold's worst
    p, g = bon_scores(proxy, gold, 2)
    assert p == pytest.approx(0.75) and g == pytest.approx(0.25 * 5 - 0.75 * 5)
    p1, g1 = bon_scores(proxy, gold, 1)
    assert p1 == pytest.approx(0.5) and g1 == pytest.approx(0.0)


@pytest.mark.parametrize("form", ["bon", "rl"])
def test_gao_fit_recovers_known_coefficients(form):
    kl = torch.tensor([0.0, 0.5, 1.0, 2.0, 4.0, 8.0], dtype=torch.float64)
    gain = gao_curve(0.3, 0.05, form, kl)
    a, b = fit_gao(kl.tolist(), gain.tolist(), form)
    assert a == pytest.approx(0.3, abs=1e-9) and b == pytest.approx(0.05, abs=1e-9)
    assert math.isnan(fit_gao([0.0, 1.0], [0.0, 0.1], form)[0])  # one usable point is not enough


def test_sweep_keeps_the_placement_and_group_size_the_user_gave(tmp_path):
    from tether.analysis.frontier import sweep_configs
    from tether.run.config import ConfigError, load_config

    sweep = [("ppo", 0.05), ("grpo", 0.05), ("rloo", 0.1)]
    given = sweep_configs(
        load_config(None, ["kl.kl_in_reward=true", "rollout.group_size=8"]), sweep, tmp_path
    )
    for c, (algo, beta) in zip(given, sweep):
        assert (c.train.algo, c.kl.kl_coef, c.kl.controller) == (algo, beta, "fixed")
        assert c.kl.kl_in_reward and not c.kl.kl_in_loss and c.rollout.group_size == 8, algo
    # left at the defaults, each trainer gets its own: GRPO's KL in the loss, groups of 4; PPO no groups
    ppo, grpo, rloo = sweep_configs(load_config(None, []), sweep, tmp_path)
    assert (ppo.kl.kl_in_reward, ppo.rollout.group_size) == (True, 1)
    assert (grpo.kl.kl_in_loss, grpo.kl.kl_in_reward, grpo.rollout.group_size) == (True, False, 4)
    assert (rloo.kl.kl_in_reward, rloo.rollout.group_size) == (True, 4)
    # a run that cannot be built is refused before any run (and before the folder) exists
    with pytest.raises(ConfigError, match="kl.kl_in_reward"):
        sweep_configs(
            load_config(None, ["kl.kl_in_reward=true"]), [("ppo", 0.1), ("dpo", 0.1)], tmp_path / "f"
        )
    assert not (tmp_path / "f").exists()


def test_best_of_n_samples_take_tool_turns_as_the_runs_do(tiny_model_dir, prompt_file):
    """With rollout.env the reference's best-of-N samples are multi-turn, as the runs they are
    compared with: the scorers read the tool's text in the transcripts."""
    from tests.conftest import TINY_RUN
    from tether.analysis.frontier import best_of_n_points
    from tether.run.config import load_config

    seen: list[str] = []

    def proxy(texts):
        seen.extend(texts)
        return [len(t) / 10 for t in texts]

    settings = {
        **TINY_RUN,
        "model.name": tiny_model_dir,
        "data.prompts": prompt_file,
        "rollout.max_new_tokens": 16,
        "rollout.env": "tests.conftest:tool_env",
        "rollout.max_turns": 2,
        "rollout.stop_strings": "e",
    }
    config = load_config(None, [f"{k}={v}" for k, v in settings.items()])
    points = best_of_n_points(config, proxy, lambda texts: [0.0] * len(texts), [1, 2], n_prompts=4)
    assert [p["N"] for p in points] == [1, 2] and len(seen) == 8  # 4 prompts x 2 samples, scored once
    assert sum(" [tool:" in t for t in seen) >= 3, seen  # the tool answered (some cut by the budget)


def test_an_evaluation_that_scored_nothing_is_a_gap_not_a_crash(tmp_path):
    """metrics.jsonl keeps a score no sample had as null; the frontier read it as None and its
    plot raised TypeError (None - float) after every run of the sweep had trained."""
    import json

    from tether.analysis.frontier import plot_frontier, run_points

    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"step": 0, "eval/kl": 0.0, "eval/proxy_score": 0.1, "eval/gold_score": 0.2, "eval/fluency_nll": 3.0},
        {
            "step": 2,
            "eval/kl": 1.0,
            "eval/proxy_score": None,
            "eval/gold_score": None,
            "eval/fluency_nll": None,
        },
        {"step": 4, "eval/kl": 2.0, "eval/proxy_score": 0.4, "eval/gold_score": 0.3, "eval/fluency_nll": 3.1},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pts = run_points(run, "ppo beta=0.1")
    assert [p["gold"] for p in pts][::2] == [0.2, 0.3] and math.isnan(pts[1]["gold"])
    assert math.isnan(pts[1]["proxy"]) and math.isnan(pts[1]["fluency_nll"])
    # the unscored point is left out of the fit: the fit of the other two, (0, 1) and (1, 2) in d
    assert fit_gao([1.0, 2.0, 4.0], [0.1, math.nan, 0.3], "rl") == fit_gao([1.0, 4.0], [0.1, 0.3], "rl")
    bon = [{"method": "best-of-N", "run": "bon-1", "N": 1, "step": "", "kl": 0.0, "proxy": 0.1, "gold": 0.2}]
    plot_frontier(bon + pts, 0.1, 0.2, tmp_path / "frontier.png")  # no TypeError
    assert (tmp_path / "frontier.png").exists()


def test_a_prompt_with_no_quality_value_is_left_out_not_zero():
    # prompt 0's two samples repeat half their 3-grams (0.5 each); prompt 1's are shorter than 3
    # words, so neither has a repetition rate. The old fill gave prompt 1 the value 0 and the
    # best-of-1 repetition (0.5 + 0) / 2 = 0.25; left out, it is prompt 0's alone, 0.5.
    from types import SimpleNamespace

    from tether.analysis.frontier import _per_sample_quality
    from tether.core.bestofn import bon_scores

    c = SimpleNamespace(eval=SimpleNamespace(fluency_model="none"))
    texts = ["great great great great", "good good good good", "ok", "no"]
    rep = _per_sample_quality(c, SimpleNamespace(prompts=["a", "b"]), texts, 2)["repetition"]
    assert rep[0].tolist() == [0.5, 0.5] and rep[1].isnan().all()
    keep = ~rep.isnan().any(-1)
    assert bon_scores(torch.zeros(1, 2), rep[keep], 1)[1] == 0.5


@pytest.mark.real_plots
def test_a_frontier_with_a_reward_named_on_the_command_line(tiny_model_dir, prompt_file, tmp_path, capsys):
    """``tether frontier ... reward.scorer=module:function`` failed before its first run: the
    frontier passed each run the reward it had built while the config named it ("train(scorer=...)
    and reward.scorer='...' both give the reward"). Each run now builds it from the config, whose
    config.yaml then names it, so ``tether train --resume`` rebuilds it."""
    from PIL import Image

    from tests.conftest import tiny_run_args
    from tether.cli import main
    from tether.run.config import load_config

    out = tmp_path / "frontier"
    overrides = {
        "reward.scorer": "tests.conftest:length_judge",
        "eval.judge": "tests.conftest:one_if_long",
        "eval.n_prompts": 4,
        "eval.every": 1,
        "eval.periodic_prompts": 4,
        "train.steps": 2,
        "train.checkpoint_every": 2,  # the frontier sets 0: a checkpoint to resume from
    }
    args = tiny_run_args(tiny_model_dir, prompt_file, out, overrides)
    args = [a for a in args if not a.startswith("train.output_dir=")]
    code = main(
        ["frontier", "--out", str(out), "--sweep", "ppo:0.05", "--bon", "1,2", "--bon-prompts", "4", *args]
    )
    assert code == 0, capsys.readouterr().err
    run = out / "ppo-beta0.05"
    assert load_config(run / "config.yaml", []).reward.scorer == "tests.conftest:length_judge"
    assert (out / "frontier.csv").exists()
    assert Image.open(out / "frontier.png").size[0] > 1000  # drawn whole (13 inches at 110 dpi)
    assert main(["train", "--resume", str(run), "train.steps=3"]) == 0
