"""Diversity of generated text: distinct-n, self-BLEU and the repetition rate. Pure Python.

What the KL leash protects besides fluency (the seeds: "Without it, the policy collapses toward
a few high-reward outputs"). Every function takes texts and returns plain floats; none looks at
a model or a config. Texts are split into words by :func:`words` (lower-cased runs of letters,
digits and apostrophes, and each other non-space character on its own), so the numbers do not
depend on any model's tokenizer and compare across policies and runs.

Sources: distinct-n, Li et al. 2016, "A Diversity-Promoting Objective Function for Neural
Conversation Models" (arXiv 1510.03055), section 4.2; self-BLEU, Zhu et al. 2018, "Texygen: A
Benchmarking Platform for Text Generation Models" (arXiv 1802.01886), section 3.2, with BLEU
of Papineni et al. 2002 (ACL, "BLEU: a Method for Automatic Evaluation of Machine
Translation", eq. 1-2) and the add-one smoothing of Lin & Och 2004 (COLING, "ORANGE", section
3: +1 to the matched and the total n-gram counts for n >= 2).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

_WORD = re.compile(r"[\w']+|[^\w\s]")


def words(text: str) -> list[str]:
    """``text`` lower-cased and split into words and punctuation marks.

    Example:
        ``words("Great, GREAT fun!")`` is ``["great", ",", "great", "fun", "!"]``.
    """
    return _WORD.findall(text.lower())


def ngrams(tokens: Sequence[str], n: int) -> list[tuple[str, ...]]:
    """The ``len(tokens) - n + 1`` contiguous n-grams of ``tokens`` (none when it is shorter)."""
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(texts: Sequence[str], n: int) -> float:
    """distinct-n of a set of texts: distinct n-grams over all n-grams, pooled over the texts.

    In [0, 1]; 1 when no n-gram occurs twice anywhere in the set. NaN when the texts hold no
    n-gram at all (every text shorter than ``n`` words).

    Example:
        "a b a b" and "a b c" hold the 2-grams ab, ba, ab, ab, bc: 3 distinct of 5, 0.6.

    Raises:
        ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"distinct_n needs n >= 1, got {n}")
    grams = [g for t in texts for g in ngrams(words(t), n)]
    return len(set(grams)) / len(grams) if grams else math.nan


def repetition(text: str, n: int = 3) -> float | None:
    """Share of a text's n-grams that repeat an n-gram earlier in the same text:
    ``1 - distinct / total`` over its own n-grams. 0 for a text without a repeated n-gram; None
    for a text shorter than ``n`` words (it has no n-gram to repeat).

    Example:
        "great great great great" holds the 3-grams (great great great) twice: 1 - 1/2 = 0.5.
    """
    grams = ngrams(words(text), n)
    return 1.0 - len(set(grams)) / len(grams) if grams else None


def bleu(hypothesis: Sequence[str], references: Sequence[Sequence[str]], max_n: int = 4) -> float:
    """Sentence BLEU of a word list against reference word lists, add-one smoothed for n >= 2.

    ``BLEU = BP * exp(mean_{n=1..max_n} log p_n)`` (Papineni et al. 2002, eq. 1-2), where ``p_n``
    is the clipped n-gram precision: each hypothesis n-gram counts at most as often as it occurs
    in the reference that holds it most. ``p_1`` is unsmoothed (0 when no word matches, and then
    BLEU is 0); for n >= 2, ``p_n = (matched + 1) / (total + 1)`` (Lin & Och 2004), so a short
    text with no matching 4-gram still gets a finite score. The brevity penalty is
    ``BP = exp(1 - r / c)`` when the hypothesis' length ``c`` is below ``r``, the length of the
    reference closest to ``c`` (the shorter one on a tie), else 1. In [0, 1].

    Example:
        hypothesis "a b c", one reference "a b d": p1 = 2/3, p2 = (1 + 1)/(2 + 1) = 2/3,
        max_n = 2, BP = 1: BLEU = exp((log 2/3 + log 2/3) / 2) = 2/3.

    Raises:
        ValueError: no reference, or ``max_n < 1``.
    """
    if not references:
        raise ValueError("bleu needs at least one reference")
    if max_n < 1:
        raise ValueError(f"bleu needs max_n >= 1, got {max_n}")
    c = len(hypothesis)
    if c == 0:
        return 0.0
    log_p = 0.0
    for n in range(1, max_n + 1):
        hyp = Counter(ngrams(hypothesis, n))
        most: Counter = Counter()
        for ref in references:
            for g, k in Counter(ngrams(ref, n)).items():
                most[g] = max(most[g], k)
        matched = sum(min(k, most[g]) for g, k in hyp.items())
        total = sum(hyp.values())
        if n == 1:
            if matched == 0:
                return 0.0
            log_p += math.log(matched / total)
        else:
            log_p += math.log((matched + 1) / (total + 1))
    r = min((len(ref) for ref in references), key=lambda length: (abs(length - c), length))
    bp = 1.0 if c >= r else math.exp(1.0 - r / c)
    return bp * math.exp(log_p / max_n)


def self_bleu(groups: Sequence[Sequence[str]], max_n: int = 4) -> list[float]:
    """Self-BLEU per group of completions of one prompt (Zhu et al. 2018): the mean, over the
    group's texts, of each text's :func:`bleu` against the group's other texts. High (near 1)
    when the completions of a prompt are near copies of each other; low for varied ones.

    Args:
        groups: one sequence of texts per prompt; groups with fewer than 2 texts are skipped.
        max_n: BLEU's longest n-gram (4, as in Texygen).

    Returns:
        One value in [0, 1] per group with at least 2 texts, in order.
    """
    out = []
    for group in groups:
        if len(group) < 2:
            continue
        toks = [words(t) for t in group]
        out.append(sum(bleu(h, toks[:i] + toks[i + 1 :], max_n) for i, h in enumerate(toks)) / len(toks))
    return out
