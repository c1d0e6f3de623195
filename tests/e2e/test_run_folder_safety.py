"""Issue #30, item 1: nothing read from a run folder runs code, and no path read from it leaves it;
``~`` and environment variables in path fields are expanded."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tether import load_config
from tether.cli import main
from tether.run.checkpoint import file_digests, latest_checkpoint, load_trainer_state, meta_digest


class Payload:
    """What an attacker pickles: unpickling it calls ``open(marker, "w")``."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickled_payload_in_trainer_pt_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"trainer": Payload(str(marker))}, tmp_path / "trainer.pt")
    with pytest.raises(ValueError, match=r"trainer\.pt: not a trainer state tether wrote"):
        load_trainer_state(tmp_path / "trainer.pt")
    assert not marker.exists()
    (tmp_path / "torn.pt").write_bytes(b"PK\x03\x04 not a whole file")
    with pytest.raises(ValueError, match=r"torn\.pt"):
        load_trainer_state(tmp_path / "torn.pt")


def _run(tiny_model_dir, prompt_file, out) -> list[str]:
    return [
        "train",
        f"model.name={tiny_model_dir}",
        f"data.prompts={prompt_file}",
        "data.heldout_fraction=0.2",
        "rollout.batch_size=4",
        "rollout.max_new_tokens=4",
        "optim.minibatch_size=2",
        "optim.epochs=1",
        "train.steps=2",
        "eval.n_prompts=2",
        "eval.every=0",
        "eval.judge=none",
        "eval.fluency_model=none",
        "reward.scorer=tests.conftest:length_judge",
        "train.progress=false",
        "train.save_model=false",
        "train.checkpoint_every=1",
        f"train.output_dir={out}",
    ]


def test_resume_of_a_run_folder_with_a_payload_runs_nothing(tiny_model_dir, prompt_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_run(tiny_model_dir, prompt_file, out)) == 0
    ckpt = latest_checkpoint(out)
    state = load_trainer_state(ckpt / "trainer.pt")  # tether's own file loads with weights_only=True
    assert "trainer" in state and "rng" in state
    marker = tmp_path / "ran"
    torch.save({**state, "trainer": Payload(str(marker))}, ckpt / "trainer.pt")
    # an attacker who also rewrites meta.json's digests gets past the checksum: the load refuses
    meta = json.loads((ckpt / "meta.json").read_text()) | {"files": file_digests(ckpt)}
    (ckpt / "meta.json").write_text(json.dumps(meta | {"meta_sha256": meta_digest(meta)}))
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "train.steps=3"]) != 0
    assert not marker.exists()
    assert "not a trainer state tether wrote" in capsys.readouterr().err


def test_a_payload_without_matching_digests_is_passed_over(tiny_model_dir, prompt_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_run(tiny_model_dir, prompt_file, out)) == 0
    ckpt = latest_checkpoint(out)
    marker = tmp_path / "ran"
    torch.save(
        {**load_trainer_state(ckpt / "trainer.pt"), "trainer": Payload(str(marker))}, ckpt / "trainer.pt"
    )
    capsys.readouterr()
    # the newest checkpoint fails its checksum, is moved aside unread, and the one before resumes
    assert main(["train", "--resume", str(out), "train.steps=3"]) == 0
    assert not marker.exists()
    said = capsys.readouterr().out
    assert f"checkpoint {ckpt.name} is damaged" in said and "trainer.pt (SHA-256 differs)" in said
    assert (out / "checkpoints" / f".damaged-{ckpt.name}").is_dir()


@pytest.mark.parametrize("name", ["../../..", "/etc", "..", "step-1/../../x", ""])
def test_latest_must_name_a_folder_inside_checkpoints(tmp_path, name):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "LATEST").write_text(name)
    with pytest.raises(ValueError, match="not a checkpoint folder inside"):
        latest_checkpoint(tmp_path)


def test_latest_naming_a_folder_beside_it_is_followed(tmp_path):
    step = tmp_path / "checkpoints" / "step-3"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 3}))
    (tmp_path / "checkpoints" / "LATEST").write_text("step-3\n")
    assert latest_checkpoint(tmp_path) == step


def test_home_and_variables_are_expanded_in_path_fields(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TETHER_TEST_DATA", str(tmp_path / "data"))
    c = load_config(
        None,
        [
            "train.output_dir=~/runs/x",
            "data.prompts=$TETHER_TEST_DATA/p.txt",
            "dpo.pairs=${TETHER_TEST_DATA}/pairs.jsonl",
            "model.name=ORG/NAME",
        ],
    )
    assert c.train.output_dir == str(tmp_path / "runs" / "x")
    assert c.data.prompts == str(tmp_path / "data" / "p.txt")
    assert c.dpo.pairs == str(tmp_path / "data" / "pairs.jsonl")
    assert c.model.name == "ORG/NAME" and load_config(None, []).dpo.pairs == "sampled"
    assert not os.path.exists("~")
