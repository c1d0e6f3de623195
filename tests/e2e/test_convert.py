"""``tether convert`` (issue 55): a TRL recipe translated key by key, every key mapped,
computed, moot or refused with its reason; the converted config runs; ``tether train --config``
of a TRL recipe says to convert it."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from tether.cli import main
from tether.run.config import ConfigError, load_config
from tether.run.convert import RULES, SIZE_KEYS, TRL_DEFAULTS, RecipeError, convert, tether_config

# a TRL 1.16 GRPO recipe as `trl grpo --config recipe.yaml` takes it: script, model and
# training arguments (42 keys)
RECIPE = {
    "model_name_or_path": "Qwen/Qwen3-0.6B",
    "model_revision": "main",
    "trust_remote_code": False,
    "dtype": "bfloat16",
    "attn_implementation": "sdpa",
    "use_peft": True,
    "lora_r": 16,
    "lora_alpha": 32,
    "lora_dropout": 0.05,
    "lora_target_modules": ["q_proj", "v_proj"],
    "dataset_name": "trl-lib/DeepMath-103K",
    "dataset_config": "default",
    "dataset_train_split": "train",
    "reward_funcs": ["accuracy_reward", "my_rewards.format_reward"],
    "reward_weights": [1.0, 0.2],
    "chat_template_kwargs": {"enable_thinking": False},
    "output_dir": "runs/qwen-grpo",
    "run_name": "qwen-grpo",
    "seed": 7,
    "learning_rate": 1e-6,
    "lr_scheduler_type": "cosine",
    "warmup_ratio": 0.1,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 4,
    "num_generations": 8,
    "num_iterations": 2,
    "max_steps": 200,
    "max_completion_length": 1024,
    "temperature": 0.9,
    "top_p": 0.95,
    "beta": 0.04,
    "epsilon": 0.2,
    "epsilon_high": 0.28,
    "loss_type": "dapo",
    "scale_rewards": "group",
    "use_vllm": False,
    "gradient_checkpointing": True,
    "bf16": True,
    "logging_steps": 10,
    "save_steps": 50,
}


def test_every_key_of_a_42_key_recipe_has_a_fate():
    assert len(RECIPE) == 42
    fates = {f.key: f for f in convert(RECIPE, "grpo")}
    assert set(RECIPE) <= set(fates)
    kinds = {k: fates[k].kind for k in RECIPE}
    # what has no tether field, and says why
    assert {k for k, v in kinds.items() if v == "refused"} == {
        "attn_implementation",
        "lora_dropout",
        "top_p",
    }
    assert fates["epsilon_high"].fields == {"ppo.clip_eps_high": 0.28}  # DAPO's clip-higher
    assert all(fates[k].why for k in RECIPE if kinds[k] in ("refused", "moot"))
    tree = tether_config(list(fates.values()))
    # the arithmetic of the sizes (one process): a TRL optimizer step takes 4 x 1 x 4 = 16
    # completions (4 micro-steps of 4), a generation 4 x 1 x steps_per_generation (=
    # gradient_accumulation_steps 4) = 16; TRL generates every steps_per_generation x
    # num_iterations = 8 micro-steps = 2 optimizer steps, so 200 TRL steps are 100 tether steps
    # (each 2 epochs over its 16 completions in one minibatch); warmup ceil(0.1 x 200) = 20
    assert (
        tree["optim"].items()
        >= {
            "micro_batch_size": 4,
            "minibatch_size": 16,
            "epochs": 2,
            "warmup_steps": 20,
        }.items()
    )
    assert tree["rollout"] == {
        "batch_size": 16,
        "group_size": 8,
        "max_new_tokens": 1024,
        "temperature": 0.9,
    }
    assert tree["train"]["steps"] == 100 and tree["train"]["algo"] == "grpo" and tree["train"]["seed"] == 7
    assert tree["kl"] == {"kl_coef": 0.04, "controller": "fixed"}
    # save_steps counts TRL's optimizer steps: 50 of them are 25 tether steps of 2
    assert tree["train"]["checkpoint_every"] == 25
    assert tree["reward"]["scorer"] == ["trl.rewards:accuracy_reward", "my_rewards:format_reward"]
    assert (
        tree["model"].items()
        >= {
            "name": "Qwen/Qwen3-0.6B",
            "dtype": "bfloat16",
            "lora_r": 16,
            "lora_alpha": 32,
        }.items()
    )
    assert tree["data"] == {
        "prompts": "trl-lib/DeepMath-103K",
        "config": "default",
        "split": "train",
        "chat_template_kwargs": {"enable_thinking": False},
    }


def test_trls_defaults_are_trls():
    """The defaults the converter fills for keys a recipe leaves out are TRL 1.16's own."""
    from trl import DPOConfig, GRPOConfig, RLOOConfig

    for trainer, cls in (("grpo", GRPOConfig), ("rloo", RLOOConfig), ("dpo", DPOConfig)):
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        for key, value in TRL_DEFAULTS[trainer].items():
            assert defaults[key] == value, (trainer, key)
        for key, value in (("per_device_train_batch_size", 8), ("gradient_accumulation_steps", 1)):
            assert defaults[key] == value
        if trainer != "dpo":
            assert defaults["num_iterations"] == 1 and defaults["steps_per_generation"] is None


