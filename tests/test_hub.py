"""Hub ids without a network: a Hugging Face cache layout under a temporary HF_HOME, HF_HUB_OFFLINE=1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .conftest import tiny_run_args

REPO = Path(__file__).resolve().parents[1]
SHA = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(home: Path, repo_id: str, folder: Path, kind: str = "models") -> Path:
    """``folder``'s files as the snapshot ``SHA`` of ``repo_id`` in an HF cache under ``home``
    (``hub/models--ORG--NAME/snapshots/SHA`` with ``refs/main`` naming it), as a download leaves it."""
    root = home / "hub" / f"{kind}--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, root / "snapshots" / SHA)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(SHA)
    return root


def offline_cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-m", "tether", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _train_args(out: Path, prompt_file: Path) -> list[str]:
    return tiny_run_args(None, prompt_file, out, command=True)


def test_a_cached_hub_id_trains_offline_and_an_uncached_one_is_refused(tiny_model_dir, prompt_file, tmp_path):
    home = tmp_path / "hf"
    hub_cache(home, "tiny-org/tiny-llama", tiny_model_dir)
    out = tmp_path / "run"
    p = offline_cli(home, *_train_args(out, prompt_file), "model.name=tiny-org/tiny-llama")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["objective/kl"] == 0.0

    missing = tmp_path / "missing"
    p = offline_cli(home, *_train_args(missing, prompt_file), "model.name=tiny-org/not-cached")
    assert p.returncode == 1
    err = p.stderr
    assert "model.name='tiny-org/not-cached'" in err and "HF_HUB_OFFLINE=1" in err
    assert str(home / "hub") in err
    assert not missing.exists()  # nothing written
