"""The test bed with environment tokens: positions a tool writes inside the response.

A multi-turn rollout interleaves the policy's tokens with an environment's (rollout.env). In the
bed an environment position draws its token from a fixed table instead of the policy
(``TabularBed.env_positions``, ``env_logits``); the trainers get ``response_mask`` False there,
as tether's multi-turn rollouts do. The optimum is the soft-Bellman one with the environment's
positions as chance nodes (``tb.optimal_table``); for a forced environment (one token per prefix)
it is also ``pi_ref exp(r / beta) / Z`` over the rollouts it can write.

Tolerances, as in tests/oracle/test_testbed.py: correct configurations KL(pi || pi*) < 1e-3 nats
(beta * 1e-3 = 5e-4 reward units from J(pi*)); GRPO's per-token KL in the loss within 5e-3 of its
own computed fixed point; the logged KL within 3 standard errors of the exact one. The two bugs
the mask exists to prevent (the environment's tokens counted as the policy's; GAE cut at a hole)
must land at least 5x that tolerance away, and they do by 15-36x (printed).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

from tether.core.advantages import GAEOutput
from tether.testing import testbed as tb

F64 = torch.float64
BETA = 0.5
G = 64
LAST = 20  # batches pooled for the logged-KL check
SETTINGS = tb.TrainSettings(steps=150, batch_size=1024, group_size=G)
# k1_seq's score-function estimate is noisier (tests/oracle/test_testbed.py): twice the batches
SETTINGS_K1_SEQ = tb.TrainSettings(steps=300, batch_size=1024, group_size=G)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/oracle/conftest.py


def env_bed() -> tb.TabularBed:
    # V = 5, T = 4: the policy writes positions 0 and 3, a forced environment positions 1 and 2
    # (a two-token tool reply fixed by the policy's first token); reference N(0, 1), rewards
    # U(0, 2) over the 625 sequences, seed 0 (25 rollouts have probability > 0)
    return tb.random_sequence_bed(seed=0, length=4, reward_scale=2.0, env_positions=(1, 2))


def star_of(bed: tb.TabularBed, beta: float = BETA) -> torch.Tensor:
    return tb.rollout_logprobs(bed, tb.optimal_table(bed, beta))


def ref_of(bed: tb.TabularBed) -> torch.Tensor:
    return tb.rollout_logprobs(bed, bed.ref_logits)


def J(bed: tb.TabularBed, table: torch.Tensor, beta: float) -> float:
    return float(tb.objective(tb.rollout_logprobs(bed, table), ref_of(bed), bed.rewards, beta))


# ---- exact quantities ---------------------------------------------------------------------------
def hand_bed() -> tb.TabularBed:
    # V = 2, T = 2: the policy picks y0 (pi_ref uniform), then a random environment writes y1 with
    # probabilities (0.25, 0.75) after either y0. Rewards r(y0 y1): r(00) = 0, r(01) = 4,
    # r(10) = 2, r(11) = 2.
    env = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.75], [0.25, 0.75]], dtype=F64))
    return tb.TabularBed(
        vocab=2,
        length=2,
        ref_logits=torch.zeros(3, 2, dtype=F64),
        rewards=torch.tensor([0.0, 4.0, 2.0, 2.0], dtype=F64),
        env_positions=(1,),
        env_logits=env,
    )


def test_optimum_with_a_random_environment_by_hand():
    bed = hand_bed()
    beta = 1.0
    # y1 is a chance node: W(y0) = E_env[r / beta] = 0.25 * 0 + 0.75 * 4 = 3 after y0 = 0 and
    # 0.25 * 2 + 0.75 * 2 = 2 after y0 = 1, so pi*(0) = 0.5 e^3 / (0.5 e^3 + 0.5 e^2) = sigmoid(1)
    # = 0.731059
    table = tb.optimal_table(bed, beta)
    assert float(table[0].softmax(-1)[0]) == pytest.approx(1 / (1 + math.exp(-1)), abs=1e-15)
    # the policy's rows at the environment's position stay pi_ref's (uniform)
    torch.testing.assert_close(table[1:].exp(), torch.full((2, 2), 0.5, dtype=F64), atol=1e-15, rtol=0)
    # rollout probabilities: pi*(y0) * env(y1): [0.7311 * 0.25, 0.7311 * 0.75, 0.2689 * 0.25, ...]
    s = 1 / (1 + math.exp(-1))
    want = torch.tensor([s * 0.25, s * 0.75, (1 - s) * 0.25, (1 - s) * 0.75], dtype=F64)
    torch.testing.assert_close(star_of(bed, beta).exp(), want, atol=1e-15, rtol=0)
    # Treating the environment's token as if the policy chose it gives another target: the
    # closed form pi_ref(y) exp(r(y) / beta) / Z puts (0.25 + 0.75 e^4) / (0.25 + 0.75 e^4 + e^2)
    # = 41.199 / 48.588 = 0.8479 on y0 = 0, not 0.7311
    closed = tb.optimal_logprobs(ref_of(bed), bed.rewards, beta).exp()
    assert float(closed[:2].sum()) == pytest.approx(
        (0.25 + 0.75 * math.e**4) / (0.25 + 0.75 * math.e**4 + math.e**2), abs=1e-12
    )
    # with one policy position there is no later KL to charge: the per-token fixed point is pi*
    torch.testing.assert_close(tb.per_token_kl_in_loss_fixed_point(bed, beta), table, atol=1e-15, rtol=0)
    # J(pi*) - J(pi) = beta * KL(pi || pi*) over rollouts, for any table (env factors cancel)
    other = torch.randn(3, 2, generator=torch.Generator().manual_seed(1), dtype=F64)
    gap = J(bed, table, beta) - J(bed, other, beta)
    assert gap == pytest.approx(beta * tb.kl_to(other, bed, star_of(bed, beta)), abs=1e-12)
    assert gap > 1e-3


def test_a_forced_environment_keeps_the_closed_form_and_carries_no_kl():
    bed = env_bed()
    star = star_of(bed)
    # a forced token leaves nothing to average: pi* = pi_ref(y) exp(r(y) / beta) / Z over the
    # rollouts the environment can write (the others have probability 0 under every policy)
    closed = tb.optimal_logprobs(ref_of(bed), bed.rewards, BETA)
    torch.testing.assert_close(star, closed, atol=1e-12, rtol=0)
    assert int(torch.isfinite(star).sum()) == 25 and float(star.exp().sum()) == pytest.approx(1, abs=1e-12)
    # every sample carries the forced tokens
    tokens = tb.sample(bed.ref_logits, 5, 4, 2000, torch.Generator().manual_seed(0), **_env(bed))
    rows = tb.prefix_indices(tokens, 5)
    forced = bed.env_logits.argmax(-1)
    assert torch.equal(tokens[:, 1:3], forced[rows[:, 1:3]])
    # KL(pi || pi_ref) over rollouts = E_pi[sum over the policy's positions of their exact KL]:
    # the environment's factors cancel, whatever the policy's table holds at its positions
    table = torch.randn(bed.num_prefixes, 5, generator=torch.Generator().manual_seed(2), dtype=F64)
    seqs = tb.all_sequences(5, 4)
    per_position = tb.position_kl(table, bed.ref_logits, tb.prefix_indices(seqs, 5))  # (625, 4)
    expected = (tb.rollout_logprobs(bed, table).exp() * per_position[:, [0, 3]].sum(-1)).sum()
    assert float(tb.exact_kl(tb.rollout_logprobs(bed, table), ref_of(bed))) == pytest.approx(
        float(expected), abs=1e-12
    )


def _env(bed: tb.TabularBed) -> dict:
    return dict(env_positions=bed.env_positions, env_logits=bed.env_logits)


def test_sampler_matches_a_random_environment():
    bed = tb.random_sequence_bed(seed=0, env_positions=(1,), env="random")
    n = 40_000
    tokens = tb.sample(bed.ref_logits, 5, 3, n, torch.Generator().manual_seed(0), **_env(bed))
    freq = torch.bincount(tb.sequence_index(tokens, 5), minlength=125).to(F64) / n
    p = ref_of(bed).exp()
    se = (p * (1 - p) / n).sqrt()
    # 125 cells: a 4.5-sigma deviation anywhere has probability ~125 * 7e-6 = 1e-3
    worst = float(((freq - p).abs() / se).max())
    assert worst < 4.5, f"a rollout frequency is {worst:.2f} standard errors from its probability"


def test_bad_environment_tables_are_refused():
    good = env_bed()
    kw = dict(vocab=5, length=4, ref_logits=good.ref_logits, rewards=good.rewards)
    with pytest.raises(ValueError, match="sorted, distinct"):
        tb.TabularBed(**kw, env_positions=(2, 1), env_logits=good.env_logits)
    with pytest.raises(ValueError, match="no position to write"):
        tb.TabularBed(**kw, env_positions=(0, 1, 2, 3), env_logits=good.env_logits)
    with pytest.raises(ValueError, match="exactly when"):
        tb.TabularBed(**kw, env_positions=(1,))
    with pytest.raises(ValueError, match="normalized"):
        tb.TabularBed(**kw, env_positions=(1,), env_logits=torch.zeros(156, 5, dtype=F64))
    nan = good.env_logits.clone()
    nan[1, 0] = math.nan
    with pytest.raises(ValueError, match="finite or -inf"):
        tb.TabularBed(**kw, env_positions=(1,), env_logits=nan)
    with pytest.raises(ValueError, match="preference pairs"):
        tb.train_dpo(good, BETA, SETTINGS)


# ---- the trainers ----------------------------------------------------------------------------
def _cut_gae(rewards, values, response_mask, gamma=1.0, gae_lambda=0.95):
    """GAE as it was before masks with holes: a masked slot hands nothing back to the slot before
    it (so a reward after a tool's reply never reaches the policy's tokens before the reply)."""
    mask = response_mask.bool()
    r = torch.where(mask, rewards.float(), 0.0)
    v = torch.where(mask, values.float(), 0.0)
    adv = torch.zeros_like(r)
    next_value = next_adv = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[-1])):
        a = r[:, t] + gamma * next_value - v[:, t] + gamma * gae_lambda * next_adv
        adv[:, t] = torch.where(mask[:, t], a, 0.0)
        next_value, next_adv = torch.where(mask[:, t], v[:, t], 0.0), adv[:, t]
    return GAEOutput(advantages=adv, returns=torch.where(mask, adv + v, 0.0))


@functools.cache
def env_run(name: str) -> tb.RunLog:
    bed = env_bed()
    runs = {
        "ppo": lambda: tb.train_ppo(bed, BETA, SETTINGS),
        "ppo-exact-shaping": lambda: tb.train_ppo(bed, BETA, SETTINGS, kl_shaping="exact"),
        "rloo": lambda: tb.train_group(bed, "rloo", BETA, SETTINGS),
        "grpo-kl-in-reward": lambda: tb.train_group(
            bed, "grpo", BETA, SETTINGS, kl_in_reward=True, kl_in_loss=False
        ),
        "grpo-k1_seq": lambda: tb.train_group(
            bed, "grpo", BETA, SETTINGS_K1_SEQ, loss_estimator="k1_seq", scale_by_std=False
        ),
        "grpo-k3+": lambda: tb.train_group(
            bed, "grpo", BETA, SETTINGS, loss_estimator="k3+", scale_by_std=False
        ),
        # the bugs: the environment's tokens counted as the policy's
        "ppo-counts-env-tokens": lambda: tb.train_ppo(bed, BETA, SETTINGS, mask_env_tokens=False),
        "rloo-counts-env-tokens": lambda: tb.train_group(bed, "rloo", BETA, SETTINGS, mask_env_tokens=False),
        "grpo-k3+-counts-env-tokens": lambda: tb.train_group(
            bed, "grpo", BETA, SETTINGS, loss_estimator="k3+", scale_by_std=False, mask_env_tokens=False
        ),
    }
    return runs[name]()


def env_rows_moved(log: tb.RunLog) -> float:
    """How far the policy's rows at the environment's positions moved from pi_ref's, nats."""
    bed = env_bed()
    rows = bed.env_rows()
    return float((log.table[rows] - torch.log_softmax(bed.ref_logits[rows], -1)).abs().max())


