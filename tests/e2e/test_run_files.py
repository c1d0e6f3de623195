"""Issue #30, items 3 to 6: appends and rewrites that survive a kill or a full disk, checkpoints
that vouch for themselves (SHA-256, fallback), a resume's settings checked before anything is
rewritten, and failures inside user code or bad sizes that speak.

Each fault is injected for real where the machine allows it: a file-size limit
(``RLIMIT_FSIZE``; CPython ignores ``SIGXFSZ``, so a write past it fails with ``EFBIG`` as on a
full disk), ``SIGKILL``, a flipped byte, a ``sys.exit`` inside a reward function."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import metric_rows
from tether.cli import main
from tether.run.checkpoint import latest_checkpoint, resume_checkpoint, save_checkpoint, verify_checkpoint
from tether.run.files import read_jsonl, rewrite_jsonl

REPO = Path(__file__).resolve().parents[2]


def _child(code: str, limit: int | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python, under a file-size limit of ``limit`` bytes when given."""
    pre = f"import resource; resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n" if limit else ""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-c", pre + textwrap.dedent(code)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# ---- JSONL files ----------------------------------------------------------------------------


def test_a_torn_last_line_is_dropped_and_said_so(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "reward": 0.')  # killed inside a write
    with caplog.at_level(logging.WARNING, logger="tether"):
        assert read_jsonl(path) == [{"step": 0}, {"step": 1}]
    assert f"{path}:3: dropped a torn last line" in caplog.text


def test_a_bad_line_before_the_last_names_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, oops\n{"step": 2}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: not a JSON row"):
        read_jsonl(path)
    path.write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(ValueError, match=rf"{path}:2: a JSON list, not a row"):
        read_jsonl(path)


def test_an_append_past_a_file_size_limit_leaves_no_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": i, "reward": 0.5} for i in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "LATEST").write_text("step-000009")  # so the hint is --resume
    size = path.stat().st_size
    # the limit falls inside the next row: the kernel writes part of it, then refuses the rest
    p = _child(
        f"""
        from tether.run.files import append_lines
        try:
            append_lines({str(path)!r}, ['{{"step": 10, "reward": 0.123456789, "pad": "{"x" * 200}"}}'])
        except OSError as e:
            print("ERRNO", e.errno)
            print(e)
        """,
        limit=size + 50,
    )
    assert f"ERRNO {errno.EFBIG}" in p.stdout, p.stdout + p.stderr
    assert f"writing {path} failed: the file-size limit was reached" in p.stdout
    assert f"tether train --resume {tmp_path}" in p.stdout
    assert path.stat().st_size == size  # cut back: the ten whole rows, no part of the eleventh
    assert read_jsonl(path) == rows


def test_a_rewrite_killed_before_its_rename_leaves_the_old_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": i} for i in range(5)]
    rewrite_jsonl(path, rows)
    # the process dies (os._exit: no cleanup, as SIGKILL) once the new text is written, before
    # the rename; the file is the old one, whole
    p = _child(
        f"""
        import os
        from tether.run import files
        files.os.replace = lambda *a: os._exit(9)
        files.rewrite_jsonl(__import__("pathlib").Path({str(path)!r}), [{{"step": 0}}])
        """
    )
    assert p.returncode == 9
    assert read_jsonl(path) == rows
    leftovers = list(tmp_path.glob(".metrics.jsonl.tmp*"))
    assert len(leftovers) == 1  # what the next resume removes (RunWriter.truncate_after)
    from tether.run.metrics import RunWriter

    RunWriter(tmp_path).truncate_after(2)
    assert read_jsonl(path) == rows[:3] and not list(tmp_path.glob(".metrics.jsonl.tmp*"))


def test_a_full_disk_is_named_with_the_room_left(tmp_path):
    from tether.run.files import write_error

    e = write_error(tmp_path / "metrics.jsonl", OSError(errno.ENOSPC, "No space left on device"), "kept")
    assert e.errno == errno.ENOSPC
    assert str(e).startswith(f"writing {tmp_path / 'metrics.jsonl'} failed: the disk is full; ")
    assert "MiB free on its disk. kept. Free space" in str(e)
    assert str(e).endswith("and start the run again")  # no checkpoint there: nothing can resume
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "LATEST").write_text("step-000001")
    e = write_error(tmp_path / "metrics.jsonl", OSError(errno.ENOSPC, "No space left on device"), "kept")
    assert str(e).endswith(f"continue with: tether train --resume {tmp_path}")


