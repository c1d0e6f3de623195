"""Tolerances for comparing float32 results of two computational paths, derived from magnitudes.

Two runs that differ only in how the work is grouped (1 or 2 processes, whole minibatches or
micro-batches, other padding widths) compute the same sums in another order, with other kernels
for other shapes; and CPUs differ in which kernels run (AVX-512 or AVX2 matrix products and
reductions). Reordering a float32 sum of ``n`` terms changes it by at most
``(n - 1) * eps * sum(|term|)`` (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed.,
eq. 4.4), with ``eps = 2**-23``. So a tolerance must scale with the summed magnitudes of the terms,
not with the result: a KL of 0.003 nats is the small difference of sequence log-probabilities of
~50 nats, and its rounding is that of the 50.

Each metric below states the magnitude ``M`` of one of its terms, estimated from the magnitudes the
row itself logs; its tolerance is ``n_terms * EPS32 * M``. Counts of signs (``dpo/accuracy``,
``objective/k1_negative_fraction``) have no such bound: a value within rounding of 0 can take
either sign, so they are compared exactly where the math makes them exact (a step-0 KL of 0) and
left out elsewhere.
"""

from __future__ import annotations

import torch

EPS32 = float(torch.finfo(torch.float32).eps)  # 2**-23 = 1.19e-7, float32's unit roundoff times 2

EXACT = {
    "step",
    "samples",
    "response/length",
    "response/eos_fraction",
    # word counts of the same texts, summed in the same (rank-major) order
    "response/distinct_2",
    "response/repetition",
    "kl/applied_in_reward",
    "kl/applied_in_loss",
    "kl/reference_forwards",
    "optim/lr",
    "rollout/compiled",  # how the rollout was decoded: a flag
    "rollout/env_tokens",  # the environment's tokens of the same samples, counted
    # the update guard's decision, a comparison of the KL against kl.budget * (1 + kl.guard_tol):
    # the same halvings unless a grouping's rounding lands on the ceiling itself
    "guard/fraction",
    "guard/backtracks",
    # the share of tokens whose ratio passes the cap: the same samples, ratios ~1 against a cap of 2
    "rollout/is_clipped_fraction",
}
"""Same samples or same counts: compared with ==."""

SIGN_COUNTS = {"dpo/accuracy", "objective/k1_negative_fraction"}