# The averaged table is log_softmax(mean of log_softmax rows): an unmoved row comes back within a
# few float64 ulp of its reference log-probs (magnitudes up to ~4 nats: ulp 9e-16); 1e-12 leaves
# three orders for the rounding and none for a gradient step (Adam moves a row ~lr = 0.05).
UNMOVED = 1e-12


@pytest.mark.parametrize("name", ["ppo", "ppo-exact-shaping", "rloo", "grpo-kl-in-reward", "grpo-k1_seq"])
def test_trainers_reach_the_optimum_with_environment_tokens(name):
    bed = env_bed()
    star = star_of(bed)
    log = env_run(name)
    dist = tb.kl_to(log.table, bed, star)
    est = torch.cat(log.kl_estimates[-LAST:]).to(F64)
    se = float(est.std() / math.sqrt(est.numel()))
    exact = sum(log.exact_kls[-LAST:]) / LAST
    msg = (
        f"env bed {name}: KL(pi || pi*) = {dist:.3e} (KL(pi* || pi_ref) = "
        f"{float(tb.exact_kl(star, ref_of(bed))):.4f}), logged KL {float(est.mean()):.4f} +- {se:.4f} "
        f"vs exact {exact:.4f}, the environment's rows moved {env_rows_moved(log):.1e}"
    )
    print(msg)
    assert dist < 1e-3, msg
    assert abs(float(est.mean()) - exact) < 3 * se, msg  # the logged KL counts the policy's tokens only
    assert env_rows_moved(log) < UNMOVED, msg  # no gradient ever reached them


