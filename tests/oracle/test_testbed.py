"""The tabular test bed: tether's trainers against the exact optimum pi* = pi_ref exp(r / beta) / Z.

Every run samples rollouts from a table policy and goes through tether's own pure functions
(estimate_kl, KLLeash, gae, whiten, group/RLOO advantages, ppo_policy_loss, clipped_value_loss,
dpo_loss, the controllers); the distance to pi* is then computed exactly by enumeration.
Distances are printed (run with ``-s`` to see them) and repeated in every assertion message.

Tolerances, stated once:

* bandit, correct configurations: KL(pi || pi*) < 1e-3 nats after the stated number of
  batches, hence ``J(pi*) - J(pi) = beta * KL(pi || pi*) < 1e-3`` reward units (beta = 1);
* the logged KL (pooled per-sequence estimates of the last 20 batches) within 3 standard errors
  of the exact KL of the policies that sampled them;
* sequence bed (V = 5, T = 3): PPO and RLOO KL(pi || pi*) < 1e-3, DPO < 1e-2, GRPO within 5e-3
  of its own, computed fixed point (it is not pi*: see the xfail tests and the module
  docstring of tether.testing.testbed).

All runs are seeded and use one torch thread (restored afterwards).
"""

from __future__ import annotations

import functools
import inspect
import math

import pytest
import torch

from tether.core.controllers import (
    BudgetKLController,
    FixedKLController,
    make_controller,
)
from tether.core.leash import KLLeash
from tether.testing import testbed as tb

F64 = torch.float64
REF = [0.4, 0.3, 0.2, 0.1]
REWARDS = [0.0, 1.0, 2.0, 3.0]
BETA = 1.0
G = 64  # GRPO / RLOO group size on the bandit: 16 groups per batch of 1024
LAST = 20  # batches pooled for the logged-KL check


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/oracle/conftest.py


# ---- exact quantities ---------------------------------------------------------------------------
def bed_bandit(scale: float = 1.0) -> tb.TabularBed:
    return tb.bandit(REF, [scale * r for r in REWARDS])


def ref_logp(bed: tb.TabularBed) -> torch.Tensor:
    return tb.sequence_logprobs(bed.ref_logits, bed.vocab, bed.length)


def pi_star(bed: tb.TabularBed, beta: float) -> torch.Tensor:
    return tb.optimal_logprobs(ref_logp(bed), bed.rewards, beta)


def J(bed: tb.TabularBed, table: torch.Tensor, beta: float) -> float:
    return float(
        tb.objective(tb.sequence_logprobs(table, bed.vocab, bed.length), ref_logp(bed), bed.rewards, beta)
    )


def test_bandit_optimum_by_hand():
    bed = bed_bandit()
    # pi_ref * e^r = [0.4 * 1, 0.3 * 2.718282, 0.2 * 7.389056, 0.1 * 20.085537]
    #             = [0.4, 0.815485, 1.477811, 2.008554];  Z = 4.701849
    # pi* = [0.4 / Z, 0.815485 / Z, 1.477811 / Z, 2.008554 / Z]
    #     = [0.085073, 0.173439, 0.314304, 0.427184]
    star = pi_star(bed, BETA).exp()
    torch.testing.assert_close(
        star, torch.tensor([0.085073, 0.173439, 0.314304, 0.427184], dtype=F64), atol=1e-6, rtol=0
    )
    # E_pi*[r] = 0.173439 + 2 * 0.314304 + 3 * 0.427184 = 2.083599
    # KL(pi* || pi_ref) = sum pi* log(pi* / pi_ref) = 0.535643; J(pi*) = 2.083599 - 0.535643
    #                   = 1.547956 = beta * log Z = log 4.701849
    kl_star = float(tb.exact_kl(star.log(), ref_logp(bed)))
    assert kl_star == pytest.approx(0.535643, abs=1e-6)
    assert J(bed, star.log()[None], BETA) == pytest.approx(1.547956, abs=1e-6)
    assert J(bed, star.log()[None], BETA) == pytest.approx(math.log(4.7018494606), abs=1e-9)
    # J(pi*) - J(pi) = beta * KL(pi || pi*) for any pi; at pi = pi_ref both sides are
    # 1.547956 - (0 + 0.4*0 + 0.3*1 + 0.2*2 + 0.1*3 = 1.0) = 0.547956
    gap = J(bed, star.log()[None], BETA) - J(bed, bed.ref_logits, BETA)
    assert gap == pytest.approx(0.547956, abs=1e-6)
    assert gap == pytest.approx(BETA * float(tb.exact_kl(ref_logp(bed), star.log())), abs=1e-12)


def test_indexing_by_hand():
    # V = 5, T = 3: prefixes 1 + 5 + 25 = 31, offsets [0, 1, 6]
    assert tb.num_prefixes(5, 3) == 31 and tb.prefix_offsets(5, 3) == [0, 1, 6]
    # y = [2, 4, 1]: rows [0, 1 + 2, 6 + (2 * 5 + 4)] = [0, 3, 20]; code 2*25 + 4*5 + 1 = 71
    y = torch.tensor([[2, 4, 1]])
    assert tb.prefix_indices(y, 5).tolist() == [[0, 3, 20]]
    assert tb.sequence_index(y, 5).tolist() == [71]
    seqs = tb.all_sequences(5, 3)
    assert seqs.shape == (125, 3) and seqs[71].tolist() == [2, 4, 1]
    assert torch.equal(tb.sequence_index(seqs, 5), torch.arange(125))
    # every prefix row is used by exactly the sequences that share the prefix: row 3 by 25
    assert int((tb.prefix_indices(seqs, 5) == 3).sum()) == 25


def test_sequence_bed_optimum_is_a_table_policy():
    bed = tb.random_sequence_bed(seed=0, reward_scale=2.0)
    beta = 0.5
    star = pi_star(bed, beta)
    table = tb.optimal_table(bed, beta)
    # the soft-value recursion gives pi* exactly, as a table policy
    torch.testing.assert_close(tb.sequence_logprobs(table, 5, 3), star, atol=1e-12, rtol=0)
    assert float(star.exp().sum()) == pytest.approx(1.0, abs=1e-12)
    # J(pi*) - J(pi) = beta * KL(pi || pi*) for an arbitrary table policy
    other = torch.randn(31, 5, generator=torch.Generator().manual_seed(1), dtype=F64)
    gap = J(bed, table, beta) - J(bed, other, beta)
    assert gap == pytest.approx(beta * tb.kl_to(other, bed, star), abs=1e-12)
    assert gap > 0.01  # an arbitrary policy is worse
    # for T = 1 the per-token fixed point with scale c is pi*(beta / c)
    band = bed_bandit()
    torch.testing.assert_close(
        tb.per_token_kl_in_loss_fixed_point(band, BETA, 0.5),
        tb.optimal_table(band, BETA / 0.5),
        atol=1e-12,
        rtol=0,
    )


def test_sampler_matches_the_table():
    bed = tb.random_sequence_bed(seed=0)
    n = 40_000
    tokens = tb.sample(bed.ref_logits, 5, 3, n, torch.Generator().manual_seed(0))
    freq = torch.bincount(tb.sequence_index(tokens, 5), minlength=125).to(F64) / n
    p = ref_logp(bed).exp()
    se = (p * (1 - p) / n).sqrt()
    worst = float(((freq - p).abs() / se).max())
    assert worst < 4.5, f"a sequence frequency is {worst:.2f} standard errors from its probability"


