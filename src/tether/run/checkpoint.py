"""Atomic checkpoints of a run, and resuming from them.

Layout inside the run directory::

    checkpoints/step-000010/   policy.safetensors, value_head.safetensors, trainer.pt, meta.json
                               (a sharded run: sharded/, each process's shards of the weights and
                               the AdamW state, in place of the two safetensors files)

``policy.safetensors`` holds the LM's tensors, or for a LoRA run (``model.lora_r`` or
``model.adapter``) only the trainable adapter's: the frozen base is never saved here.
    checkpoints/LATEST         the name of the newest complete checkpoint
    best/                      with eval.best_by: the policy of the best periodic evaluation

A checkpoint is written to a temporary folder, which is renamed into place when complete, and only
then is ``LATEST`` replaced (write to a temporary file, then ``os.replace``). A process killed at
any moment therefore leaves ``LATEST`` naming a complete checkpoint (or no checkpoint at all);
older checkpoints beyond ``train.keep_checkpoints`` are deleted only after ``LATEST`` moved on.
``meta.json`` records the SHA-256 of every other file of its checkpoint; a resume checks them and
falls back to the newest earlier checkpoint that verifies (:func:`resume_checkpoint`).

The reference model is never saved here: on resume it is rebuilt from its original source and
its fingerprint compared with the one recorded when the run started.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

from tether.core import distributed as D
from tether.models.sharding import load_full_state_dict
from tether.run.files import (
    RUN_RECORD,
    RunFileError,
    atomic_write_text,
    own_folder,
    read_json,
    remove_tree,
    resume_hint,
    write_error,
)

SHARDED = "sharded"
"""The folder of a sharded run's checkpoint (``train.sharding=fsdp``) that holds its weights and
AdamW state, each process's shards in files of its own (``torch.distributed.checkpoint``)."""


def sharded_folder(run_dir: Path, step: int) -> Path:
    """The temporary folder of checkpoint ``step`` of a sharded run, where every process writes its
    shards (:func:`save_sharded_state`) before rank 0 completes it with :func:`save_checkpoint`:
    one name for all processes (a plain run's temporary folder is named by its process id)."""
    return Path(run_dir) / "checkpoints" / f".step-{step:06d}.tmp-sharded"


def save_sharded_state(folder: Path, policy, optimizer: torch.optim.Optimizer) -> None:
    """Every process writes its shards of ``policy``'s weights (value head included) and of
    ``optimizer``'s state into ``folder`` (``torch.distributed.checkpoint.save``; collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(policy), "optimizer": get_optimizer_state_dict(policy, optimizer)}
    dcp.save(state, checkpoint_id=str(folder))


def load_sharded_state(folder: Path, policy, optimizer: torch.optim.Optimizer) -> None:
    """Load what :func:`save_sharded_state` wrote into ``policy`` and ``optimizer``, on any number of
    processes, sharded or not (``torch.distributed.checkpoint`` reshards: each process reads the
    parts of the files its own tensors cover)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(policy), "optimizer": get_optimizer_state_dict(policy, optimizer)}
    dcp.load(state, checkpoint_id=str(folder), no_dist=not D.is_distributed())
    set_model_state_dict(policy, state["model"])
    set_optimizer_state_dict(policy, optimizer, state["optimizer"])


