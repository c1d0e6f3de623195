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
import logging
import os
import random
import re
import stat
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import NamedTuple

from tether.core.text import SHOWN_CHARS, shown
from tether.models.loading import cache_dir, cache_lock
from tether.models.sampling import RowPrompt

log = logging.getLogger(__name__)

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
    with cache_lock(root):
        if not target.exists():  # another process may have fetched it while this one waited
            _fetch_icwsm(root)
    return target


def _fetch_icwsm(root: Path) -> None:
    """Download the archive with pip and unpack its ICWSM folder as ``root`` (held under its
    :func:`cache_lock`)."""
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
            dest_tmp = root.with_name(root.name + f".tmp{os.getpid()}")
            if dest_tmp.exists():
                import shutil

                shutil.rmtree(dest_tmp)
            (staging / "hutto_ICWSM_2014").replace(dest_tmp)
            dest_tmp.replace(root)


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


Prompt = str | list  # a text, or a conversation: a list of {"role": ..., "content": ...} messages


def prompt_key(prompt: Prompt) -> str:
    """The text that identifies a prompt: itself, or a conversation's messages as sorted JSON
    (for the held-out hash, which must not depend on the format)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, ensure_ascii=False)


class PromptData:
    """Prompts and the other columns of their rows, aligned: a sequence of prompts.

    ``data[i]`` is prompt ``i``; ``data[a:b]`` and :meth:`select` keep the columns with their rows
    (so a reward function gets each row's ``answer`` beside its completion, whatever groups and
    shards did to the order).

    Attributes:
        prompts: texts or conversations (:data:`Prompt`).
        columns: column name -> one value per prompt (JSON-able: it is written to samples.jsonl).
    """

    def __init__(self, prompts: list, columns: dict[str, list] | None = None):
        self.prompts = list(prompts)
        self.columns = {k: list(v) for k, v in (columns or {}).items()}
        for k, v in self.columns.items():
            if len(v) != len(self.prompts):
                raise ValueError(f"column {shown(k)} has {len(v)} values for {len(self.prompts)} prompts")

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self):
        return iter(self.prompts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.select(range(len(self.prompts))[i])
        return self.prompts[i]

    def __eq__(self, other) -> bool:
        if isinstance(other, PromptData):
            return self.prompts == other.prompts and self.columns == other.columns
        return self.prompts == list(other)

    def select(self, rows) -> PromptData:
        """Rows ``rows`` (indices, repeats allowed), in that order."""
        rows = [int(r) for r in rows]
        return PromptData(
            [self.prompts[r] for r in rows], {k: [v[r] for r in rows] for k, v in self.columns.items()}
        )

    def row(self, i: int) -> dict:
        """Row ``i``'s columns (without the prompt)."""
        return {k: v[i] for k, v in self.columns.items()}


def records_to_data(
    records: list[dict], prompt_column: str, source: str, where: list[str] | None = None
) -> PromptData:
    """:class:`PromptData` of dict rows: ``prompt_column`` is the prompt (a non-empty text or a
    conversation), every other key a column (None where a row lacks it).

    Raises:
        ValueError: a row lacks the prompt column or holds an empty or malformed prompt; the
            message names the row (``where[i]``, default ``SOURCE row N``), the columns there are
            and ``data.prompt_column``.
    """
    prompts, names = [], list(dict.fromkeys(k for r in records for k in r if k != prompt_column))
    for i, r in enumerate(records):
        p = r.get(prompt_column)
        if isinstance(p, str) and p.strip():
            prompts.append(p)
        elif (
            isinstance(p, list)
            and p
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in p
            )
        ):
            messages = [{"role": m["role"], "content": m["content"]} for m in p]
            prompts.append(RowPrompt(messages, p.template_kwargs) if isinstance(p, RowPrompt) else messages)
        else:
            at = where[i] if where is not None else f"{source} row {i + 1}"
            column = prompt_column if len(prompt_column) <= SHOWN_CHARS else shown(prompt_column)
            raise ValueError(
                f'data.prompts: {at} needs a "{column}": data.prompt_column={shown(prompt_column)} '
                f"must hold a non-empty text or a list of {{role, content}} messages, got {shown(p, 80)}; "
                f"the rows have the columns {shown(sorted(set(r)))}"
            )
    return PromptData(prompts, {k: [r.get(k) for r in records] for k in names})


