"""The optimizer's fast path (fused AdamW) against the per-tensor loop, the clip, and gradient
accumulation over micro-batches against the whole minibatch."""

import json

import pytest
import torch

from tests.conftest import metric_rows
from tether.trainers.common import make_optimizer
from tether.trainers.update import optimizer_step

pytestmark = pytest.mark.numerics  # every test here compares two computational paths


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
def test_micro_batches_accumulate_to_the_minibatch_gradient(
    algo, micro, tiny_model_dir, prompt_file, tmp_path, monkeypatch
):
    """optim.micro_batch_size: the gradients accumulated over micro-batches of `micro` rows equal
    the minibatch's (4 rows) at every optimizer step, and so do the logged statistics, to the
    rounding of a reordered float32 sum (tests/numerics.py).

    The claim is about gradients, so gradients are compared, as AdamW receives them: weights
    after AdamW are not, since AdamW's first step is about lr * sign(gradient), and a gradient
    that is 0 up to rounding can take either sign. The optimizer's step is skipped (the weights
    stay at their start), so every step of both runs is taken at the same weights and every
    step's gradients compare.
    """
    import accelerate

    from tests.numerics import assert_grads_close, assert_rows_close
    from tether.cli import main

    log = {"grads": [], "parts": [], "_pending": [], "_seen": None}

    def backward(self, loss, **kw):  # record what each micro-batch's backward adds to .grad
        loss.backward(**kw)
        now = [p.grad.detach().clone() if p.grad is not None else None for p in log["_params"]]
        before = log["_seen"] or [None] * len(now)
        log["_pending"].append([n - b if b is not None else n for n, b in zip(now, before)])
        log["_seen"] = now

    def step(self, closure=None):  # record the gradient AdamW would step with, and do not step
        params = [p for g in self.param_groups for p in g["params"]]
        assert params == log["_params"]
        log["grads"].append([p.grad.detach().clone() for p in params])
        log["parts"].append(
            [
                [t if t is not None else torch.zeros_like(p) for t, p in zip(part, params)]
                for part in log["_pending"]
            ]
        )
        log["_pending"], log["_seen"] = [], None

    real_init = torch.optim.AdamW.__init__

    def init(self, params, *a, **kw):
        params = list(params)
        log["_params"] = params
        real_init(self, params, *a, **kw)

    monkeypatch.setattr(accelerate.Accelerator, "backward", backward)
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    monkeypatch.setattr(torch.optim.AdamW, "__init__", init)

    def run(out, extra):
        args = [
            "train",
            f"model.name={tiny_model_dir}",
            f"data.prompts={prompt_file}",
            "data.heldout_fraction=0.2",
            "rollout.batch_size=8",
            "rollout.max_new_tokens=6",
            "optim.minibatch_size=4",
            "optim.epochs=1",
            "train.steps=2",
            f"train.algo={algo}",
            "eval.n_prompts=0",
            "eval.every=0",
            "eval.judge=none",
            "reward.scorer=tests.conftest:length_judge",
            "train.progress=false",
            "train.checkpoint_every=0",
            "train.save_model=false",
            "optim.lr=1e-3",
            "optim.fused_adamw=false",
            f"train.output_dir={out}",
        ]
        args += ["rollout.group_size=2"] if algo in ("grpo", "rloo") else []
        args += ["dpo.n_pairs=8", "dpo.candidates=2", "dpo.kl_eval_prompts=4"] if algo == "dpo" else []
        log["grads"], log["parts"] = [], []
        assert main(args + extra) == 0
        rows = metric_rows(out, timings=True)
        return rows, log["grads"], log["parts"]

    whole, g_whole, _ = run(tmp_path / "whole", [])
    acc, g_acc, parts = run(tmp_path / "micro", [f"optim.micro_batch_size={micro}"])
    # 2 steps x 2 minibatches of 4: one optimizer step per minibatch, however it is split
    assert len(g_whole) == len(g_acc) == 4
    assert all(len(p) == 4 // micro for p in parts)
    # a gradient entry sums <= 4 rows x (prompt + response positions <= 16) terms
    n_terms = 4 * 16
    worst = max(
        assert_grads_close(w, g, p, n_terms, f"optimizer step {i}: ")
        for i, (w, g, p) in enumerate(zip(g_whole, g_acc, parts))
    )
    assert all(sum(float(t.abs().sum()) for t in g) > 0 for g in g_whole)  # there was a gradient
    vocab = len(json.loads((tiny_model_dir / "tokenizer.json").read_text())["model"]["vocab"])
    for a, b in zip(whole, acc):
        assert_rows_close(a, b, 8 * 6, vocab, f"step {a['step']}: ")
    print(f"{algo}, micro {micro}: largest gradient difference {worst:.2g} of its tolerance")


@pytest.mark.parametrize("algo", ["grpo", "dpo"])
def test_a_resumed_cosine_schedule_continues_where_it_stopped(algo, tiny_model_dir, prompt_file, tmp_path):
    """Four steps straight against two steps, the trainer state through torch.save, two more steps
    in a new trainer: the same learning rate at every step. Hand-worked: 4 steps x 1 epoch x 2
    minibatches = 8 optimizer steps, 2 of warmup: step 0 starts at lr 0, step 1 at lr * 2/2 (end
    of warmup), step 2 at lr * 0.5 * (1 + cos(pi * 2/6)) = 0.75 lr, step 3 at 0.25 lr."""
    import io
    import math

    from tether.run.config import load_config
    from tether.run.setup import build_run
    from tether.training import TRAINERS

    def trainer(out):
        args = [
            f"model.name={tiny_model_dir}",
            f"data.prompts={prompt_file}",
            f"train.algo={algo}",
            "rollout.batch_size=4",
            "rollout.max_new_tokens=4",
            "optim.minibatch_size=2",
            "optim.epochs=1",
            "optim.lr=1e-3",
            "optim.lr_scheduler=cosine",
            "optim.warmup_steps=2",
            "train.steps=4",
            "eval.n_prompts=0",
            "eval.judge=none",
            "reward.scorer=tests.conftest:length_judge",
            f"train.output_dir={out}",
        ]
        if algo == "grpo":
            args.append("rollout.group_size=2")
        else:
            args += ["dpo.n_pairs=4", "dpo.candidates=2", "dpo.kl_eval_prompts=2"]
        return TRAINERS[algo](build_run(load_config(None, args)))

    straight = trainer(tmp_path / "a")
    lrs = [straight.step(s)["optim/lr"] for s in range(4)]
    want = [
        0.0,
        1e-3,
        1e-3 * 0.5 * (1 + math.cos(math.pi * 2 / 6)),
        1e-3 * 0.5 * (1 + math.cos(math.pi * 4 / 6)),
    ]
    assert lrs == pytest.approx(want, rel=1e-6)
    first = trainer(tmp_path / "b")
    resumed_lrs = [first.step(s)["optim/lr"] for s in range(2)]
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    second = trainer(tmp_path / "c")
    second.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    resumed_lrs += [second.step(s)["optim/lr"] for s in range(2, 4)]
    assert resumed_lrs == lrs
