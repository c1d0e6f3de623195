"""The run folder's files written so that a kill, a full disk or a file-size limit loses nothing.

Three rules, one function each:

- :func:`atomic_write_text`: a file replaced whole (config.yaml, LATEST, a JSONL file rewritten on
  resume) is written beside itself, flushed to disk and renamed over the old one (``os.replace``,
  atomic on POSIX), so a reader sees the old file or the new one, never a part.
- :func:`append_lines`: a row appended to metrics.jsonl, samples.jsonl or warnings.jsonl goes in
  one ``write`` of whole lines; when the write fails (``ENOSPC``, ``EFBIG`` under a file-size limit)
  the file is cut back to its length before the write, so no torn line stays behind.
- :func:`read_jsonl`: a file's rows; a last line without its newline that does not parse (a
  process killed inside a write, or a disk that failed under another writer) is dropped and said
  so; a bad line anywhere else is an error naming ``FILE:LINE``.

Errors name the file and the fix (:class:`RunFileError`, an ``OSError`` with the errno kept).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger("tether")


class RunFileError(OSError):
    """Writing a run folder's file failed (a full disk, a file-size limit, no permission); the
    message names the file, the room left on its disk and what was kept (``errno`` is the
    cause's)."""

    def __str__(self) -> str:  # the message alone, without OSError's "[Errno N] " prefix
        return str(self.strerror)


def space_note(path: Path) -> str:
    """``"; N MiB free on its disk"`` for the disk holding ``path`` (empty when unknown)."""
    for folder in (Path(path), *Path(path).parents):
        if folder.exists():
            try:
                return f"; {shutil.disk_usage(folder).free / 2**20:.0f} MiB free on its disk"
            except OSError:
                return ""
    return ""


def write_error(path: Path, e: BaseException, kept: str) -> RunFileError:
    """A :class:`RunFileError` for a failed write of ``path``: the cause, the free space, ``kept``
    (what is still intact) and the fix; a full disk and a file-size limit are named as such."""
    code = getattr(e, "errno", None)
    if code is None:  # safetensors' and torch.save's errors carry it in the text: "(os error 28)"
        found = re.search(r"os error (\d+)|errno[ =:]*(\d+)", str(e), re.IGNORECASE)
        code = int(found.group(1) or found.group(2)) if found else None
    cause = {
        errno.ENOSPC: "the disk is full",
        errno.EFBIG: "the file-size limit was reached (ulimit -f)",
        errno.EDQUOT: "the disk quota is spent",
    }.get(code, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
    if code is None:  # torch.save's "[enforce fail at inline_container.cc] unexpected pos": guess
        cause += likely_write_cause(path)
    return RunFileError(
        code or errno.EIO,
        f"writing {path} failed: {cause}{space_note(path)}. {kept}. Free space (or raise the limit), then "
        f"{resume_hint(run_folder_of(path))}",
    )


def likely_write_cause(path: Path) -> str:
    """For a write error that names no cause: ``"; likely ..."`` when a file-size limit is set
    or the disk holding ``path`` has under 256 MiB free, else empty."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if soft != resource.RLIM_INFINITY:
        return f"; likely the file-size limit (ulimit -f: {soft} bytes)"
    for folder in (Path(path), *Path(path).parents):
        if folder.exists():
            try:
                if shutil.disk_usage(folder).free < 256 * 2**20:
                    return "; likely a full disk"
            except OSError:
                pass
            break
    return ""


def resume_hint(run_dir: Path) -> str:
    """What to do after a failure: resume when the run has a checkpoint, else start again (a run
    folder without one cannot resume, and a new run refuses a folder that holds a run)."""
    if (Path(run_dir) / "checkpoints" / "LATEST").exists():
        return f"continue with: tether train --resume {run_dir}"
    return (
        f"no checkpoint was written, so nothing can resume: delete {run_dir} (or choose another "
        "train.output_dir) and start the run again"
    )


def run_folder_of(path: Path) -> Path:
    """The run folder a file of it lies in (the folder above ``checkpoints/`` for a checkpoint's)."""
    path = Path(path)
    for folder in path.parents:
        if folder.name == "checkpoints":
            return folder.parent
    return path.parent


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` whole: written to ``.NAME.tmpPID`` beside it, flushed to disk,
    renamed over it. On failure the temporary file is removed and ``path`` is as it was.

    Raises:
        RunFileError: the write failed; names ``path``.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(path, e, f"{path.name} is as it was") from None


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Delete the ``.NAME.tmpPID`` files :func:`atomic_write_text` left in ``folder`` when its
    process was killed between writing and renaming (the files they were to replace are whole).
    Call it holding the run folder's lock (no other writer is mid-write). Returns what went."""
    gone = []
    for tmp in Path(folder).glob(".*.tmp*"):
        # a starting process's lock file, written beside the lock for a moment, is not this kind
        if (
            tmp.is_file()
            and tmp.name.rpartition(".tmp")[2].isdigit()
            and not tmp.name.startswith(".tether.lock")
        ):
            tmp.unlink(missing_ok=True)
            gone.append(tmp)
    return gone


def append_lines(path: Path, lines: list[str]) -> None:
    """Append ``lines`` (each a JSON row, no newline) to ``path`` in one write, all or none.

    A failed write (a full disk: ``ENOSPC``; a file-size limit: ``EFBIG``, which Python gets instead
    of ``SIGXFSZ``) is undone by cutting the file back to its length before the write.

    Raises:
        RunFileError: the write failed; names ``path`` and what was kept.
    """
    path = Path(path)
    data = "".join(line + "\n" for line in lines).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:  # a short write (the disk filling inside it) goes on or fails
                view = view[os.write(fd, view) :]
        except OSError as e:
            try:
                os.ftruncate(fd, size)  # shrinking a file needs no room
            except OSError:
                pass
            raise write_error(
                path, e, f"{path.name} keeps its rows up to the last whole one; the last checkpoint is intact"
            ) from None
    finally:
        os.close(fd)


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSONL file tether wrote; ``[]`` when it does not exist.

    A torn last line (no newline at its end, not valid JSON) is dropped with a logged note: it is
    the part of a row whose write a kill interrupted. Blank lines are skipped.

    Raises:
        ValueError: a line other than a torn last one is not a JSON object; names ``FILE:LINE``.
    """
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(errors="replace")
    lines = text.split("\n")
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines):  # the last line, with no newline after it: a torn write
                log.warning(
                    "tether: %s:%d: dropped a torn last line (%d characters; a write was interrupted)",
                    path,
                    i,
                    len(line),
                )
                break
            raise ValueError(
                f"{path}:{i}: not a JSON row ({e.msg}); tether writes one JSON object per line. Delete "
                "or fix that line"
            ) from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i}: a JSON {type(row).__name__}, not a row (an object)")
        rows.append(row)
    return rows


def rewrite_jsonl(path: Path, rows: list[dict]) -> None:
    """Replace ``path`` with ``rows`` (:func:`atomic_write_text`): a kill leaves the old file or the
    new one."""
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def read_json(path: Path) -> dict:
    """A JSON object file of the run folder (meta.json, reference.json, eval_reference.json ...).

    Raises:
        FileNotFoundError: it is missing; ValueError: it is not a JSON object (a corrupt or torn
            file); each names the file.
    """
    path = Path(path)
    try:
        obj = json.loads(path.read_text(errors="replace"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: missing; the run folder is incomplete") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno}); the file is damaged"
        ) from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: a JSON {type(obj).__name__}, not an object; the file is damaged")
    return obj


def write_json_file(path: Path, obj) -> None:
    """Write ``obj`` as JSON, whole or not at all (:func:`atomic_write_text`)."""
    atomic_write_text(path, json.dumps(obj))
