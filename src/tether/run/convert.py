"""``tether convert recipe.yaml --trainer grpo``: a TRL recipe as tether's config, key by key.

A TRL recipe (the YAML of ``trl grpo --config``, ``trl rloo``, ``trl dpo``: ``GRPOConfig`` /
``RLOOConfig`` / ``DPOConfig`` fields, transformers' ``TrainingArguments``, and the script's
``ScriptArguments`` and ``ModelConfig``) has a fate for every key:

- **mapped**: the same setting under tether's name (``learning_rate`` -> ``optim.lr``);
- **computed**: tether's fields from several of TRL's, with the arithmetic said (batch sizes,
  steps, the warmup ratio);
- **moot**: nothing to set: tether always does it (``disable_dropout``), or the value is the one
  that changes nothing here (``use_vllm: false``, ``top_p: 1.0``);
- **refused**: no tether field does it, with the reason.

A recipe with a refused key is written only with ``allow_dropped`` (``--allow-dropped``): the
run would differ from the recipe's there, and the written YAML's header says where. Nothing in
the recipe runs: it is read as YAML data (:func:`tether.run.config.read_yaml`).

Sizes assume one process (``processes``: TRL's per-device sizes times the processes are
tether's global ones). Units: ``max_steps``, ``save_steps`` and ``eval_steps`` count TRL's
optimizer steps, ``train.steps`` tether's rollouts (each ``optim.epochs`` x ``rollout.batch_size /
optim.minibatch_size`` optimizer steps), so ``train.steps = max_steps / (num_iterations x
steps_per_generation / gradient_accumulation_steps)``, refused when that is not a whole number
(:func:`_sizes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRAINERS = ("grpo", "rloo", "dpo")
"""The TRL trainers whose recipes convert."""


@dataclass
class Fate:
    """What became of one recipe key."""

    key: str
    value: Any
    kind: str  # mapped, computed, moot, refused
    why: str = ""
    fields: dict[str, Any] = field(default_factory=dict)


class RecipeError(ValueError):
    """A recipe that is not a mapping of TRL keys, or a trainer tether does not convert."""


def _same(name: str):
    """A rule mapping the value to tether field ``name`` unchanged."""
    return lambda v, r, t: ("mapped", {name: v}, "")


def _moot_if(default, why: str, refuse: str):
    """Moot when the value is ``default`` (TRL's value that changes nothing here), else refused."""

    def rule(v, r, t):
        if v == default or (isinstance(default, tuple) and v in default):
            return "moot", {}, why
        return "refused", {}, refuse

    return rule


def _moot_if_no_vllm(v, r, t):
    """TRL's ``vllm_importance_sampling_*``: read only with ``use_vllm`` (refused itself)."""
    if not r.get("use_vllm"):
        return "moot", {}, "TRL applies it only with use_vllm"
    return (
        "refused",
        {},
        "tether's sampler is not vLLM: rollout.dtype=bf16 samples from a bfloat16 copy, corrected by "
        "rollout.correction (tis: token_truncate, mis: sequence_mask with clip_min 1/cap) and "
        "rollout.correction_cap",
    )


def _refused(why: str):
    return lambda v, r, t: ("refused", {}, why)


def _moot(why: str):
    return lambda v, r, t: ("moot", {}, why)


def _beta(v, r, t):
    if t == "dpo":
        return "mapped", {"dpo.beta": v}, ""
    return (
        "mapped",
        {"kl.kl_coef": v, "kl.controller": "fixed"},
        "a fixed beta, as TRL's (tether's default is the budget leash)",
    )


def _dtype(v, r, t):
    names = {
        "bfloat16": "bfloat16",
        "bf16": "bfloat16",
        "float32": "float32",
        "fp32": "float32",
        "auto": "auto",
    }
    if v in names:
        return "mapped", {"model.dtype": names[v]}, ""
    return "refused", {}, f"model.dtype takes auto, float32, bfloat16 or float16, not {v!r}"


def _bf16(v, r, t):
    return (
        ("mapped", {"model.dtype": "bfloat16"}, "") if v else ("moot", {}, "float32 is tether's CPU default")
    )


def _scale_rewards(v, r, t):
    if v in (True, "group"):
        return "mapped", {"grpo.scale_by_std": True}, ""
    if v in (False, "none"):
        return "mapped", {"grpo.scale_by_std": False}, ""
    return "refused", {}, f"scale_rewards={v!r}: tether scales by each group's std or not at all"


def _loss_type(v, r, t):
    if t == "dpo":
        ok = v == "sigmoid" or v == ["sigmoid"]
        return (
            ("moot", {}, "tether's DPO loss is sigmoid")
            if ok
            else ("refused", {}, "tether's DPO loss is sigmoid only")
        )
    if v == "dapo":
        return "moot", {}, "tether's loss is the token mean over the minibatch's valid tokens, TRL's dapo"
    return "refused", {}, f"loss_type={v!r}: tether's loss is dapo's token mean only"


def _scheduler(v, r, t):
    if v in ("constant", "linear", "cosine"):
        return "mapped", {"optim.lr_scheduler": v}, ""
    return "refused", {}, f"optim.lr_scheduler is constant, linear or cosine, not {v!r}"


def _save_steps(v, r, t):
    if r.get("save_strategy", "steps") == "no":
        return "moot", {}, "save_strategy is no"
    return _in_steps("train.checkpoint_every", "a checkpoint")(v, r, t)


def _save_strategy(v, r, t):
    if v == "no":
        return "mapped", {"train.checkpoint_every": 0}, ""
    if v == "steps":
        return "moot", {}, "tether checkpoints every train.checkpoint_every steps (save_steps)"
    return "refused", {}, f"save_strategy={v!r}: tether counts steps, not epochs"


def _eval_steps(v, r, t):
    if r.get("eval_strategy", r.get("evaluation_strategy", "no")) != "steps":
        return "moot", {}, "eval_strategy is not steps"
    return _in_steps("eval.every", "tether's periodic held-out evaluation")(v, r, t)


def _eval_strategy(v, r, t):
    if v in ("no", "steps"):
        return "moot", {}, "eval.every (eval_steps) sets tether's periodic evaluation"
    return "refused", {}, f"eval_strategy={v!r}: tether counts steps, not epochs"


def _dataset(v, r, t):
    return "mapped", {"dpo.pairs" if t == "dpo" else "data.prompts": v}, ""


def _use_peft(v, r, t):
    if not v:
        return "moot", {}, "no LoRA"
    return (
        "computed",
        {"model.lora_r": int(r.get("lora_r", 16))},
        "LoRA: model.lora_r from lora_r (TRL's 16 if unset)",
    )


def _lora(name: str):
    def rule(v, r, t):
        if not r.get("use_peft"):
            return "moot", {}, "use_peft is not set"
        if name == "model.lora_r":
            return "moot", {}, "set with use_peft"
        return "mapped", {name: v}, ""

    return rule


def _lora_dropout(v, r, t):
    if not v or not r.get("use_peft"):
        return "moot", {}, "no LoRA dropout"
    return (
        "refused",
        {},
        "tether trains with every dropout off (the first PPO ratio 1, the step-0 KL 0 with no policy change)",
    )


def _reward_funcs(v, r, t):
    names = [v] if isinstance(v, str) else list(v)
    specs = []
    for n in names:
        if ":" in n:
            specs.append(n)
        elif "." in n:  # TRL's dotted path module.function
            module, _, fn = n.rpartition(".")
            specs.append(f"{module}:{fn}")
        else:  # one of TRL's own reward functions (trl.rewards)
            specs.append(f"trl.rewards:{n}")
    return (
        "mapped",
        {"reward.scorer": specs if len(specs) > 1 else specs[0]},
        "TRL's names as module:function",
    )


def _num_train_epochs(v, r, t):
    if r.get("max_steps", -1) not in (None, -1):
        return "moot", {}, "max_steps is set, which TRL follows"
    return "refused", {}, "tether counts steps (train.steps): give max_steps"


def _count(recipe: dict, key: str, default: int | None = None) -> int:
    """``recipe[key]`` (or ``default``) as a count: a whole number >= 1.

    Raises:
        RecipeError: anything else (text, a fraction, zero), naming the key.
    """
    v = recipe.get(key, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or int(v) < 1:
        raise RecipeError(f"{key}={v!r}: a whole number >= 1")
    return int(v)


def _sizes(recipe: dict, trainer: str, processes: int) -> tuple[dict, list[str], str | None]:
    """tether's batch fields and train.steps from TRL's sizes; the arithmetic, and a refusal.

    TRL (GRPO, RLOO) draws a generation of ``per_device_train_batch_size x processes x
    steps_per_generation`` completions every ``steps_per_generation x num_iterations``
    micro-steps, and an optimizer step is ``gradient_accumulation_steps`` micro-steps; a tether
    step draws ``rollout.batch_size`` completions and takes ``optim.epochs x rollout.batch_size /
    optim.minibatch_size`` optimizer steps on them.

    Raises:
        RecipeError: a size that is not a whole number >= 1, or a warmup ratio outside [0, 1).
    """
    per_device = _count(recipe, "per_device_train_batch_size", 8)
    accumulate = _count(recipe, "gradient_accumulation_steps", 1)
    out: dict[str, Any] = {
        "optim.micro_batch_size": per_device,
        "optim.minibatch_size": per_device * processes * accumulate,
    }
    said = [
        f"optim.micro_batch_size = per_device_train_batch_size = {per_device}",
        f"optim.minibatch_size = per_device_train_batch_size x processes x gradient_accumulation_steps "
        f"= {per_device} x {processes} x {accumulate} = {out['optim.minibatch_size']}",
    ]
    if trainer == "dpo":
        out["rollout.batch_size"] = out["optim.minibatch_size"]
        out["optim.epochs"] = 1
        said.append("rollout.batch_size = the pairs of one optimizer step; optim.epochs = 1")
        per_rollout = 1
    else:
        if "generation_batch_size" in recipe and "steps_per_generation" in recipe:
            return out, said, "give generation_batch_size or steps_per_generation, not both (as TRL)"
        if "generation_batch_size" in recipe:  # TRL: steps_per_generation = it / (per device x processes)
            gen = _count(recipe, "generation_batch_size")
            if gen % (per_device * processes):
                return (
                    out,
                    said,
                    (
                        f"generation_batch_size={gen} is not a multiple of per_device_train_batch_size x "
                        f"processes = {per_device * processes}"
                    ),
                )
            steps_per_generation = gen // (per_device * processes)
        else:
            steps_per_generation = _count(recipe, "steps_per_generation", accumulate)
        out["rollout.batch_size"] = per_device * processes * steps_per_generation
        out["optim.epochs"] = _count(recipe, "num_iterations", 1)
        said.append(
            f"rollout.batch_size = per_device_train_batch_size x processes x steps_per_generation = "
            f"{per_device} x {processes} x {steps_per_generation} = {out['rollout.batch_size']}"
        )
        if steps_per_generation % accumulate:
            return (
                out,
                said,
                (
                    f"steps_per_generation={steps_per_generation} is not a multiple of "
                    f"gradient_accumulation_steps={accumulate}: an optimizer step would take completions of "
                    "two generations, which a tether step never does"
                ),
            )
        per_rollout = steps_per_generation // accumulate * out["optim.epochs"]
        said.append(
            f"optimizer steps a step = num_iterations x steps_per_generation / gradient_accumulation_steps "
            f"= {out['optim.epochs']} x {steps_per_generation} / {accumulate} = {per_rollout}"
        )
    if recipe.get("max_steps") not in (None, -1):
        max_steps = _count(recipe, "max_steps")
        if max_steps % per_rollout:
            return (
                out,
                said,
                (
                    f"max_steps={max_steps} optimizer steps is not a whole number of tether steps of "
                    f"{per_rollout} optimizer steps each"
                ),
            )
        out["train.steps"] = max_steps // per_rollout
        said.append(f"train.steps = max_steps / {per_rollout} = {out['train.steps']}")
        ratio = recipe.get("warmup_ratio")
        if ratio:
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
                raise RecipeError(f"warmup_ratio={ratio!r}: a number in [0, 1)")
            out["optim.warmup_steps"] = math.ceil(float(ratio) * max_steps)
            said.append(
                f"optim.warmup_steps = ceil(warmup_ratio x max_steps) = ceil({ratio} x {max_steps}) = "
                f"{out['optim.warmup_steps']} (transformers' rule)"
            )
    out["(optimizer steps a step)"] = per_rollout
    return out, said, None


PER_STEP = "(optimizer steps a step)"
"""The key under which :func:`convert` hands the rules TRL's optimizer steps per tether step."""


def _in_steps(field: str, what: str):
    """A rule for a count of TRL's optimizer steps (``save_steps``, ``eval_steps``): tether's
    ``field`` counts its steps, each :data:`PER_STEP` optimizer steps, so the count is divided
    (rounded up: a checkpoint or an evaluation no later than TRL's)."""

    def rule(v, r, t):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ValueError(f"{v!r} is not a count of steps")
        per = r.get(PER_STEP) or 1
        n = math.ceil(v / per)
        why = f"{what}: ceil({v} TRL optimizer steps / {per} a tether step) = {n} tether steps"
        return ("computed" if per > 1 else "mapped"), {field: n}, why

    return rule


SIZE_KEYS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "generation_batch_size",
    "num_iterations",
    "max_steps",
    "warmup_ratio",
)
"""The keys :func:`_sizes` reads together."""

RULES = {
    # ScriptArguments and ModelConfig
    "model_name_or_path": _same("model.name"),
    "model_revision": _same("model.revision"),
    "trust_remote_code": _same("model.trust_remote_code"),
    "dtype": _dtype,
    "torch_dtype": _dtype,
    "attn_implementation": _refused("tether loads the model's default attention"),
    "use_peft": _use_peft,
    "lora_r": _lora("model.lora_r"),
    "lora_alpha": _lora("model.lora_alpha"),
    "lora_target_modules": _lora("model.lora_target_modules"),
    "lora_dropout": _lora_dropout,
    "lora_task_type": _moot_if(
        "CAUSAL_LM", "tether's LoRA is for causal LMs", "tether's LoRA is CAUSAL_LM only"
    ),
    "load_in_4bit": _moot_if(False, "not quantized", "tether does not train quantized models"),
    "load_in_8bit": _moot_if(False, "not quantized", "tether does not train quantized models"),
    "dataset_name": _dataset,
    "dataset_config": _same("data.config"),
    "dataset_train_split": _same("data.split"),
    "dataset_test_split": _refused(
        "tether holds out a hash share of the training prompts, or data.eval_prompts (another source)"
    ),
    "reward_funcs": _reward_funcs,
    "reward_weights": _same("reward.weights"),
    "reward_model_name_or_path": lambda v, r, t: ("mapped", {"reward.scorer": f"hf:{v}"}, ""),
    "chat_template_kwargs": _same("data.chat_template_kwargs"),
    # the trainers' configs
    "learning_rate": _same("optim.lr"),
    "beta": _beta,
    "num_generations": _same("rollout.group_size"),
    "max_completion_length": _same("rollout.max_new_tokens"),
    "max_prompt_length": _same("rollout.max_prompt_tokens"),
    "temperature": _same("rollout.temperature"),
    "top_p": _moot_if(1.0, "plain softmax sampling", "tether samples plain softmax(logits / T)"),
    "top_k": _moot_if((0, None, -1), "plain softmax sampling", "tether samples plain softmax(logits / T)"),
    "min_p": _moot_if((None, 0.0), "plain softmax sampling", "tether samples plain softmax(logits / T)"),
    "repetition_penalty": _moot_if(1.0, "no penalty", "tether samples plain softmax(logits / T)"),
    "epsilon": _same("ppo.clip_eps"),
    "epsilon_high": lambda v, r, t: (
        ("moot", {}, "equal to epsilon: one symmetric range")
        if v == r.get("epsilon", 0.2)
        else ("mapped", {"ppo.clip_eps_high": v}, "DAPO's clip-higher")
    ),
    "loss_type": _loss_type,
    "scale_rewards": _scale_rewards,
    "mask_truncated_completions": _moot_if(False, "a cut response keeps its reward", "no equivalent"),
    "importance_sampling_level": _moot_if(
        "token", "token-level ratios", "sequence-level (GSPO) has no equivalent"
    ),
    "max_tool_calling_iterations": lambda v, r, t: (
        ("refused", {}, "None is no limit; tether counts turns: set rollout.max_turns (iterations + 1)")
        if v is None
        else (
            "mapped",
            {"rollout.max_turns": int(v) + 1},
            "rollout.max_turns counts the policy's turns: iterations + 1",
        )
    ),
    "use_vllm": _moot_if(
        False,
        "transformers generation",
        "tether generates with its own seeded sampler; its low-precision one is rollout.dtype=bf16",
    ),
    **{
        f"vllm_importance_sampling_{name}": _moot_if_no_vllm
        for name in ("correction", "mode", "clip_max", "clip_min")
    },
    "log_completions": _moot("samples.jsonl and the sample table every train.sample_every steps"),
    "num_completions_to_print": _moot("the sample table shows the step's samples"),
    "disable_dropout": _moot("dropout is always off in tether"),
    "sync_ref_model": _moot_if(False, "a frozen reference", "the reference is frozen by design"),
    "max_length": _moot("tether truncates nothing: a longer prompt is refused, named"),
    "truncation_mode": _moot("tether truncates nothing"),
    "precompute_ref_log_probs": _moot_if(False, "the reference is scored in each batch", "no equivalent"),
    # transformers' TrainingArguments
    "output_dir": _same("train.output_dir"),
    "seed": _same("train.seed"),
    "run_name": _same("train.run_name"),
    "report_to": _same("train.report_to"),
    "weight_decay": _same("optim.weight_decay"),
    "max_grad_norm": _same("optim.max_grad_norm"),
    "lr_scheduler_type": _scheduler,
    "warmup_steps": lambda v, r, t: (
        ("mapped", {"optim.warmup_steps": int(v)}, "")
        if float(v) >= 1 or float(v) == 0
        else ("refused", {}, "a ratio (transformers 5: warmup_steps < 1) needs max_steps")
        if r.get("max_steps") in (None, -1)
        else (
            "computed",
            {"optim.warmup_steps": math.ceil(float(v) * int(r["max_steps"]))},
            f"a ratio: ceil({v} x max_steps {r['max_steps']}) optimizer steps (transformers' rule)",
        )
    ),
    "bf16": _bf16,
    "fp16": _moot_if(
        False, "not float16", "tether trains in float32 or bfloat16 with float32 master weights"
    ),
    "gradient_checkpointing": _same("model.gradient_checkpointing"),
    "logging_steps": _moot("every step is logged (metrics.jsonl)"),
    "logging_strategy": _moot("every step is logged"),
    "logging_first_step": _moot("every step is logged"),
    "save_steps": _save_steps,
    "save_strategy": _save_strategy,
    "save_total_limit": _refused("tether keeps every checkpoint it writes"),
    "eval_steps": _eval_steps,
    "eval_strategy": _eval_strategy,
    "evaluation_strategy": _eval_strategy,
    "per_device_eval_batch_size": _moot("tether's evaluation batches are its own"),
    "num_train_epochs": _num_train_epochs,
    "push_to_hub": lambda v, r, t: (
        ("moot", {}, "nothing pushed")
        if not v
        else ("moot", {}, "train.hub_model_id (hub_model_id) pushes at the end")
        if r.get("hub_model_id")
        else ("refused", {}, "give hub_model_id: tether pushes to a named ORG/NAME repository")
    ),
    "hub_model_id": lambda v, r, t: (
        ("mapped", {"train.hub_model_id": v}, "pushed when the run ends")
        if r.get("push_to_hub")
        else ("moot", {}, "push_to_hub is not set")
    ),
    "hub_private_repo": _same("train.hub_private"),
    "hub_strategy": _moot_if(
        ("every_save", "end"),
        "tether pushes the final policy once, at the end (no checkpoint pushes)",
        "tether pushes the final policy once, at the end",
    ),
    "dataloader_num_workers": _moot("tether draws its own batches"),
    "remove_unused_columns": _moot("every other column travels with its row"),
}
"""A TRL key -> ``(value, recipe, trainer) -> (kind, tether fields, why)`` (module docstring);
the keys of :data:`SIZE_KEYS` are computed together, and every other key is refused as unknown."""


TRL_DEFAULTS = {
    "grpo": {
        "learning_rate": 1e-6,
        "beta": 0.0,
        "num_generations": 8,
        "max_completion_length": 512,
        "seed": 42,
        "lr_scheduler_type": "linear",
        "gradient_checkpointing": True,
    },
    "rloo": {
        "learning_rate": 1e-6,
        "beta": 0.05,
        "num_generations": 2,
        "max_completion_length": 512,
        "seed": 42,
        "lr_scheduler_type": "linear",
        "gradient_checkpointing": True,
    },
    "dpo": {
        "learning_rate": 1e-6,
        "beta": 0.1,
        "seed": 42,
        "lr_scheduler_type": "linear",
        "gradient_checkpointing": True,
    },
}
"""TRL 1.16's defaults where tether's differ (docs/trl.md): a key the recipe leaves out runs
at TRL's default in TRL, so the converted config sets it too (tested against TRL's configs).
The batch sizes' defaults (8 per device, 1 accumulation step, 1 iteration) are
:func:`_sizes`'."""


def convert(recipe: dict, trainer: str, *, processes: int = 1) -> list[Fate]:
    """Every key of ``recipe`` with its fate (module docstring), in the recipe's order; then
    TRL's defaults for the keys it leaves out (:data:`TRL_DEFAULTS`), the computed sizes and the
    trainer.

    Raises:
        RecipeError: not a mapping, a trainer other than :data:`TRAINERS`, or ``processes < 1``.
    """
    if not isinstance(recipe, dict):
        raise RecipeError(f"a TRL recipe is a mapping of keys, not a {type(recipe).__name__}")
    if trainer not in TRAINERS:
        raise RecipeError(f"--trainer {trainer!r}: tether converts {', '.join(TRAINERS)} recipes")
    if processes < 1:
        raise RecipeError(f"--processes {processes}: at least 1")
    fates = []
    try:
        sizes, said, refusal = _sizes(recipe, trainer, processes)
    except RecipeError as e:
        sizes, said, refusal = {}, [], str(e)
    context = {**recipe, PER_STEP: sizes.pop(PER_STEP, None)}
    for key, value in recipe.items():
        if key in SIZE_KEYS:
            if refusal is not None:
                fates.append(Fate(key, value, "refused", refusal))
            else:
                fates.append(
                    Fate(key, value, "computed", "with the other sizes (the arithmetic below the table)")
                )
            continue
        rule = RULES.get(key)
        if rule is None:
            fates.append(Fate(key, value, "refused", "no tether field (not a key the converter knows)"))
            continue
        try:
            kind, fields, why = rule(value, context, trainer)
        except (TypeError, ValueError, AttributeError) as e:  # a value of the wrong kind
            kind, fields, why = (
                "refused",
                {},
                f"{value!r} is not a value this key takes ({type(e).__name__}: {e})",
            )
        fates.append(Fate(key, value, kind, why, fields))
    if recipe.get("max_steps") in (None, -1) and "num_train_epochs" not in recipe:
        fates.append(
            Fate(
                "max_steps",
                None,
                "refused",
                "not in the recipe: TRL then trains num_train_epochs (3) passes over the data; tether counts "
                "steps, so give max_steps",
            )
        )
    for key, value in TRL_DEFAULTS[trainer].items():
        if key not in recipe:
            kind, fields, why = RULES[key](value, recipe, trainer)
            fates.append(
                Fate(key, value, kind, f"TRL's default, not in the recipe; {why}".rstrip("; "), fields)
            )
    fates.append(
        Fate(
            "(sizes)",
            None,
            "computed" if refusal is None else "refused",
            refusal or "; ".join(said),
            sizes if refusal is None else {},
        )
    )
    fates.append(Fate("(trainer)", trainer, "mapped", "", {"train.algo": trainer}))
    return fates


def tether_config(fates: list[Fate]) -> dict:
    """The tether config (sections of fields) the fates set; a field set twice keeps the later."""
    tree: dict[str, dict] = {}
    for f in fates:
        for dotted, value in f.fields.items():
            section, name = dotted.split(".")
            tree.setdefault(section, {})[name] = value
    return tree


def fate_table(fates: list[Fate]) -> str:
    """The fates as a Markdown table: key, value, fate, tether fields, why."""
    rows = ["| TRL key | value | fate | tether | why |", "|---|---|---|---|---|"]
    for f in fates:
        if f.key.startswith("("):
            continue
        fields = ", ".join(f"{k}={v}" for k, v in f.fields.items())
        rows.append(f"| `{f.key}` | `{f.value}` | {f.kind} | {fields} | {f.why} |")
    sizes = next((f for f in fates if f.key == "(sizes)"), None)
    if sizes is not None:
        rows += ["", f"sizes ({sizes.kind}): " + sizes.why.replace("; ", "\n  ")]
    return "\n".join(rows)


def convert_file(path: str | Path, trainer: str, *, processes: int = 1) -> tuple[list[Fate], dict]:
    """Read ``path`` (a TRL recipe, YAML data only) and convert it: the fates and the config.

    Raises:
        FileNotFoundError: no such file.
        tether.run.config.ConfigError: not YAML.
        RecipeError: as :func:`convert`.
    """
    import yaml

    from tether.run.config import read_yaml

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"tether convert: no file {p}")
    try:
        recipe = read_yaml(p.read_text(encoding="utf-8"), f"tether convert {p}") or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise RecipeError(f"tether convert {p}: not valid UTF-8 YAML data ({e})") from None
    fates = convert(recipe, trainer, processes=processes)
    return fates, tether_config(fates)