# ---- checkpoints ----------------------------------------------------------------------------


def _policy(tiny_lm):
    from tether.models.policy import PolicyWithValue

    return PolicyWithValue(tiny_lm)


def test_checkpoints_record_every_file_and_keep_the_newest(tiny_lm, tmp_path):
    policy = _policy(tiny_lm)
    for step in range(4):
        save_checkpoint(tmp_path, step, policy, {"x": step}, "fp", keep=2)
    folders = sorted(d.name for d in (tmp_path / "checkpoints").iterdir() if d.is_dir())
    assert folders == ["step-000002", "step-000003"]
    meta = verify_checkpoint(latest_checkpoint(tmp_path))
    assert set(meta["files"]) == {"policy.safetensors", "value_head.safetensors", "trainer.pt"}
    save_checkpoint(tmp_path, 4, policy, {"x": 4}, "fp", keep=1)
    assert sorted(d.name for d in (tmp_path / "checkpoints").iterdir() if d.is_dir()) == ["step-000004"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "meta", "meta-step", "remove"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tiny_lm, tmp_path, damage):
    policy = _policy(tiny_lm)
    for step in range(3):
        save_checkpoint(tmp_path, step, policy, {"x": step}, "fp", keep=2)
    newest = latest_checkpoint(tmp_path)
    weights = newest / "policy.safetensors"
    if damage == "flip":
        data = bytearray(weights.read_bytes())
        data[-3] ^= 0x01  # one bit of one weight
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        (newest / "trainer.pt").write_bytes((newest / "trainer.pt").read_bytes()[:40])
    elif damage == "meta":
        (newest / "meta.json").write_text('{"step": 2, "files": {')
    elif damage == "meta-step":  # one bit: "step": 2 -> "step": 3, which would skip a step
        meta = (newest / "meta.json").read_text()
        (newest / "meta.json").write_text(meta.replace('"step": 2', '"step": 3'))
    else:
        weights.unlink()
    folder, notes = resume_checkpoint(tmp_path)
    assert folder.name == "step-000001" and latest_checkpoint(tmp_path) == folder
    assert "checkpoint step-000002 is damaged" in notes[0] and "moved aside" in notes[0]
    assert "resuming from checkpoint step-000001, the newest that verifies" in notes[-1]
    assert (tmp_path / "checkpoints" / ".damaged-step-000002").is_dir()
    # a later checkpoint keeps the damaged folder for a person to look at
    save_checkpoint(tmp_path, 2, policy, {"x": 2}, "fp", keep=2)
    assert (tmp_path / "checkpoints" / ".damaged-step-000002").is_dir()


