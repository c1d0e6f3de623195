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
from tether.run import lock
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


@pytest.fixture()
def live_pid():
    """The pid of a live process of this host that is no tether (a sleep)."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield holder.pid
    holder.kill()
    holder.wait()


def test_an_unreadable_lock_is_refused_naming_it_and_the_fix(tmp_path, live_pid, unprivileged):
    """Issue 50, item 1: a lock of another user that this one may not read (mode 000 here) was
    taken as damaged, so stale, and the resume trained beside the live holder. It is refused."""
    tmp_path.chmod(0o777)  # the second process may write the folder, not read the lock
    _write_lock(tmp_path, socket.gethostname(), live_pid)
    (tmp_path / LOCK_NAME).chmod(0)
    take = "import sys, pathlib, tether.run.lock as L; print(L.acquire(pathlib.Path(sys.argv[1])))"
    r = unprivileged("-c", take, str(tmp_path))
    print(r.stdout, r.stderr)
    assert r.returncode != 0 and "RunLocked" in r.stderr, r.stdout
    assert f"its lock {tmp_path / LOCK_NAME} cannot be read (Permission denied)" in r.stderr
    assert f"delete {tmp_path / LOCK_NAME} and run again" in r.stderr
    assert (tmp_path / LOCK_NAME).stat().st_mode & 0o777 == 0  # the holder's lock is kept


def test_a_reused_pid_is_stale_and_one_that_cannot_be_told_is_refused_with_the_fix(
    tmp_path, live_pid, monkeypatch
):
    """Issue 50, item 5: a lock whose pid now belongs to a process started later (the pid was
    reused) is stale; where the start time cannot be compared, the refusal says how to free it."""
    here, path = socket.gethostname(), tmp_path / LOCK_NAME
    now = lock.started(live_pid)
    if now is None:
        pytest.skip("no /proc: a process's start time cannot be read here")
    assert now != lock.started(os.getpid())
    # the lock's holder started at another time (another boot's clock ticks): the pid was reused
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": here, "pid": live_pid, "started": "other-boot:1"}))
    taken, note = acquire(tmp_path)
    assert note is not None and f"pid {live_pid} is now another process" in note
    assert json.loads(taken.read_text())["started"] == lock.started(os.getpid())
    release(taken)
    # the holder itself, still running: refused
    path.write_text(json.dumps({"host": here, "pid": live_pid, "started": now}))
    with pytest.raises(RunLocked, match=f"pid {live_pid} on {here}") as e:
        acquire(tmp_path)
    assert "cannot be compared" not in str(e.value)
    # a lock of a tether from before start times, or a system without /proc: cannot be told
    old, recorded = {"host": here, "pid": live_pid}, {"host": here, "pid": live_pid, "started": now}
    for record, no_proc in ((old, False), (recorded, True)):
        path.write_text(json.dumps(record))
        if no_proc:
            monkeypatch.setattr(lock, "started", lambda pid: None)
        with pytest.raises(RunLocked) as e:
            acquire(tmp_path)
        print(e.value)
        assert "its start time cannot be compared" in str(e.value)
        assert f"if no tether process runs on {tmp_path}, delete {path} and run again" in str(e.value)
        assert json.loads(path.read_text())["pid"] == live_pid  # kept


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


def _start(args, go: Path | None = None):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    if go is not None:  # for tests.conftest:length_scorer_held_until_go
        env["TETHER_TEST_GO"] = str(go)
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
    # the second resume starts once the first holds the lock (not by timing luck), and the first
    # holds it until the second has been answered: its reward waits for the test's go
    go = out.parent / "go"
    held = ["reward.scorer=tests.conftest:length_scorer_held_until_go"]
    first = _start(["train", "--resume", str(out), "train.steps=5", *held], go=go)
    deadline = time.monotonic() + 120
    while not (out / LOCK_NAME).exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    second = _start(["train", "--resume", str(out), "train.steps=5", *held], go=go)
    second_out = second.communicate(timeout=300)[0]
    go.touch()
    first_out = first.communicate(timeout=300)[0]
    assert (first.returncode, second.returncode) == (0, 1), (first_out, second_out)
    assert f"in use by another tether process (pid {first.pid}" in second_out
    assert _steps(out) == list(range(5))


TAKE = """
import json, os, sys, time
from pathlib import Path
import tether.run.lock as L

run_dir, me, pause = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "pause"
read = L._read


