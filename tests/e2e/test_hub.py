"""Hub ids without a network: a Hugging Face cache layout under a temporary HF_HOME, HF_HUB_OFFLINE=1."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import hub_cache, metric_rows, offline_cli, tiny_run_args


def _train_args(out: Path, prompt_file: Path) -> list[str]:
    return tiny_run_args(None, prompt_file, out, command=True)


REPO = Path(__file__).resolve().parents[2]


def test_a_cached_hub_id_trains_offline_and_an_uncached_one_is_refused(tiny_model_dir, prompt_file, tmp_path):
    home = tmp_path / "hf"
    hub_cache(home, "tiny-org/tiny-llama", tiny_model_dir)
    out = tmp_path / "run"
    p = offline_cli(home, *_train_args(out, prompt_file), "model.name=tiny-org/tiny-llama")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = metric_rows(out, timings=True)
    assert rows[0]["objective/kl"] == 0.0

    missing = tmp_path / "missing"
    p = offline_cli(home, *_train_args(missing, prompt_file), "model.name=tiny-org/not-cached")
    assert p.returncode == 1
    err = p.stderr
    assert "model.name='tiny-org/not-cached'" in err and "HF_HUB_OFFLINE=1" in err
    assert str(home / "hub") in err
    assert not missing.exists()  # nothing written