# ---- the oracle runs the defaults ---------------------------------------------------------------
@pytest.mark.parametrize("algo", ["ppo", "grpo", "rloo"])
def test_the_bed_runs_the_step_settings_of_a_default_run(algo):
    # train_on_policy builds StepSettings(algo, group_size, gamma, gae_lambda, **overrides); with
    # no override it must equal what `tether train train.algo=ALGO` builds, so every fixed point
    # below proves the configuration users run (return scaling, the exact-KL controller signal)
    from tether.run.config import load_config
    from tether.trainers.base import step_settings
    from tether.trainers.steps import StepSettings

    config = load_config(None, [f"train.algo={algo}"]).for_run()
    run = step_settings(config, algo)
    s = tb.TrainSettings()
    bed = StepSettings(algo=algo, group_size=run.group_size, gamma=s.gamma, gae_lambda=s.gae_lambda)
    assert bed == run
    assert run.scale_returns and run.controller_signal == "exact"  # the two the oracle once left out
    # the update guard: on with the budget controller in both, with the config's tolerance and halvings
    from tether.trainers.guard import GuardSettings

    cfg = load_config(None, [f"train.algo={algo}"]).for_run()
    guard = GuardSettings(limit=cfg.kl.budget)
    assert cfg.kl.guard and (guard.tol, guard.max_halvings) == (cfg.kl.guard_tol, cfg.kl.guard_halvings)
    assert BudgetKLController.guarded and not FixedKLController.guarded
    # the KL surrogate in the loss (GRPO's placement, any algorithm's kl.kl_in_loss): the bed's
    # default is the CLI's and the leash's, k3_is (exact on the update's off-policy minibatches)
    bed_estimator = inspect.signature(tb.train_on_policy).parameters["loss_estimator"].default
    assert bed_estimator == config.kl.loss_estimator == KLLeash(False, True).loss_estimator == "k3_is"
    assert config.kl.kl_in_loss == (algo == "grpo") and config.kl.kl_in_reward == (algo != "grpo")


# ---- convergence on the bandit ------------------------------------------------------------------
BANDIT = tb.TrainSettings(steps=100, batch_size=1024, group_size=G)
BANDIT_DPO = tb.TrainSettings(steps=100, batch_size=4096)  # labels are noisy: 4096 fresh pairs per batch


@functools.cache
def bandit_run(name: str) -> tb.RunLog:
    """Runs by name, each at most once per session. Dr. GRPO (no std scaling): see the xfail test."""
    bed = bed_bandit()
    runs = {
        # correct configurations
        "ppo": lambda: tb.train_ppo(bed, BETA, BANDIT),
        "grpo-k2": lambda: tb.train_group(bed, "grpo", BETA, BANDIT, loss_estimator="k2", scale_by_std=False),
        "grpo-k3+": lambda: tb.train_group(
            bed, "grpo", BETA, BANDIT, loss_estimator="k3+", scale_by_std=False
        ),
        "grpo-k3_is": lambda: tb.train_group(
            bed, "grpo", BETA, BANDIT, loss_estimator="k3_is", scale_by_std=False
        ),
        # GRPO's other placement: k1 in the reward (kl.kl_in_reward=true), with the std scaling on
        "grpo-kl-in-reward": lambda: tb.train_group(
            bed, "grpo", BETA, BANDIT, kl_in_reward=True, kl_in_loss=False
        ),
        "rloo": lambda: tb.train_group(bed, "rloo", BETA, BANDIT),
        "dpo": lambda: tb.train_dpo(bed, BETA, BANDIT_DPO),
        # rewards and beta x 50: the same pi*, with ppo.scale_returns dividing the rewards by
        # the returns' spread (about 50 x 0.9) before GAE
        "ppo rewards x 50": lambda: tb.train_ppo(bed_bandit(50.0), 50.0 * BETA, BANDIT),
        # biased configurations
        "grpo k1 in the loss": lambda: tb.train_group(
            bed, "grpo", BETA, BANDIT, loss_estimator="k1", scale_by_std=False
        ),
        "rloo k3 in the reward": lambda: tb.train_group(bed, "rloo", BETA, BANDIT, estimator="k3"),
        "ppo k3 in the reward": lambda: tb.train_ppo(bed, BETA, BANDIT, estimator="k3"),
        "rloo KL twice": lambda: tb.train_group(bed, "rloo", BETA, BANDIT, kl_in_loss=True),
        "grpo KL twice": lambda: tb.train_group(
            bed, "grpo", BETA, BANDIT, kl_in_reward=True, scale_by_std=False
        ),
        "ppo KL twice": lambda: tb.train_ppo(bed, BETA, BANDIT, kl_in_loss=True),
    }
    return runs[name]()


def logged_vs_exact(log: tb.RunLog) -> tuple[float, float, float]:
    """(mean logged per-sequence KL, its standard error, mean exact KL) over the last LAST batches."""
    est = torch.cat(log.kl_estimates[-LAST:]).to(F64)
    return float(est.mean()), float(est.std() / math.sqrt(est.numel())), sum(log.exact_kls[-LAST:]) / LAST


CORRECT = ["ppo", "grpo-k2", "grpo-k3+", "grpo-k3_is", "grpo-kl-in-reward", "rloo", "dpo"]


@pytest.mark.parametrize("name", CORRECT)
def test_bandit_trainer_reaches_the_optimum(name):
    bed = bed_bandit()
    log = bandit_run(name)
    star = pi_star(bed, BETA)
    dist = tb.kl_to(log.table, bed, star)
    j, j_star = J(bed, log.table, BETA), J(bed, tb.optimal_table(bed, BETA), BETA)
    est, se, exact = logged_vs_exact(log)
    steps = (BANDIT_DPO if name == "dpo" else BANDIT).steps
    msg = (
        f"{name}: after {steps} batches KL(pi || pi*) = {dist:.3e} nats, J = {j:.6f} vs J* = {j_star:.6f}, "
        f"logged KL {est:.4f} +- {se:.4f} vs exact {exact:.4f}"
    )
    print(msg)
    assert dist < 1e-3, msg
    assert abs(j - j_star) < 1e-3, msg  # = beta * dist
    assert abs(est - exact) < 3 * se, msg
    assert exact > 0.4, msg  # the leash is not trivially slack: KL(pi* || pi_ref) = 0.5356


@pytest.mark.parametrize("name", ["grpo-k2", "grpo-k3+", "grpo-k3_is"])
def test_dr_grpo_fixed_point_is_beta_times_g_over_g_minus_1(name):
    # Mean-centered advantages r_i - mean_g(r) include r_i itself, so the policy-gradient term is
    # (G - 1) / G of the unbiased one while the loss-placed KL keeps its full weight: the fixed
    # point is pi*(beta * G / (G - 1)) = pi*(64 / 63), at KL 1.15e-4 from pi*(1) (well inside
    # the 1e-3 tolerance above, but measurable: with seeds 0-4 the runs land 1e-6 .. 2.2e-5 from
    # it and 1.4e-4 .. 1.9e-4 from pi*).
    bed = bed_bandit()
    log = bandit_run(name)
    to_fp = tb.kl_to(log.table, bed, pi_star(bed, BETA * G / (G - 1)))
    to_star = tb.kl_to(log.table, bed, pi_star(bed, BETA))
    msg = f"{name}: KL(pi || pi*(beta G/(G-1))) = {to_fp:.2e}, KL(pi || pi*(beta)) = {to_star:.2e}"
    print(msg)
    assert to_fp < 5e-5 and to_star > 3 * to_fp, msg


def test_ppo_with_its_returns_scaled_reaches_the_optimum():
    # pi* = pi_ref exp(r / beta) / Z is unchanged when r and beta are both x 50; the value head
    # learns in the scaled units and the whitened advantages are the unscaled ones
    bed = bed_bandit(50.0)
    log = bandit_run("ppo rewards x 50")
    dist = tb.kl_to(log.table, bed, pi_star(bed, 50.0 * BETA))
    print(f"ppo, rewards x 50, beta 50: KL(pi || pi*) = {dist:.3e}")
    assert dist < 1e-3, f"KL(pi || pi*) = {dist:.3e}"


def test_leash_counts_each_placement():
    # correct runs: the KL enters once per batch (reward) or once per minibatch (loss), never both
    steps, updates = BANDIT.steps, BANDIT.steps * BANDIT.epochs * BANDIT.minibatches
    assert bandit_run("ppo").counts == {"reward": steps, "loss": 0}
    assert bandit_run("rloo").counts == {"reward": steps, "loss": 0}
    assert bandit_run("grpo-k3+").counts == {"reward": 0, "loss": updates}
    # the double count is visible in the counts
    assert bandit_run("ppo KL twice").counts == {"reward": steps, "loss": updates}