def term_magnitudes(row: dict) -> dict[str, float]:
    """``M`` of every metric of ``row``: the size of one term of the sum that computes it.

    On the policy's own samples ``E[-log pi(y)] = H`` (the entropy per token, logged as
    ``objective/entropy``) and ``E[-log pi_ref(y)] = H + KL``, so one token's policy and reference
    log-probs together weigh ``m_tok = 2 H + |KL per token|`` nats, and a sequence's ``L * m_tok``
    (``L`` = ``response/length``). Every KL estimate, KL term, approx_kl and DPO implicit reward is
    a sum of such log-prob differences.
    """
    H, L = row.get("objective/entropy", 0.0), row.get("response/length", 0.0)
    beta = row.get("objective/kl_coef", 0.0)
    m_tok = 2 * H + abs(row.get("objective/kl_per_token", 0.0))
    s = abs(row.get("objective/scores", 0.0)) + row.get("objective/scores_std", 0.0)
    v = abs(row.get("value/mean", 0.0)) + s  # a value estimate regresses to the returns (scores)
    g = row.get("policy/grad_norm", 0.0)
    return {
        "objective/kl": L * m_tok,
        "objective/kl_exact": L * m_tok,
        # the other divergences of the same logits: sums of per-position terms of the same size
        "objective/forward_kl_exact": L * m_tok,
        "objective/js_exact": L * m_tok,
        "objective/alpha_exact": L * m_tok,
        # the exact KL of the updated policy at the same batch's prefixes: the same terms; its
        # standard error moves by at most as much as the per-sequence sums it is taken over
        "guard/kl_updated": L * m_tok,
        "guard/kl_kept": L * m_tok,
        "guard/kl_kept_se": L * m_tok,
        "objective/kl_per_token": m_tok,
        "objective/kl_exact_per_token": m_tok,
        "policy/approx_kl": m_tok,
        # k3 and max |difference| of the sampler's and the learner's log-probs of the same tokens,
        # as approx_kl is of the old and new ones
        "rollout/logprob_mismatch": m_tok,
        "rollout/logprob_diff_max": m_tok,
        # rollout.dtype=bf16: the exact KL(sampler || learner) per position, terms as the exact KL's;
        # the weights exp(learner - sampler) ~ 1 move by their log-probs' rounding
        "rollout/sampler_kl_exact": m_tok,
        "rollout/sampler_kl_max": m_tok,
        "rollout/is_weight_mean": 1.0 + m_tok,
        "policy/kl_loss": m_tok,
        # exactly 0 when the first minibatch is scored in the old log-probs' own batch; a
        # micro-batch is another batch shape: exp(d) - 1 ~ d for a log-prob rounding d
        "policy/ratio_max_dev_first": m_tok,
        "objective/non_score_reward": beta * L * m_tok,
        "objective/rlhf_reward": s + beta * L * m_tok,
        # the adaptive controller moves beta by beta * clip(KL / target - 1) * n / horizon: at most
        # beta * n / (horizon * target) < beta per nat of KL (target * horizon > n)
        "objective/kl_coef": beta * L * m_tok,
        # GRPO: beta x the mean group reward std, a std of scores
        "objective/kl_coef_effective": beta * s,
        "objective/scores": s,
        "objective/scores_std": s,
        # -sum p log p over the vocabulary: terms of one sign, so no cancellation (n_terms adds V)
        "objective/entropy": H,
        # whitened or group-normalized advantages have unit rms; the ratio is ~1; plus the KL term
        "policy/loss": 1.0 + beta * m_tok,
        "policy/clipfrac": 1.0,
        # shares of groups whose scores are all equal: the same samples give the same share
        "rollout/groups_all_equal": 1.0,
        "rollout/groups_all_best": 1.0,
        "rollout/groups_all_worst": 1.0,
        "value/clipfrac": 1.0,
        "value/loss": v * v,
        "value/mean": v,
        # max(1, std of the sequence returns): 1, or a std of scores and beta-weighted KL sums
        "value/return_scale": 1.0 + s + beta * L * m_tok,
        "value/explained_variance": 2.0,
        # a sum of N per-token gradients of random sign has a norm ~sqrt(N) times smaller than the
        # sum of their norms; sqrt(N) is folded in by the caller through n_terms ** 1.5
        "policy/grad_norm": g,
        # kl.attribution: quantiles, maximum and decile means of the per-token exact KL are
        # per-token terms; a share divides a sum of them by the batch's total (n tokens x the KL per
        # token), so its rounding is a token's over the KL per token (large where the KL is small:
        # a share of a KL that is mostly rounding is mostly rounding); the top-1 agreement counts
        # argmax ties, which rounding moves only where two logits agree to it (as the groups' shares)
        **{f"kl/{k}": m_tok for k in ("token_p50", "token_p90", "token_p99", "token_max")},
        **{f"kl/decile_{d}": m_tok for d in range(10)},
        **{
            f"kl/{k}": m_tok / max(abs(row.get("objective/kl_exact_per_token", 0.0)), 1e-30)
            for k in ("top1pct_share", "special_token_share", "misaligned_share")
        },
        "kl/top1_agreement": 1.0,
        # the text anchor: token means of q (log q - log p) and -log p on its text, each term a
        # cross-entropy's size (the NLL) whatever the difference of the two
        "anchor/forward_kl": row.get("anchor/nll", 0.0) + abs(row.get("anchor/forward_kl", 0.0)),
        "anchor/nll": row.get("anchor/nll", 0.0) + abs(row.get("anchor/forward_kl", 0.0)),
        # the anchor's weight, the mean of the step's: fixed (exact), or under anchor.budget moved
        # by (eta + kp) / budget per nat of forward KL, whose rounding (the term above, ~n eps x the
        # NLL) the caller's gains must keep under the weight's own (tests/e2e/test_distributed.py:
        # eta 0.01, kp 0, budget 1 -> 0.04 x the NLL's rounding, against the weight's ~0.5)
        "anchor/coef": abs(row.get("anchor/coef", 0.0)),
        "dpo/loss": 1.0,
        "dpo/margin": beta * L * m_tok,
        "dpo/chosen_reward": beta * L * m_tok,
        "dpo/rejected_reward": beta * L * m_tok,
    }


