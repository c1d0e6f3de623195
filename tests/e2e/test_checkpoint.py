"""Checkpoints: SIGKILL and resume reproduce the uninterrupted run; a torn write loses nothing."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import metric_rows, tiny_run_args
from tether.run.checkpoint import latest_checkpoint, load_checkpoint, meta_digest, save_checkpoint
from tether.run.files import RunFileError

REPO = Path(__file__).resolve().parents[2]


def _args(model_dir, prompts, out, steps=6):
    return tiny_run_args(
        model_dir,
        prompts,
        out,
        {
            "rollout.max_new_tokens": 6,
            "optim.epochs": None,
            "train.steps": steps,
            "train.checkpoint_every": 2,
            "eval.n_prompts": 4,
            "eval.every": 2,
            "eval.periodic_prompts": 4,
            "eval.judge": "tests.conftest:length_judge",
            "eval.fluency_model": model_dir,  # a subprocess: conftest's stand-in does not reach it
            "reward.scorer": "tests.conftest:slow_length_scorer",
        },
        command=True,
    )


def _tether(args, env_vars: dict | None = None, **kw):
    # one thread: the test's tiny model gains nothing from more, and oversubscribed OpenMP threads
    # can stall a loaded machine; this checkout's src/ before an installed tether
    path = os.pathsep.join([str(REPO / "src"), str(REPO)])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", **(env_vars or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "tether", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def test_sigkill_then_resume_matches_uninterrupted(tiny_model_dir, prompt_file, tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    p = _tether(_args(tiny_model_dir, prompt_file, full))
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out

    p = _tether(_args(tiny_model_dir, prompt_file, killed))
    deadline = time.time() + 240
    while time.time() < deadline:  # kill once step 4 is logged (the checkpoint of step 3 exists)
        m = killed / "metrics.jsonl"
        if m.exists() and len(m.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)
    assert latest_checkpoint(killed).name == "step-000003"

    p = _tether(["train", "--resume", str(killed)])
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    a, b = metric_rows(full), metric_rows(killed)
    assert [r["step"] for r in b] == list(range(6))
    assert a == b  # every metric of every step, bit for bit (CPU, fixed seed)
    assert json.loads((full / "eval.json").read_text()) == json.loads((killed / "eval.json").read_text())


def test_sigterm_checkpoints_and_stops(tiny_model_dir, prompt_file, tmp_path):
    out_dir = tmp_path / "term"
    p = _tether(_args(tiny_model_dir, prompt_file, out_dir, steps=50))
    while not (
        (out_dir / "metrics.jsonl").exists() and (out_dir / "metrics.jsonl").read_text().count("\n") >= 1
    ):
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 130, out
    assert "--resume" in out
    ckpt = latest_checkpoint(out_dir)
    last = metric_rows(out_dir)[-1]["step"]
    assert ckpt is not None and json.loads((ckpt / "meta.json").read_text())["step"] == last


def test_ctrl_c_while_the_environment_hangs_is_said_and_a_second_keeps_the_step_before(
    tiny_model_dir, prompt_file, tmp_path
):
    """An environment that hung at step 1: the first Ctrl-C said nothing, the second ended in a
    traceback with step 0 lost. Now the first is said at once, naming what tether waits for, and
    the second stops the wait: the checkpoint of step 0, exit status 130, --resume named."""
    import threading

    out, marker = tmp_path / "run", tmp_path / "hanging"
    tool = [
        "rollout.env=tests.conftest:faulty_env",
        "rollout.max_turns=2",
        "rollout.stop_strings=e",
        "rollout.max_new_tokens=16",
        "rollout.env_timeout=300",
    ]
    faults = {
        "TETHER_TEST_ENV_FAULT": "hang",
        "TETHER_TEST_ENV_METRICS": str(out / "metrics.jsonl"),
        "TETHER_TEST_ENV_AFTER": "1",  # at step 1's first call
        "TETHER_TEST_ENV_MARKER": str(marker),
    }
    p = _tether(_args(tiny_model_dir, prompt_file, out, steps=4) + tool, faults)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
    reader.start()

    def wait_for(what, seconds: float) -> bool:
        deadline = time.time() + seconds
        while not what() and time.time() < deadline and p.poll() is None:
            time.sleep(0.05)
        return bool(what())

    try:
        assert wait_for(marker.exists, 240), "".join(lines)
        p.send_signal(signal.SIGINT)
        # said while the environment still hangs (it would for 300 s)
        assert wait_for(lambda: any("stopping after the step in progress" in line for line in lines), 30), (
            lines
        )
        said = next(line for line in lines if "stopping after the step in progress" in line)
        assert "waiting for rollout.env (row" in said and "at most rollout.env_timeout=300 s" in said, said
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=120) == 130
    finally:
        p.kill()
    reader.join(timeout=10)
    text = "".join(lines)
    assert "stopped while waiting for rollout.env (row" in text and "holds the run after step 0" in text, text
    assert f"tether train --resume {out}" in text and "Traceback" not in text, text
    assert latest_checkpoint(out).name == "step-000000"


def test_torn_checkpoint_write_keeps_the_previous_one(tiny_lm, tmp_path, monkeypatch):
    from tether.models.policy import PolicyWithValue

    policy = PolicyWithValue(tiny_lm)
    save_checkpoint(tmp_path, 1, policy, {"x": 1}, "fp")
    import safetensors.torch

    def die(*a, **k):  # the process dies in the middle of writing the next checkpoint
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.torch, "save_file", die)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, policy, {"x": 2}, "fp")
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt.name == "step-000001"
    meta, state = load_checkpoint(ckpt, PolicyWithValue(tiny_lm))
    assert meta["step"] == 1 and state == {"x": 1}


def test_resume_without_checkpoint_is_a_clear_error(tiny_model_dir, prompt_file, tmp_path, capsys):
    from tether.cli import main

    out = tmp_path / "r"
    assert main(_args(tiny_model_dir, prompt_file, out, steps=1) + ["train.checkpoint_every=0"]) == 0
    assert main(["train", "--resume", str(out)]) == 1
    assert "no complete checkpoint" in capsys.readouterr().err


def test_resume_of_a_folder_that_is_not_a_run(tmp_path, capsys):
    from tether.cli import main

    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 1
    assert "not a tether run directory" in capsys.readouterr().err


def _budget_trainer(tiny_model_dir, prompt_file, out, *extra):
    """A PPO trainer on the tiny model under kl.controller=budget (budget 6, eta 0.01), no evaluation."""
    from tether.run.config import load_config
    from tether.run.setup import build_run
    from tether.trainers.ppo import PPOTrainer

    cfg = load_config(
        None,
        [
            f"model.name={tiny_model_dir}",
            f"data.prompts={prompt_file}",
            "rollout.batch_size=4",
            "optim.minibatch_size=2",
            "reward.scorer=tests.conftest:length_judge",
            f"train.output_dir={out}",
            "kl.controller=budget",
            "kl.budget=6.0",
            "kl.budget_eta=0.01",
            "eval.n_prompts=0",
            "eval.every=0",
            *extra,
        ],
    )
    return PPOTrainer(build_run(cfg))


def test_budget_checkpoint_from_before_kp_resumes_as_pure_dual_ascent(tiny_model_dir, prompt_file, tmp_path):
    # a checkpoint written before kl.budget_kp existed holds only kl_coef, budget and eta; it ran
    # pure dual ascent, so the resumed controller must go on with kp = 0, not the new default 1.0
    trainer = _budget_trainer(tiny_model_dir, prompt_file, tmp_path / "run")
    assert trainer.controller.kp == 3.0  # the config default
    state = trainer.state_dict()
    state["controller"] = {"kl_coef": 0.2, "budget": 6.0, "eta": 0.01}  # what the old code saved
    trainer.load_state_dict(state)
    c = trainer.controller
    assert (c.kl_coef, c.dual, c.kp, c.eta) == (0.2, 0.2, 0.0, 0.01)
    # the old rule: max(0, 0.2 + 0.01 * (8 - 6)) = 0.22
    assert c.update(8.0, 4) == pytest.approx(0.22, abs=1e-15)
    # a new checkpoint round-trips kp and dual as saved
    c.kp, c.dual = 1.0, 0.5
    trainer.load_state_dict(trainer.state_dict())
    assert (trainer.controller.kp, trainer.controller.dual) == (1.0, 0.5)


def test_budget_checkpoint_keeps_the_last_kl_for_the_derivative_term(tiny_model_dir, prompt_file, tmp_path):
    # the derivative term needs the previous step's KL across a resume; a changed controller
    # setting forgets it (a rise measured under other settings means nothing)
    made = []

    def trainer(*extra):
        made.append(None)
        out = tmp_path / f"run{len(made)}"
        return _budget_trainer(tiny_model_dir, prompt_file, out, "kl.kl_coef=0", "kl.budget_kd=3.0", *extra)

    assert trainer("kl.budget_kd=0").controller.kd == 0.0
    t = trainer()
    assert (t.controller.kp, t.controller.kd) == (3.0, 3.0)
    # under budget: dual max(0, 0 + 0.01 * (4 - 6)) = 0, beta max(0, 3 * (-2)) = 0, last_kl 4
    assert t.controller.update(4.0, 4) == 0.0
    state = t.state_dict()
    fresh = trainer()
    fresh.load_state_dict(state)
    c = fresh.controller
    assert (c.last_kl, c.kd, c.kl_coef, c.dual) == (4.0, 3.0, 0.0, 0.0)
    # rise 1.5 from the restored 4.0: dual max(0, 0.01 * (-0.5)) = 0; beta 3 * (-0.5) + 3 * 1.5 = 3.0
    assert c.update(5.5, 4) == pytest.approx(3.0, abs=1e-12)
    changed = trainer("kl.budget=5.0")
    changed.load_state_dict(state)
    assert changed.controller.last_kl is None


TENSORS = {"lm": {"w": torch.zeros(2)}, "value_head": {"b": torch.zeros(1)}}
"""What a checkpoint holds of a policy (:func:`tether.run.checkpoint.policy_tensors`), tiny."""


def test_a_checkpoint_deletes_only_what_tether_wrote(tmp_path):
    """Issue 50, item 2: every folder of checkpoints/ that was not a kept step-N was deleted: a
    user's copy, another experiment in a scratch folder checkpoints/ linked to, another run's
    checkpoint. Only this run's step-N folders beyond train.keep_checkpoints go, and temporaries."""
    run, ours, theirs = tmp_path / "run", "a" * 32, "b" * 32
    save_checkpoint(run, 1, TENSORS, {"x": 1}, "fp", keep=1, run_id=ours)
    root = run / "checkpoints"
    shutil.copytree(root / "step-000001", root / "step-000001-keep")  # a user's copy
    (root / "other-experiment").mkdir()
    (root / "other-experiment" / "results.txt").write_text("precious")
    (root / "notes.txt").write_text("mine")
    save_checkpoint(tmp_path / "other", 0, TENSORS, {"x": 0}, "fp", run_id=theirs)
    shutil.copytree(tmp_path / "other" / "checkpoints" / "step-000000", root / "step-000000")  # dropped in
    (root / ".step-000002.tmp999999").mkdir()  # a killed process's temporary
    for step in (2, 3):
        save_checkpoint(run, step, TENSORS, {"x": step}, "fp", keep=1, run_id=ours)
    kept = {"LATEST", "step-000003", "step-000001-keep", "other-experiment", "notes.txt", "step-000000"}
    assert set(os.listdir(root)) == kept
    assert (root / "other-experiment" / "results.txt").read_text() == "precious"
    # checkpoints/ a link to a scratch folder: refused before anything is written or deleted there
    scratch = tmp_path / "scratch"
    (scratch / "other-experiment").mkdir(parents=True)
    shutil.rmtree(root)
    root.symlink_to(scratch)
    with pytest.raises(RunFileError, match=r"checkpoints is a symbolic link \(to .*scratch\)"):
        save_checkpoint(run, 4, TENSORS, {"x": 4}, "fp", keep=1, run_id=ours)
    assert os.listdir(scratch) == ["other-experiment"]


