"""The run folder's files written so that a kill, a full disk or a file-size limit loses nothing.

Four rules, one function each:

- :func:`atomic_write_text`: a file replaced whole (config.yaml, LATEST, a JSONL file rewritten on
  resume) is written beside itself, flushed to disk and renamed over the old one (``os.replace``,
  atomic on POSIX), so a reader sees the old file or the new one, never a part.
- :func:`append_lines`: a row appended to metrics.jsonl, samples.jsonl or warnings.jsonl goes in
  one ``write`` of whole lines; when the write fails (``ENOSPC``, ``EFBIG`` under a file-size limit)
  the file is cut back to its length before the write, so no torn line stays behind.
- :func:`read_jsonl`: a file's rows; a last line without its newline that does not parse (a
  process killed inside a write, or a disk that failed under another writer) is dropped and said
  so; a bad line anywhere else is an error naming ``FILE:LINE``.
- :func:`link_error`: no write goes through a symbolic link (``O_NOFOLLOW``; a link planted
  while the run goes on stops the write, naming it), so no run file leads tether outside its
  folder (a run folder handed over is checked whole first: :func:`tether.run.folder.check_no_links`).

Errors name the file and the fix (:class:`RunFileError`, an ``OSError`` with the errno kept).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import uuid
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
    """Replace ``path`` with ``text`` whole (:func:`replace_whole`): a kill leaves the old file or
    the new one; on failure the temporary file is removed and ``path`` is as it was.

    Raises:
        RunFileError: the write failed; names ``path``.
    """
    try:
        replace_whole(path, text.encode())
    except OSError as e:
        raise write_error(path, e, f"{Path(path).name} is as it was") from None


def replace_whole(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: written to ``.NAME.tmpPID`` beside it, flushed to disk,
    renamed over it (``os.replace``, atomic on POSIX). Nothing is written through a symbolic link:
    the temporary file is created new (``O_EXCL | O_NOFOLLOW``), and the rename replaces a link at
    ``path`` itself, never its target.

    Raises:
        OSError: the write failed (the temporary file is removed; ``path`` is as it was).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)  # a killed earlier process's of the same pid (or a planted link)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def link_error(path: Path) -> RunFileError:
    """The error for a run file or folder found to be a symbolic link when tether came to write it
    (a link planted while the run went on): names it, and what to do."""
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return RunFileError(
        errno.ELOOP,
        f"{path} is a symbolic link (to {target}): tether writes a run's files only inside its folder, "
        f"never through a link, so it wrote nothing there. Remove the link (rm {path}), then "
        f"{resume_hint(run_folder_of(path))}",
    )


def own_folder(path: Path) -> Path:
    """``path``, a folder of the run that tether writes into (``checkpoints/``), created if missing.

    Raises:
        RunFileError: it is a symbolic link (:func:`link_error`).
    """
    path = Path(path)
    if path.is_symlink():
        raise link_error(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def remove_tree(path: Path) -> None:
    """Remove what tether left at ``path`` (a temporary or an old folder of its own): a folder with
    everything in it, a file, or a link itself (never what a link points to)."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.exists():
        shutil.rmtree(path, ignore_errors=True)


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
    try:  # O_NOFOLLOW: a link planted at a run file's name cannot lead the write out of the run
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise link_error(path) from None
        raise
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


RUN_RECORD = "run.json"
"""The run folder's file that holds its id (:func:`run_id`)."""


def run_id(run_dir: Path) -> str:
    """The run's id: ``run.json``'s ``run_id``, made once (128 random bits, hex) when the run folder
    is claimed and has none (a new run, or a run of a tether from before run ids). Each checkpoint
    records it, so that a resume refuses a checkpoint of another run dropped into ``checkpoints/``.

    Raises:
        ValueError: ``run.json`` is damaged (names it and how to restore it).
    """
    path = Path(run_dir) / RUN_RECORD
    if not (path.exists() or path.is_symlink()):
        value = uuid.uuid4().hex
        write_json_file(path, {"run_id": value})
        return value
    value = read_json(path).get("run_id")
    if not (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{32}", value)):
        raise ValueError(
            f"{path}: holds no run id ({value!r}); the file is damaged. Restore it: "
            '{"run_id": "ID"}, with the run_id of one of this run\'s checkpoints/step-N/meta.json'
        )
    return value
