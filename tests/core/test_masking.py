"""Masks that must hold: masked NaN never reaches a gradient, a broadcast mask is refused."""

from __future__ import annotations

import pytest
import torch

from tether.core.leash import KLLeash
from tether.core.masked import masked_mean


def test_kl_in_the_loss_keeps_masked_nan_out_of_gradients():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, float("nan")]])
    mask = torch.tensor([[True, False]])
    for est in ("k2", "k3+", "k3_is"):
        lp.grad = None
        KLLeash(False, True, est).loss(lp, ref, 0.1, mask, old_logprobs=lp.detach()).backward()
        assert torch.isfinite(lp.grad).all() and lp.grad[0, 1] == 0, est


def test_broadcast_mask_is_refused():
    with pytest.raises(ValueError, match="shape"):
        masked_mean(torch.ones(2, 3), torch.ones(3))
