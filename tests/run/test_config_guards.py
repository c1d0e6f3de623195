"""Config guards found by trying to break tether: each test reproduces a way it once went wrong."""

from __future__ import annotations

import pytest

from tether.run.config import ConfigError, dump_config, load_config


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "3\n"])
def test_yaml_that_is_not_a_mapping(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match="mapping"):
        load_config(p, ["kl.kl_coef=0.1"])


def test_text_fields_are_taken_verbatim():
    c = load_config(None, ["model.name=007", "data.prompts=a: b.txt", "train.output_dir=null"])
    assert c.model.name == "007" and c.data.prompts == "a: b.txt" and c.train.output_dir is None


def test_saved_config_reloads_with_another_trainer(tmp_path):
    path = tmp_path / "c.yaml"
    dump_config(load_config(None, []), path)  # a PPO run's config.yaml
    c = load_config(path, ["train.algo=grpo"])
    assert c.rollout.group_size == 4 and c.kl.kl_in_loss and not c.kl.kl_in_reward


def test_non_finite_config_values_are_refused():
    for o in ("kl.kl_coef=inf", "optim.lr=nan", "rollout.temperature=.inf"):
        with pytest.raises(ConfigError, match="finite"):
            load_config(None, [o])


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["train.algo=dpo"], "DPO samples its pairs eagerly"),
        (["model.lora_r=4"], "a LoRA policy"),
    ],
)
def test_rollout_compile_on_is_refused_where_it_is_not_built(overrides, named):
    with pytest.raises(
        ConfigError, match=rf"rollout.compile=True is invalid: {named}.*rollout.compile=auto or false"
    ):
        load_config(None, [*overrides, "rollout.compile=on"])
    load_config(None, [*overrides, "rollout.compile=auto"])  # auto: eager there, no error


def test_rollout_compile_takes_words_and_booleans():
    from tether.run.config import Config, RolloutConfig

    assert [
        load_config(None, [f"rollout.compile={v}"]).rollout.compile for v in ("on", "off", "true", "auto")
    ] == [
        True,
        False,
        True,
        "auto",
    ]
    assert Config(rollout=RolloutConfig(compile="on")).rollout.compile is True  # edited in Python
    with pytest.raises(
        ConfigError,
        match=r"rollout.compile='Auto' is invalid: expected true or false; or choose one of \['auto'\]",
    ):
        load_config(None, ["rollout.compile=Auto"])  # every alternative named
    assert RolloutConfig(compile="yes").compile is True and RolloutConfig(compile="0").compile is False
    c = load_config(None, [])
    c.rollout.compile = "off"  # edited after loading, as a word
    assert c.for_run().rollout.compile is False


def test_a_huge_train_steps_loads_with_the_adaptive_controller():
    """``train.steps=1e8 kl.controller=adaptive`` ended in a raw OverflowError from the note on
    how far beta can move (``1.00128 ** 1e8``); that reach is now inf, and no note is due."""
    c = load_config(None, ["train.steps=1e8", "kl.controller=adaptive"])
    assert c.train.steps == 10**8 and not [w for w in c.placement.warnings if "moves beta by at most" in w]
