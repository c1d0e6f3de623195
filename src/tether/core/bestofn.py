"""Best-of-N from a finite sample: selection probabilities, exact KL and expected scores.

Torch only. Best-of-N draws N samples from the reference and keeps the one the proxy scores
highest. On an empirical reference of m equally likely samples everything is exact: the pick has
rank k (ascending) with probability ``(k/m)^N - ((k-1)/m)^N``.
"""

from __future__ import annotations

import math

import torch


def bon_kl_bound(n: int) -> float:
    """``log n - (n - 1) / n`` nats: the often-quoted KL of best-of-n to pi_ref.

    Exact when the reward is continuous under pi_ref, an upper bound otherwise (Beirami et al.
    2024, "Theoretical guarantees on the best-of-n alignment policy", arXiv 2401.01879;
    Stiennon et al. 2020, appendix).
    """
    return math.log(n) - (n - 1) / n


def bon_rank_probs(n: int, m: int) -> torch.Tensor:
    """P(best-of-n picks the item of rank k) among m equally likely items, ranks 1..m ascending.

    Draws are with replacement from the m items: ``P(k) = (k/m)^n - ((k-1)/m)^n``. Ties in the
    score are broken by rank order (a fixed total order). Shape (m,), float64, sums to 1.
    """
    k = torch.arange(1, m + 1, dtype=torch.float64)
    return (k / m) ** n - ((k - 1) / m) ** n


def bon_kl_empirical(n: int, m: int) -> float:
    """Exact KL(best-of-n || uniform) on an m-sample empirical reference, nats.

    ``sum_k P(k) log(P(k) * m)``; tends to the bound from below as m grows.
    """
    p = bon_rank_probs(n, m)
    return float(torch.where(p > 0, p * torch.log(p * m), torch.zeros_like(p)).sum())


def bon_scores(proxy: torch.Tensor, gold: torch.Tensor, n: int) -> tuple[float, float]:
    """Expected proxy and gold score of best-of-n (by proxy) over each prompt's m samples.

    Args:
        proxy: (P, m) proxy scores of m reference samples per prompt.
        gold: (P, m) gold scores of the same samples.
        n: best-of-n, drawing n of the m samples with replacement.

    Returns:
        (mean proxy, mean gold) of the best-of-n pick, exact over the draws, averaged over prompts.
    """
    P, m = proxy.shape
    order = torch.argsort(proxy.double(), dim=-1, stable=True)  # ascending: rank k at order[:, k-1]
    w = bon_rank_probs(n, m)  # (m,)
    p_sorted = torch.gather(proxy.double(), 1, order)
    g_sorted = torch.gather(gold.double(), 1, order)
    return float((p_sorted * w).sum(-1).mean()), float((g_sorted * w).sum(-1).mean())