def read_then_wait(path):  # read the stale lock, then wait for the test's go before acting on it
    holder = read(path)
    (run_dir.parent / f"{me}-read").touch()
    deadline = time.monotonic() + 20
    while not (run_dir.parent / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return holder


if pause:
    L._read = read_then_wait
print("trying", flush=True)
try:
    L.acquire(run_dir)
    print("took", flush=True)
except L.RunLocked as e:
    print("refused:", e, flush=True)
deadline = time.monotonic() + 20
while not (run_dir.parent / "done").exists() and time.monotonic() < deadline:  # hold it, alive
    time.sleep(0.01)
"""


def test_two_processes_taking_over_one_stale_lock_one_holds_it(tmp_path):
    """Issue 50b, item 6: two processes found the same stale lock; the first removed it and took
    its own, then the second removed the first's and took its own: both held the run. Here the
    first is paused between reading the stale lock and removing it while the second tries; the
    read, removal and new lock happen under a flock of RUN/.tether.lock.mutex, so the second waits,
    then finds the first's live lock and is refused."""
    run = tmp_path / "run"
    _write_lock(run, socket.gethostname(), 2**22 + 12345)  # no such pid: stale

    def start(name: str, pause: bool):
        env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
        cmd = [sys.executable, "-c", TAKE, str(run), name, "pause" if pause else "-"]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    first = start("first", pause=True)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "first-read").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (tmp_path / "first-read").exists(), first.stdout
        second = start("second", pause=False)
        assert second.stdout.readline() == "trying\n"
        time.sleep(1.0)  # the second has read the stale lock and acted on it, or waits for the first
        (tmp_path / "go").touch()
        assert first.stdout.readline() == "trying\n"
        said = {"first": first.stdout.readline(), "second": second.stdout.readline()}
    finally:
        (tmp_path / "done").touch()
        outs = [p.communicate(timeout=30)[0] for p in (first, second)]
    print(said, outs)
    assert said["first"].startswith("took"), said
    assert said["second"].startswith(
        f"refused: {run} is in use by another tether process (pid {first.pid}"
    ), said
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == first.pid


def test_a_stale_lock_taken_by_several_processes_at_once_has_one_holder(tmp_path):
    """Issue 50b, item 6, as the reviewer found it: 4 processes take one stale lock at once, a few
    times; each time exactly one holds it."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    for trial in range(3):
        run = tmp_path / str(trial)
        _write_lock(run, socket.gethostname(), 2**22 + 12345)
        results = ctx.Queue()
        start = time.time() + 0.3
        procs = [ctx.Process(target=_take_at, args=(run, start, results)) for _ in range(4)]
        for p in procs:
            p.start()
        got = [results.get(timeout=30) for _ in procs]
        for p in procs:
            p.join(timeout=30)
        assert sorted(got).count("took") == 1, got


def _take_at(run: Path, start: float, results) -> None:
    while time.time() < start:  # all at once
        pass
    try:
        acquire(run)
        results.put("took")
        time.sleep(0.5)  # alive and holding while the others look
    except RunLocked:
        results.put("refused")


def test_a_process_that_holds_the_lock_is_refused_a_second_time(tmp_path):
    """Issue 50b, item 6: acquire() called twice in one process (two train() calls, a notebook)
    said it "took over a stale lock (pid X is gone)", X being the live process itself. It is refused;
    a lock of this pid written by a process started at another time (the pid reused) is stale."""
    path, _ = acquire(tmp_path)
    with pytest.raises(
        RunLocked, match=f"this process \\(pid {os.getpid()}\\) already holds the lock of {tmp_path}"
    ):
        acquire(tmp_path)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    if lock.started(os.getpid()) is not None:
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": "other-boot:1"}
        path.write_text(json.dumps(record))
        taken, note = acquire(tmp_path)
        assert note is not None and "the holder is gone" in note
        assert json.loads(taken.read_text())["started"] == lock.started(os.getpid())
    release(path)
    assert not path.exists()


def test_a_lock_that_is_not_a_file_is_refused_without_blocking(tmp_path, hang_guard):
    """A FIFO at the lock's name blocked acquire() in its read; it is refused, named."""
    os.mkfifo(tmp_path / LOCK_NAME)
    with hang_guard(), pytest.raises(RunLocked, match=f"{LOCK_NAME} is a FIFO"):
        acquire(tmp_path)
