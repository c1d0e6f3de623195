"""Config: YAML + overrides, and errors that name the field before anything loads."""

from __future__ import annotations

import os
import re
import time

import pytest
import yaml

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
        (["kl.exact=false"], ["without the update guard (kl.exact=false turns it off)", "not a bound"]),
        (["train.algo=rloo", "kl.guard=false"], ["without the update guard (kl.guard=false)"]),
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


def _alias_bomb(section: str, field: str) -> str:
    """The "billion laughs": 9 levels of 9 aliases, 9**9 = 387,420,489 strings in ~360 bytes."""
    lines = [f"{section}:", f"  {field}:", "    a: &a [x, x, x, x, x, x, x, x, x]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"    {name}: &{name} [{', '.join(['*' + prev] * 9)}]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("section, field", [("data", "prompts"), ("rollout", "stop_strings")])
def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path, section, field):
    """Under data.prompts the bomb's repr for the refusal grew until memory ran out (MemoryError at
    2.47 GB); under rollout.stop_strings the refusal was 312 MB long. Aliases are now refused while
    the file is read, naming the key, the line and the fix."""
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb(section, field))
    assert len(path.read_bytes()) < 440
    start = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        load_config(path)
    # reading 400 bytes of YAML takes milliseconds; before, the refusal ran for minutes
    assert time.perf_counter() - start < 1.0
    message = str(e.value)
    assert f"{section}.{field}.b[0] (line 4) is a YAML alias, '*a'" in message
    assert "write the value out in full" in message and len(message) < 400


def test_an_alias_in_an_override_is_refused_with_its_field():
    value = "[&a [x, x, x], &b [*a, *a, *a], *b]"
    with pytest.raises(ConfigError, match=r"override rollout.stop_strings: rollout.stop_strings\[1\]\[0\]"):
        load_config(None, [f"rollout.stop_strings={value}"])
    with pytest.raises(ConfigError, match=r"override reward.weights: reward.weights\[1\] .* alias, '\*w'"):
        load_config(None, ["reward.scorer=[vader, vader]", "reward.weights=[&w 1.0, *w]"])


