"""Tests for tether.core.logprobs: tempered log-probs, entropy, response masks."""

from __future__ import annotations

import math

import pytest
import torch

from tether.core.logprobs import (
    entropy_from_logits,
    last_token_index,
    logprobs_from_logits,
    response_mask_from_tokens,
)

F64 = torch.float64
EOS, PAD = 2, 0


# ---------------------------------------------------------------------------------------------
# Case 3: temperature.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_temperature_hand_value(dtype):
    # z = [2.0, 1.0, 0.0] / 0.7 = [2.857142857, 1.428571429, 0.0]
    # exp(z) = [17.41170806, 4.17273388, 1.0], sum = 22.58444195, logsumexp = 3.11726126
    # log p(0) = 2.857142857 - 3.11726126 = -0.26011840
    # untempered: -log(1 + e^-1 + e^-2) = -log(1.50321472) = -0.40760596 (must NOT appear)
    logits = torch.tensor([[[2.0, 1.0, 0.0]]], dtype=dtype)
    tokens = torch.tensor([[0]])
    got = logprobs_from_logits(logits, tokens, temperature=0.7).item()
    assert got == pytest.approx(-0.260118, abs=1e-6)
    assert abs(got - -0.407606) > 0.1
    assert logprobs_from_logits(logits, tokens, temperature=1.0).item() == pytest.approx(-0.407606, abs=1e-6)


def _slow_logprobs(logits, tokens, temperature):
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, tokens[..., None])[..., 0]


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 2048])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_logprobs_chunked_equals_slow_float64(chunk_size, temperature):
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 5, 11  # 15 positions: chunks of 3 and 7 do not divide evenly
    logits = torch.randn(B, T, V, generator=g, dtype=F64) * 3
    tokens = torch.randint(0, V, (B, T), generator=g)
    got = logprobs_from_logits(logits, tokens, temperature, chunk_size=chunk_size)
    assert got.shape == (B, T) and got.dtype == F64
    torch.testing.assert_close(got, _slow_logprobs(logits, tokens, temperature), rtol=0, atol=1e-12)
    assert (got <= 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_low_precision_input_gives_float32(dtype):
    # float32 output: compare against the float64 log-softmax of the same (rounded) logits at
    # float32 precision (|log p| <~ 10, so 1e-5 absolute is a few float32 ulps).
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 4, 9, generator=g) * 3).to(dtype)
    tokens = torch.randint(0, 9, (2, 4), generator=g)
    got = logprobs_from_logits(logits, tokens, 0.9, chunk_size=3)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _slow_logprobs(logits, tokens, 0.9), rtol=0, atol=1e-5)


def test_logprobs_validates_arguments():
    logits = torch.zeros(1, 2, 3)
    tokens = torch.zeros(1, 2, dtype=torch.long)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            logprobs_from_logits(logits, tokens, temperature=bad)
    with pytest.raises(ValueError):
        logprobs_from_logits(logits, torch.zeros(1, 3, dtype=torch.long))


def _slow_entropy(logits, temperature):
    """Python loop over positions and vocabulary, float64."""
    B, T, V = logits.shape
    out = torch.empty(B, T, dtype=F64)
    for b in range(B):
        for t in range(T):
            z = [x / temperature for x in logits[b, t].tolist()]
            m = max(z)
            lse = m + math.log(math.fsum(math.exp(x - m) for x in z))
            out[b, t] = -math.fsum(math.exp(x - lse) * (x - lse) for x in z)
    return out


@pytest.mark.parametrize("chunk_size", [1, 4, 2048])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_entropy_equals_slow_reference(chunk_size, temperature):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 13, generator=g, dtype=F64) * 2
    got = entropy_from_logits(logits, temperature, chunk_size=chunk_size)
    assert got.shape == (2, 5) and got.dtype == F64
    torch.testing.assert_close(got, _slow_entropy(logits, temperature), rtol=0, atol=1e-12)
    # 0 <= H <= log V
    assert (got >= 0).all() and (got <= math.log(13) + 1e-12).all()


