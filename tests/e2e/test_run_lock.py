"""Issue #30, item 2: one writer per run folder (a lock with a stale-lock rule), default run
folders that cannot collide."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import tiny_run_args
from tether.run.lock import LOCK_NAME, RunLocked, acquire, release

REPO = Path(__file__).resolve().parents[2]


def _write_lock(run_dir: Path, host: str, pid: int) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK_NAME).write_text(json.dumps({"host": host, "pid": pid, "since": 0.0}))


def test_a_live_holder_is_refused_by_name(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        _write_lock(tmp_path, socket.gethostname(), holder.pid)
        with pytest.raises(RunLocked, match=f"pid {holder.pid} on {socket.gethostname()}"):
            acquire(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone now: its lock is stale and is taken over, saying so
    path, note = acquire(tmp_path)
    assert note is not None and f"pid {holder.pid}" in note and "is gone" in note
    assert json.loads(path.read_text())["pid"] == os.getpid()
    release(path)
    assert not path.exists()


def test_another_hosts_lock_is_refused_and_a_torn_one_is_stale(tmp_path):
    _write_lock(tmp_path, "some-other-host", 1)
    with pytest.raises(RunLocked, match="on host some-other-host"):
        acquire(tmp_path)
    (tmp_path / LOCK_NAME).write_text('{"host": "')  # killed while writing it
    path, note = acquire(tmp_path)
    assert note is not None
    release(path)


def test_release_keeps_a_lock_another_process_took_over(tmp_path):
    path, _ = acquire(tmp_path)
    _write_lock(tmp_path, socket.gethostname(), os.getpid() + 1_000_000)
    release(path)
    assert path.exists()


def test_default_run_folders_differ_between_processes():
    from tether.run.setup import default_run_dir

    assert default_run_dir("ppo").name.endswith(f"-{os.getpid()}")


def _args(model_dir, prompts, out, steps):
    return tiny_run_args(
        model_dir,
        prompts,
        out,
        {
            "train.steps": steps,
            "train.checkpoint_every": 1,
            "eval.every": 0,
            "eval.fluency_model": "none",
            "reward.scorer": "tests.conftest:slow_length_scorer",
        },
        command=True,
    )


def _start(args):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-m", "tether", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _steps(out: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_runs_on_one_folder_one_writes(tiny_model_dir, prompt_file, tmp_path):
    """Started together on one train.output_dir: one trains, the other is refused (by the lock or
    the not-empty check, whichever it meets first); one run's rows, in order. The same for two
    resumes of one run."""
    out = tmp_path / "run"
    procs = [_start(_args(tiny_model_dir, prompt_file, out, 3)) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 1], outs
    refused = outs[[p.returncode for p in procs].index(1)]
    assert "in use by another tether process" in refused or "already holds a run" in refused, refused
    assert _steps(out) == [0, 1, 2]
    assert not (out / LOCK_NAME).exists()  # released at the end
    # the second resume starts once the first holds the lock (not by timing luck); the first has
    # 37 steps of >= 0.3 s left, longer than the second takes to start
    first = _start(["train", "--resume", str(out), "train.steps=40"])
    deadline = time.monotonic() + 120
    while not (out / LOCK_NAME).exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    second = _start(["train", "--resume", str(out), "train.steps=40"])
    second_out = second.communicate(timeout=300)[0]
    first_out = first.communicate(timeout=300)[0]
    assert (first.returncode, second.returncode) == (0, 1), (first_out, second_out)
    assert f"in use by another tether process (pid {first.pid}" in second_out
    assert _steps(out) == list(range(40))
