"""The on-policy step's glue in tether.trainers.steps, by hand: make_experience (steps 5-6), the
advantage registry, controller_input (step 8). Every value below is worked out in the comments;
the trainers and the test bed both call these functions, so these numbers are theirs."""

from __future__ import annotations

import pytest
import torch

from tether.core.leash import KLLeash
from tether.testing.testbed import TableSamples
from tether.trainers.steps import ADVANTAGES, StepSettings, controller_input, make_experience

F64 = torch.float64


def samples(mask: list[list[bool]]) -> TableSamples:
    m = torch.tensor(mask)
    return TableSamples(torch.zeros(m.shape, dtype=torch.long), torch.zeros(m.shape, dtype=torch.long), m)


def experience(algo: str, leash: KLLeash, kl_coef: float, **settings):
    # 4 one-token sequences, two groups of 2; k1 = old - ref = [0.5, 0, 0, -0.5]
    return make_experience(
        rollout=samples([[True]] * 4),
        scores=torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=F64),
        old_logprobs=torch.tensor([[-1.0], [-1.0], [-1.0], [-1.0]], dtype=F64),
        ref_logprobs=torch.tensor([[-1.5], [-1.0], [-1.0], [-0.5]], dtype=F64),
        values=torch.zeros(4, 1, dtype=F64) if algo == "ppo" else None,
        exact_kl=torch.tensor([[0.2], [0.1], [0.1], [0.4]], dtype=F64),
        minibatches=[torch.arange(4)],
        kl_coef=kl_coef,
        leash=leash,
        settings=StepSettings(algo=algo, group_size=2, **settings),
    )


def test_rloo_experience_by_hand():
    # k1 in the reward, beta 0.5: rewards = score - 0.5 k1 = [1 - 0.25, 0, 1, 1 + 0.25]
    #   = [0.75, 0, 1, 1.25]; leave-one-out advantage r_i - r_other:
    #   [0.75 - 0, 0 - 0.75, 1 - 1.25, 1.25 - 1] = [0.75, -0.75, -0.25, 0.25]
    exp = experience("rloo", KLLeash(True, False), 0.5)
    assert exp.kl.flatten().tolist() == [0.5, 0.0, 0.0, -0.5]
    assert exp.rewards.flatten().tolist() == [0.75, 0.0, 1.0, 1.25]
    assert exp.non_score_reward.flatten().tolist() == [-0.25, 0.0, 0.0, 0.25]
    assert exp.advantages.flatten().tolist() == [0.75, -0.75, -0.25, 0.25]
    assert exp.returns is None and exp.return_scale is None and exp.kl_weights is None
    assert exp.exact_kl.flatten().tolist() == [0.2, 0.1, 0.1, 0.4]  # kept for step 8


def test_grpo_experience_by_hand_with_an_all_equal_group():
    # KL in the loss: rewards are the scores [1, 0, 1, 1]. Group 1: mean 0.5, std of (1, 0)
    # (n - 1 normalisation) = sqrt(0.5) = 0.7071; advantages +-0.5 / (0.7071 + 1e-4) = +-0.70701.
    # Group 2 is all-equal: advantage exactly 0, and with scale_kl_by_std its KL weight is the
    # other groups' mean, 1 / (0.7071 + 1e-4) = 1.41401 (docs/kl.md, "All-equal groups")
    exp = experience("grpo", KLLeash(False, True), 0.5, scale_kl_by_std=True)
    assert exp.rewards.flatten().tolist() == [1.0, 0.0, 1.0, 1.0]
    adv = exp.advantages.flatten()
    assert adv[2:].tolist() == [0.0, 0.0]
    w = 1 / (0.5**0.5 + 1e-4)
    # the group statistics are float32 (unit roundoff 6e-8, a few operations): rel 1e-6
    assert adv[:2].tolist() == pytest.approx([0.5 * w, -0.5 * w], rel=1e-6)
    assert exp.kl_weights.tolist() == pytest.approx([w] * 4, rel=1e-6)
    # without scale_kl_by_std, or with the KL in the reward, there are no weights
    assert experience("grpo", KLLeash(False, True), 0.5).kl_weights is None
    assert experience("grpo", KLLeash(True, False), 0.5, scale_kl_by_std=True).kl_weights is None


def test_ppo_experience_returns_its_scale_and_needs_values():
    # one token per sequence, gamma 1, zero values: the return is the reward, the GAE advantage
    # too. k1 in the reward at beta 0.5: rewards [0.75, 0, 1, 1.25], std (n - 1) of them =
    # 0.5401; return_scale = max(1, std) = 1, so the returns are the rewards themselves
    exp = experience("ppo", KLLeash(True, False), 0.5)
    assert float(exp.return_scale) == 1.0
    assert exp.returns.flatten().tolist() == [0.75, 0.0, 1.0, 1.25]
    # whitened: mean 0.75, std 0.5401 -> (r - 0.75) / 0.5401
    assert exp.advantages.flatten().tolist() == pytest.approx([0.0, -1.3887, 0.4629, 0.9258], abs=1e-4)
    with pytest.raises(ValueError, match="value head's predictions"):
        ADVANTAGES["ppo"](None, None, None, StepSettings(algo="ppo"))


def test_controller_input_reads_the_signal_and_unit_asked_for():
    # two sequences, the second one token long: kl [[0.1, 0.2], [0.3, -]], exact [[0.5, 0.5], [1.0, -]]
    exp = make_experience(
        rollout=samples([[True, True], [True, False]]),
        scores=torch.tensor([0.0, 0.0], dtype=F64),
        old_logprobs=torch.tensor([[0.1, 0.2], [0.3, 7.0]], dtype=F64),
        ref_logprobs=torch.zeros(2, 2, dtype=F64),
        values=torch.zeros(2, 2, dtype=F64),
        exact_kl=torch.tensor([[0.5, 0.5], [1.0, 9.9]], dtype=F64),
        minibatches=[],
        kl_coef=0.0,
        leash=KLLeash(True, False),
        settings=StepSettings(algo="ppo"),
    )

    def read(signal, unit):
        return controller_input(exp, StepSettings(algo="ppo", controller_signal=signal, target_unit=unit))

    assert read("exact", "nats_per_sequence") == pytest.approx((1.0 + 1.0) / 2)  # masked 9.9 ignored
    assert read("exact", "nats_per_token") == pytest.approx((0.5 + 0.5 + 1.0) / 3)
    assert read("estimator", "nats_per_sequence") == pytest.approx((0.3 + 0.3) / 2)
    assert read("estimator", "nats_per_token") == pytest.approx((0.1 + 0.2 + 0.3) / 3)
    with pytest.raises(ValueError, match="kl.exact=true"):
        controller_input(exp._replace(exact_kl=None), StepSettings(algo="ppo"))
    assert controller_input(exp._replace(kl=None), StepSettings(algo="ppo")) is None  # no reference