def test_grpo_with_a_per_token_kl_reaches_its_fixed_point_with_environment_tokens():
    # the per-token surrogate charges no KL a token causes later (tests/oracle/test_testbed.py);
    # the environment's positions are chance nodes of that fixed point too
    bed = env_bed()
    fixed = tb.rollout_logprobs(bed, tb.per_token_kl_in_loss_fixed_point(bed, BETA, (G - 1) / G))
    star = star_of(bed)
    gap = float(tb.exact_kl(fixed, star))
    log = env_run("grpo-k3+")
    to_fixed, to_star = tb.kl_to(log.table, bed, fixed), tb.kl_to(log.table, bed, star)
    msg = (
        f"env bed grpo-k3+: KL(pi || per-token fixed point) = {to_fixed:.2e}, KL(pi || pi*) = "
        f"{to_star:.3e}, KL(fixed point || pi*) = {gap:.3e}"
    )
    print(msg)
    assert gap > 1e-2 and to_fixed < 5e-3 and to_star > gap / 2, msg
    assert env_rows_moved(log) < UNMOVED, msg


@pytest.mark.parametrize("name", ["ppo-counts-env-tokens", "rloo-counts-env-tokens"])
def test_counting_the_environments_tokens_lands_away_from_the_optimum(name):
    bed = env_bed()
    log = env_run(name)
    dist = tb.kl_to(log.table, bed, star_of(bed))
    msg = (
        f"env bed {name}: KL(pi || pi*) = {dist:.3e}, the environment's rows moved {env_rows_moved(log):.2f}"
    )
    print(msg)
    assert dist > 5e-3 and env_rows_moved(log) > 0.1, msg


