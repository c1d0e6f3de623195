"""``--resume RUN optim.X=...``: every optim setting applies from the next step, or is refused.

A checkpoint holds the optimizer's and the schedule's state, and loading it used to put the old
learning rate and weight decay back over the resumed config's (prime-rl PRs #1095 and #2088 fix
the same bug). Here each setting is changed on resume and the optimizer steps after it are
watched: the rate, weight decay, kernel, clipping norm and micro-batches each step ran with.

The base run: rollout.batch_size=4, optim.minibatch_size=2, optim.epochs=1, so 2 optimizer steps
per training step; train.steps=3, so a linear schedule over 6 optimizer steps, lambda(n) =
(6 - n) / 6; one step (optimizer steps 0 and 1) before the checkpoint, so the resumed run's
first optimizer step is n = 2.
"""

from __future__ import annotations

import io
import json
import math

import pytest
import torch

import tether.trainers.update as update
from tests.conftest import tiny_run_args
from tether.cli import main
from tether.run.config import load_config
from tether.run.setup import build_run
from tether.training import TRAINERS

LR = 1e-3


def _args(model_dir, prompts, out, algo: str, overrides: list[str]) -> list[str]:
    settings = {
        "train.algo": algo,
        "rollout.max_prompt_tokens": 32,
        "optim.lr": LR,
        "optim.lr_scheduler": "linear",
        "train.steps": 3,
        "eval.every": 0,
        "data.heldout_fraction": None,
        "train.progress": None,
        "train.save_model": None,
        "train.checkpoint_every": None,
    }
    args = tiny_run_args(model_dir, prompts, out, settings)
    if algo in ("grpo", "rloo"):
        args.append("rollout.group_size=2")
    if algo == "dpo":
        args += ["dpo.n_pairs=4", "dpo.candidates=2", "dpo.kl_eval_prompts=2"]
    return args + overrides


@pytest.fixture()
def optimizer_steps(monkeypatch) -> list[dict]:
    """What each optimizer step ran with, recorded as it is called (before AdamW steps)."""
    seen: list[dict] = []
    real = update.optimizer_step

    def watched(optimizer, params, loss, max_grad_norm, *args, **kw):
        group = optimizer.param_groups[0]
        seen.append(
            {
                "lr": group["lr"],
                "weight_decay": group["weight_decay"],
                "fused": bool(group.get("fused")),
                "max_grad_norm": max_grad_norm,
                "micro_batches": len(loss),
            }
        )
        return real(optimizer, params, loss, max_grad_norm, *args, **kw)

    monkeypatch.setattr(update, "optimizer_step", watched)
    return seen


def _resume_after_step_0(tiny_model_dir, prompt_file, tmp_path, algo, first, resumed, caplog, steps):
    """Train step 0 with ``first``, its trainer state through torch.save into a trainer built with
    ``resumed`` (what ``--resume`` does: train.training._resume); clear ``steps`` (the optimizer
    steps so far) and train step 1. Returns the resumed trainer and step 1's metrics row."""
    a = TRAINERS[algo](
        build_run(load_config(None, _args(tiny_model_dir, prompt_file, tmp_path / "a", algo, first)))
    )
    a.step(0)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = TRAINERS[algo](
        build_run(
            load_config(None, _args(tiny_model_dir, prompt_file, tmp_path / "b", algo, first + resumed))
        )
    )
    caplog.clear()
    b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False), next_step=1)
    steps.clear()
    return b, b.step(1)


def _linear(n: int, total: int, lr: float = LR) -> float:
    return lr * (total - n) / total