def save_checkpoint(
    run_dir: Path,
    step: int,
    policy,
    trainer_state: dict,
    reference_fingerprint: str | None,
    *,
    sharded: Path | None = None,
    keep: int = 2,
    run_id: str | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically and point ``LATEST`` at it; returns its folder.

    Every file's SHA-256 goes into its ``meta.json`` (:func:`verify_checkpoint` checks them on
    resume), with ``run_id``. Only once the new checkpoint is complete and ``LATEST`` names it are
    checkpoints beyond the newest ``keep`` deleted: only what tether wrote there, the ``step-N``
    folders of this run (:func:`own_checkpoint`) and its own temporaries; any other file or
    folder in ``checkpoints/`` is left as it is. A failed write removes its temporary folder and
    leaves every earlier checkpoint and ``LATEST`` as they were.

    Args:
        run_dir: the run directory.
        step: the last completed step.
        policy: the :class:`tether.models.policy.PolicyWithValue` (weights saved as safetensors), or
            :func:`policy_tensors` of it; None with ``sharded``.
        trainer_state: optimizer, controller, RNG and data states (``torch.save``-able).
        reference_fingerprint: recorded for the integrity check on resume.
        sharded: a sharded run's :func:`sharded_folder`, where every process has written its shards
            (:func:`save_sharded_state`): completed here with the rest and renamed into place.
        keep: complete checkpoints to keep, the newest (``train.keep_checkpoints``, >= 1).
        run_id: the run's id (:func:`tether.run.files.run_id`), recorded so that a resume refuses
            a checkpoint of another run.

    Raises:
        tether.run.files.RunFileError: a write failed (a full disk, a file-size limit),
            ``checkpoints/`` is a symbolic link, or ``step-N`` holds what tether may not replace
            (another run's checkpoint: :func:`check_replaceable`); names the file and the
            checkpoint that is kept.
    """
    root = own_folder(Path(run_dir) / "checkpoints")
    name = f"step-{step:06d}"
    check_replaceable(root / name, run_id)  # before the work of writing it
    tmp = sharded if sharded is not None else root / f".{name}.tmp{os.getpid()}"
    try:
        if sharded is None:
            remove_tree(tmp)
            tmp.mkdir()
            save_policy_weights(tmp, policy)
        torch.save(trainer_state, tmp / "trainer.pt")
        meta = {"step": step, "reference_fingerprint": reference_fingerprint, "files": file_digests(tmp)}
        meta |= {"sharded": True} if sharded is not None else {}
        meta |= {"run_id": run_id} if run_id is not None else {}
        (tmp / "meta.json").write_text(json.dumps(meta | {"meta_sha256": meta_digest(meta)}))
    # torch.save's full disk is a RuntimeError (inline_container), safetensors' a SafetensorError
    except (OSError, RuntimeError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        before = latest_checkpoint(run_dir)
        raise write_error(
            root / name,  # the checkpoint as it would have been named (its temporary folder is gone)
            e,
            f"The checkpoint of step {step} is not written; "
            + (f"{before} is kept" if before else "there is no earlier checkpoint"),
        ) from None
    final = root / name
    try:
        check_replaceable(final, run_id)  # again: something may have been put there meanwhile
    except RunFileError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    remove_tree(final)  # a checkpoint of this run (one a kill left before LATEST named it)
    os.replace(tmp, final)
    atomic_write_text(root / "LATEST", name)
    earlier = sorted((d for d in own_checkpoints(root, run_id) if _step_of(d) < step), key=_step_of)
    # the newest keep - 1 of them (all while there are fewer: a negative start would count from the end)
    kept = {d.name for d in earlier[-(keep - 1) :]} if keep > 1 else set()
    for old in earlier:  # this run's checkpoints beyond the newest ``keep``
        if old.name not in kept:
            shutil.rmtree(old, ignore_errors=True)
    for old in root.iterdir():  # temporaries a killed process left (a damaged checkpoint stays)
        if TEMPORARY.fullmatch(old.name):
            remove_tree(old)
    return final


CHECKPOINT = re.compile(r"step-\d{6,}")
"""The name of a checkpoint folder tether writes, ``step-N`` (N with six digits or more)."""
TEMPORARY = re.compile(r"\.step-\d{6,}\.tmp(\d+|-sharded)")
"""The name of a checkpoint's temporary folder (a plain run's names its process, a sharded run's
is shared by all processes: :func:`sharded_folder`)."""


def own_checkpoint(folder: Path, run_id: str | None) -> bool:
    """Whether ``folder`` is a complete checkpoint of the run ``run_id``, one tether may delete:
    named ``step-N``, a folder (not a link), with a ``meta.json`` naming ``run_id`` or no run
    (a checkpoint of a tether from before run ids). A user's copy (``step-000010-keep``), another
    run's checkpoint dropped in, or a folder without a readable meta.json is not."""
    if not (CHECKPOINT.fullmatch(folder.name) and folder.is_dir() and not folder.is_symlink()):
        return False
    try:
        return read_json(folder / "meta.json").get("run_id", run_id) == run_id
    except (OSError, ValueError):
        return False