# ---- biased configurations ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,correct,floor",
    [
        # k1 in the loss pulls nothing in expectation: the policy runs to the best action
        ("grpo k1 in the loss", "grpo-k3+", 0.1),
        # k3 in the reward: the score-function gradient of k3 is not grad KL
        ("rloo k3 in the reward", "rloo", 0.1),
        ("ppo k3 in the reward", "ppo", 0.1),
        # KL in the reward and in the loss: beta counted twice -> pi*(2 beta), KL 0.1376 from pi*
        ("rloo KL twice", "rloo", 0.1),
        ("grpo KL twice", "grpo-k3+", 0.1),
        # PPO whitens its advantages: the reward-placed KL is divided by the batch's advantage
        # std, the loss-placed one is not, so their ratio depends on the batch; near pi* the
        # advantages shrink and the loss copy loses weight. Farther than correct PPO by orders
        # of magnitude, but not by the 0.1 of the other double counts.
        ("ppo KL twice", "ppo", 1e-4),
    ],
)
def test_biased_configuration_lands_away_from_the_optimum(name, correct, floor):
    bed = bed_bandit()
    star = pi_star(bed, BETA)
    dist = tb.kl_to(bandit_run(name).table, bed, star)
    good = tb.kl_to(bandit_run(correct).table, bed, star)
    probs = torch.softmax(bandit_run(name).table[0], -1).tolist()
    msg = (
        f"{name}: KL(pi || pi*) = {dist:.3e} vs {good:.3e} for {correct}; "
        f"pi = [{', '.join(f'{p:.4f}' for p in probs)}]"
    )
    print(msg)
    assert dist > floor and dist > 10 * good, msg


@pytest.mark.parametrize("name", ["rloo KL twice", "grpo KL twice"])
def test_kl_counted_twice_is_the_optimum_for_twice_beta(name):
    # pi*(2) = pi_ref e^(r/2) / Z_2: [0.4, 0.494616, 0.543656, 0.448169] / 1.886442
    #        = [0.212039, 0.262195, 0.288191, 0.237574], at KL 0.1376 from pi*(1)
    bed = bed_bandit()
    star2 = pi_star(bed, 2 * BETA)
    torch.testing.assert_close(
        star2.exp(), torch.tensor([0.212039, 0.262195, 0.288191, 0.237574], dtype=F64), atol=1e-6, rtol=0
    )
    # GRPO's mean-centering makes its fixed point pi*(2 G / (G - 1)) (see above): 2e-4 slack
    dist = tb.kl_to(bandit_run(name).table, bed, star2)
    msg = f"{name}: KL(pi || pi*(2 beta)) = {dist:.2e}"
    print(msg)
    assert dist < 2e-4, msg


def test_convergence_check_catches_a_flipped_kl_sign(monkeypatch):
    # the same RLOO run with the KL estimate negated (non_score_reward = +beta * kl): the policy
    # is pushed away from pi_ref; both checks of test_bandit_trainer_reaches_the_optimum fail
    monkeypatch.setattr(tb, "estimate_kl", lambda lp, ref, est="k1": -(lp - ref).to(F64))
    bed = bed_bandit()
    log = tb.train_group(bed, "rloo", BETA, tb.TrainSettings(steps=40, group_size=G))
    dist = tb.kl_to(log.table, bed, pi_star(bed, BETA))
    est, se, exact = logged_vs_exact(log)
    print(f"flipped sign: KL(pi || pi*) = {dist:.3f}, logged {est:.3f} vs exact {exact:.3f}")
    assert dist > 0.1 and abs(est - exact) > 3 * se


def test_grpo_std_scaling_puts_beta_in_reward_stds_unless_the_kl_is_scaled_too():
    # GRPO with scale_by_std=True and the KL in the loss: the advantages are divided by the group
    # reward std while the KL term is not, so beta acts in units of the reward's std. (4 r, 4 beta)
    # has the same pi* as (r, beta) but gets the same advantages with 4x the leash: it lands
    # elsewhere. grpo.scale_kl_by_std divides the KL term by the same std, and it lands on pi*.
    bed = bed_bandit(scale=4.0)
    star = pi_star(bed, 4 * BETA)  # = pi*(r, beta) of the bandit
    published = tb.train_group(bed, "grpo", 4 * BETA, BANDIT, scale_by_std=True)
    scaled = tb.train_group(bed, "grpo", 4 * BETA, BANDIT, scale_by_std=True, scale_kl_by_std=True)
    d_pub, d_scaled = tb.kl_to(published.table, bed, star), tb.kl_to(scaled.table, bed, star)
    print(
        f"GRPO on (4 r, 4 beta): KL(pi || pi*) = {d_pub:.3e} as published, "
        f"{d_scaled:.3e} with scale_kl_by_std"
    )
    assert d_pub > 1e-2 and d_scaled < 1e-3


def test_grpo_with_kl_in_the_reward_keeps_beta_in_reward_units():
    # With k1 in the reward the std divides score and KL alike: (4 r, 4 beta) gives advantages
    # (4 r - 4 beta k1 - mean) / std = the (r, beta) ones exactly, so the fixed point is pi*(r, beta)
    # with or without the std scaling; the xfail above is a property of the loss placement only.
    bed = bed_bandit(scale=4.0)
    log = tb.train_group(
        bed, "grpo", 4 * BETA, BANDIT, scale_by_std=True, kl_in_reward=True, kl_in_loss=False
    )
    dist = tb.kl_to(log.table, bed, pi_star(bed, 4 * BETA))
    print(f"GRPO (std-scaled, KL in the reward) on (4 r, 4 beta): KL(pi || pi*) = {dist:.2e}")
    assert dist < 1e-3, f"GRPO (std-scaled, KL in the reward) on (4 r, 4 beta): KL(pi || pi*) = {dist:.3f}"


# ---- GRPO's default with two epochs: the KL surrogate on the update's off-policy samples ---------
# The default run takes 2 epochs (x 2 minibatches on the bed): after the first gradient step the
# samples are those of pi_old, the policy before it. k3+ differentiates k1 grad log pi on them
# unweighted, E_old[k1 grad log pi] != grad KL(pi || pi_ref); k3_is (the default) weighs each
# token by pi / pi_old, which makes it exact (tests/oracle/test_kl_placement.py). lr 0.2, 4x the
# bed's, moves the policy far enough within a batch to tell them apart (docs/kl.md has the table
# at lr 0.05, 0.2, 0.5 and 1.0, five seeds each).
OFF_POLICY = tb.TrainSettings(steps=100, batch_size=1024, group_size=G, lr=0.2)


@functools.cache
def off_policy_run(estimator: str) -> tb.RunLog:
    """GRPO as a default run places it (KL in the loss, std-scaled advantages), at lr 0.2."""
    return tb.train_group(bed_bandit(), "grpo", BETA, OFF_POLICY, loss_estimator=estimator)


@functools.cache
def published_grpo_fixed_point() -> torch.Tensor:
    """(1, V) log-probs where the expected update of GRPO's default placement vanishes (G = 64,
    by enumerating the 47905 outcomes of a group; ~3 s)."""
    return tb.group_fixed_point(bed_bandit(), BETA, G, "grpo")


def kl_gradient_error(old: torch.Tensor, now: torch.Tensor, ref: torch.Tensor) -> float:
    """|E_old[k1 grad log pi] - grad KL(pi || pi_ref)| / |grad KL| on the bandit, exact: k3+'s
    expected KL gradient on samples of pi_old (log-probs ``old``) at the policy ``now``, in logit
    space: sum_y old_y k1_y (e_y - pi) against pi (k1 - KL), k1 = log pi - log pi_ref."""
    pi, k1 = now.exp(), now - ref
    true = pi * (k1 - (pi * k1).sum())
    k3_plus = old.exp() * k1 - pi * (old.exp() * k1).sum()
    return float((k3_plus - true).norm() / true.norm())


