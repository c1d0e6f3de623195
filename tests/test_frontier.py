"""Best-of-N KL and the Gao et al. 2022 fits: exact values and recoveries, no sampling."""

from __future__ import annotations

import math

import pytest
import torch

from tether.bestofn import bon_kl_bound, bon_kl_empirical, bon_rank_probs, bon_scores
from tether.frontier import fit_gao, gao_curve


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