# (field, the run's settings, the resumed ones, the change line, what the resumed optimizer steps ran with)
CASES = [
    # lambda(2) = 4/6 and lambda(3) = 3/6 at the new peak rate: 6.67e-5 and 5e-5 (not 6.67e-4, 5e-4)
    ("lr", [], ["optim.lr=1e-4"], "lr 0.001 -> 0.0001", {"lr": [_linear(2, 6, 1e-4), _linear(3, 6, 1e-4)]}),
    (
        "weight_decay",
        [],
        ["optim.weight_decay=0.1"],
        "weight_decay 0 -> 0.1",
        {"weight_decay": [0.1, 0.1], "lr": [_linear(2, 6), _linear(3, 6)]},
    ),
    # cosine over 6, no warmup: lambda(n) = 0.5 * (1 + cos(pi * n / 6)): 0.75 at n = 2, 0.5 at n = 3
    (
        "lr_scheduler",
        [],
        ["optim.lr_scheduler=cosine"],
        "lr_scheduler linear -> cosine",
        {"lr": [LR * 0.5 * (1 + math.cos(math.pi * 2 / 6)), LR * 0.5 * (1 + math.cos(math.pi * 3 / 6))]},
    ),
    ("lr_scheduler", [], ["optim.lr_scheduler=constant"], "linear -> constant", {"lr": [LR, LR]}),
    # linear with 4 warmup steps: n / 4 while n < 4, so 2/4 and 3/4 (the rate climbs back)
    ("warmup_steps", [], ["optim.warmup_steps=4"], "warmup_steps 0 -> 4", {"lr": [LR * 2 / 4, LR * 3 / 4]}),
    # 4 optimizer steps per step now: total = 6 - (3 - 1) * 2 + (3 - 1) * 4 = 10, so (10 - n) / 10
    # for n = 2..5; the decay still reaches 0 after the last step (n = 10)
    ("epochs", [], ["optim.epochs=2"], "epochs 1 -> 2", {"lr": [_linear(n, 10) for n in range(2, 6)]}),
    # 1 optimizer step per step now: total = 6 - 2 * 2 + 2 * 1 = 4, lambda(2) = 2/4
    ("minibatch_size", [], ["optim.minibatch_size=4"], "minibatch_size 2 -> 4", {"lr": [_linear(2, 4)]}),
    (
        "micro_batch_size",
        [],
        ["optim.micro_batch_size=1"],
        "micro_batch_size null -> 1",
        {"micro_batches": [2, 2], "lr": [_linear(2, 6), _linear(3, 6)]},
    ),
    (
        "max_grad_norm",
        [],
        ["optim.max_grad_norm=0.5"],
        "max_grad_norm 1 -> 0.5",
        {"max_grad_norm": [0.5, 0.5]},
    ),
    ("fused_adamw", [], ["optim.fused_adamw=false"], "fused_adamw True -> False", {"fused": [False, False]}),
    (
        "fused_adamw",
        ["optim.fused_adamw=false"],
        ["optim.fused_adamw=true"],
        "False -> True",
        {"fused": [True, True]},
    ),
    # one minibatch of the whole batch: 1 optimizer step per step, linear over 3: lambda(1) = 2/3
    (
        "reuse_forward",
        ["optim.minibatch_size=4"],
        ["optim.reuse_forward=false"],
        "reuse_forward True -> False",
        {"lr": [_linear(1, 3)]},
    ),
    # not an optim field, but the schedule's length: total 6 + (5 - 3) * 2 = 10, an uninterrupted
    # 5-step run's, so (10 - 2) / 10 = 0.8 and 0.7 (the old code ran the first one at 4/6)
    (
        "train.steps",
        [],
        ["train.steps=5"],
        "schedule over 6 -> 10 optimizer steps",
        {"lr": [_linear(2, 10), _linear(3, 10)]},
    ),
]


@pytest.mark.parametrize(
    ("field", "first", "resumed", "said", "want"),
    CASES,
    ids=[f"{c[0]}-{c[2][0].split('=')[1]}" for c in CASES],
)
def test_a_changed_optim_setting_applies_from_the_next_step(
    field, first, resumed, said, want, tiny_model_dir, prompt_file, tmp_path, caplog, optimizer_steps
):
    trainer, row = _resume_after_step_0(
        tiny_model_dir, prompt_file, tmp_path, "grpo", first, resumed, caplog, optimizer_steps
    )
    for key, values in want.items():
        assert [s[key] for s in optimizer_steps] == pytest.approx(values, rel=1e-12), key
    assert row["optim/lr"] == optimizer_steps[0]["lr"]  # the logged rate is that of the step's first
    assert said in caplog.text and "resuming with optim settings changed" in caplog.text
    if field == "reuse_forward":
        assert not trainer.reuse_forward
    if field == "epochs":  # 4 optimizer steps taken of 10: the last step's 4 end the decay at 0
        assert (trainer.scheduler.last_epoch, trainer.schedule_steps) == (6, 10)
    if field == "fused_adamw":  # the AdamW state was stepped on by the other kernel
        inner = trainer.optimizer.optimizer
        assert all(float(s["step"]) == 4 for s in inner.state.values())


