"""The step's KL attribution (tether.trainers.kl_tokens) on a hand-built batch: which steps write
a record, a misaligned token told apart from drift, and the record's numbers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tether.trainers.kl_tokens import KLAttribution


class Letters:
    """A tokenizer whose id i decodes to the i-th letter (specials: id 0 '<e>')."""

    def decode(self, ids, **kw):
        return "".join("<e>" if i == 0 else chr(ord("a") + i) for i in ids)


def _batch():
    # 2 rows of 3 positions; row 1's last slot is padding. Exact KL: row 0 [0.1, 0.5, 0.2], row 1
    # [0.3, 0.9 (the end token, id 0), pad]. The sampler's log-prob of row 1's first token is 0.5
    # nats off the learner's: misaligned (> 0.1); the others agree to 1e-6 (rounding)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.5, -0.5, 0.0]])
    sampler = old + torch.tensor([[1e-6, 0.0, 0.0], [0.5, 0.0, 0.0]])
    rollout = SimpleNamespace(
        response_mask=mask,
        response_ids=torch.tensor([[1, 2, 3], [4, 0, 0]]),
        prompt_ids=torch.tensor([[5, 6], [0, 7]]),
        prompt_mask=torch.tensor([[1, 1], [0, 1]]),
        sampler_logprobs=sampler,
    )
    exact = torch.tensor([[0.1, 0.5, 0.2], [0.3, 0.9, 7.0]])
    ref = old - torch.tensor([[0.05, 0.4, 0.1], [0.2, 0.7, 0.0]])
    top = {
        "policy": (torch.tensor([[[1], [2], [3]], [[4], [0], [0]]]), torch.full((2, 3, 1), -0.1)),
        "reference": (torch.tensor([[[1], [9], [3]], [[4], [9], [0]]]), torch.full((2, 3, 1), -0.2)),
    }
    return rollout, exact, old, ref, top


def test_the_metrics_the_misaligned_token_and_the_record_by_hand():
    rollout, exact, old, ref, top = _batch()
    att = KLAttribution(tokenizer=Letters(), special_ids=[0], jump=0.5, budget=1.0)
    kw = dict(rollout=rollout, exact_kl=exact, old_logprobs=old, ref_logprobs=ref, top=top)
    metrics, record = att.step(0, reading=0.5, **kw)  # no previous step: no record
    assert record is None
    # counted: 0.1 0.5 0.2 0.3 0.9, summed 2.0; the end token (id 0) 0.9 -> 0.45; the misaligned
    # token 0.3 -> 0.15; top-1 agreement: positions (0,1) and (1,1) disagree -> 3 of 5
    assert metrics["kl/special_token_share"] == pytest.approx(0.45, rel=1e-6)
    assert metrics["kl/misaligned_share"] == pytest.approx(0.15, rel=1e-6)
    assert metrics["kl/top1_agreement"] == pytest.approx(0.6, rel=1e-12)
    assert metrics["kl/token_max"] == pytest.approx(0.9, rel=1e-6)
    # a rise of 0.5 -> 0.8 is +60% > 50%: a jump, written
    _, record = att.step(1, reading=0.8, **kw)
    assert record["reason"] == "jump" and record["previous_kl"] == 0.5
    first = record["positions"][0]
    assert (first["row"], first["position"], first["token"], first["context"]) == (1, 1, "<e>", "he")
    assert first["k1"] == pytest.approx(0.7, rel=1e-5) and first["misaligned"] is False
    misaligned = [p for p in record["positions"] if p["misaligned"]]
    assert [(p["row"], p["position"]) for p in misaligned] == [(1, 0)]
    assert [p["kl"] for p in record["positions"]] == pytest.approx([0.9, 0.5, 0.3, 0.2, 0.1], rel=1e-6)
    assert record["top_share"] == pytest.approx(1.0, rel=1e-6)  # 5 positions, all listed
    # the same batch again: no rise, the ids explain nothing (the rise is 0)
    assert record["rise"]["kl_sum"] == pytest.approx(0.0, abs=1e-12) and record["rise"]["explained"] is None
    # the heat map: row 1's tokens with their KL, up to its last policy token (the padding left out)
    assert record["responses"]["1"] == [["e", pytest.approx(0.3)], ["<e>", pytest.approx(0.9)]]
    # crossing the budget of 1.0 (0.8 -> 1.1, +37.5%: no jump) writes a record too; staying over does not
    assert att.step(2, reading=1.1, **kw)[1]["reason"] == "budget"
    assert att.step(3, reading=1.2, **kw)[1] is None
    att.every = 5
    assert att.step(5, reading=1.2, **kw)[1]["reason"] == "every"


def test_the_state_round_trips():
    rollout, exact, old, ref, top = _batch()
    att = KLAttribution(tokenizer=Letters(), special_ids=[0])
    att.step(0, reading=0.5, rollout=rollout, exact_kl=exact, old_logprobs=old, ref_logprobs=ref, top=top)
    again = KLAttribution(tokenizer=Letters(), special_ids=[0])
    again.load_state_dict(att.state_dict())
    assert again.previous == 0.5 and again.previous_by_id == att.previous_by_id
    again.load_state_dict({})  # a checkpoint from before the attribution: nothing to compare with
    assert again.previous is None and again.previous_by_id == {}
