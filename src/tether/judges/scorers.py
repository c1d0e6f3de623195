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
    ``hf:FOLDER[#LABEL]`` or ``hf:ORG/NAME[#LABEL]``: a Hugging Face sequence classifier, local or
        from the Hub (through the HF cache); the score is the logit of ``LABEL`` (an index or a
        label name; default: the last label).
"""

from __future__ import annotations

import importlib
import os
import sys

from tether.judges.contract import Scorer, WeightedReward
from tether.judges.vader import vader_scorer


def hf_classifier_scorer(spec: str, batch_size: int = 32) -> Scorer:
    """A Hugging Face sequence classifier (a local folder or a Hub id) as a TRL-style scorer: the
    logit of one label for the prompt and the completion together, through the classifier's chat
    template when it has one (a reward model trained on conversations reads one)."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tether.models.loading import hub_folder, is_hub_id

    folder, _, label = spec.partition("#")
    if is_hub_id(folder):  # ORG/NAME: its snapshot in the Hugging Face cache
        folder = str(hub_folder(folder, field_name="reward.scorer=hf:"))
    elif not Path(folder).is_dir():
        raise ValueError(
            f"scorer hf:{folder}: no such local folder (a saved sequence classifier) nor a Hub id (ORG/NAME)"
        )
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    n_labels = model.config.num_labels
    if not label:
        idx = n_labels - 1
    elif label.isdigit():
        idx = int(label)
    else:
        idx = model.config.label2id[label]

    chat = bool(getattr(tok, "chat_template", None))

    def joined(prompt, completion: str) -> str:
        """What the reward model reads: the conversation through its chat template when it has
        one, else prompt then completion."""
        if prompt is None:
            return completion
        if chat:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            return tok.apply_chat_template(
                [*messages, {"role": "assistant", "content": completion}], tokenize=False
            )
        text = prompt if isinstance(prompt, str) else " ".join(m["content"] for m in prompt)
        return text + completion

    @torch.no_grad()
    def score(prompts: list | None, completions: list[str], **columns) -> list[float]:
        texts = [joined(p, c) for p, c in zip(prompts or [None] * len(completions), completions)]
        out = []
        for i in range(0, len(texts), batch_size):
            enc = tok(texts[i : i + batch_size], return_tensors="pt", padding=True, truncation=True)
            out.extend(model(**enc).logits[:, idx].float().tolist())
        return out

    return score


def scorer_name(spec: str | Scorer) -> str:
    """The short name a reward is logged under (``reward/<name>``): ``vader``, the function's
    name of ``module:function``, the model's of ``hf:ORG/NAME#LABEL``, a callable's ``__name__``."""
    if callable(spec):
        return getattr(spec, "__name__", type(spec).__name__)
    if spec.startswith(("hf:", "rm:")):
        return spec[3:].partition("#")[0].rstrip("/").rsplit("/", 1)[-1]
    return spec.rpartition(":")[2] if ":" in spec else spec


def make_scorer(spec: str | Scorer | list, weights: list[float] | None = None) -> Scorer:
    """A scorer from a name (``vader``), ``hf:FOLDER[#LABEL]``, ``hf:ORG/NAME[#LABEL]``,
    ``module:function``, or a callable; or from a list of them, a
    :class:`tether.judges.contract.WeightedReward` with ``weights``.

    Raises:
        ValueError: the spec names nothing tether can build.
    """
    if isinstance(spec, (list, tuple)):
        named: dict[str, Scorer] = {}
        for one in spec:
            name = base = scorer_name(one)
            k = 2
            while name in named:  # two of the same name: vader, vader_2
                name, k = f"{base}_{k}", k + 1
            named[name] = make_scorer(one)
        return WeightedReward(named, weights)
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