def test_grpo_default_epochs_k3_plus_and_k3_is_share_the_fixed_point_not_the_path():
    # Both reach the same fixed point: where the expected update vanishes pi = pi_old at every
    # minibatch, so k3_is's weight is 1 and its gradient is k3+'s. On the way they differ: in
    # the second epoch k3+'s leash pulls by pi_old's weights while the clipped surrogate's ratio
    # already weighs by pi, so each batch overshoots and the policy oscillates about the point.
    bed = bed_bandit()
    fp = published_grpo_fixed_point()[0]
    ref = torch.log_softmax(bed.ref_logits[0].to(F64), -1)
    gap = float(tb.exact_kl(fp, pi_star(bed, BETA)))  # 1.92e-4: the fixed point is not pi*
    per = OFF_POLICY.epochs * OFF_POLICY.minibatches  # gradient steps per batch
    second = OFF_POLICY.minibatches  # the second epoch's first gradient step
    got = {}
    for est in ("k3+", "k3_is"):
        log = off_policy_run(est)
        steps = [lp[0] for lp in log.step_logprobs]  # the policy before each gradient step
        assert len(steps) == OFF_POLICY.steps * per
        samplers = steps[::per]  # pi_old of each batch
        off = [float(tb.exact_kl(steps[b * per], steps[b * per + second])) for b in range(10)]
        err = [kl_gradient_error(steps[b * per], steps[b * per + second], ref) for b in range(10)]
        path = [float(tb.exact_kl(p, fp)) for p in samplers]
        got[est] = {
            "KL(pi_old || pi), 2nd epoch": sum(off) / 10,
            "k3+ grad error, 2nd epoch": sum(err) / 10,
            "mean KL(pi_t || fp), t = 10-49": sum(path[10:50]) / 40,
            "first t with KL(pi_t || fp) < 1e-3": next((t for t, d in enumerate(path) if d < 1e-3), None),
            "final KL(pi || fp)": tb.kl_to(log.table, bed, fp),
        }
        print(f"GRPO default, 2 epochs, lr {OFF_POLICY.lr}, {est}: {got[est]}")
    for est, row in got.items():
        # measurably off-policy: the first 10 batches' second epoch starts ~8e-3 nats from its
        # sampler, where k3+'s expected KL gradient is ~9% off the true one (1e-16 on-policy)
        assert row["KL(pi_old || pi), 2nd epoch"] > 1e-3 and row["k3+ grad error, 2nd epoch"] > 0.01, row
        # the same fixed point: 4x closer to it than it is to pi* (seeds 0-4, benchmarks/
        # testbed_epochs.py: <= 1.3e-5)
        assert row["final KL(pi || fp)"] < gap / 4, (est, row, gap)
    # the path: k3+ wanders 10x further from the fixed point at this lr (seeds 0-4: 4.6x-14x)
    path = "mean KL(pi_t || fp), t = 10-49"
    assert got["k3+"][path] > 3 * got["k3_is"][path], got


# ---- the sequence bed ---------------------------------------------------------------------------
SEQ_BETA = 0.5
SEQ = tb.TrainSettings(steps=150, batch_size=1024, group_size=G)
SEQ_DPO = tb.TrainSettings(steps=150, batch_size=2048)
# k1_seq's score-function estimate (the KL still to come times grad log pi) is noisier than the
# per-token surrogates' (docs/kl.md): twice the batches bring its averaged table to the same floor
SEQ_K1_SEQ = tb.TrainSettings(steps=300, batch_size=1024, group_size=G)


def seq_bed() -> tb.TabularBed:
    # V = 5, T = 3, reference logits N(0, 1), rewards U(0, 2) over the 125 sequences, seed 0
    return tb.random_sequence_bed(seed=0, reward_scale=2.0)


@functools.cache
def seq_run(name: str) -> tb.RunLog:
    bed = seq_bed()
    runs = {
        "ppo": lambda: tb.train_ppo(bed, SEQ_BETA, SEQ),
        # ppo.kl_shaping=exact: the exact per-position KL in the returns, each token's own k1 - KL_t
        # on its advantage (the same expected gradient, tests/oracle/test_kl_placement.py). It ends
        # further from pi* than "ppo" (1.2e-4 to 2.8e-4 over seeds 0-3, against 0.7e-5 to 4.3e-5):
        # at pi* the sampled return r - beta * sum k1 is constant, a cancellation it gives up
        # (docs/kl.md, "Exact shaping")
        "ppo-exact-shaping": lambda: tb.train_ppo(bed, SEQ_BETA, SEQ, kl_shaping="exact"),
        "rloo": lambda: tb.train_group(bed, "rloo", SEQ_BETA, SEQ),
        "grpo-k3+": lambda: tb.train_group(
            bed, "grpo", SEQ_BETA, SEQ, loss_estimator="k3+", scale_by_std=False
        ),
        "grpo-k3_is": lambda: tb.train_group(
            bed, "grpo", SEQ_BETA, SEQ, loss_estimator="k3_is", scale_by_std=False
        ),
        # k1 summed over the response, in the reward before the group baseline: the sequence-level
        # score-function gradient of the KL, so pi* is the fixed point (std scaling on or off)
        "grpo-kl-in-reward": lambda: tb.train_group(
            bed, "grpo", SEQ_BETA, SEQ, kl_in_reward=True, kl_in_loss=False
        ),
        "dr-grpo-kl-in-reward": lambda: tb.train_group(
            bed, "grpo", SEQ_BETA, SEQ, kl_in_reward=True, kl_in_loss=False, scale_by_std=False
        ),
        "dpo": lambda: tb.train_dpo(bed, SEQ_BETA, SEQ_DPO),
        # the KL in the loss through the sequence-level surrogate (score function with the KL
        # still to come): its expected gradient is the sequence KL's (tests/oracle/test_k1_seq.py)
        "grpo-k1_seq": lambda: tb.train_group(
            bed, "grpo", SEQ_BETA, SEQ_K1_SEQ, loss_estimator="k1_seq", scale_by_std=False
        ),
        "rloo-k1_seq-in-loss": lambda: tb.train_group(
            bed, "rloo", SEQ_BETA, SEQ_K1_SEQ, kl_in_reward=False, kl_in_loss=True, loss_estimator="k1_seq"
        ),
    }
    return runs[name]()


@pytest.mark.parametrize(
    "name,tol",
    [
        ("ppo", 1e-3),
        ("ppo-exact-shaping", 1e-3),
        ("rloo", 1e-3),
        ("rloo-k1_seq-in-loss", 1e-3),
        ("grpo-kl-in-reward", 1e-3),
        ("dr-grpo-kl-in-reward", 1e-3),
        ("dpo", 1e-2),
    ],
)
def test_sequence_bed_trainer_reaches_the_optimum(name, tol):
    bed = seq_bed()
    star = pi_star(bed, SEQ_BETA)
    log = seq_run(name)
    dist = tb.kl_to(log.table, bed, star)
    est, se, exact = logged_vs_exact(log)
    msg = (
        f"sequence bed {name}: KL(pi || pi*) = {dist:.3e} (KL(pi* || pi_ref) = "
        f"{float(tb.exact_kl(star, ref_logp(bed))):.4f}), logged KL {est:.4f} +- {se:.4f} "
        f"vs exact {exact:.4f}"
    )
    print(msg)
    assert dist < tol, msg
    assert abs(est - exact) < 3 * se, msg


def test_sequence_grpo_with_k1_seq_reaches_the_kl_regularized_optimum():
    # GRPO's group mean includes the sample itself, so its score gradient is (G - 1) / G of the
    # true one (Dr. GRPO, no std scaling): the fixed point is pi* of beta * G / (G - 1), the
    # sequence-level optimum (not the per-token one of the test below). With k1_seq it lands
    # there; the scale alone moves it 1e-3 nats from pi*(beta) at G = 64.
    bed = seq_bed()
    own = pi_star(bed, SEQ_BETA * G / (G - 1))
    star = pi_star(bed, SEQ_BETA)
    table = seq_run("grpo-k1_seq").table
    to_own, to_star = tb.kl_to(table, bed, own), tb.kl_to(table, bed, star)
    msg = (
        f"sequence bed grpo-k1_seq: KL(pi || pi*(beta G/(G-1))) = {to_own:.2e}, "
        f"KL(pi || pi*) = {to_star:.2e}, "
        f"KL(pi*(beta G/(G-1)) || pi*) = {float(tb.exact_kl(own, star)):.2e}"
    )
    print(msg)
    assert to_own < 1e-3 and to_star < 2e-3, msg