def test_a_checkpoint_of_another_run_is_refused_and_one_from_before_run_ids_resumes(
    tiny_model_dir, prompt_file, tmp_path, capsys
):
    """Issue 50, item 7: a checkpoint of another run dropped into checkpoints/ resumed silently
    (its digests vouch for its files, not for whose it is). Each checkpoint records the run's id
    (run.json); a resume refuses another run's, naming both; a checkpoint from before run ids
    resumes, saying so."""
    from tether.cli import main

    a, b = tmp_path / "a", tmp_path / "b"
    args = tiny_run_args(tiny_model_dir, prompt_file, a, {"train.steps": 2, "train.checkpoint_every": 1})
    assert main(["train", *args]) == 0
    ours = json.loads((a / "run.json").read_text())["run_id"]
    assert json.loads((latest_checkpoint(a) / "meta.json").read_text())["run_id"] == ours
    shutil.copytree(a, b)  # b: another run (its own id) that a's checkpoints were copied into
    (b / "run.json").write_text(json.dumps({"run_id": "f" * 32}))
    capsys.readouterr()
    assert main(["train", "--resume", str(b), "train.steps=3"]) == 1
    err = capsys.readouterr().err
    print(err)
    assert f"step-000001 is of another run (run id {ours}), not of this one (run id {'f' * 32}" in err
    assert metric_rows(b) == metric_rows(a)  # nothing trained, nothing written
    # a run folder of a tether from before run ids: its checkpoints resume, and it gets an id
    (a / "run.json").unlink()
    for folder in (a / "checkpoints").glob("step-*"):
        meta = json.loads((folder / "meta.json").read_text())
        meta = {k: v for k, v in meta.items() if k not in ("run_id", "meta_sha256")}
        (folder / "meta.json").write_text(json.dumps(meta | {"meta_sha256": meta_digest(meta)}))
    assert main(["train", "--resume", str(a), "train.steps=3"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint step-000001 records no run id (written by a tether from before run ids)" in out
    assert [r["step"] for r in metric_rows(a)] == [0, 1, 2]
    now = json.loads((a / "run.json").read_text())["run_id"]
    assert now != ours and json.loads((latest_checkpoint(a) / "meta.json").read_text())["run_id"] == now


@pytest.mark.parametrize("keep", [1, 2, 5])
def test_keep_checkpoints_keeps_as_many_as_it_says(tmp_path, keep):
    """Issue 50b, item 1: with train.keep_checkpoints=5 and 5 checkpoints written only steps 2-4
    were left: ``earlier[len(earlier) - (keep - 1):]`` starts at a negative index (counted from
    the end) while fewer than keep - 1 earlier checkpoints exist."""
    root = tmp_path / "checkpoints"
    for step in range(7):
        save_checkpoint(tmp_path, step, TENSORS, {"x": step}, "fp", keep=keep, run_id="a" * 32)
        newest = list(range(max(0, step + 1 - keep), step + 1))
        assert sorted(d.name for d in root.glob("step-*")) == [f"step-{s:06d}" for s in newest], step


def test_a_checkpoint_folder_it_would_write_is_replaced_only_when_it_is_its_own(
    tiny_model_dir, prompt_file, tmp_path, capsys
):
    """Issue 50b, item 2: run B's checkpoints/step-000003 copied into run A (whose newest is step
    1) was replaced by A's on --resume A, silently. tether replaces only its own checkpoints: the
    resume is refused before it trains, naming the folder and the fix, and save_checkpoint refuses
    another run's checkpoint, a folder without meta.json and a file at the name it would write."""
    from tether.cli import main
    from tether.run.checkpoint import file_digests, load_trainer_state

    a, ours, theirs = tmp_path / "a", "a" * 32, "b" * 32
    save_checkpoint(tmp_path / "b", 3, TENSORS, {"x": 3}, "fp", run_id=theirs)
    b3 = tmp_path / "b" / "checkpoints" / "step-000003"
    before = file_digests(b3) | {"meta.json": (b3 / "meta.json").read_text()}

    def intact(folder: Path) -> bool:
        return file_digests(folder) | {"meta.json": (folder / "meta.json").read_text()} == before

    # save_checkpoint itself: nothing replaced, nothing left behind, LATEST unmoved
    save_checkpoint(a, 1, TENSORS, {"x": 1}, "fp", keep=5, run_id=ours)
    root = a / "checkpoints"
    shutil.copytree(b3, root / "step-000003")
    with pytest.raises(
        RunFileError, match=r"step-000003 holds a checkpoint of another run \(run id b+,"
    ) as e:
        save_checkpoint(a, 3, TENSORS, {"x": 3}, "fp", keep=5, run_id=ours)
    assert "Move step-000003 out of" in str(e.value)
    assert intact(root / "step-000003") and latest_checkpoint(a).name == "step-000001"
    assert sorted(os.listdir(root)) == ["LATEST", "step-000001", "step-000003"]  # no temporary left
    (root / "step-000004").mkdir()  # a folder tether did not write (no meta.json)
    (root / "step-000004" / "notes.txt").write_text("mine")
    (root / "step-000005").write_text("a file")
    for step in (4, 5):
        with pytest.raises(RunFileError, match=f"step-00000{step} holds something tether did not write"):
            save_checkpoint(a, step, TENSORS, {"x": step}, "fp", keep=5, run_id=ours)
    assert (root / "step-000004" / "notes.txt").read_text() == "mine"
    assert (root / "step-000005").read_text() == "a file"
    # its own checkpoint at that name (a kill before LATEST named it) is replaced
    save_checkpoint(a, 6, TENSORS, {"x": 6}, "fp", keep=5, run_id=ours)
    (root / "LATEST").write_text("step-000001")
    save_checkpoint(a, 6, TENSORS, {"x": 66}, "fp", keep=5, run_id=ours)
    assert load_trainer_state(root / "step-000006" / "trainer.pt") == {"x": 66}

    # --resume: refused before any step, naming the folder; B's checkpoint and A's rows intact
    run = tmp_path / "run"
    args = tiny_run_args(tiny_model_dir, prompt_file, run, {"train.steps": 2, "train.checkpoint_every": 1})
    assert main(["train", *args]) == 0
    rows = metric_rows(run)
    shutil.copytree(b3, run / "checkpoints" / "step-000003")
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "train.steps=5"]) == 1
    err = capsys.readouterr().err
    print(err)
    assert f"{run / 'checkpoints' / 'step-000003'} holds a checkpoint of another run (run id {theirs}" in err
    assert f"Move step-000003 out of {run / 'checkpoints'}" in err
    assert intact(run / "checkpoints" / "step-000003") and metric_rows(run) == rows
    # a checkpoint beyond the steps the run will train is left alone
    assert main(["train", "--resume", str(run), "train.steps=3"]) == 0
    assert intact(run / "checkpoints" / "step-000003") and [r["step"] for r in metric_rows(run)] == [0, 1, 2]


