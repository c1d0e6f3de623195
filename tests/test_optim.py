"""The optimizer's fast path (fused AdamW) against the per-tensor loop, the clip, and gradient
accumulation over micro-batches against the whole minibatch."""

import json

import pytest
import torch
from safetensors.torch import load_file

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


@pytest.mark.parametrize("algo,micro", [("ppo", 1), ("ppo", 2), ("grpo", 1), ("rloo", 2), ("dpo", 1)])
def test_micro_batches_accumulate_to_the_minibatch_update(algo, micro, tiny_model_dir, prompt_file, tmp_path):
    """optim.micro_batch_size: minibatch 4 x accumulation 1 equals micro-batches of `micro` rows
    accumulated: the same weights after a step and the same logged statistics, to float rounding."""
    from tether.cli import main

    def run(out, extra):
        args = ["train", f"model.name={tiny_model_dir}", f"data.prompts={prompt_file}", "data.heldout_fraction=0.2",
                "rollout.batch_size=8", "rollout.max_new_tokens=6", "optim.minibatch_size=4", "optim.epochs=1",
                "train.steps=2", f"train.algo={algo}", "eval.n_prompts=0", "eval.every=0", "eval.judge=none",
                "reward.scorer=tests.conftest:length_judge", "train.progress=false", "train.checkpoint_every=0",
                "optim.lr=1e-3", "optim.fused_adamw=false", f"train.output_dir={out}"]
        args += ["rollout.group_size=2"] if algo in ("grpo", "rloo") else []
        args += ["dpo.n_pairs=8", "dpo.candidates=2", "dpo.kl_eval_prompts=4"] if algo == "dpo" else []
        assert main(args + extra) == 0
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        return rows, load_file(str(out / "policy" / "model.safetensors"))

    whole, w_whole = run(tmp_path / "whole", [])
    acc, w_acc = run(tmp_path / "micro", [f"optim.micro_batch_size={micro}"])
    for a, b in zip(whole, acc):
        for k in a:
            if k.startswith("time/") or k == "dpo/accuracy":  # accuracy: margins of 0 +- rounding at the start
                continue
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (k, a[k], b[k])
    moved = 0
    for name, t in w_whole.items():
        # AdamW's step is about lr = 1e-3 per weight whatever the gradient's size, so a gradient
        # that is ~0 up to summation rounding can move its weight by a few 1e-6 differently
        # (measured: at most 2.7e-6, one DPO weight of 2048); 1e-5 is 1% of one step
        torch.testing.assert_close(w_acc[name], t, rtol=1e-4, atol=1e-5)
        moved += int(not torch.equal(t, load_file(str(tiny_model_dir / "model.safetensors"))[name]))
    assert moved > 0  # the update really changed weights
