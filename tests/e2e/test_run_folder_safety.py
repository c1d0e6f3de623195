"""Issue #30, item 1: nothing read from a run folder runs code, and no path read from it leaves it;
``~`` and environment variables in path fields are expanded."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess

import pytest
import torch

from tests.conftest import metric_rows, tiny_run_args
from tether import load_config, train
from tether.cli import main
from tether.run.checkpoint import file_digests, latest_checkpoint, load_trainer_state, meta_digest
from tether.run.files import RunFileError, append_lines, atomic_write_text, own_folder
from tether.run.folder import RunFolderError, check_no_links


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


def _run_folder(tiny_model_dir, prompt_file, out) -> None:
    """A tiny run of 2 steps, checkpointed after each, with samples."""
    assert main(_run(tiny_model_dir, prompt_file, out) + ["train.sample_every=1"]) == 0


def test_a_run_folder_holding_a_link_is_refused_before_anything_is_read_or_written(
    tiny_model_dir, prompt_file, tmp_path, capsys
):
    """Issue 50, items 3 and 9: with samples.jsonl a dangling link to a file outside the run,
    --resume created and filled that file; a symlinked policy/ failed after the training (the
    rename onto a link), a symlinked checkpoints/ had tether delete in the folder it points to.
    A run folder holding a link is refused on --resume, tether report and tether push, naming the
    link, before anything is read or written."""
    out, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    _run_folder(tiny_model_dir, prompt_file, out)
    rows = metric_rows(out)
    (out / "samples.jsonl").unlink()
    (out / "samples.jsonl").symlink_to(outside / "planted.jsonl")
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "train.steps=3"]) == 1
    err = capsys.readouterr().err
    print(err)
    assert f"samples.jsonl -> {outside / 'planted.jsonl'} (outside the run)" in err
    assert "Replace each link with a copy of what it points to, or remove it" in err
    assert not (outside / "planted.jsonl").exists() and metric_rows(out) == rows
    (out / "samples.jsonl").unlink()
    # policy/ a link, even to a folder inside the run: refused at the start, not after training
    (out / "kept").mkdir()
    (out / "policy").symlink_to(out / "kept")
    assert main(["train", "--resume", str(out), "train.steps=3", "train.save_model=true"]) == 1
    assert "policy -> " in capsys.readouterr().err and metric_rows(out) == rows
    (out / "policy").unlink()
    # the same check on tether report and tether push (also called from Python: train() with resume)
    (out / "config.yaml").rename(out / "config.real.yaml")
    (out / "config.yaml").symlink_to(outside / "secret.yaml")
    (outside / "secret.yaml").write_text("secret: 1\n")
    assert main(["report", str(out)]) == 1
    assert "tether report" in capsys.readouterr().err and not (out / "report.html").exists()
    assert main(["push", str(out), "org/name"]) == 1
    assert "tether push" in capsys.readouterr().err
    with pytest.raises(RunFolderError, match="config.yaml -> "):
        check_no_links(out, "--resume")


def test_no_write_goes_through_a_link_planted_while_the_run_goes_on(tmp_path):
    """Issue 50, item 3: a link put at a run file's name after the start cannot lead a write out
    of the run: an appended row refuses it (O_NOFOLLOW), a file replaced whole replaces the link
    itself, a temporary file is created new, and checkpoints/ as a link is refused."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    (run / "samples.jsonl").symlink_to(outside / "planted.jsonl")
    with pytest.raises(RunFileError, match=r"samples\.jsonl is a symbolic link \(to .*planted\.jsonl\)"):
        append_lines(run / "samples.jsonl", ['{"step": 0}'])
    assert not (outside / "planted.jsonl").exists()
    (outside / "eval.json").write_text("theirs")
    (run / "eval.json").symlink_to(outside / "eval.json")
    (run / f".config.yaml.tmp{os.getpid()}").symlink_to(outside / "config.yaml")  # where the temporary goes
    atomic_write_text(run / "eval.json", "{}")
    atomic_write_text(run / "config.yaml", "a: 1\n")
    assert not (run / "eval.json").is_symlink() and (run / "eval.json").read_text() == "{}"
    assert (outside / "eval.json").read_text() == "theirs" and not (outside / "config.yaml").exists()
    assert (run / "config.yaml").read_text() == "a: 1\n"
    (run / "checkpoints").symlink_to(outside)
    with pytest.raises(RunFileError, match="checkpoints is a symbolic link"):
        own_folder(run / "checkpoints")


