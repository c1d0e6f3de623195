"""KL placement: expected gradients by exact enumeration, the placement matrix, and the baselines.

Expected gradients are sums over the whole (tiny) vocabulary, in float64: equalities, not
sampling luck. For a loss-placement surrogate L(y; theta) evaluated on samples y ~ pi_old, the
expected gradient is sum_y pi_old(y) * dL(y; theta)/dtheta (on-policy: pi_old = pi_theta).
"""

from __future__ import annotations

import math

import pytest
import torch

from tether.core.advantages import group_normalized_advantages, rloo_advantages
from tether.core.leash import KLLeash
from tether.core.losses import kl_loss_terms
from tether.core.placement import check_placement
from tether.testing import testbed as tb
from tether.trainers.steps import kl_and_rewards, ppo_advantages

F64 = torch.float64


def exact_kl(theta: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(theta, -1)
    return (logp.exp() * (logp - ref_logp)).sum()


def expected_loss_grad(theta, ref_logp, estimator, old_logp=None):
    """sum_y pi_sample(y) * grad_theta L(y; theta), pi_sample = pi_old (or pi_theta, held fixed)."""
    theta = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)  # (V,) log pi_theta of every token
    sample_logp = (old_logp if old_logp is not None else logp).detach()
    terms = kl_loss_terms(
        logp[None],
        ref_logp[None],
        estimator,
        old_logprobs=sample_logp[None] if estimator == "k3_is" else None,
    )[0]
    (sample_logp.exp() * terms).sum().backward()
    return theta.grad


def expected_reward_grad(theta, ref_logp, estimator):
    """Policy-gradient (score-function) gradient of E[-kl(y)] with kl in the reward."""
    from tether.core.kl import estimate_kl

    theta = theta.clone().requires_grad_(True)
    logp = torch.log_softmax(theta, -1)
    kl = estimate_kl(logp.detach()[None], ref_logp[None], estimator)[0]  # a reward: no pathwise grad
    (logp.exp().detach() * logp * kl).sum().backward()  # E[grad log pi * kl]
    return theta.grad


def test_two_token_case_by_hand():
    theta = torch.zeros(2, dtype=F64)  # pi = [0.5, 0.5]
    ref_logp = torch.tensor([0.8, 0.2], dtype=F64).log()
    # KL = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2) = 0.5 (-0.470004) + 0.5 (0.916291) = 0.223144
    kl = exact_kl(theta, ref_logp)
    assert kl.item() == pytest.approx(0.223144, abs=1e-6)
    # dKL/dtheta_i = pi_i (log(pi_i / ref_i) - KL) = 0.5 (-0.470004 - 0.223144) = -0.346574
    th = theta.clone().requires_grad_(True)
    exact_kl(th, ref_logp).backward()
    torch.testing.assert_close(th.grad, torch.tensor([-0.346574, 0.346574], dtype=F64), atol=1e-6, rtol=0)
    for est in ("k2", "k3+", "k3_is"):
        torch.testing.assert_close(expected_loss_grad(theta, ref_logp, est), th.grad, atol=1e-6, rtol=0)
    # k1 as a loss: E[grad log pi] = 0
    torch.testing.assert_close(
        expected_loss_grad(theta, ref_logp, "k1"), torch.zeros(2, dtype=F64), atol=1e-12, rtol=0
    )
    # k3 as a loss: pi - ref = [0.5 - 0.8, 0.5 - 0.2] = [-0.3, +0.3], the forward-KL gradient
    torch.testing.assert_close(
        expected_loss_grad(theta, ref_logp, "k3"), torch.tensor([-0.3, 0.3], dtype=F64), atol=1e-12, rtol=0
    )


