"""The scorer contract: what a reward function or judge is, and the check every call passes.

A scorer is any ``Callable[[list[str]], Sequence[float]]`` of the responses, or a TRL-style reward
function ``f(prompts, completions, **kwargs)`` (:func:`takes_prompts`); every call goes through
:func:`checked_scores`, which refuses a wrong count or a non-finite score with the step named.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Sequence

Scorer = Callable[[list[str]], Sequence[float]]

log = logging.getLogger(__name__)


FLOAT32_MAX = 3.4028234663852886e38
"""Largest finite float32: scores beyond it would become inf in the reward tensors."""


class ArgumentError(ValueError):
    """A reward function needs an argument (a dataset column, the prompts) the call does not have."""


def takes_prompts(scorer: Callable) -> bool:
    """True when ``scorer`` is a TRL-style reward function: it names a ``completions`` parameter.
    It is then called with keywords, ``scorer(prompts=..., completions=..., **columns)`` (each
    dataset column it names, or all of them if it takes ``**kwargs``), else as ``scorer(texts)``."""
    try:
        params = inspect.signature(scorer).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature
        return False
    return "completions" in params


def required_arguments(scorer: Callable) -> list[str]:
    """The parameters a TRL-style reward function needs (no default), or [] for a plain scorer."""
    if not takes_prompts(scorer):
        return []
    params = inspect.signature(scorer).parameters
    return [
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def _keywords(scorer: Callable, prompts, texts: list[str], columns: dict[str, list] | None) -> dict:
    """The keyword arguments of a TRL-style call: the completions, the prompts and every column
    the function names (all of them when it takes ``**kwargs``)."""
    params = inspect.signature(scorer).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kw = {"prompts": list(prompts) if prompts is not None else None, "completions": texts}
    for name, values in (columns or {}).items():
        if name not in kw and (takes_all or name in params):
            kw[name] = list(values)
    if not takes_all:
        kw = {k: v for k, v in kw.items() if k in params}
    missing = [n for n in required_arguments(scorer) if n not in kw or kw[n] is None]
    if missing:
        have = ["prompts", "completions", *sorted(columns or {})] if prompts is not None else ["completions"]
        raise ArgumentError(
            f"it takes {missing}, and the call has {have}"
            + (
                ""
                if prompts is not None
                else f" (it takes prompts, and none came with the {len(texts)} texts)"
            )
        )
    return kw


def checked_scores(
    scorer: Scorer,
    texts: list[str],
    step: int | str,
    prompts=None,
    columns: dict[str, list] | None = None,
    allow_none: bool = False,
) -> list[float]:
    """Call ``scorer`` and validate its output: one finite float per text.

    ``step`` names where the call happens in messages: a training step number, or a phrase
    such as ``"held-out evaluation"``. ``prompts`` (one per text) and the dataset ``columns``
    (name -> one value per text) go to a TRL-style reward function (:func:`takes_prompts`).

    Args:
        allow_none: a score may be None (a reward that does not apply to that sample, as in TRL);
            it comes back as NaN.

    Raises:
        ValueError: wrong count, a NaN/inf score, or one beyond float32's range; the message names
            the step and the texts.
    """
    where = f"step {step}" if isinstance(step, int) else step
    try:
        if takes_prompts(scorer):
            if prompts is not None and len(prompts) != len(texts):
                raise ValueError(f"{len(prompts)} prompts came with the {len(texts)} texts")
            raw = scorer(**_keywords(scorer, prompts, texts, columns))
        else:
            raw = scorer(texts)
        raw = list(raw)
        if not allow_none and any(s is None for s in raw):
            raise ValueError(
                "it returned None for a sample; one reward must score every sample (None, 'does not "
                "apply', is for a reward in a list of them: reward.scorer=[a, b])"
            )
        scores = [float("nan") if s is None else float(s) for s in raw]
    except Exception as e:  # a user's scorer: report it with the step, never a bare traceback
        raise ValueError(
            f"{where}: the scorer failed on {len(texts)} texts ({type(e).__name__}: {e})"
            + ("" if isinstance(e, ArgumentError) else "; it must return one float per text")
        ) from e
    if len(scores) != len(texts):
        raise ValueError(f"{where}: the scorer returned {len(scores)} scores for {len(texts)} texts")
    bad = [
        (t, s)
        for t, s, r in zip(texts, scores, raw)
        if not math.isfinite(s) and not (allow_none and r is None)
    ]
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


class WeightedReward:
    """Several reward functions as one: ``sum_i w_i * r_i`` per sample (``reward.scorer`` a list,
    ``reward.weights``), a TRL-style reward function itself.

    A function may return None for a sample it does not apply to (TRL's convention): that sample
    is left out of that reward, i.e. the sum skips it (NaN-sum, as TRL does). A sample no function
    scores gets 0. After each call :attr:`last` holds every reward's values (NaN where None), for
    ``reward/<name>``.

    Args:
        scorers: name -> scorer, in order.
        weights: one per scorer (default all 1).

    Raises:
        ValueError: as many weights as scorers are needed, each finite.
    """

    def __init__(self, scorers: dict[str, Scorer], weights: Sequence[float] | None = None):
        self.scorers = dict(scorers)
        self.weights = [1.0] * len(self.scorers) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(self.scorers) or not all(math.isfinite(w) for w in self.weights):
            raise ValueError(
                f"reward.weights={list(weights or [])!r}: give one finite weight per reward.scorer "
                f"({len(self.scorers)}: {list(self.scorers)})"
            )
        self.last: dict[str, list[float]] = {}

    def __call__(self, prompts=None, completions: list[str] | None = None, **columns) -> list[float]:
        texts = list(completions or [])
        self.last = {
            name: checked_scores(scorer, texts, f"reward {name!r}", prompts, columns, allow_none=True)
            for name, scorer in self.scorers.items()
        }
        total, unscored = [], 0
        for i in range(len(texts)):
            terms = [w * v[i] for w, v in zip(self.weights, self.last.values()) if not math.isnan(v[i])]
            total.append(sum(terms))
            unscored += not terms
        if unscored:  # TRL warns too: such a sample's reward is 0 by default, not by any function
            log.warning(
                "tether: warning: %d of %d samples were scored by none of the rewards (all returned None); "
                "their reward is 0",
                unscored,
                len(texts),
            )
        return total
