"""Devices and precision: every tensor on ``train.device``, bf16 weights with exact step-0 numbers,
float32 master weights, gradient checkpointing, the sampler/learner mismatch metric.

The tests marked ``device`` take the ``device`` fixture: the CPU here, each device of
``TETHER_TEST_DEVICES`` (e.g. ``cuda``) when set; ``benchmarks/gpu_check.py`` runs them on a GPU.
"""

from __future__ import annotations

import ast
import copy
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from tests.conftest import tiny_run_args
from tests.numerics import EPS32, assert_grads_close
from tether.cli import main
from tether.models.policy import PolicyWithValue
from tether.models.sampling import Rollout, generate, sample_seeds
from tether.models.scoring import rollout_logprobs
from tether.run.config import ConfigError, load_config
from tether.run.setup import build_run, resolve_device, resolve_dtype
from tether.trainers.base import sample_metrics
from tether.trainers.common import RolloutLogprobs
from tether.trainers.precision import INITIAL_LOSS_SCALE, MasterWeights
from tether.trainers.update import optimizer_step
from tether.training import TRAINERS

SRC = Path(__file__).resolve().parents[2] / "src" / "tether"

FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
}
"""Functions that make a tensor on the default device unless told ``device=`` (``*_like`` and
methods inherit their input's device)."""


class FactoryWatch(TorchFunctionMode):
    """Records every factory call made from tether's own code without ``device=``.

    On a machine without a GPU every tensor is on the CPU, so a tensor created on the wrong
    device cannot be seen by where it is; the call that would put it on the CPU under CUDA can.
    """

    def __init__(self):
        super().__init__()
        self.flagged: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            implicit = not (func is torch.as_tensor and args and torch.is_tensor(args[0]))
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            if implicit and frame is not None and frame.f_code.co_filename.startswith(str(SRC)):
                where = f"{Path(frame.f_code.co_filename).relative_to(SRC)}:{frame.f_lineno}"
                self.flagged.append(f"torch.{func.__name__} at {where}")
        return func(*args, **kwargs)


def _config(tiny_model_dir, prompt_file, tmp_path, algo: str, *extra: str):
    settings = {
        "train.algo": algo,
        "rollout.max_new_tokens": 6,
        "data.heldout_fraction": None,
        "train.steps": None,
        "train.save_model": None,
        "train.checkpoint_every": None,
    }
    args = tiny_run_args(tiny_model_dir, prompt_file, tmp_path / "run", settings) + list(extra)
    if algo in ("grpo", "rloo"):
        args.append("rollout.group_size=2")
    if algo == "dpo":
        args += ["dpo.n_pairs=4", "dpo.candidates=2", "dpo.kl_eval_prompts=4"]
    return load_config(None, args)


@pytest.mark.device
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("algo", ["ppo", "grpo", "rloo", "dpo"])
def test_a_training_step_creates_every_tensor_on_the_device(
    algo, dtype, device, tiny_model_dir, prompt_file, tmp_path
):
    """One step of each trainer, with every factory call of tether's code watched: none may leave
    ``device=`` to the default. And step 0 is exact in bf16 as in float32: the policy is the
    reference and the old policy, so the KL is 0.0 and the first ratio 1.0 exactly."""
    cfg = _config(
        tiny_model_dir,
        prompt_file,
        tmp_path,
        algo,
        f"model.dtype={dtype}",
        f"train.device={device}",
        "kl.exact=true",
    )
    run = build_run(cfg)
    assert next(run.policy.lm.parameters()).dtype == getattr(torch, dtype)
    assert next(run.policy.lm.parameters()).device.type == device
    assert run.policy.value_head.weight.dtype == torch.float32
    trainer = TRAINERS[algo](run)
    watch = FactoryWatch()
    with watch:
        row = trainer.step(0)
    assert watch.flagged == [], watch.flagged
    exp = trainer.last_experience
    for t in (exp.scores, exp.old_logprobs, exp.kl, exp.rewards, exp.rollout.response_ids):
        assert t.device.type == device
    assert exp.old_logprobs.dtype == torch.float32 and exp.kl.dtype == torch.float32
    assert 0.0 <= row["rollout/logprob_mismatch"] < 1.0
    if algo != "dpo":  # DPO's probe samples after its first update
        assert row["objective/kl"] == 0.0 and row["objective/kl_exact"] == 0.0
        assert row["policy/ratio_max_dev_first"] == 0.0