def test_a_per_token_kl_counting_the_environments_tokens_moves_their_rows():
    # The loss's per-token KL at an environment position touches that position's rows only, so
    # the policy's own rows land where the masked run's do; the rows a masked trainer never
    # touches moved, and with them every logged KL
    log = env_run("grpo-k3+-counts-env-tokens")
    assert env_rows_moved(log) > 0.1, env_rows_moved(log)


def test_gae_cut_at_the_environments_tokens_lands_away_from_the_optimum(monkeypatch):
    import tether.trainers.steps as steps

    bed = env_bed()
    monkeypatch.setattr(steps, "gae", _cut_gae)
    log = tb.train_ppo(bed, BETA, SETTINGS)
    dist = tb.kl_to(log.table, bed, star_of(bed))
    print(f"env bed ppo, GAE cut at holes: KL(pi || pi*) = {dist:.3e}")
    assert dist > 5e-3, f"GAE cut at holes: KL(pi || pi*) = {dist:.3e}"


def test_ppo_reaches_the_optimum_with_a_random_environment():
    # a tool that answers at random: pi* averages over its reply (chance nodes), which the closed
    # form over sequences does not (0.18 nats from pi* on this bed)
    bed = tb.random_sequence_bed(seed=0, reward_scale=2.0, env_positions=(1,), env="random")
    star = star_of(bed)
    closed_gap = float(tb.exact_kl(star, tb.optimal_logprobs(ref_of(bed), bed.rewards, BETA)))
    dist = tb.kl_to(tb.train_ppo(bed, BETA, SETTINGS).table, bed, star)
    msg = f"random env bed ppo: KL(pi || pi*) = {dist:.3e}; KL(pi* || closed form) = {closed_gap:.3f}"
    print(msg)
    assert dist < 1e-3 and closed_gap > 0.1, msg