@pytest.mark.parametrize("name", ["grpo-k3+", "grpo-k3_is"])
def test_sequence_grpo_reaches_its_per_token_fixed_point(name):
    # A per-token KL surrogate in the loss charges each token only its own position's KL, not the
    # KL its choice causes later, so GRPO's fixed point is the myopic table of
    # tb.per_token_kl_in_loss_fixed_point (with Dr. GRPO's (G - 1) / G score scale), which on
    # this bed is 0.048 nats from pi*. The runs land on it.
    bed = seq_bed()
    fixed = tb.sequence_logprobs(tb.per_token_kl_in_loss_fixed_point(bed, SEQ_BETA, (G - 1) / G), 5, 3)
    star = pi_star(bed, SEQ_BETA)
    gap = float(tb.exact_kl(fixed, star))
    to_fixed = tb.kl_to(seq_run(name).table, bed, fixed)
    to_star = tb.kl_to(seq_run(name).table, bed, star)
    msg = (
        f"sequence bed {name}: KL(pi || per-token fixed point) = {to_fixed:.2e}, "
        f"KL(pi || pi*) = {to_star:.3e}, KL(fixed point || pi*) = {gap:.3e}"
    )
    print(msg)
    assert gap > 1e-2, msg  # the bed tells the two apart
    assert to_fixed < 5e-3 and to_star > 1e-2, msg


# ---- the budget controller ----------------------------------------------------------------------
def test_budget_update_rule_by_hand():
    c = BudgetKLController(kl_coef=0.1, budget=1.0, eta=0.1)
    # 0.1 + 0.1 * (1.5 - 1.0) = 0.1 + 0.05 = 0.15 (over budget: beta rises)
    assert c.update(1.5, 256) == pytest.approx(0.15, abs=1e-15)
    # 0.15 + 0.1 * (0.0 - 1.0) = 0.15 - 0.1 = 0.05 (under budget: beta falls)
    assert c.update(0.0, 256) == pytest.approx(0.05, abs=1e-15)
    # 0.05 + 0.1 * (0.0 - 1.0) = -0.05 -> projected to 0
    assert c.update(0.0, 256) == 0.0
    # at 0 and under budget it stays 0: max(0, 0 + 0.1 * (0.2 - 1.0)) = max(0, -0.08) = 0
    assert c.update(0.2, 1) == 0.0
    # a negative measured k1 mean is a valid (noisy) KL: max(0, 0 + 0.1 * (-0.5 - 1)) = 0
    assert c.update(-0.5, 1) == 0.0
    # exactly on budget: unchanged; n_steps does not matter: 0 + 0.1 * (3.0 - 1.0) = 0.2
    assert c.update(1.0, 10**6) == 0.0
    assert c.update(3.0, 1) == pytest.approx(0.2, abs=1e-15)
    assert c.update(3.0, 10**6) == pytest.approx(0.4, abs=1e-15)
    assert c.state_dict() == {
        "kind": "budget",
        "kl_coef": c.kl_coef,
        "budget": 1.0,
        "eta": 0.1,
        "kp": 0.0,
        "dual": c.kl_coef,
        "kd": 0.0,
        "last_kl": 3.0,
    }


def test_budget_proportional_term_by_hand():
    c = BudgetKLController(kl_coef=0.1, budget=1.0, eta=0.1, kp=1.0)
    # error 0.5: dual 0.1 + 0.1 * 0.5 = 0.15; beta = 0.15 + 1.0 * 0.5 = 0.65
    assert c.update(1.5, 1) == pytest.approx(0.65, abs=1e-15) and c.dual == pytest.approx(0.15, abs=1e-15)
    # error -0.5: dual 0.15 - 0.05 = 0.10; beta = 0.10 - 0.5 -> projected to 0
    assert c.update(0.5, 1) == 0.0 and c.dual == pytest.approx(0.10, abs=1e-15)
    # on budget: dual unchanged (0.10) and beta = dual = 0.10 (the fixed point of pure dual ascent)
    assert c.update(1.0, 1) == pytest.approx(0.10, abs=1e-15) and c.dual == pytest.approx(0.10, abs=1e-15)
    # far under: dual max(0, 0.10 + 0.1 * (-1.0)) = max(0, 0.0) = 0, beta max(0, 0 - 1.0) = 0
    assert c.update(0.0, 1) == 0.0 and c.dual == pytest.approx(0.0, abs=1e-15)
    with pytest.raises(ValueError, match="kp"):
        BudgetKLController(kl_coef=0.1, budget=1.0, kp=-1.0)
    # kp = 0 is the pure rule, step for step
    a, b = BudgetKLController(0.3, 1.0, 0.2), BudgetKLController(0.3, 1.0, 0.2, kp=0.0)
    for kl in (1.7, 0.2, 0.0, 2.5, 1.0):
        assert a.update(kl, 1) == b.update(kl, 1) == a.dual


def test_budget_derivative_term_by_hand():
    c = BudgetKLController(kl_coef=0.0, budget=1.0, eta=0.1, kp=1.0, kd=1.0)
    # first call, no previous KL: dual max(0, 0 + 0.1 * (0.2 - 1)) = 0, beta max(0, 0 - 0.8 + 0) = 0
    assert c.update(0.2, 1) == 0.0 and c.last_kl == 0.2
    # rise 0.5, still under budget: dual max(0, 0 - 0.03) = 0; beta 0 + 1.0 * (-0.3) + 1.0 * 0.5 = 0.2
    assert c.update(0.7, 1) == pytest.approx(0.2, abs=1e-15) and c.dual == 0.0
    # over budget, rise 0.6: dual 0 + 0.1 * 0.3 = 0.03; beta 0.03 + 0.3 + 0.6 = 0.93
    assert c.update(1.3, 1) == pytest.approx(0.93, abs=1e-15) and c.dual == pytest.approx(0.03, abs=1e-15)
    # falling (1.3 -> 1.1): no derivative push; dual 0.03 + 0.01 = 0.04, beta 0.04 + 0.1 = 0.14
    assert c.update(1.1, 1) == pytest.approx(0.14, abs=1e-15) and c.dual == pytest.approx(0.04, abs=1e-15)
    # on budget and flat at the fixed point: beta = dual
    c.update(1.0, 1)
    assert c.update(1.0, 1) == pytest.approx(c.dual, abs=1e-15)
    # a falling or flat KL adds nothing: kd 2 and kd 0 agree step for step on such a path
    a = BudgetKLController(0.3, 1.0, 0.2, kp=1.0, kd=2.0)
    b = BudgetKLController(0.3, 1.0, 0.2, kp=1.0, kd=0.0)
    for kl in (2.5, 1.7, 1.7, 0.6, 0.1):
        assert a.update(kl, 1) == b.update(kl, 1)
    # then a rise of 0.3: beta max(0, dual + 1.0 * (0.4 - 1.0) + 2.0 * 0.3) = dual (a.dual, after the update)
    assert a.update(0.4, 1) == pytest.approx(a.dual, abs=1e-15) and a.dual > 0
    assert b.update(0.4, 1) == 0.0  # without kd: max(0, dual - 0.6), projected
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="kd"):
            BudgetKLController(kl_coef=0.1, budget=1.0, kd=bad)
    assert make_controller("budget", 0.2, budget=0.3, kp=1.0, kd=2.0).kd == 2.0


def test_budget_controller_validation_and_factory():
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="finite"):
            BudgetKLController(kl_coef=0.1, budget=1.0).update(bad, 1)
    for kw, match in (
        ({"budget": 0.0}, "budget"),
        ({"budget": -1.0}, "budget"),
        ({"budget": float("nan")}, "budget"),
        ({"budget": 1.0, "eta": 0.0}, "eta"),
        ({"budget": 1.0, "eta": -0.1}, "eta"),
        ({"budget": 1.0, "kl_coef": -0.1}, "kl_coef"),
    ):
        with pytest.raises(ValueError, match=match):
            BudgetKLController(**{"kl_coef": 0.1, **kw})
    c = make_controller("budget", 0.2, budget=0.3, eta=0.5)
    assert isinstance(c, BudgetKLController) and (c.kl_coef, c.budget, c.eta) == (0.2, 0.3, 0.5)
    assert make_controller("budget", 0.2, budget=0.3).eta == 0.1
    with pytest.raises(ValueError, match="budget"):
        make_controller("budget", 0.2)
    # a controller takes its own settings, by name, and refuses another's
    assert isinstance(make_controller("fixed", 0.1), FixedKLController)
    with pytest.raises(ValueError, match=r"kl.controller=fixed has no setting \['horizon', 'target'\]"):
        make_controller("fixed", 0.1, target=6.0, horizon=10_000)