def test_random_16_token_case():
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(16, generator=g, dtype=F64)
    ref_logp = torch.log_softmax(torch.randn(16, generator=g, dtype=F64), -1)
    th = theta.clone().requires_grad_(True)
    exact_kl(th, ref_logp).backward()
    true = th.grad
    for est in ("k2", "k3+", "k3_is"):
        torch.testing.assert_close(expected_loss_grad(theta, ref_logp, est), true, atol=1e-10, rtol=0)
    # k3_is stays exact off-policy: samples from another pi_old
    old = torch.log_softmax(torch.randn(16, generator=g, dtype=F64), -1)
    torch.testing.assert_close(
        expected_loss_grad(theta, ref_logp, "k3_is", old_logp=old), true, atol=1e-10, rtol=0
    )
    # ... while k3+ off-policy is not
    assert (expected_loss_grad(theta, ref_logp, "k3+", old_logp=old) - true).abs().max() > 1e-3
    assert (expected_loss_grad(theta, ref_logp, "k1") - true).abs().max() > 1e-3
    assert (expected_loss_grad(theta, ref_logp, "k3") - true).abs().max() > 1e-3
    # in the reward, k1's score-function gradient is exactly grad KL; k3's is not
    torch.testing.assert_close(expected_reward_grad(theta, ref_logp, "k1"), true, atol=1e-10, rtol=0)
    assert (expected_reward_grad(theta, ref_logp, "k3") - true).abs().max() > 1e-3


def test_second_epoch_kl_gradient_on_three_actions():
    # A second epoch: the samples come from pi_old, the policy has moved one step since, by a
    # ratio pi / pi_old = [0.875, 1, 1.1667] inside PPO's clip range (KL(pi_old || pi) = 0.0072).
    # pi_ref = [0.6, 0.3, 0.1], pi_old = [0.4, 0.3, 0.3], pi = [0.35, 0.3, 0.35].
    ref, old = torch.tensor([0.6, 0.3, 0.1], dtype=F64).log(), torch.tensor([0.4, 0.3, 0.3], dtype=F64).log()
    theta = torch.tensor([0.35, 0.3, 0.35], dtype=F64).log()
    # k1 = log(pi / pi_ref) = [ln(0.35 / 0.6), 0, ln 3.5] = [-0.538997, 0, 1.252763]
    # KL(pi || pi_ref) = 0.35 (-0.538997) + 0.35 (1.252763) = 0.249818
    # grad KL in logit space: pi_i (k1_i - KL) = [0.35 (-0.788815), 0.3 (-0.249818), 0.35 (1.002945)]
    true = torch.tensor([-0.276085, -0.074945, 0.351031], dtype=F64)
    # k3+ (k2's gradient k1 grad log pi) on samples of pi_old, unweighted:
    #   sum_y old_y k1_y (e_y - pi) = old_i k1_i - pi_i S, S = sum_y old_y k1_y
    #   S = 0.4 (-0.538997) + 0.3 (1.252763) = -0.215599 + 0.375829 = 0.160230
    #   = [-0.215599 - 0.35 (0.160230), -0.3 (0.160230), 0.375829 - 0.35 (0.160230)]
    unweighted = torch.tensor([-0.271679, -0.048069, 0.319748], dtype=F64)
    th = theta.clone().requires_grad_(True)
    exact_kl(th, ref).backward()
    torch.testing.assert_close(th.grad, true, atol=1e-6, rtol=0)
    got = {est: expected_loss_grad(theta, ref, est, old_logp=old) for est in ("k3+", "k2", "k3_is")}
    print("second epoch, 3 actions: grad KL =", th.grad.tolist(), {k: v.tolist() for k, v in got.items()})
    torch.testing.assert_close(got["k3+"], unweighted, atol=1e-6, rtol=0)
    assert torch.equal(got["k2"], got["k3+"])  # the same gradient
    # the middle action's component is 36% short: the leash pulls too little where pi has moved
    assert (got["k3+"] - th.grad).abs().max() > 0.02
    # k3_is weights each sample by pi / pi_old: E_old[(pi / pi_old) k1 grad log pi] = grad KL,
    # float64 sums of three terms of size < 1: a few ulp
    torch.testing.assert_close(got["k3_is"], th.grad, atol=1e-15, rtol=0)


