"""pass@k (Chen et al. 2021, eq. 1) against counting every k-subset, and the held-out summary's use of it."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest

from tether.core.passk import ks_up_to, pass_at_k
from tether.run.evaluation import EvalResult, compare


def _enumerated(n: int, c: int, k: int) -> Fraction:
    # the share of the C(n, k) subsets of k samples that hold a right one, counted
    right = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(right[i] for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_equals_the_share_of_subsets_holding_a_right_sample(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            exact = _enumerated(n, c, k)
            # the product of at most n factors, each rounded once: within n ulps of the count
            assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=n * 2**-52)


def test_its_extremes_are_exact():
    assert pass_at_k(16, 0, 16) == 0.0  # nothing right: 0, not a rounding of it
    assert pass_at_k(16, 1, 16) == 1.0  # n - c < k: every subset holds the right one
    assert pass_at_k(16, 16, 1) == 1.0
    # k = 1 is the mean: 1 - (1 - 1/16) ... (1 - 1/12) = 1 - 11/16 = 5/16 for c = 5
    assert pass_at_k(16, 5, 1) == pytest.approx(5 / 16, abs=1e-15)
    # hand-worked: n = 4, c = 1, k = 2: 1 - C(3, 2) / C(4, 2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5, abs=1e-15)
    assert 1 - math.comb(15, 8) / math.comb(16, 8) == pytest.approx(pass_at_k(16, 1, 8), abs=1e-15)


@pytest.mark.parametrize("n, c, k", [(4, 1, 0), (4, 1, 5), (4, 5, 2), (4, -1, 2)])
def test_out_of_range_arguments_are_refused(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_ks_up_to_n():
    assert ks_up_to(16) == [1, 2, 4, 8, 16]
    assert ks_up_to(6) == [1, 2, 4, 6]
    assert ks_up_to(1) == [1]


def _result(name, proxy, k=4):
    responses = [f" {i}" for i in range(len(proxy))]
    return EvalResult(
        name, responses, kl_per_sequence=[0.0] * len(proxy), scores={"proxy": proxy}, samples_per_prompt=k
    )


def test_a_checkers_summary_has_pass_at_k_and_its_change_paired_by_prompt():
    # two prompts of 4 samples: the reference gets 1 and 0 right, the policy 2 and 0
    ref = _result("reference", [1, 0, 0, 0, 0, 0, 0, 0])
    pol = _result("policy", [1, 1, 0, 0, 0, 0, 0, 0])
    s = pol.summary()
    # pass@2 of prompt 1: 1 - C(2, 2) / C(4, 2) = 1 - 1/6 = 5/6; prompt 2: 0; mean 5/12
    assert s["proxy_pass@2"] == pytest.approx(5 / 12, abs=1e-15)
    assert s["proxy_pass@4"] == 0.5 and s["proxy_pass@1"] == pytest.approx(0.25, abs=1e-15)
    out = compare(ref, pol)
    # reference's pass@2 of prompt 1: 1 - C(3, 2) / C(4, 2) = 1/2; the change (5/6 - 1/2 + 0) / 2 = 1/6
    assert out["pass@2_gain"] == pytest.approx(1 / 6, abs=1e-15)
    assert out["pass@1_gain"] == pytest.approx(out["gain"], abs=1e-15)  # pass@1 is the mean score
    # distinct responses per prompt: every response differs here, 4 of 4
    assert s["distinct_responses"] == 4.0


def test_a_graded_or_unscored_score_has_no_pass_at_k():
    assert not any("pass@" in key for key in _result("graded", [0.5, 1, 0, 0]).summary())
    assert not any("pass@" in key for key in _result("unscored", [None, 1, 0, 0]).summary())
    assert not any("pass@" in key for key in _result("one sample", [1, 0], k=1).summary())


def test_an_evaluation_of_k_samples_sharing_each_prompt_equals_one_without(tiny_tokenizer, tiny_lm):
    """eval.samples_per_prompt > 1 runs each prompt through the trunk once (sampling and scoring):
    the same samples, scores and KL as running every row whole, to float32 rounding."""
    import copy
    from dataclasses import replace

    import torch

    from tether.models.rollouts import OneTurn, SamplingSettings
    from tether.run.evaluation import EvalSettings, evaluate

    reference = copy.deepcopy(tiny_lm)
    with torch.no_grad():  # another model, so the KL is not 0
        for p in reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    from tether.models.head import shares_prefix

    # prompts of 20+ tokens: past SHARED_PREFIX_MIN_POSITIONS (16), so the prefix is shared
    assert shares_prefix(tiny_lm, 20)
    prompts = [" ".join(["word"] * 20 + [str(i)]) for i in range(3)]
    sampler = OneTurn(
        tiny_tokenizer, SamplingSettings(max_new_tokens=4, temperature=1.0, max_prompt_tokens=64)
    )
    settings = EvalSettings(seed=7, batch_size=6, samples_per_prompt=4, share_prefix=True)
    length = {"length": lambda completions, **kw: [float(len(c)) for c in completions]}
    kwargs = dict(reference=reference, sampler=sampler, scorers=length, prompts=prompts)
    shared = evaluate("policy", tiny_lm, settings=settings, **kwargs)
    whole = evaluate("policy", tiny_lm, settings=replace(settings, share_prefix=False), **kwargs)
    assert shared.responses == whole.responses and shared.scores == whole.scores
    # per sequence, 4 tokens' log-ratios; each log-prob O(10) with float32 rounding ~1e-6 of it
    # in a reordered attention sum: under 4 x 2 x 1e-5 = 8e-5
    assert shared.kl_per_sequence == pytest.approx(whole.kl_per_sequence, abs=1e-4)
    assert max(abs(x) for x in whole.kl_per_sequence) > 1e-3  # a KL that could differ