def beta_for_budget(bed: tb.TabularBed, eps: float) -> float:
    """beta with KL(pi*(beta) || pi_ref) = eps, by bisection (the KL falls as beta grows)."""
    lo, hi = 1e-3, 1e3
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if float(tb.exact_kl(pi_star(bed, mid), ref_logp(bed))) > eps:
            lo = mid
        else:
            hi = mid
    return mid


@pytest.mark.parametrize(
    "algo, kp, kd",
    [("rloo", 0.0, 0.0), ("rloo", 1.0, 0.0), ("rloo", 1.0, 1.0), ("ppo", 1.0, 0.0)],
    ids=["rloo-dual-ascent", "rloo-with-kp", "rloo-with-kp-kd", "ppo"],
)
def test_budget_controller_holds_the_kl_on_the_bandit(algo, kp, kd):
    # the controller reads what a default run's reads: the exact KL per sequence; PPO is the
    # default run itself (budget leash, k1 in the reward, ppo.scale_returns on). The derivative
    # term (kd) reacts to the batches' noise too (a positive push on every rise), but the
    # integral still drives the mean error to 0: the budget holds (the dual within 5% of beta*)
    bed, eps = bed_bandit(), 0.3  # nats per sequence; unconstrained KL at beta 1 is 0.5356
    beta_star = beta_for_budget(bed, eps)  # 1.36867
    c = BudgetKLController(kl_coef=1.0, budget=eps, eta=0.2, kp=kp, kd=kd)
    settings = tb.TrainSettings(steps=150, batch_size=1024, group_size=G, lr_final_fraction=0.2)
    log = tb.train_on_policy(bed, algo, c, settings)
    half = settings.steps // 2
    measured = torch.tensor([float(k.mean()) for k in log.kl_estimates[half:]])  # the logged estimate
    exact = torch.tensor(log.exact_kls[half:])
    mean_dev = abs(float(measured.mean()) - eps) / eps
    exact_dev = float((exact - eps).abs().max()) / eps
    batch_dev = float((measured - eps).abs().max()) / eps
    msg = (
        f"budget {eps}: last half measured KL mean {float(measured.mean()):.4f} ({mean_dev:.1%} off), "
        f"exact KL in [{float(exact.min()):.4f}, {float(exact.max()):.4f}] (max {exact_dev:.1%} off), "
        f"single-batch estimates up to {batch_dev:.1%} off (sampling noise, SE ~8%); "
        f"beta {c.kl_coef:.4f} (dual {c.dual:.4f}) vs beta*(eps) {beta_star:.4f} ({algo}, kp {kp}, kd {kd})"
    )
    msg += f"; exact KL mean {float(exact.mean()):.4f}"
    print(msg)
    assert beta_star == pytest.approx(1.36867, abs=1e-4)
    assert mean_dev < 0.10, msg
    assert abs(float(exact.mean()) - eps) / eps < 0.10, msg
    if algo == "rloo":
        # PPO's policy also moves with its value table's errors: one batch's exact KL was 16%
        # off (0.252 .. 0.346) while the mean held within 1%, so only RLOO's path is bounded
        assert exact_dev < 0.10, msg
    assert abs(c.dual - beta_star) / beta_star < 0.05, msg  # the multiplier settles at beta*(eps)


def test_budget_controller_holds_the_kl_with_the_kl_in_the_loss():
    # the other placement: GRPO with k3+ in the loss (beta acts through the loss, not the reward).
    # GRPO's leave-in group baseline lands on pi*(beta G / (G - 1)), so the multiplier that holds
    # the budget is beta*(eps) (G - 1) / G = 1.36867 * 63 / 64 = 1.34729
    bed, eps = bed_bandit(), 0.3
    beta_needed = beta_for_budget(bed, eps) * (G - 1) / G
    c = BudgetKLController(kl_coef=1.0, budget=eps, eta=0.2, kp=1.0)
    settings = tb.TrainSettings(steps=150, batch_size=1024, group_size=G, lr_final_fraction=0.2)
    log = tb.train_on_policy(
        bed, "grpo", c, settings, kl_in_reward=False, kl_in_loss=True, loss_estimator="k3+"
    )
    half = settings.steps // 2
    measured = torch.tensor([float(k.mean()) for k in log.kl_estimates[half:]])
    exact = torch.tensor(log.exact_kls[half:])
    mean_dev = abs(float(measured.mean()) - eps) / eps
    exact_dev = float((exact - eps).abs().max()) / eps
    msg = (
        f"budget {eps}, KL in the loss: last half measured KL mean {float(measured.mean()):.4f} "
        f"({mean_dev:.1%} off), exact KL max {exact_dev:.1%} off; dual {c.dual:.4f} vs {beta_needed:.4f}"
    )
    print(msg)
    assert mean_dev < 0.10 and exact_dev < 0.10, msg
    # looser than the reward placement's 5%: measured 1.2803 (5.0% under), the multiplier wanders
    # more when beta acts through a surrogate's gradient
    assert abs(c.dual - beta_needed) / beta_needed < 0.10, msg


# ---- best-of-N ----------------------------------------------------------------------------------
def test_best_of_n_by_hand_and_tie_break():
    bed = bed_bandit()
    # rewards 0 < 1 < 2 < 3: F = [0.4, 0.7, 0.9, 1.0]; N = 2: p = F^2 - F_<^2
    # = [0.16, 0.49 - 0.16, 0.81 - 0.49, 1 - 0.81] = [0.16, 0.33, 0.32, 0.19]
    p2 = tb.best_of_n_logprobs(ref_logp(bed), bed.rewards, 2).exp()
    torch.testing.assert_close(p2, torch.tensor([0.16, 0.33, 0.32, 0.19], dtype=F64), atol=1e-12, rtol=0)
    # KL = 0.16 ln 0.4 + 0.33 ln 1.1 + 0.32 ln 1.6 + 0.19 ln 1.9
    #    = -0.146607 + 0.031452 + 0.150401 + 0.121952 = 0.157199;  bound ln 2 - 1/2 = 0.193147
    row = tb.best_of_n_kl_table(ref_logp(bed), bed.rewards, [2])[0]
    assert row.kl == pytest.approx(0.157199, abs=1e-6) and row.bound == pytest.approx(0.193147, abs=1e-6)
    # ties: rewards [1, 1, 0], pi_ref [0.2, 0.3, 0.5]; the lower index wins a tie, so the order
    # worst..best is [2, 1, 0] with F = [0.5, 0.8, 1.0]; N = 2:
    # p[2] = 0.25, p[1] = 0.64 - 0.25 = 0.39, p[0] = 1 - 0.64 = 0.36
    tie = tb.best_of_n_logprobs(
        torch.tensor([0.2, 0.3, 0.5], dtype=F64).log(), torch.tensor([1.0, 1.0, 0.0]), 2
    )
    torch.testing.assert_close(tie.exp(), torch.tensor([0.36, 0.39, 0.25], dtype=F64), atol=1e-12, rtol=0)


def test_best_of_n_matches_simulation():
    bed = tb.random_sequence_bed(seed=0)
    ref = ref_logp(bed)
    n, draws = 4, 20_000
    g = torch.Generator().manual_seed(0)
    idx = torch.multinomial(ref.exp(), draws * n, replacement=True, generator=g).view(draws, n)
    best = idx.gather(1, bed.rewards[idx].argmax(1, keepdim=True))[:, 0]  # rewards are distinct
    freq = torch.bincount(best, minlength=125).to(F64) / draws
    p = tb.best_of_n_logprobs(ref, bed.rewards, n).exp()
    worst = float(((freq - p).abs() / (p * (1 - p) / draws).sqrt()).max())
    assert worst < 4.5, f"best-of-{n} frequency {worst:.2f} standard errors off"


