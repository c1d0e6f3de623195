"""One writer per run folder: a lock file taken before anything is written, released on exit.

``RUN/.tether.lock`` holds the holder's host, pid and start time, created with ``O_CREAT | O_EXCL``
(atomic on a local file system): of two processes started on one folder at once, exactly one
creates it. A lock whose holder is gone (same host, no such pid: a SIGKILL, a power cut) is stale
and is taken over with a message; one held by a live process, or by another host, is refused,
naming the holder.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".tether.lock"


class RunLocked(RuntimeError):
    """Another process holds the run folder's lock; the message names it and the fix."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user: alive
        return True
    return True


def acquire(run_dir: Path) -> tuple[Path, str | None]:
    """Take ``run_dir``'s lock (creating the folder); returns (lock path, a note when a stale lock
    was taken over, else None).

    Raises:
        RunLocked: a live process (this host) or a process of another host holds it.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    # the lock appears whole or not at all: written beside it, then hard-linked to its name (link
    # fails if the name exists), so a second process never reads a lock still being written
    tmp = path.with_name(f".{LOCK_NAME}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(me))
    try:
        return _take(path, tmp, run_dir, me)
    finally:
        tmp.unlink(missing_ok=True)


def _take(path: Path, tmp: Path, run_dir: Path, me: dict) -> tuple[Path, str | None]:
    note = None
    for _ in range(2):  # the second try after removing a stale lock
        try:
            os.link(tmp, path)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
                host, pid = str(holder["host"]), int(holder["pid"])
            except (OSError, ValueError, KeyError, TypeError):
                holder, host, pid = {}, "?", -1  # damaged (never half-written by tether): stale
            if host == me["host"] and pid > 0 and _alive(pid) and pid != me["pid"]:
                raise RunLocked(
                    f"{run_dir} is in use by another tether process (pid {pid} on {host}, {path}); "
                    "wait for it to end, stop it, or use another train.output_dir"
                ) from None
            if host not in (me["host"], "?"):
                raise RunLocked(
                    f"{run_dir} is locked by a tether process on host {host} (pid {pid}, {path}); if it is "
                    "no longer running there, delete the lock file and run again"
                ) from None
            path.unlink(missing_ok=True)
            note = f"tether: took over a stale lock of {run_dir} (pid {pid} on {host} is gone)"
            continue
        return path, note
    raise RunLocked(f"{run_dir}: could not take its lock {path}; another process keeps taking it")


def release(path: Path | None) -> None:
    """Remove the lock at ``path`` if this process holds it (a lock taken over by another is kept)."""
    if path is None:
        return
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)
