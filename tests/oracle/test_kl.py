"""Tests for tether.core.kl: per-token estimators, masked aggregations, exact KL from logits.

Expectations are checked by exact enumeration over a small vocabulary in float64 (an
expectation is a finite sum, so unbiasedness is an equality, not sampling luck).
"""

from __future__ import annotations

import math

import pytest
import torch

from tether.core.distributed import kl_stats
from tether.core.kl import (
    ESTIMATORS,
    KLEstimator,
    estimate_kl,
    exact_kl_from_logits,
    kl_abs,
    kl_k1,
    kl_k2,
    kl_k3,
    sampled_estimators,
    sequence_kl,
)
from tether.core.masked import masked_mean, masked_sum, masked_var

F64 = torch.float64
INF, NAN = float("inf"), float("nan")


def _dist_pair(seed: int, V: int = 16, scale: float = 1.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random float64 log-distributions (log p, log q) over V tokens."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(V, generator=g, dtype=F64) * scale, -1)
    lq = torch.log_softmax(torch.randn(V, generator=g, dtype=F64) * scale, -1)
    return lp, lq


def _exact_kl_python(lp: list[float], lq: list[float]) -> float:
    """sum_v p(v) (log p(v) - log q(v)) with plain Python floats (independent of torch)."""
    return math.fsum(math.exp(a) * (a - b) for a, b in zip(lp, lq))


def _expect(estimator, lp: torch.Tensor, lq: torch.Tensor) -> float:
    """E_{v ~ p}[k(v)] = sum_v p(v) k(v), calling the estimator on every vocabulary item."""
    k = estimator(lp[None, :], lq[None, :])[0]  # (V,) : the estimate if token v were sampled
    return math.fsum((lp.exp() * k.to(F64)).tolist())


# ---------------------------------------------------------------------------------------------
# Case 1: padding never counts.
# ---------------------------------------------------------------------------------------------

# valid tokens: logprobs [-1.0, -2.0], ref [-1.5, -2.0]
# log ratio r = [-1.0 - -1.5, -2.0 - -2.0] = [0.5, 0.0]
#   k1  = r                      -> [0.5, 0.0]          sum 0.5
#   abs = |r|                    -> [0.5, 0.0]          sum 0.5
#   k2  = 0.5 r^2                -> [0.125, 0.0]        sum 0.125
#   k3  = exp(-r) - 1 + r        -> [e^-0.5 - 0.5, 0]   sum 0.6065306597126334 - 0.5
EXPECTED_SEQ = {
    "k1": 0.5,
    "abs": 0.5,
    "k2": 0.125,
    "k3": math.exp(-0.5) - 0.5,  # 0.10653065971263342
}
PAD_FILLS = [
    (-3.0, -4.0),  # ordinary numbers in the pad slots
    (-1.0, -1.0),
    (INF, -INF),
    (-INF, -INF),  # -inf - -inf = nan inside the estimator
    (NAN, NAN),
    (NAN, 0.0),
    (-INF, 0.0),  # k3 sees r = +inf (clamped) here
    (0.0, -INF),
]


def _padded(pad_lp: float, pad_ref: float, dtype=F64):
    logprobs = torch.tensor([[-1.0, -2.0, pad_lp, pad_lp]], dtype=dtype)
    ref = torch.tensor([[-1.5, -2.0, pad_ref, pad_ref]], dtype=dtype)
    mask = torch.tensor([[1, 1, 0, 0]], dtype=torch.bool)
    return logprobs, ref, mask


@pytest.mark.parametrize("pad_lp,pad_ref", PAD_FILLS)
def test_sequence_k1_ignores_padding(pad_lp, pad_ref):
    # k1 = [0.5, 0.0, <pad>, <pad>]; masked sum over [1, 1, 0, 0] = 0.5 + 0.0 = 0.5
    logprobs, ref, mask = _padded(pad_lp, pad_ref)
    seq = sequence_kl(kl_k1(logprobs, ref), mask)
    assert seq.shape == (1,)
    assert seq.item() == pytest.approx(0.5, abs=1e-15)


@pytest.mark.parametrize("name", sorted(KLEstimator.__args__))
@pytest.mark.parametrize("pad_lp,pad_ref", PAD_FILLS)
def test_every_estimator_ignores_padding(name, pad_lp, pad_ref):
    logprobs, ref, mask = _padded(pad_lp, pad_ref)
    kl = estimate_kl(logprobs, ref, name)
    seq = sequence_kl(kl, mask)
    tot = masked_sum(kl, mask)
    mean = masked_mean(kl, mask)
    row_mean = masked_mean(kl, mask, dim=-1)
    for t in (seq, tot, mean, row_mean):
        assert torch.isfinite(t).all(), (name, pad_lp, pad_ref, t)
    want = EXPECTED_SEQ[name]
    assert seq.item() == pytest.approx(want, abs=1e-14)
    assert tot.item() == pytest.approx(want, abs=1e-14)
    # mean over the 2 valid tokens: sum / 2
    assert mean.item() == pytest.approx(want / 2, abs=1e-14)
    assert row_mean.item() == pytest.approx(want / 2, abs=1e-14)


@pytest.mark.parametrize("fill", [INF, -INF, NAN, 1e30])
def test_masked_reductions_ignore_nonfinite(fill):
    values = torch.tensor([[1.0, 2.0, fill], [4.0, fill, fill]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    # sum = 1 + 2 + 4 = 7; mean = 7 / 3; per-row sums [3, 4], per-row means [1.5, 4]
    assert masked_sum(values, mask).item() == 7.0
    assert masked_mean(values, mask).item() == pytest.approx(7.0 / 3.0, abs=1e-15)
    assert masked_sum(values, mask, dim=-1).tolist() == [3.0, 4.0]
    assert masked_mean(values, mask, dim=-1).tolist() == [1.5, 4.0]
    # unbiased variance of {1, 2, 4}: mean 7/3, squares (16 + 1 + 25)/9 = 42/9, / (3 - 1) = 7/3
    assert masked_var(values, mask).item() == pytest.approx(7.0 / 3.0, abs=1e-14)
    # biased: 42/9 / 3 = 14/9
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(14.0 / 9.0, abs=1e-14)


def test_masked_mean_all_masked_row_is_zero_not_nan():
    values = torch.tensor([[NAN, INF], [1.0, 3.0]], dtype=F64)
    mask = torch.tensor([[0, 0], [1, 1]], dtype=torch.bool)
    # row 0 has no valid token: 0 / clamp(0, min=1) = 0; row 1: (1 + 3) / 2 = 2
    assert masked_mean(values, mask, dim=-1).tolist() == [0.0, 2.0]
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_masked_reductions_accept_01_masks():
    values = torch.tensor([[1.0, 2.0, 5.0]], dtype=F64)
    assert masked_sum(values, torch.tensor([[1, 0, 1]])).item() == 6.0  # 1 + 5
    assert masked_mean(values, torch.tensor([[1.0, 0.0, 1.0]])).item() == 3.0  # 6 / 2


def test_masked_sum_upcasts_half_but_keeps_float64():
    v = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    m = torch.ones(1, 2, dtype=torch.bool)
    assert masked_sum(v, m).dtype == torch.float32
    assert masked_sum(v.to(F64), m).dtype == F64


def test_kl_stats_units():
    # per-token KL [0.5]*4 and [1.0, 1.0, pad, pad]:
    # per sequence: 0.5*4 = 2.0 and 1.0 + 1.0 = 2.0 -> batch mean 2.0 nats / sequence
    # per token: (2.0 + 2.0) / 6 valid tokens = 0.666...
    kl = torch.tensor([[0.5, 0.5, 0.5, 0.5], [1.0, 1.0, NAN, INF]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    stats = kl_stats(kl, mask)
    assert stats["kl_per_sequence"].item() == pytest.approx(2.0, abs=1e-15)
    assert stats["kl_per_token"].item() == pytest.approx(4.0 / 6.0, abs=1e-15)


# ---------------------------------------------------------------------------------------------
# Estimator definitions, hand values.
# ---------------------------------------------------------------------------------------------


def test_estimators_hand_values():
    # logprobs [-1, -3], ref [-2, -1]: r = log p - log q = [1, -2]
    lp = torch.tensor([[-1.0, -3.0]], dtype=F64)
    lq = torch.tensor([[-2.0, -1.0]], dtype=F64)
    assert kl_k1(lp, lq).tolist() == [[1.0, -2.0]]
    assert kl_abs(lp, lq).tolist() == [[1.0, 2.0]]
    # k2 = 0.5 r^2 = [0.5, 2.0]
    assert kl_k2(lp, lq).tolist() == [[0.5, 2.0]]
    # k3 = exp(-r) - 1 + r = [e^-1 - 1 + 1, e^2 - 1 - 2] = [0.36787944, 4.3890561]
    want = [math.exp(-1.0), math.exp(2.0) - 3.0]
    got = kl_k3(lp, lq)[0].tolist()
    assert got == pytest.approx(want, abs=1e-14)


def test_k3_clamp_keeps_outliers_finite():
    # r = log q - log p = 0 - (-100) = 100 would give exp(100) ~ 2.7e43 (inf in float32):
    # clamped to 20: exp(20) - 1 - 20
    lp = torch.tensor([[-100.0]], dtype=torch.float32)
    lq = torch.tensor([[0.0]], dtype=torch.float32)
    out = kl_k3(lp, lq)
    assert torch.isfinite(out).all()
    assert out.item() == pytest.approx(math.expm1(20.0) - 20.0, rel=1e-6)


def test_estimators_reject_shape_mismatch():
    with pytest.raises(ValueError):
        kl_k1(torch.zeros(2, 3), torch.zeros(2, 4))


def test_estimators_keep_float64_and_upcast_half():
    lp, lq = torch.zeros(1, 2, dtype=F64), torch.zeros(1, 2, dtype=F64)
    for name in sampled_estimators():
        fn = ESTIMATORS[name].value
        assert fn(lp, lq).dtype == F64, name
        assert fn(lp.bfloat16(), lq.bfloat16()).dtype == torch.float32, name


# ---------------------------------------------------------------------------------------------
# Case 4: exact enumeration on a 16-token vocabulary, float64.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_k1_k3_unbiased_by_enumeration_float64(seed):
    """E_p[k1] = E_p[k3] = KL(p || q) to 1e-12.

    Requires the estimators to keep float64 (a float32 downcast of the log-probs alone
    gives errors ~1e-7, which this test would catch).
    """
    lp, lq = _dist_pair(seed)
    assert math.isclose(math.fsum(lp.exp().tolist()), 1.0, abs_tol=1e-14)
    kl = _exact_kl_python(lp.tolist(), lq.tolist())
    assert kl > 0.05  # a non-trivial pair
    assert abs(_expect(kl_k1, lp, lq) - kl) <= 1e-12
    # E_p[k3] = sum p (q/p - 1 + log p/q) = sum q - sum p + KL = 1 - 1 + KL
    assert abs(_expect(kl_k3, lp, lq) - kl) <= 1e-12
    assert kl_k1(lp[None], lq[None]).dtype == F64
    assert kl_k3(lp[None], lq[None]).dtype == F64


@pytest.mark.parametrize("seed", [0, 1])
def test_k1_k3_unbiased_float32_inputs(seed):
    # float32 in, float32 out. Rounding each log-prob (|log p| <~ 8) to float32 costs up to
    # 8 * 2^-24 ~ 5e-7 per token, so E_p[k] can differ from the float64 KL by ~1e-6 at most.
    lp, lq = _dist_pair(seed)
    kl = _exact_kl_python(lp.tolist(), lq.tolist())
    for fn in (kl_k1, kl_k3):
        assert fn(lp[None].float(), lq[None].float()).dtype == torch.float32
        k = fn(lp[None].float(), lq[None].float())[0].double()
        e = math.fsum((lp.exp() * k).tolist())
        assert abs(e - kl) <= 2e-6, fn.__name__


def test_abs_is_biased_upward_by_enumeration():
    lp, lq = _dist_pair(5)
    kl = _exact_kl_python(lp.tolist(), lq.tolist())
    # |r| >= r pointwise with strict inequality where r < 0, so E|r| > E r = KL
    assert _expect(kl_abs, lp, lq) > kl + 1e-3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k2_bias_equals_enumerated_formula(seed):
    lp, lq = _dist_pair(seed)
    p = lp.exp().tolist()
    lpl, lql = lp.tolist(), lq.tolist()
    kl = _exact_kl_python(lpl, lql)
    # independent enumeration: E_p[0.5 (log p - log q)^2] - sum p log(p/q)
    predicted_bias = math.fsum(pi * 0.5 * (a - b) ** 2 for pi, a, b in zip(p, lpl, lql)) - kl
    bias = _expect(kl_k2, lp, lq) - kl
    assert bias == pytest.approx(predicted_bias, abs=1e-12)


def test_k2_bias_positive_for_far_apart_pair():
    # p = [0.9, 0.1], q = [0.1, 0.9]: r = log p/q = [ln 9, -ln 9], ln 9 = 2.1972245773
    # E_p[k2] = 0.5 (ln 9)^2 = 0.5 * 4.8277958 = 2.4138979
    # KL = 0.9 ln 9 - 0.1 ln 9 = 0.8 ln 9 = 1.7577797
    # bias = 2.4138979 - 1.7577797 = 0.6561182 > 0
    lp = torch.tensor([0.9, 0.1], dtype=F64).log()
    lq = torch.tensor([0.1, 0.9], dtype=F64).log()
    l9 = math.log(9.0)
    assert _expect(kl_k1, lp, lq) == pytest.approx(0.8 * l9, abs=1e-14)
    bias = _expect(kl_k2, lp, lq) - 0.8 * l9
    assert bias == pytest.approx(0.5 * l9**2 - 0.8 * l9, abs=1e-14)
    assert bias == pytest.approx(0.6561182, abs=1e-7)
    # also on the 16-token vocabulary with a far pair
    lp16, lq16 = _dist_pair(7, scale=4.0)
    kl16 = _exact_kl_python(lp16.tolist(), lq16.tolist())
    assert kl16 > 1.0
    assert _expect(kl_k2, lp16, lq16) - kl16 > 0.1


def test_k2_bias_is_third_order_for_close_distributions():
    """For r = log p/q, E_p[exp(-r)] = 1 gives E[r] = E[r^2]/2 - E[r^3]/6 + O(r^4), so
    bias = E[k2] - KL = E[r^3]/6 + O(r^4): it shrinks 8x when the distance halves."""
    g = torch.Generator().manual_seed(11)
    lp = torch.log_softmax(torch.randn(16, generator=g, dtype=F64), -1)
    d = torch.randn(16, generator=g, dtype=F64) * 3.0

    def bias_and_third(eps: float) -> tuple[float, float, float]:
        lq = torch.log_softmax(lp + eps * d, -1)  # q = p exp(eps d) / Z
        kl = _exact_kl_python(lp.tolist(), lq.tolist())
        r = lp - lq
        third = math.fsum((lp.exp() * r.pow(3)).tolist()) / 6.0
        return _expect(kl_k2, lp, lq) - kl, third, r.abs().max().item()

    b1, t1, rmax1 = bias_and_third(0.02)
    b2, t2, _ = bias_and_third(0.01)
    assert abs(t1) > 1e-7  # leading term is not accidentally zero
    assert rmax1 < 0.5
    # leading order matches E[r^3]/6 within a few percent
    assert b1 == pytest.approx(t1, rel=0.05)
    assert b2 == pytest.approx(t2, rel=0.03)
    # cubic scaling: halving eps divides the bias by ~2^3
    assert b1 / b2 == pytest.approx(8.0, rel=0.05)
    # and it is much smaller than the KL itself (second order)
    kl = _expect(kl_k1, lp, torch.log_softmax(lp + 0.01 * d, -1))
    assert abs(b2) < 0.05 * kl


# ---------------------------------------------------------------------------------------------
# exact_kl_from_logits
# ---------------------------------------------------------------------------------------------


def _enumerate_exact(logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float) -> list:
    """Pure-Python per-position KL(softmax(l/T) || softmax(r/T))."""
    B, T, V = logits.shape
    out = []
    for b in range(B):
        row = []
        for t in range(T):
            zl = [x / temperature for x in logits[b, t].tolist()]
            zr = [x / temperature for x in ref_logits[b, t].tolist()]
            ml, mr = max(zl), max(zr)
            lsl = ml + math.log(math.fsum(math.exp(x - ml) for x in zl))
            lsr = mr + math.log(math.fsum(math.exp(x - mr) for x in zr))
            lp = [x - lsl for x in zl]
            lq = [x - lsr for x in zr]
            row.append(math.fsum(math.exp(a) * (a - c) for a, c in zip(lp, lq) if a != -INF))
        out.append(row)
    return out


def _random_logits(seed: int, shape=(2, 3, 16), dtype=F64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=F64) * 2).to(dtype), (
        torch.randn(*shape, generator=g, dtype=F64) * 2
    ).to(dtype)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_exact_kl_matches_enumeration_float64(temperature):
    logits, ref = _random_logits(0)
    got = exact_kl_from_logits(logits, ref, temperature)
    assert got.shape == (2, 3) and got.dtype == F64
    want = torch.tensor(_enumerate_exact(logits, ref, temperature), dtype=F64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_exact_kl_float32_input_float32_tolerance():
    # float32 in, float32 out: compare with the float64 enumeration at float32 precision
    logits, ref = _random_logits(1, dtype=torch.float32)
    got = exact_kl_from_logits(logits, ref)
    assert got.dtype == torch.float32
    want = torch.tensor(_enumerate_exact(logits.double(), ref.double(), 1.0), dtype=F64)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_exact_kl_equals_expectation_of_sampled_estimators():
    # the exact KL at each position is E_p[k1] computed from the same logits
    logits, ref = _random_logits(2)
    exact = exact_kl_from_logits(logits, ref)
    lp, lq = torch.log_softmax(logits, -1), torch.log_softmax(ref, -1)
    for b in range(2):
        for t in range(3):
            for fn in (kl_k1, kl_k3):
                assert _expect(fn, lp[b, t], lq[b, t]) == pytest.approx(exact[b, t].item(), abs=1e-12)


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 5])
def test_exact_kl_chunked_equals_unchunked(chunk_size):
    logits, ref = _random_logits(3, shape=(3, 5, 16))  # 15 positions: chunks do not divide evenly
    full = exact_kl_from_logits(logits, ref, 0.8, chunk_size=1024)
    chunked = exact_kl_from_logits(logits, ref, 0.8, chunk_size=chunk_size)
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-14)


def test_exact_kl_temperature_applied_to_both():
    logits, ref = _random_logits(4)
    T = 0.5
    tempered = exact_kl_from_logits(logits, ref, T)
    # tempering both by hand must give the same number
    torch.testing.assert_close(tempered, exact_kl_from_logits(logits / T, ref / T, 1.0), rtol=0, atol=1e-13)
    # tempering only one of them gives something else
    assert not torch.allclose(tempered, exact_kl_from_logits(logits / T, ref, 1.0), atol=1e-3)
    assert not torch.allclose(tempered, exact_kl_from_logits(logits, ref / T, 1.0), atol=1e-3)
    assert not torch.allclose(tempered, exact_kl_from_logits(logits, ref, 1.0), atol=1e-3)


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_exact_kl_neg_inf_policy_logit_is_finite(dtype):
    logits, ref = _random_logits(5, dtype=dtype)
    logits[0, 1, 3] = -INF  # p(token 3) = 0 at one position
    logits[1, 2, :5] = -INF
    ref[1, 2, 0] = -INF  # q = 0 where p = 0 too: 0 * (-inf - -inf) must still be 0
    got = exact_kl_from_logits(logits, ref, chunk_size=2)
    assert torch.isfinite(got).all()
    want = torch.tensor(_enumerate_exact(logits.double(), ref.double(), 1.0), dtype=F64)
    # KL_t = sum_v p(v) (log p(v) - log q(v)) over V = 16 terms: Higham's bound for the sum in
    # this dtype is V * eps * sum_v p |log p - log q| (each log-softmax rounds within a few ulps
    # of its own scale, folded into the same factor)
    lp, lq = torch.log_softmax(logits.double(), -1), torch.log_softmax(ref.double(), -1)
    terms = torch.nan_to_num(lp.exp() * (lp - lq), nan=0.0, posinf=0.0, neginf=0.0).abs().sum(-1)
    eps = torch.finfo(dtype).eps
    tol = logits.shape[-1] * eps * terms
    assert ((got.double() - want).abs() <= tol).all(), ((got.double() - want).abs() / tol).max()
    assert (got.double() >= -tol).all()


def test_exact_kl_zero_for_identical_and_validates_args():
    logits, _ = _random_logits(6)
    assert exact_kl_from_logits(logits, logits.clone()).abs().max().item() <= 1e-15
    with pytest.raises(ValueError):
        exact_kl_from_logits(logits, logits[:, :2])
    with pytest.raises(ValueError):
        exact_kl_from_logits(logits, logits, temperature=0.0)
    with pytest.raises(ValueError):
        exact_kl_from_logits(logits, logits, chunk_size=0)


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


def test_registry_every_name_works():
    import tether.core.losses  # noqa: F401  (registers the surrogates; alone, this file would not)

    assert set(sampled_estimators()) == {"k1", "abs", "k2", "k3"}
    assert set(ESTIMATORS) == {"k1", "abs", "k2", "k3", "k3+", "k3_is", "k1_seq"}  # with the surrogates
    lp = torch.tensor([[-1.0, -3.0]], dtype=F64)
    lq = torch.tensor([[-2.0, -1.0]], dtype=F64)
    for name in sampled_estimators():
        out = estimate_kl(lp, lq, name)
        assert out.shape == (1, 2)
        assert torch.equal(out, ESTIMATORS[name].value(lp, lq)), name
    assert torch.equal(estimate_kl(lp, lq), kl_k1(lp, lq))  # default is k1


def test_registry_unknown_name_raises_with_choices():
    with pytest.raises(ValueError) as info:
        estimate_kl(torch.zeros(1, 2), torch.zeros(1, 2), "k4")  # type: ignore[arg-type]
    msg = str(info.value)
    assert "'k4'" in msg
    for name in sampled_estimators():
        assert repr(name) in msg


@pytest.mark.parametrize("ref", [-25.0, -40.0, -100.0])
def test_k3_is_not_capped_where_the_policy_is_far_above_the_reference(ref):
    # log pi = -0.1, log pi_ref = ref: r = ref + 0.1 <= -24.9, exp(r) < 2e-11, so
    # k3 = exp(r) - 1 - r = -0.9 - ref (+ exp(r)): 23.9 at ref = -25, 38.9 at -40, 98.9 at -100.
    # A clamp of r from below at -20 would have capped all three at exp(-20) + 19 = 19.0.
    lp = torch.tensor([[-0.1]], dtype=F64)
    lq = torch.tensor([[ref]], dtype=F64)
    want = math.expm1(ref + 0.1) - (ref + 0.1)
    assert kl_k3(lp, lq).item() == pytest.approx(want, rel=1e-14)
    assert want > 23.8
    from tether.core.losses import kl_loss_terms

    lp.requires_grad_(True)
    # k3_is's gradient on-policy (old = current): d/dlp [exp(lp - old) * k3] = k3 + (1 - exp(r))
    #   = (-1 - r + exp(r)) + 1 - exp(r) = -r: 24.9 at ref = -25 (a clamp gave 19)
    kl_loss_terms(lp, lq, "k3_is", lp.detach()).sum().backward()
    assert lp.grad.item() == pytest.approx(-(ref + 0.1), rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("r", [5.0, 16.0, 18.0, 19.9, 20.5, 25.0, 100.0])
def test_k3_is_gradient_at_and_past_the_clamp(r, dtype):
    # The policy far *below* the reference on a sampled token: log pi = -1 - r, log pi_ref = -1,
    # r = log pi_ref - log pi. On-policy (old = pi, weight 1) k3_is's gradient is k1 = -r, exactly
    # k3+'s, at every r: the straight-through form never subtracts two numbers of size exp(r).
    # Left to autograd, rho k3 + rho (1 - exp(r)) gave -16 and -32 in float32 at r = 18 and 19.9,
    # and past the clamp (r > 20: k3's clamped exp has no gradient) +(e^20 - 21) = +4.85e8, the
    # wrong sign: the leash pushed the token further down.
    from tether.core.kl import K3_LOG_RATIO_CLAMP
    from tether.core.losses import kl_loss_terms

    lp = torch.tensor([[-1.0 - r]], dtype=dtype, requires_grad=True)
    ref = torch.tensor([[-1.0]], dtype=dtype)
    terms = kl_loss_terms(lp, ref, "k3_is", lp.detach())
    terms.sum().backward()
    k1 = float((lp.detach() - ref).item())  # -r to the dtype's rounding of -1 - r
    assert lp.grad.item() == k1
    # the value (what is logged) is k3's, clamped at r = 20 (the clamp table of docs/kl.md)
    rc = min(r, K3_LOG_RATIO_CLAMP)
    assert terms.item() == pytest.approx(math.expm1(rc) - rc, rel=4 * torch.finfo(dtype).eps)


def test_k3_is_importance_weight_is_capped_at_exp_20():
    # The weight pi / pi_old past its clamp: a token the update raised by 25 nats since it was
    # sampled (log pi - log pi_old = 25) weighs e^20 = 4.85e8, not e^25 (the exponent is clamped
    # from above at 20 nats, as k3's); below the clamp it is exact. Gradient rho * k1 either way.
    from tether.core.losses import kl_loss_terms

    ref = torch.tensor([[-3.0, -3.0]], dtype=F64)
    lp = torch.tensor([[-2.0, -2.0]], dtype=F64, requires_grad=True)  # k1 = 1 on both tokens
    old = torch.tensor([[-27.0, -12.0]], dtype=F64)  # log ratio 25 (clamped) and 10 (exact)
    terms = kl_loss_terms(lp, ref, "k3_is", old)
    terms.sum().backward()
    k3 = math.expm1(-1.0) + 1.0  # r = -1: e^-1 - 1 + 1 = 0.367879
    rho = [math.exp(20.0), math.exp(10.0)]
    assert terms.detach()[0].tolist() == pytest.approx([rho[0] * k3, rho[1] * k3], rel=1e-15)
    assert lp.grad[0].tolist() == pytest.approx(rho, rel=1e-15)  # rho * k1, k1 = 1