@pytest.mark.device
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_k3_is_takes_k3_plus_first_minibatch_step_bit_for_bit(
    dtype, device, tiny_model_dir, prompt_file, tmp_path
):
    """GRPO's KL surrogates on a real step: on the first minibatch the old log-probs are the
    update's own (policy/ratio_max_dev_first = 0), so k3_is's weight pi / pi_old is 1.0 exactly
    and its loss and every gradient equal k3+'s bit for bit; once the policy has moved (a later
    minibatch or epoch) they differ, which is k3_is's point (docs/kl.md)."""
    from tether.core.leash import KLLeash
    from tether.trainers.steps import make_experience

    cfg = _config(
        tiny_model_dir,
        prompt_file,
        tmp_path,
        "grpo",
        f"model.dtype={dtype}",
        f"train.device={device}",
        "kl.controller=fixed",
        "kl.kl_coef=0.5",
        "optim.lr=0.01",
    )
    trainer = TRAINERS["grpo"](build_run(cfg))
    trainer.step(0)  # the policy leaves the reference: the KL term has a gradient from step 1 on
    rollout = trainer.sample_rollout(1)
    scores, _ = trainer.score(rollout, 1)
    minibatches = trainer.minibatch_indices()
    forwards = trainer.rollout_forwards(rollout, minibatches)
    exp = make_experience(
        rollout=rollout,
        scores=scores,
        forwards=forwards.step_forwards(),
        minibatches=minibatches,
        kl_coef=0.5,
        leash=trainer.leash,
        settings=trainer.settings,
    )
    mb = exp.select(minibatches[0])

    def loss_and_grads(estimator: str):
        trainer.leash = KLLeash(False, True, estimator)
        for p in trainer.params:
            p.grad = None
        out = trainer.minibatch_loss(mb, 0.5)
        out.loss.backward()
        return out, [p.grad.clone() for p in trainer.params]

    plus, plus_grads = loss_and_grads("k3+")
    is_, is_grads = loss_and_grads("k3_is")
    assert float(is_.ratio_dev) == 0.0 and float(is_.stats["policy/kl_loss"].detach()) > 0
    assert torch.equal(is_.loss, plus.loss)
    assert all(torch.equal(a, b) for a, b in zip(is_grads, plus_grads))
    # a moved policy (as after a first minibatch's step): the weight is no longer 1
    with torch.no_grad():
        g = torch.Generator(device="cpu").manual_seed(0)
        for p in trainer.params:
            p.add_((1e-2 * torch.randn(p.shape, generator=g)).to(p.device, p.dtype))
    plus, plus_grads = loss_and_grads("k3+")
    is_, is_grads = loss_and_grads("k3_is")
    assert float(is_.ratio_dev) > 0
    assert not all(torch.equal(a, b) for a, b in zip(is_grads, plus_grads))


@pytest.mark.device
def test_dpo_step0_margins_are_exactly_zero_in_bf16(device, tiny_model_dir, prompt_file, tmp_path):
    cfg = _config(
        tiny_model_dir, prompt_file, tmp_path, "dpo", "model.dtype=bfloat16", f"train.device={device}"
    )
    trainer = TRAINERS["dpo"](build_run(cfg))
    for rows in (torch.tensor([0]), torch.tensor([1, 2]), torch.arange(4)):
        out = trainer.pair_loss(rows)
        assert torch.equal(out.chosen_rewards, torch.zeros(len(rows), device=device))
        assert torch.equal(out.rejected_rewards, torch.zeros(len(rows), device=device))
        assert float(out.margin) == 0.0


def test_every_generator_is_made_on_a_named_device():
    """``torch.Generator()`` is a class, not a function a mode sees: read the source instead."""
    missing = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) == "torch.Generator"
                and not any(k.arg == "device" for k in node.keywords)
            ):
                missing.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert missing == []


def test_cuda_without_cuda_is_a_config_error_and_writes_nothing(tiny_model_dir, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="train.device=cuda"):
        resolve_device("cuda")
    out = tmp_path / "run"
    assert (
        main(["train", f"model.name={tiny_model_dir}", "train.device=cuda", f"train.output_dir={out}"]) == 2
    )
    err = capsys.readouterr().err
    assert "train.device=cuda" in err and "train.device=auto or cpu" in err
    assert not out.exists()


def test_device_and_dtype_defaults():
    assert resolve_device("auto", cuda_available=False) == torch.device("cpu")
    assert resolve_device("auto", cuda_available=True) == torch.device("cuda")
    assert resolve_device("cpu", cuda_available=True) == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(ConfigError, match="model.dtype"):
        load_config(None, ["model.dtype=fp8"])


# ---- float32 master weights -------------------------------------------------------------------
def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)


