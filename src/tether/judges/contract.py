"""The scorer contract: what a reward function or judge is, and the check every call passes.

A scorer is any ``Callable[[list[str]], Sequence[float]]`` of the responses, or a TRL-style reward
function ``f(prompts, completions, **kwargs)`` (:func:`takes_prompts`); every call goes through
:func:`checked_scores`, which refuses a wrong count or a non-finite score with the step named.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence

Scorer = Callable[[list[str]], Sequence[float]]


FLOAT32_MAX = 3.4028234663852886e38
"""Largest finite float32: scores beyond it would become inf in the reward tensors."""


def takes_prompts(scorer: Callable) -> bool:
    """True when ``scorer`` names parameters ``prompts`` and ``completions`` (TRL's reward-function
    convention): it is then called as ``scorer(prompts=..., completions=...)``, else ``scorer(texts)``."""
    try:
        params = inspect.signature(scorer).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
    return "prompts" in params and "completions" in params


def checked_scores(
    scorer: Scorer, texts: list[str], step: int | str, prompts: list[str] | None = None
) -> list[float]:
    """Call ``scorer`` and validate its output: one finite float per text.

    ``step`` names where the call happens in messages: a training step number, or a phrase
    such as ``"held-out evaluation"``. ``prompts`` (one per text) go to a scorer that takes
    them (:func:`takes_prompts`).

    Raises:
        ValueError: wrong count, a NaN/inf score, or one beyond float32's range; the message names
            the step and the texts.
    """
    where = f"step {step}" if isinstance(step, int) else step
    try:
        if takes_prompts(scorer):
            if prompts is None or len(prompts) != len(texts):
                raise ValueError(
                    f"it takes prompts, and {'none' if prompts is None else len(prompts)} "
                    f"came with the {len(texts)} texts"
                )
            raw = scorer(prompts=list(prompts), completions=texts)
        else:
            raw = scorer(texts)
        scores = [float(s) for s in raw]
    except Exception as e:  # a user's scorer: report it with the step, never a bare traceback
        raise ValueError(
            f"{where}: the scorer failed on {len(texts)} texts "
            f"({type(e).__name__}: {e}); it must return one float per text"
        ) from e
    if len(scores) != len(texts):
        raise ValueError(f"{where}: the scorer returned {len(scores)} scores for {len(texts)} texts")
    bad = [(t, s) for t, s in zip(texts, scores) if not math.isfinite(s)]
    if bad:
        shown = "; ".join(f"{s} for {t[:60]!r}" for t, s in bad[:3])
        raise ValueError(f"{where}: the scorer returned non-finite scores: {shown}")
    # rewards are float32 tensors: a finite Python float above float32's max would become inf there
    big = [(t, s) for t, s in zip(texts, scores) if abs(s) > FLOAT32_MAX]
    if big:
        shown = "; ".join(f"{s} for {t[:60]!r}" for t, s in big[:3])
        raise ValueError(
            f"{where}: the scorer returned scores beyond float32's range (+-{FLOAT32_MAX:.4g}), "
            f"which would be inf as rewards: {shown}"
        )
    return scores
