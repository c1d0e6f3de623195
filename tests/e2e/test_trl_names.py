"""docs/trl.md's name tables kept true (issue 33): every TRL argument and metric it names is in
TRL 1.16's source, every tether field it names is a config field, and every tether metric it
names is logged by a tiny run of its trainer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import REPO, metric_rows, tiny_run_args
from tether.cli import main
from tether.run.config import config_fields

DOC = REPO / "docs" / "trl.md"


def _table(section: str) -> list[list[str]]:
    """The rows (cells) of the first table under ``## section`` in docs/trl.md."""
    text = DOC.read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("|")]
    return [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]  # header and rule left out


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def _trl_source() -> str:
    trl = pytest.importorskip("trl")
    import transformers

    root = Path(trl.__file__).parent / "trainer"
    files = [root / f for f in ("grpo_trainer.py", "grpo_config.py", "rloo_trainer.py", "rloo_config.py")]
    files += [root / "dpo_trainer.py", root / "dpo_config.py"]
    files.append(Path(transformers.__file__).parent / "trainer.py")  # learning_rate, grad_norm
    files.append(Path(transformers.__file__).parent / "training_args.py")
    return "\n".join(f.read_text() for f in files)


def _in_source(name: str, source: str) -> bool:
    """``name`` as a string or an identifier in the source; ``{x}`` stands for any f-string field."""
    pattern = re.escape(name).replace(r"\{name\}", r"\{[a-z_]+\}")
    return re.search(rf"[\"'.]{pattern}[\"']|\b{pattern}\s*[:=]", source) is not None


TOOL_METRICS = ("rollout/tool_calls", "rollout/tool_failures", "rollout/tool_failure_fraction")
"""What a tool-calling run logs (``test_train_with_tools_end_to_end`` checks each)."""


@pytest.fixture(scope="module")
def logged(tiny_model_dir, tmp_path_factory) -> set[str]:
    """Every metric name a tiny GRPO run (two rewards, periodic evaluation), PPO run and DPO run log."""
    tmp = tmp_path_factory.mktemp("names")
    prompts = tmp / "prompts.txt"
    prompts.write_text("\n".join(f"the movie number {i} was" for i in range(40)) + "\n")
    keys: set[str] = set()
    runs = {
        "grpo": {"reward.scorer": "tests.conftest:length_judge,tests.conftest:one_if_long"},
        "ppo": {},
        "dpo": {"dpo.pairs": "sampled"},
    }
    for algo, extra in runs.items():
        out = tmp / algo
        overrides = {"train.algo": algo, "train.steps": 1, **extra}
        assert main(tiny_run_args(tiny_model_dir, prompts, out, overrides, command=True)) == 0
        keys |= {k for row in metric_rows(out) for k in row}
    return keys


def test_every_trl_metric_in_the_table_is_trls_and_every_tether_metric_is_logged(logged):
    source = _trl_source()
    rows = _table("Logged metrics")
    assert len(rows) >= 15
    for trl_cell, tether_cell, _ in rows:
        for name in _names(trl_cell):
            assert _in_source(name, source), f"docs/trl.md names TRL metric {name!r}, not in TRL 1.16"
        for name in _names(tether_cell):
            name = name.removeprefix("1 - ")
            if "<name>" in name:  # one per reward of a list
                prefix = name.split("<name>")[0]
                assert {"length_judge", "one_if_long"} <= {
                    k[len(prefix) :] for k in logged if k.startswith(prefix)
                }
            elif name.startswith("rollout/tool_"):  # a tool-calling run's: tests/e2e/test_tools.py
                assert name in TOOL_METRICS, name
            else:
                assert name in logged, f"docs/trl.md names tether metric {name!r}, which no run logs"


@pytest.mark.parametrize("section", ["GRPOConfig and RLOOConfig", "DPOConfig"])
def test_every_argument_in_the_tables_is_trls_and_every_field_is_tethers(section):
    source = _trl_source()
    fields = {f.name for f in config_fields()}
    rows = _table(section)
    assert len(rows) >= 8
    checked = 0
    for trl_cell, tether_cell, *notes in rows:
        removed = "not in TRL 1.16" in " ".join(notes)  # a row that says TRL dropped the argument
        for name in [] if removed else _names(trl_cell):
            arg = name.split(" ")[0]
            if re.fullmatch(r"[a-z_]+", arg) and not arg.endswith("_"):
                assert _in_source(arg, source), f"docs/trl.md: TRL argument {arg!r} is not in TRL 1.16"
                checked += 1
        for name in _names(tether_cell):
            field = name.split("=")[0]
            if re.fullmatch(r"[a-z_]+\.[a-z_0-9]+", field):
                assert field in fields, f"docs/trl.md names {field!r}, not a tether config field"
                checked += 1
    assert checked >= 10