@pytest.mark.parametrize("which", ["bandit", "sequence bed"])
def test_best_of_n_kl_is_below_the_bound(which):
    bed = bed_bandit() if which == "bandit" else tb.random_sequence_bed(seed=0)
    rows = tb.best_of_n_kl_table(ref_logp(bed), bed.rewards, range(1, 17))
    print(f"\nbest-of-N on the {which}:  N  exact KL  log N - (N-1)/N")
    for r in rows:  # N = 1 is 0 up to rounding (+-1e-17); printed as 0
        print(f"  {r.n:2d}  {0.0 if abs(r.kl) < 1e-15 else r.kl:.6f}  {r.bound:.6f}")
    assert rows[0].n == 1 and rows[0].kl == pytest.approx(0.0, abs=1e-15) and rows[0].bound == 0.0
    assert all(r.kl <= r.bound + 1e-12 for r in rows), rows
    assert all(r.kl < r.bound for r in rows[1:]), rows  # strictly below for a discrete reward
    assert all(b.kl > a.kl for a, b in zip(rows, rows[1:])), rows  # grows with N


def test_exact_shaping_is_refused_without_per_token_advantages():
    with pytest.raises(ValueError, match="per-token advantages"):
        tb.train_group(seq_bed(), "rloo", SEQ_BETA, SEQ, kl_shaping="exact")


# ---- a 0/1 reward: all-equal groups -----------------------------------------------------------
# A verifiable reward on the bandit: action 3 is right (1), the others wrong (0). With G = 4 the
# groups are all-wrong with probability 0.768^4 = 0.35 at pi* (pi*(3) = 0.1e / (0.9 + 0.1e) =
# 0.232), so every batch of 256 groups holds ~90 all-equal ones. The fixed points are computed
# exactly, by enumerating the 35 outcomes of a group (tb.group_fixed_point).
BED01_REWARDS = [0.0, 0.0, 0.0, 1.0]
G01 = 4
BANDIT01 = tb.TrainSettings(steps=300, batch_size=1024, group_size=G01)
RULES01 = {  # name -> (the fixed point's rule, train_group's keywords)
    "grpo": ("grpo", dict(algo="grpo", scale_by_std=True)),
    "grpo-scale-kl": ("grpo-scale-kl", dict(algo="grpo", scale_by_std=True, scale_kl_by_std=True)),
    "grpo-scale-kl-k1_seq": (
        "grpo-scale-kl",
        dict(algo="grpo", scale_by_std=True, scale_kl_by_std=True, loss_estimator="k1_seq"),
    ),
    "dr-grpo": ("dr-grpo", dict(algo="grpo", scale_by_std=False)),
    "rloo": ("rloo", dict(algo="rloo")),
}


def bed01() -> tb.TabularBed:
    return tb.bandit(REF, BED01_REWARDS)


def test_group_fixed_points_on_the_01_bandit_by_enumeration():
    bed = bed01()
    fp = {
        rule: tb.group_fixed_point(bed, BETA, G01, rule)
        for rule in ("grpo", "grpo-scale-kl", "dr-grpo", "rloo")
    }
    star, star_g = pi_star(bed, BETA), pi_star(bed, BETA * G01 / (G01 - 1))
    d = {rule: tb.kl_to(f, bed, star) for rule, f in fp.items()}
    d_g = {rule: tb.kl_to(f, bed, star_g) for rule, f in fp.items()}
    print("0/1 bandit, G = 4: KL(fp || pi*) =", d, "KL(fp || pi*(beta G/(G-1))) =", d_g)
    # RLOO (k1 in the reward, leave-one-out) is unbiased: pi* itself, to rounding
    assert abs(d["rloo"]) < 1e-12
    # mean-centred advantages include r_i: pi*(beta G / (G - 1)) = pi*(4/3), to rounding
    assert abs(d_g["dr-grpo"]) < 1e-12
    # scale_kl_by_std with the all-equal rule: within 1e-5 of Dr. GRPO's fixed point (1.8e-6; the
    # weights are not exactly uncorrelated with the group's gradient, docs/kl.md)
    assert d_g["grpo-scale-kl"] < 1e-5
    # the published GRPO (KL unscaled) puts beta in group-std units: it lands 0.017 away
    assert d["grpo"] > 1e-2 and d_g["grpo"] > 1e-2
    # all-equal groups are common there: P(all 4 wrong) + P(all 4 right) at Dr. GRPO's fixed point
    # (pi(3) = 0.190: 0.810^4 + 0.190^4 = 0.43)
    right = float(fp["dr-grpo"].exp()[0, 3])
    assert (1 - right) ** G01 + right**G01 > 0.4


@pytest.mark.parametrize("name", list(RULES01))
def test_group_trainers_reach_their_fixed_point_on_the_01_bandit(name):
    bed = bed01()
    rule, kw = RULES01[name]
    kw = dict(kw)
    log = tb.train_group(bed, kw.pop("algo"), BETA, BANDIT01, **kw)
    dist = tb.kl_to(log.table, bed, tb.group_fixed_point(bed, BETA, G01, rule))
    msg = (
        f"{name} on the 0/1 bandit (G = 4): after {BANDIT01.steps} batches KL(pi || fixed point) = {dist:.2e}"
    )
    print(msg)
    assert dist < 1e-3, msg


# ---- grpo.scale_kl_by_std: the std is sampled, so its fixed point moves by O(1/G) -------------
# Each group's update is w_g sum_i ((r_i - mean_g) - beta k1_i) grad log pi(y_i) / G with
# w_g = 1 / std_g. Were w_g independent of which actions the group drew, the fixed point would be
# Dr. GRPO's pi*(beta G / (G - 1)). It is not: a sample far from the reward mean raises its
# group's std. To first order in 1/G (docs/kl.md, "scale_kl_by_std: the fixed point"):
#   log pi(a) = log pi_ref(a) + (G - 1) / G * r_a / beta + KL z_a^2 / (2 G) - log Z + O(1/G^2)
# with z_a = (r_a - mu) / sigma and KL = KL(pi || pi_ref), all under pi.


def tilted_fixed_point(bed: tb.TabularBed, beta: float, group_size: int) -> torch.Tensor:
    """(V,) log-probs of the first-order prediction above, its moments taken at pi*(beta G / (G - 1))."""
    G = group_size
    ref = torch.log_softmax(bed.ref_logits[0].to(F64), -1)
    r = bed.rewards.to(F64)
    base = torch.log_softmax(ref + (G - 1) / G * r / beta, -1)  # pi*(beta G / (G - 1))
    p = base.exp()
    mu = (p * r).sum()
    z2 = (r - mu) ** 2 / (p * (r - mu) ** 2).sum()
    kl = (p * (base - ref)).sum()
    return torch.log_softmax(base + kl * z2 / (2 * G), -1)


@functools.cache
def scale_kl_fixed_point(group_size: int) -> torch.Tensor:
    """(1, V) exact fixed point of grpo.scale_kl_by_std on the bandit (r = 0..3, beta 1), by
    enumerating every group outcome (47905 at G = 64, ~3 s)."""
    return tb.group_fixed_point(bed_bandit(), BETA, group_size, "grpo-scale-kl")


def test_sampled_group_variance_given_one_sample_by_enumeration():
    # The fact the derivation rests on: with y_1 = a fixed and y_2..y_G ~ pi,
    #   E[s^2 | y_1 = a] = sigma^2 + ((r_a - mu)^2 - sigma^2) / G   (s^2 with G - 1, as group_std)
    # exactly. By hand for G = 2, pi = (1/2, 1/2) over rewards (0, 1): mu = 1/2, sigma^2 = 1/4;
    # s^2 of two samples is (r_1 - r_2)^2 / 2, so E[s^2 | r_1 = 0] = 1/2 * 1/2 = 1/4, and the formula
    # gives 1/4 + (1/4 - 1/4) / 2 = 1/4. Here every outcome of the other G - 1 samples is summed.
    from tether.core.advantages import group_std

    pi = torch.tensor(REF, dtype=F64)
    r = torch.tensor(REWARDS, dtype=F64)
    mu = (pi * r).sum()
    var = (pi * (r - mu) ** 2).sum()
    for G in (2, 4, 8):
        counts = tb.group_outcomes(4, G - 1)  # (M, V) the other samples
        prob = torch.exp(
            torch.lgamma(torch.tensor(float(G), dtype=F64))
            - torch.lgamma(counts.to(F64) + 1).sum(-1)
            + counts.to(F64) @ pi.log()
        )  # multinomial probabilities, (M,)
        for a in range(4):
            group = counts.clone()
            group[:, a] += 1  # (M, V) with y_1 = a
            rewards = torch.repeat_interleave(r.repeat(len(group)), group.reshape(-1))  # (M * G,)
            s2 = group_std(rewards, G).view(-1, G)[:, 0] ** 2  # the trainers' std, squared
            want = var + ((r[a] - mu) ** 2 - var) / G
            assert float((prob * s2).sum()) == pytest.approx(float(want), rel=1e-12), (G, a)