def check_replaceable(folder: Path, run_id: str | None) -> None:
    """Check that tether may write checkpoint ``folder`` (``checkpoints/step-N``), replacing what is
    there: nothing, or a checkpoint of the run ``run_id`` (:func:`own_checkpoint`; one a kill left
    before ``LATEST`` named it). tether deletes only its own.

    Raises:
        RunFileError: ``folder`` holds another run's checkpoint (its meta.json names another run
            id) or something tether did not write there; names it and the fix.
    """
    folder = Path(folder)
    if not (folder.exists() or folder.is_symlink()) or own_checkpoint(folder, run_id):
        return
    try:
        theirs = read_json(folder / "meta.json").get("run_id") if folder.is_dir() else None
    except (OSError, ValueError):
        theirs = None
    what = (
        f"a checkpoint of another run (run id {theirs}, not this run's {run_id})"
        if isinstance(theirs, str) and not folder.is_symlink()
        else "something tether did not write there"
        + (" (a symbolic link)" if folder.is_symlink() else "" if folder.is_dir() else " (not a folder)")
    )
    root = folder.parent
    raise RunFileError(
        errno.EEXIST,
        f"{folder} holds {what}; tether would write the checkpoint of step {_step_of(folder)} there and "
        f"replaces only its own run's checkpoints, so it writes nothing there. Move {folder.name} out of "
        f"{root} (to keep it), then {resume_hint(root.parent)}",
    )


def check_checkpoints_ahead(resumed: Path, last: int, run_id: str | None) -> None:
    """Before a resume from checkpoint ``resumed`` (``step-N``) trains steps N + 1 to ``last``:
    check that each checkpoint folder it may write is free or this run's
    (:func:`check_replaceable`), so that a folder copied in from another run is refused now, not
    after the training.

    Raises:
        RunFileError: the first such folder that is not, named with the fix.
    """
    root, step = Path(resumed).parent, _step_of(Path(resumed))
    ahead = sorted(
        (d for d in root.iterdir() if CHECKPOINT.fullmatch(d.name) and step < _step_of(d) <= last),
        key=_step_of,
    )
    for folder in ahead:
        check_replaceable(folder, run_id)


def own_checkpoints(root: Path, run_id: str | None) -> list[Path]:
    """The folders of ``root`` (``checkpoints/``) that are :func:`own_checkpoint`."""
    return [d for d in root.iterdir() if own_checkpoint(d, run_id)] if root.is_dir() else []


DAMAGED = ".damaged-"
"""The prefix a checkpoint that failed :func:`verify_checkpoint` is renamed with when a resume falls
back to an earlier one (kept for a person to look at, never deleted by tether)."""


def _step_of(folder: Path) -> int:
    try:
        return int(folder.name.removeprefix("step-"))
    except ValueError:
        return -1


def file_digests(folder: Path) -> dict[str, str]:
    """``relative path -> SHA-256 hex`` of every file under ``folder`` (meta.json excepted)."""
    out = {}
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.name != "meta.json"):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        out[path.relative_to(folder).as_posix()] = h.hexdigest()
    return out