def test_bf16_weights_take_small_updates_through_float32_masters():
    """Ten AdamW steps of lr 1e-3 on a weight of 1.0 whose gradient is always 1.

    Adam's step is lr * m_hat / (sqrt(v_hat) + eps) = 1e-3 * 1 / (1 + 1e-8) each time, so the
    float32 master goes 1.0 -> 0.99 (to float32 rounding). bf16 has 8 significant bits: its
    neighbours of 1.0 are 1 - 2**-8 = 0.99609375 and 1 + 2**-7; a plain bf16 AdamW rounds every
    1.0 - 0.001 back to 1.0 and never moves. Through the master, the bf16 weight is 0.99 rounded
    to bf16: 0.98828125 (253/256; 0.9921875 = 254/256 is farther, 0.0022 against 0.0017).
    """
    plain = torch.ones(1, dtype=torch.bfloat16, requires_grad=True)
    opt = _adamw([plain])
    w = torch.ones(1, dtype=torch.bfloat16, requires_grad=True)
    master = MasterWeights([w], _adamw)
    for _ in range(10):
        for p, o in ((plain, opt), (w, master)):
            o.zero_grad()
            p.grad = torch.ones_like(p)
            if o is master:
                master.accumulate()
            o.step()
    assert float(plain.detach()) == 1.0  # the bug master weights exist for
    assert float(master.masters[0].detach()) == pytest.approx(0.99, abs=10 * EPS32)
    assert float(w.detach()) == 0.98828125


def test_float32_weights_are_their_own_masters():
    w = torch.ones(3, requires_grad=True)
    master = MasterWeights([w], _adamw)
    assert master.masters[0] is w and master.loss_scale == 1.0


def test_masters_survive_a_checkpoint_round_trip():
    """The master is not recoverable from the bf16 weight (0.99 vs 0.98828125): the state keeps it."""
    w = torch.ones(1, dtype=torch.bfloat16, requires_grad=True)
    master = MasterWeights([w], _adamw)
    for _ in range(10):
        master.zero_grad()
        w.grad = torch.ones_like(w)
        master.accumulate()
        master.step()
    state = copy.deepcopy(master.state_dict())
    w2 = torch.ones(1, dtype=torch.bfloat16, requires_grad=True)
    resumed = MasterWeights([w2], _adamw)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.masters[0], master.masters[0]) and torch.equal(w2, w)
    for m in (master, resumed):
        m.zero_grad()
        m.params[0].grad = torch.ones_like(w)
        m.accumulate()
        m.step()
    assert torch.equal(resumed.masters[0], master.masters[0])


def test_float16_overflow_skips_the_step_and_halves_the_loss_scale():
    """loss = 1e4 * w: its gradient 1e4 times the first scale 2**16 is 6.6e8, past float16's
    largest finite 65504, so the step is skipped and the scale halved; from scale 4 (1e4 * 4 =
    40000 < 65504) steps are taken, with the true gradient 1e4 = 4e4 / 4."""
    w = torch.ones(1, dtype=torch.float16, requires_grad=True)
    master = MasterWeights([w], _adamw)
    assert master.loss_scale == INITIAL_LOSS_SCALE
    norm = optimizer_step(master, [w], (w * 1e4).sum(), 1e9, "test")
    assert not torch.isfinite(norm) and float(w.detach()) == 1.0 and master.loss_scale == 2**15
    while master.loss_scale > 4:
        optimizer_step(master, [w], (w * 1e4).sum(), 1e9, "test")
    norm = optimizer_step(master, [w], (w * 1e4).sum(), 1e9, "test")
    assert float(norm) == 1e4 and float(w.detach()) < 1.0 and master.skipped_steps == 14


def test_bf16_update_loop_accumulates_micro_batches_in_float32():
    """Gradient accumulation over two micro-batches: the master gradient is the float32 sum of the
    two bf16 gradients, not their bf16 sum. 1 + 2**-9 is not a bf16 number (it rounds to 1.0),
    but each micro-batch's gradient (1.0 and 2**-9) is, and their float32 sum is exact."""
    w = torch.ones(1, dtype=torch.bfloat16, requires_grad=True)
    master = MasterWeights([w], lambda p: torch.optim.SGD(p, lr=1.0))
    optimizer_step(master, [w], [lambda: (w * 1.0).sum(), lambda: (w * 2**-9).sum()], 1e9, "test")
    assert float(master.masters[0].detach()) == 1.0 - (1.0 + 2**-9)  # SGD, lr 1: w - g, exactly