def test_a_huge_value_gives_a_short_refusal(tmp_path):
    """A refusal shows a user's value cut (tether.core.text.shown): before, a 10 MB value made a
    10 MB message."""
    with pytest.raises(ConfigError) as e:  # a str field keeps the override's text as it is, unparsed
        load_config(None, ["rollout.env=" + "m" * 10_000_000])
    assert len(str(e.value)) < 400 and "(cut: a text of 10,000,000 characters)" in str(e.value)
    path = tmp_path / "big.yaml"  # through YAML (1 MB: the pure-Python reader takes ~1 s a MB)
    path.write_text("rollout:\n  stop_strings: {x: " + "b" * 1_000_000 + "}\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert len(str(e.value)) < 400 and "rollout.stop_strings={'x': 'bbb" in str(e.value)
    path.write_text("kl:\n  ? " + "k" * 1_000_000 + "\n  : 1\n")  # a 1 MB key (an explicit one: ? KEY)
    with pytest.raises(ConfigError, match="unknown config key") as e:
        load_config(path)
    # the message names the section's valid keys (each quoted, ", " between): the key itself is cut
    # to the few hundred characters of the other refusals above
    from dataclasses import fields

    from tether.run.config import KLConfig

    valid = sum(len(f.name) + 4 for f in fields(KLConfig))
    assert len(str(e.value)) < 400 + valid


@pytest.mark.parametrize(
    "text, words",
    [
        (
            "kl:\n  kl_coef: 0.1\noptim:\n  lr: 1.0e-5\nkl:\n  kl_coef: 0.5\n",
            "line 5 repeats the key 'kl' (first at line 1)",
        ),
        (
            "kl:\n  kl_coef: 0.1\n  target: 6\n  kl_coef: 0.5\n",
            "line 4 repeats the key 'kl_coef' under kl (first at line 2)",
        ),
    ],
)
def test_a_key_given_twice_is_refused_with_both_lines(tmp_path, text, words):
    """YAML keeps the last of two equal keys; the first value was lost without a word."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert words in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize(
    "text, words",
    [
        ("train:\n  steps: 3\n  <<: {steps: 100}\n", "train.<< (line 3) is a YAML merge key"),
        (
            "optim:\n  lr: 0.1\ntrain:\n  <<: {steps: 5}\n  <<: {steps: 7}\n",
            "train.<< (line 4) is a YAML merge key",
        ),
        ("<<: {train: {steps: 5}}\n", "--config FILE: << (line 1) is a YAML merge key"),
        ("train:\n  !!merge <<: {steps: 5}\n", "train.<< (line 2) is a YAML merge key"),
    ],
)
def test_a_merge_key_is_refused_with_its_key_and_line(tmp_path, text, words):
    """Issue 50b, item 7: ``train: {steps: 3, <<: {steps: 100}}`` loaded steps 3, and two merge
    keys with steps 5 then 7 loaded 7, silently: a merge key gives a key twice without the
    repeated-key refusal seeing it. Merge keys are refused as aliases are."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    message = str(e.value).replace(str(path), "FILE")
    assert words in message and "write the values out in full" in message, message
    with pytest.raises(ConfigError, match=r"rollout.stop_strings\[0\]\.<< \(line 1\) is a YAML merge key"):
        load_config(None, ["rollout.stop_strings=[{<<: {a: x}}]"])
    path.write_text('train:\n  "<<": 5\n')  # a quoted "<<" is a key like any other (and unknown here)
    with pytest.raises(ConfigError, match="unknown config key"):
        load_config(path)


def test_a_key_given_twice_in_an_override_value_is_refused():
    with pytest.raises(ConfigError, match=r"override rollout.stop_strings: line 1 repeats the key 'a' under"):
        load_config(None, ["rollout.stop_strings=[{a: x, a: y}]"])


@pytest.mark.parametrize(
    "text, words",
    [
        ("train:\n  steps: " + "1" * 5000 + "\n", "train.steps (line 2) holds a value YAML cannot read"),
        ("data:\n  prompts: " + "[" * 5000 + "]" * 5000 + "\n", "is nested over 100 levels deep"),
    ],
    ids=["a 5000-digit number", "5000 nested lists"],
)
def test_unreadable_yaml_is_a_config_error_not_a_traceback(tmp_path, text, words):
    """A number over 4300 digits raised int()'s ValueError, and 5000 nested lists a RecursionError,
    both out of the command line as tracebacks."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(words)) as e:
        load_config(path)
    assert len(str(e.value)) < 600
    with pytest.raises(ConfigError, match="holds a value YAML cannot read"):
        load_config(None, ["train.steps=" + "1" * 5000])


def test_what_tether_writes_it_reads_back(tmp_path):
    """tether's YAML writer never writes an alias, which its reader refuses: PyYAML's safe_dump
    writes ``&id001`` / ``*id001`` for one list met twice."""
    from tether.run.config import dump_yaml, read_yaml

    shared = ["</call>"]
    tree = {"rollout": {"stop_strings": shared}, "train": {"report_to": shared}}
    assert "&id001" in yaml.safe_dump(tree)
    assert read_yaml(dump_yaml(tree), "test") == tree
    c = load_config(None, ["rollout.env=tests.conftest:tool_env", "rollout.max_turns=2"])
    c.rollout.stop_strings = c.train.report_to = ["none"]
    dump_config(c, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == c


@pytest.mark.parametrize("kind", ["a character device", "a FIFO (named pipe)", "a folder"])
def test_a_config_path_that_is_not_a_file_is_refused_unread(tmp_path, kind):
    path = {"a character device": "/dev/zero", "a folder": str(tmp_path)}.get(kind, str(tmp_path / "fifo"))
    if kind.startswith("a FIFO"):
        os.mkfifo(path)
    with pytest.raises(ConfigError, match=f"--config {path} is {re.escape(kind)}, not a file"):
        load_config(path)


def test_an_unweighted_kl_surrogate_over_several_updates_is_warned():
    # k3+ (and k2) take the KL's gradient unweighted: exact on the batch's first optimizer step
    # only. With 2 epochs (or several minibatches) the run is told, and k3_is (the default) is not.
    from tether.run.config import load_config

    for est in ("k3+", "k2"):
        warned = load_config(None, ["train.algo=grpo", f"kl.loss_estimator={est}", "optim.epochs=2"])
        assert any("optimizer steps per batch" in w for w in warned.placement.warnings), est
    quiet = [
        ["train.algo=grpo", "kl.loss_estimator=k3+", "optim.epochs=1"],  # one update: on-policy
        ["train.algo=grpo", "optim.epochs=2"],  # k3_is, the default
        ["train.algo=rloo", "kl.loss_estimator=k3+", "optim.epochs=2"],  # the KL in the reward
    ]
    for args in quiet:
        assert not any("optimizer steps per batch" in w for w in load_config(None, args).placement.warnings)


@pytest.mark.parametrize(
    "override, words",
    [
        ("kl.guard_z=-1", "kl.guard_z"),
        ("kl.guard_z=nan", "kl.guard_z"),
        ("kl.guard_tol=-0.1", "kl.guard_tol"),
        ("kl.guard_halvings=0", "kl.guard_halvings"),
        ("kl.guard_halvings=31", "2^-24"),
        ("kl.tokens_jump=-0.5", "kl.tokens_jump"),
        ("kl.tokens_jump=inf", "kl.tokens_jump"),
        ("kl.tokens_every=-1", "kl.tokens_every"),
    ],
)
def test_the_guards_settings_are_refused_out_of_range(override, words):
    with pytest.raises(ConfigError, match=words.replace("^", r"\^")):
        load_config(None, [override]).for_run()


def test_settings_that_turn_the_kl_attribution_off_say_so():
    # kl.tokens_every asks for records a run without the attribution never writes; kl.exact=false
    # turns the attribution off with it: each said at the start, not found out after the run
    for overrides, words in (
        (["kl.attribution=false", "kl.tokens_every=1"], "kl.tokens_every=1 does nothing"),
        (["kl.exact=false"], "kl.exact=false (it reads the exact KL): no kl/* attribution metrics"),
    ):
        c = load_config(None, overrides).for_run()
        assert any(words in w for w in c.placement.warnings), (overrides, c.placement.warnings)
    assert not any("kl_tokens.jsonl" in w for w in load_config(None, []).for_run().placement.warnings)


def test_anchor_settings_given_while_the_anchor_is_off_are_said_to_do_nothing():
    def said(*overrides):
        return [w for w in load_config(None, list(overrides)).placement.warnings if "anchor" in w]

    assert said() == []
    (w,) = said("anchor.texts=my.txt", "anchor.budget_kp=5")
    assert (
        w.startswith("anchor.texts, anchor.budget_kp set while the text anchor is off")
        and "anchor.budget" in w
    )
    assert said("anchor.texts=my.txt", "anchor.budget=0.03") == []  # on: nothing to say
    assert (
        said("anchor.budget_eta=2", "anchor.coef=1") == []
    )  # on (a fixed weight): the gains are unused, not wrong