def test_k3_is_is_k3_plus_on_policy_bit_for_bit():
    # On the first minibatch pi_old = pi: the weight is exp(0) = 1.0 exactly and k3_is's gradient
    # rho * k1 * grad log pi is k3+'s k1 * grad log pi, per sample, in float64 and float32 alike
    # (the trainers check that ratio is 1.0 exactly: policy/ratio_max_dev_first = 0)
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(16, generator=g, dtype=F64)
    ref_logp = torch.log_softmax(torch.randn(16, generator=g, dtype=F64), -1)
    assert torch.equal(
        expected_loss_grad(theta, ref_logp, "k3_is"), expected_loss_grad(theta, ref_logp, "k3+")
    )
    for dtype in (F64, torch.float32):
        lp = torch.log_softmax(torch.randn(4, 9, generator=g, dtype=F64), -1).to(dtype)
        ref = torch.log_softmax(3 * torch.randn(4, 9, generator=g, dtype=F64), -1).to(dtype)
        weight = torch.rand(4, 9, generator=g, dtype=F64).to(dtype)
        grads, values = {}, {}
        for est in ("k3+", "k3_is"):
            x = lp.clone().requires_grad_(True)
            terms = kl_loss_terms(x, ref, est, old_logprobs=lp.clone())
            (weight * terms).sum().backward()
            grads[est], values[est] = x.grad, terms.detach()
        assert torch.equal(grads["k3_is"], grads["k3+"]), dtype
        assert torch.equal(grads["k3_is"], weight * (lp - ref)), dtype  # k1, one rounding
        # the values: k3 (k3+'s k2 + (k3 - k2) may round one ulp away from it)
        torch.testing.assert_close(values["k3_is"], values["k3+"], rtol=4 * torch.finfo(dtype).eps, atol=0)


def test_k3_plus_logs_k3_value():
    lp = torch.tensor([[-1.0, -2.0]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0]], dtype=F64)
    r = ref - lp  # [-0.5, 1.0]
    want = torch.exp(r) - 1 - r  # k3 = [0.106531, 0.718282]
    torch.testing.assert_close(kl_loss_terms(lp, ref, "k3+"), want)


# ---- the placement matrix: one 2-token response, score 1.0, per-token KL [0.2, 0.1], beta 0.05
SCORES = torch.tensor([1.0], dtype=F64)
KL = torch.tensor([[0.2, 0.1]], dtype=F64)
MASK = torch.tensor([[True, True]])
BETA = 0.05
# log-ratios whose k2 = 0.5 r^2 equals [0.2, 0.1]: r = sqrt(0.4), sqrt(0.2)
LP = torch.tensor([[math.sqrt(0.4), math.sqrt(0.2)]], dtype=F64)
REF = torch.zeros(1, 2, dtype=F64)


def _apply(leash: KLLeash):
    rewards = leash.reward(SCORES, KL, BETA, MASK).rewards
    loss = leash.loss(LP, REF, BETA, MASK, old_logprobs=LP)
    return rewards, loss


def test_placement_off_off():
    leash = KLLeash(False, False, "k2")
    rewards, loss = _apply(leash)
    assert rewards.tolist() == [[0.0, 1.0]] and loss is None
    assert leash.counts == {"reward": 0, "loss": 0}
    p = check_placement(False, False, "k1", "k2", kl_coef=BETA, monitor_kl=False)
    assert not p.needs_reference  # zero reference forwards


def test_placement_reward_on():
    leash = KLLeash(True, False, "k2")
    rewards, loss = _apply(leash)
    # [-0.05 * 0.2, 1.0 - 0.05 * 0.1] = [-0.01, 0.995]
    torch.testing.assert_close(rewards, torch.tensor([[-0.01, 0.995]], dtype=F64))
    assert loss is None and leash.counts == {"reward": 1, "loss": 0}


def test_placement_loss_on():
    leash = KLLeash(False, True, "k2")
    rewards, loss = _apply(leash)
    assert rewards.tolist() == [[0.0, 1.0]]
    # beta * mean(k2) = 0.05 * (0.2 + 0.1) / 2 = 0.0075, added once
    assert loss.item() == pytest.approx(0.0075, abs=1e-12)
    assert leash.counts == {"reward": 0, "loss": 1}


