"""tether.core.noise: the sampler's counter-based Gumbel noise. Exact against Python's integers,
a function of (key, position, token) alone, finite at the extremes of its bits, Gumbel in its
moments, and a Gumbel-max sampler with it draws softmax(z / T) (a chi-square on a small
vocabulary, on fixed keys: the same numbers on every run)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tether.core import noise as N
from tether.models.sampling import GumbelMaxSampler, sample_seeds

F64 = torch.float64


def test_mix_is_splitmix64_exactly():
    # SplitMix64 from state 0: the first output is mix(0 + GOLDEN) = 0xE220A8397B1DCDAF (the
    # generator's published first value); the tensor version equals Python's exact integers
    assert N.mix_int(N.GOLDEN) == 0xE220A8397B1DCDAF
    rng = random.Random(0)
    words = [rng.getrandbits(64) for _ in range(2000)] + [0, 1, 2**63, 2**64 - 1]
    got = N.mix(torch.tensor([N._signed(w) for w in words], dtype=torch.int64)).tolist()
    assert [g & N.MASK64 for g in got] == [N.mix_int(w) for w in words]


def test_noise_is_a_function_of_key_position_and_token_only():
    keys = torch.tensor(sample_seeds(3, 1, range(6)), dtype=torch.int64)
    whole = N.gumbel_noise(keys, 4, 50)
    # a row's noise is the same in any batch: alone, shuffled, beside other rows
    assert torch.equal(N.gumbel_noise(keys[2:3], 4, 50), whole[2:3])
    perm = torch.tensor([5, 0, 3, 1, 4, 2])
    assert torch.equal(N.gumbel_noise(keys[perm], 4, 50), whole[perm])
    # a larger vocabulary extends the row (token v's noise does not depend on V)
    assert torch.equal(N.gumbel_noise(keys, 4, 80)[:, :50], whole)
    # another position, another key: other noise
    assert not torch.equal(N.gumbel_noise(keys, 5, 50), whole)
    assert (N.gumbel_noise(keys + 1, 4, 50) != whole).float().mean() > 0.99


def test_uniform_is_never_0_or_1_and_the_noise_stays_finite_at_the_extremes():
    # bits 0 and all ones: u = 2^-53 and 1 - 2^-53, both exact float64 numbers (1 - 2^-54 is not:
    # it rounds to 1, whose log is 0 and whose draw is infinite; 53 bits would hit it)
    bits = torch.tensor([0, -1], dtype=torch.int64)
    u = N.uniform_from_bits(bits)
    assert u[0].item() == 2.0**-53 and u[1].item() == 1.0 - 2.0**-53 and u[1].item() < 1.0
    g = -torch.log(-torch.log(u))
    assert torch.isfinite(g).all()
    # -log(-log 2^-53) = -log(53 log 2) = -3.6040; -log(-log(1 - 2^-53)) = -log(2^-53) = 36.737
    assert g[0].item() == pytest.approx(-math.log(53 * math.log(2)), rel=1e-12)
    assert g[1].item() == pytest.approx(53 * math.log(2), rel=1e-6)


def test_noise_has_gumbel_moments_and_no_correlation_across_rows_positions_tokens():
    keys = torch.tensor(sample_seeds(0, 0, range(64)), dtype=torch.int64)
    g = torch.stack([N.gumbel_noise(keys, t, 4096) for t in range(4)])  # (4, 64, 4096): 1,048,576
    n = g.numel()
    # Gumbel(0, 1): mean Euler's gamma 0.5772, variance pi^2 / 6 = 1.6449; SE of the mean
    # sqrt(1.6449 / n) = 1.25e-3, of the variance sqrt((mu4 - sigma^4) / n) with excess kurtosis
    # 12/5: sqrt(1.6449^2 * (2 + 2.4) / n) = 3.4e-3; each checked at 5 SE
    assert abs(g.mean().item() - 0.5772157) < 5 * math.sqrt(math.pi**2 / 6 / n)
    assert abs(g.var().item() - math.pi**2 / 6) < 5 * math.sqrt((math.pi**2 / 6) ** 2 * 4.4 / n)
    # correlations of neighbours: adjacent tokens, rows, positions; SE 1/sqrt(pairs), 5 SE
    z = (g - g.mean()) / g.std()
    for a, b in ((z[..., 1:], z[..., :-1]), (z[:, 1:], z[:, :-1]), (z[1:], z[:-1])):
        r = (a * b).mean().item()
        assert abs(r) < 5 / math.sqrt(a.numel()), r


def test_the_sampler_draws_softmax_of_the_tempered_logits():
    """Chi-square of 200,000 Gumbel-max draws against softmax(z / T) on 6 tokens, T = 0.7.

    The keys are fixed, so the statistic is the same number on every machine; with 5 degrees of
    freedom, P(chi2 > 30) = 1.5e-5 for an exact sampler, while a sampler off by 1% in one
    token's probability would give about 200,000 * 0.01^2 / p = 20 to 100 more.
    """
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0], dtype=F64)
    T, rows, steps = 0.7, 2000, 100
    sampler = GumbelMaxSampler(sample_seeds(11, 0, range(rows)), T)
    scores = logits.expand(rows, -1).float()
    counts = torch.zeros(6, dtype=F64)
    for _ in range(steps):
        counts += torch.bincount(sampler(None, scores).argmax(-1), minlength=6).to(F64)

    def chi2(temperature: float) -> float:
        expected = torch.softmax(logits / temperature, -1) * rows * steps
        return float(((counts - expected) ** 2 / expected).sum())

    print(f"chi-square {chi2(T):.2f} on 5 degrees of freedom; observed {counts.tolist()}")
    assert chi2(T) < 30, chi2(T)
    # the same draws against a temperature 5% off fail it: the test can fail
    assert chi2(0.7 * 1.05) > 100 and chi2(1.0) > 1000


def test_check_wrapping_refuses_a_device_whose_integers_do_not_wrap(monkeypatch):
    N.check_wrapping.cache_clear()
    monkeypatch.setattr(N, "mix_int", lambda x: 0)  # as if the device's answers were wrong
    with pytest.raises(RuntimeError, match="does not wrap modulo 2\\^64"):
        N.check_wrapping("cpu")
    N.check_wrapping.cache_clear()
