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