def test_placement_both_refused_without_override():
    with pytest.raises(ValueError, match="counted twice"):
        check_placement(True, True, "k1", "k2", kl_coef=BETA)
    p = check_placement(True, True, "k1", "k2", kl_coef=BETA, allow_double_kl=True)
    assert p.warnings and "counted twice" in p.warnings[0]


@pytest.mark.parametrize(
    "reward_on, est, field",
    [(True, "k3", "kl.estimator"), (False, "k1", "kl.loss_estimator"), (False, "k3", "kl.loss_estimator")],
)
def test_biased_estimators_refused_with_reason(reward_on, est, field):
    args = (True, False, est, "k2") if reward_on else (False, True, "k1", est)
    with pytest.raises(ValueError) as e:
        check_placement(*args, kl_coef=BETA)
    assert field in str(e.value) and "2506.09477" in str(e.value)
    assert check_placement(*args, kl_coef=BETA, allow_biased_estimator=True).warnings


def test_zero_beta_adds_nothing_to_the_loss():
    leash = KLLeash(False, True, "k3+")
    assert leash.loss(LP, REF, 0.0, MASK) is None and leash.counts["loss"] == 0


# ---- group baselines: vectorized against a Python loop
def test_grpo_and_rloo_match_loops():
    g = torch.Generator().manual_seed(1)
    G, n = 4, 5
    r = torch.randn(G * n, generator=g, dtype=F64)
    grpo, rloo = group_normalized_advantages(r, G), rloo_advantages(r, G)
    for i in range(G * n):
        group = r[(i // G) * G : (i // G + 1) * G].tolist()
        mean = sum(group) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (G - 1))
        assert grpo[i].item() == pytest.approx((r[i].item() - mean) / (std + 1e-4), abs=1e-12)
        others = [x for j, x in enumerate(group) if (i // G) * G + j != i]
        assert rloo[i].item() == pytest.approx(r[i].item() - sum(others) / (G - 1), abs=1e-12)


def test_group_baselines_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64)
    # RLOO, k = 2: [1 - 0, 0 - 1, 0 - 1, 1 - 0]
    assert rloo_advantages(r, 2).tolist() == [1.0, -1.0, -1.0, 1.0]
    # GRPO, G = 4: mean 0.5, std sqrt(4 * 0.25 / 3) = 0.57735; (1 - 0.5) / 0.57745 = 0.865876
    got = group_normalized_advantages(r, 4)
    assert got[0].item() == pytest.approx(0.5 / (math.sqrt(1 / 3) + 1e-4), abs=1e-12)
    assert group_normalized_advantages(torch.ones(4, dtype=F64), 4).tolist() == [0.0] * 4
    with pytest.raises(ValueError):
        rloo_advantages(r, 3)


# ---- PPO's exact shaping (ppo.kl_shaping=exact): the same expected gradient as k1 in the reward --
SHAPING_BETA = 0.7


def _shaping_setup():
    """The sequence bed (V = 5, T = 3), a policy table off the reference (so the KL is not 0) and
    a random value table (a baseline: with lambda = 1 it leaves the expected gradient alone)."""
    bed = tb.random_sequence_bed(seed=0, reward_scale=2.0)
    g = torch.Generator().manual_seed(1)
    policy = bed.ref_logits + 0.8 * torch.randn(bed.ref_logits.shape, generator=g, dtype=F64)
    values = torch.randn(bed.num_prefixes, generator=g, dtype=F64)
    return bed, policy, values


def _ppo_per_sequence_terms(bed, policy, values, form, beta=SHAPING_BETA):
    """For every sequence y (all V^T, in ``tb.all_sequences`` order): pi(y), the per-token log-probs
    with grad (N, T) and PPO's advantages (N, T) from the trainers' own functions at gamma =
    lambda = 1, unwhitened. ``form``: "sampled" (k1 in the reward), "exact" (ppo.kl_shaping=exact)
    or "exact-without-own" (the exact KL in the returns, token t's own correction dropped)."""
    V, T = bed.vocab, bed.length
    table = policy.clone().requires_grad_(True)
    seqs = tb.all_sequences(V, T)  # (N, T)
    rows = tb.prefix_indices(seqs, V)
    logp = tb.token_logprobs(table, seqs, V)  # (N, T), with grad
    ref = tb.token_logprobs(bed.ref_logits, seqs, V)
    mask = torch.ones(seqs.shape, dtype=torch.bool)
    exact = tb.position_kl(table, bed.ref_logits, rows) if form != "sampled" else None
    leash = KLLeash(True, False, reward_form="sampled" if form == "sampled" else "exact")
    leashed = kl_and_rewards(
        bed.rewards,
        logp.detach(),
        ref_logprobs=ref,
        mask=mask,
        kl_coef=beta,
        estimator="k1",
        leash=leash,
        exact_kl=exact,
    )
    adv, _, _ = ppo_advantages(
        leashed.rewards,
        values[rows],
        mask,
        1.0,
        1.0,
        whiten=False,
        token_correction=leashed.token_correction if form == "exact" else None,
    )
    return table, logp.sum(-1).detach().exp(), logp, adv


def ppo_expected_gradient(bed, policy, values, form):
    """sum_y pi(y) sum_t A_t(y) grad log pi(y_t | y_<t): the expected policy gradient, (P, V)."""
    table, weight, logp, adv = _ppo_per_sequence_terms(bed, policy, values, form)
    (weight[:, None] * adv * logp).sum().backward()
    return table.grad


def exact_objective_gradient(bed, policy):
    """grad of J = E[r] - beta * KL(pi || pi_ref) over whole sequences, by enumeration, (P, V)."""
    table = policy.clone().requires_grad_(True)
    seq_logp = tb.sequence_logprobs(table, bed.vocab, bed.length)
    ref = tb.sequence_logprobs(bed.ref_logits, bed.vocab, bed.length)
    tb.objective(seq_logp, ref, bed.rewards, SHAPING_BETA).backward()
    return table.grad


def test_exact_shaping_has_the_expected_gradient_of_j():
    bed, policy, values = _shaping_setup()
    want = exact_objective_gradient(bed, policy)
    # float64 sums over 125 sequences x 3 tokens of terms of magnitude at most |A| * 1 (A: rewards
    # < 2 plus beta 0.7 times a few nats, minus values ~1): rounding ~ 375 * 1e1 * 2.2e-16 ~ 1e-12
    tol = 1e-11 * max(1.0, float(want.abs().max()))
    for form in ("sampled", "exact"):
        got = ppo_expected_gradient(bed, policy, values, form)
        gap = float((got - want).abs().max())
        assert gap < tol, f"{form}: |E[grad] - grad J| = {gap:.2e} (tolerance {tol:.1e})"
    # dropping token t's own correction loses the direct gradient of KL_t: biased, far off
    wrong = ppo_expected_gradient(bed, policy, values, "exact-without-own")
    gap = float((wrong - want).abs().max())
    assert gap > 1e-3 * float(want.abs().max()), f"without the own term the gap is only {gap:.2e}"


def _gradient_variance(bed, policy, values, form, beta) -> float:
    """E ||g(y) - E g||^2 of the one-sequence estimate g(y) = sum_t A_t grad log pi(y_t), exact."""
    table, weight, logp, adv = _ppo_per_sequence_terms(bed, policy, values, form, beta)
    per_seq = []
    for n in range(logp.shape[0]):
        (g,) = torch.autograd.grad((adv[n] * logp[n]).sum(), table, retain_graph=True)
        per_seq.append(g.flatten())
    grads = torch.stack(per_seq)  # (N, P * V)
    mean = (weight[:, None] * grads).sum(0)
    return float((weight * ((grads - mean) ** 2).sum(-1)).sum())


def test_exact_shaping_lowers_the_gradient_variance_on_the_bed():
    # not a theorem for every table (token t's own term is kept): a property of this bed, computed
    # exactly, so it moves only if the shaping does (e.g. if the correction were propagated).
    # At beta 3 the KL dominates the advantages, as once a budget binds (docs/kl.md): there the
    # exact form's variance is 0.67 of the sampled one's; at beta 0.7, 0.93.
    bed, policy, values = _shaping_setup()
    ratios = {}
    for beta in (0.7, 3.0):
        sampled = _gradient_variance(bed, policy, values, "sampled", beta)
        exact = _gradient_variance(bed, policy, values, "exact", beta)
        ratios[beta] = exact / sampled
        print(f"beta {beta}: one-sequence gradient variance, sampled k1 {sampled:.4f}, exact {exact:.4f}")
    assert ratios[3.0] < 0.8 and ratios[0.7] < 1.0, ratios


def test_importance_weighted_kl_is_the_updated_policys_kl_in_expectation():
    # On a bed of V = 5, T = 3 (125 sequences), pi_old and pi two random table policies: the
    # prefix-ratio estimate summed over pi_old's sequences with their probabilities is
    # KL(pi || pi_ref) exactly (an equality of sums, float64); at pi = pi_old it is the exact KL of
    # each sequence's own positions, whose pi-weighted sum is the same KL again.
    from tether.core.kl import importance_weighted_kl

    bed = tb.random_sequence_bed(seed=3, reward_scale=1.0)
    g = torch.Generator().manual_seed(5)
    old = bed.ref_logits.to(F64) + torch.randn(bed.ref_logits.shape, generator=g, dtype=F64)
    new = old + 0.5 * torch.randn(bed.ref_logits.shape, generator=g, dtype=F64)
    seqs = tb.all_sequences(bed.vocab, bed.length)
    rows = tb.prefix_indices(seqs, bed.vocab)
    mask = torch.ones(seqs.shape, dtype=torch.bool)
    p_old = tb.sequence_logprobs(old, bed.vocab, bed.length).exp()  # (125,)
    per_seq, weights = importance_weighted_kl(
        tb.position_kl(new, bed.ref_logits, rows),
        tb.token_logprobs(new, seqs, bed.vocab),
        tb.token_logprobs(old, seqs, bed.vocab),
        mask,
    )
    truth = tb.exact_kl(
        tb.sequence_logprobs(new, bed.vocab, bed.length),
        tb.sequence_logprobs(bed.ref_logits.to(F64), bed.vocab, bed.length),
    )
    assert float((p_old * per_seq).sum()) == pytest.approx(float(truth), rel=1e-12)
    # the weights' expectation at each position is 1 (E_old[rho_<t] = 1), so the length under pi
    assert (p_old[:, None] * weights).sum(0).tolist() == pytest.approx([1.0, 1.0, 1.0], rel=1e-12)
    # a mask with a hole: position 1 is an environment's (no ratio, no KL): the estimate is the KL of
    # positions 0 and 2 under pi with position 1 drawn alike (here by the old table, as the bed
    # cannot tell who drew it: the ratio skips it)
    hole = torch.tensor([True, False, True]).expand_as(mask)
    per_seq_h, _ = importance_weighted_kl(
        tb.position_kl(new, bed.ref_logits, rows),
        tb.token_logprobs(new, seqs, bed.vocab),
        tb.token_logprobs(old, seqs, bed.vocab),
        hole,
    )
    # by enumeration: sequences drawn with position 1 from pi_old and 0, 2 from pi
    lp_new, lp_old = tb.token_logprobs(new, seqs, bed.vocab), tb.token_logprobs(old, seqs, bed.vocab)
    mixed = (lp_new[:, 0] + lp_old[:, 1] + lp_new[:, 2]).exp()
    pk = tb.position_kl(new, bed.ref_logits, rows)
    assert float((p_old * per_seq_h).sum()) == pytest.approx(
        float((mixed * (pk[:, 0] + pk[:, 2])).sum()), rel=1e-12
    )
