"""tether.trainers.steps by hand: make_experience (steps 5-6), the advantage registry,
controller_input (step 8), and each step function called directly. Every value below is worked
out in the comments; the trainers and the test bed both call these functions, so these numbers
are theirs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

from tether.core.leash import KLLeash
from tether.testing.testbed import TableSamples
from tether.trainers.steps import (
    ADVANTAGES,
    ClipSettings,
    Forwards,
    StepSettings,
    broadcast_sequence_advantages,
    clipped_policy_loss,
    controller_input,
    dpo_pair_loss,
    grpo_advantages,
    grpo_kl_weights,
    kl_and_rewards,
    make_experience,
    ppo_advantages,
    rloo_token_advantages,
    uses_kl_weights,
)

F64 = torch.float64


def samples(mask: list[list[bool]]) -> TableSamples:
    m = torch.tensor(mask)
    return TableSamples(torch.zeros(m.shape, dtype=torch.long), torch.zeros(m.shape, dtype=torch.long), m)


def experience(algo: str, leash: KLLeash, kl_coef: float, **settings):
    # 4 one-token sequences, two groups of 2; k1 = old - ref = [0.5, 0, 0, -0.5]
    return make_experience(
        rollout=samples([[True]] * 4),
        scores=torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=F64),
        forwards=Forwards(
            old_logprobs=torch.tensor([[-1.0], [-1.0], [-1.0], [-1.0]], dtype=F64),
            ref_logprobs=torch.tensor([[-1.5], [-1.0], [-1.0], [-0.5]], dtype=F64),
            values=torch.zeros(4, 1, dtype=F64) if algo == "ppo" else None,
            exact_kl=torch.tensor([[0.2], [0.1], [0.1], [0.4]], dtype=F64),
        ),
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
        ADVANTAGES["ppo"](None, None, None, StepSettings(algo="ppo"), scored=None)


def unscored_experience(algo: str, leash: KLLeash, kl_coef: float = 0.0, **settings):
    # One group of 4 one-token samples; two rewards returned [None/None, 1/0, 0.25/None, 1/0]:
    # sample 0 is unscored (NaN), the others sum to [1, 0.25, 1] (the TRL check).
    # k1 = old - ref = [0.5, 0, 0, -0.5].
    return make_experience(
        rollout=samples([[True]] * 4),
        scores=torch.tensor([math.nan, 1.0, 0.25, 1.0], dtype=F64),
        forwards=Forwards(
            old_logprobs=torch.tensor([[-1.0]] * 4, dtype=F64),
            ref_logprobs=torch.tensor([[-1.5], [-1.0], [-1.0], [-0.5]], dtype=F64),
            values=torch.zeros(4, 1, dtype=F64) if algo == "ppo" else None,
            exact_kl=torch.tensor([[0.2], [0.1], [0.1], [0.4]], dtype=F64),
        ),
        minibatches=[torch.arange(4)],
        kl_coef=kl_coef,
        leash=leash,
        settings=StepSettings(algo=algo, group_size=4 if algo != "ppo" else 1, **settings),
    )


def test_unscored_samples_leave_the_group_statistics_with_advantage_zero():
    # TRL 1.16 (PR #5902) on rewards [-, 1, 0.25, 1]: the scored three have mean 0.75 and
    # unbiased std sqrt((0.25^2 + 0.5^2 + 0.25^2) / 2) = sqrt(0.1875) = 0.43301; advantages
    # [0, 0.25, -0.5, 0.25] / (0.43301 + 1e-4) = [0, 0.57722, -1.15444, 0.57722]. Counting the
    # unscored sample as 0 (the old code) gave [-1.091, 0.849, -0.606, 0.849].
    grpo = unscored_experience("grpo", KLLeash(False, True), 0.5)
    w = 1 / (0.1875**0.5 + 1e-4)
    # the shaped rewards are float32 (unit roundoff 6e-8, a few operations): rel 1e-6
    assert grpo.advantages.flatten().tolist() == pytest.approx([0.0, 0.25 * w, -0.5 * w, 0.25 * w], rel=1e-6)
    assert grpo.scored.tolist() == [False, True, True, True]
    assert grpo.update_mask is None  # GRPO keeps the row in the loss (advantage 0; its KL term counts)
    # RLOO, KL in the reward at beta 0 (the scores alone): leave-one-out over the scored siblings,
    # 1 - (0.25 + 1) / 2 = 0.375, 0.25 - (1 + 1) / 2 = -0.75, 0.375; the unscored sample 0
    rloo = unscored_experience("rloo", KLLeash(True, False), 0.0)
    assert rloo.advantages.flatten().tolist() == [0.0, 0.375, -0.75, 0.375]
    # with beta 0.5 the unscored row's reward -0.5 * 0.5 = -0.25 (its KL) still reaches no sibling:
    # rewards [-, 1, 0.25, 1.25]; 1 - 1.5 / 2 = 0.25, 0.25 - 2.25 / 2 = -0.875, 1.25 - 1.25 / 2 = 0.625
    rloo = unscored_experience("rloo", KLLeash(True, False), 0.5)
    assert rloo.advantages.flatten().tolist() == [0.0, 0.25, -0.875, 0.625]
    # the controller still reads every sample's KL: exact [0.2, 0.1, 0.1, 0.4] -> mean 0.2
    assert controller_input(rloo, StepSettings(algo="rloo", group_size=4)) == pytest.approx(0.2, rel=1e-12)


def test_unscored_samples_leave_ppos_update():
    # PPO, one-token samples, zero values, beta 0: returns = scores; the unscored row is out of
    # the update mask, so the whitening is over [1, 0.25, 1]: mean 0.75, std 0.43301 ->
    # [0.57735, -1.15470, 0.57735] (WHITEN_EPS 1e-8 moves the 5th digit by nothing)
    exp = unscored_experience("ppo", KLLeash(True, False), 0.0)
    assert exp.update_mask.flatten().tolist() == [False, True, True, True]
    assert exp.mask.flatten().tolist() == [False, True, True, True]  # what the losses count
    assert exp.advantages.flatten().tolist() == pytest.approx([0.0, 0.57735, -1.15470, 0.57735], abs=1e-5)
    assert exp.returns.flatten().tolist() == [0.0, 1.0, 0.25, 1.0]
    mb = exp.select(torch.tensor([0, 1]))
    assert mb.update_mask.flatten().tolist() == [False, True] and mb.scored.tolist() == [False, True]
    # the loss of a micro-batch holding only the unscored row is 0 and has no gradient on it
    logprobs = torch.tensor([[-1.0]], dtype=F64, requires_grad=True)
    out = clipped_policy_loss(
        exp.select(torch.tensor([0])), logprobs, ClipSettings(0.2), KLLeash(True, False), 0.0
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and logprobs.grad.abs().sum().item() == 0.0


def test_group_statistics_edge_cases_with_unscored_samples():
    from tether.core.advantages import group_normalized_advantages, rloo_advantages

    nan = math.nan
    # one scored sample in a group: no ranking, advantages 0; none scored: 0
    scores = torch.tensor([nan, 2.0, nan, nan, nan, nan, nan, nan], dtype=F64)
    scored = ~torch.isnan(scores)
    assert group_normalized_advantages(scores, 4, scored=scored).tolist() == [0.0] * 8
    assert rloo_advantages(scores, 4, scored=scored).tolist() == [0.0] * 8
    # every sample scored: bit for bit the plain statistics
    x = torch.rand(8, dtype=F64)
    all_scored = torch.ones(8, dtype=torch.bool)
    assert torch.equal(
        group_normalized_advantages(x, 4, scored=all_scored), group_normalized_advantages(x, 4)
    )
    assert torch.equal(rloo_advantages(x, 4, scored=all_scored), rloo_advantages(x, 4))
    # the scored samples of a group with holes equal the group of those samples alone
    x[[1, 6]] = nan
    part = ~torch.isnan(x)
    for scale in (True, False):
        got = group_normalized_advantages(x, 4, scale, scored=part)
        for g in range(2):
            rows = [i for i in range(4 * g, 4 * g + 4) if part[i]]
            alone = group_normalized_advantages(x[rows], len(rows), scale)
            assert got[rows].tolist() == pytest.approx(alone.tolist(), rel=1e-12, abs=1e-15)
    got = rloo_advantages(x, 4, scored=part)
    for g in range(2):
        rows = [i for i in range(4 * g, 4 * g + 4) if part[i]]
        assert got[rows].tolist() == pytest.approx(rloo_advantages(x[rows], len(rows)).tolist(), rel=1e-12)
    assert got[[1, 6]].tolist() == [0.0, 0.0]


def hole_experience(algo: str, leash: KLLeash, kl_coef: float, **settings):
    # One group of 2 responses of 4 tokens whose masks have a hole: [policy, tool, policy, tool].
    # k1 = old - ref = [0.1, 5, 0.3, 0.7] and [0.2, 9, 0.2, 9]: the tool's positions hold values
    # that would dominate everything if anything counted them. Scores 2 and 1.
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0]], dtype=F64)
    k1 = torch.tensor([[0.1, 5.0, 0.3, 0.7], [0.2, 9.0, 0.2, 9.0]], dtype=F64)
    return make_experience(
        rollout=samples([[True, False, True, False]] * 2),
        scores=torch.tensor([2.0, 1.0], dtype=F64),
        forwards=Forwards(
            old_logprobs=old,
            ref_logprobs=old - k1,
            values=None,
            exact_kl=k1.abs(),
        ),
        minibatches=[torch.arange(2)],
        kl_coef=kl_coef,
        leash=leash,
        settings=StepSettings(algo=algo, group_size=2, **settings),
    )


def test_group_trainers_with_a_hole_in_the_mask_by_hand():
    # RLOO, k1 in the reward at beta 0.1: the sequence reward sums the policy's tokens only,
    #   2 - 0.1 * (0.1 + 0.3) = 1.96 and 1 - 0.1 * (0.2 + 0.2) = 0.96 (counting the tool's
    #   positions: 2 - 0.61 = 1.39 and 1 - 1.84 = -0.84); leave-one-out advantages
    #   1.96 - 0.96 = 1 and -1, on the policy's tokens only
    exp = hole_experience("rloo", KLLeash(True, False), 0.1)
    assert exp.rewards.sum(-1).tolist() == pytest.approx([1.96, 0.96], abs=1e-12)
    want = torch.tensor([[1.0, 0.0, 1.0, 0.0], [-1.0, 0.0, -1.0, 0.0]], dtype=F64)
    torch.testing.assert_close(exp.advantages.to(F64), want, atol=1e-12, rtol=0)
    # GRPO, k2 in the loss at beta 0.1: advantages of the scores, mean 1.5, std sqrt(0.5):
    #   +-0.5 / (0.70711 + 1e-4) = +-0.70701 on the policy's tokens. At ratio 1 the policy term
    #   is -mean A over the 4 policy tokens = 0, and the KL term beta * mean 0.5 k1^2 over them:
    #   0.1 * (0.005 + 0.045 + 0.02 + 0.02) / 4 = 0.00225 (with the tool's: 0.1 * 27.7 = 2.77)
    leash = KLLeash(False, True, "k2")
    exp = hole_experience("grpo", leash, 0.1)
    a = 0.5 / (0.5**0.5 + 1e-4)
    want = torch.tensor([[a, 0, a, 0], [-a, 0, -a, 0]], dtype=F64)
    torch.testing.assert_close(exp.advantages.to(F64), want, atol=1e-6, rtol=0)  # float32 statistics
    logprobs = exp.old_logprobs.clone().requires_grad_(True)
    out = clipped_policy_loss(exp, logprobs, ClipSettings(0.2), leash, 0.1)
    assert out.stats["policy/kl_loss"].item() == pytest.approx(0.00225, rel=1e-12)
    assert out.loss.item() == pytest.approx(0.00225, abs=1e-9)  # float32 advantages: 1e-9 of +-0.7
    out.loss.backward()
    assert (logprobs.grad[:, [1, 3]] == 0).all()  # the tool's tokens get no gradient
    # GRPO with k1_seq in the loss: token 0's KL still to come sums the later policy tokens only
    #   (row 0: 0.3, not 0.3 + 0.7 + 5); covered by tests/core/test_losses.py's hole test


def test_controller_input_reads_the_signal_and_unit_asked_for():
    # two sequences, the second one token long: kl [[0.1, 0.2], [0.3, -]], exact [[0.5, 0.5], [1.0, -]]
    exp = make_experience(
        rollout=samples([[True, True], [True, False]]),
        scores=torch.tensor([0.0, 0.0], dtype=F64),
        forwards=Forwards(
            old_logprobs=torch.tensor([[0.1, 0.2], [0.3, 7.0]], dtype=F64),
            ref_logprobs=torch.zeros(2, 2, dtype=F64),
            values=torch.zeros(2, 2, dtype=F64),
            exact_kl=torch.tensor([[0.5, 0.5], [1.0, 9.9]], dtype=F64),
        ),
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
        controller_input(
            exp._replace(forwards=exp.forwards._replace(exact_kl=None)), StepSettings(algo="ppo")
        )
    no_reference = exp._replace(leashed=exp.leashed._replace(kl=None))
    assert controller_input(no_reference, StepSettings(algo="ppo")) is None


# ---- each function of steps.py called directly, by hand ----------------------------------------

# two rows of three tokens; the second row's third token is padding (its numbers are garbage)
MASK = torch.tensor([[True, True, True], [True, True, False]])


def flat(x) -> list[float]:
    """A tensor or nested list as one flat list of floats (pytest.approx takes no nesting)."""
    return torch.as_tensor(x, dtype=F64).flatten().tolist()


def test_kl_and_rewards_by_hand():
    # k1 = old - ref: row 0 [-1 + 1.5, -2 + 2, -3 + 2] = [0.5, 0, -1]; row 1 [-0.5, 0, .]
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-0.5, -1.0, -9.0]], dtype=F64)
    scores = torch.tensor([2.0, 1.0], dtype=F64)
    out = kl_and_rewards(scores, old, ref, MASK, 0.1, estimator="k1", leash=KLLeash(True, False))
    assert out.kl[MASK].tolist() == [0.5, 0.0, -1.0, -0.5, 0.0]
    # KL in the reward at beta 0.1: -0.1 k1 on every valid token, the score on the last valid one:
    #   row 0 [-0.05, 0, 0.1 + 2] = [-0.05, 0, 2.1]; row 1 [0.05, 0 + 1, pad 0]
    assert flat(out.rewards) == pytest.approx(flat([[-0.05, 0.0, 2.1], [0.05, 1.0, 0.0]]), abs=1e-15)
    assert flat(out.non_score_reward) == pytest.approx(flat([[-0.05, 0.0, 0.1], [0.05, 0.0, 0.0]]), abs=1e-15)
    assert out.token_correction is None
    # KL in the loss: the rewards are the scores alone; the KL is still estimated (logged)
    out = kl_and_rewards(scores, old, ref, MASK, 0.1, estimator="k3", leash=KLLeash(False, True))
    assert out.rewards.tolist() == [[0.0, 0.0, 2.0], [0.0, 1.0, 0.0]]
    assert out.non_score_reward.abs().sum().item() == 0.0
    # k3 of row 0's first token: r = ref - old = -0.5, e^-0.5 - 1 + 0.5 = 0.1065307
    assert out.kl[0, 0].item() == pytest.approx(math.exp(-0.5) - 0.5, rel=1e-15)
    # no reference: no KL, the scores alone
    none = kl_and_rewards(scores, old, None, MASK, 0.1, estimator="k1", leash=KLLeash(True, False))
    assert none.kl is None and none.rewards.tolist() == [[0.0, 0.0, 2.0], [0.0, 1.0, 0.0]]


def test_ppo_advantages_by_hand():
    # one row, rewards [0, 1, pad], values [0.5, 0.25, pad], gamma 0.9, lambda 0.5, no whitening:
    # delta_1 = 1 + 0.9 * 0 - 0.25 = 0.75 (nothing after the last valid token)
    # delta_0 = 0 + 0.9 * 0.25 - 0.5 = -0.275
    # A_1 = 0.75, A_0 = -0.275 + 0.9 * 0.5 * 0.75 = 0.0625; returns = A + V = [0.5625, 1.0]
    rewards = torch.tensor([[0.0, 1.0, 5.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.25, 7.0]], dtype=F64)
    mask = torch.tensor([[True, True, False]])
    adv, ret, scale = ppo_advantages(rewards, values, mask, 0.9, 0.5, whiten=False)
    assert flat(adv) == pytest.approx([0.0625, 0.75, 0.0], abs=1e-15)
    assert flat(ret) == pytest.approx([0.5625, 1.0, 0.0], abs=1e-15)
    assert float(scale) == 1.0


def test_ppo_advantages_scale_returns_and_token_correction_by_hand():
    # summed rewards [0, 4]: std (n - 1) = sqrt(8) = 2.8284 > 1, so the scale is 2.8284; gamma =
    # lambda = 1, values 0: each token's return is the scaled reward to come, row 1 [4, 4] / 2.8284
    # = [1.41421, 1.41421]. The correction 0.1 on row 0's first token reaches its advantage alone,
    # divided by the same scale: 0.1 / 2.8284 = 0.0353553; it is in no return.
    rewards = torch.tensor([[0.0, 0.0], [0.0, 4.0]], dtype=F64)
    values = torch.zeros(2, 2, dtype=F64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    corr = torch.tensor([[0.1, 0.0], [0.0, 0.0]], dtype=F64)
    adv, ret, scale = ppo_advantages(
        rewards, values, mask, 1.0, 1.0, whiten=False, scale_returns=True, token_correction=corr
    )
    s = math.sqrt(8)
    assert float(scale) == pytest.approx(s, rel=1e-15)
    assert flat(ret) == pytest.approx([0.0, 0.0, 4 / s, 4 / s], rel=1e-15)
    assert flat(adv) == pytest.approx([0.1 / s, 0.0, 4 / s, 4 / s], rel=1e-15)
    with pytest.raises(ValueError, match="token_correction"):
        ppo_advantages(rewards, values, mask, 1.0, 1.0, whiten=False, token_correction=corr[:, :1])


def test_group_advantages_and_kl_weights_by_hand():
    # per-token rewards whose row sums are [1, 3, 2, 2, 0, 4] (row 3's masked 9 counts nowhere);
    # groups of 2
    rewards = torch.tensor([[0.0, 1.0], [1.0, 2.0], [2.0, 0.0], [2.0, 9.0], [0.0, 0.0], [4.0, 0.0]])
    mask = torch.ones(6, 2, dtype=torch.bool)
    mask[3, 1] = False
    # GRPO: group 1 mean 2, std (n - 1) of (1, 3) = sqrt(2); advantages -+1 / (sqrt(2) + 1e-4)
    # = -+0.707057; group 2 all-equal: 0; group 3 mean 2, std sqrt(8): -+2 / (2.828427 + 1e-4)
    # = -+0.707082
    w1, w3 = 1 / (math.sqrt(2) + 1e-4), 1 / (math.sqrt(8) + 1e-4)
    want = [[a, a] for a in (-w1, w1, 0.0, 0.0, -2 * w3, 2 * w3)]
    want[3][1] = 0.0  # masked
    # the group statistics are float32: rel 1e-6 (unit roundoff 6e-8, a few operations)
    assert flat(grpo_advantages(rewards, mask, 2, True)) == pytest.approx(flat(want), rel=1e-6)
    # Dr. GRPO: the mean removed alone
    dr = grpo_advantages(rewards, mask, 2, False)
    assert dr.tolist() == [[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [-2.0, -2.0], [2.0, 2.0]]
    # KL weights: 1 / (std + 1e-4) per group; the all-equal group gets the mean over the other
    # groups' rows, (2 w1 + 2 w3) / 4 = (0.707057 + 0.353541) / 2 = 0.530299
    weights = grpo_kl_weights(rewards, mask, 2)
    mean = (w1 + w3) / 2
    assert weights.tolist() == pytest.approx([w1, w1, mean, mean, w3, w3], rel=1e-6)
    # every group all-equal: weight 1 (no other group to borrow from)
    assert grpo_kl_weights(torch.ones(4, 2), torch.ones(4, 2, dtype=torch.bool), 2).tolist() == [1.0] * 4
    # RLOO, leave-one-out: r_i - r_other = [1 - 3, 3 - 1, 0, 0, 0 - 4, 4 - 0]
    loo = rloo_token_advantages(rewards, mask, 2)
    assert loo.tolist() == [[-2.0, -2.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0], [-4.0, -4.0], [4.0, 4.0]]
    # groups of 3 over the first 3 rows, sums [1, 3, 2]: r_i - mean of the other two
    # = [1 - 2.5, 3 - 1.5, 2 - 2] = [-1.5, 1.5, 0]
    loo3 = rloo_token_advantages(rewards[:3], mask[:3], 3)
    assert loo3[:, 0].tolist() == [-1.5, 1.5, 0.0]
    assert broadcast_sequence_advantages(torch.tensor([3.0, -1.0]), MASK).tolist() == [
        [3.0, 3.0, 3.0],
        [-1.0, -1.0, 0.0],
    ]


def test_uses_kl_weights_only_for_grpo_with_the_std_the_kl_in_the_loss_and_the_option():
    on = StepSettings(algo="grpo", group_size=4, scale_by_std=True, scale_kl_by_std=True)
    assert uses_kl_weights(on, KLLeash(False, True))
    assert not uses_kl_weights(on, KLLeash(True, False))  # KL in the reward
    for off in (
        StepSettings(algo="rloo", group_size=4, scale_by_std=True, scale_kl_by_std=True),
        StepSettings(algo="grpo", group_size=4, scale_by_std=False, scale_kl_by_std=True),  # Dr. GRPO
        StepSettings(algo="grpo", group_size=4, scale_by_std=True, scale_kl_by_std=False),
        StepSettings(algo="grpo", group_size=1, scale_by_std=True, scale_kl_by_std=True),
    ):
        assert not uses_kl_weights(off, KLLeash(False, True)), off


def test_clipped_policy_loss_by_hand():
    # one row, two valid tokens and a padded one; old log-probs -1, the new ones make the ratio
    # [1.5, 0.5]; advantages 1; clip 0.2. Per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   token 0: max(-1.5, -1.2) = -1.2 (clipped); token 1: max(-0.5, -0.8) = -0.5
    #   loss = (-1.2 - 0.5) / 2 = -0.85; clipfrac 1 / 2; ratio_dev max |r - 1| = 0.5
    #   approx_kl = mean(r - 1 - log r) = (0.5 - 0.405465 + -0.5 + 0.693147) / 2 = 0.143841
    mask = torch.tensor([[True, True, False]])
    old = torch.tensor([[-1.0, -1.0, 50.0]], dtype=F64)
    logprobs = (old + torch.tensor([[math.log(1.5), math.log(0.5), 0.0]], dtype=F64)).requires_grad_(True)
    rows = SimpleNamespace(
        mask=mask,
        old_logprobs=old,
        advantages=torch.tensor([[1.0, 1.0, 99.0]], dtype=F64),
        ref_logprobs=torch.tensor([[-1.0, -1.0, 3.0]], dtype=F64),
        values=torch.tensor([[0.4, 0.0, 8.0]], dtype=F64),  # at rollout time
        returns=torch.tensor([[1.0, 0.0, 8.0]], dtype=F64),
        kl_weights=None,
        is_weights=None,  # the learner sampled (rollout.dtype=fp32)
    )
    no_kl = KLLeash(True, False)
    out = clipped_policy_loss(rows, logprobs, ClipSettings(0.2), no_kl, 0.1)
    approx_kl = (0.5 - math.log(1.5) + -0.5 - math.log(0.5)) / 2
    assert out.loss.item() == pytest.approx(-0.85, rel=1e-15)
    assert out.stats["policy/clipfrac"].item() == 0.5
    assert out.stats["policy/approx_kl"].item() == pytest.approx(approx_kl, rel=1e-14)
    assert out.ratio_dev.item() == pytest.approx(0.5, rel=1e-15)
    assert "policy/kl_loss" not in out.stats and no_kl.counts["loss"] == 0
    # PPO's value term: values now [0.7, -0.3], at rollout [0.4, 0], returns [1, 0], clip 0.2:
    #   clipped values [0.6, -0.2]; squared errors unclipped [0.09, 0.09], clipped [0.16, 0.04];
    #   max [0.16, 0.09], value loss 0.5 * mean = 0.0625; value clipfrac 1 / 2
    # k2 in the loss at beta 0.1 against ref [-1, -1]: 0.5 (log r)^2 = [0.0822010, 0.2402265],
    #   mean 0.1612138, times 0.1 = 0.01612138
    # loss = -0.85 + 0.5 * 0.0625 + 0.01612138 = -0.80262862
    k2 = 0.1 * (0.5 * math.log(1.5) ** 2 + 0.5 * math.log(0.5) ** 2) / 2
    leash = KLLeash(False, True, "k2")
    values = torch.tensor([[0.7, -0.3, 4.0]], dtype=F64, requires_grad=True)
    out = clipped_policy_loss(rows, logprobs, ClipSettings(0.2, 0.2, 0.5), leash, 0.1, values=values)
    assert out.stats["value/loss"].item() == pytest.approx(0.0625, rel=1e-14)
    assert out.stats["value/clipfrac"].item() == 0.5
    assert out.stats["policy/kl_loss"].item() == pytest.approx(k2, rel=1e-14)
    assert out.loss.item() == pytest.approx(-0.85 + 0.5 * 0.0625 + k2, rel=1e-14)
    assert leash.counts["loss"] == 1
    # a later micro-batch of the same gradient step is not counted again; row weights scale the term
    weighted = SimpleNamespace(**{**vars(rows), "kl_weights": torch.tensor([2.0], dtype=F64)})
    out = clipped_policy_loss(weighted, logprobs, ClipSettings(0.2), leash, 0.1, first_micro=False)
    assert out.stats["policy/kl_loss"].item() == pytest.approx(2 * k2, rel=1e-14)
    assert leash.counts["loss"] == 1
    out.loss.backward()
    assert logprobs.grad[0, 2].item() == 0.0  # the padded token gets no gradient


def test_dpo_pair_loss_by_hand():
    # beta 0.5. Pair 1: implicit rewards 0.5 (-1 + 2) = 0.5 and 0.5 (-3 + 2) = -0.5, margin 1,
    #   loss -log sigmoid(1) = log(1 + e^-1) = 0.3132617, right. Pair 2: 0.5 (-2 + 2) = 0 and
    #   0.5 (-1 + 2) = 0.5, margin -0.5, loss log(1 + e^0.5) = 0.9740770, wrong.
    # means: loss 0.6436693, margin 0.25, accuracy 0.5, chosen 0.25, rejected 0.0
    out = dpo_pair_loss(
        torch.tensor([-1.0, -2.0], dtype=F64),
        torch.tensor([-3.0, -1.0], dtype=F64),
        torch.tensor([-2.0, -2.0], dtype=F64),
        torch.tensor([-2.0, -2.0], dtype=F64),
        0.5,
    )
    loss = (math.log1p(math.exp(-1)) + math.log1p(math.exp(0.5))) / 2
    assert out.loss.item() == pytest.approx(loss, rel=1e-14)
    assert out.stats["dpo/loss"].item() == pytest.approx(loss, rel=1e-14)
    assert out.stats["dpo/margin"].item() == pytest.approx(0.25, rel=1e-14)
    assert out.stats["dpo/accuracy"].item() == 0.5
    assert out.stats["dpo/chosen_reward"].item() == pytest.approx(0.25, rel=1e-14)
    assert out.stats["dpo/rejected_reward"].item() == pytest.approx(0.0, abs=1e-15)
    assert out.ratio_dev is None


# ---- a mask with holes reads as the policy's tokens squeezed together ---------------------------
# A multi-turn rollout's response_mask is False on the environment's tokens between the policy's.
# Every step (5-8) must then compute what it computes on the same policy tokens put side by side
# (the environment's positions taken out): the KL, the shaped rewards, GAE by policy step, every
# advantage, the controller's input, each loss, its statistics and its gradient. The holes hold
# values 30x the valid ones, so a step that read them would move every number it touched.

HOLE_CASES = {
    # PPO with everything a hole could disturb: gamma < 1 (discounting by policy step), the exact
    # reward form (its per-token correction), the return scale and whitening (batch statistics)
    "ppo exact gamma 0.9": (KLLeash(True, False, reward_form="exact"), dict(gamma=0.9, gae_lambda=0.8)),
    "ppo k1 k3": (KLLeash(True, False), dict(estimator="k3", gamma=1.0, whiten=False, scale_returns=False)),
    "grpo k3+": (KLLeash(False, True, "k3+"), dict(group_size=2)),
    "grpo k3_is by std": (KLLeash(False, True, "k3_is"), dict(group_size=2, scale_kl_by_std=True)),
    "grpo k1_seq": (KLLeash(False, True, "k1_seq"), dict(group_size=2, scale_by_std=False)),
    "rloo k2": (KLLeash(True, False), dict(group_size=2, estimator="k2")),
}


def _holes_and_squeezed(seed: int = 0):
    """A (B, R) = (4, 9) mask with holes and the same policy tokens as a prefix of each row."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(4, 9, generator=g) < 0.6
    mask[:, 0] = True  # every response starts with a policy token
    mask[1, -1] = True  # one row ends on a policy token, the others may end on a tool's
    n = mask.sum(-1)
    squeezed_mask = torch.arange(9)[None] < n[:, None]

    def draw(scale: float = 1.0, shift: float = 0.0) -> Tensor:
        valid = scale * torch.randn(4, 9, generator=g, dtype=F64) + shift
        junk = 30.0 * torch.randn(4, 9, generator=g, dtype=F64)  # what a hole might hold
        return torch.where(mask, valid, junk)

    def squeeze(x: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        for b in range(4):
            out[b, : n[b]] = x[b][mask[b]]
        return out

    return mask, squeezed_mask, draw, squeeze


@pytest.mark.parametrize("case", list(HOLE_CASES))
def test_a_mask_with_holes_reads_as_the_policys_tokens_squeezed_together(case):
    leash_of, settings = HOLE_CASES[case]
    algo = case.split()[0]
    mask, squeezed_mask, draw, squeeze = _holes_and_squeezed()
    old = draw(0.5, -2.0)
    ref = torch.where(mask, old + draw(0.3), draw())  # the holes' reference log-probs: junk too
    now = torch.where(mask, old + 0.05, draw())  # the current policy, off-policy by 0.05 nats
    values = draw() if algo == "ppo" else None
    exact = draw().abs()
    scores = torch.tensor([2.0, -1.0, 0.5, 0.5], dtype=F64)

    def run(m: Tensor, f):
        leash = KLLeash(
            leash_of.kl_in_reward, leash_of.kl_in_loss, leash_of.loss_estimator, leash_of.reward_form
        )
        exp = make_experience(
            rollout=samples(m.tolist()),
            scores=scores,
            forwards=Forwards(
                old_logprobs=f(old),
                ref_logprobs=f(ref),
                values=f(values) if values is not None else None,
                exact_kl=f(exact),
            ),
            minibatches=[torch.arange(4)],
            kl_coef=0.2,
            leash=leash,
            settings=StepSettings(algo=algo, **settings),
        )
        logprobs = f(now).clone().requires_grad_(True)
        v = f(values + 0.1).clone().requires_grad_(True) if values is not None else None
        mb = exp.select(torch.tensor([3, 0, 2]))  # a minibatch in another order
        out = clipped_policy_loss(
            mb,
            logprobs[[3, 0, 2]],
            ClipSettings(0.2),
            leash,
            0.2,
            values=v[[3, 0, 2]] if v is not None else None,
        )
        out.loss.backward()
        controls = [
            controller_input(exp, StepSettings(algo=algo, controller_signal=s, target_unit=u, **settings))
            for s in ("exact", "estimator")
            for u in ("nats_per_sequence", "nats_per_token")
        ]
        return exp, out, logprobs.grad, v.grad if v is not None else None, controls

    holed, squeezed = run(mask, lambda x: x), run(squeezed_mask, squeeze)
    exp_h, out_h, grad_h, vgrad_h, ctl_h = holed
    exp_s, out_s, grad_s, vgrad_s, ctl_s = squeezed
    # float64 throughout; the two orders of summation differ by a few ulps of values of order 10
    tol = dict(rtol=1e-12, atol=1e-12)
    for name in ("kl", "rewards", "non_score_reward", "advantages", "returns"):
        a, b = getattr(exp_h, name), getattr(exp_s, name)
        if a is None:
            assert b is None, name
            continue
        torch.testing.assert_close(squeeze(torch.where(mask, a, 0.0)), b.to(a.dtype), **tol, msg=name)
        if name != "kl":  # the estimate is unmasked; what reaches a step is zero at the holes
            assert (a[~mask] == 0).all(), f"{name} is not 0 on the environment's tokens"
    assert ctl_h == pytest.approx(ctl_s, rel=1e-12)
    torch.testing.assert_close(out_h.loss, out_s.loss, **tol)
    assert out_h.stats.keys() == out_s.stats.keys()
    for k in out_h.stats:
        torch.testing.assert_close(out_h.stats[k], out_s.stats[k], **tol, msg=k)
    torch.testing.assert_close(out_h.ratio_dev, out_s.ratio_dev, **tol)
    # the gradient: the policy's tokens get the squeezed run's, the environment's exactly 0
    torch.testing.assert_close(squeeze(grad_h), grad_s, **tol)
    assert (grad_h[~mask] == 0).all()
    if vgrad_h is not None:
        torch.testing.assert_close(squeeze(vgrad_h), vgrad_s, **tol)
        assert (vgrad_h[~mask] == 0).all()