# ---- gradient checkpointing -------------------------------------------------------------------
@pytest.mark.device
def test_gradient_checkpointing_gives_the_plain_backward(device, tiny_tokenizer, tiny_lm):
    lm = tiny_lm.to(device)
    plain = PolicyWithValue(copy.deepcopy(lm)).to(device)
    ckpt = PolicyWithValue(copy.deepcopy(lm), gradient_checkpointing=True).to(device)
    ckpt.value_head.load_state_dict(plain.value_head.state_dict())
    prompts = ["the movie was", "a terrible boring film with", "i loved"]
    ro = generate(lm, tiny_tokenizer, prompts, 8, 1.0, seeds=sample_seeds(0, 0, range(3)))
    calls = []
    # transformers checkpoints a block's forward (not its __call__): count a module inside it
    ckpt.lm.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: calls.append(1))
    grads = []
    for policy in (plain, ckpt):
        out = rollout_logprobs(policy, ro, 1.0, with_values=True)
        loss = -(out.logprobs * ro.response_mask).sum() + (out.values * ro.response_mask).pow(2).sum()
        loss.backward()
        grads.append([p.grad for p in policy.parameters()])
    assert len(calls) == 2  # the checkpointed block ran again in the backward
    assert not ckpt.lm.training  # back in eval mode after the forward
    # every gradient entry sums one term per response token (B * R of them)
    assert_grads_close(grads[0], grads[1], [grads[0]], ro.response_ids.numel(), "checkpointing: ")


def test_gradient_checkpointing_runs_without_a_shared_prefix(tiny_model_dir, prompt_file, tmp_path):
    cfg = _config(
        tiny_model_dir, prompt_file, tmp_path, "grpo", "model.gradient_checkpointing=true", "kl.exact=true"
    )
    run = build_run(cfg)
    assert run.policy.gradient_checkpointing and not run.policy.share_prefix
    row = TRAINERS["grpo"](run).step(0)
    assert row["objective/kl_exact"] == 0.0 and row["policy/ratio_max_dev_first"] == 0.0


# ---- sampler against learner ------------------------------------------------------------------
def test_logprob_mismatch_is_k3_of_sampler_against_learner():
    """Two valid tokens and one masked. Token 1: sampler and learner agree (-1.0), k3 = 0.
    Token 2: sampler -2.0, learner -2.5, r = learner - sampler = -0.5,
    k3 = exp(-0.5) - 1 + 0.5 = 0.6065307 - 0.5 = 0.1065307. Mean over the 2 tokens: 0.0532653.
    The masked slot (sampler 0.0 against -9.0) counts in neither number."""
    ro = Rollout(
        ["p"],
        torch.ones(1, 1, dtype=torch.long),
        prompt_mask=torch.ones(1, 1, dtype=torch.long),
        response_ids=torch.zeros(1, 3, dtype=torch.long),
        response_mask=torch.tensor([[True, True, False]]),
        responses=["r"],
        sampler_logprobs=torch.tensor([[-1.0, -2.0, 0.0]]),
    )
    zeros = torch.zeros(1, 3)
    learner = RolloutLogprobs(
        torch.tensor([[-1.0, -2.5, -9.0]]), None, values=None, entropy=zeros, exact_kl=None
    )
    row = sample_metrics(ro, torch.zeros(1), kl=zeros, forwards=learner, kl_coef=0.1, estimator="k1")
    assert float(row["rollout/logprob_mismatch"]) == pytest.approx(0.0532653, abs=1e-6)
    assert float(row["rollout/logprob_diff_max"]) == 0.5


@pytest.mark.device
def test_sampler_logprobs_are_the_learners_up_to_cache_rounding(device, tiny_tokenizer, tiny_lm):
    """generate's own log-probs (key/value-cached decoding) against a full forward's, float32.

    Both compute ``z_y - logsumexp(z)`` from logits of the same weights and inputs, once one
    position at a time against the cache and once all at once, so they differ by the rounding
    of the matrix products behind a logit: each a sum of ``d`` (hidden size) terms per layer, so
    ``n = d * (layers + 1)`` terms, each at most ``M`` = the largest |logit| (the attention
    and MLP sums are of the same order in this tiny model); plus the log-sum-exp's own rounding.
    """
    lm = tiny_lm.to(device)
    prompts = ["the movie was", "a terrible boring film with", "i loved", "worst"]
    ro = generate(lm, tiny_tokenizer, prompts, 10, 0.7, seeds=sample_seeds(3, 0, range(4)))
    with torch.no_grad():
        learner = rollout_logprobs(lm, ro, 0.7, keep_logits=True)
    mask = ro.response_mask
    d, layers = lm.config.hidden_size, lm.config.num_hidden_layers
    M = float(learner.logits.abs().max()) / 0.7
    tol = d * (layers + 1) * EPS32 * M
    diff = ((ro.sampler_logprobs - learner.logprobs).abs() * mask).max()
    assert float(diff) <= tol, (float(diff), tol)
