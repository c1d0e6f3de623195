"""The optimizer's fast path (fused AdamW) against the per-tensor loop, and the clip."""

import torch

from tether.trainers.common import make_optimizer, optimizer_step


def _params(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(37, 11, generator=g).requires_grad_(), torch.randn(5, generator=g).requires_grad_()]


def _loss(params: list[torch.Tensor], step: int) -> torch.Tensor:
    return sum(((p - step) ** 2).sum() * (i + 1) for i, p in enumerate(params))


def test_fused_adamw_equals_the_loop_to_rounding():
    fused_p, loop_p = _params(0), _params(0)
    fused = make_optimizer(fused_p, lr=1e-2, weight_decay=0.1, fused=True)
    loop = make_optimizer(loop_p, lr=1e-2, weight_decay=0.1, fused=False)
    assert fused.param_groups[0]["fused"] is True
    assert not loop.param_groups[0]["fused"]
    for step in range(20):
        # max_grad_norm 5 clips most steps here, so the clipped path is compared too
        n_fused = optimizer_step(fused, fused_p, _loss(fused_p, step), 5.0, "test")
        n_loop = optimizer_step(loop, loop_p, _loss(loop_p, step), 5.0, "test")
        torch.testing.assert_close(n_fused, n_loop, rtol=1e-6, atol=0)
    start = _params(0)
    for a, b, s in zip(fused_p, loop_p, start):
        assert (a - s).abs().max() > 0.1  # the weights moved
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert a.grad is None  # gradients freed after the step


def test_clip_scales_to_the_max_norm():
    p = [torch.zeros(2, requires_grad=True)]
    opt = make_optimizer(p, lr=0.0, weight_decay=0.0)
    # loss 3*x0 + 4*x1: gradient (3, 4), norm 5; clipped to 1 -> (0.6, 0.8)
    norm = optimizer_step(opt, p, 3 * p[0][0] + 4 * p[0][1], 1.0, "test")
    assert float(norm) == 5.0
    # first moment after one step: (1 - beta1) * clipped gradient = 0.1 * (0.6, 0.8)
    torch.testing.assert_close(opt.state[p[0]]["exp_avg"], torch.tensor([0.06, 0.08]))
