"""What a run folder holds, and whose it is.

- :func:`check_no_links`: a run folder handed over (``--resume``, ``tether push``, ``tether
  report``) that holds a symbolic link, a file with other hard links (a copy made with
  ``cp -al``) or an entry that is neither a file nor a folder (a FIFO, a socket, a device) is
  refused before anything in it is read, so no run file leads tether outside its folder, into
  another run's files, or into a read that never ends.
- :func:`tether_entry`: the names tether writes at a run folder's top level, so that what it
  removes (a run that failed before its first step) is its own and nothing a person put there.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import NamedTuple

from tether.run.files import RUN_RECORD


class RunFolderError(ValueError):
    """A run folder that holds a symbolic link, a file with other hard links, or an entry that is
    neither a file nor a folder: tether neither reads nor writes it; the message names each and
    the fix."""


def run_folder_links(run_dir: Path) -> list[Path]:
    """Every symbolic link under ``run_dir`` (links are not followed into), in walk order."""
    return run_folder_oddities(run_dir).links


class Oddities(NamedTuple):
    """What :func:`check_no_links` refuses in a run folder, each in walk order."""

    links: list[Path]
    """Symbolic links (to a file or a folder, wherever they point)."""
    shared: list[tuple[Path, int]]
    """Files with other hard links (``st_nlink > 1``), with their link count."""
    special: list[tuple[Path, int]]
    """Entries that are neither a file nor a folder (a FIFO, a socket, a device), with their
    ``st_mode``."""


SHARED_NAMES = re.compile(r"\.tether\.lock|\.\.tether\.lock\.tmp\d+|\.tether\.lock\.mutex")
"""The run folder's files that may have two hard links: the lock (:mod:`tether.run.lock` writes it
beside itself and hard-links it to its name, so for a moment, or after a kill there, the lock and
its temporary file are one file), which tether only ever creates new and reads, never writes in
place."""


def run_folder_oddities(run_dir: Path) -> Oddities:
    """The links, the hard-linked files and the special entries under ``run_dir`` (not followed
    into links), each examined with ``lstat`` (nothing is opened: a FIFO would block a read)."""
    found = Oddities([], [], [])
    for folder, dirs, files in os.walk(run_dir):
        for name in sorted(dirs + files):
            path = Path(folder, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:  # removed while walking
                continue
            if stat.S_ISLNK(st.st_mode):
                found.links.append(path)
            elif stat.S_ISREG(st.st_mode):
                top = Path(folder) == Path(run_dir)
                if st.st_nlink > 1 and not (top and SHARED_NAMES.fullmatch(name)):
                    found.shared.append((path, st.st_nlink))
            elif not stat.S_ISDIR(st.st_mode):
                found.special.append((path, st.st_mode))
    return found


def check_no_links(run_dir: Path, command: str) -> None:
    """Refuse a run folder that holds a symbolic link, a file with other hard links, or an entry
    that is neither a file nor a folder, before anything in it is read or written.

    tether writes no links, and one would let a run folder handed over lead a read (into a report,
    an upload) or a write (an appended row, a deleted checkpoint) outside itself, or turn one run
    file into another: a link to a file or a folder is refused wherever it points (the run folder
    itself may be reached through links: it is resolved first). A file with other hard links is
    shared with another folder (``cp -al RUN COPY``): a row appended to COPY's metrics.jsonl
    would land in RUN's too (the lock's files excepted, :data:`SHARED_NAMES`). A FIFO (or a socket,
    a device) at a run file's name would make a read hang or fail.

    Raises:
        RunFolderError: names up to three of each with the fix (links with their targets).
    """
    root = Path(run_dir).resolve()
    odd = run_folder_oddities(root)
    if not (odd.links or odd.shared or odd.special):
        return

    def target(link: Path) -> str:
        to = Path(os.path.realpath(link))
        where = "inside the run" if to == root or root in to.parents else "outside the run"
        return f"{link.relative_to(root)} -> {os.readlink(link)} ({where})"

    def some(items: list[str]) -> str:
        return "; ".join(items[:3]) + (f", and {len(items) - 3} more" if len(items) > 3 else "")

    said = []
    if odd.links:
        said.append(
            f"the run folder holds symbolic links: {some([target(x) for x in odd.links])}. tether reads "
            "and writes a run only inside its folder and never through a link. Replace each link with a "
            "copy of what it points to, or remove it (rm LINK removes the link alone)"
        )
    if odd.shared:
        said.append(
            "the run folder holds files with other hard links, shared with another folder: "
            f"{some([f'{p.relative_to(root)} ({n} links)' for p, n in odd.shared])}. A run's rows "
            "appended here would be written into the other folder's files too. A copy of a run folder "
            "made with cp -al (or ln) shares its files: copy it with cp -r instead (or replace each "
            "file with a copy of itself: cp FILE FILE.new && mv FILE.new FILE)"
        )
    if odd.special:
        from tether.data.prompts import path_kind  # here: it loads torch, which only a refusal pays for

        said.append(
            "the run folder holds entries that are neither files nor folders: "
            f"{some([f'{p.relative_to(root)}: {path_kind(mode)}' for p, mode in odd.special])}; tether "
            "writes none, and reading one would hang or fail. Remove each (rm PATH)"
        )
    raise RunFolderError(f"{command} {run_dir}: {'; and '.join(said)}, then run again")


RUN_FILES = (
    "config.yaml",
    RUN_RECORD,
    "reference.json",
    "data.json",
    "eval.json",
    "eval_reference.json",
    "eval_reference_capability.json",
    "eval_reference_periodic.json",
    "metrics.jsonl",
    "samples.jsonl",
    "warnings.jsonl",
    "kl_tokens.jsonl",
    "interpolate.json",
    "interpolate.png",
    "training.png",
    "score_vs_kl.png",
    "report.html",
    ".tether.lock",
    ".tether.lock.mutex",
)
"""The files tether writes at a run folder's top level (config.until-step-N.yaml too)."""
RUN_FOLDERS = ("checkpoints", "best", "policy", "tensorboard", ".aim")
"""The folders tether writes at a run folder's top level: its checkpoints, its best and final
policies, and the folders of the trackers it starts there (``train.report_to``: TensorBoard's,
Aim's)."""


def tether_entry(name: str) -> bool:
    """Whether ``name``, at a run folder's top level, is what tether writes there: one of
    :data:`RUN_FILES` or :data:`RUN_FOLDERS`, a config.until-step-N.yaml, or the temporary file or
    folder of one (``.NAME.tmpPID``, the best policy's ``.best.oldPID``)."""
    temporary = re.fullmatch(r"\.(.+)\.tmp\d+|\.(best)\.old\d+", name)
    base = (temporary.group(1) or temporary.group(2)) if temporary else name
    return (
        base in RUN_FILES
        or base in RUN_FOLDERS
        or re.fullmatch(r"config\.until-step-\d+\.yaml", base) is not None
    )
