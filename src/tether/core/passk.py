"""pass@k of a checker reward: the probability that at least one of k samples is right.

Pure Python. Source: Chen et al. 2021, "Evaluating Large Language Models Trained on Code"
(arXiv 2107.03374), section 2.1, eq. 1: from ``n`` samples of a problem of which ``c`` are
right, the unbiased estimator of pass@k (``k <= n``) is

    pass@k = 1 - C(n - c, k) / C(n, k),

the share of the ``C(n, k)`` subsets of k samples that hold a right one. It is computed as the
product ``prod_{i = n - c + 1}^{n} (1 - k / i)`` (the paper's numerically stable form), which
never forms a binomial coefficient and is exactly 0 for c = 0 and exactly 1 for ``n - c < k``.
"""

from __future__ import annotations


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one problem with ``c`` right answers among ``n`` samples.

    Args:
        n: samples drawn (>= 1). c: right ones (0 <= c <= n). k: samples allowed (1 <= k <= n).

    Returns:
        A probability in [0, 1]: 1 - C(n - c, k) / C(n, k); ``c / n`` at k = 1.

    Raises:
        ValueError: k outside [1, n] or c outside [0, n].
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n; got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n right samples; got c={c}, n={n}")
    if n - c < k:  # every k-subset holds a right sample
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def ks_up_to(n: int) -> list[int]:
    """The k reported for n samples a problem: 1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return [*ks, n]