def meta_digest(meta: dict) -> str:
    """SHA-256 of a checkpoint's meta.json fields (``meta_sha256`` excepted), keys sorted: meta.json
    vouches for itself too (a flipped ``"step"`` would skip or repeat steps)."""
    rest = {k: v for k, v in meta.items() if k != "meta_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


class DamagedCheckpoint(ValueError):
    """A checkpoint whose files do not match the digests its meta.json recorded."""


def verify_checkpoint(folder: Path) -> dict:
    """Check every file of checkpoint ``folder`` against its meta.json's SHA-256 digests; returns
    the meta. A checkpoint written before digests were recorded (no ``files``) is taken as it is.

    Raises:
        DamagedCheckpoint: a file is missing, extra or differs (a flipped byte, a torn copy), or
            meta.json is not valid JSON; the message names the files.
    """
    try:
        meta = read_json(Path(folder) / "meta.json")
    except (ValueError, FileNotFoundError) as e:
        raise DamagedCheckpoint(str(e)) from None
    if meta.get("step") != _step_of(Path(folder)):
        raise DamagedCheckpoint(
            f"{folder}: meta.json says step {meta.get('step')!r}, the folder's name another"
        )
    if "meta_sha256" in meta and meta["meta_sha256"] != meta_digest(meta):
        raise DamagedCheckpoint(f"{folder}: meta.json (SHA-256 of its fields differs)")
    recorded = meta.get("files")
    if recorded is None:
        return meta
    found = file_digests(folder)
    bad = sorted(k for k in set(recorded) | set(found) if recorded.get(k) != found.get(k))
    if bad:

        def why(k: str) -> str:
            return "missing" if k not in found else "not recorded" if k not in recorded else "SHA-256 differs"

        what = ", ".join(f"{k} ({why(k)})" for k in bad[:4])
        raise DamagedCheckpoint(f"{folder}: {what}")
    return meta


def resume_checkpoint(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint a resume starts from: ``LATEST``'s when it verifies, else the newest earlier
    complete one that does (each damaged one is renamed ``.damaged-step-N``, kept); with a note
    for each one passed over.

    A ``LATEST`` that is not text or names a folder outside ``checkpoints/`` is ignored (never
    followed), with a note, and rewritten to the checkpoint chosen.

    Returns:
        (folder or None when no checkpoint verifies, notes to print).
    """
    root = Path(run_dir) / "checkpoints"
    notes = []
    try:
        latest = latest_checkpoint(run_dir)
    except (ValueError, UnicodeDecodeError) as e:  # damaged or tampered: never followed
        notes.append(f"tether: {root / 'LATEST'} is damaged ({e}); ignoring it")
        latest = None
    others = sorted(
        (
            d
            for d in root.glob("step-*")
            if d != latest and CHECKPOINT.fullmatch(d.name) and (d / "meta.json").exists()
        ),
        key=_step_of,
    )
    candidates = ([latest] if latest is not None else []) + others[::-1]
    for folder in candidates:
        try:
            verify_checkpoint(folder)
        except DamagedCheckpoint as e:
            aside, k = folder.with_name(f"{DAMAGED}{folder.name}"), 2
            while aside.exists():  # an earlier damaged copy of the same step is kept too
                aside, k = folder.with_name(f"{DAMAGED}{folder.name}-{k}"), k + 1
            os.replace(folder, aside)
            notes.append(
                f"tether: checkpoint {folder.name} is damaged ({e}); moved aside to {aside.name} (delete it "
                "once looked at)"
            )
            continue
        if notes:
            notes.append(f"tether: resuming from checkpoint {folder.name}, the newest that verifies")
            atomic_write_text(root / "LATEST", folder.name)
        return folder, notes
    return None, notes


def check_checkpoint_run(folder: Path, run_id: str | None) -> list[str]:
    """Check that checkpoint ``folder`` is of the run ``run_id`` (the run folder's,
    :func:`tether.run.files.run_id`): its digests vouch for its files, this for whose it is.
    Returns the notes to print: one for a checkpoint of a tether from before run ids, resumed as
    this run's (whose it is cannot be told).

    Raises:
        RuntimeError: the checkpoint names another run; names both and the fix.
    """
    theirs = read_json(Path(folder) / "meta.json").get("run_id")
    if theirs is None or run_id is None:
        return [
            f"tether: checkpoint {Path(folder).name} records no run id (written by a tether from before run "
            "ids), so whose run it is cannot be checked; resuming it as this run's"
        ]
    if theirs != run_id:
        root = Path(folder).parent
        raise RuntimeError(
            f"checkpoint {folder} is of another run (run id {theirs}), not of this one (run id {run_id}, "
            f"in {root.parent / RUN_RECORD}): it was copied in from another run folder. Move it out of "
            f"{root} (and write the name of this run's newest step-N folder into {root / 'LATEST'}), or "
            "resume the run it came from"
        )
    return []


def policy_tensors(policy) -> dict[str, dict[str, torch.Tensor]]:
    """What a checkpoint holds of ``policy``: ``{"lm": ..., "value_head": ...}``, whole tensors.

    The LM's tensors are :meth:`tether.models.policy.PolicyWithValue.lm_checkpoint_state` (a LoRA
    run's trainable adapter only). Under FSDP (``train.sharding=fsdp``) each is gathered from
    every process: every process calls this, and rank 0 writes what it returns.
    """
    return {
        "lm": {k: D.full_tensor(v) for k, v in policy.lm_checkpoint_state().items()},
        "value_head": {k: D.full_tensor(v) for k, v in policy.value_head.state_dict().items()},
    }


def save_policy_weights(folder: Path, policy) -> None:
    """Write ``policy.safetensors`` (the LM's tensors, or a LoRA run's trainable adapter only: the
    frozen base is rebuilt and fingerprinted on resume) and ``value_head.safetensors`` into ``folder``.

    ``policy``: the :class:`tether.models.policy.PolicyWithValue`, or what :func:`policy_tensors`
    returned for it (a sharded policy's, gathered by every process).
    """
    from safetensors.torch import save_file

    tensors = policy if isinstance(policy, dict) else policy_tensors(policy)
    lm_state = {k: v.detach().contiguous().clone() for k, v in tensors["lm"].items()}
    # tied weights share storage; safetensors refuses shared tensors, so each is cloned above
    save_file(lm_state, str(Path(folder) / "policy.safetensors"))
    save_file(
        {k: v.detach().contiguous() for k, v in tensors["value_head"].items()},
        str(Path(folder) / "value_head.safetensors"),
    )


def load_policy_weights(folder: Path, policy) -> None:
    """Load what :func:`save_policy_weights` wrote into ``policy``.

    Raises:
        RuntimeError: the tensors do not match the model (another model or LoRA setting).
    """
    from safetensors.torch import load_file

    lm_state = load_file(str(Path(folder) / "policy.safetensors"))
    expected = set(policy.lm_checkpoint_state())
    # whole tensors; a sharded (FSDP) policy keeps each process's own shard of them
    missing, unexpected = load_full_state_dict(policy.lm, lm_state, strict=False)
    missing = [k for k in missing if k in expected]  # a LoRA checkpoint holds the adapter only
    if unexpected or [k for k in missing if "lm_head" not in k or ".lora_" in k]:  # lm_head may be tied
        raise RuntimeError(
            f"checkpoint {folder} does not match the model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    load_full_state_dict(policy.value_head, load_file(str(Path(folder) / "value_head.safetensors")))


def save_best(run_dir: Path, policy, meta: dict) -> Path:
    """Replace ``run_dir/best`` (the policy of the best periodic evaluation): written to a
    temporary folder, then swapped in, so a kill leaves the previous best or the new one (in the
    moment between the two renames, as ``.best.old*``, which :func:`best_folder` puts back)."""
    root = Path(run_dir)
    best_folder(root)
    tmp, final, old = root / f".best.tmp{os.getpid()}", root / "best", root / f".best.old{os.getpid()}"
    for leftover in root.iterdir():  # a killed earlier save's (tether's names only)
        if BEST_TEMPORARY.fullmatch(leftover.name):
            remove_tree(leftover)
    tmp.mkdir()
    save_policy_weights(tmp, policy)
    (tmp / "meta.json").write_text(json.dumps(meta))
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    remove_tree(old)
    return final


BEST_TEMPORARY = re.compile(r"\.best\.(tmp|old)\d+")
"""The names of :func:`save_best`'s temporary folders: the new best, and the old one moved aside."""


def best_folder(run_dir: Path) -> Path | None:
    """``run_dir/best`` if it holds a complete best policy, else None; a best moved aside by a
    :func:`save_best` that was killed between its two renames is put back first."""
    final = Path(run_dir) / "best"
    if not final.exists():
        aside = sorted(d for d in Path(run_dir).glob(".best.old*") if BEST_TEMPORARY.fullmatch(d.name))
        if aside and (aside[-1] / "meta.json").exists():
            os.replace(aside[-1], final)
    return final if (final / "meta.json").exists() else None


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The folder ``LATEST`` names, or None when the run has no complete checkpoint."""
    pointer = Path(run_dir) / "checkpoints" / "LATEST"
    if not pointer.exists():
        return None
    try:
        name = pointer.read_text().strip()
    except UnicodeDecodeError:
        raise ValueError(
            f"{pointer}: not text (a damaged file); it should hold one folder name (step-N)"
        ) from None
    path = pointer.parent / name
    # LATEST names a folder beside it, nothing else: a run folder handed over must not point a
    # resume at files outside it
    if (
        not name
        or Path(name).name != name
        or name in (".", "..")
        or path.resolve().parent != pointer.parent.resolve()
    ):
        raise ValueError(
            f"{pointer}: names {name!r}, which is not a checkpoint folder inside {pointer.parent}; a run "
            "folder's LATEST holds one folder name (step-N). Fix or delete it (the newest step-N folder "
            "with a meta.json is the last complete checkpoint)"
        )
    return path if (path / "meta.json").exists() else None


def load_checkpoint(path: Path, policy) -> tuple[dict, dict]:
    """Load policy weights into ``policy``; return (meta, trainer_state). A sharded run's checkpoint
    (``meta["sharded"]``) holds its weights and optimizer state in :data:`SHARDED`, for
    :func:`load_sharded_state` with the trainer's optimizer; they are not loaded here."""
    if not (Path(path) / SHARDED).exists():
        load_policy_weights(path, policy)
    meta = read_json(path / "meta.json")
    return meta, load_trainer_state(path / "trainer.pt")


def load_trainer_state(path: Path) -> dict:
    """A checkpoint's ``trainer.pt`` with ``torch.load(weights_only=True)``: tensors, numbers,
    strings and the containers of them that tether writes (optimizer, scheduler, controller, RNG,
    sampler and leash state), and nothing that runs code. A pickle of anything else (a run folder
    crafted to execute code on ``--resume``) is refused.

    Raises:
        ValueError: the file holds an object tether did not write, or is not a torch file; the
            message names the file.
    """
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # UnpicklingError for a foreign object; RuntimeError/EOFError for a torn file
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(
            f"{path}: not a trainer state tether wrote ({type(e).__name__}: {first}); it is loaded with "
            "weights_only=True, so a file holding other objects is refused, not run. Resume from an "
            "intact checkpoint"
        ) from None


def save_policy(
    policy,
    tokenizer,
    out: Path,
    whole: dict | None = None,
    *,
    base_model: tuple[str, str | None] | None = None,
    value_head: bool = True,
) -> None:
    """The final policy as a model folder (``save_pretrained``; a LoRA run's adapter as a peft
    folder), its tokenizer and, when ``value_head`` (the trainer trains one: PPO),
    ``value_head.safetensors``. ``whole``: when the policy is sharded,
    ``{"lm": ..., "value_head": ...}``, their whole tensors
    (:func:`tether.models.sharding.full_state_dict`, gathered by every process).

    ``base_model``: ``(Hub id, revision)`` of a base model that came from the Hub. An adapter's
    ``adapter_config.json`` then names it by id and revision (peft would record the local cache
    folder it was loaded from, which breaks once the cache moves), as TRL's adapters do; a local
    base stays a path.

    Written to a temporary folder beside ``out`` and renamed into place, so ``out`` is a whole
    policy or absent (an earlier one is replaced only once the new one is complete).

    Raises:
        tether.run.files.RunFileError: a write failed (a full disk, a file-size limit); names the
            folder, and the last checkpoint is kept.
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    remove_tree(tmp)
    try:
        if whole is not None:
            policy.lm.save_pretrained(tmp, state_dict=whole["lm"])
        else:
            policy.save_pretrained(tmp)  # the model, or for a LoRA run its adapter (a peft folder)
        if base_model is not None and (tmp / "adapter_config.json").exists():
            adapter = json.loads((tmp / "adapter_config.json").read_text())
            adapter["base_model_name_or_path"], adapter["revision"] = base_model
            (tmp / "adapter_config.json").write_text(json.dumps(adapter, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(tmp)
        if value_head:  # GRPO, RLOO and DPO never train it: an untrained head is not shipped
            head = whole["value_head"] if whole is not None else policy.value_head.state_dict()
            save_file(
                {k: v.detach().contiguous() for k, v in head.items()}, str(tmp / "value_head.safetensors")
            )
    except (OSError, RuntimeError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_error(out, e, "The final policy is not saved; the last checkpoint is kept") from None
    remove_tree(out)  # a link put there while the run went on goes (its target is left as it is)
    os.replace(tmp, out)
