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

Taking over a stale lock takes three steps (read the holder, remove the lock, create one's
own), so two processes that found the same stale lock could both take it, the second removing the
lock the first had just made. Every process that finds the lock taken goes through those steps
holding an exclusive ``flock`` of ``RUN/.tether.lock.mutex``, a file that is never written: one
at a time, each reads the lock as the one before left it. A process already holding the lock that asks for it
again (``train()`` called twice in one process) is refused, not told the lock is stale.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = ".tether.lock"
MUTEX_NAME = ".tether.lock.mutex"
"""The file whose ``flock`` serializes reading, removing and taking over a lock (:func:`_mutex`):
created empty when first needed and never written."""


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


def _kind(mode: int) -> str:
    from tether.data.prompts import path_kind  # here: it loads torch, which only a refusal pays for

    return path_kind(mode)


def _read(path: Path) -> dict:
    """The lock's record, read without following a link.

    Raises:
        FileNotFoundError: it is gone (its holder released it); OSError: it cannot be read (no
            permission, a link); ValueError, KeyError, TypeError: it is damaged; RunLocked: it is
            not a file (a FIFO, a folder).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO would block a read
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise RunLocked(
            f"{path} is {_kind(mode)}, not a lock tether wrote (a file): remove it (rm -r {path}), then "
            "run again"
        )
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


@contextmanager
def _mutex(run_dir: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` of ``run_dir/.tether.lock.mutex`` (created if missing, never
    followed if a link): the lock is read, and a stale one removed and taken, by one process at a
    time. Should the file be removed or replaced while this process waits for it (a failed start
    removes tether's files), the file now at that name is locked instead, so that two processes
    never each hold the ``flock`` of a different file.

    Raises:
        RunLocked: the file cannot be opened (a link, no permission) or is not a file.
    """
    path = run_dir / MUTEX_NAME
    while True:
        try:
            try:  # write access where the file system needs it for an exclusive lock (NFS)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
            except PermissionError:  # another user's: a lock on a read-only descriptor
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise RunLocked(
                f"{run_dir}: its lock's {path} cannot be opened ({e.strerror or e}): tether takes it "
                f"before it reads the lock {run_dir / LOCK_NAME}. If no tether process runs on {run_dir}, "
                f"delete {path} and run again"
            ) from None
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise RunLocked(
                    f"{path} is {_kind(mode)}, not the empty file tether locks: remove it (rm -r {path}), "
                    "then run again"
                )
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                now = os.stat(path, follow_symlinks=False)
                same = (now.st_dev, now.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)  # removed or replaced while this process waited: lock the file at its name
    try:
        yield
    finally:
        os.close(fd)  # releases the flock


def _take(path: Path, tmp: Path, run_dir: Path, me: dict) -> tuple[Path, str | None]:
    try:
        os.link(tmp, path)  # the lock was free: taken at once
        return path, None
    except FileExistsError:
        pass
    with _mutex(run_dir):  # who holds it is read, and a stale lock taken over, one process at a time
        note = None
        for _ in range(3):  # again after a stale lock is removed, or after the holder released it
            try:
                os.link(tmp, path)
            except FileExistsError:
                try:
                    holder: dict | None = _read(path)
                except FileNotFoundError:  # released between the two calls: take it now
                    continue
                except (ValueError, KeyError, TypeError):  # damaged (never half-written by tether): stale
                    holder = None
                except OSError as e:  # another user's lock this one may not read, a link: not stale
                    raise RunLocked(
                        f"{run_dir} is locked, and its lock {path} cannot be read ({e.strerror or e}): it "
                        "may be held by a running tether process of another user. Run as that user, or, if "
                        f"no tether process runs on {run_dir}, delete {path} and run again"
                    ) from None
                note = _stale(holder, path, run_dir, me)
                path.unlink(missing_ok=True)
                continue
            return path, note
    raise RunLocked(f"{run_dir}: could not take its lock {path}; another process keeps taking it")


def _stale(holder: dict | None, path: Path, run_dir: Path, me: dict) -> str:
    """The note saying the lock ``holder`` (its record; None when damaged) is stale and is taken
    over.

    Raises:
        RunLocked: it is not stale: held by a live process, this one included, or by another host,
            or whose holder cannot be told from a process that reused its pid.
    """
    free = f"if no tether process runs on {run_dir}, delete {path} and run again"
    host, pid = (holder["host"], holder["pid"]) if holder is not None else ("?", -1)
    then = (holder or {}).get("started")
    if host == me["host"] and pid == me["pid"]:
        if then is not None and me["started"] is not None and then != me["started"]:
            return (
                f"tether: took over a stale lock of {run_dir} (pid {pid}, now this process, was another "
                "process before: the holder is gone)"
            )
        raise RunLocked(
            f"this process (pid {pid}) already holds the lock of {run_dir} ({path}): a run on that folder "
            "is going on in this process (train() called again inside a run: from a callback, another "
            f"thread). Wait for it to end, or use another train.output_dir; {free}"
        )
    if host == me["host"] and pid > 0 and _alive(pid):
        now = started(pid)
        if now is not None and then is not None and now != then:  # the pid was reused
            return (
                f"tether: took over a stale lock of {run_dir} (pid {pid} is now another process, "
                "started after the lock's holder: the holder is gone)"
            )
        if now is not None and then is not None:
            raise RunLocked(
                f"{run_dir} is in use by another tether process (pid {pid} on {host}, {path}); "
                "wait for it to end, stop it, or use another train.output_dir"
            )
        raise RunLocked(
            f"{run_dir} is locked by pid {pid} on {host} ({path}), a running process; its start "
            "time cannot be compared with the lock's, so whether it is the tether process that "
            "took the lock or another program that got its pid since cannot be told. If it is "
            f"tether, wait for it to end, stop it, or use another train.output_dir; {free}"
        )
    if host not in (me["host"], "?"):
        raise RunLocked(
            f"{run_dir} is locked by a tether process on host {host} (pid {pid}, {path}); if it is "
            "no longer running there, delete the lock file and run again"
        )
    return f"tether: took over a stale lock of {run_dir} (pid {pid} on {host} is gone)"


def release(path: Path | None) -> None:
    """Remove the lock at ``path`` if this process holds it (a lock taken over by another is kept)."""
    if path is None:
        return
    try:
        holder = _read(path)
    except (OSError, ValueError, KeyError, TypeError, RunLocked):
        return
    if holder["pid"] == os.getpid() and holder["host"] == socket.gethostname():
        path.unlink(missing_ok=True)