def test_a_checkpoint_past_a_file_size_limit_names_the_file_and_keeps_the_last(tiny_model_dir, tmp_path):
    code = f"""
        from transformers import AutoModelForCausalLM
        from tether.models.policy import PolicyWithValue
        from tether.run.checkpoint import save_checkpoint
        policy = PolicyWithValue(AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r}))
        try:
            save_checkpoint({str(tmp_path)!r}, STEP, policy, {{"x": STEP}}, "fp")
        except OSError as e:
            print("ERROR", e)
        """
    assert _child(code.replace("STEP", "1")).returncode == 0
    size = (tmp_path / "checkpoints" / "step-000001" / "policy.safetensors").stat().st_size
    p = _child(code.replace("STEP", "2"), limit=size // 2)
    assert "ERROR writing" in p.stdout and "the file-size limit was reached" in p.stdout, p.stdout + p.stderr
    assert "step-000001 is kept" in p.stdout
    assert sorted(x.name for x in (tmp_path / "checkpoints").iterdir()) == ["LATEST", "step-000001"]
    assert resume_checkpoint(tmp_path) == (tmp_path / "checkpoints" / "step-000001", [])


# ---- whole runs -----------------------------------------------------------------------------


def _run(model_dir, prompts, out, *extra) -> list[str]:
    return [
        "train",
        f"model.name={model_dir}",
        f"data.prompts={prompts}",
        "data.heldout_fraction=0.2",
        "rollout.batch_size=4",
        "rollout.max_new_tokens=4",
        "optim.minibatch_size=2",
        "train.steps=4",
        "train.checkpoint_every=1",
        "eval.n_prompts=2",
        "eval.every=0",
        "eval.judge=none",
        "eval.fluency_model=none",
        "reward.scorer=tests.conftest:length_judge",
        "train.progress=false",
        "train.save_model=false",
        f"train.output_dir={out}",
        *extra,
    ]


def test_a_flipped_byte_resumes_from_the_checkpoint_before_bit_exact(
    tiny_model_dir, prompt_file, tmp_path, capsys
):
    full, hit = tmp_path / "full", tmp_path / "hit"
    assert main(_run(tiny_model_dir, prompt_file, full)) == 0
    # train.keep_checkpoints=2 (the default): the last two remain
    assert sorted(d.name for d in (full / "checkpoints").glob("step-*")) == ["step-000002", "step-000003"]
    assert main(_run(tiny_model_dir, prompt_file, hit)) == 0
    weights = hit / "checkpoints" / "step-000003" / "policy.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10
    weights.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["train", "--resume", str(hit)]) == 0
    said = capsys.readouterr().out
    assert "checkpoint step-000003 is damaged" in said and "policy.safetensors (SHA-256 differs)" in said
    assert "resuming after step 2" in said
    # step 3 ran again from the checkpoint of step 2: every row as the run that was never damaged
    assert metric_rows(hit) == metric_rows(full)


def test_a_resume_that_changes_the_model_or_folder_is_refused_untouched(
    tiny_model_dir, prompt_file, tmp_path, capsys
):
    out = tmp_path / "run"
    assert main(_run(tiny_model_dir, prompt_file, out, "train.steps=2")) == 0
    config = (out / "config.yaml").read_bytes()
    for override, field in [
        ("model.lora_r=4", "model.lora_r"),
        ("model.trainable_layers=1", "model.trainable_layers"),
        ("data.prompts=other.txt", "data.prompts"),
        ("train.algo=grpo", "train.algo"),
        (f"train.output_dir={tmp_path / 'elsewhere'}", "train.output_dir"),
    ]:
        capsys.readouterr()
        assert main(["train", "--resume", str(out), "train.steps=3", override]) == 2, override
        err = capsys.readouterr().err
        assert field in err and ("Drop the override" in err), err
        assert (out / "config.yaml").read_bytes() == config  # nothing rewritten
    assert not (tmp_path / "elsewhere").exists()
    assert not list(out.glob("config.until-step-*"))


@pytest.mark.parametrize(
    "fault, said",
    [
        ("exits_once_at_step_2", "step 2: the scorer raised SystemExit(0)"),
        # a reward's ordinary failure lost every step since the last checkpoint before
        (
            "raises_once_at_step_2",
            "step 2: the scorer failed on 4 texts (ConnectionError: the reward service",
        ),
    ],
)
def test_a_reward_that_exits_or_fails_stops_with_a_checkpoint_and_resumes_bit_exact(
    tiny_model_dir, prompt_file, tmp_path, capsys, monkeypatch, fault, said
):
    scorer = f"reward.scorer=tests.conftest:{fault}"
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    monkeypatch.setenv("TETHER_TEST_EXIT_MARKER", str(tmp_path / "already-exited"))
    (tmp_path / "already-exited").write_text("")  # this run's scorer never exits
    assert main(_run(tiny_model_dir, prompt_file, full, scorer, "train.checkpoint_every=0")) == 0
    monkeypatch.setenv("TETHER_TEST_EXIT_MARKER", str(tmp_path / "marker"))
    capsys.readouterr()
    assert main(_run(tiny_model_dir, prompt_file, stopped, scorer, "train.checkpoint_every=0")) == 1
    err = capsys.readouterr().err
    assert said in err, err
    assert "holds the run after step 1" in err and f"tether train --resume {stopped}" in err
    assert latest_checkpoint(stopped).name == "step-000001"
    assert main(["train", "--resume", str(stopped)]) == 0
    assert metric_rows(stopped) == metric_rows(full)