@pytest.mark.parametrize("algo", ["ppo", "grpo", "rloo", "dpo", "grpo-lora"])
def test_every_trainer_takes_the_new_lr_and_weight_decay(
    algo, tiny_model_dir, prompt_file, tmp_path, caplog, optimizer_steps
):
    name, lora = algo.removesuffix("-lora"), ["model.lora_r=2"] if algo.endswith("-lora") else []
    trainer, row = _resume_after_step_0(
        tiny_model_dir,
        prompt_file,
        tmp_path,
        name,
        lora,
        ["optim.lr=1e-4", "optim.weight_decay=0.1"],
        caplog,
        optimizer_steps,
    )
    # 2 optimizer steps per step for every trainer (DPO: 4 pairs in minibatches of 2)
    assert row["optim/lr"] == pytest.approx(_linear(2, 6, 1e-4), rel=1e-12)  # 6.67e-5
    assert [s["lr"] for s in optimizer_steps] == pytest.approx([_linear(2, 6, 1e-4), _linear(3, 6, 1e-4)])
    groups = trainer.optimizer.param_groups
    assert all(g["weight_decay"] == 0.1 and g["initial_lr"] == 1e-4 for g in groups)
    assert trainer.scheduler.base_lrs == [1e-4] * len(groups)
    assert trainer.scheduler.get_last_lr() == [_linear(4, 6, 1e-4)] * len(groups)  # the next step's
    assert "lr 0.001 -> 0.0001, weight_decay 0 -> 0.1" in caplog.text


def test_an_unchanged_resume_keeps_every_rate_and_says_nothing(
    tiny_model_dir, prompt_file, tmp_path, caplog, optimizer_steps
):
    """Cosine with warmup, steps 1 and 2 resumed against the same steps straight: the same rates
    bit for bit, and no change line."""
    settings = ["optim.lr_scheduler=cosine", "optim.warmup_steps=3"]
    straight = TRAINERS["grpo"](
        build_run(load_config(None, _args(tiny_model_dir, prompt_file, tmp_path / "s", "grpo", settings)))
    )
    for s in range(3):
        straight.step(s)
    want = [s["lr"] for s in optimizer_steps[2:]]
    trainer, _ = _resume_after_step_0(
        tiny_model_dir, prompt_file, tmp_path, "grpo", settings, [], caplog, optimizer_steps
    )
    trainer.step(2)
    assert [s["lr"] for s in optimizer_steps] == want  # exactly
    assert "resuming with optim settings changed" not in caplog.text


@pytest.fixture()
def one_step_run(tiny_model_dir, prompt_file, tmp_path):
    """A finished one-step GRPO run through the CLI (linear over its 2 optimizer steps), checkpointed."""
    out = tmp_path / "run"
    args = [
        "train",
        *_args(tiny_model_dir, prompt_file, out, "grpo", ["train.steps=1", "train.checkpoint_every=1"]),
    ]
    assert main(args + ["train.progress=false", "train.save_model=false"]) == 0
    return out


def _lr_rows(out) -> list[float]:
    return [json.loads(line)["optim/lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_resume_with_a_new_lr_logs_it_and_records_it(one_step_run, caplog, capsys):
    """The issue's command: the run extended to 3 steps with lr 1e-4 and weight decay 0.1. The
    schedule: 2 optimizer steps of the first run plus 2 x 2 left = 6; step 1 starts at n = 2,
    1e-4 * 4/6 = 6.67e-5, step 2 at n = 4, 1e-4 * 2/6 = 3.33e-5. (The old code logged 0.0, the
    rate the one-step schedule had reached, then 3.33e-4, the checkpoint's rate on the new curve.)"""
    assert _lr_rows(one_step_run) == [LR]
    resumed = ["optim.lr=1e-4", "optim.weight_decay=0.1", "train.steps=3"]
    assert main(["train", "--resume", str(one_step_run), *resumed]) == 0
    lrs = _lr_rows(one_step_run)
    print("optim/lr by step:", lrs)
    assert lrs == pytest.approx([LR, 1e-4 * 4 / 6, 1e-4 * 2 / 6], rel=1e-12)
    assert (
        "resuming with optim settings changed (lr 0.001 -> 0.0001, weight_decay 0 -> 0.1, schedule over "
        "2 -> 6 optimizer steps, the next optimizer step's rate 0 -> 6.66667e-05)"
    ) in caplog.text
    cfg = load_config(one_step_run / "config.yaml", [])
    assert (cfg.optim.lr, cfg.optim.weight_decay) == (1e-4, 0.1)


def test_resume_refuses_a_minibatch_size_that_does_not_divide_the_batch(one_step_run, capsys):
    before = (one_step_run / "config.yaml").read_text()
    assert main(["train", "--resume", str(one_step_run), "optim.minibatch_size=3", "train.steps=2"]) == 2
    err = capsys.readouterr().err
    assert "optim.minibatch_size=3" in err and "must divide rollout.batch_size=4" in err
    assert (one_step_run / "config.yaml").read_text() == before  # the run is as it was
    assert _lr_rows(one_step_run) == [LR]
