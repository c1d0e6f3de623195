"""Prompts: the embedded ICWSM-2014 movie-review prefixes, or a user's JSONL/text file.

The default prompts are the first 2-8 words of the 10,605 movie-review snippets of
Hutto & Gilbert (2014), "VADER: A Parsimonious Rule-based Model for Sentiment Analysis of
Social Media Text", ICWSM-14 (MIT license). The data ship only in the ``vaderSentiment==3.3.2``
*source* archive on PyPI; tether downloads that archive once with pip and caches the extracted
file under ``~/.cache/tether/data``.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import NamedTuple

from tether.models.loading import cache_dir

DEFAULT_PROMPTS = "icwsm-movies"
_VADER_SDIST = "vaderSentiment==3.3.2"
_INNER = "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz"
_MOVIES = "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt"


class Rated(NamedTuple):
    text: str
    rating: float
    """mean human rating in [-4, 4]."""


def icwsm_file(name: str = _MOVIES) -> Path:
    """Path of one ICWSM-2014 ground-truth file, downloading and caching the archive once.

    Raises:
        RuntimeError: pip could not download the ``vaderSentiment`` source archive.
    """
    root = cache_dir() / "data" / "hutto_ICWSM_2014"
    target = root.parent / name
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "--no-build-isolation",
            "-q",
            _VADER_SDIST,
            "-d",
            tmp,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        archives = list(Path(tmp).glob("vaderSentiment-*.tar.gz"))
        if not archives:
            raise RuntimeError(
                f"could not download the {_VADER_SDIST} source archive with pip "
                f"(needed for the default prompts):\n{proc.stderr[-2000:]}\n"
                "Pass data.prompts=FILE.jsonl to use your own prompts instead."
            )
        with tarfile.open(archives[0]) as outer:
            inner_bytes = outer.extractfile(_INNER).read()
        with tarfile.open(fileobj=io.BytesIO(inner_bytes)) as inner:
            staging = Path(tmp) / "x"
            inner.extractall(staging, filter="data")
            root.parent.mkdir(parents=True, exist_ok=True)
            dest_tmp = root.with_name(root.name + ".tmp")
            if dest_tmp.exists():
                import shutil

                shutil.rmtree(dest_tmp)
            (staging / "hutto_ICWSM_2014").replace(dest_tmp)
            dest_tmp.replace(root)
    return target


def read_ground_truth(path: Path) -> list[Rated]:
    """Parse an ICWSM ``*_GroundTruth.txt`` file: ``id<TAB>rating<TAB>text`` per line."""
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        parts = line.strip().split("\t")
        if len(parts) >= 3 and parts[2].strip():
            rows.append(Rated(text=parts[2].strip(), rating=float(parts[1])))
    return rows


def is_heldout(text: str, heldout_fraction: float) -> bool:
    """True for a fixed ``heldout_fraction`` of texts, chosen by a SHA-256 hash of the text."""
    # A hash of the whole snippet decides its split, so the split never depends on the seed,
    # on file order or on the prefix length drawn: a held-out prompt is never trained on.
    h = int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return h < heldout_fraction


def movie_prompts(
    seed: int = 0, min_words: int = 2, max_words: int = 8, heldout_fraction: float = 0.05
) -> tuple[list[str], list[str]]:
    """(train, heldout) prompts: the first ``min_words``..``max_words`` words of each snippet.

    The prefix length is drawn per snippet from ``random.Random(seed)``; duplicates are dropped,
    and any prompt that also appears in the held-out set is removed from training.
    """
    rows = read_ground_truth(icwsm_file())
    rng = random.Random(seed)
    train, heldout = [], []
    for r in rows:
        words = r.text.replace("''", '"').split()
        n = rng.randint(min_words, max_words)
        prompt = " ".join(words[:n])
        (heldout if is_heldout(r.text, heldout_fraction) else train).append(prompt)
    held = list(dict.fromkeys(heldout))
    held_set = set(held)
    train = [p for p in dict.fromkeys(train) if p not in held_set]
    return train, held


def read_prompt_file(path: str | Path) -> list[str]:
    """Prompts from a ``.jsonl`` file (``{"prompt": ...}`` per line) or a plain text file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: empty file, malformed JSON or a missing/empty ``prompt`` (the line is named).
    """
    return [p for _, p in prompt_file_lines(path)]


def prompt_file_lines(path: str | Path) -> list[tuple[int, str]]:
    """(1-based line, prompt) of each prompt of a file, as :func:`read_prompt_file` reads it.

    Raises:
        the errors of :func:`read_prompt_file`.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data.prompts: no file {path}")
    prompts = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"data.prompts: {path}:{i} is not valid JSON ({e.msg})") from None
            if (
                not isinstance(obj, dict)
                or not isinstance(obj.get("prompt"), str)
                or not obj["prompt"].strip()
            ):
                raise ValueError(f'data.prompts: {path}:{i} needs a non-empty "prompt" string')
            prompts.append((i, obj["prompt"]))
        else:
            prompts.append((i, line.strip()))
    if not prompts:
        raise ValueError(f"data.prompts: {path} holds no prompts")
    return prompts


def split_prompts(prompts: list[str], heldout_fraction: float) -> tuple[list[str], list[str]]:
    """Hash-based (train, heldout) split of a user's prompts, stable across runs and seeds."""
    held = [p for p in prompts if is_heldout(p, heldout_fraction)]
    train = [p for p in prompts if not is_heldout(p, heldout_fraction)]
    if not train:
        raise ValueError(
            "data.prompts: no training prompts left after the held-out split; lower data.heldout_fraction"
        )
    return train, held


class PromptSampler:
    """Endless shuffled pass over the training prompts, one epoch at a time (seeded)."""

    def __init__(self, prompts: list[str], seed: int):
        self.prompts = list(prompts)
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.position = 0

    def next_batch(self, n: int) -> list[str]:
        batch = []
        while len(batch) < n:
            if self.position >= len(self.order):
                self.order = list(range(len(self.prompts)))
                self.rng.shuffle(self.order)
                self.position = 0
            batch.append(self.prompts[self.order[self.position]])
            self.position += 1
        return batch

    def state_dict(self) -> dict:
        """Data position: the epoch's order, the position in it and the shuffling RNG."""
        return {"order": list(self.order), "position": self.position, "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.order, self.position = list(state["order"]), int(state["position"])
        rng = state["rng"]
        self.rng.setstate((rng[0], tuple(rng[1]), rng[2]))