def test_scale_kl_by_std_fixed_point_over_group_size():
    # Exact fixed points (Newton on the enumerated expected update) against pi*(beta G/(G - 1)),
    # pi*(beta) and the first-order prediction. The prediction's log-probs are off by O(1/G^2), so
    # its KL by O(1/G^4): a factor 16 per doubling of G; a wrong first-order term would leave
    # O(1/G) in the log-probs and a factor 4. The test takes the geometric middle, 8. Likewise
    # KL(fp || pi*(beta G/(G - 1))) is O(1/G^2) (factor 4), told from O(1/G) (factor 2) at 2.83.
    bed = bed_bandit()
    rows = {}
    for G in (4, 8, 16, 32, 64):
        fp = scale_kl_fixed_point(G)[0]
        rows[G] = (
            float(tb.exact_kl(fp, pi_star(bed, BETA * G / (G - 1)))),
            float(tb.exact_kl(fp, pi_star(bed, BETA))),
            float(tb.exact_kl(fp, tilted_fixed_point(bed, BETA, G))),
        )
    print("\nscale_kl_by_std on the bandit, KL(fp || .):  G  pi*(bG/(G-1))  pi*(b)  first order")
    for G, (d_g, d, d_pred) in rows.items():
        print(f"  {G:3d}  {d_g:.3e}  {d:.3e}  {d_pred:.3e}")
    for G in (16, 32, 64):
        assert rows[G // 2][2] / rows[G][2] > 8, rows  # 1/G^4: measured 14.2, 16.4, 16.4
        assert rows[G // 2][0] / rows[G][0] > 2.83, rows  # 1/G^2: measured 5.1, 4.8, 4.4
    for d_g, d, _ in rows.values():
        assert d_g < d / 5, rows  # G / (G - 1) is most of it: 11x-13x closer than to pi*(beta)
    d_g, d, d_pred = rows[64]
    # G = 64, exact enumeration of 47905 outcomes, Newton to |gradient / pi| < 1e-14
    assert d_g == pytest.approx(1.406e-5, rel=1e-3) and d == pytest.approx(1.807e-4, rel=1e-3), rows[64]
    assert d_pred < d_g / 50, rows[64]  # 1.33e-7: the first order accounts for the rest


def test_scale_kl_by_std_run_lands_on_its_exact_fixed_point():
    # 150 batches of 4096 (64 groups of G = 64): the run lands on the enumerated fixed point, not
    # on pi*(beta G/(G - 1)), which is 1.41e-5 from it (seeds 0-4, benchmarks/testbed_epochs.py
    # --scale-kl: 0.45e-6 .. 1.4e-6 from the fixed point, 0.87e-5 .. 1.9e-5 from pi*(beta G/(G - 1)))
    bed = bed_bandit()
    fp = scale_kl_fixed_point(G)[0]
    dr_grpo = pi_star(bed, BETA * G / (G - 1))
    settings = tb.TrainSettings(steps=150, batch_size=4096, group_size=G)
    log = tb.train_group(bed, "grpo", BETA, settings, scale_by_std=True, scale_kl_by_std=True)
    to_fp, to_dr = tb.kl_to(log.table, bed, fp), tb.kl_to(log.table, bed, dr_grpo)
    gap = float(tb.exact_kl(fp, dr_grpo))
    msg = (
        f"scale_kl_by_std, G = {G}: KL(pi || fp) = {to_fp:.2e}, "
        f"KL(pi || pi*(bG/(G-1))) = {to_dr:.2e}, gap {gap:.2e}"
    )
    print(msg)
    assert to_fp < gap / 4 and to_dr > 3 * to_fp, msg


def sequence_kl_cv(bed: tb.TabularBed, beta: float) -> float:
    """The coefficient of variation of a sequence's exact-KL sum under pi*(beta), by enumeration:
    the guard's batch estimate of the KL has relative standard error cv / sqrt(B) there."""
    table = tb.optimal_table(bed, beta)
    seqs = tb.all_sequences(bed.vocab, bed.length)
    per = tb.position_kl(table, bed.ref_logits, tb.prefix_indices(seqs, bed.vocab)).sum(-1)
    p = tb.sequence_logprobs(table, bed.vocab, bed.length).exp()
    mean = (p * per).sum()
    return float(((p * (per - mean) ** 2).sum()).sqrt() / mean)


@functools.cache
def guard_runs(bed_name: str, algo: str, guarded: bool) -> tuple[tb.RunLog, float]:
    bed, eps, lr = (bed_bandit(), 0.3, 0.05) if bed_name == "bandit" else (seq_bed(), 0.5, 0.1)
    c = BudgetKLController(kl_coef=1.0, budget=eps, eta=0.2, kp=1.0)
    settings = tb.TrainSettings(steps=150, batch_size=1024, group_size=G, lr_final_fraction=0.2, lr=lr)
    log = tb.train_on_policy(bed, algo, c, settings, guard="auto" if guarded else None)
    return log, c.dual


@pytest.mark.parametrize("bed_name", ["bandit", "sequence"])
@pytest.mark.parametrize("algo", ["ppo", "rloo"])
def test_the_guard_holds_the_budget_and_reaches_the_constrained_optimum(bed_name, algo):
    # A learning rate at which one unguarded update crosses the budget (the bandit at lr 0.05, the
    # sequence bed at 0.1: unguarded PPO peaks 97% and 23% over). Guarded (the budget
    # controller's default): the exact KL of the policy at every batch stays within the ceiling
    # budget * 1.05, up to the guard's own error on the sequence bed: it reads the KL at the
    # prefixes of the policy that drew the batch, and kl.guard_z = 2 standard errors leave a 2.3%
    # tail; 3 standard errors of its batch estimate (cv / sqrt(1024), by enumeration at pi*: 1.9%)
    # allowed. On the bandit one position makes the estimate exact (its SE 0). And the run lands
    # on pi* of the beta that spends the budget exactly (KL < 1e-3 nats), the multiplier on that
    # beta (within 5%).
    bed, eps = (bed_bandit(), 0.3) if bed_name == "bandit" else (seq_bed(), 0.5)
    beta_star = beta_for_budget(bed, eps)
    cv = 0.0 if bed_name == "bandit" else sequence_kl_cv(bed, beta_star)
    ceiling = eps * 1.05 * (1 + 3 * cv / math.sqrt(1024)) + 1e-9
    log, dual = guard_runs(bed_name, algo, True)
    unguarded, _ = guard_runs(bed_name, "ppo", False)
    peak, free_peak = max(log.exact_kls), max(unguarded.exact_kls)
    dist = tb.kl_to(log.table, bed, pi_star(bed, beta_star))
    cut = sum(g.fraction < 1 for g in log.guard)
    msg = (
        f"{bed_name} {algo}: exact KL peak {peak:.4f} (ceiling {eps * 1.05:.4f}, with the estimate's "
        f"noise {ceiling:.4f}; unguarded PPO {free_peak:.4f}), the guard cut {cut} of {len(log.guard)} "
        f"updates; KL(pi || pi*(beta*)) = {dist:.2e}, dual {dual:.4f} vs beta* {beta_star:.4f}"
    )
    print(msg)
    assert free_peak > eps * 1.05, msg  # the learning rate crosses the budget unguarded
    assert peak <= ceiling, msg
    assert dist < 1e-3, msg
    assert abs(dual - beta_star) / beta_star < 0.05, msg
