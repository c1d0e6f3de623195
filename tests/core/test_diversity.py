"""Diversity measures (tether.core.diversity) on hand-worked texts, and the evaluation's
standard errors over prompts (tether.run.evaluation)."""

from __future__ import annotations

import math

import pytest

from tether.core.diversity import bleu, distinct_n, ngrams, repetition, self_bleu, words
from tether.run.evaluation import EvalResult, compare, jackknife_se, prompt_means


def test_words_lowercases_and_splits_punctuation():
    assert words("Great, GREAT fun!") == ["great", ",", "great", "fun", "!"]
    assert words("it's   fine") == ["it's", "fine"]
    assert words("") == []


def test_distinct_n_hand_worked():
    # 2-grams: "a b a b" -> ab, ba, ab; "a b c" -> ab, bc: 5 in all, distinct {ab, ba, bc} = 3
    assert distinct_n(["a b a b", "a b c"], 2) == 3 / 5
    # 1-grams: a b a b a b c = 7 words, distinct {a, b, c} = 3
    assert distinct_n(["a b a b", "a b c"], 1) == 3 / 7
    assert distinct_n(["one", "two"], 2) != distinct_n(["one", "two"], 2)  # NaN: no 2-gram
    assert distinct_n(["x y z"], 3) == 1.0
    with pytest.raises(ValueError, match="n >= 1"):
        distinct_n(["a"], 0)


def test_repetition_hand_worked():
    # "great great great great": 3-grams (g g g) twice, 1 distinct: 1 - 1/2 = 0.5
    assert repetition("great great great great") == 0.5
    # "a b c a b c": abc, bca, cab, abc: 3 distinct of 4: 1 - 3/4 = 0.25
    assert repetition("a b c a b c") == 0.25
    assert repetition("no repeats at all here") == 0.0
    assert repetition("too short") is None


def test_bleu_hand_worked():
    # hypothesis a b c, reference a b d: p1 = 2/3; p2 = (1 + 1)/(2 + 1) = 2/3 (ab matches, bc not)
    # BP = 1 (equal lengths); BLEU-2 = exp((log 2/3 + log 2/3) / 2) = 2/3
    assert bleu(["a", "b", "c"], [["a", "b", "d"]], max_n=2) == pytest.approx(2 / 3, rel=1e-15)
    # identical texts of 4 words: p1 = 1, p2 = (3+1)/(3+1), p3 = (2+1)/(2+1), p4 = (1+1)/(1+1): 1
    assert bleu(list("abcd"), [list("abcd")]) == 1.0
    # no shared word: p1 = 0, BLEU 0
    assert bleu(["x"], [["y"]]) == 0.0
    # brevity: hypothesis "a" (c = 1) against "a b" (r = 2): p1 = 1, BP = exp(1 - 2/1) = e^-1;
    # max_n = 1
    assert bleu(["a"], [["a", "b"]], max_n=1) == pytest.approx(math.exp(-1.0), rel=1e-15)
    # clipping: "a a a" against "a": p1 = min(3, 1)/3 = 1/3, c = 3 >= r = 1, BP = 1
    assert bleu(["a", "a", "a"], [["a"]], max_n=1) == pytest.approx(1 / 3, rel=1e-15)
    with pytest.raises(ValueError, match="reference"):
        bleu(["a"], [])


def test_self_bleu_is_high_for_copies_and_skips_single_texts():
    same = self_bleu([["the film was great fun", "the film was great fun"]])
    assert same == [1.0]
    varied = self_bleu([["the film was great fun", "a slow story of two sisters"]])
    assert varied[0] < 0.2
    assert self_bleu([["only one"]]) == []
    # symmetric pair: each text against the other, the mean of the two BLEUs
    a, b = words("a b c"), words("a b d")
    assert self_bleu([["a b c", "a b d"]], max_n=2) == [
        pytest.approx((bleu(a, [b], 2) + bleu(b, [a], 2)) / 2)
    ]


def test_ngrams():
    assert ngrams(["a", "b", "c"], 2) == [("a", "b"), ("b", "c")]
    assert ngrams(["a"], 2) == []


def test_prompt_means_and_jackknife_hand_worked():
    # k = 2: prompts (1, 3) and (5, None): means 2 and 5
    assert prompt_means([1, 3, 5, None], 2) == [2.0, 5.0]
    assert prompt_means([None, None, 4, 4], 2) == [4.0]
    # jackknife of the mean over 3 groups of one number each equals the usual SE of the mean:
    # values 1, 2, 6: mean 3, sample var ((4 + 1 + 9) / 2) = 7, SE = sqrt(7 / 3)
    groups = [["1"], ["2"], ["6"]]

    def mean_of(texts):
        return sum(float(t) for t in texts) / len(texts)

    assert jackknife_se(groups, mean_of) == pytest.approx(math.sqrt(7 / 3), rel=1e-12)
    assert jackknife_se([["1"]], mean_of) != jackknife_se([["1"]], mean_of)  # NaN


def _result(name, responses, proxy, fluency, k=2):
    return EvalResult(
        name,
        responses,
        kl_per_sequence=[0.0] * len(responses),
        scores={"proxy": proxy},
        samples_per_prompt=k,
        fluency_nll=fluency,
    )


def test_eval_summary_and_compare_are_over_prompts():
    ref = _result(
        "reference", ["a b c d", "e f g h", "i j k l", "m n o p"], [0.0, 1.0, 1.0, 0.0], [2.0, 3.0, 2.0, 2.0]
    )
    pol = _result(
        "policy",
        ["good good good good", "good good good good", "great great", "great great"],
        [1.0, 1.0, 1.0, 1.0],
        [5.0, 5.0, None, 6.0],
    )
    s = ref.summary()
    # per-prompt means 0.5 and 0.5: mean 0.5, SE 0
    assert (s["proxy_mean"], s["proxy_se"]) == (0.5, 0.0)
    # fluency per prompt 2.5 and 2.0: mean 2.25, SE = |2.5 - 2.0| / 2 = 0.25 (n = 2)
    assert s["fluency_nll_mean"] == 2.25 and s["fluency_nll_se"] == pytest.approx(0.25)
    assert s["distinct_2"] == 1.0 and s["repetition"] == 0.0
    p = pol.summary()
    # "good good good good" x2: 2-grams (good good) x6, "great great" x2: (great great) x2:
    # 2 distinct of 8
    assert p["distinct_2"] == 2 / 8
    # repetition: "good good good good" 0.5 each (prompt mean 0.5); "great great" has no 3-gram
    assert p["repetition"] == 0.5
    assert p["self_bleu"] == 1.0  # each prompt's two completions are copies
    out = compare(ref, pol)
    assert out["n_prompts"] == 2 and out["gain"] == 0.5
    # fluency: policy prompts 5.0 and 6.0 (None left out): 5.5 - 2.25 = 3.25
    assert out["fluency_nll_change"] == pytest.approx(3.25)
    assert out["distinct_2_change"] == pytest.approx(2 / 8 - 1.0)
    # head(1) keeps prompt 0's two samples
    assert ref.head(1).responses == ["a b c d", "e f g h"]
    back = EvalResult.from_json(pol.to_json())
    assert back.fluency_nll == pol.fluency_nll and back.samples_per_prompt == 2
