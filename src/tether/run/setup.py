"""What every trainer shares: building a run (models, data, scorer, run dir) and scoring rollouts."""

from __future__ import annotations

import copy
import datetime as _dt
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from safetensors import SafetensorError
from torch import nn

from tether.core.distributed import barrier, gather_objects, is_main
from tether.core.text import shown
from tether.data.capability import anchor_texts
from tether.data.prompts import (
    DEFAULT_PROMPTS,
    PromptData,
    load_prompt_data,
    movie_prompts,
    pair_prompts,
    prompt_file_lines,
    prompt_key,
    records_to_data,
    split_prompts,
    unique_prompts,
)
from tether.data.tasks import TASKS, task_prompts
from tether.judges.contract import (
    ENV_REPLIES,
    ENVIRONMENTS,
    Scorer,
    WeightedReward,
    is_conversational,
    required_arguments,
)
from tether.judges.scorers import (
    PYTHON_SCORER,
    RewardModelScorer,
    check_scorer_spec,
    make_scorer,
    scorer_name,
)
from tether.models.callables import python_object_spec
from tether.models.loading import (
    check_model_name,
    disable_dropout,
    is_hub_id,
    load_causal_lm,
    load_tokenizer,
    prepare_tokenizer,
    resolve_model_path,
)
from tether.models.lora import add_lora, check_passed_peft_model
from tether.models.policy import PolicyWithValue
from tether.models.reference import (
    check_reference,
    count_reference_forwards,
    fingerprint,
    make_reference,
)
from tether.models.rollouts import Sampler, SamplingSettings, make_sampler
from tether.models.sampling import bf16_matmul_missing, prompt_texts, set_template_kwargs, use_chat_template
from tether.models.sharding import shard_model
from tether.models.tools import (
    load_environment_factory,
    load_tools,
)
from tether.models.turns import (
    chat_reply_text,
    env_column_names,
    load_env,
    prompt_messages,
    tool_template,
    tool_turn_formats,
    turn_formats,
)
from tether.run.config import Config, ConfigError, check_world_size, dump_config, read_yaml
from tether.run.files import remove_tree, run_id
from tether.run.folder import check_no_links, tether_entry
from tether.run.lock import RunLocked
from tether.run.lock import acquire as acquire_lock
from tether.run.lock import release as release_lock
from tether.run.metrics import RunWriter
from tether.run.reporting import resolve_trackers
from tether.run.rngs import seed_everything

log = logging.getLogger(__name__)