def test_a_stop_after_a_checkpointed_step_writes_no_second_checkpoint(
    tiny_model_dir, prompt_file, tmp_path, capsys, monkeypatch
):
    """The reward's SystemExit at step 2 wrote the checkpoint of step 1 again when
    train.checkpoint_every had just written it (seconds of weights, for nothing). Now the newest
    checkpoint is kept and named."""
    from tether.run import lifecycle

    saved, real = [], lifecycle.save_checkpoint
    monkeypatch.setattr(
        lifecycle,
        "save_checkpoint",
        lambda run_dir, step, *a, **k: saved.append(step) or real(run_dir, step, *a, **k),
    )
    monkeypatch.setenv("TETHER_TEST_EXIT_MARKER", str(tmp_path / "marker"))
    out = tmp_path / "run"
    assert (
        main(_run(tiny_model_dir, prompt_file, out, "reward.scorer=tests.conftest:exits_once_at_step_2")) == 1
    )
    err = capsys.readouterr().err
    assert saved == [0, 1], saved
    assert (
        f"the last checkpoint, {out / 'checkpoints' / 'step-000001'}, is kept" in err and "--resume" in err
    ), err


def test_data_files_by_suffix_in_any_case_and_the_rest_refused(tmp_path):
    from tether.data.prompts import load_prompt_data

    upper = tmp_path / "upper.JSONL"
    upper.write_text('{"prompt": "a film that"}\n{"prompt": "the movie was"}\n')
    assert list(load_prompt_data(str(upper)).prompts) == ["a film that", "the movie was"]
    tsv = tmp_path / "p.tsv"
    tsv.write_text("prompt\tid\na film\t1\n")
    with pytest.raises(ValueError, match=r"data.prompts=.*p\.tsv.*not \.tsv; convert it to \.csv"):
        load_prompt_data(str(tsv))
    gz = tmp_path / "p.jsonl.gz"
    gz.write_bytes(b"\x1f\x8b\x08\x00")
    with pytest.raises(ValueError, match=r"not \.gz; decompress it first"):
        load_prompt_data(str(gz))
    latin = tmp_path / "latin.txt"
    latin.write_bytes("a caf\xe9 film\n".encode("latin-1"))
    # "a caf" is bytes 0 to 4, so latin-1's one-byte é (0xe9, not a UTF-8 start byte) is at offset 5
    with pytest.raises(ValueError, match=r"latin\.txt is not UTF-8 text \(byte 0xe9 at offset 5\)"):
        load_prompt_data(str(latin))


def test_a_model_folder_missing_a_tensor_is_refused(tiny_model_dir, prompt_file, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    gone = sorted(k for k in tensors if "layers.0.mlp" in k)[0]
    del tensors[gone]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    assert main(_run(broken, prompt_file, tmp_path / "run")) == 1
    err = capsys.readouterr().err
    assert f"model.name={str(broken)!r}" in err and "1 tensor(s) are missing" in err and gone in err, err
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)  # not a safetensors file at all
    assert main(_run(broken, prompt_file, tmp_path / "run")) == 1
    assert f"model.name={str(broken)!r}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override,field",
    [
        ("train.seed=100000000000000000000", "train.seed"),
        ("rollout.temperature=1e-45", "rollout.temperature"),
        ("rollout.batch_size=1000000000", "rollout.batch_size"),
        ("rollout.max_new_tokens=200", "rollout.max_new_tokens"),  # past the model's 128 positions
    ],
)
def test_sizes_and_seeds_beyond_what_works_are_refused_before_work(
    tiny_model_dir, prompt_file, tmp_path, capsys, override, field
):
    assert main(_run(tiny_model_dir, prompt_file, tmp_path / "run", override)) in (1, 2)
    err = capsys.readouterr().err
    assert field in err, err
    assert not (tmp_path / "run").exists()