def assert_rows_close(a: dict, b: dict, n_terms: int, vocab_size: int, where: str = "") -> dict[str, float]:
    """Assert two metric rows of the same step agree within the rounding their magnitudes allow.

    Args:
        a, b: metric rows (``metrics.jsonl``) of two runs that differ only in grouping.
        n_terms: the most float32 terms any of the row's reductions adds (rows x response
            positions of a batch).
        vocab_size: V, the terms of one token's entropy.

    Returns:
        Each compared key's difference as a fraction of its tolerance (for printing the margin).
    """
    assert set(a) == set(b), (where, set(a) ^ set(b))
    mags = term_magnitudes(a)
    used = {}
    for k in sorted(a):
        if k.startswith("time/"):
            continue
        if k in EXACT or (k in SIGN_COUNTS and a.get("objective/kl", 0.0) == 0.0 and k != "dpo/accuracy"):
            assert a[k] == b[k], f"{where}{k}: {a[k]!r} != {b[k]!r} (exact by construction)"
            continue
        if k in SIGN_COUNTS:
            continue
        assert k in mags, f"{k}: no magnitude known; add it to tests/numerics.py:term_magnitudes"
        n = n_terms + (vocab_size if k == "objective/entropy" else 0)
        n = n**1.5 if k == "policy/grad_norm" else n
        tol = n * EPS32 * mags[k]
        diff = abs(a[k] - b[k])
        assert diff <= tol, (
            f"{where}{k}: {a[k]!r} vs {b[k]!r}, difference {diff:.3g} > tolerance {tol:.3g} "
            f"({n:.0f} terms x eps x magnitude {mags[k]:.3g})"
        )
        used[k] = diff / tol if tol > 0 else 0.0
    return used


def assert_grads_close(
    want: list[torch.Tensor],
    got: list[torch.Tensor],
    parts: list[list[torch.Tensor]],
    n_terms: int,
    where: str = "",
) -> float:
    """Assert accumulated gradients equal whole-minibatch ones within their summation rounding.

    Args:
        want: each parameter's gradient from one backward over the whole minibatch.
        got: the same, accumulated over micro-batches.
        parts: each micro-batch's own contribution to ``got`` (the gradient added by its backward).
        n_terms: the most terms a gradient entry sums (tokens of the minibatch).

    Every entry of a weight's gradient (``sum_t x_t * delta_t`` over tokens) is made of products
    of the same activations and back-propagated errors, so one term of any entry is bounded by
    the tensor's largest ones, not by the entry's own (small) sum: an entry near 0 is a
    cancellation of terms as large as the others. The magnitude ``M`` of a tensor is therefore its
    largest ``sum_k |part_k|`` (the micro-batch contributions, partial sums of those terms), and
    the tolerance ``n_terms * eps * M`` is Higham's bound for a sum of ``n_terms`` such terms.

    Returns:
        The largest difference as a fraction of its tolerance.
    """
    worst = 0.0
    for i, (w, g) in enumerate(zip(want, got)):
        mag = torch.stack([p[i].abs() for p in parts]).sum(0).max()
        tol = n_terms * EPS32 * mag
        diff = (w - g).abs()
        assert float(diff.max()) <= float(tol), (
            f"{where}parameter {i}: {int((diff > tol).sum())} entries off, largest difference "
            f"{float(diff.max()):.3g} > tolerance {float(tol):.3g}"
        )
        worst = max(worst, float(diff.max()) / max(float(tol), 1e-30))
    return worst
