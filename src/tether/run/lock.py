"""One writer per run folder: a lock file taken before anything is written, released on exit.

``RUN/.tether.lock`` holds the holder's host, pid, start time and when it took the lock, created
with ``O_CREAT | O_EXCL`` (atomic on a local file system): of two processes started on one folder
at once, exactly one creates it. A lock whose holder is gone is stale and is taken over with a
message: same host and no such pid (a SIGKILL, a power cut), or a pid that now belongs to a
process started at another time (the pid was reused: the start time, ``/proc/PID/stat`` field 22
with the boot's id, differs from the one the lock recorded). A lock held by a live process, by a
pid whose start cannot be compared (no ``/proc``, a lock from an older tether), by another host,
or that cannot be read (a lock of another user that this one may not read) is refused, naming the
holder, the lock file and the fix.
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


def started(pid: int) -> str | None:
    """When process ``pid`` started, as ``BOOT_ID:TICKS`` (the boot's id and ``/proc/PID/stat``
    field 22, clock ticks after boot): two processes that share a pid at different times differ
    here. None where it cannot be told (no ``/proc``: macOS; no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # field 3 on: the name before may hold spaces and ")"
    return f"{boot}:{fields[19]}" if len(fields) > 19 else None


def _read(path: Path) -> dict:
    """The lock's record, read without following a link.

    Raises:
        FileNotFoundError: it is gone (its holder released it); OSError: it cannot be read (no
            permission, a link); ValueError, KeyError, TypeError: it is damaged.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        holder = json.loads(f.read())
    return {**holder, "host": str(holder["host"]), "pid": int(holder["pid"])}


def acquire(run_dir: Path) -> tuple[Path, str | None]:
    """Take ``run_dir``'s lock (creating the folder); returns (lock path, a note when a stale lock
    was taken over, else None).

    Raises:
        RunLocked: a live process (this host) or a process of another host holds it, or it cannot
            be read or its holder cannot be told from a process that reused its pid.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.time(),
        "started": started(os.getpid()),
    }
    # the lock appears whole or not at all: written beside it, then hard-linked to its name (link
    # fails if the name exists), so a second process never reads a lock still being written
    tmp = path.with_name(f".{LOCK_NAME}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), "w") as f:
        f.write(json.dumps(me))
    try:
        return _take(path, tmp, run_dir, me)
    finally:
        tmp.unlink(missing_ok=True)


def _take(path: Path, tmp: Path, run_dir: Path, me: dict) -> tuple[Path, str | None]:
    note = None
    free = f"if no tether process runs on {run_dir}, delete {path} and run again"
    for _ in range(3):  # again after a stale lock is removed, or after the holder released it
        try:
            os.link(tmp, path)
        except FileExistsError:
            try:
                holder = _read(path)
                host, pid = holder["host"], holder["pid"]
            except FileNotFoundError:  # released between the two calls: take it now
                continue
            except (ValueError, KeyError, TypeError):  # damaged (never half-written by tether): stale
                holder, host, pid = {}, "?", -1
            except OSError as e:  # another user's lock this one may not read, a link: not stale
                raise RunLocked(
                    f"{run_dir} is locked, and its lock {path} cannot be read ({e.strerror or e}): it may "
                    f"be held by a running tether process of another user. Run as that user, or, {free}"
                ) from None
            if host == me["host"] and pid > 0 and _alive(pid) and pid != me["pid"]:
                now, then = started(pid), holder.get("started")
                if now is not None and then is not None and now != then:  # the pid was reused
                    note = (
                        f"tether: took over a stale lock of {run_dir} (pid {pid} is now another process, "
                        "started after the lock's holder: the holder is gone)"
                    )
                elif now is not None and then is not None:
                    raise RunLocked(
                        f"{run_dir} is in use by another tether process (pid {pid} on {host}, {path}); "
                        "wait for it to end, stop it, or use another train.output_dir"
                    ) from None
                else:
                    raise RunLocked(
                        f"{run_dir} is locked by pid {pid} on {host} ({path}), a running process; its start "
                        "time cannot be compared with the lock's, so whether it is the tether process that "
                        "took the lock or another program that got its pid since cannot be told. If it is "
                        f"tether, wait for it to end, stop it, or use another train.output_dir; {free}"
                    ) from None
            elif host not in (me["host"], "?"):
                raise RunLocked(
                    f"{run_dir} is locked by a tether process on host {host} (pid {pid}, {path}); if it is "
                    "no longer running there, delete the lock file and run again"
                ) from None
            else:
                note = f"tether: took over a stale lock of {run_dir} (pid {pid} on {host} is gone)"
            path.unlink(missing_ok=True)
            continue
        return path, note
    raise RunLocked(f"{run_dir}: could not take its lock {path}; another process keeps taking it")


def release(path: Path | None) -> None:
    """Remove the lock at ``path`` if this process holds it (a lock taken over by another is kept)."""
    if path is None:
        return
    try:
        holder = _read(path)
    except (OSError, ValueError, KeyError, TypeError):
        return
    if holder["pid"] == os.getpid() and holder["host"] == socket.gethostname():
        path.unlink(missing_ok=True)
