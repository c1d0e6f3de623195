"""Config: YAML + overrides, and errors that name the field before anything loads."""

from __future__ import annotations

import pytest

from tether.run.config import Config, ConfigError, dump_config, load_config


def test_defaults_are_valid_and_roundtrip(tmp_path):
    c = load_config()
    assert c.kl.target_unit == "nats_per_sequence"
    path = tmp_path / "c.yaml"
    dump_config(c, path)
    assert load_config(path) == c


def test_overrides_are_typed():
    c = load_config(
        None,
        [
            "optim.lr=3e-5",
            "kl.controller=fixed",
            "kl.exact=false",
            "model.trainable_layers=2",
            "train.output_dir=null",
        ],
    )
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
        ("eval.fluency_samples=3", "eval.fluency_samples"),  # more than eval.samples_per_prompt=2
        ("model.trainable_layers=some", "model.trainable_layers"),
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


@pytest.mark.parametrize(
    "overrides,words",
    [
        (
            ["kl.kl_coef=0", "kl.controller=adaptive"],
            ["kl.kl_coef=0: no KL leash", "adaptive multiplies beta, so it stays 0"],
        ),
        (["kl.kl_coef=0", "kl.controller=fixed"], ["kl.kl_coef=0: no KL leash"]),
        (
            [
                "train.algo=grpo",
                "kl.estimator=abs",
                "kl.controller_signal=estimator",
                "kl.allow_biased_estimator=true",
            ],
            ["kl.estimator='abs' is biased", "allowed by kl.allow_biased_estimator"],
        ),
    ],
)
def test_runs_without_a_sound_leash_are_warned_about(overrides, words):
    warnings = " | ".join(load_config(None, overrides).placement.warnings)
    for w in words:
        assert w in warnings, (w, warnings)


def test_an_adaptive_controller_too_slow_for_the_run_is_warned_about():
    # 32 samples per step, horizon 10000: beta moves at most 1.00064 ** 16 - 1 = 1.0% in 16 steps
    adaptive = ["kl.controller=adaptive", "rollout.batch_size=32"]
    (w,) = load_config(None, [*adaptive, "train.steps=16"]).placement.warnings
    assert "at most 1% over train.steps=16" in w and "kl.horizon (e.g. 140)" in w
    # the proposed horizon can double beta: (1 + 0.2 * 32 / 140) ** 16 = 2.04; and it takes no warning
    assert load_config(None, [*adaptive, "train.steps=16", "kl.horizon=140"]).placement.warnings == []
    # a long run reaches 10%: 1.00064 ** 148 = 1.0993 warns, 1.00064 ** 149 = 1.1000 does not
    assert len(load_config(None, [*adaptive, "train.steps=148"]).placement.warnings) == 1
    assert load_config(None, [*adaptive, "train.steps=149"]).placement.warnings == []


def test_a_leashed_run_has_no_warning():
    for algo in ("ppo", "grpo", "rloo", "dpo"):
        c = load_config(None, [f"train.algo={algo}"])
        assert c.placement.warnings == []
        # the default leash: the budget controller, except for DPO (dpo.beta is its leash)
        assert c.kl.controller == ("fixed" if algo == "dpo" else "budget")
    # the budget controller raises beta from 0: a leash, no warning
    assert load_config(None, ["kl.kl_coef=0", "kl.controller=budget"]).placement.warnings == []


def test_tether_config_lists_every_field_of_the_dataclasses(capsys):
    """`tether config` reads the dataclasses: one entry per field of every section, each with a doc."""
    import dataclasses
    import typing

    from tether.cli import main
    from tether.run.config import Config

    sections = typing.get_type_hints(Config)
    want = [f"{s}.{f.name}" for s in sections for f in dataclasses.fields(sections[s])]
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    listed = [line.split(":")[0] for line in out.splitlines() if not line.startswith(" ")]
    assert listed == want and len(want) > 80
    docs = [line for line in out.splitlines() if line.startswith("    ")]
    assert len(docs) == len(want) and all(len(d.strip()) > 10 for d in docs)
    assert "kl.kl_coef: float = 0.05 [reward units per nat]" in out
    assert main(["config", "kl"]) == 0
    assert all(line.startswith(("kl.", " ")) for line in capsys.readouterr().out.splitlines())
    assert main(["config", "nope"]) == 2 and "choose one of" in capsys.readouterr().err


def test_print_config_prints_the_resolved_config_and_loads_nothing(capsys):
    import yaml

    from tether.cli import main

    assert main(["train", "--print-config", "train.algo=grpo", "model.name=/nowhere"]) == 0
    out = capsys.readouterr().out
    cfg = yaml.safe_load(out)
    assert cfg["model"]["name"] == "/nowhere"  # not loaded
    # config.yaml's form: the trainer's defaults stay null, so the printed file reloads with
    # another train.algo; their values for this config are in the comment line
    assert cfg["kl"]["kl_in_loss"] is None and cfg["rollout"]["group_size"] is None
    assert "rollout.group_size=4" in out and "kl.kl_in_loss=True" in out


def test_trainable_layers_default_is_six_blocks_of_the_embedded_model_and_all_of_others():
    assert load_config(None, []).model.layers_to_train == 6
    assert load_config(None, ["model.trainable_layers=all"]).model.layers_to_train is None
    assert load_config(None, ["model.trainable_layers=2"]).model.layers_to_train == 2
    assert load_config(None, ["model.name=ORG/NAME"]).model.layers_to_train is None
    assert load_config(None, ["model.lora_r=4"]).model.layers_to_train is None


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["ppo.kl_shaping=rough"], "choose one of ['sampled', 'exact']"),
        (["ppo.kl_shaping=exact", "kl.exact=false"], "set kl.exact=true"),
        (["ppo.kl_shaping=exact", "train.algo=grpo"], "train.algo=grpo"),
    ],
)
def test_exact_kl_shaping_is_refused_where_it_cannot_act(overrides, words):
    with pytest.raises(ConfigError, match="ppo.kl_shaping") as e:
        load_config(None, overrides)
    assert words in str(e.value)


def test_exact_kl_shaping_reaches_the_leash():
    assert load_config().kl_reward_form == "sampled"
    assert load_config(None, ["ppo.kl_shaping=exact"]).kl_reward_form == "exact"


def test_a_list_of_texts_keeps_each_item_as_written(tmp_path):
    """On the command line ``[yes, 010, 1:30, null, =]`` are texts (YAML's safe loader read them as
    True, 8, 90, None and failed on '=': the stop strings became 'True', '8', ... and '[=]', which
    no turn writes, and the environment was never called). In a YAML file, where the document is
    YAML, such items are refused with the quoting named."""
    from tether.run.config import ConfigError, load_config

    turns = ["rollout.env=tests.conftest:tool_env", "rollout.max_turns=2"]
    c = load_config(None, [*turns, "rollout.stop_strings=[yes, 010, 1:30, null, =]"])
    assert c.rollout.stop_strings == ["yes", "010", "1:30", "null", "="]
    assert load_config(None, [*turns, "rollout.stop_strings=[' e', 'Answer: x']"]).rollout.stop_strings == [
        " e",
        "Answer: x",
    ]
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  env: tests.conftest:tool_env\n  max_turns: 2\n  stop_strings: [yes, '=']\n")
    with pytest.raises(ConfigError, match=r"rollout.stop_strings.*YAML read True as a bool, not text; quote"):
        load_config(str(f))
    f.write_text("rollout:\n  env: tests.conftest:tool_env\n  max_turns: 2\n  stop_strings: ['yes', '=']\n")
    assert load_config(str(f)).rollout.stop_strings == ["yes", "="]