def test_a_second_damage_keeps_the_first_damaged_copy_and_a_bad_latest_is_passed_over(tiny_lm, tmp_path):
    policy = _policy(tiny_lm)
    for step in range(3):
        save_checkpoint(tmp_path, step, policy, {"x": step}, "fp", keep=3)
    root = tmp_path / "checkpoints"
    (root / "step-000002" / "trainer.pt").write_bytes(b"PK")
    assert resume_checkpoint(tmp_path)[0].name == "step-000001"
    save_checkpoint(tmp_path, 2, policy, {"x": 2}, "fp", keep=3)
    (root / "step-000002" / "trainer.pt").write_bytes(b"PK again")
    assert resume_checkpoint(tmp_path)[0].name == "step-000001"
    assert sorted(d.name for d in root.glob(".damaged-*")) == [
        ".damaged-step-000002",
        ".damaged-step-000002-2",
    ]
    (root / "LATEST").write_bytes(b"\xff\xfe junk")  # not text: ignored, never followed
    folder, notes = resume_checkpoint(tmp_path)
    assert folder.name == "step-000001" and "LATEST is damaged" in notes[0]
    assert (root / "LATEST").read_text() == "step-000001"


def test_a_reward_exit_at_step_0_removes_the_run_folder(tiny_model_dir, prompt_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_run(tiny_model_dir, prompt_file, out, "reward.scorer=tests.conftest:exits_at_step_0")) == 1
    err = capsys.readouterr().err
    assert "step 0: the scorer raised SystemExit(0)" in err and "the run folder is removed" in err, err
    assert "--resume" not in err and not out.exists()


def test_a_resume_on_edited_prompts_is_refused_and_a_respelled_path_accepted(
    tiny_model_dir, prompt_file, tmp_path, capsys
):
    out = tmp_path / "run"
    assert main(_run(tiny_model_dir, prompt_file, out, "train.steps=2")) == 0
    config = (out / "config.yaml").read_bytes()
    lines = prompt_file.read_text().splitlines()
    prompt_file.write_text("\n".join(lines[:60]) + "\n")  # 80 prompts -> 60
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "train.steps=3"]) == 1
    err = capsys.readouterr().err
    assert "the prompts differ from the run's" in err and "data.prompts=" in err, err
    assert (out / "config.yaml").read_bytes() == config
    prompt_file.write_text("\n".join(lines) + "\n")  # restored: the same prompts again
    # the model folder spelled with a trailing slash is the same folder, not a change of model
    assert main(["train", "--resume", str(out), "train.steps=3", f"model.name={tiny_model_dir}/"]) == 0


def test_text_encodings_and_folders_are_named(tmp_path):
    from tether.data.prompts import load_prompt_data

    bom = tmp_path / "bom.txt"
    bom.write_bytes("\ufeffthe movie was\na film\n".encode())
    assert list(load_prompt_data(str(bom)).prompts) == ["the movie was", "a film"]
    utf16 = tmp_path / "wide.txt"
    utf16.write_bytes("the movie was\n".encode("utf-16"))
    with pytest.raises(ValueError, match=r"wide\.txt is UTF-16 text; save it as UTF-8 \(iconv -f utf-16"):
        load_prompt_data(str(utf16))
    folder = tmp_path / "dir.txt"
    folder.mkdir()
    with pytest.raises(ValueError, match=r"data\.prompts=.*dir\.txt.*a folder datasets cannot read"):
        load_prompt_data(str(folder))