def test_entropy_hand_values():
    # uniform over 4 tokens: H = log 4 = 1.3862944; one-hot-ish (logit gap 100): H ~ 0
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]], dtype=F64)
    got = entropy_from_logits(logits)
    assert got[0, 0].item() == pytest.approx(math.log(4.0), abs=1e-14)
    # H = -sum p log p with 3 tokens at ~e^-100 each: ~3 * 100 * e^-100 ~ 1e-41
    assert 0.0 <= got[0, 1].item() < 1e-30
    # float32 input gives float32, to float32 precision
    got32 = entropy_from_logits(logits.float())
    assert got32.dtype == torch.float32
    assert got32[0, 0].item() == pytest.approx(math.log(4.0), abs=1e-6)


def test_entropy_neg_inf_logit_is_finite():
    # [0, -inf, 0]: two tokens at 1/2, H = log 2 = 0.6931472
    logits = torch.tensor([[[0.0, float("-inf"), 0.0]]], dtype=F64)
    got = entropy_from_logits(logits)
    assert torch.isfinite(got).all()
    assert got.item() == pytest.approx(math.log(2.0), abs=1e-14)


def test_a_nan_or_inf_logit_reads_nan_not_zero():
    # a broken policy (a NaN logit, or +inf: softmax is inf / inf there) has no entropy and no KL;
    # reading 0 would let the update guard keep it and the controller read "no KL"
    from tether.core.kl import exact_kl_from_logits

    ref = torch.zeros(1, 2, 3, dtype=F64)
    for bad in (float("nan"), float("inf")):
        logits = torch.tensor([[[0.0, bad, 0.0], [0.0, float("-inf"), 0.0]]], dtype=F64)
        h, kl = entropy_from_logits(logits), exact_kl_from_logits(logits, ref)
        assert math.isnan(h[0, 0]) and math.isnan(kl[0, 0])
        # the row with only a -inf logit stays finite: log 2, and KL = log 3 - log 2 (p = 1/2, 1/2)
        assert h[0, 1].item() == pytest.approx(math.log(2.0), abs=1e-14)
        assert kl[0, 1].item() == pytest.approx(math.log(3.0) - math.log(2.0), abs=1e-14)


# ---------------------------------------------------------------------------------------------
# Case 2: EOS mask.
# ---------------------------------------------------------------------------------------------


def test_response_mask_eos_then_pad():
    # [t0, t1, EOS, PAD, PAD] -> [1, 1, 1, 0, 0]
    tokens = torch.tensor([[5, 7, EOS, PAD, PAD]])
    assert response_mask_from_tokens(tokens, EOS).tolist() == [[True, True, True, False, False]]


def test_response_mask_pad_equals_eos():
    # [t0, t1, EOS, EOS, EOS] (pad token == EOS) -> [1, 1, 1, 0, 0]
    tokens = torch.tensor([[5, 7, EOS, EOS, EOS]])
    assert response_mask_from_tokens(tokens, EOS).tolist() == [[True, True, True, False, False]]


def test_response_mask_no_eos_and_eos_first_and_batch():
    tokens = torch.tensor(
        [
            [5, 7, 9, 4, 3],  # truncated, no EOS -> all True
            [EOS, 7, 9, EOS, 3],  # EOS first -> [1, 0, 0, 0, 0], later EOS/tokens ignored
            [5, EOS, 9, 4, EOS],  # real tokens after EOS do not count
            [5, 7, 9, 4, EOS],  # EOS in the last slot
        ]
    )
    mask = response_mask_from_tokens(tokens, EOS)
    assert mask.dtype == torch.bool
    assert mask.int().tolist() == [
        [1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 1, 1],
    ]


def test_response_mask_none_eos_counts_everything():
    tokens = torch.tensor([[EOS, EOS, 3]])
    assert response_mask_from_tokens(tokens, None).tolist() == [[True, True, True]]


def test_last_token_index():
    mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool
    )
    # last True positions: 2, 4, 0; empty row -> 0 (documented)
    assert last_token_index(mask).tolist() == [2, 4, 0, 0]