def test_a_left_out_key_runs_at_trls_default_and_no_max_steps_is_refused():
    fates = {f.key: f for f in convert({"max_steps": 10}, "rloo")}
    assert (
        fates["learning_rate"].fields == {"optim.lr": 1e-6} and "TRL's default" in fates["learning_rate"].why
    )
    assert fates["beta"].fields == {"kl.kl_coef": 0.05, "kl.controller": "fixed"}
    assert fates["num_generations"].fields == {"rollout.group_size": 2}
    # 8 x 1 x 1 completions a generation, one optimizer step each
    assert tether_config(list(fates.values()))["train"]["steps"] == 10
    nosteps = {f.key: f for f in convert({}, "grpo")}
    assert nosteps["max_steps"].kind == "refused" and "give max_steps" in nosteps["max_steps"].why
    # accumulation: a generation is one optimizer step (TRL's default steps_per_generation), so
    # 10 TRL steps are 10 tether steps of 8 x 4 = 32 completions
    acc = tether_config(convert({"max_steps": 10, "gradient_accumulation_steps": 4}, "grpo"))
    assert (
        acc["train"]["steps"] == 10 and acc["rollout"]["batch_size"] == acc["optim"]["minibatch_size"] == 32
    )
    # generation_batch_size 16 at 4 per device: steps_per_generation 4 (TRL's division), so a
    # generation of 16 is 2 optimizer steps of 4 x 2 = 8
    gen = tether_config(
        convert(
            {
                "max_steps": 10,
                "per_device_train_batch_size": 4,
                "gradient_accumulation_steps": 2,
                "generation_batch_size": 16,
            },
            "grpo",
        )
    )
    assert (
        gen["rollout"]["batch_size"] == 16
        and gen["optim"]["minibatch_size"] == 8
        and gen["train"]["steps"] == 5
    )
    uneven = {f.key: f for f in convert({"max_steps": 9, "steps_per_generation": 2}, "grpo")}
    assert uneven["max_steps"].kind == "refused" and "not a whole number" in uneven["max_steps"].why
    for bad in ({"max_steps": "ten"}, {"max_steps": 10.5}, {"max_steps": 4, "num_iterations": 0}):
        fates = {f.key: f for f in convert(bad, "grpo")}
        assert any(f.kind == "refused" and "a whole number >= 1" in f.why for f in fates.values()), bad
    odd = {f.key: f for f in convert({"max_steps": 4, "reward_funcs": 5, "save_steps": "x"}, "grpo")}
    assert odd["reward_funcs"].kind == odd["save_steps"].kind == "refused"


def test_unknown_keys_are_refused_by_name():
    fates = {f.key: f for f in convert({"max_steps": 4, "vllm_mode": "colocate"}, "grpo")}
    assert fates["vllm_mode"].kind == "refused" and "not a key the converter knows" in fates["vllm_mode"].why
    with pytest.raises(RecipeError, match="--trainer 'ppo'"):
        convert({}, "ppo")
    assert set(SIZE_KEYS).isdisjoint(RULES)