def default_run_dir(algo: str) -> Path:
    """``runs/<algo>-<date-time>-<pid>``: two runs started in the same second get two folders."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{algo}-{stamp}-{os.getpid()}"


def load_model_part(load, name: str, *args):
    """``load(*args)`` (the tokenizer or the model of ``model.name``), its failure named.

    Raises:
        ValueError: naming ``model.name`` and what failed (a folder without weights, a
            tokenizer that needs a missing package ...).
    """
    try:
        return load(*args)
    except (OSError, ValueError, ImportError, RuntimeError, SafetensorError) as e:  # a shape's RuntimeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"model.name={shown(name)}: {load.__name__.replace('_', ' ')} failed ({first}); point model.name "
            "at a folder saved with save_pretrained (config, tokenizer and weights) or a Hub id"
        ) from e


def check_scorer_columns(
    scorer,
    columns: dict[str, list],
    field_name: str = "reward.scorer",
    data_field: str = "data.prompts",
    *,
    multi_turn: bool = False,
) -> None:
    """Refuse, before the model loads, a reward function (or judge, ``field_name``) that needs a
    dataset column the prompts do not have, or the environment's replies
    (:data:`tether.judges.contract.ENV_REPLIES`) in a run without ``rollout.env``
    (``multi_turn``: the run has one).

    Raises:
        ValueError: naming the field, the function, the column and the columns there are.
    """
    scorers = (
        scorer.scorers.items()
        if isinstance(scorer, WeightedReward)
        else [(getattr(scorer, "__name__", type(scorer).__name__), scorer)]
    )
    for name, one in scorers:
        needed = required_arguments(one)
        if ENV_REPLIES in needed and not multi_turn:
            raise ValueError(
                f"{field_name} {shown(name)} takes {ENV_REPLIES}, what rollout.env wrote between the "
                "policy's turns, and this run has no rollout.env; give the parameter a default or set "
                "rollout.env"
            )
        missing = [c for c in needed if c not in ("prompts", "completions", ENV_REPLIES) and c not in columns]
        if missing:
            raise ValueError(
                f"{field_name} {shown(name)} needs the dataset column(s) {missing}, and {data_field} has "
                f"{shown(sorted(columns)) if columns else 'none'}; point {data_field} at a dataset with "
                "them (or set data.prompt_column) or give the function defaults"
            )


def python_scorer_spec(scorer) -> list[str]:
    """What config.yaml records for rewards passed as objects (``train(config, scorer=...)``): one
    ``(from Python) NAME`` entry per reward, which no spec builds, so a resume without them asks
    for them (:func:`tether.judges.scorers.check_scorer_spec`) rather than falling back to VADER."""
    if isinstance(scorer, WeightedReward):
        names = list(scorer.scorers)
    elif isinstance(scorer, (list, tuple)) and not (len(scorer) == 2 and hasattr(scorer[1], "decode")):
        names = [scorer_name(one) if callable(one) else type(one).__name__ for one in scorer]
    else:
        names = [scorer_name(scorer) if callable(scorer) else type(scorer).__name__]
    return [f"{PYTHON_SCORER} {n}" for n in names]


RESUME_FIXED = (
    ("train", "algo"),
    ("data", "prompts"),
    ("data", "split"),
    ("data", "prompt_column"),
    ("data", "heldout_fraction"),
    ("data", "eval_prompts"),
    ("data", "min_words"),
    ("data", "max_words"),
    ("data", "chat_template"),
    ("dpo", "pairs"),
    ("model", "name"),
    ("model", "revision"),
    ("model", "trainable_layers"),
    ("model", "lora_r"),
    ("model", "lora_alpha"),
    ("model", "lora_target_modules"),
    ("model", "adapter"),
)
"""Fields a resume cannot change: the trainer (its checkpoint state is another trainer's), the
data (the checkpoint's prompt order and the held-out split index these prompts) and the model
(the checkpoint's weights are this model's, with these adapters and trainable layers)."""


def check_resume_keeps(config: Config, saved: Path) -> None:
    """Refuse, before anything loads or is rewritten, a ``--resume`` that changes a field of
    :data:`RESUME_FIXED` from the run's config.yaml.

    Raises:
        ConfigError: naming the field, both values and the fix.
    """
    before = read_yaml(saved.read_text(), f"--resume: {saved}") or {}
    for section, name in RESUME_FIXED:
        if section == "dpo" and config.trainer.samples:
            continue  # read by a trainer of pairs (DPO) alone
        was = (before.get(section) or {}).get(name, getattr(getattr(Config(), section), name))
        now = getattr(getattr(config, section), name)
        if was != now and not _same_path(was, now):
            raise ConfigError(
                f"--resume: {section}.{name}={shown(now)} differs from the run's {shown(was)} ({saved}); "
                "a resumed run keeps its trainer, its data (the checkpoint's prompt order, the held-out "
                "split) and its model (the checkpoint's weights and adapters). "
                f"Drop the override, or start a new run with it: tether train --config {saved} "
                f"{section}.{name}={shown(now)} train.output_dir=NEW_DIR"
            )


def _same_path(a, b) -> bool:
    """Whether two field values name the same existing file or folder (``dir/`` and ``dir``,
    ``./x`` and ``x``, a relative and an absolute path)."""
    if not (isinstance(a, str) and isinstance(b, str)):
        return False
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def check_integer_answers(scorer, *parts: PromptData) -> None:
    """With the built-in ``integer-answer`` checker (alone or in a reward list), every row's
    ``answer`` must be an integer, checked before any model loads (a bad row would otherwise fail
    only when it is drawn, or never).

    Raises:
        ValueError: naming the first bad row and its value.
    """
    from tether.judges.verifiers import integer_answer

    scorers = scorer.scorers.values() if isinstance(scorer, WeightedReward) else [scorer]
    if not any(s is integer_answer for s in scorers):
        return
    for part in parts:
        for i, a in enumerate(part.columns.get("answer", [])):
            try:
                integer_answer(["0"], [a])
            except ValueError:
                raise ValueError(
                    f"reward.scorer=integer-answer: row {i + 1} of the prompts has answer {shown(a)}, not an "
                    "integer; fix the data's answer column, or use your own reward.scorer=module:function"
                ) from None


def dataset_prompts(dataset, config: Config) -> tuple[PromptData, PromptData]:
    """(train, heldout) of a ``train_dataset`` given to :func:`build_run`, split by the hash.

    Raises:
        the errors of :func:`dataset_data`.
    """
    data = dataset_data(dataset, config, "train_dataset")
    return split_prompts(data, config.data.heldout_fraction, field_name="train_dataset")


def dataset_data(dataset, config: Config, field_name: str) -> PromptData:
    """The rows of a dataset passed from Python (``train_dataset``, ``eval_dataset``): a
    ``datasets.Dataset``, a ``datasets.DatasetDict`` (its ``data.split``), a pandas ``DataFrame``,
    a list of row dicts, or a list of prompts.

    Raises:
        ValueError: another type, a missing split, or no rows (``field_name`` named).
    """
    if isinstance(dataset, dict) and dataset and all(hasattr(v, "to_list") for v in dataset.values()):
        if config.data.split not in dataset:  # a DatasetDict
            raise ValueError(
                f"data.split={shown(config.data.split)}: {field_name} has the splits {list(dataset)}"
            )
        dataset = dataset[config.data.split]
    if hasattr(dataset, "to_dict") and hasattr(dataset, "columns") and not hasattr(dataset, "to_list"):
        rows = dataset.to_dict("records")  # a pandas DataFrame
    elif hasattr(dataset, "to_list"):
        rows = dataset.to_list()
    elif isinstance(dataset, (list, tuple)):
        rows = list(dataset)
    else:
        raise ValueError(
            f"{field_name}: a {type(dataset).__name__} is not a dataset; pass a datasets.Dataset or "
            "DatasetDict, a pandas DataFrame, a list of row dicts or a list of prompts (a file or Hub id "
            "goes in config.data.prompts)"
        )
    if not rows:
        raise ValueError(f"{field_name} holds no rows")
    if rows and all(isinstance(r, dict) for r in rows):
        return records_to_data(rows, config.data.prompt_column, field_name)
    return records_to_data([{"prompt": r} for r in rows], "prompt", field_name)


def eval_set(config: Config, eval_dataset=None) -> PromptData | None:
    """The held-out set of ``train(..., eval_dataset=...)`` or ``data.eval_prompts`` (any source
    ``data.prompts`` takes), whole; None for neither (the hash share).

    Raises:
        ValueError, FileNotFoundError: as for ``data.prompts``, naming ``data.eval_prompts``.
    """
    spec, d = config.data.eval_prompts, config.data
    if eval_dataset is not None:  # record_passed_objects refused a data.eval_prompts beside it
        return unique_prompts(dataset_data(eval_dataset, config, "eval_dataset"), "eval_dataset")
    if spec is None:
        return None
    if spec == "(an eval_dataset passed to train)":
        raise ValueError(
            "data.eval_prompts: this run's held-out set was an eval_dataset passed to train(); "
            "pass it again (train(..., eval_dataset=...)) to resume the run"
        )
    try:
        if spec == DEFAULT_PROMPTS:
            train, held = movie_prompts(config.train.seed, d.min_words, d.max_words, d.heldout_fraction)
            data = PromptData(train + held)
        elif spec in TASKS:
            data = task_prompts(spec)
        else:
            data = load_prompt_data(spec, d.split, d.prompt_column, d.config)
    except (ValueError, FileNotFoundError) as e:
        raise type(e)(str(e).replace("data.prompts", "data.eval_prompts")) from None
    return unique_prompts(data, "data.eval_prompts")


def check_same_format(train: PromptData, evaluation: PromptData, field_name: str) -> None:
    """Refuse a held-out set of conversations for text training prompts, or the other way round:
    its numbers would measure another prompt format than the one trained.

    Raises:
        ValueError: the formats differ (both named).
    """

    def kind(data: PromptData) -> str:
        return "conversations" if data.prompts and not isinstance(data.prompts[0], str) else "text prompts"

    if len(train) and len(evaluation) and kind(train) != kind(evaluation):
        raise ValueError(
            f"{field_name} holds {kind(evaluation)} and data.prompts {kind(train)}: the held-out "
            "evaluation would measure another prompt format than the one trained; give both in one format"
        )


def train_on_the_rest(train: PromptData, heldout: PromptData, evaluation: PromptData) -> PromptData:
    """Every prompt of ``train`` and ``heldout`` (the hash split of data.prompts, whole again)
    except those also in ``evaluation`` (by :func:`tether.data.prompts.prompt_key`): what a run
    with its own held-out set trains on. The count left out is said.

    Raises:
        ValueError: no training prompt is left, or the two sets' columns differ.
    """
    if set(train.columns) != set(heldout.columns):  # pragma: no cover - one source, one set of columns
        raise ValueError("data.prompts: its training and held-out rows have different columns")
    both = PromptData(
        train.prompts + heldout.prompts, {k: train.columns[k] + heldout.columns[k] for k in train.columns}
    )
    held = {prompt_key(p) for p in evaluation.prompts}
    kept = [i for i, p in enumerate(both.prompts) if prompt_key(p) not in held]
    if not kept:
        raise ValueError(
            "data.eval_prompts: every training prompt is also in the held-out set; give prompts to "
            "train on that the evaluation does not hold"
        )
    if len(kept) < len(both):
        log.warning(
            "tether: %d training prompt(s) are also in the held-out set (data.eval_prompts / "
            "eval_dataset) and are left out of training; %d remain",
            len(both) - len(kept),
            len(kept),
        )
    return both.select(kept)


def load_prompts(config: Config) -> tuple[PromptData, PromptData]:
    """(train, heldout) prompts for ``config.data``, each with its rows' other columns."""
    d = config.data
    if config.pairs_file and d.prompts == DEFAULT_PROMPTS:
        # DPO on a pairs file: its own prompts, split by the usual hash (the held-out ones are the
        # evaluation's and never trained on); the demo's prompts are not fetched
        try:
            return split_prompts(pair_prompts(config.dpo.pairs, d.split, d.config), d.heldout_fraction)
        except ValueError as e:  # every pair's prompt held out: the pairs file is the prompt set
            raise ValueError(str(e).replace("data.prompts:", f"dpo.pairs={config.dpo.pairs}:")) from None
    if d.prompts == DEFAULT_PROMPTS:
        train, held = movie_prompts(config.train.seed, d.min_words, d.max_words, d.heldout_fraction)
        return PromptData(train), PromptData(held)
    if d.prompts in TASKS:  # a built-in verifiable task, generated in code
        return split_prompts(task_prompts(d.prompts), d.heldout_fraction)
    return split_prompts(load_prompt_data(d.prompts, d.split, d.prompt_column, d.config), d.heldout_fraction)


def freeze_lower_layers(lm: nn.Module, trainable_layers: int | None) -> None:
    """Keep only the last ``trainable_layers`` blocks (and the final norm) trainable."""
    if trainable_layers is None:
        return
    trunk = getattr(lm, lm.base_model_prefix)
    for p in lm.parameters():
        p.requires_grad_(False)
    layers = getattr(trunk, "layers", None) or getattr(trunk, "h", None)
    if layers is None:
        raise ValueError(
            f"model.trainable_layers: cannot find the transformer blocks of {type(lm).__name__} "
            "(no .layers or .h); leave model.trainable_layers unset"
        )
    if trainable_layers > len(layers):
        raise ValueError(
            f"model.trainable_layers={trainable_layers}: {type(lm).__name__} has {len(layers)} transformer "
            f"blocks; give at most {len(layers)}, or all"
        )
    for block in list(layers)[len(layers) - trainable_layers :] if trainable_layers else []:
        for p in block.parameters():
            p.requires_grad_(True)
    if trainable_layers and hasattr(trunk, "norm"):
        for p in trunk.norm.parameters():
            p.requires_grad_(True)


def model_context(config_or_path, trust_remote_code: bool = False) -> int | None:
    """The positions a model was trained on (``max_position_embeddings``, GPT-2's ``n_positions``)
    of a model config or of the folder holding its config.json; None when it states none."""
    cfg = config_or_path
    if isinstance(cfg, (str, Path)):
        from transformers import AutoConfig

        try:
            cfg = AutoConfig.from_pretrained(cfg, trust_remote_code=trust_remote_code)
        except (OSError, ValueError):  # a peft adapter folder, an unknown type: the model load says why
            return None
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        n = getattr(cfg, name, None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def fill_max_prompt_tokens(config: Config, longest: int, context: int | None) -> Config:
    """``config`` with ``rollout.max_prompt_tokens`` filled, when left None, by the data's longest
    prompt (``longest`` tokens); refused when the longest prompt and a full response cannot fit
    the model's ``context`` positions. The value is printed (rank 0) when it was filled.

    Raises:
        ConfigError: ``longest + rollout.max_new_tokens > context``, naming the field.
    """
    r = config.rollout
    given = r.max_prompt_tokens is not None
    need = longest + r.max_new_tokens
    if context is not None and need > context:
        raise ConfigError(
            f"the longest prompt ({longest} tokens) + rollout.max_new_tokens={r.max_new_tokens} = {need} "
            f"tokens, beyond the model's {context} positions (max_position_embeddings): the response would "
            "run past the positions it was trained on; lower rollout.max_new_tokens or shorten the prompts"
        )
    if given:
        return config
    config = copy.deepcopy(config)
    if r.environment_factory is not None and context is not None:  # reset() may lengthen a prompt
        config.rollout._fill("max_prompt_tokens", context - r.max_new_tokens)
        if is_main():
            print(
                f"tether: rollout.max_prompt_tokens={context - r.max_new_tokens}: what the model's {context} "
                f"positions leave beside rollout.max_new_tokens={r.max_new_tokens}, as environment_factory's "
                f"reset() may append to a prompt (the data's longest has {longest} tokens)"
            )
        return config
    config.rollout._fill("max_prompt_tokens", longest)
    if is_main():
        cap = f"; the model's {context} positions cap it at {context - r.max_new_tokens}" if context else ""
        print(
            f"tether: rollout.max_prompt_tokens={longest}: the data's longest prompt{cap} "
            f"(with rollout.max_new_tokens={r.max_new_tokens})"
        )
    return config


def check_prompt_lengths(
    tokenizer,
    prompts: list[str],
    max_prompt_tokens: int | None,
    source: str | None = None,
    room: tuple[int, int] | None = None,
) -> int:
    """Refuse, before training starts, any prompt that is empty, longer than the limit, or too
    long to leave room for a response in the model's positions; return the longest prompt's
    length in tokens.

    Args:
        max_prompt_tokens: the limit; None = none (it is filled with the returned length).
        source: the prompt file, if any: the error then names its line (``FILE:LINE``).
        room: ``(context, max_new_tokens)``: the model's positions and the response's length; a
            prompt longer than ``context - max_new_tokens`` is refused.

    Raises:
        ValueError: naming the prompt (and its file and line) and the field to change.
    """
    longest = 0
    limit = max_prompt_tokens if max_prompt_tokens is not None else float("inf")
    fits = room[0] - room[1] if room is not None else float("inf")
    for start in range(0, len(prompts), 2048):
        chunk = prompts[start : start + 2048]
        lengths = [
            len(ids)
            for ids in tokenizer(prompt_texts(tokenizer, chunk), add_special_tokens=True)["input_ids"]
        ]
        longest = max([longest, *lengths])
        for i, (p, n) in enumerate(zip(chunk, lengths)):
            if n == 0 or n > min(limit, fits):
                where = f"prompt {start + i + 1}"
                if (
                    source is not None
                    and isinstance(p, str)
                    and Path(source).suffix.lower() in (".txt", ".text", "", ".jsonl")
                ):
                    where = f"data.prompts: {source}:{prompt_line(source, p)}:"
                if 0 < n <= limit and room is not None:
                    raise ValueError(
                        f"{where} ({shown(p, 60)}) has {n} tokens, and with rollout.max_new_tokens={room[1]} "
                        f"the response would run past the model's {room[0]} positions "
                        "(max_position_embeddings); shorten the prompt or lower rollout.max_new_tokens "
                        "(rollout.max_prompt_tokens bounds the prompts)"
                    )
                raise ValueError(
                    f"{where} ({shown(p, 60)}) has {n} tokens; rollout.max_prompt_tokens="
                    f"{max_prompt_tokens} (shorten the prompt or raise rollout.max_prompt_tokens)"
                )
    return longest


def prompt_line(path: str | Path, prompt: str) -> int | str:
    """1-based line of ``prompt``'s first occurrence in a prompt file (``"?"`` if absent)."""
    try:
        return next((i for i, p in prompt_file_lines(path) if p == prompt), "?")
    except ValueError:  # a .jsonl whose prompts are in another column (data.prompt_column)
        return "?"


@dataclass
class Run:
    """Everything a trainer needs, built from a validated :class:`Config`."""

    config: Config
    policy: PolicyWithValue
    reference: nn.Module | None
    """None when no KL is used or monitored (kl_coef 0 and kl.monitor false)."""
    tokenizer: object
    scorer: Scorer
    train_prompts: PromptData
    """The training prompts (a sequence of texts or conversations) and their rows' other columns."""
    heldout_prompts: PromptData
    writer: RunWriter
    reference_fingerprint: str | None
    reference_forwards: list[int]
    """[count] of reference forward passes of this process (a pre-hook increments it)."""
    sampler: Sampler
    """How this run samples (:func:`run_sampler`: one turn, or tool turns with ``rollout.env``'s
    environment): every stage that samples calls it, the trainers (DPO's pairs and probe
    included) and the evaluator."""
    accelerator: Accelerator | None = None
    """accelerate's handle on the processes (one without ``accelerate launch``); the trainers
    wrap the policy with ``accelerator.prepare`` (DDP when there are several)."""
    run_dir_existed: bool = False
    """The run directory existed (empty) before this run, see :func:`discard_failed_start`."""
    anchor_texts: list[str] | None = None
    """The text anchor's human texts (:func:`load_anchor_texts`), None when the anchor is off."""
    fluency_model: str | None = None
    """What eval.fluency_model is on this run: its value, or what ``auto`` chose
    (:func:`tether.run.evaluation.fluency_judge`); None before the evaluator is built. The config
    keeps ``auto``, so that a resume decides again."""


def sampling_settings(config: Config, device: torch.device | str | None = None) -> SamplingSettings:
    """The :class:`tether.models.rollouts.SamplingSettings` of a run: its ``rollout.*`` fields by
    name, ``train.sharded_generation``, ``rollout.compile`` as the run can use it (off for DPO,
    whose pairs and probe decode eagerly; ``auto`` off where compiled decoding is not built:
    LoRA, FSDP; ``true`` there is refused by the config) and ``rollout.dtype`` resolved
    (:func:`rollout_dtype`) for the policy's ``device``."""
    r = config.rollout
    not_built = not config.trainer.samples or config.model.lora or config.train.sharding == "fsdp"
    return SamplingSettings(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        max_prompt_tokens=r.max_prompt_tokens,
        stop_strings=tuple(r.stop_strings),
        max_turns=r.max_turns,
        env_format=r.env_format,
        env_timeout=r.env_timeout,
        sharded_generation=config.train.sharded_generation,
        compile=False if r.compile == "auto" and not_built else r.compile,
        dtype=rollout_dtype(config, device),
    )


def rollout_dtype(config: Config, device: torch.device | str | None) -> str:
    """``rollout.dtype`` resolved: ``bf16`` or ``fp32``. ``auto`` is bf16 where the trainer samples
    its rollouts (PPO, GRPO, RLOO), the policy is whole (not FSDP-sharded) and float32 (a
    bfloat16 learner would sample from a bit-identical copy) and decodes on a CPU with bfloat16
    matrix instructions (:func:`tether.models.sampling.bf16_matmul_missing`)."""
    r = config.rollout
    if r.dtype != "auto":
        return r.dtype
    cpu = device is not None and torch.device(device).type == "cpu"
    whole = config.trainer.samples and config.train.sharding != "fsdp"
    fp32 = config.model.dtype in ("auto", "float32")  # auto is float32 on a CPU
    return "bf16" if cpu and whole and fp32 and bf16_matmul_missing() is None else "fp32"


def config_env(config: Config) -> Callable | None:
    """``rollout.env``'s environment, imported by its name, or None without one.

    Raises:
        ValueError: a name that does not import, or the name of an object passed from Python
            (it must be passed again: :func:`tether.models.turns.load_env`).
    """
    if config.rollout.environment_factory:
        return load_environment_factory(config.rollout.environment_factory, config.rollout.tools)
    if config.rollout.tools:
        return load_tools(config.rollout.tools)
    return load_env(config.rollout.env) if config.rollout.env else None


def config_sampler(config: Config, tokenizer, *, device, eager: bool = False) -> Sampler:
    """The sampler a run of ``config`` builds (:func:`run_sampler`), its environment imported by
    name (:func:`config_env`); ``eager``: never compiled (a one-off sampling, the frontier's)."""
    settings = sampling_settings(config, device)
    return make_sampler(
        tokenizer, replace(settings, compile=False) if eager else settings, config_env(config), device=device
    )


def run_sampler(config: Config, tokenizer, *, env: Callable | None, device) -> Sampler:
    """The run's sampler (:func:`tether.models.rollouts.make_sampler`): tool turns with ``env``,
    else one turn, with :func:`sampling_settings`.

    Raises:
        ValueError: ``rollout.compile=true`` where decoding cannot be compiled (the reason named).
    """
    return make_sampler(tokenizer, sampling_settings(config, device), env, device=device)


ROLLOUT_BYTES_PER_TOKEN = 24
"""The least host memory one token of a rollout takes, bytes: its id (int64, 8) and four float32
values per token (logprobs, old_logprobs, ref_logprobs, advantages; 16). A floor: the real step
also holds logits, values and masks."""


def check_rollout_memory(batch_size: int, max_new_tokens: int, max_prompt_tokens: int | None) -> None:
    """Refuse, before anything is built, a rollout whose floor of memory (batch_size x (prompt +
    response tokens) x :data:`ROLLOUT_BYTES_PER_TOKEN`) exceeds this machine's physical memory:
    it could only end in an out-of-memory kill, or hang building the prompt indices.

    Raises:
        ValueError: naming rollout.batch_size, the floor and the memory there is.
    """
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no bound known
        return
    tokens = max_new_tokens + (max_prompt_tokens or 1)
    need = batch_size * tokens * ROLLOUT_BYTES_PER_TOKEN
    if need > memory:
        most = memory // (tokens * ROLLOUT_BYTES_PER_TOKEN)
        raise ValueError(
            f"rollout.batch_size={batch_size}: a step's samples alone need at least {need / 2**30:.1f} GiB "
            f"({tokens} tokens each x {ROLLOUT_BYTES_PER_TOKEN} bytes), more than this machine's "
            f"{memory / 2**30:.1f} GiB; lower rollout.batch_size (at most {most} here, far fewer in "
            "practice) or rollout.max_new_tokens"
        )


def check_launcher(distributed_type: str) -> None:
    """Refuse accelerate's own sharding launch modes (an accelerate config with
    ``distributed_type: FSDP`` or ``DEEPSPEED``) before anything is written: ``accelerator.prepare``
    would wrap the policy in a way tether's rollout, scoring and checkpoints do not gather from.
    tether shards itself (``train.sharding=fsdp``) under a plain multi-process launch.

    Raises:
        ValueError: naming the fix.
    """
    if distributed_type in ("FSDP", "DEEPSPEED"):
        raise ValueError(
            f"accelerate launched tether with distributed_type={distributed_type}: tether does its own "
            "sharding; launch with a MULTI_GPU config (`accelerate launch --multi_gpu --num_processes N`) "
            "and set train.sharding=fsdp (docs/distributed.md, 'Sharded training')"
        )


def check_full_precision(mixed_precision: str) -> None:
    """Refuse accelerate's mixed precision (``accelerate launch --mixed_precision`` or
    ``ACCELERATE_MIXED_PRECISION``) before anything is written.

    ``accelerator.prepare`` would run the update's forward under bf16/fp16 autocast while the old
    and reference log-probs come from the model without it: the seeds' precision mismatch (bf16
    autocast is 0.028 nats per token off fp32 on SmolLM2, docs/performance.md), so the first
    ratio is not 1 and the step-0 KL of the update's forward is not 0. Lower precision is
    ``model.dtype``: the weights themselves, one path for every log-prob.

    Raises:
        ValueError: ``mixed_precision`` is not ``"no"``.
    """
    if mixed_precision != "no":
        raise ValueError(
            f"accelerate's mixed_precision={shown(mixed_precision)} (from `accelerate launch "
            "--mixed_precision` or ACCELERATE_MIXED_PRECISION): tether scores the old and reference "
            "log-probs without autocast, so an autocast update would see a precision mismatch (a first "
            "ratio != 1); run with --mixed_precision no (or unset ACCELERATE_MIXED_PRECISION) and set "
            "the precision with model.dtype=bfloat16"
        )


def resolve_device(name: str, cuda_available: bool | None = None) -> torch.device:
    """The device of ``train.device``: ``auto`` is CUDA when it is available, else the CPU.

    Under ``accelerate launch`` on GPUs each process then takes its own GPU (accelerate's
    ``LOCAL_RANK``); this only decides CPU or CUDA.

    Raises:
        ConfigError: ``cuda`` on a machine where ``torch.cuda.is_available()`` is False.
    """
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if name == "cuda" and not cuda:
        raise ConfigError(
            "train.device=cuda, but torch sees no CUDA device (torch.cuda.is_available() is False; "
            f"torch {torch.__version__} is "
            f"{'a CPU build' if torch.version.cuda is None else 'built for CUDA'}); "
            "use train.device=auto or cpu, or install a CUDA build of torch on a machine with a GPU"
        )
    return torch.device("cuda" if name == "cuda" or (name == "auto" and cuda) else "cpu")


def make_trackers(report_to: list[str]) -> list | None:
    """accelerate's ``log_with`` for ``train.report_to``: the names of accelerate's own trackers, or
    None; a ``module:Class`` tracker is checked here (it imports, it is a ``GeneralTracker``) and
    built when the run starts (:meth:`tether.run.reporting.Reporter.start`), with the run's
    project and name.

    Raises:
        ConfigError: a named tracker's package is not installed, or a class cannot be imported.
    """
    names, _ = resolve_trackers(report_to)
    return names or None


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``model.dtype`` -> torch dtype (``auto``: :func:`resolve_dtype`)."""


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The weight dtype of ``model.dtype``: ``auto`` is bfloat16 on CUDA, float32 on the CPU
    (CPUs without bf16 matrix units run bf16 slower than float32)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def build_run(
    config: Config,
    scorer: Scorer | None = None,
    resume: bool = False,
    model: nn.Module | None = None,
    tokenizer=None,
    *,
    train_dataset=None,
    eval_dataset=None,
    judges: dict | None = None,
    env: Callable | None = None,
) -> Run:
    """Load model, reference, tokenizer, prompts and scorer; create the run directory.

    The config is validated before this is called; data and scorer load before the model so a
    bad prompt file or scorer fails in seconds, not after the model loads.

    Args:
        model: a causal LM object to train instead of loading ``model.name`` (moved to
            ``train.device``; cast to ``model.dtype`` unless that is ``auto``); needs ``tokenizer``
            unless its ``name_or_path`` names a loadable tokenizer.
        tokenizer: the tokenizer to use instead of loading ``model.name``'s.
        train_dataset: prompts instead of ``data.prompts``: a ``datasets.Dataset``, a list of row
            dicts (``data.prompt_column`` and other columns) or a list of prompts; split into train
            and held out by the usual hash.
        judges: field name -> judge already built (``eval.judge``): its columns are checked
            against the data's with the reward's.
        env: the environment object (a callable, as ``rollout.env`` names one) instead of
            importing ``rollout.env``; config.yaml records its name (a resume asks for it again).

    Raises:
        ConfigError, ValueError, FileNotFoundError: a bad input, before any model loads.
    """
    config = record_passed_objects(
        config,
        scorer=scorer,
        model=model,
        tokenizer=tokenizer,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        env=env,
    )
    accelerator, sharded, dtype = start_process(config)
    # 1. the checks that need no weights and no download, each in seconds
    run_dir = check_before_loading(config, resume=resume, model=model, scorer=scorer)
    env = env if env is not None else config_env(config)
    # 2. the data, then the scorer, checked against the data's columns before any model loads
    train_prompts, heldout, scorer = load_data_and_scorer(
        config,
        scorer=scorer,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        judges=judges,
        device=accelerator.device,
        env=env,
    )
    apply_template_kwargs(config, scorer, (train_prompts, heldout))
    anchor_texts = load_anchor_texts(config)
    config, path = resolve_model_source(config, model=model, tokenizer=tokenizer)
    barrier()  # every process checked the folder before the first one writes into it
    existed = run_dir.exists()
    writer = claim_run_dir(run_dir)
    try:
        if not resume and is_main():
            dump_config(config, run_dir / "config.yaml")
        for w in config.placement.warnings:
            log.warning("tether: warning: %s", w)
        # 3. the tokenizer and the prompts' lengths; 4. the policy and its frozen reference
        tokenizer = load_run_tokenizer(config, path, tokenizer, tools=getattr(env, "schemas", None))
        config = check_prompts_fit(config, tokenizer, model=model, path=path, parts=(train_prompts, heldout))
        check_env_format(config, tokenizer, parts=(train_prompts, heldout), env=env)
        policy, reference, forwards = load_policy_and_reference(
            config, model=model, path=path, dtype=dtype, device=accelerator.device, sharded=sharded
        )
        reference_fingerprint = fingerprint(reference) if reference is not None else None
        if sharded:  # after the checks and the fingerprint, which read the whole weights
            shard_model(policy, policy.lm)
            if reference is not None:
                shard_model(reference, reference)
        sampler = run_sampler(config, tokenizer, env=env, device=next(policy.parameters()).device)
        return Run(
            config,
            policy,
            reference=reference,
            tokenizer=tokenizer,
            scorer=scorer,
            train_prompts=train_prompts,
            heldout_prompts=heldout,
            writer=writer,
            reference_fingerprint=reference_fingerprint,
            reference_forwards=forwards,
            accelerator=accelerator,
            run_dir_existed=existed,
            sampler=sampler,
            anchor_texts=anchor_texts,
        )
    except BaseException:
        release_lock(writer.lock)
        if not resume and is_main():
            discard_failed_start(run_dir, existed)
        raise


def record_passed_objects(
    config: Config, *, scorer, model, tokenizer, train_dataset, eval_dataset=None, env=None
) -> Config:
    """The config as config.yaml records it when Python passed objects in place of fields (a
    model, a dataset, a reward): a copy naming them, so a resume asks for them again.

    Raises:
        ValueError: a model object that names no folder to load a tokenizer from, without one.
    """
    if model is not None or train_dataset is not None:
        config = copy.deepcopy(config)
        if model is not None:
            config.model.name = getattr(model, "name_or_path", "") or "(a model object passed to train)"
            if tokenizer is None and not getattr(model, "name_or_path", ""):
                raise ValueError(
                    "train(model=...): the model names no folder to load a tokenizer from; pass tokenizer=..."
                )
        if train_dataset is not None:
            config.data.prompts = "(a train_dataset passed to train)"
    if eval_dataset is not None:
        spec = config.data.eval_prompts
        if spec is not None and spec != "(an eval_dataset passed to train)":
            raise ValueError(
                f"train(eval_dataset=...) and data.eval_prompts={shown(spec)} both give a held-out set; "
                "give one of them"
            )
        config = copy.deepcopy(config)
        config.data.eval_prompts = "(an eval_dataset passed to train)"
    if env is not None and not getattr(env, "tool_calls", False):  # tools are named in rollout.tools
        config = copy.deepcopy(config)
        config.rollout.env = python_object_spec(env)
    given = config.reward._given("scorer")
    if scorer is not None and given is not None:
        specs = given if isinstance(given, list) else [given]
        if not all(isinstance(x, str) and x.startswith(PYTHON_SCORER) for x in specs):
            # config.yaml would name the config's reward while the run trains on the object, and a
            # resume from the command line would go on with another reward
            raise ValueError(
                f"train(scorer=...) and reward.scorer={shown(given)} both give the reward; give one of them "
                "(reward.scorer=null to pass it from Python)"
            )
    if scorer is not None:
        config = copy.deepcopy(config)  # config.yaml names the objects, so a resume asks for them
        config.reward.scorer = python_scorer_spec(scorer)
    return config


def start_process(config: Config) -> tuple[Accelerator, bool, torch.dtype]:
    """This process's threads, device, trackers and seed: ``(accelerator, sharded, dtype)``, where
    ``sharded`` says FSDP shards the models over processes and ``dtype`` is their weights'.

    Every tensor lives on the accelerator's device: this process's GPU (NCCL between processes)
    or the CPU (gloo); docs/distributed.md.
    """
    if config.train.threads:
        torch.set_num_threads(config.train.threads)
    device = resolve_device(config.train.device)
    trackers = make_trackers(config.train.report_to)
    # a tracker that writes files (tensorboard) needs a folder now; the run's is set before init_trackers
    accelerator = Accelerator(
        cpu=device.type == "cpu", log_with=trackers, project_dir=config.train.output_dir or "runs"
    )
    sharded = config.train.sharding == "fsdp" and accelerator.num_processes > 1
    # FSDP shards float32 weights (the config refuses a low-precision model.dtype with it)
    dtype = torch.float32 if sharded else resolve_dtype(config.model.dtype, accelerator.device)
    check_full_precision(accelerator.mixed_precision)
    check_launcher(str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)))
    check_world_size(config, accelerator.num_processes)
    seed_everything(config.train.seed)
    return accelerator, sharded, dtype


def check_before_loading(config: Config, *, resume: bool, model, scorer) -> Path:
    """The checks that need no weights and no download: the run folder (new, or a run to resume
    with no symbolic link in it and the settings it must keep), the rollout's memory, the model's,
    scorers' and judges' names (a module:function imports here), a model object's LoRA dropout.
    Returns the run folder (rank 0's name).

    Raises:
        FileExistsError, FileNotFoundError, ConfigError, ValueError: naming the field and the fix.
    """
    run_dir = Path(config.train.output_dir) if config.train.output_dir else default_run_dir(config.train.algo)
    run_dir = gather_objects(run_dir)[0]  # rank 0's (a default name holds the time)
    if not resume and run_dir.exists() and any(run_dir.iterdir()):
        hint = (
            f" or continue it with: tether train --resume {run_dir}"
            if (run_dir / "checkpoints").exists()
            else ""
        )
        raise FileExistsError(
            f"train.output_dir={run_dir} already holds a run (it is not empty); "
            f"choose another directory{hint}"
        )
    if resume:  # nothing of the folder is read or written through a link (policy/, checkpoints/ ...)
        check_no_links(run_dir, "--resume")
    if resume and not (run_dir / "config.yaml").exists():
        raise FileNotFoundError(f"--resume {run_dir}: not a tether run directory (no config.yaml)")
    if resume:
        check_resume_keeps(config, run_dir / "config.yaml")
    r = config.rollout
    check_rollout_memory(r.batch_size, r.max_new_tokens, r.max_prompt_tokens)
    if model is None:
        check_model_name(config.model.name, config.model.revision)
    else:
        check_passed_peft_model(model)
    if scorer is None:
        check_scorer_spec(config.reward.scorer)
    if config.eval.fluency_model not in ("none", "auto") and (config.eval.n_prompts or config.eval.every):
        check_model_name(config.eval.fluency_model, field_name="eval.fluency_model")
    return run_dir


def load_data_and_scorer(
    config: Config, *, scorer, train_dataset, judges: dict | None, device, eval_dataset=None, env=None
) -> tuple[PromptData, PromptData, Scorer]:
    """The training and held-out prompts (a user's file reads in seconds; the embedded prompts
    download once) and the reward: reward.scorer, or TRL's reward_funcs from Python (a callable,
    a reward model, (model, tokenizer), or a list of them), counted against reward.weights; a
    reward model runs on ``device``. The reward and the judges are checked against the data's
    columns (and integer answers) here, before any model loads. An ``environment_factory`` whose
    objects own a reward (``get_reward``) adds it, named after their class, at weight 1 (TRL's
    rule), or is the reward where none is given."""
    train_prompts, heldout = (
        load_prompts(config) if train_dataset is None else dataset_prompts(train_dataset, config)
    )
    evaluation = eval_set(config, eval_dataset)
    field = "eval_dataset" if eval_dataset is not None else "data.eval_prompts"
    if evaluation is not None:  # the user's held-out set: train on everything else
        check_same_format(train_prompts, evaluation, field)
        train_prompts, heldout = train_on_the_rest(train_prompts, heldout, evaluation), evaluation
    else:  # the hash share is the evaluation set: each prompt once (its copies trained on nothing)
        source = "train_dataset" if train_dataset is not None else "data.prompts"
        heldout = unique_prompts(heldout, f"{source} (its held-out share)")
    own = getattr(env, "has_reward", False)  # environment_factory's get_reward
    if own and scorer is None and config.reward._given("scorer") is None:
        scorer = WeightedReward({env.kind.__name__: env.rewards})
    else:
        scorer = make_scorer(
            config.reward.scorer if scorer is None else scorer, config.reward.weights, device=device
        )
        if own:
            parts = scorer.scorers if isinstance(scorer, WeightedReward) else {scorer_name(scorer): scorer}
            weights = scorer.weights if isinstance(scorer, WeightedReward) else [1.0]
            scorer = WeightedReward({**parts, env.kind.__name__: env.rewards}, [*weights, 1.0])
    turns = config.rollout.multi_turn
    factory = hasattr(env, "begin")
    for part, where in ((train_prompts, "data.prompts"), (evaluation, field)):
        if factory and part is not None and ENVIRONMENTS in (part.columns or {}):
            raise ValueError(
                f"{where}: a column is named {ENVIRONMENTS!r}, the keyword under which a reward gets "
                "environment_factory's objects; rename the column"
            )
    extra = {ENVIRONMENTS: []} if factory else {}
    check_scorer_columns(scorer, {**train_prompts.columns, **extra}, multi_turn=turns)
    if evaluation is not None:
        check_scorer_columns(scorer, {**heldout.columns, **extra}, data_field=field, multi_turn=turns)
    check_integer_answers(scorer, train_prompts, heldout)
    for field_name, judge in (judges or {}).items():
        check_scorer_columns(judge, train_prompts.columns, field_name, multi_turn=turns)
        if evaluation is not None:  # a judge reads the held-out prompts alone
            check_scorer_columns(judge, heldout.columns, field_name, data_field=field, multi_turn=turns)
    return train_prompts, heldout, scorer


def load_anchor_texts(config: Config) -> list[str] | None:
    """The text anchor's texts (``anchor.texts``: builtin, or a source as ``data.prompts`` takes
    with ``anchor.column``), or None when the anchor is off.

    Raises:
        ValueError: a row that is not text (a conversation), or no text at all; the field named.
        FileNotFoundError: no such source (from :func:`tether.data.prompts.load_prompt_data`).
    """
    a = config.anchor
    if not a.on:
        return None
    if a.texts == "builtin":
        return anchor_texts()
    try:
        data = load_prompt_data(a.texts, "train", a.column)
    except (ValueError, FileNotFoundError) as e:  # its message names data.*: the fields here are anchor.*
        msg = str(e)
        for theirs, ours in (
            ("data.prompt_column", "anchor.column"),
            ("data.split", "anchor.texts"),
            ("data.prompts", "anchor.texts"),
            ("holds no prompts", "holds no text"),
            ("the one that holds the prompts", "the one that holds the text"),
            (" or a list of {role, content} messages", ""),
        ):
            msg = msg.replace(theirs, ours)
        raise type(e)(msg) from None
    texts = list(data.prompts)
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise ValueError(
            f"anchor.texts={a.texts}: row {bad} of anchor.column={a.column} is not text "
            f"({type(texts[bad]).__name__}); the anchor takes plain human text"
        )
    if not texts:
        raise ValueError(f"anchor.texts={a.texts}: no text")
    return texts


def resolve_model_source(config: Config, *, model, tokenizer) -> tuple[Config, Path | None]:
    """The folder the model (or its tokenizer) loads from, resolved before anything is written (a
    bad id costs nothing), or None when both objects were passed. A Hub id without
    model.revision gets the snapshot's commit in the returned config, so --resume rebuilds this
    very model."""
    if model is not None and tokenizer is not None:
        return config, None
    source = getattr(model, "name_or_path", None) if model is not None else None
    path = Path(source) if source else resolve_model_path(config.model.name, config.model.revision)
    if model is None and is_hub_id(config.model.name) and config.model.revision is None:
        config = copy.deepcopy(config)
        config.model.revision = path.name
    return config, path


def claim_run_dir(run_dir: Path) -> RunWriter:
    """One writer per run: rank 0 takes the folder's lock before anything is written, reads or
    makes the run's id (:func:`tether.run.files.run_id`), and every process learns whether it
    could (so that all stop together, none waits at a barrier).
    Returns the folder's writer, holding the lock (``writer.lock``) and the id (``writer.run_id``;
    both None on other ranks).

    Raises:
        RunLocked: another process holds the run; ValueError: its run.json is damaged; OSError:
            the folder cannot be written.
    """
    held, refused, rid = None, None, None
    if is_main():
        try:
            held, note = acquire_lock(run_dir)
            if note:
                print(note)
            rid = run_id(run_dir)
        except (RunLocked, ValueError, OSError) as e:
            release_lock(held)
            refused = e
    refused = gather_objects(refused)[0]  # every process raises rank 0's error
    if refused is not None:
        raise refused
    writer = RunWriter(run_dir)
    writer.lock, writer.run_id = held, rid
    return writer


def load_run_tokenizer(config: Config, path: Path | None, tokenizer=None, *, tools: list[dict] | None = None):
    """The run's tokenizer: ``tokenizer`` if given, else model.name's (from ``path``), with a
    padding token and left padding (:func:`tether.models.loading.prepare_tokenizer`) and, with
    data.chat_template, the chat template applied to prompts; data.chat_template_kwargs and the
    tools' schemas (``tools``, rollout.tools: the template's ``tools``) given to the template."""
    if tokenizer is None:
        tokenizer = load_model_part(load_tokenizer, config.model.name, path, config.model.trust_remote_code)
    prepare_tokenizer(tokenizer)
    if config.data.chat_template:
        use_chat_template(tokenizer)
    set_template_kwargs(
        tokenizer, {**config.data.chat_template_kwargs, **({"tools": tools} if tools else {})}
    )
    return tokenizer


def apply_template_kwargs(config: Config, scorer, parts) -> None:
    """``data.chat_template_kwargs`` where tether renders chat: checked to have an effect (a
    template renders the prompts: conversations, or data.chat_template), and given to each reward
    model's tokenizer (TRL renders a reward model's conversations with them too).

    Raises:
        ConfigError: the variables are set and every prompt is text with data.chat_template false.
    """
    kwargs = config.data.chat_template_kwargs
    if not kwargs:
        return
    if config.pairs_file:  # DPO renders its pairs' prompts and responses (the template's tokens)
        parts = (*parts, pair_prompts(config.dpo.pairs, config.data.split, config.data.config))
    if not config.data.chat_template and not any(is_conversational(list(p.prompts[:1])) for p in parts if p):
        raise ConfigError(
            f"data.chat_template_kwargs={shown(kwargs)} would change nothing: the prompts are text and "
            "data.chat_template is false, so no chat template renders them; set data.chat_template=true "
            "(or give conversations), or drop data.chat_template_kwargs"
        )
    for s in getattr(scorer, "scorers", {}).values() if isinstance(scorer, WeightedReward) else [scorer]:
        if isinstance(s, RewardModelScorer):
            set_template_kwargs(s.tokenizer, kwargs)


def check_prompts_fit(config: Config, tokenizer, *, model, path: Path | None, parts) -> Config:
    """Every prompt (of ``parts`` and DPO's pairs file) within rollout.max_prompt_tokens and,
    with rollout.max_new_tokens, the model's context; returns the config with
    rollout.max_prompt_tokens filled (the longest prompt) when it was left unset.

    Raises:
        ValueError: a prompt too long, named by its line.
    """
    context = model_context(model.config if model is not None else path, config.model.trust_remote_code)
    pairs = config.pairs_file
    longest = check_prompt_lengths(
        tokenizer,
        [p for part in parts for p in part.prompts]
        + (pair_prompts(config.dpo.pairs, config.data.split, config.data.config).prompts if pairs else []),
        config.rollout.max_prompt_tokens,
        None if config.data.prompts in (DEFAULT_PROMPTS, *TASKS) else config.data.prompts,
        room=(context, config.rollout.max_new_tokens) if context else None,
    )
    return fill_max_prompt_tokens(config, longest, context)


def check_env_format(config: Config, tokenizer, *, parts, env: Callable | None = None) -> None:
    """With rollout.env, the format every prompt's turns take (rollout.env_format) is one that can
    be exact, before any weights load: all chat or all raw, raw turns with stop strings, an
    environment that takes its keywords and the dataset columns it names
    (:func:`tether.models.turns.env_column_names`), and a chat template that renders an
    assistant's text verbatim before a tool message (with spaces and newlines at its ends).

    Raises:
        ValueError: the first of these that fails, naming the field and the fix
            (:func:`tether.models.turns.generate_turns` raises the same at sampling time).
    """
    r = config.rollout
    if not r.multi_turn:
        return
    prompts = [p for part in parts for p in part.prompts]
    env = env if env is not None else config_env(config)
    chat = (
        tool_turn_formats(tokenizer, prompts, r.env_format)
        if getattr(env, "tool_calls", False)
        else turn_formats(tokenizer, prompts, r.env_format, r.stop_strings, r.max_turns)
    )
    # the held-out part comes from data.eval_prompts (or eval_dataset) when one is given
    held_out = config.data.eval_prompts
    if held_out is None:
        held_out = "data.prompts"
    elif held_out.startswith("(an eval_dataset"):
        held_out = "eval_dataset"
    else:
        held_out = "data.eval_prompts"
    for part, field_name in zip(parts, ["data.prompts"] + [held_out] * (len(parts) - 1)):
        names = list(getattr(part, "columns", None) or {})  # the environment takes its keywords
        env_column_names(env, names)  # and the columns it names
        if ENV_REPLIES in names:  # the reward's keyword of that name holds what the environment wrote
            raise ValueError(
                f"{field_name}: a column is named {ENV_REPLIES!r}, the keyword under which a reward gets "
                "what rollout.env wrote in a multi-turn run; rename the column"
            )
    if getattr(env, "tool_calls", False):  # chat prompts (tool_turn_formats); the template carries tools
        tool_template(tokenizer)
    elif chat and chat[0]:  # the template must carry a tool message after the assistant's text
        # an assistant's text as a policy writes it: spaces and newlines at its ends (a template
        # that trims them cannot carry a turn verbatim)
        for content in ("2 + 3 =", " 2 + 3 = ", "\n2 + 3 =\n"):
            chat_reply_text(tokenizer, prompt_messages(prompts[0]), content, "5")


def load_run_lm(config: Config, *, path: Path | None, dtype: torch.dtype, device) -> nn.Module:
    """model.name's causal LM from ``path`` in ``dtype`` on ``device`` (its failure named)."""
    lm = load_model_part(load_causal_lm, config.model.name, path, dtype, config.model.trust_remote_code)
    return lm.to(device)


def load_policy_and_reference(
    config: Config, *, model, path: Path | None, dtype: torch.dtype, device, sharded: bool
) -> tuple[PolicyWithValue, nn.Module | None, list[int]]:
    """The policy (``model`` or model.name's LM, LoRA adapters added, lower blocks frozen, a value
    head) and the frozen reference where the run needs one (a copy, or the LoRA model's base),
    checked equal to the policy at step 0. Returns ``(policy, reference, forwards)``, where
    ``forwards[0]`` counts the reference's forwards (``kl/reference_forwards``)."""
    if model is not None:  # the caller's object: dropout off, eval mode, on the device
        lm = disable_dropout(model).eval().to(device)
        if config.model.dtype != "auto":
            lm = lm.to(dtype)
    else:
        lm = load_run_lm(config, path=path, dtype=dtype, device=device)
    m = config.model
    if m.lora:  # a peft model: the policy trains adapters, the reference reuses its frozen base
        lm = add_lora(lm, m.lora_r, m.lora_alpha, m.lora_target_modules, m.adapter)
    needs_reference = config.placement.needs_reference or config.trainer.needs_reference or config.anchor.on
    reference = make_reference(lm) if needs_reference else None
    forwards = [0]
    if reference is not None:
        # count on the trunk: every path (scoring, generation) runs it exactly once per forward
        count_reference_forwards(reference, forwards)
    freeze_lower_layers(lm, config.model.layers_to_train)
    # rows share prompts only in groups; otherwise the prefix pass would be one trunk call more
    # (and not under FSDP: whether a batch takes the prefix pass depends on its own prompts, and
    # every process must run the same number of block forwards there)
    share_prefix = (
        m.share_prompt_prefix
        and config.rollout.group_size > 1
        and not m.gradient_checkpointing
        and not sharded
    )
    policy = PolicyWithValue(
        lm,
        head_chunk=config.model.head_chunk_size,
        share_prefix=share_prefix,
        gradient_checkpointing=m.gradient_checkpointing,  # the policy's only: after the reference's copy
        # FSDP: every process must run the same block forwards, and a replay skips them
        replay_frozen=m.replay_frozen_blocks and not sharded,
    )
    policy.value_head.to(device)  # float32 whatever the LM's dtype
    if reference is not None:
        check_reference(policy, reference)
    return policy, reference, forwards


def discard_failed_start(run_dir: Path, existed: bool) -> None:
    """Remove what a run that failed before its first step wrote (config.yaml, the reference's
    evaluation ...), so the same command can be run again once the input is fixed.

    The folder was empty or absent when the run started, but a person may have put files in it
    since (notes, an analysis, while the first step ran): only what tether writes goes
    (:func:`tether.run.folder.tether_entry`, its lock last), and the folder itself only when
    nothing else is left and it did not exist before. A folder kept for other files is said so,
    with what they are and why the same command will refuse it.
    """
    if not run_dir.is_dir() or run_dir.is_symlink():
        return
    theirs, lock = [], []
    for child in sorted(run_dir.iterdir()):
        if not tether_entry(child.name):
            theirs.append(child.name + ("/" if child.is_dir() and not child.is_symlink() else ""))
        elif child.name.startswith(".tether.lock"):
            lock.append(child)
        else:
            remove_tree(child)
    for child in lock:  # the folder stays claimed until the rest of tether's files are gone
        remove_tree(child)
    if theirs:
        more = f", and {len(theirs) - 5} more" if len(theirs) > 5 else ""
        log.warning(
            "tether: kept %s, which holds files tether did not write (%s%s): put there while the run "
            "started, they are not tether's to delete; tether's own files are removed. A new run refuses a "
            "folder that is not empty, so the same command will refuse this one: move them out of it (or "
            "choose another train.output_dir), then run it again",
            run_dir,
            ", ".join(theirs[:5]),
            more,
        )
    elif not existed:
        try:
            run_dir.rmdir()
        except OSError:  # something appeared meanwhile: kept
            pass
