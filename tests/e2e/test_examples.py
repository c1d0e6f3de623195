"""The TRL ports in examples/ run end to end with --tiny (tiny random models, nothing downloaded)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import metric_rows

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    "script, reward_keys",
    [
        ("grpo_think_format.py", ["reward/think_format_reward", "reward/accuracy_reward"]),
        ("rloo_reward_model.py", ["objective/scores"]),
        ("dpo_preferences.py", ["dpo/loss", "objective/scores"]),
        ("grpo_calculator_tool.py", ["objective/scores", "rollout/env_tokens"]),
        ("grpo_calculator_tool.py --chat", ["objective/scores", "rollout/env_tokens"]),
    ],
)
def test_an_example_runs_with_tiny_models(script, reward_keys, tmp_path):
    pytest.importorskip("trl")  # grpo_think_format uses trl.rewards.think_format_reward
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    script, *flags = script.split()
    args = [sys.executable, str(EXAMPLES / script), *flags, "--tiny", "--out", str(out)]
    if script == "dpo_preferences.py":
        args += ["--pairs", str(tmp_path / "pairs")]
    p = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "last step:" in p.stdout
    rows = metric_rows(out, timings=True)
    assert len(rows) == 2 and all(k in rows[-1] for k in reward_keys)
