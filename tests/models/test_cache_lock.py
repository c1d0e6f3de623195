"""The shared cache (``~/.cache/tether``) is built by one process at a time: two that find an
entry missing at once (two runs started together on a fresh machine, two test workers) build it
once, and neither reads the other's half-built entry."""

from __future__ import annotations

import threading
import time

import tether.data.prompts as prompts
import tether.models.loading as loading


def _twice_at_once(fn) -> list:
    """``fn()`` in two threads started together; their results (FileLock holds per thread)."""
    out, go = [], threading.Barrier(2)

    def run():
        go.wait()
        out.append(fn())

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def test_an_embedded_model_missing_twice_at_once_is_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path))
    monkeypatch.setitem(loading.EMBEDDED_MODELS, "toy", ("toy-fp32", lambda: None, "~0 s"))
    builds = []

    def build(target, gguf, how_long):  # slow enough that the second caller arrives meanwhile
        builds.append(target)
        time.sleep(0.3)
        target.mkdir(parents=True)
        (target / "tokenizer_config.json").write_text("{}")
        (target / "model.safetensors").write_bytes(b"x")

    monkeypatch.setattr(loading, "_build_embedded", build)
    got = _twice_at_once(lambda: loading.embedded_model_folder("toy"))
    assert got == [tmp_path / "models" / "toy-fp32"] * 2
    assert len(builds) == 1  # the second waited for the lock, then found it built
    assert loading.embedded_model_folder("toy") == got[0] and len(builds) == 1  # cached: no lock taken


def test_the_icwsm_data_missing_twice_at_once_is_fetched_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path))
    fetches = []

    def fetch(root):
        fetches.append(root)
        time.sleep(0.3)
        root.mkdir(parents=True)
        (root.parent / prompts._MOVIES).write_text("1\t2.0\tgood\n")

    monkeypatch.setattr(prompts, "_fetch_icwsm", fetch)
    got = _twice_at_once(prompts.icwsm_file)
    assert got == [tmp_path / "data" / prompts._MOVIES] * 2 and len(fetches) == 1


def test_the_default_judge_missing_twice_at_once_is_fitted_once(tmp_path, monkeypatch):
    import torch

    from tether.judges import reward_model as rm

    monkeypatch.setenv("TETHER_CACHE", str(tmp_path))
    fits = []

    def fit(path, progress, max_sentences):  # slow enough that the second caller arrives meanwhile
        fits.append(path)
        time.sleep(0.3)
        rm.RewardModel(torch.ones(3), 0.5).save(path, {})
        return {"reward_model": {"pairwise_accuracy": 0.8}, "vader": {"pairwise_accuracy": 0.7}}

    monkeypatch.setattr(rm, "fit_reward_model", fit)
    got = _twice_at_once(lambda: rm.load_reward_model(progress=False))
    assert [m.bias for m in got] == [0.5, 0.5]
    assert fits == [rm.default_rm_dir()]  # the second waited for the lock, then found it fitted
