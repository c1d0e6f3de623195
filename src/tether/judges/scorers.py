"""Scorers (reward models): any ``Callable[[list[str]], list[float]]``.

Built in:
    ``vader``: VADER compound sentiment of the completion, in [-1, 1] (Hutto & Gilbert 2014,
        ``vaderSentiment`` package, MIT). A proxy reward that is easy to game.
    ``minilm-rm``: the Bradley-Terry reward model fitted on ICWSM-2014 human ratings
        (:mod:`tether.judges.reward_model`; fitted on first use, then cached); ``rm:FOLDER`` for
        another one saved by ``tether reward fit --out FOLDER``.
    ``module.path:function``: any importable callable ``list[str] -> list[float]`` of the
        responses, or a TRL-style reward function ``f(prompts, completions, **kwargs)`` (both
        parameters named so), called with the prompts and the responses (:func:`takes_prompts`).
    ``hf:FOLDER[#LABEL]``: a local Hugging Face sequence classifier; the score is the logit of
        ``LABEL`` (an index or a label name; default: the last label).
"""

from __future__ import annotations

import importlib
import os
import sys

from tether.judges.contract import Scorer
from tether.judges.vader import vader_scorer


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
        from tether.judges.reward_model import load_reward_model

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
