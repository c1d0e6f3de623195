"""Where the KL went: a step's exact per-token KL attributed to its tokens, positions and ids.

Torch only; imports nothing from tether but :mod:`tether.core.masked`. Every function takes
tensors and scalars. The inputs are the exact per-position KL that step 4 computes anyway,
``KL_t = sum_v pi(v | s_t) (log pi(v | s_t) - log pi_ref(v | s_t))`` in nats at each sampled
position ``s_t`` (:func:`tether.core.kl.exact_kl_from_logits`), so every number here is free of
estimator noise: it attributes the batch's exact KL, not a sampled estimate of it.

The model of the table is llama.cpp's KL-divergence statistics (``llama-perplexity
--kl-divergence``: mean, median, q99, max and top-1 agreement per position).

Units: KL values in nats per token; shares are fractions of the batch's summed exact KL (in
[0, 1] up to rounding); agreement is a fraction of tokens.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

QUANTILES = {"token_p50": 0.5, "token_p90": 0.9, "token_p99": 0.99}
"""The logged quantiles of the per-token exact KL (``kl/token_p50`` ...), linear interpolation
between order statistics (numpy's and torch's default, Hyndman and Fan 1996, definition 7)."""

DECILES = 10
"""Position bins of a response: token ``k`` of a response of ``n`` policy tokens is in decile
``floor(10 k / n)``."""


def position_deciles(mask: Tensor) -> Tensor:
    """The decile of each policy token's position within its response.

    The ``k``-th counted token (0-based, counting only ``mask`` True) of a row with ``n`` counted
    tokens is in decile ``floor(10 k / n)``: a row of 4 tokens puts them in 0, 2, 5, 7; a row of
    20, two per decile. Positions ``mask`` leaves out (padding, after the end, an environment's
    tokens) get -1, and are counted in no decile: so a response with holes (tool turns) is binned
    by its policy tokens only.

    Args:
        mask: (B, R) bool, True on the policy's tokens.

    Returns:
        (B, R) long, in [0, 10) on counted tokens, -1 elsewhere.
    """
    m = mask.bool()
    k = torch.cumsum(m.long(), dim=-1) - 1  # (B, R) index among the row's counted tokens
    n = m.sum(-1, keepdim=True).clamp(min=1)  # (B, 1); a row with none has no counted token to bin
    return torch.where(m, torch.div(k * DECILES, n, rounding_mode="floor"), torch.full_like(k, -1))


PARTS = 5 + 2 * DECILES
"""The length of :func:`kl_parts`' vector."""


def kl_parts(
    kl: Tensor,
    *,
    special: Tensor,
    decile: Tensor,
    agree: Tensor | None = None,
    misaligned: Tensor | None = None,
) -> Tensor:
    """The sums the step's summary is made of, additive over processes (all-reduce them).

    Args:
        kl, special, decile, agree, misaligned: as :func:`token_kl_summary`, one process's tokens.

    Returns:
        (:data:`PARTS`,) float64: ``[n, summed KL, KL on special tokens, KL on misaligned
        tokens, agreeing tokens, the KL summed in each decile (10), the tokens of each decile
        (10)]``.

    Raises:
        ValueError: the arguments' lengths differ.
    """
    n = kl.numel()
    for name, t in (("special", special), ("decile", decile), ("agree", agree), ("misaligned", misaligned)):
        if t is not None and t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} values for {n} tokens")
    x = kl.detach().to(torch.float64).flatten()
    out = torch.zeros(PARTS, dtype=torch.float64, device=x.device)
    out[0], out[1] = n, x.sum()
    out[2] = x[special.flatten().bool()].sum()
    if misaligned is not None:
        out[3] = x[misaligned.flatten().bool()].sum()
    if agree is not None:
        out[4] = agree.flatten().to(torch.float64).sum()
    d = decile.flatten().long()
    counted = (d >= 0) & (d < DECILES)
    out[5 : 5 + DECILES].index_add_(0, d[counted], x[counted])
    out[5 + DECILES :].index_add_(0, d[counted], torch.ones_like(x[counted]))
    return out


def sorted_quantile(values: Tensor, q: float) -> float:
    """The ``q`` quantile of ascending ``values`` (1-D, n >= 1), linear interpolation between
    order statistics: at index ``h = (n - 1) q``, ``v[floor h] + (h - floor h)(v[floor h + 1] -
    v[floor h])`` (numpy's and torch's default, Hyndman and Fan 1996, definition 7; torch.quantile
    refuses more than 2^24 values, a step of long responses has more)."""
    n = values.numel()
    h = (n - 1) * q
    lo = min(int(math.floor(h)), n - 1)
    hi = min(lo + 1, n - 1)
    a, b = float(values[lo]), float(values[hi])
    return a + (h - lo) * (b - a)


def summary_of(
    parts: Tensor,
    *,
    top_values: Tensor,
    quantile_values: Tensor,
    maximum: float,
    with_agree: bool,
    with_misaligned: bool,
    top_share: float = 0.01,
) -> dict[str, float]:
    """:func:`token_kl_summary` from its pieces gathered over processes: the all-reduced
    :func:`kl_parts`, the ``ceil(top_share * n)`` largest KLs of the step (each process's largest
    that many, merged), ascending values to take the quantiles from (every token's, or an evenly
    spaced sample of each process's sorted ones past :data:`QUANTILE_TOKENS`), and the maximum."""
    n, total = int(parts[0]), float(parts[1])
    if n == 0:
        return {}
    out = {k: sorted_quantile(quantile_values, q) for k, q in QUANTILES.items()}
    out["token_max"] = float(maximum)
    for d in range(DECILES):
        count = float(parts[5 + DECILES + d])
        if count > 0:
            out[f"decile_{d}"] = float(parts[5 + d]) / count
    if with_agree:
        out["top1_agreement"] = float(parts[4]) / n
    if total > 0:  # nothing to attribute otherwise (module docstring)
        k = max(1, math.ceil(top_share * n))
        out["top1pct_share"] = (
            float(top_values.to(torch.float64).topk(min(k, top_values.numel())).values.sum()) / total
        )
        out["special_token_share"] = float(parts[2]) / total
        if with_misaligned:
            out["misaligned_share"] = float(parts[3]) / total
    return out


