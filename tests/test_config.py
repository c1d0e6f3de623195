"""Config: YAML + overrides, and errors that name the field before anything loads."""

from __future__ import annotations

import pytest

from tether.config import Config, ConfigError, dump_config, load_config


def test_defaults_are_valid_and_roundtrip(tmp_path):
    c = load_config()
    assert c.kl.target_unit == "nats_per_sequence"
    path = tmp_path / "c.yaml"
    dump_config(c, path)
    assert load_config(path) == c


def test_overrides_are_typed():
    c = load_config(None, ["optim.lr=3e-5", "kl.controller=fixed", "kl.exact=false",
                           "model.trainable_layers=2", "train.output_dir=null"])
    assert c.optim.lr == 3e-5 and isinstance(c.optim.lr, float)
    assert c.kl.controller == "fixed" and c.kl.exact is False
    assert c.model.trainable_layers == 2 and c.train.output_dir is None


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("kl:\n  kl_coef: 0.2\nrollout:\n  batch_size: 8\noptim:\n  minibatch_size: 4\n")
    c = load_config(path, ["kl.kl_coef=0.3"])
    assert c.kl.kl_coef == 0.3 and c.rollout.batch_size == 8


@pytest.mark.parametrize(
    "override, field",
    [
        ("kl.kl_coef=-0.1", "kl.kl_coef"),
        ("kl.target=0", "kl.target"),
        ("rollout.temperature=0", "rollout.temperature"),
        ("kl.estimator=k4", "kl.estimator"),
        ("kl.controller=pid", "kl.controller"),
        ("optim.minibatch_size=5", "optim.minibatch_size"),
        ("optim.lr=abc", "optim.lr"),
        ("rollout.batch_size=2.5", "rollout.batch_size"),
        ("kl.target_unit=bits", "kl.target_unit"),
        ("ppo.gamma=1.5", "ppo.gamma"),
        ("train.algo=a2c", "train.algo"),
        ("kl.nonsense=1", "kl.nonsense"),
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert field in str(e.value)


def test_override_without_section_is_explained():
    with pytest.raises(ConfigError, match="section"):
        load_config(None, ["lr=1e-5"])


def test_missing_yaml_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file"):
        load_config(tmp_path / "missing.yaml")


def test_config_is_plain_data():
    c = Config()
    assert c.to_dict()["kl"]["estimator"] == "k1"