def test_report_on_a_read_only_run_names_out(tmp_path, unprivileged):
    """Issue 50, item 6: tether report on a read-only run folder was a traceback; it is an error
    that names --out, and --out writes the report elsewhere."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "objective/scores": 0.5}) + "\n")
    run.chmod(0o555)
    try:
        r = unprivileged("-m", "tether", "report", str(run))
        print(r.stderr)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        assert f"tether report: cannot write {run / 'report.html'} (Permission denied)" in r.stderr
        assert f"tether report {run} --out FILE.html" in r.stderr
        assert not (run / "report.html").exists()
        elsewhere = tmp_path / "report.html"
        r = unprivileged("-m", "tether", "report", str(run), "--out", str(elsewhere))
        assert r.returncode == 0 and "<h1>tether run run</h1>" in elsewhere.read_text()
    finally:
        run.chmod(0o755)


def test_a_run_folder_copied_with_hard_links_is_refused(tiny_model_dir, prompt_file, tmp_path, capsys):
    """Issue 50b, item 3: ``cp -al run copy; tether train --resume copy`` appended the copy's steps
    to run's metrics.jsonl and samples.jsonl (one file, two names). A run folder holding a file
    with other hard links is refused on --resume, tether report and tether push, naming the file
    and the fix (cp -r)."""
    out, copy = tmp_path / "run", tmp_path / "copy"
    _run_folder(tiny_model_dir, prompt_file, out)
    rows, samples = metric_rows(out), (out / "samples.jsonl").read_bytes()
    subprocess.run(["cp", "-al", str(out), str(copy)], check=True)
    capsys.readouterr()
    assert main(["train", "--resume", str(copy), "train.steps=3"]) == 1
    err = capsys.readouterr().err
    print(err)
    assert "the run folder holds files with other hard links" in err and "config.yaml (2 links)" in err
    assert "copy it with cp -r instead" in err
    assert metric_rows(out) == rows and (out / "samples.jsonl").read_bytes() == samples
    assert main(["report", str(copy)]) == 1 and "files with other hard links" in capsys.readouterr().err
    assert main(["push", str(copy), "org/name"]) == 1 and "cp -al" in capsys.readouterr().err
    with pytest.raises(RunFolderError, match=r"config\.yaml \(2 links\)"):
        check_no_links(out, "--resume")  # the original is refused too: its files have two names now
    # the lock is the one file tether hard-links itself (written beside its name, then linked)
    shutil.rmtree(copy)
    (out / ".tether.lock").write_text("{}")
    os.link(out / ".tether.lock", out / f"..tether.lock.tmp{os.getpid()}")
    check_no_links(out, "--resume")


@pytest.mark.parametrize(
    "name",
    [
        "metrics.jsonl",
        "run.json",
        ".tether.lock",
        "checkpoints/LATEST",
        "data.json",
        "samples.jsonl",
        "config.yaml",
    ],
)
def test_a_fifo_in_a_run_folder_is_refused_before_anything_blocks_on_it(
    tiny_model_dir, prompt_file, tmp_path, capsys, hang_guard, name
):
    """Issue 50b, item 3: a FIFO at a run file's name made --resume (and tether report, at
    metrics.jsonl) hang; a FIFO config.yaml was "not a tether run directory (no config.yaml)".
    Entries that are neither files nor folders are refused, naming them, before any is opened."""
    out = tmp_path / "run"
    args = tiny_run_args(tiny_model_dir, prompt_file, out, {"train.steps": 1, "train.checkpoint_every": 1})
    assert main(["train", *args]) == 0
    (out / name).unlink(missing_ok=True)
    os.mkfifo(out / name)
    capsys.readouterr()
    with hang_guard():
        assert main(["train", "--resume", str(out), "train.steps=2"]) == 1
        err = capsys.readouterr().err
        assert f"holds entries that are neither files nor folders: {name}: a FIFO" in err, err
        assert "Remove each (rm PATH)" in err
        assert main(["report", str(out)]) == 1
        assert f"{name}: a FIFO" in capsys.readouterr().err
    assert stat.S_ISFIFO(os.lstat(out / name).st_mode)


def test_files_a_person_put_in_the_run_folder_during_the_first_step_are_kept(
    tiny_model_dir, prompt_file, tmp_path, caplog
):
    """Issue 50b, item 5: a run that failed before its first step completed removed its whole
    folder, NOTES.md and analysis/results.csv that a person wrote there meanwhile included. Only
    tether's files go; the folder is kept with the others and the message says why the same
    command will refuse it. A folder holding only tether's files still goes."""
    out = tmp_path / "run"

    def notes_then_fails(completions, **kwargs):
        (out / "NOTES.md").write_text("what I saw")
        (out / "analysis").mkdir()
        (out / "analysis" / "results.csv").write_text("a,b\n")
        raise ValueError("the reward failed")

    config = load_config(None, tiny_run_args(tiny_model_dir, prompt_file, out, {"reward.scorer": None}))
    with pytest.raises(Exception, match="the reward failed"):
        train(config, reward_funcs=notes_then_fails)
    assert sorted(os.listdir(out)) == ["NOTES.md", "analysis"]
    assert (out / "analysis" / "results.csv").read_text() == "a,b\n"
    assert f"kept {out}, which holds files tether did not write (NOTES.md, analysis/)" in caplog.text
    assert "the same command will refuse this one: move them out of it" in caplog.text
    shutil.rmtree(out)

    def fails(completions, **kwargs):
        raise ValueError("the reward failed")

    with pytest.raises(Exception, match="the reward failed"):
        train(config, reward_funcs=fails)
    assert not out.exists()