def write_converted(fates: list[Fate], tree: dict, out: Path, *, allow_dropped: bool) -> list[Fate]:
    """Write ``tree`` as tether's YAML at ``out`` (checked by loading it back), headed by the
    recipe keys that were refused; returns those.

    Raises:
        RecipeError: a key was refused and ``allow_dropped`` is False (nothing written).
        tether.run.config.ConfigError: the converted values do not make a valid tether config
            (nothing written).
    """
    import tempfile

    from tether.run.config import dump_yaml, load_config
    from tether.run.files import atomic_write_text

    refused = [f for f in fates if f.kind == "refused"]
    if refused and not allow_dropped:
        raise RecipeError(
            "tether convert: no tether field does "
            + "; ".join(f"{f.key} ({f.why})" for f in refused)
            + ". The run would differ from the recipe there: drop those keys from the recipe, or write the "
            "rest with --allow-dropped"
        )
    header = "".join(" ".join(f"# dropped: {f.key}={f.value!r} ({f.why})".split()) + "\n" for f in refused)
    text = "# tether config converted from a TRL recipe by `tether convert`\n" + header + dump_yaml(tree)
    with tempfile.TemporaryDirectory() as tmp:  # a config that does not load is not written
        probe = Path(tmp) / "probe.yaml"
        probe.write_text(text, encoding="utf-8")
        load_config(probe)
    atomic_write_text(Path(out), text)
    return refused


def looks_like_a_trl_recipe(tree: dict) -> list[str]:
    """The top-level keys of a config file that are TRL recipe keys (not tether sections): what
    ``tether train --config`` names when it is given a TRL recipe."""
    return [k for k in tree if k in RULES or k in SIZE_KEYS]