def test_the_cli_converts_refuses_without_allow_dropped_and_the_result_runs(
    tiny_model_dir, prompt_file, tmp_path, capsys
):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE))
    out = tmp_path / "recipe.tether.yaml"
    assert main(["convert", str(recipe), "--trainer", "grpo"]) == 1
    err = capsys.readouterr().err
    assert "no tether field does attn_implementation" in err and "--allow-dropped" in err
    assert not out.exists()
    assert main(["convert", str(recipe), "--trainer", "grpo", "--allow-dropped"]) == 0
    said = capsys.readouterr().out
    assert "| `epsilon_high` | `0.28` | mapped |" in said
    assert "42 keys: 28 mapped, 7 computed, 4 moot, 3 refused" in said
    text = out.read_text()
    assert "# dropped: top_p=0.95" in text
    config = load_config(out)
    assert config.optim.minibatch_size == 16 and config.kl.kl_coef == 0.04
    # the converted 42-key recipe runs, on the tiny model and a local prompt file in place of
    # the Hub's (and the lengths and steps of a test)
    offline = [
        f"model.name={tiny_model_dir}",
        "model.model_revision=null".replace("model_revision", "revision"),
        f"data.prompts={prompt_file}",
        "data.config=null",
        "data.chat_template_kwargs={}",
        "reward.scorer=vader",
        "reward.weights=null",
        "model.dtype=float32",
        "rollout.max_new_tokens=4",
        "train.steps=1",
        f"train.output_dir={tmp_path / 'qwen-grpo'}",
        "eval.n_prompts=0",
        "eval.fluency_model=none",
    ]
    assert main(["train", "--config", str(out), *offline]) == 0
    assert (tmp_path / "qwen-grpo" / "metrics.jsonl").exists()
    capsys.readouterr()
    # the converted recipe, on the tiny model and a local prompt file, trains
    small = tmp_path / "small.yaml"
    small.write_text(
        yaml.safe_dump(
            {
                "max_steps": 2,
                "per_device_train_batch_size": 4,
                "num_generations": 2,
                "max_completion_length": 4,
                "learning_rate": 1e-5,
                "beta": 0.04,
                "model_name_or_path": str(tiny_model_dir),
                "dataset_name": str(prompt_file),
                "output_dir": str(tmp_path / "run"),
                "gradient_checkpointing": False,
            }
        )
    )
    assert main(["convert", str(small), "--trainer", "grpo", "-o", str(tmp_path / "small.tether.yaml")]) == 0
    capsys.readouterr()
    overrides = ["eval.n_prompts=0", "eval.fluency_model=none", "train.save_model=false"]
    assert main(["train", "--config", str(tmp_path / "small.tether.yaml"), *overrides]) == 0
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 2


def test_train_with_a_trl_recipe_says_to_convert_it(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"learning_rate": 1e-6, "beta": 0.04, "model": {"name": "x"}}))
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config(recipe)
    assert main(["train", "--config", str(recipe)]) == 2
    assert re.search(r"is a TRL recipe \(beta, learning_rate\).*tether convert", capsys.readouterr().err)


def test_push_to_hub_with_a_model_id_pushes_at_the_end():
    fates = {f.key: f for f in convert({"max_steps": 4, "push_to_hub": True, "hub_model_id": "o/n"}, "grpo")}
    assert (
        fates["hub_model_id"].fields == {"train.hub_model_id": "o/n"} and fates["push_to_hub"].kind == "moot"
    )
    alone = {f.key: f for f in convert({"max_steps": 4, "push_to_hub": True}, "grpo")}
    assert alone["push_to_hub"].kind == "refused" and "give hub_model_id" in alone["push_to_hub"].why


def test_bad_recipe_files_and_writing_over_the_recipe_are_refused(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: [1\n")
    assert main(["convert", str(bad), "--trainer", "grpo"]) == 1
    assert "not valid UTF-8 YAML data" in capsys.readouterr().err
    code = tmp_path / "code.yaml"
    code.write_text("learning_rate: !!python/name:os.system\n")
    assert main(["convert", str(code), "--trainer", "grpo"]) == 1
    assert "tether: error:" in capsys.readouterr().err
    ok = tmp_path / "ok.yaml"
    ok.write_text("max_steps: 4\n")
    assert main(["convert", str(ok), "--trainer", "grpo", "-o", str(ok)]) == 1
    assert "is the recipe itself" in capsys.readouterr().err and ok.read_text() == "max_steps: 4\n"


def test_a_hub_model_id_must_be_a_repository_id():
    for bad in ("/x", "a/", "a b/c", "-a/b", "a/b/c"):
        with pytest.raises(ConfigError, match="train.hub_model_id"):
            load_config(None, [f"train.hub_model_id={bad}"])
    assert load_config(None, ["train.hub_model_id=my-org/my.policy"]).train.hub_model_id == "my-org/my.policy"


def test_tool_calling_iterations_become_turns():
    # TRL counts the tool rounds after the first turn; tether counts the policy's turns: 3 -> 4
    fates = {f.key: f for f in convert({"max_steps": 4, "max_tool_calling_iterations": 3}, "grpo")}
    assert fates["max_tool_calling_iterations"].fields == {"rollout.max_turns": 4}
    unlimited = {f.key: f for f in convert({"max_steps": 4, "max_tool_calling_iterations": None}, "grpo")}
    assert unlimited["max_tool_calling_iterations"].kind == "refused"
    assert "set rollout.max_turns" in unlimited["max_tool_calling_iterations"].why


def test_vllms_importance_sampling_keys_are_moot_without_vllm_and_name_tethers_own_with_it():
    keys = {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 2.0}
    fates = {f.key: f for f in convert({"max_steps": 4, **keys}, "grpo")}
    assert all(fates[k].kind == "moot" for k in keys)
    with_vllm = {f.key: f for f in convert({"max_steps": 4, "use_vllm": True, **keys}, "grpo")}
    assert with_vllm["use_vllm"].kind == "refused" and "rollout.dtype=bf16" in with_vllm["use_vllm"].why
    assert all(with_vllm[k].kind == "refused" and "rollout.correction" in with_vllm[k].why for k in keys)
