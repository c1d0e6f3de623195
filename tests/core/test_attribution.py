"""The KL attribution (tether.core.attribution) on a small batch worked by hand, with a mask with
holes (an environment's token inside a response, padding after the end)."""

from __future__ import annotations

import math

import pytest
import torch

from tether.core.attribution import (
    kl_by_token_id,
    position_deciles,
    rise_by_token_id,
    token_kl_summary,
)

# row 0: 5 positions, position 2 is an environment's token (KL 0.7 there must not count);
# row 1: one policy token, then padding (9.9 must not count)
KL = torch.tensor([[0.1, 0.2, 0.7, 0.3, 0.4], [1.0, 9.9, 9.9, 9.9, 9.9]])
MASK = torch.tensor([[True, True, False, True, True], [True, False, False, False, False]])
IDS = torch.tensor([[5, 7, 3, 5, 2], [7, 0, 0, 0, 0]])


def test_position_deciles_bin_the_policy_tokens_only():
    # row 0 counts 4 tokens: k = 0, 1, 2, 3 -> floor(10 k / 4) = 0, 2, 5, 7; the hole is -1;
    # row 1 counts 1 token: decile 0; a row of 20 puts two in each decile
    d = position_deciles(MASK)
    assert d.tolist() == [[0, 2, -1, 5, 7], [0, -1, -1, -1, -1]]
    assert position_deciles(torch.ones(1, 20, dtype=torch.bool)).tolist() == [[k // 2 for k in range(20)]]
    assert position_deciles(torch.zeros(2, 3, dtype=torch.bool)).tolist() == [[-1] * 3] * 2


def test_the_summary_equals_the_hand_worked_batch():
    m = MASK
    kl, decile = KL[m], position_deciles(m)[m]  # counted tokens: 0.1, 0.2, 0.3, 0.4, 1.0
    special = (IDS == 2)[m]  # id 2 ends row 0: its 0.4
    agree = torch.tensor([True, False, True, True, False])
    misaligned = torch.tensor([False, False, False, False, True])  # row 1's token
    out = token_kl_summary(kl, special=special, decile=decile, agree=agree, misaligned=misaligned)
    want = {
        # sorted 0.1 0.2 0.3 0.4 1.0, n = 5: quantile q at index 4 q, linear between neighbours
        "token_p50": 0.3,  # index 2
        "token_p90": 0.4 + 0.6 * (1.0 - 0.4),  # index 3.6: 0.76
        "token_p99": 0.4 + 0.96 * (1.0 - 0.4),  # index 3.96: 0.976
        "token_max": 1.0,
        "top1pct_share": 1.0 / 2.0,  # ceil(0.01 * 5) = 1 token, 1.0 of the summed 2.0
        "special_token_share": 0.4 / 2.0,
        "misaligned_share": 1.0 / 2.0,
        "decile_0": (0.1 + 1.0) / 2,  # row 0's first token and row 1's only one
        "decile_2": 0.2,
        "decile_5": 0.3,
        "decile_7": 0.4,
        "top1_agreement": 3 / 5,
    }
    assert set(out) == set(want)
    for k, v in want.items():  # float32 inputs: each value within a few float32 ulps of 1
        assert out[k] == pytest.approx(v, rel=1e-6), k


def test_no_share_where_there_is_no_kl_and_nothing_without_tokens():
    # step 0: the policy is the reference, every exact KL 0: quantiles 0, no share (0 / 0)
    z = torch.zeros(4)
    out = token_kl_summary(
        z, special=torch.ones(4, dtype=torch.bool), decile=torch.zeros(4, dtype=torch.long)
    )
    assert out == {"token_p50": 0.0, "token_p90": 0.0, "token_p99": 0.0, "token_max": 0.0, "decile_0": 0.0}
    empty = torch.zeros(0)
    assert token_kl_summary(empty, special=empty.bool(), decile=empty.long()) == {}
    with pytest.raises(ValueError, match="special has 3 values for 4 tokens"):
        token_kl_summary(z, special=torch.ones(3, dtype=torch.bool), decile=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="top_share"):
        token_kl_summary(z, special=z.bool(), decile=z.long(), top_share=0.0)


def test_kl_by_token_id_and_its_rise_by_hand():
    now = kl_by_token_id(KL[MASK], IDS[MASK])
    # id 5: 0.1 + 0.3 (2 tokens), id 7: 0.2 + 1.0 (2), id 2: 0.4 (1); the hole's id 3 is not counted
    assert set(now) == {5, 7, 2}
    assert now[5][0] == pytest.approx(0.4, rel=1e-6) and now[5][1] == 2
    assert now[7][0] == pytest.approx(1.2, rel=1e-6) and now[7][1] == 2
    assert now[2][0] == pytest.approx(0.4, rel=1e-6) and now[2][1] == 1
    before = {5: (0.4, 2), 3: (0.5, 1)}
    # rises: 5: 0, 7: 1.2, 2: 0.4, 3: -0.5; total 2.0 - 0.9 = 1.1; the top 2 (7, 2) add 1.6, which
    # is 1.6 / 1.1 of the rise (ids that fell make the listed ones explain more than all of it)
    listed, total, explained = rise_by_token_id(now, before, top=2)
    assert [i for i, _ in listed] == [7, 2]
    assert total == pytest.approx(1.1, rel=1e-6) and explained == pytest.approx(1.6 / 1.1, rel=1e-6)
    # a fall has nothing to explain
    assert math.isnan(rise_by_token_id(before, now)[2])
    assert kl_by_token_id(torch.zeros(0), torch.zeros(0, dtype=torch.long)) == {}


def test_special_token_ids_hold_the_end_ids_the_special_ids_and_the_added_special_tokens():
    from types import SimpleNamespace

    from tether.models.sampling import special_token_ids

    # EOS 2, the special ids 0 (BOS) and 2, an added special token 5 (a chat delimiter such as
    # <|im_end|>), an added plain token 6 (not special), a generation config that also ends on 9
    tok = SimpleNamespace(
        eos_token_id=2,
        all_special_ids=[0, 2],
        added_tokens_decoder={5: SimpleNamespace(special=True), 6: SimpleNamespace(special=False)},
    )
    lm = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[2, 9]))
    assert special_token_ids(tok, lm) == [0, 2, 5, 9]
    assert special_token_ids(SimpleNamespace(eos_token_id=None)) == []