DATASET_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
"""File suffix (lower case) -> ``datasets`` builder for a single data file."""

TEXT_SUFFIXES = (".txt", ".text", "")
"""Suffixes (lower case) of a plain prompt file, one prompt per line; every other suffix that
:data:`DATASET_SUFFIXES` does not name is refused (a .tsv's header would be a prompt, a .gz's
bytes text)."""


def file_suffix(path: Path, field_name: str = "data.prompts") -> str:
    """The lower-case suffix of a data file (``UPPER.JSONL`` is a .jsonl).

    Raises:
        ValueError: a suffix tether does not read (.tsv, .gz, .xlsx ...); names the field and the
            suffixes it reads.
    """
    suffix = Path(path).suffix.lower()
    if suffix in DATASET_SUFFIXES or suffix in TEXT_SUFFIXES:
        return suffix
    fix = (
        f"decompress it first (a {suffix} file)"
        if suffix in (".gz", ".bz2", ".xz", ".zst", ".zip")
        else (
            "convert it to .csv or .jsonl"
            if suffix == ".tsv"
            else "rename it to .txt if it holds a prompt per line, or save it as one of the others"
        )
    )
    raise ValueError(
        f"{field_name}={shown(str(path))}: tether reads .txt (a prompt per line), .jsonl, .json, .csv and "
        f".parquet files, not {suffix}; {fix}"
    )


