"""The anchor's math (tether.core.anchor) against enumeration and hand-worked values."""

import math

import pytest
import torch

from tether.core.anchor import anchor_term, forward_kl_from_logits, text_nll


def _enumerated_fkl(logits: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    # the definition, float64, term by term over the vocabulary
    lp = torch.log_softmax(logits.double(), -1)
    lq = ref_logprobs.double()
    return (lq.exp() * (lq - lp)).sum(-1)


def test_hand_worked_forward_kl_and_its_gradient():
    # q = (1/2, 1/2), p = softmax(0, ln 3) = (1/4, 3/4):
    # KL(q || p) = 1/2 ln(1/2 / 1/4) + 1/2 ln(1/2 / 3/4) = 1/2 ln 2 + 1/2 ln(2/3) = 1/2 ln(4/3)
    logits = torch.tensor([[0.0, math.log(3.0)]], requires_grad=True)
    ref = torch.log(torch.tensor([[0.5, 0.5]]))
    kl = forward_kl_from_logits(logits, ref)
    assert kl.item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    kl.sum().backward()
    # d/dz = p - q = (1/4 - 1/2, 3/4 - 1/2) = (-1/4, 1/4)
    assert torch.allclose(logits.grad, torch.tensor([[-0.25, 0.25]]), atol=1e-7)


def test_forward_kl_and_gradient_equal_enumeration_on_a_small_vocabulary():
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 7, generator=g) * 2).requires_grad_(True)
    ref = torch.log_softmax(torch.randn(3, 5, 7, generator=g) * 2, -1)
    weights = torch.rand(3, 5, generator=g)  # an arbitrary upstream gradient per position
    for chunk in (1, 4, 1024):  # chunking changes nothing
        logits.grad = None
        kl = forward_kl_from_logits(logits, ref, chunk_size=chunk)
        (kl * weights).sum().backward()
        expected = _enumerated_fkl(logits.detach(), ref)
        # float32 against float64: each term is O(1) nats over 7 entries, so ~1e-6 rounding
        assert torch.allclose(kl.double(), expected, atol=1e-6)
        p, q = torch.softmax(logits.detach().double(), -1), ref.double().exp()
        assert torch.allclose(logits.grad.double(), (p - q) * weights[..., None].double(), atol=1e-6)
    # and autograd through the float64 definition gives the same gradient
    x = logits.detach().double().requires_grad_(True)
    (_enumerated_fkl(x, ref) * weights.double()).sum().backward()
    assert torch.allclose(logits.grad.double(), x.grad, atol=1e-6)


def test_the_reference_is_the_forward_kls_fixed_point_and_not_ptxs():
    g = torch.Generator().manual_seed(1)
    ref_logits = torch.randn(2, 4, 6, generator=g)
    ref = torch.log_softmax(ref_logits, -1)
    at_ref = ref_logits.clone().requires_grad_(True)
    kl = forward_kl_from_logits(at_ref, ref)
    kl.sum().backward()
    assert kl.abs().max() < 1e-6 and at_ref.grad.abs().max() < 1e-6  # value 0, gradient 0
    # ptx at the reference: gradient p - onehot(target) != 0, its minimum is the text's token
    targets = torch.randint(0, 6, (2, 4), generator=g)
    at_ref.grad = None
    text_nll(at_ref, targets).sum().backward()
    onehot = torch.nn.functional.one_hot(targets, 6).float()
    assert torch.allclose(at_ref.grad, torch.softmax(ref_logits, -1) - onehot, atol=1e-6)


def test_extremes_zero_reference_mass_and_broken_logits():
    # q(v) = 0 (a -inf reference log-prob): the term is 0, not NaN; p -> 0 where q > 0 gives +inf
    logits = torch.tensor([[0.0, 0.0, -1e4]], requires_grad=True)
    ref = torch.tensor([[math.log(0.5), math.log(0.5), -math.inf]])
    kl = forward_kl_from_logits(logits, ref)
    assert kl.item() == pytest.approx(0.0, abs=1e-7)  # p = (1/2, 1/2, ~0) = q on its support
    kl.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert torch.isnan(
        forward_kl_from_logits(torch.tensor([[float("nan"), 0.0]]), torch.log(torch.tensor([[0.5, 0.5]])))
    ).all()
    with pytest.raises(ValueError, match="chunk_size"):
        forward_kl_from_logits(logits, ref, chunk_size=0)
    with pytest.raises(ValueError, match="!="):
        forward_kl_from_logits(logits, ref[:, :2])


def test_anchor_term_is_a_token_mean_over_the_mask_times_its_coefficient():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 5, generator=g, requires_grad=True)
    ref = torch.log_softmax(torch.randn(2, 3, 5, generator=g), -1)
    targets = torch.randint(0, 5, (2, 3), generator=g)
    mask = torch.tensor([[True, True, False], [True, False, False]])  # 3 counted positions
    fkl = _enumerated_fkl(logits.detach(), ref)
    nll = -torch.log_softmax(logits.detach().double(), -1).gather(-1, targets[..., None])[..., 0]
    for kind, per_position in (("forward_kl", fkl), ("ptx", nll)):
        term = anchor_term(logits, ref, targets, mask, coef=0.5, kind=kind)
        expected = per_position[mask].sum() / 3
        assert term.loss.item() == pytest.approx(0.5 * expected.item(), rel=1e-5)
        assert term.forward_kl.item() == pytest.approx((fkl[mask].sum() / 3).item(), rel=1e-5)
        assert term.nll.item() == pytest.approx((nll[mask].sum() / 3).item(), rel=1e-5)
    empty = anchor_term(
        logits, ref, targets, torch.zeros(2, 3, dtype=torch.bool), coef=1.0, kind="forward_kl"
    )
    assert empty.loss.item() == 0.0 and math.isnan(empty.forward_kl.item())  # no token: no loss, no number
    empty.loss.backward()  # still reaches the logits (a zero gradient), so every process runs a backward
    assert logits.grad is not None and logits.grad.abs().max() == 0
    with pytest.raises(ValueError, match="anchor.kind"):
        anchor_term(logits, ref, targets, mask, coef=1.0, kind="js")
    with pytest.raises(ValueError, match="anchor.coef"):
        anchor_term(logits, ref, targets, mask, coef=-1.0, kind="ptx")
