"""A tabular test bed where the optimum of ``J = E[r] - beta * KL(pi || pi_ref)`` is known exactly.

Torch, tether's pure math modules and the trainers' pure step functions only (no transformers,
no models). Two beds share one representation, an autoregressive *table policy*:

* the one-step **bandit**: one token position, a vocabulary of A actions (``length = 1``);
* the **sequence bed**: a vocabulary of V tokens and sequences of exactly T tokens (no EOS). The
  policy is a logits table with one row per prefix ``y_<t`` (``1 + V + ... + V^(T-1)`` rows:
  ``1 + 5 + 25 = 31`` for V = 5, T = 3), the reference a table of the same shape, and the reward
  a table over all ``V^T`` whole sequences (125).

Either bed may hold **environment positions** (``TabularBed.env_positions``): there a fixed table
(``env_logits``; one-hot rows are forced tokens) writes the token, as a tool writes its reply
inside a multi-turn response; ``response_mask`` is False there, so the trainers' masks have holes,
and the optimum treats those positions as chance nodes (:func:`optimal_table`). Rollout
probabilities include the environment's factors (:func:`rollout_logprobs`); they cancel in
every KL.

Everything the continuous-model trainers only estimate is computed here by enumeration over all
sequences, in float64: the sequence-level KL(pi || pi_ref), the objective J, the optimum

    pi*(y) = pi_ref(y) exp(r(y) / beta) / Z,   Z = sum_y pi_ref(y) exp(r(y) / beta)

(Ziegler et al. 2019, arXiv 1909.08593; Rafailov et al. 2023, arXiv 2305.18290, eq. 4), and
KL(pi || pi*). pi* is itself a table policy (:func:`optimal_table`, soft values by backward
recursion), and ``J(pi*) - J(pi) = beta * KL(pi || pi*)`` exactly, so KL(pi || pi*) is the
distance that matters.

The trainers (:func:`train_on_policy` with its wrappers :func:`train_ppo` and :func:`train_group`,
and :func:`train_dpo`) sample rollouts from the table with ``torch.multinomial`` and run the
real trainers' own step functions on the tables' log-probs: the KL estimate and reward shaping
(:func:`tether.trainers.steps.kl_and_rewards`), the advantages
(:func:`tether.trainers.steps.ppo_advantages`, :func:`~tether.trainers.steps.grpo_advantages`,
:func:`~tether.trainers.steps.rloo_token_advantages`), the minibatch losses
(:func:`tether.trainers.steps.clipped_policy_loss`, :func:`~tether.trainers.steps.dpo_pair_loss`)
and the update loop itself (:func:`tether.trainers.update.minibatch_update`), in the same order as
:class:`tether.trainers.base.OnPolicyTrainer`, so a sign error or a double count in those
functions moves the policy measurably away from pi*. Adam acts on the logit tables (no gradient
clipping: ``max_grad_norm = inf``).

Where a configuration is *not* expected to reach pi*, the fixed point it should reach instead is
computed too (:func:`per_token_kl_in_loss_fixed_point`): a per-token KL surrogate in the loss
(GRPO's placement) regularizes each position's local KL but not the KL its choice causes at
later positions, so on sequences it converges to a different, computable table.

Best-of-N sampling from pi_ref is enumerated exactly as well (:func:`best_of_n_logprobs`) and its
KL compared with the formula ``log N - (N - 1) / N`` (:func:`best_of_n_kl_table`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from tether.core.advantages import (
    GROUP_STD_EPS,
    group_all_equal,
    group_normalized_advantages,
    group_std,
    rloo_advantages,
)
from tether.core.bestofn import bon_kl_bound
from tether.core.controllers import FixedKLController, KLController
from tether.core.kl import estimate_kl, exact_kl_from_logits, sequence_kl
from tether.core.leash import KLLeash
from tether.core.logprobs import logprobs_from_logits
from tether.core.losses import KLLossEstimator
from tether.core.masked import masked_sum
from tether.run.config import TRAINER_DEFAULTS
from tether.trainers.guard import GuardResult, GuardSettings, guarded_epochs
from tether.trainers.steps import (
    ClipSettings,
    Experience,
    Forwards,
    StepSettings,
    clipped_policy_loss,
    dpo_pair_loss,
    kl_reading,
    make_experience,
    updated_kl,
)
from tether.trainers.update import MicroLoss, Optimization, minibatch_update

F64 = torch.float64


# ---- the bed ------------------------------------------------------------------------------------
def num_prefixes(vocab: int, length: int) -> int:
    """Rows of a table policy: the number of prefixes ``y_<t`` for t = 0 .. T-1, ``sum_t V^t``."""
    return sum(vocab**t for t in range(length))


def prefix_offsets(vocab: int, length: int) -> list[int]:
    """First table row of each position t: ``offset_t = sum_{s < t} V^s`` (0, 1, 1 + V, ...)."""
    return [num_prefixes(vocab, t) for t in range(length)]


@dataclass(frozen=True)
class TabularBed:
    """A table policy's world: vocabulary, length, reference table and reward table.

    Attributes:
        vocab: V >= 2 tokens (actions) per position.
        length: T >= 1 tokens per sequence, fixed (every position counts: no EOS, no padding).
        ref_logits: (P, V) float64 reference logits, one row per prefix, P = ``num_prefixes``;
            row ``offset_t + code(y_<t)`` holds the logits of position t after prefix y_<t.
        rewards: (V^T,) float64 reward of each whole sequence, indexed by :func:`sequence_index`.
        env_positions: the positions an environment writes (a tool's output inside a multi-turn
            response), sorted, in [0, T), not all of them; empty for a bed without one. There the
            token is drawn from ``env_logits``, not from the policy: ``response_mask`` is False on
            it, and policy and reference score it as context only (their table rows at those
            positions are never used for sampling, and a trainer that masks correctly never
            changes the policy's).
        env_logits: (P, V) float64 log-probs of the environment's token after each prefix, read at
            the rows of ``env_positions`` only, each such row normalized (logsumexp 0); ``-inf``
            where the environment never writes a token, so a one-hot row is a *forced* token.
            None when ``env_positions`` is empty.
    """

    vocab: int
    length: int
    ref_logits: Tensor
    rewards: Tensor
    env_positions: tuple[int, ...] = ()
    env_logits: Tensor | None = None

    def __post_init__(self) -> None:
        if self.vocab < 2 or self.length < 1:
            raise ValueError(f"need vocab >= 2 and length >= 1, got {self.vocab}, {self.length}")
        P, N = num_prefixes(self.vocab, self.length), self.vocab**self.length
        if tuple(self.ref_logits.shape) != (P, self.vocab):
            raise ValueError(f"ref_logits {tuple(self.ref_logits.shape)} must be ({P}, {self.vocab})")
        if tuple(self.rewards.shape) != (N,):
            raise ValueError(f"rewards {tuple(self.rewards.shape)} must be ({N},)")
        if not (torch.isfinite(self.ref_logits).all() and torch.isfinite(self.rewards).all()):
            raise ValueError("ref_logits and rewards must be finite")
        pos = tuple(self.env_positions)
        if list(pos) != sorted(set(pos)) or any(not 0 <= t < self.length for t in pos):
            raise ValueError(f"env_positions {pos} must be sorted, distinct and in [0, {self.length})")
        if len(pos) == self.length:
            raise ValueError(f"env_positions {pos} leave the policy no position to write")
        if (self.env_logits is None) != (not pos):
            raise ValueError("env_logits is needed exactly when env_positions is not empty")
        if self.env_logits is not None:
            if tuple(self.env_logits.shape) != (P, self.vocab):
                raise ValueError(f"env_logits {tuple(self.env_logits.shape)} must be ({P}, {self.vocab})")
            rows = torch.cat([torch.arange(P)[_level_rows(self, t)] for t in pos])
            env = self.env_logits[rows].to(F64)
            if torch.isnan(env).any() or (env == math.inf).any():
                raise ValueError("env_logits must be finite or -inf (a token the environment never writes)")
            # normalized to rounding: 1e-12 nats is ~5000 ulp of float64 at 1, far above the
            # rounding of a log_softmax row and far below any real mistake
            if (env.logsumexp(-1).abs() > 1e-12).any():
                raise ValueError("env_logits rows at env_positions must be normalized log-probs")

    @property
    def num_prefixes(self) -> int:
        return num_prefixes(self.vocab, self.length)

    @property
    def policy_mask(self) -> Tensor:
        """(T,) bool, True at the positions the policy writes, False at ``env_positions``: a
        multi-turn rollout's ``response_mask``, the same for every sequence."""
        mask = torch.ones(self.length, dtype=torch.bool)
        mask[list(self.env_positions)] = False
        return mask

    def env_rows(self) -> Tensor:
        """(n,) long: the table rows of every prefix at an environment position."""
        P = self.num_prefixes
        return torch.cat(
            [torch.arange(P)[_level_rows(self, t)] for t in self.env_positions] or [torch.arange(0)]
        )


def bandit(ref_probs: list[float] | Tensor, rewards: list[float] | Tensor) -> TabularBed:
    """The one-step bandit: one position, ``pi_ref = ref_probs`` (> 0, sums to 1), reward per action.

    Example:
        ``bandit([0.4, 0.3, 0.2, 0.1], [0, 1, 2, 3])``: a (1, 4) reference table of log-probs.
    """
    p = torch.as_tensor(ref_probs, dtype=F64)
    if (p <= 0).any() or abs(float(p.sum()) - 1.0) > 1e-12:
        raise ValueError(f"ref_probs must be > 0 and sum to 1, got {p.tolist()}")
    return TabularBed(
        vocab=p.numel(), length=1, ref_logits=p.log()[None, :], rewards=torch.as_tensor(rewards, dtype=F64)
    )


def random_sequence_bed(
    seed: int = 0,
    vocab: int = 5,
    length: int = 3,
    ref_scale: float = 1.0,
    reward_scale: float = 1.0,
    *,
    env_positions: tuple[int, ...] = (),
    env: Literal["forced", "random"] = "forced",
) -> TabularBed:
    """A sequence bed with a random reference table and a random reward table (fixed seed).

    ``ref_logits ~ ref_scale * N(0, 1)`` per entry and ``rewards ~ reward_scale * U(0, 1)`` per
    sequence, drawn from ``torch.Generator(device="cpu").manual_seed(seed)`` in float64; with
    ``env_positions``, then the environment's table from the same generator (so the reference and
    the rewards are those of the bed without it): ``forced``, one token per prefix drawn uniformly
    (a one-hot row: a tool whose reply the prefix determines), or ``random``, a row of
    ``log_softmax(N(0, 1))`` (a tool that answers at random).
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    P = num_prefixes(vocab, length)
    ref = ref_scale * torch.randn(P, vocab, generator=g, dtype=F64)
    rewards = reward_scale * torch.rand(vocab**length, generator=g, dtype=F64)
    env_logits = None
    if env_positions:
        if env == "forced":
            env_logits = torch.full((P, vocab), -math.inf, dtype=F64)
            env_logits[torch.arange(P), torch.randint(vocab, (P,), generator=g)] = 0.0
        elif env == "random":
            env_logits = torch.log_softmax(torch.randn(P, vocab, generator=g, dtype=F64), -1)
        else:
            raise ValueError(f"env must be 'forced' or 'random', got {env!r}")
    return TabularBed(vocab, length, ref, rewards, tuple(env_positions), env_logits)


# ---- indexing and enumeration -------------------------------------------------------------------
def prefix_indices(tokens: Tensor, vocab: int) -> Tensor:
    """Table row of every position: ``offset_t + code(y_<t)``, code in base V (first token most significant).

    Args:
        tokens: (B, T) long in [0, V).
        vocab: V.

    Returns:
        (B, T) long row indices into a (P, V) table.
    """
    B, T = tokens.shape
    offsets = prefix_offsets(vocab, T)
    code = torch.zeros(B, dtype=torch.long, device=tokens.device)
    rows = torch.empty_like(tokens)
    for t in range(T):
        rows[:, t] = offsets[t] + code
        code = code * vocab + tokens[:, t]
    return rows


def sequence_index(tokens: Tensor, vocab: int) -> Tensor:
    """Index of each whole sequence in the reward table: its base-V code, (B, T) -> (B,) long."""
    code = torch.zeros(tokens.shape[0], dtype=torch.long, device=tokens.device)
    for t in range(tokens.shape[1]):
        code = code * vocab + tokens[:, t]
    return code


def all_sequences(vocab: int, length: int) -> Tensor:
    """Every sequence, row n = base-V digits of n: (V^T, T) long, so ``sequence_index`` is arange."""
    n = torch.arange(vocab**length)
    return torch.stack([(n // vocab ** (length - 1 - t)) % vocab for t in range(length)], dim=-1)


def token_logprobs(table: Tensor, tokens: Tensor, vocab: int) -> Tensor:
    """Per-token log pi(y_t | y_<t) of a table policy, through tether's own log-prob function.

    Gathers each position's logits row from the table and calls
    :func:`tether.core.logprobs.logprobs_from_logits` (temperature 1), the function every tether
    trainer uses for the policy, the old policy and the reference alike.

    Args:
        table: (P, V) logits (with grad for the policy).
        tokens: (B, T) long.
        vocab: V.

    Returns:
        (B, T) log-probabilities, nats, in the table's float dtype (float64 stays float64).
    """
    logits = table[prefix_indices(tokens, vocab)]  # (B, T, V)
    return logprobs_from_logits(logits, tokens)


def position_kl(table: Tensor, ref_table: Tensor, rows: Tensor) -> Tensor:
    """Exact KL(pi(.|s_t) || pi_ref(.|s_t)) at each sampled position, nats, no grad.

    Args:
        table: (P, V) policy logits.
        ref_table: (P, V) reference logits.
        rows: (B, T) long table row of each position (:func:`prefix_indices`).

    Returns:
        (B, T) float64 per-position KL, nats.
    """
    # the trainers' own exact KL, on the rows' logits (float64 in, float64 out)
    return exact_kl_from_logits(table.detach().to(F64)[rows], ref_table.to(F64)[rows])


def sequence_logprobs(table: Tensor, vocab: int, length: int) -> Tensor:
    """log pi(y) = sum_t log pi(y_t | y_<t) of every sequence: (V^T,), nats, in ``all_sequences`` order."""
    return token_logprobs(table, all_sequences(vocab, length).to(table.device), vocab).sum(-1)


def rollout_logprobs(bed: TabularBed, table: Tensor) -> Tensor:
    """log P(y) of every whole rollout when ``table`` writes the policy's positions and the bed's
    environment the others: ``sum_{t policy} log pi(y_t | y_<t) + sum_{t env} log env(y_t | y_<t)``.

    (V^T,) float64 nats in ``all_sequences`` order; ``-inf`` for a sequence a forced environment
    never writes. Without an environment it is :func:`sequence_logprobs`. The environment's
    factors are the same for every policy, so they cancel in KL(pi || pi_ref) and in
    KL(pi || pi*): only the policy's positions carry KL, as in a multi-turn rollout.
    """
    seqs = all_sequences(bed.vocab, bed.length).to(table.device)
    logp = token_logprobs(table.to(F64), seqs, bed.vocab)  # (V^T, T)
    if bed.env_logits is not None:
        rows = prefix_indices(seqs, bed.vocab)
        env = bed.env_logits.to(F64)[rows].gather(-1, seqs[..., None])[..., 0]  # (V^T, T)
        logp = torch.where(bed.policy_mask.to(table.device), logp, env)
    return logp.sum(-1)


def exact_kl(logp: Tensor, logq: Tensor) -> Tensor:
    """KL(p || q) = sum_y p(y) (log p(y) - log q(y)) over an enumerated support, nats (scalar).

    Terms with p(y) = 0 are 0 (the ``xlogy`` convention), so a -inf in ``logq`` where p is 0
    never gives NaN.

    Args:
        logp: (N,) log p over all N outcomes (normalized).
        logq: (N,) log q over the same outcomes.
    """
    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum()


def objective(logp: Tensor, ref_logp: Tensor, rewards: Tensor, beta: float) -> Tensor:
    """Exact ``J(pi) = E_pi[r] - beta * KL(pi || pi_ref)`` (reward units) by enumeration.

    Args:
        logp: (N,) log pi over all sequences; ref_logp: (N,) log pi_ref; rewards: (N,).
        beta: KL coefficient >= 0, reward units per nat.
    """
    return (logp.exp() * rewards).sum() - beta * exact_kl(logp, ref_logp)


def optimal_logprobs(ref_logp: Tensor, rewards: Tensor, beta: float) -> Tensor:
    """log pi*(y) = log pi_ref(y) + r(y) / beta - log Z, the maximizer of J (all sequences).

    Source: the Gibbs variational principle; Rafailov et al. 2023, arXiv 2305.18290, eq. 4.
    ``log Z = logsumexp(log pi_ref + r / beta)`` and ``J(pi*) = beta * log Z``.

    Args:
        ref_logp: (N,) log pi_ref of every sequence. rewards: (N,). beta: > 0.

    Returns:
        (N,) normalized log-probabilities, nats.
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0 for the optimum to exist, got {beta}")
    return torch.log_softmax(ref_logp + rewards / beta, dim=-1)


def _level_rows(bed: TabularBed, t: int) -> slice:
    off = prefix_offsets(bed.vocab, bed.length)[t]
    return slice(off, off + bed.vocab**t)


def optimal_table(bed: TabularBed, beta: float) -> Tensor:
    """pi* as a table policy: ``pi*(a | p) = pi_ref(a | p) exp(W(p a) - W(p))`` (soft values).

    Backward recursion over positions: ``W(y) = r(y) / beta`` for whole sequences and
    ``W(p) = log sum_a pi_ref(a | p) exp(W(p a))`` for a prefix p, so the logits row of p is
    ``log pi_ref(. | p) + W(p .)``. The product over positions telescopes to
    ``pi_ref(y) exp(r(y) / beta) / exp(W(empty))`` = pi*(y) with Z = exp(W(empty)): the optimum
    over whole sequences is exactly a table policy (tested against :func:`optimal_logprobs`).

    With an environment (``bed.env_positions``) the prefixes before an environment token are
    chance nodes: ``W(p) = sum_e env(e | p) W(p e)``, an expectation, since the policy cannot
    choose e (the soft Bellman equation of an MDP with stochastic transitions; Levine 2018,
    arXiv 1805.00909, sec. 2.3-2.4, with the variational posterior's dynamics held to the true
    ones); the policy's rows there stay pi_ref's (a masked trainer never moves them). For a
    forced environment the expectation is the one token, so pi* is again ``pi_ref(y) exp(r(y) /
    beta) / Z`` over the sequences it can write; for a random one it is not (tested).

    Returns:
        (P, V) float64 logits (rows are normalized log-probs).
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    V = bed.vocab
    table = torch.empty_like(bed.ref_logits, dtype=F64)
    W = bed.rewards.to(F64) / beta  # (V^T,) soft value of each whole sequence, indexed by code
    for t in reversed(range(bed.length)):
        rows = _level_rows(bed, t)
        ref = torch.log_softmax(bed.ref_logits[rows].to(F64), -1)  # (V^t, V)
        if t in bed.env_positions:
            table[rows] = ref
            W = _chance_mean(bed, rows, W.view(V**t, V))
            continue
        logits = ref + W.view(V**t, V)  # (V^t, V)
        table[rows] = torch.log_softmax(logits, -1)
        W = logits.logsumexp(-1)  # (V^t,) soft value of each prefix of length t
    return table


def _chance_mean(bed: TabularBed, rows: slice, values: Tensor) -> Tensor:
    """``sum_e env(e | p) values[p, e]`` at each prefix p of ``rows``: (V^t, V) -> (V^t,).

    A token the environment never writes (probability 0) contributes 0, whatever its value.
    """
    assert bed.env_logits is not None
    probs = bed.env_logits[rows].to(F64).exp()
    return torch.where(probs > 0, probs * values, torch.zeros_like(values)).sum(-1)


def per_token_kl_in_loss_fixed_point(
    bed: TabularBed,
    beta: float,
    reward_scale: float = 1.0,
    divergence: str = "reverse_kl",
    alpha: float = 0.5,
) -> Tensor:
    """Fixed point of a policy gradient on the score with a per-token divergence in the loss.

    This is GRPO's placement on a table policy: advantages from the (scaled, baselined) sequence
    score ``c * r(y)``, plus ``beta * sum_t D_t`` where each per-token term (k2, k3+, k3_is for the
    reverse KL; the exact ``D(pi(. | p), pi_ref(. | p))`` for ``divergence``) has on-policy expected
    gradient ``grad D(pi(. | p), pi_ref(. | p))`` *at the sampled prefix p, with the prefix
    distribution held fixed*. The expected update at prefix p is then zero iff ``pi(. | p)``
    maximizes ``sum_a pi(a) c Q(p a) - beta D(pi, pi_ref(. | p))`` over the simplex
    (:func:`best_response`), ``Q(p a) = E_pi[r | p a]`` the plain expected score (no future
    divergence), which is solved by backward recursion. For the reverse KL that is
    ``pi(a | p) propto pi_ref(a | p) exp(c Q(p a) / beta)``, which differs from
    :func:`optimal_table` for T > 1: the true gradient of the sequence KL also charges a token for
    the KL it causes at later positions (``E[grad log pi(y_s) sum_{t > s} kl_t]``), which the
    per-token surrogate omits. For T = 1 and the reverse KL it is ``optimal_table(bed, beta / c)``.
    An environment's positions are chance nodes, as in :func:`optimal_table` (Q is averaged over
    its token).

    Args:
        bed: the bed.
        beta: the coefficient in the loss, > 0.
        reward_scale: c > 0, the factor the advantages apply to the score (1 for an unbiased
            baseline; (G - 1) / G for GRPO's mean-centered advantages without std scaling).
        divergence: one of :data:`tether.core.divergences.LEASH_DIVERGENCES`; alpha: its order
            for ``"alpha"``.

    Returns:
        (P, V) float64 logits (normalized log-probs per row).
    """
    if not (beta > 0 and reward_scale > 0):
        raise ValueError(f"beta and reward_scale must be > 0, got {beta}, {reward_scale}")
    V = bed.vocab
    table = torch.empty_like(bed.ref_logits, dtype=F64)
    Q = bed.rewards.to(F64)  # (V^T,) expected score after each whole sequence
    for t in reversed(range(bed.length)):
        rows = _level_rows(bed, t)
        if t in bed.env_positions:  # a chance node: the expected score over the environment's token
            table[rows] = torch.log_softmax(bed.ref_logits[rows].to(F64), -1)
            Q = _chance_mean(bed, rows, Q.view(V**t, V))
            continue
        lq = torch.log_softmax(bed.ref_logits[rows].to(F64), -1)
        logp = best_response(lq, reward_scale * Q.view(V**t, V), beta, divergence, alpha)  # (V^t, V)
        table[rows] = logp
        Q = (logp.exp() * Q.view(V**t, V)).sum(-1)  # (V^t,) E_pi[r | prefix]
    return table


def best_response(
    lq: Tensor, u: Tensor, beta: float, divergence: str = "reverse_kl", alpha: float = 0.5
) -> Tensor:
    """Per row, the log-probs of ``argmax_pi sum_a pi_a u_a - beta D(pi, q)`` over the simplex,
    float64: the stationary point of a policy gradient with values ``u`` and the divergence ``D``
    of ``q = exp(lq)`` in the loss (every ``q_a > 0``; the maximizer is interior for each
    divergence here). Setting the softmax gradient ``pi_a (u_a - beta g_a - sum_b pi_b (u_b -
    beta g_b)) = 0`` with ``g = dD / dpi`` (docs/kl.md, "The leash's divergence"):

    * reverse KL: ``g_a = log(pi_a / q_a) + 1``, so ``pi propto q exp(u / beta)``;
    * forward KL ``KL(q || pi)``: ``g_a = -q_a / pi_a``, so ``pi_a = beta q_a / (lam - u_a)``;
    * JS: ``g_a = log(2 pi_a / (pi_a + q_a)) / 2``, so ``pi_a = e_a q_a / (2 - e_a)`` with
      ``e_a = exp(2 (u_a - lam) / beta)``;
    * Amari alpha: ``g_a = -(q_a / pi_a)^(1 - a) / (1 - a)``, so ``pi_a = q_a (beta / ((1 - a)
      (lam - u_a)))^(1 / (1 - a))``;

    with ``lam`` the one value (per row) where ``sum_a pi_a = 1``: ``sum pi`` falls strictly as
    ``lam`` rises, from infinity at the lower end of the bracket (``max u``; for JS ``max u - beta
    ln(2) / 2``) to at most 1 at its upper end (``max u + beta``, ``max u`` and ``max u + beta / (1 -
    a)``), so 200 bisections pin it to float64 (the last rounding is normalized away).

    Args:
        lq: (N, V) the reference's log-probs. u: (N, V) the values. beta: > 0.
        divergence: one of :data:`tether.core.divergences.LEASH_DIVERGENCES`. alpha: in (0, 1).

    Returns:
        (N, V) float64 log-probs.
    """
    lq, u = lq.to(F64), u.to(F64)
    if divergence == "reverse_kl":
        return torch.log_softmax(lq + u / beta, -1)
    top = u.max(-1, keepdim=True).values
    q = lq.exp()

    def probs(lam: Tensor) -> Tensor:
        if divergence == "forward_kl":
            return beta * q / (lam - u)
        if divergence == "alpha":
            return q * (beta / ((1 - alpha) * (lam - u))) ** (1 / (1 - alpha))
        e = torch.exp(2 * (u - lam) / beta)  # js
        return e * q / (2 - e)

    if divergence == "forward_kl":
        lo, hi = top, top + beta
    elif divergence == "alpha":
        lo, hi = top, top + beta / (1 - alpha)
    elif divergence == "js":
        lo, hi = top - beta * math.log(2) / 2, top.clone()
    else:
        raise ValueError(f"unknown divergence {divergence!r}")
    for _ in range(200):
        mid = (lo + hi) / 2
        over = probs(mid).sum(-1, keepdim=True) > 1
        lo, hi = torch.where(over, mid, lo), torch.where(over, hi, mid)
    pi = probs(hi)  # the end with sum <= 1 (finite)
    return torch.log(pi / pi.sum(-1, keepdim=True))


def sample(
    table: Tensor,
    vocab: int,
    length: int,
    n: int,
    generator: torch.Generator,
    *,
    env_positions: tuple[int, ...] = (),
    env_logits: Tensor | None = None,
) -> Tensor:
    """Draw n sequences from a table policy, position by position, with ``torch.multinomial``.

    Args:
        table: (P, V) logits (no grad needed). vocab, length: V and T. n: number of sequences.
        generator: the seeded generator every draw uses (reproducible).
        env_positions, env_logits: a bed's environment (:class:`TabularBed`): at those positions
            the token is drawn from ``env_logits`` instead of the policy.

    Returns:
        (n, T) long tokens.
    """
    offsets = prefix_offsets(vocab, length)
    probs_table = torch.softmax(table.detach().to(F64), -1)  # (P, V)
    env_probs = torch.softmax(env_logits.to(F64), -1) if env_logits is not None else None
    tokens = torch.empty(n, length, dtype=torch.long)
    code = torch.zeros(n, dtype=torch.long)
    for t in range(length):
        source = env_probs if t in env_positions else probs_table
        probs = source[offsets[t] + code]  # (n, V)
        tokens[:, t] = torch.multinomial(probs, 1, replacement=True, generator=generator)[:, 0]
        code = code * vocab + tokens[:, t]
    return tokens


# ---- best-of-N ----------------------------------------------------------------------------------
def best_of_n_logprobs(ref_logp: Tensor, rewards: Tensor, n: int) -> Tensor:
    """Exact distribution of best-of-n sampling from pi_ref: n i.i.d. draws, keep the best.

    "Best" is a strict total order: higher reward wins, and among equal rewards the lower index
    wins (a fixed, consistent tie-break). With outcomes ranked by that order,
    ``F(y) = pi_ref(outcomes ranked <= y)`` and ``F_<(y) = F(y) - pi_ref(y)``, the kept outcome
    is y exactly when all n draws rank <= y and not all rank < y:
    ``p_n(y) = F(y)^n - F_<(y)^n``.

    Args:
        ref_logp: (N,) log pi_ref over all outcomes (sequences), normalized.
        rewards: (N,) reward of each outcome.
        n: number of draws, >= 1.

    Returns:
        (N,) float64 log p_n (an outcome with pi_ref > 0 always has p_n > 0).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    N = ref_logp.numel()
    r = rewards.to(F64)
    # ascending rank: lower reward first; among equal rewards the higher index first, so the
    # lower index ranks higher (wins). Two stable sorts give the lexicographic order.
    by_index_desc = torch.arange(N - 1, -1, -1)
    order = by_index_desc[torch.sort(r[by_index_desc], stable=True).indices]  # (N,) worst .. best
    p_sorted = ref_logp.to(F64).exp()[order]
    # Clamps (rounding only, both at most a few ulp): the cumulative sum can end a hair above 1,
    # and F - p of the worst-ranked outcome a hair below 0.
    F = torch.cumsum(p_sorted, 0).clamp(max=1.0)
    F_lt = (F - p_sorted).clamp(min=0.0)
    p_n = torch.empty(N, dtype=F64)
    p_n[order] = F.pow(n) - F_lt.pow(n)
    return p_n.log()


class BestOfNRow(NamedTuple):
    n: int
    kl: float
    """exact KL(best-of-n || pi_ref), nats."""
    bound: float
    """log n - (n - 1) / n, nats."""


def best_of_n_kl_table(
    ref_logp: Tensor, rewards: Tensor, ns: range | list[int] = range(1, 17)
) -> list[BestOfNRow]:
    """Exact KL of best-of-n to pi_ref next to the bound, one row per n.

    Args:
        ref_logp: (N,) log pi_ref over all outcomes. rewards: (N,). ns: the n to tabulate.
    """
    ref = ref_logp.to(F64)
    return [
        BestOfNRow(n, float(exact_kl(best_of_n_logprobs(ref, rewards, n), ref)), bon_kl_bound(n)) for n in ns
    ]


# ---- trainers -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainSettings:
    """Hyperparameters of a test-bed run.

    Attributes:
        steps: rollout batches (DPO: batches of fresh pairs).
        batch_size: sequences per rollout batch B (DPO: pairs per batch).
        group_size: GRPO/RLOO G, consecutive rows of one (the only) prompt; must divide B.
        epochs: passes over each batch; minibatches: gradient steps per pass (must divide B).
        lr: Adam learning rate on the policy table at step 0; it follows a cosine down to
            ``lr * lr_final_fraction`` at the last step, so the sampling noise of the last
            updates is small.
        value_lr: Adam learning rate of PPO's value table (same schedule).
        average_from: fraction of the run after which the policy's per-row log-probs are
            averaged (Polyak-Ruppert averaging); the returned table is that average.
        clip_eps, clip_eps_value: PPO ratio and value clip ranges.
        vf_coef: weight of PPO's value loss.
        gamma, gae_lambda: GAE parameters (PPO).
        seed: seeds the sampling generator, the minibatch permutations and the DPO labels.
    """

    steps: int = 100
    batch_size: int = 1024
    group_size: int = 64
    epochs: int = 2
    minibatches: int = 2
    lr: float = 0.05
    lr_final_fraction: float = 0.02
    value_lr: float = 0.1
    average_from: float = 0.5
    clip_eps: float = 0.2
    clip_eps_value: float = 0.2
    vf_coef: float = 0.5
    gamma: float = 1.0
    gae_lambda: float = 0.95
    seed: int = 0

    def lr_at(self, step: int, base: float) -> float:
        """Cosine from ``base`` at step 0 to ``base * lr_final_fraction`` at the last step."""
        frac = step / max(1, self.steps - 1)
        lo = base * self.lr_final_fraction
        return lo + (base - lo) * 0.5 * (1.0 + math.cos(math.pi * frac))


@dataclass
class RunLog:
    """What a test-bed run returns.

    Attributes:
        table: (P, V) float64 final policy logits, the average of the per-row log-probs over the
            averaging window (see :class:`TrainSettings`).
        kl_estimates: per batch, the (B,) per-sequence sampled KL estimate that was logged (and,
            when the KL is in the reward, shaped into it and fed to the controller), nats per
            sequence. DPO: on policy samples drawn after each update (a probe, as in tether).
        exact_kls: per batch, the exact KL(pi_sample || pi_ref) of the policy those sequences were
            sampled from, nats per sequence.
        kl_coefs: beta used at each batch.
        counts: the leash's counts (how many times the KL entered reward and loss).
        step_logprobs: (PPO, GRPO, RLOO) the (P, V) per-row log-probs of the policy before each
            gradient step, ``epochs x minibatches`` per batch in order: the first of each batch
            is the policy that sampled it (pi_old), the others how far the update had moved
            from it when each minibatch was taken.
        guard: per batch, the update guard's account (:class:`tether.trainers.guard.GuardResult`),
            when the run was guarded.
    """

    table: Tensor
    kl_estimates: list[Tensor] = field(default_factory=list)
    exact_kls: list[float] = field(default_factory=list)
    kl_coefs: list[float] = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    step_logprobs: list[Tensor] = field(default_factory=list)
    guard: list[GuardResult] = field(default_factory=list)


class _Averager:
    """Running mean of per-row log-probs of the policy table (Polyak-Ruppert averaging)."""

    def __init__(self) -> None:
        self.total: Tensor | None = None
        self.count = 0

    def add(self, table: Tensor) -> None:
        logp = torch.log_softmax(table.detach().to(F64), -1)
        self.total = logp if self.total is None else self.total + logp
        self.count += 1

    def mean(self) -> Tensor:
        assert self.total is not None
        return torch.log_softmax(self.total / self.count, -1)


def kl_to(table: Tensor, bed: TabularBed, target_logp: Tensor) -> float:
    """KL(pi_table || target) over whole rollouts (the bed's environment writing its positions,
    :func:`rollout_logprobs`), nats; ``target_logp`` is (V^T,) log-probs."""
    return float(exact_kl(rollout_logprobs(bed, table.detach().to(F64)), target_logp))


def _check_settings(s: TrainSettings, group: bool) -> None:
    if s.batch_size % s.minibatches:
        raise ValueError(f"minibatches={s.minibatches} must divide batch_size={s.batch_size}")
    if group and s.batch_size % s.group_size:
        raise ValueError(f"group_size={s.group_size} must divide batch_size={s.batch_size}")


Algo = Literal["ppo", "grpo", "rloo"]


class TableSamples(NamedTuple):
    """The sampled sequences of a test-bed batch, the ``rollout`` of its :class:`Experience`."""

    tokens: Tensor
    """(B, T) long."""
    rows: Tensor
    """(B, T) long table row of each position (:func:`prefix_indices`)."""
    response_mask: Tensor
    """(B, T) bool: True at the policy's positions, False at the environment's (a fixed pattern:
    no EOS, no padding)."""

    def select(self, idx: Tensor) -> TableSamples:
        """Rows ``idx`` ((n,) long)."""
        return TableSamples(self.tokens[idx], self.rows[idx], self.response_mask[idx])


def table_policy_loss(
    mb: Experience,
    first_micro: bool = True,
    *,
    table: Tensor,
    value_table: Tensor | None,
    clip: ClipSettings,
    leash: KLLeash,
    kl_coef: float,
    record: list[Tensor] | None = None,
    ref_table: Tensor | None = None,
) -> MicroLoss:
    """The on-policy trainers' ``minibatch_loss`` hook on a table policy.

    The current log-probs of ``mb``'s tokens (:func:`token_logprobs`, with grad) and, for PPO, the
    value table's entries at its prefixes go to :func:`tether.trainers.steps.clipped_policy_loss`,
    the function :class:`tether.trainers.ppo.PPOTrainer` and the group trainers call.

    Args:
        mb: the micro-batch's rows of the batch's :class:`Experience` (rollout: :class:`TableSamples`).
        first_micro: first micro-batch of the gradient step (the leash counts its loss term once).
        table: (P, V) policy logits, with grad. value_table: (P,) values with grad (PPO) or None.
        clip: PPO's clip ranges and value weight (:class:`tether.trainers.steps.ClipSettings`).
        leash: the KL placement. kl_coef: beta of the step.
        record: a list the policy's per-row log-probs are appended to before each gradient step
            (at its first micro-batch), or None.
        ref_table: (P, V) the reference's logits, for a leash holding another divergence than
            the reverse KL (``leash.divergence``): the table rows of the sampled prefixes go to it.

    Returns:
        :class:`tether.trainers.update.MicroLoss`.
    """
    if record is not None and first_micro:
        record.append(torch.log_softmax(table.detach().to(F64), -1))
    samples = mb.rollout
    return clipped_policy_loss(
        mb,
        token_logprobs(table, samples.tokens, table.shape[-1]),  # (P, V): V
        clip=clip,
        leash=leash,
        kl_coef=kl_coef,
        first_micro=first_micro,
        values=value_table[samples.rows] if value_table is not None else None,
        **(
            {"logits": table[samples.rows], "ref_logits": ref_table.to(table.dtype)[samples.rows]}
            if leash.divergence != "reverse_kl" and ref_table is not None
            else {}
        ),
    )


def epoch_minibatches(n: int, settings: TrainSettings, generator: torch.Generator) -> Iterator[Tensor]:
    """``settings.epochs`` passes of ``settings.minibatches`` random minibatches of rows ``[0, n)``,
    each pass's permutation drawn from ``generator`` when it starts."""
    for _ in range(settings.epochs):
        yield from torch.randperm(n, generator=generator).split(n // settings.minibatches)


def train_on_policy(
    bed: TabularBed,
    algo: Algo,
    controller: KLController,
    settings: TrainSettings = TrainSettings(),
    kl_in_reward: bool = True,
    *,
    kl_in_loss: bool = False,
    loss_estimator: KLLossEstimator = "k3_is",
    kl_shaping: Literal["sampled", "exact"] = "sampled",
    mask_env_tokens: bool = True,
    guard: GuardSettings | None | Literal["auto"] = "auto",
    divergence: str = "reverse_kl",
    alpha: float = 0.5,
    sampler_shift: Tensor | None = None,
    **step: Any,
) -> RunLog:
    """PPO, GRPO or RLOO on the bed, step for step as :class:`tether.trainers.base.OnPolicyTrainer`.

    Each batch: sample B sequences from the current table (one prompt, so consecutive rows form
    the groups); old and reference log-probs (B, T) via :func:`token_logprobs` and the exact
    per-position KL (:func:`position_kl`); then the trainers' own calls, with the trainers'
    default settings unless an argument says otherwise
    (:class:`tether.trainers.steps.StepSettings`): steps 5-6 by
    :func:`tether.trainers.steps.make_experience` (the KL estimate, the leashed rewards, the
    advantages: PPO's GAE on a value table per prefix, whitened, its rewards divided by the
    returns' spread; GRPO's and RLOO's of the summed sequence reward, broadcast to every token);
    ``epochs x minibatches`` Adam steps through :func:`tether.trainers.update.minibatch_update`
    with :func:`table_policy_loss` (the trainers' :func:`tether.trainers.steps.clipped_policy_loss`);
    then ``controller.update`` with :func:`tether.trainers.steps.controller_input` (the exact KL
    per sequence, by default). No placement check is made here: biased configurations are the
    point of some runs (tether's :func:`tether.core.placement.check_placement` refuses them in
    real runs).

    Args:
        bed: the test bed. algo: "ppo", "grpo" or "rloo".
        controller: holds beta (e.g. :class:`FixedKLController`); updated once per batch.
        settings: see :class:`TrainSettings`.
        kl_in_reward, kl_in_loss, loss_estimator: the placement, as :class:`KLLeash`.
        kl_shaping: PPO's reward form (``ppo.kl_shaping``): ``exact`` shapes with the exact
            per-position KL of the table (:func:`position_kl`) and adds each token's own
            correction to its advantage (:func:`tether.core.shaping.shape_rewards_exact`).
        divergence, alpha: what a loss-placed leash holds (``kl.divergence``, ``kl.alpha``): the
            reverse KL through ``loss_estimator``, or another divergence exactly over the
            vocabulary at each sampled prefix (:func:`tether.core.divergences.leash_divergence`;
            its fixed point: :func:`per_token_kl_in_loss_fixed_point`).
        mask_env_tokens: False reproduces the bug the mask prevents: the environment's tokens
            counted as the policy's (``response_mask`` all True: in the KL, the losses, the values
            and the advantages), to show that the bed catches it. True (the trainers' way):
            ``response_mask`` is False at ``bed.env_positions``.
        sampler_shift: (P, V) logits added to the policy's table for sampling only: a sampler
            that is not the learner (``rollout.dtype=bf16``: the sampler's rounding; any larger
            perturbation). The batch is drawn from ``softmax(table + sampler_shift)``, its
            log-probs there become ``Forwards.sampler_logprobs`` and the step's correction
            (``correction``, ``correction_cap`` in ``**step``) weighs the losses, as in a run;
            the learner's log-probs stay the table's. None: the learner samples.
        **step: fields of :class:`tether.trainers.steps.StepSettings` other than ``algo``,
            ``group_size``, ``gamma`` and ``gae_lambda`` (which ``algo`` and ``settings`` give):
            ``estimator`` (logged, shaped and controlled on; default k1), ``scale_by_std``
            (GRPO; False: Dr. GRPO), ``scale_kl_by_std`` (GRPO), ``scale_returns`` (PPO),
            ``whiten`` (PPO), ``controller_signal`` and ``target_unit``. Unset, each is the
            trainers' default, a default run's (tested).

    Returns:
        :class:`RunLog`.
    """
    s, spec = settings, TRAINER_DEFAULTS[algo]
    grouped = spec.min_group_size > 1  # GRPO's and RLOO's groups; PPO's samples stand alone
    _check_settings(s, group=grouped)
    step_settings = StepSettings(
        algo=algo,
        group_size=s.group_size if grouped else 1,
        gamma=s.gamma,
        gae_lambda=s.gae_lambda,
        **step,
    )
    if kl_shaping == "exact" and not spec.per_token_advantages:
        raise ValueError(f"kl_shaping='exact' needs per-token advantages (algo='ppo'), got algo={algo!r}")
    V, T, B = bed.vocab, bed.length, s.batch_size
    gen = torch.Generator(device="cpu").manual_seed(s.seed)
    table = bed.ref_logits.clone().to(F64).requires_grad_(True)  # start at pi = pi_ref
    params = [{"params": [table], "lr": s.lr}]
    values = None
    if spec.value_head:
        values = torch.zeros(bed.num_prefixes, dtype=F64, requires_grad=True)  # V(prefix)
        params.append({"params": [values], "lr": s.value_lr})
    opt = torch.optim.Adam(params)
    guarding = (
        (GuardSettings(limit=controller.held_kl()) if controller.guarded else None)
        if guard == "auto"
        else guard
    )
    leash = KLLeash(kl_in_reward, kl_in_loss, loss_estimator, kl_shaping, divergence=divergence, alpha=alpha)
    clip = ClipSettings(clip_eps=s.clip_eps, clip_eps_value=s.clip_eps_value, vf_coef=s.vf_coef)
    optimization = Optimization(
        optimizer=opt,
        params=[table] if values is None else [table, values],
        max_grad_norm=math.inf,
        name=algo,
    )
    ref_seq_logp = rollout_logprobs(bed, bed.ref_logits)
    avg = _Averager()
    log = RunLog(table=table)
    # fixed length: every token the policy writes counts, none the environment writes
    counts = bed.policy_mask if mask_env_tokens else torch.ones(T, dtype=torch.bool)
    mask = counts.expand(B, T).clone()
    for step in range(s.steps):
        for group, base in zip(opt.param_groups, (s.lr, s.value_lr)):
            group["lr"] = s.lr_at(step, base)
        # 1-3. sample from the current policy (the environment writing its positions) and score
        #      whole sequences
        drawn_from = table.detach() if sampler_shift is None else table.detach() + sampler_shift
        tokens = sample(drawn_from, V, T, B, gen, env_positions=bed.env_positions, env_logits=bed.env_logits)
        scores = bed.rewards[sequence_index(tokens, V)]  # (B,)
        rows = prefix_indices(tokens, V)  # (B, T)
        # 4. old and reference log-probs (and values), no grad
        with torch.no_grad():
            old_logprobs = token_logprobs(table, tokens, V)  # (B, T)
            ref_logprobs = token_logprobs(bed.ref_logits.to(F64), tokens, V)
            old_values = values[rows] if values is not None else None
            sampler_logprobs = token_logprobs(drawn_from, tokens, V) if sampler_shift is not None else None
            log.exact_kls.append(float(exact_kl(rollout_logprobs(bed, table), ref_seq_logp)))
        # 5-6. the KL the batch was drawn at, as a run's controller reads it, and beta from it
        exact_now = position_kl(table, bed.ref_logits, rows)
        reading = kl_reading(
            kl=estimate_kl(old_logprobs, ref_logprobs, step_settings.estimator),
            exact_kl=exact_now,
            mask=mask,
            settings=step_settings,
        )
        controller.update(reading, n_steps=B)
        # 7-8. per-token KL, leashed rewards and advantages: the trainers' own call, with the run's
        #      settings; ``estimate_kl`` is this module's name for the estimator, so a test can
        #      flip its sign
        kl_coef = controller.kl_coef
        exp = make_experience(
            rollout=TableSamples(tokens, rows, mask),
            scores=scores,
            forwards=Forwards(
                old_logprobs=old_logprobs,
                ref_logprobs=ref_logprobs,
                values=old_values,
                exact_kl=exact_now,
                sampler_logprobs=sampler_logprobs,
            ),
            kl_coef=kl_coef,
            leash=leash,
            settings=step_settings,
            estimate=estimate_kl,
        )
        kl = exp.kl  # (B, T)
        # 9-10. epochs of minibatch updates, each guarded as a run's (kl.guard)
        run_minibatches = partial(
            minibatch_update,
            exp,
            minibatch_loss=partial(
                table_policy_loss,
                table=table,
                value_table=values,
                clip=clip,
                leash=leash,
                kl_coef=kl_coef,
                record=log.step_logprobs,
                ref_table=bed.ref_logits,
            ),
            optimization=optimization,
        )
        if guarding is None:
            run_minibatches(epoch_minibatches(B, s, gen))
        else:
            epochs = (
                list(torch.randperm(B, generator=gen).split(B // s.minibatches)) for _ in range(s.epochs)
            )
            measure = partial(
                _table_updated_kl,
                table=table,
                bed=bed,
                exp=exp,
                target_unit=step_settings.target_unit,
            )
            _, result = guarded_epochs(
                epochs,
                update=run_minibatches,
                tensors=[table] if values is None else [table, values],
                measure=measure,
                kl_before=measure()[0],  # its own measure of the policy that drew the batch
                settings=guarding,
            )
            log.guard.append(result)
            if result.fraction < 1.0:  # the update wanted more KL than the budget: the dual learns it
                controller.cut(result.kl_updated, n_steps=B)
        # 11. log
        log.kl_estimates.append(sequence_kl(kl, mask).detach())
        log.kl_coefs.append(kl_coef)
        if step >= s.average_from * s.steps:
            avg.add(table)
    log.table = avg.mean()
    log.counts = dict(leash.counts)
    return log


def _table_updated_kl(
    *, table: Tensor, bed: TabularBed, exp: Experience, target_unit: str
) -> tuple[float, float]:
    """The update guard's measure on the bed: the table policy's exact KL at the prefixes of the
    batch its pi_old drew (:func:`tether.trainers.steps.updated_kl`), from its exact per-position
    KL (:func:`position_kl`)."""
    samples = exp.rollout
    with torch.no_grad():
        return updated_kl(
            exact_kl=position_kl(table, bed.ref_logits, samples.rows),
            mask=samples.response_mask,
            target_unit=target_unit,
        )


def train_ppo(bed: TabularBed, beta: float, settings: TrainSettings = TrainSettings(), **kw) -> RunLog:
    """PPO with k1 in the reward and a fixed beta (keywords as :func:`train_on_policy`)."""
    return train_on_policy(bed, "ppo", FixedKLController(beta), settings, **kw)


def train_group(
    bed: TabularBed,
    algo: Literal["grpo", "rloo"],
    beta: float,
    settings: TrainSettings = TrainSettings(),
    **kw,
) -> RunLog:
    """GRPO (default placement: KL in the loss) or RLOO (default: k1 in the reward), fixed beta.

    Keywords override the placement, as :func:`train_on_policy`.
    """
    placement = TRAINER_DEFAULTS[algo].placement  # the trainer's default, as tether train's
    defaults = dict(kl_in_reward=placement == "reward", kl_in_loss=placement == "loss")
    return train_on_policy(bed, algo, FixedKLController(beta), settings, **{**defaults, **kw})


def bradley_terry_pairs(bed: TabularBed, n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """n preference pairs: two sequences from pi_ref, the first preferred w.p. sigmoid(r_a - r_b).

    The Bradley-Terry model of the reward table (Bradley & Terry 1952; Rafailov et al. 2023,
    eq. 1), whose DPO optimum is pi* (Rafailov et al. 2023, eq. 4-5).

    Returns:
        ``(chosen, rejected)``, each (n, T) long.
    """
    V, T = bed.vocab, bed.length
    a = sample(bed.ref_logits, V, T, n, generator)
    b = sample(bed.ref_logits, V, T, n, generator)
    p_a = torch.sigmoid(bed.rewards[sequence_index(a, V)] - bed.rewards[sequence_index(b, V)])  # (n,)
    a_wins = (torch.rand(n, generator=generator, dtype=F64) < p_a)[:, None]
    return torch.where(a_wins, a, b), torch.where(a_wins, b, a)


class TablePairs(NamedTuple):
    """A test-bed batch of preference pairs, the record DPO's update selects micro-batches from."""

    chosen: Tensor
    """(n, T) long."""
    rejected: Tensor
    """(n, T) long."""
    ref_chosen: Tensor
    """(n,) reference sequence log-probs of ``chosen``, nats."""
    ref_rejected: Tensor
    """(n,) the same of ``rejected``."""
    mask: Tensor
    """(n, T) bool, all True (fixed length)."""

    share_by = "rows"
    """The DPO loss is a mean over pairs (:func:`tether.trainers.update.micro_shares`)."""

    @property
    def num_rows(self) -> int:
        """The number of pairs n."""
        return self.chosen.shape[0]

    def select(self, idx: Tensor) -> TablePairs:
        """Pairs ``idx`` ((m,) long)."""
        return TablePairs(*(t[idx] for t in self))


def table_dpo_loss(
    pairs: TablePairs, first_micro: bool = True, *, table: Tensor, vocab: int, beta: float
) -> MicroLoss:
    """DPO's ``minibatch_loss`` hook on a table policy: the masked sums of :func:`token_logprobs`
    (nats, with grad) into :func:`tether.trainers.steps.dpo_pair_loss`, the function
    :class:`tether.trainers.dpo.DPOTrainer` calls.

    Args:
        pairs: the micro-batch. first_micro: unused (DPO has no once-per-step term).
        table: (P, V) policy logits, with grad. vocab: V. beta: DPO's beta > 0.
    """
    return dpo_pair_loss(
        masked_sum(token_logprobs(table, pairs.chosen, vocab), pairs.mask, dim=-1),
        masked_sum(token_logprobs(table, pairs.rejected, vocab), pairs.mask, dim=-1),
        pairs.ref_chosen,
        pairs.ref_rejected,
        beta,
    )


def train_dpo(bed: TabularBed, beta: float, settings: TrainSettings = TrainSettings()) -> RunLog:
    """DPO on fresh Bradley-Terry pairs from pi_ref every batch, through tether's DPO update
    (:func:`table_dpo_loss` in :func:`tether.trainers.update.minibatch_update`).

    Sequence log-probs are the masked sums of :func:`token_logprobs`. After each batch a probe of
    B policy samples logs the per-sequence k1 estimate of KL(pi || pi_ref), as tether's DPO
    trainer does on held-out prompts.
    """
    s = settings
    _check_settings(s, group=False)
    if bed.env_positions:  # as tether's DPO trainer refuses rollout.env
        raise ValueError("train_dpo: a bed with an environment has no preference pairs to learn from")
    V, T, B = bed.vocab, bed.length, s.batch_size
    gen = torch.Generator(device="cpu").manual_seed(s.seed)
    table = bed.ref_logits.clone().to(F64).requires_grad_(True)
    opt = torch.optim.Adam([table], lr=s.lr)
    ref_table = bed.ref_logits.to(F64)
    ref_seq_logp = sequence_logprobs(ref_table, V, T)
    mask = torch.ones(B, T, dtype=torch.bool)
    avg = _Averager()
    log = RunLog(table=table)
    for step in range(s.steps):
        opt.param_groups[0]["lr"] = s.lr_at(step, s.lr)
        chosen, rejected = bradley_terry_pairs(bed, B, gen)
        with torch.no_grad():
            ref_c = masked_sum(token_logprobs(ref_table, chosen, V), mask, dim=-1)  # (B,)
            ref_r = masked_sum(token_logprobs(ref_table, rejected, V), mask, dim=-1)
        minibatch_update(
            TablePairs(chosen, rejected, ref_c, ref_r, mask),
            epoch_minibatches(B, s, gen),
            minibatch_loss=partial(table_dpo_loss, table=table, vocab=V, beta=beta),
            optimization=Optimization(optimizer=opt, params=[table], max_grad_norm=math.inf, name="DPO"),
        )
        with torch.no_grad():  # probe: the policy's own samples, k1 per sequence
            probe = sample(table, V, T, B, gen)
            kl = estimate_kl(token_logprobs(table, probe, V), token_logprobs(ref_table, probe, V), "k1")
            log.kl_estimates.append(sequence_kl(kl, mask))
            log.exact_kls.append(float(exact_kl(sequence_logprobs(table, V, T), ref_seq_logp)))
            log.kl_coefs.append(beta)
        if step >= s.average_from * s.steps:
            avg.add(table)
    log.table = avg.mean()
    return log


GroupRule = Literal["grpo", "grpo-scale-kl", "dr-grpo", "rloo"]


def group_outcomes(vocab: int, group_size: int) -> Tensor:
    """Every multiset of ``group_size`` actions of a bandit, as counts: (M, V) long, each row
    summing to G (M = C(G + V - 1, V - 1); 35 for V = G = 4, 2145 for V = 3 and G = 64, 47905
    for V = 4 and G = 64). A fresh copy of a cached table."""
    return _outcomes(vocab, group_size)[0].clone()


@lru_cache(maxsize=8)
def _outcomes(vocab: int, group_size: int) -> tuple[Tensor, Tensor]:
    """``(counts, actions)`` of :func:`group_outcomes`: (M, V) counts and (M, G) the actions of
    each outcome in ascending order, computed once per (V, G) (enumerating 47905 outcomes in
    Python takes a fifth of a second, and Newton's method asks for them at every step)."""

    def rec(left: int, slots: int) -> list[list[int]]:
        if slots == 1:
            return [[left]]
        return [[k, *rest] for k in range(left + 1) for rest in rec(left - k, slots - 1)]

    counts = torch.tensor(rec(group_size, vocab), dtype=torch.long)
    actions = torch.repeat_interleave(torch.arange(vocab).repeat(len(counts)), counts.reshape(-1))
    return counts, actions.view(-1, group_size)


def expected_group_gradient(
    logits: Tensor, bed: TabularBed, beta: float, group_size: int, rule: GroupRule
) -> Tensor:
    """The exact expected ascent direction of one on-policy group update of a bandit, (V,) in
    logit space, by enumerating every group outcome (:func:`group_outcomes`) with its
    multinomial probability: ``E[(1/G) sum_i (A_i - beta w_g kl_i) grad log pi(y_i)]``.

    The advantages and weights are the trainers' own (:func:`group_normalized_advantages`,
    :func:`rloo_advantages`, and for ``grpo-scale-kl`` :func:`grpo_kl_weights`'s rule with the
    batch mean taken in expectation: an all-equal group's weight is ``E[w 1{not equal}] /
    P(not equal)``). The KL term's per-sample gradient is k2's (and on-policy k3+'s and
    k3_is's, and on a bandit k1_seq's): ``(log pi(y) - log pi_ref(y)) grad log pi(y)``; RLOO's
    k1 is in the reward instead (``r - beta (log pi - log pi_ref)``, no gradient through it).

    Args:
        logits: (V,) float64 policy logits. bed: a bandit (length 1). beta: kl_coef.
        group_size: G >= 2. rule: ``grpo`` (std-scaled advantages, KL in the loss unweighted),
            ``grpo-scale-kl`` (grpo.scale_kl_by_std), ``dr-grpo`` (mean-centred only), ``rloo``.

    Returns:
        (V,) float64 expected gradient of the objective (zero at the rule's fixed point).
    """
    if bed.length != 1:
        raise ValueError("expected_group_gradient enumerates a bandit (length 1)")
    V, G = bed.vocab, group_size
    logp = torch.log_softmax(logits.to(F64), -1)
    ref = torch.log_softmax(bed.ref_logits[0].to(F64), -1)
    counts, actions = _outcomes(V, G)  # (M, V) counts, (M, G) the actions of each outcome
    log_multi = torch.lgamma(torch.tensor(G + 1.0, dtype=F64)) - torch.lgamma(counts.to(F64) + 1).sum(-1)
    prob = torch.exp(log_multi + (counts.to(F64) * logp).sum(-1))  # (M,)
    kl = (logp - ref)[actions]  # (M, G): log pi - log pi_ref of each sample
    if rule == "rloo":
        # k1 in the reward: the advantages depend on the policy
        adv = rloo_advantages((bed.rewards.to(F64)[actions] - beta * kl).reshape(-1), G).view(-1, G)
        w = torch.zeros(len(counts), dtype=F64)
    else:
        adv, std_weight, equal = _group_statistics(tuple(bed.rewards.tolist()), G, rule != "dr-grpo")
        w = torch.ones(len(counts), dtype=F64)
        if rule == "grpo-scale-kl":
            p_ne = prob[~equal].sum()
            mean = (prob * std_weight)[~equal].sum() / p_ne if p_ne > 0 else 1.0
            w = torch.where(equal, mean, std_weight)
    coef = adv - beta * w[:, None] * kl  # (M, G): each sample's weight on grad log pi(y_i)
    # grad log pi(a) = e_a - pi: sum over the group's samples, sum_i coef_i e_(y_i) - pi sum_i coef_i
    per_action = torch.zeros(len(counts), V, dtype=F64).scatter_add(1, actions, coef)  # (M, V)
    per_group = (per_action - coef.sum(1, keepdim=True) * logp.exp()) / G  # (M, V)
    return (prob[:, None] * per_group).sum(0)


@lru_cache(maxsize=16)
def _group_statistics(
    rewards: tuple[float, ...], group_size: int, scale_by_std: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """What a group's rewards alone decide, for every outcome of :func:`group_outcomes` (they do
    not depend on the policy, so Newton's method computes them once): the trainers' advantages
    (M, G) (:func:`group_normalized_advantages`), the ``grpo.scale_kl_by_std`` weight
    ``1 / (std_g + GROUP_STD_EPS)`` (M,) (:func:`group_std`) and whether the group is all-equal
    (M,) bool (:func:`group_all_equal`)."""
    G = group_size
    _, actions = _outcomes(len(rewards), G)
    r = torch.tensor(rewards, dtype=F64)[actions].reshape(-1)  # (M * G,) each sample's reward
    adv = group_normalized_advantages(r, G, scale_by_std=scale_by_std).view(-1, G)
    std_weight = 1.0 / (group_std(r, G).view(-1, G)[:, 0] + GROUP_STD_EPS)
    return adv, std_weight, group_all_equal(r, G).view(-1, G)[:, 0]


def group_fixed_point(bed: TabularBed, beta: float, group_size: int, rule: GroupRule) -> Tensor:
    """The bandit policy where :func:`expected_group_gradient` vanishes: (1, V) float64 log-probs,
    by Newton's method on the V - 1 free logits from pi_ref (the gradient divided by pi, so that a
    policy with some pi(a) -> 0 is no spurious zero), each step halved until that shrinks, to
    |gradient / pi| < 1e-14.

    Raises:
        RuntimeError: no convergence in 200 steps.
    """
    ref = torch.log_softmax(bed.ref_logits[0].to(F64), -1)
    free = ref[1:] - ref[0]  # logits relative to the first action's, starting at pi_ref

    def f(x: Tensor) -> Tensor:
        logits = torch.cat([torch.zeros(1, dtype=F64), x])
        # each action's component over its probability: the logit gradient of action a carries a
        # factor pi(a), which would make a policy with pi(a) -> 0 a spurious zero
        return (expected_group_gradient(logits, bed, beta, group_size, rule) / torch.softmax(logits, -1))[1:]

    g = f(free)
    for _ in range(200):
        if float(g.abs().max()) < 1e-14:
            return torch.log_softmax(torch.cat([torch.zeros(1, dtype=F64), free]), -1)[None, :]
        step = torch.linalg.solve(torch.autograd.functional.jacobian(f, free), g)
        for _ in range(30):  # backtrack: a step that does not shrink |gradient| is halved
            trial = free - step
            g_trial = f(trial)
            if float(g_trial.norm()) < float(g.norm()):
                break
            step = step / 2
        free, g = trial, g_trial
    raise RuntimeError(f"group_fixed_point({rule!r}): no convergence (|gradient| {float(g.abs().max()):.2e})")
