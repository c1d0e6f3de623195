"""Scorers (reward models): any ``Callable[[list[str]], list[float]]``.

Built in:
    ``vader``: VADER compound sentiment of the completion, in [-1, 1] (Hutto & Gilbert 2014,
        ``vaderSentiment`` package, MIT). A proxy reward that is easy to game.
    ``minilm-rm``: the Bradley-Terry reward model fitted on ICWSM-2014 human ratings
        (:mod:`tether.reward_model`; fitted on first use, then cached); ``rm:FOLDER`` for
        another one saved by ``tether reward fit --out FOLDER``.
    ``module.path:function``: any importable callable ``list[str] -> list[float]`` of the
        responses, or a TRL-style reward function ``f(prompts, completions, **kwargs)`` (both
        parameters named so), called with the prompts and the responses (:func:`takes_prompts`).
    ``hf:FOLDER[#LABEL]``: a local Hugging Face sequence classifier; the score is the logit of
        ``LABEL`` (an index or a label name; default: the last label).
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
from typing import Callable, Sequence

Scorer = Callable[[list[str]], Sequence[float]]


def vader_scorer() -> Scorer:
    """VADER compound score, [-1, 1], of each text."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()

    def score(texts: list[str]) -> list[float]:
        return [analyzer.polarity_scores(t)["compound"] for t in texts]

    return score


def hf_classifier_scorer(spec: str, batch_size: int = 32) -> Scorer:
    """A local Hugging Face sequence classifier as a scorer (logit of one label)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder, _, label = spec.partition("#")
    from pathlib import Path

    if not Path(folder).is_dir():
        raise ValueError(f"scorer hf:{folder}: no such local folder (a saved sequence classifier)")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    n_labels = model.config.num_labels
    if not label:
        idx = n_labels - 1
    elif label.isdigit():
        idx = int(label)
    else:
        idx = model.config.label2id[label]

    @torch.no_grad()
    def score(texts: list[str]) -> list[float]:
        out = []
        for i in range(0, len(texts), batch_size):
            enc = tok(texts[i : i + batch_size], return_tensors="pt", padding=True, truncation=True)
            out.extend(model(**enc).logits[:, idx].float().tolist())
        return out

    return score


def make_scorer(spec: str | Scorer) -> Scorer:
    """A scorer from a name (``vader``), ``hf:FOLDER[#LABEL]``, ``module:function``, or a callable.

    Raises:
        ValueError: the spec names nothing tether can build.
    """
    if callable(spec):
        return spec
    if spec == "vader":
        return vader_scorer()
    if spec == "minilm-rm" or spec.startswith("rm:"):
        from tether.reward_model import load_reward_model

        return load_reward_model(spec[3:] if spec.startswith("rm:") else None)
    if spec.startswith("hf:"):
        return hf_classifier_scorer(spec[3:])
    if ":" in spec:
        module, _, attr = spec.partition(":")
        if "" not in sys.path and os.getcwd() not in sys.path:
            # the `tether` script, unlike `python -m tether`, does not put the working directory
            # on the import path; a scorer module beside the user's prompts must import either way
            sys.path.append(os.getcwd())
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"scorer {spec!r}: cannot import ({e})") from None
        if not callable(fn):
            raise ValueError(f"scorer {spec!r} is not callable")
        return fn
    raise ValueError(
        f"scorer {spec!r} is unknown; use 'vader', 'minilm-rm', 'rm:FOLDER', 'hf:FOLDER[#LABEL]' "
        "or 'module:function'"
    )


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


def checked_scores(scorer: Scorer, texts: list[str], step: int | str,
                   prompts: list[str] | None = None) -> list[float]:
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
                raise ValueError(f"it takes prompts, and {'none' if prompts is None else len(prompts)} "
                                 f"came with the {len(texts)} texts")
            raw = scorer(prompts=list(prompts), completions=texts)
        else:
            raw = scorer(texts)
        scores = [float(s) for s in raw]
    except Exception as e:  # a user's scorer: report it with the step, never a bare traceback
        raise ValueError(f"{where}: the scorer failed on {len(texts)} texts "
                         f"({type(e).__name__}: {e}); it must return one float per text") from e
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
        raise ValueError(f"{where}: the scorer returned scores beyond float32's range (+-{FLOAT32_MAX:.4g}), "
                         f"which would be inf as rewards: {shown}")
    return scores
