"""What a reward may return (issue 50's adversarial review): a sequence of real numbers or None,
each refused kind named; a reward list's failure told once; no coroutine left unawaited."""

from __future__ import annotations

import gc
import math
import re
import warnings

import numpy as np
import pytest
import torch

from tether.judges.contract import ScorerFailed, ScorerStopped, WeightedReward, checked_scores

TEXTS = ["a", "bb", "ccc", "dddd"]


@pytest.mark.parametrize(
    "returned",
    [
        [1, 2.5, True, None],
        (1, 2.5, True, None),
        np.array([1.0, 2.5, 1.0, np.nan])[:3].tolist() + [None],
        [np.float32(1.0), np.int64(2), np.bool_(True), None],  # NumPy scalars
        [torch.tensor(1.0), torch.tensor(2), torch.tensor(True), None],  # 0-D tensors
    ],
)
def test_a_sequence_of_numbers_or_none_is_taken(returned):
    got = checked_scores(lambda completions, **kw: returned, TEXTS, 0, TEXTS, allow_none=True)
    assert got[:3] == [1.0, float(returned[1]), 1.0] and math.isnan(got[3])


@pytest.mark.parametrize(
    "returned",
    [np.array([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 2.0, 3.0, 4.0]), np.arange(1, 5)],
)
def test_a_1d_array_or_tensor_is_taken(returned):
    assert checked_scores(lambda completions, **kw: returned, TEXTS, 0, TEXTS) == [1.0, 2.0, 3.0, 4.0]


@pytest.mark.parametrize(
    "returned, said",
    [
        # each was read as numbers before: a dict's keys [0, 1, 2, 3], a string's characters
        ({0: 5.0, 1: 5.0, 2: 5.0, 3: 5.0}, "the scorer returned a dict; it must return a list of one float"),
        ("0123", "the scorer returned a str; it must return a list of one float per text"),
        (b"0123", "the scorer returned a bytes; it must return a list"),
        ({1.0, 2.0, 3.0, 4.0}, "the scorer returned a set; it must return a list"),
        ((float(i) for i in range(4)), "the scorer returned a generator; it must return a list"),
        (np.ones((4, 1)), "the scorer returned a 2-D ndarray; it must return a list"),
        (torch.tensor(1.0), "the scorer returned a 0-D Tensor; it must return a list"),
        (4.0, "the scorer returned a float; it must return a list"),
        (None, "the scorer returned a NoneType; it must return a list"),
        # a list of numeric strings was parsed by float()
        (["1", "2", "3", "4"], "the scorer returned a str ('1') for text 0 and 3 more; each score must be"),
        ([1.0, 2.0, [3.0], 4.0], "the scorer returned a list ([3.0]) for text 2; each score must be"),
        ([1.0, 2.0, 3.0, 1j], "the scorer returned a complex (1j) for text 3; each score must be"),
    ],
)
def test_what_is_not_a_sequence_of_numbers_is_refused_by_name(returned, said):
    with pytest.raises(ScorerFailed, match="^" + re.escape(f"step 3: {said}")):
        checked_scores(lambda completions, **kw: returned, TEXTS, 3, TEXTS, allow_none=True)
    with pytest.raises(
        ScorerFailed, match="^" + re.escape(f"step 3: reward 'r': {said}")
    ):  # in a list: named once
        checked_scores(WeightedReward({"r": lambda completions, **kw: returned}), TEXTS, 3, TEXTS)


def test_a_failing_reward_of_a_list_is_told_once():
    """A failing reward in a list said "the scorer failed on 4 texts (ScorerFailed: reward 'x':
    the scorer failed on 4 texts (...); it must return one float per text); it must return one
    float per text": the reward's error wrapped in a second failure. Now the step, the reward and
    its error, once; so for a sync reward, an async one and one that exits."""

    def fails(completions, **kw):
        raise KeyError("boom")

    async def afails(completions, **kw):
        raise KeyError("boom")

    def ok(completions, **kw):
        return [1.0] * len(completions)

    for bad in (fails, afails):
        with pytest.raises(ScorerFailed) as e:
            checked_scores(WeightedReward({"ok": ok, "x": bad}), TEXTS, 2, TEXTS)
        assert str(e.value) == (
            "step 2: reward 'x': the scorer failed on 4 texts (KeyError: 'boom'); "
            "it must return one float per text"
        )
        assert isinstance(e.value.__cause__, KeyError)

    def exits(completions, **kw):
        raise SystemExit(3)

    with pytest.raises(ScorerStopped, match=r"^step 2: reward 'x': the scorer raised SystemExit\(3\)"):
        checked_scores(WeightedReward({"ok": ok, "x": exits}), TEXTS, 2, TEXTS)


def test_a_sync_reward_that_raises_leaves_no_coroutine_unawaited():
    """A sync reward of a list that raised after an async one was called left that one's
    coroutine never awaited: "RuntimeWarning: coroutine 'later' was never awaited". Now the
    coroutines made are closed."""

    async def later(completions, **kw):
        return [1.0] * len(completions)

    def fails(completions, **kw):
        raise ValueError("boom")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ScorerFailed, match="boom"):
            checked_scores(WeightedReward({"later": later, "fails": fails}), TEXTS, 0, TEXTS)
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]