QUANTILE_TOKENS = 1 << 22
"""The most tokens (4,194,304) whose per-token KLs are gathered for the quantiles; past it each
process sends an evenly spaced sample of its sorted values, in proportion to its tokens, and the
quantiles are those of the sample (their rank is off by under 1 / 2^22 of the step's tokens per
process's share)."""


def token_kl_summary(
    kl: Tensor,
    *,
    special: Tensor,
    decile: Tensor,
    agree: Tensor | None = None,
    misaligned: Tensor | None = None,
    top_share: float = 0.01,
) -> dict[str, float]:
    """The step's per-token attribution of its exact KL, from its counted tokens (each argument
    is 1-D over the same ``n`` tokens; several processes combine :func:`kl_parts` and the rest
    through :func:`summary_of`, as this does for one).

    Keys (``kl/`` prefixed by the trainer):

    * ``token_p50``, ``token_p90``, ``token_p99`` (:data:`QUANTILES`) and ``token_max``: nats per
      token;
    * ``top1pct_share``: the share of the summed KL carried by the ``ceil(top_share * n)`` tokens
      of largest KL (at least one);
    * ``special_token_share``: the share on special and template tokens (``special``);
    * ``decile_0`` ... ``decile_9``: the mean KL per token of each position decile
      (:func:`position_deciles`), nats per token; a decile with no token is left out;
    * ``top1_agreement``: the fraction of tokens where the policy's and the reference's most
      likely next token agree (``agree``, when given);
    * ``misaligned_share``: the share on tokens whose sampler and learner log-probs disagree
      (``misaligned``, when given): KL there may be an alignment or precision fault, not drift.

    Shares divide by the summed KL: where it is 0 (step 0, the policy is the reference) or
    below (rounding), there is nothing to attribute and no share is returned (a 0 would read as
    "none on special tokens"). Nothing is returned for ``n = 0``.

    Args:
        kl: (n,) float, the exact KL of each counted token, nats.
        special: (n,) bool, the token is a special or template token.
        decile: (n,) long, its position decile, in [0, 10).
        agree: (n,) bool or None, policy and reference agree on the most likely next token.
        misaligned: (n,) bool or None, the sampler's and the learner's log-probs disagree there.
        top_share: the fraction of tokens whose share ``top1pct_share`` reports (0.01).

    Returns:
        ``{name: value}`` as above, floats.

    Raises:
        ValueError: the arguments' lengths differ, or ``top_share`` is not in (0, 1].
    """
    if not 0 < top_share <= 1:
        raise ValueError(f"top_share must be in (0, 1], got {top_share}")
    parts = kl_parts(kl, special=special, decile=decile, agree=agree, misaligned=misaligned)
    if kl.numel() == 0:
        return {}
    x = kl.detach().to(torch.float64).flatten()
    return summary_of(
        parts,
        top_values=x,
        quantile_values=x.sort().values,
        maximum=float(x.max()),
        with_agree=agree is not None,
        with_misaligned=misaligned is not None,
        top_share=top_share,
    )


def kl_by_token_id(kl: Tensor, token_ids: Tensor) -> dict[int, tuple[float, int]]:
    """The summed exact KL and the count of each token id, over counted tokens.

    Args:
        kl: (n,) float, the exact KL of each counted token, nats.
        token_ids: (n,) long, the sampled token at each.

    Returns:
        ``{token_id: (summed KL in nats, count)}``, float64 sums.
    """
    if kl.numel() == 0:
        return {}
    ids, inverse = torch.unique(token_ids.flatten(), return_inverse=True)
    sums = torch.zeros(len(ids), dtype=torch.float64, device=kl.device)
    sums.index_add_(0, inverse, kl.detach().flatten().to(torch.float64))
    counts = torch.bincount(inverse, minlength=len(ids))
    return {int(i): (float(s), int(c)) for i, s, c in zip(ids.tolist(), sums.tolist(), counts.tolist())}


def rise_by_token_id(
    now: dict[int, tuple[float, int]], before: dict[int, tuple[float, int]], top: int = 20
) -> tuple[list[tuple[int, float]], float, float]:
    """Which token ids carried a rise of the batch's summed KL from one step to the next.

    Each id's rise is its summed KL now minus before (an id absent from a step counts 0 there).
    Both batches hold the same number of sequences (``rollout.batch_size``), so the sums compare.

    Args:
        now, before: :func:`kl_by_token_id` of this step's and the previous step's batch.
        top: how many ids to return.

    Returns:
        ``(ids, rise, explained)``: the ``top`` ids of largest rise with their rise (nats, largest
        first), the total rise of the summed KL (nats, may be negative), and the share of that
        rise the listed ids' rises add to (NaN where the total did not rise: nothing to explain).
    """
    ids = set(now) | set(before)
    rises = {i: now.get(i, (0.0, 0))[0] - before.get(i, (0.0, 0))[0] for i in ids}
    total = sum(v[0] for v in now.values()) - sum(v[0] for v in before.values())
    listed = sorted(rises.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    explained = sum(r for _, r in listed) / total if total > 0 else float("nan")
    return listed, total, explained