def test_top_logprobs_recovered_from_the_sampled_tokens_equal_a_fresh_log_softmax():
    # fast path (the normalizer from the sampled token's log-prob) against the slow one (a fresh
    # log-softmax over the vocabulary), at temperature 0.7 on random logits of scale 5: they agree
    # to float32 rounding of a logsumexp of ~|z| / T ~ 20 nats, a few 1e-6
    from tether.core.logprobs import logprobs_from_logits
    from tether.models.scoring import top_logprobs

    g = torch.Generator().manual_seed(0)
    z = 5 * torch.randn(3, 4, 50, generator=g)
    tokens = torch.randint(0, 50, (3, 4), generator=g)
    lp = logprobs_from_logits(z, tokens, 0.7)
    ids, fast = top_logprobs(z, 5, 0.7, tokens=tokens, logprobs=lp)
    slow = torch.log_softmax(z.double() / 0.7, -1)
    assert torch.equal(ids, slow.topk(5, -1).indices)
    assert torch.allclose(fast.double(), slow.gather(-1, ids), atol=2e-5, rtol=0)
    assert torch.allclose(top_logprobs(z, 5, 0.7)[1].double(), slow.gather(-1, ids), atol=2e-5, rtol=0)


def test_the_quantiles_equal_torchs_and_pass_its_size_limit():
    # fast path (one sort, interpolated by hand) against torch.quantile on sizes it takes; then a
    # step of 2^24 + 1 tokens, which torch.quantile refuses ("input tensor is too large"): the
    # values 0 .. n-1, whose q quantile is (n - 1) q exactly
    from tether.core.attribution import sorted_quantile

    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 1000):
        x = torch.rand(n, generator=g, dtype=torch.float64)
        for q in (0.0, 0.5, 0.9, 0.99, 1.0):
            assert sorted_quantile(x.sort().values, q) == pytest.approx(
                float(torch.quantile(x, q)), rel=1e-12
            )
    n = 2**24 + 1
    x = torch.arange(n, dtype=torch.float32)
    out = token_kl_summary(
        x, special=torch.zeros(n, dtype=torch.bool), decile=torch.zeros(n, dtype=torch.long)
    )
    assert out["token_p50"] == (n - 1) * 0.5 and out["token_p99"] == pytest.approx((n - 1) * 0.99, rel=1e-12)
