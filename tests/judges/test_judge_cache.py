"""The gold judge's cache files are written whole or not at all, each process through its own
temporary file: two processes filling a fresh cache at once (two runs, or two pytest-xdist
workers) never read each other's half-written file."""

from __future__ import annotations

import os

import torch

from tether.judges import reward_model as rm


def test_a_saved_head_loads_and_leaves_no_temporary_file(tmp_path):
    model = rm.RewardModel(torch.arange(6, dtype=torch.float32), 0.25)
    model.save(tmp_path, {"pairs": 3})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head.safetensors", "report.json"]
    back = rm.RewardModel.load(tmp_path)
    assert torch.equal(back.weight, model.weight) and back.bias == 0.25


def test_embeddings_are_cached_through_a_file_of_this_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TETHER_CACHE", str(tmp_path))
    seen = []

    class Encoder:
        def encode(self, texts, progress=False):
            # nothing of this key is in the cache while it is encoded
            (tmp_path / "embeddings").mkdir(parents=True, exist_ok=True)
            seen.append(sorted(p.name for p in (tmp_path / "embeddings").iterdir()))
            return torch.ones(len(texts), 3)

    monkeypatch.setattr(rm, "MiniLMEncoder", Encoder)
    saved = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, path: (saved.append(path.name), real_save(obj, path)))
    e = rm.embeddings_cached(["a", "b"], progress=False)
    assert e.shape == (2, 3) and seen == [[]]
    assert saved and saved[0].startswith(".minilm-") and saved[0].endswith(f".tmp{os.getpid()}")
    files = sorted(p.name for p in (tmp_path / "embeddings").iterdir())
    assert len(files) == 1 and files[0].startswith("minilm-") and files[0].endswith(".pt")
    assert torch.equal(rm.embeddings_cached(["a", "b"], progress=False), e)  # read back, not encoded
    assert len(seen) == 1