def test_a_second_resume_from_the_same_step_keeps_the_config_that_trained_it(
    tiny_model_dir, prompt_file, tmp_path, capsys, monkeypatch
):
    """Issue 50b, item 4: --resume RUN train.seed=7 failed at step 2, before a new checkpoint;
    then --resume RUN optim.lr=0.5 overwrote config.until-step-1.yaml with config.yaml, which held
    seed 7 though steps 0-1 trained with seed 0. The record of the config that trained them stays."""
    from tether.cli import main
    from tether.run.config import load_config

    monkeypatch.setenv("TETHER_TEST_EXIT_MARKER", str(tmp_path / "raised"))
    run = tmp_path / "run"
    scorer = "tests.conftest:raises_once_at_step_2"
    args = tiny_run_args(
        tiny_model_dir,
        prompt_file,
        run,
        {"train.steps": 2, "train.checkpoint_every": 1, "reward.scorer": scorer, "eval.every": 0},
    )
    assert main(["train", *args]) == 0
    assert main(["train", "--resume", str(run), "train.steps=4", "train.seed=7"]) == 1  # fails at step 2
    assert latest_checkpoint(run).name == "step-000001"
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "train.steps=4", "optim.lr=0.5"]) == 0
    said = capsys.readouterr().out
    assert "config.until-step-1.yaml (written by an earlier resume from step 1" in said, said
    first = load_config(run / "config.until-step-1.yaml", [])
    assert (first.train.seed, first.train.steps, first.optim.lr) == (0, 2, 3e-4)
    now = load_config(run / "config.yaml", [])
    assert (now.train.seed, now.train.steps, now.optim.lr) == (7, 4, 0.5)
    assert [r["step"] for r in metric_rows(run)] == [0, 1, 2, 3]