_KINDS = (
    (stat.S_ISREG, "a file"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def path_kind(mode: int) -> str:
    """What a path whose ``os.stat`` mode is ``mode`` is, for messages: ``"a file"``, ``"a folder"``,
    ``"a character device"`` ... Reading a device or a FIFO may never end (``/dev/zero``, a FIFO no
    one writes to), so tether refuses every kind but a file and a folder before it reads."""
    return next((name for test, name in _KINDS if test(mode)), "neither a file nor a folder")


def data_path(spec: str | Path, field_name: str = "data.prompts") -> Path:
    """``spec``, a data source a user named, as a path (``~`` expanded), checked without reading
    it: missing (then a Hub id, maybe), a file or a folder (symlinks followed), never a device, a
    FIFO or a socket.

    Raises:
        ValueError: it is a device, FIFO or socket, or the system cannot look it up (a name too
            long, a folder without permission); names ``field_name``, the kind and the fix.
    """
    path = Path(spec).expanduser()
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return path  # not there: a Hub id, or the caller's "no such file"
    except OSError as e:
        raise ValueError(f"{field_name}={shown(str(spec))}: cannot look it up ({e.strerror})") from None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return path
    what = "preference pairs" if field_name == "dpo.pairs" else "prompts"
    raise ValueError(
        f"{field_name}={shown(str(spec))} is {path_kind(mode)}, not a file of {what} (tether does not "
        "read it: reading it might never end); give a .txt, .jsonl, .json, .csv or .parquet file, a "
        "folder of them or one saved with save_to_disk, or a Hub dataset id (ORG/NAME)"
    )


def read_utf8(path: Path, field_name: str = "data.prompts") -> str:
    """A data file's text, decoded as UTF-8.

    Raises:
        ValueError: it is not UTF-8 (a binary file, latin-1 text); names the file and the byte;
            it is a device, FIFO or socket (:func:`data_path`).
    """
    raw = data_path(path, field_name).read_bytes()
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ValueError(f"{field_name}: {path} is UTF-16 text; save it as UTF-8 (iconv -f utf-16 -t utf-8)")
    try:
        return raw.decode("utf-8-sig")  # a UTF-8 byte-order mark is not part of the first prompt
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{field_name}: {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); "
            "save it as UTF-8 (iconv -f latin1 -t utf-8 for latin-1 text), or give a .parquet or .csv file"
        ) from None


def jsonl_objects(path: Path, field_name: str = "data.prompts") -> list[tuple[int, dict]]:
    """(1-based line, object) of each non-blank line of a user's UTF-8 ``.jsonl`` file.

    Strict, as data a user gives should be read (tether's own files are read by
    :func:`tether.run.files.read_jsonl`, which forgives a torn last line).

    Raises:
        ValueError: not UTF-8, a line that is not valid JSON, or not a JSON object; names
            ``FIELD: FILE:LINE``.
    """
    rows = []
    for i, line in enumerate(read_utf8(path, field_name).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field_name}: {path}:{i} is not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{field_name}: {path}:{i} needs a JSON object")
        rows.append((i, obj))
    return rows


def load_rows(
    spec: str, split: str = "train", field_name: str = "data.prompts", subset: str | None = None
) -> tuple[list[dict], list[str]]:
    """The rows of a .jsonl file, a data file ``datasets`` reads (json, parquet, csv), a folder
    saved with ``save_to_disk`` or of data files, or a Hub dataset id (``ORG/NAME``, through the
    Hugging Face cache: ``HF_HUB_OFFLINE=1`` reads it from there alone), each a dict, with where
    each row is (``FILE:LINE`` for a .jsonl, ``SPEC row N`` otherwise) for error messages.
    ``subset``: the dataset's configuration (``data.config``; ``datasets.load_dataset``'s
    ``name``, TRL's ``dataset_config``), for a Hub dataset or a folder of one.

    Raises:
        FileNotFoundError: no such file or folder, and not a cached or downloadable Hub dataset.
        ValueError: bad JSON (the line named), a missing split, a dataset of several subsets and
            no ``subset`` (they are listed), or a ``subset`` for one file.
    """
    from tether.models.loading import hub_folder, is_hub_id

    path = data_path(spec, field_name)
    suffix = file_suffix(path, field_name) if path.is_file() else ""
    if subset is not None and (path.is_file() or (path.is_dir() and _saved_to_disk(path))):
        raise ValueError(
            f"data.config={shown(subset)}: {field_name}={shown(spec)} is "
            + ("one file" if path.is_file() else "a dataset saved with save_to_disk")
            + ", which has no subsets; drop data.config"
        )
    if suffix == ".jsonl":  # errors name FILE:LINE
        numbered = jsonl_objects(path, field_name)
        records = [obj for _, obj in numbered]
        where = [f"{path}:{i}" for i, _ in numbered]
        if not records:
            raise ValueError(f"{field_name}: {path} holds no rows")
        return records, where
    if not path.exists() and not is_hub_id(spec):
        raise FileNotFoundError(
            f"{field_name}={shown(spec)}: no such file or folder, and not a Hub dataset id (ORG/NAME)"
        )
    import datasets

    datasets.disable_progress_bars()
    if path.is_file():
        if suffix not in DATASET_SUFFIXES:
            raise ValueError(f"{field_name}={shown(spec)}: a file must be .jsonl, .json, .parquet or .csv")
        if suffix in (".json", ".csv"):
            read_utf8(path, field_name)  # a binary or latin-1 file: named, not a decoder's traceback
        ds = datasets.load_dataset(DATASET_SUFFIXES[suffix], data_files=str(path), split="train")
    elif path.is_dir() and _saved_to_disk(path):
        ds = datasets.load_from_disk(str(path))
    elif path.is_dir():
        # prepared in a cache of its own, read, then dropped: datasets' cache keys a folder whose
        # card declares its subsets by the folder's name and the subset's (not its path or files),
        # so another folder of the same name was read as this one, its rows or its columns (a Hub
        # snapshot's folder is its commit: there the same name is the same data)
        scratch = tempfile.TemporaryDirectory(prefix="tether-dataset-")
        try:
            ds = datasets.load_dataset(str(path), subset, split=split, cache_dir=scratch.name)
            rows = ds.to_list() if not isinstance(ds, datasets.DatasetDict) else None
        except ValueError as e:
            _subset_error(e, spec, subset)
            raise ValueError(f"{field_name}={shown(spec)}: {str(e).splitlines()[0][:300]}") from None
        except Exception as e:  # an empty folder, one without data files, an unknown split ...
            raise ValueError(
                f"{field_name}={shown(spec)}: a folder datasets cannot read ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''}); give a data file, or a folder of "
                ".jsonl/.csv/.parquet files or saved with save_to_disk"
            ) from None
        finally:
            scratch.cleanup()
        if rows is not None:
            return rows, [f"{spec} row {i + 1}" for i in range(len(rows))]
    else:
        folder = hub_folder(spec, field_name=field_name, repo_type="dataset")
        try:
            ds = datasets.load_dataset(str(folder), subset, split=split)
        except ValueError as e:  # an unknown split or subset
            _subset_error(e, spec, subset)
            raise ValueError(f"data.split={shown(split)}: {spec}: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"data.split={shown(split)}: {spec} has the splits {list(ds)}; choose one")
        ds = ds[split]
    rows = ds.to_list()
    return rows, [f"{spec} row {i + 1}" for i in range(len(rows))]


def _saved_to_disk(path: Path) -> bool:
    """A folder ``Dataset.save_to_disk`` wrote (read with ``load_from_disk``)."""
    return any((path / f).exists() for f in ("dataset_info.json", "dataset_dict.json", "state.json"))


def _subset_error(e: ValueError, spec: str, subset: str | None) -> None:
    """Raise ``datasets``' complaint about a dataset's subsets (configurations) as
    ``data.config``'s: none chosen where several exist, or one that does not exist; return for
    any other error."""
    text = str(e)
    if "Config name is missing" in text or ("BuilderConfig" in text and "not found" in text):
        found = re.search(r"\[.*?\]", text, re.S)
        have = f" has the subsets {found[0]}" if found else " has several subsets"
        what = f"data.config={shown(subset)}: {spec}" if subset else f"data.config: {spec}"
        raise ValueError(f"{what}{have}; choose one with data.config=NAME") from None


def row_template_kwargs(row: dict, at: str) -> dict:
    """A preference row's own chat template variables, as TRL's DPO reads them: its
    ``chat_template_kwargs`` column and its ``tools`` column (a list of JSON schemas, or JSON
    text of one, which TRL parses), both for a conversational prompt only.

    Raises:
        ValueError: ``tools`` that is not a list of schemas (or JSON text of one),
            ``chat_template_kwargs`` that is not a mapping, or either on a text prompt (TRL renders
            text prompts without a template: they would change nothing); the row named.
    """
    kwargs: dict = {}
    tools, extra = row.get("tools"), row.get("chat_template_kwargs")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ValueError(f'dpo.pairs: {at}: its "tools" column is text that is not JSON ({e})') from None
    if tools:
        if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise ValueError(
                f'dpo.pairs: {at}: its "tools" column must be a list of JSON schemas (TRL\'s format: '
                '{"type": "function", "function": {...}}), or JSON text of one'
            )
        kwargs["tools"] = tools
    if extra:
        if not isinstance(extra, dict):
            raise ValueError(f'dpo.pairs: {at}: its "chat_template_kwargs" column must be a mapping')
        kwargs.update(extra)
    if kwargs and not isinstance(row.get("prompt", row.get("chosen")), list):
        raise ValueError(
            f'dpo.pairs: {at} has a "tools" or "chat_template_kwargs" column and a text prompt, which '
            "no chat template renders (TRL ignores them there); give conversational rows, or drop the column"
        )
    return kwargs


def explicit_pair(row: dict, at: str) -> dict:
    """A preference row with its ``prompt`` explicit, as TRL's DPO reads it.

    A row of ``chosen`` and ``rejected`` alone (TRL's implicit-prompt format: each holds the
    prompt and its response) gets the prompt TRL's ``extract_prompt`` gives: the longest common
    prefix of the two (characters of text, messages of conversations), a space just before the
    point they part left with the responses. Rows with a ``prompt`` are returned as they are.

    Raises:
        ValueError: bad ``tools`` or ``chat_template_kwargs`` columns (:func:`row_template_kwargs`;
            good ones make the prompt a :class:`tether.models.sampling.RowPrompt`), an
            unpaired row (``prompt``, ``completion``, ``label``: KTO's format, TRL's ``KTOTrainer``),
            or an implicit row whose two sides share no prompt, or one of which is the other's
            prefix (no response would be left to compare; TRL then cuts the prompt at an arbitrary
            place), naming the row.
    """
    kwargs = row_template_kwargs(row, at)
    if kwargs:  # the row's own template variables travel with its prompt
        out = explicit_pair({k: v for k, v in row.items() if k not in ("tools", "chat_template_kwargs")}, at)
        if isinstance(out.get("prompt"), list):
            out["prompt"] = RowPrompt(out["prompt"], kwargs)
        return out
    if "completion" in row and "label" in row and "chosen" not in row:
        raise ValueError(
            f"dpo.pairs: {at} is an unpaired preference row (prompt, completion, label: KTO's format, "
            "TRL's KTOTrainer); DPO needs pairs: prompt, chosen and rejected"
        )
    if "prompt" in row:
        return row
    c, r = row.get("chosen"), row.get("rejected")
    if not (isinstance(c, str) and isinstance(r, str)) and not (isinstance(c, list) and isinstance(r, list)):
        return row  # named by the pair checks: not two texts or two conversations
    idx = next((i for i in range(min(len(c), len(r))) if c[i] != r[i]), None)
    if idx is not None and idx > 0 and c[idx - 1] == " ":  # TRL: the space goes with the responses
        idx -= 1
    if not idx:
        why = "one is the other's start" if idx is None else "they differ from the start"
        raise ValueError(
            f'dpo.pairs: {at} has no "prompt", and its "chosen" and "rejected" share no prompt to '
            f'extract ({why}); give the prompt in a "prompt" column'
        )
    return {**row, "prompt": c[:idx], "chosen": c[idx:], "rejected": r[idx:]}


def pair_prompts(spec: str, split: str = "train", subset: str | None = None) -> PromptData:
    """The distinct prompts of a preference-pair file or dataset (``dpo.pairs``: rows of
    ``prompt``, ``chosen``, ``rejected``), each with its first row's other columns (not
    ``chosen`` and ``rejected``): the prompts a DPO run on that file trains and evaluates on.

    Raises:
        FileNotFoundError, ValueError: as :func:`load_rows`; a row without a prompt.
    """
    records, where = load_rows(spec, split, field_name="dpo.pairs", subset=subset)
    records = [explicit_pair(r, at) for r, at in zip(records, where)]
    first: dict[str, int] = {}
    for i, r in enumerate(records):
        p = r.get("prompt")
        first.setdefault(prompt_key(p) if isinstance(p, (str, list)) else repr(p), i)
    rows = [{k: v for k, v in records[i].items() if k not in ("chosen", "rejected")} for i in first.values()]
    return records_to_data(rows, "prompt", str(spec), [where[i] for i in first.values()])


def load_prompt_data(
    spec: str, split: str = "train", prompt_column: str = "prompt", subset: str | None = None
) -> PromptData:
    """Every row of ``data.prompts``: a .txt file (a prompt per line), or anything
    :func:`load_rows` reads; ``split`` and ``prompt_column`` choose the rows and the prompt, the
    other columns travel with them.

    Raises:
        FileNotFoundError: no such file or folder, and not a cached or downloadable Hub dataset.
        ValueError: the split or the prompt column is missing, or a prompt is empty.
    """
    path = data_path(spec)
    suffix = file_suffix(path) if path.is_file() else ""
    if path.is_file() and suffix in TEXT_SUFFIXES:  # .txt: one prompt per line
        return PromptData(read_prompt_file(path))
    records, where = load_rows(spec, split, subset=subset)
    if records and all(prompt_column not in r for r in records) and suffix != ".jsonl":
        raise ValueError(
            f"data.prompt_column={shown(prompt_column)}: {spec} has the columns "
            f"{shown(sorted(records[0]))}; name the one that holds the prompts"
        )
    return records_to_data(records, prompt_column, spec, where)


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
    path = data_path(path)
    if not path.exists():
        raise FileNotFoundError(f"data.prompts: no file {path}")
    if file_suffix(path) == ".jsonl":
        prompts = []
        for i, obj in jsonl_objects(path, "data.prompts"):
            if not isinstance(obj.get("prompt"), str) or not obj["prompt"].strip():
                raise ValueError(f'data.prompts: {path}:{i} needs a non-empty "prompt" string')
            prompts.append((i, obj["prompt"]))
    else:
        lines = enumerate(read_utf8(path).splitlines(), start=1)
        prompts = [(i, line.strip()) for i, line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"data.prompts: {path} holds no prompts")
    return prompts


def unique_prompts(data: PromptData, field_name: str) -> PromptData:
    """A held-out set with each prompt once (the first row of each, by :func:`prompt_key`; the
    count left out is said): a copy would count as an independent prompt in every standard error
    of the evaluation (30 prompts x 3 copies would report n=12 for 4 prompts)."""
    seen: set[str] = set()
    keep = []
    for i, p in enumerate(data.prompts):
        key = prompt_key(p)
        if key not in seen:
            seen.add(key)
            keep.append(i)
    if len(keep) < len(data):
        log.warning(
            "tether: %s holds %d repeated prompt(s); each is evaluated once (%d held-out prompts)",
            field_name,
            len(data) - len(keep),
            len(keep),
        )
    return data.select(keep) if len(keep) < len(data) else data


def split_prompts(prompts, heldout_fraction: float, field_name: str = "data.prompts"):
    """Hash-based (train, heldout) split of a user's prompts, stable across runs and seeds: the
    hash of each prompt's text (:func:`prompt_key`), whatever the format and the other columns.
    A :class:`PromptData` splits into two, columns kept; a list into two lists.

    Every copy of a prompt hashes to the same side, and both sides keep their copies (a run with
    its own held-out set trains on both); the run keeps each held-out prompt once when the share
    becomes its evaluation set (:func:`unique_prompts`). The training side's copies weigh the
    prompt in the training distribution, as in TRL.

    Raises:
        ValueError: no training prompt is left (``field_name`` named).
    """
    data = prompts if isinstance(prompts, PromptData) else PromptData(prompts)
    held = [i for i, p in enumerate(data.prompts) if is_heldout(prompt_key(p), heldout_fraction)]
    kept = set(held)
    train = [i for i in range(len(data)) if i not in kept]
    if not train:
        raise ValueError(
            f"{field_name}: no training prompts left after the held-out split; lower data.heldout_fraction"
        )
    if isinstance(prompts, PromptData):
        return data.select(train), data.select(held)
    return [data.prompts[i] for i in train], [data.prompts[i] for i in held]


class PromptSampler:
    """Endless shuffled pass over the training prompts, one epoch at a time (seeded)."""

    def __init__(self, prompts, seed: int):
        self.prompts = list(prompts)
        self.rng = random.Random(seed)
        self.order: list[int] = []
        self.position = 0

    def next_indices(self, n: int) -> list[int]:
        """The indices of the next ``n`` prompts (into the prompts given)."""
        batch = []
        while len(batch) < n:
            if self.position >= len(self.order):
                self.order = list(range(len(self.prompts)))
                self.rng.shuffle(self.order)
                self.position = 0
            batch.append(self.order[self.position])
            self.position += 1
        return batch

    def next_batch(self, n: int) -> list:
        """The next ``n`` prompts."""
        return [self.prompts[i] for i in self.next_indices(n)]

    def state_dict(self) -> dict:
        """Data position: the epoch's order, the position in it and the shuffling RNG."""
        return {"order": list(self.order), "position": self.position, "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.order, self.position = list(state["order"]), int(state["position"])
        rng = state["rng"]
        self.rng.setstate((rng[0], tuple(rng[1]), rng[2]))
