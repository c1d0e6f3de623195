"""A run's life beside its checkpoints: start, resume, checkpoint, and the checks that keep a
resumed run the run it was (the same prompts, the same reference, settings changes recorded).

Each function takes the :class:`tether.run.setup.Run` and, where it saves or restores the
trainer's state, the trainer (any object with ``state_dict``, ``load_state_dict`` and
``optimizer``: the layers above build it).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import NamedTuple, NoReturn

import torch

from tether.core import distributed as D
from tether.core.health import Alarm
from tether.core.text import shown
from tether.judges.contract import ScorerFailed, ScorerStopped
from tether.models.reference import fingerprint
from tether.models.sharding import is_sharded
from tether.models.turns import EnvFailed
from tether.run.checkpoint import (
    SHARDED,
    check_checkpoint_run,
    check_checkpoints_ahead,
    latest_checkpoint,
    load_checkpoint,
    load_sharded_state,
    policy_tensors,
    resume_checkpoint,
    save_checkpoint,
    save_sharded_state,
    sharded_folder,
)
from tether.run.config import Config, dump_yaml, read_yaml
from tether.run.console import say
from tether.run.files import (
    RunFileError,
    atomic_write_text,
    own_folder,
    read_json,
    read_jsonl,
    remove_tree,
    resume_hint,
    write_json_file,
)
from tether.run.monitor import HealthMonitor
from tether.run.rngs import checkpoint_rng_state, restore_rng_state, rng_state, set_rng_state
from tether.run.setup import Run
from tether.run.signals import Interrupted


def start_run(run: Run) -> int:
    """A fresh run: record its reference's fingerprint and its prompts' (reference.json,
    data.json); returns the first step, 0."""
    if D.is_main():
        write_json_file(run.writer.run_dir / "reference.json", {"fingerprint": run.reference_fingerprint})
        write_json_file(run.writer.run_dir / "data.json", data_record(run))
    return 0


def data_record(run: Run) -> dict:
    """The run's prompts, fingerprinted (SHA-256 of the training and held-out prompts with their
    columns, in order): a resume must see the same ones (the checkpoint's prompt order and the
    held-out split index them)."""
    h = hashlib.sha256()
    for part in (run.train_prompts, run.heldout_prompts):
        h.update(json.dumps([part.prompts, part.columns], sort_keys=True, default=str).encode())
    return {
        "prompts_sha256": h.hexdigest(),
        "train": len(run.train_prompts),
        "heldout": len(run.heldout_prompts),
    }


def check_data(run: Run) -> None:
    """Refuse a resume whose prompts differ from the run's (data.json; a run from before it has
    none and is not checked)."""
    path = run.writer.run_dir / "data.json"
    if not path.exists():
        return
    saved, now = read_json(path), data_record(run)
    if saved.get("prompts_sha256") != now["prompts_sha256"]:
        raise RuntimeError(
            f"--resume {run.writer.run_dir}: the prompts differ from the run's "
            f"({saved.get('train')} training and {saved.get('heldout')} held-out prompts then, "
            f"{now['train']} and {now['heldout']} now, "
            f"SHA-256 {str(saved.get('prompts_sha256'))[:12]}... vs {now['prompts_sha256'][:12]}...): "
            f"data.prompts={run.config.data.prompts} was edited since, or train.seed changed the "
            "embedded prompts' prefixes. The checkpoint's prompt order and the held-out split index the "
            "run's prompts: restore the file (and train.seed), or start a new run"
        )


def resume_run(run: Run, trainer, monitor: HealthMonitor) -> int:
    """Restore the newest checkpoint; check the rebuilt reference against its fingerprint."""
    w = run.writer
    # rank 0 checks every file's SHA-256 (falling back past a damaged newest checkpoint) and that
    # the checkpoint is this run's; all load the folder it chose, or all stop
    found, notes, refused = None, [], None
    if D.is_main():
        found, notes = resume_checkpoint(w.run_dir)
        try:
            notes += check_checkpoint_run(found, w.run_id) if found is not None else []
            if found is not None:  # the checkpoints it will write are free or its own
                check_checkpoints_ahead(found, run.config.train.steps - 1, w.run_id)
        except (RuntimeError, RunFileError) as e:
            refused = str(e)
    path, refused = D.gather_objects((found, refused))[0]
    for note in notes:
        say(note, True)
    if refused:
        raise RuntimeError(f"--resume {w.run_dir}: {refused}")
    if path is None:
        raise FileNotFoundError(
            f"--resume {w.run_dir}: no complete checkpoint in {w.run_dir / 'checkpoints'}"
            + (
                " that verifies (each damaged one was moved aside to checkpoints/.damaged-step-N: rename "
                "one back to look at it, or start a new run)"
                if notes
                else ""
            )
        )
    check_data(run)
    recorded = read_json(w.run_dir / "reference.json").get("fingerprint")
    if recorded != run.reference_fingerprint:
        raise RuntimeError(
            f"--resume {w.run_dir}: the reference rebuilt from {run.config.model.name} does not match "
            f"the fingerprint recorded when the run started ({recorded[:12]}... vs "
            f"{str(run.reference_fingerprint)[:12]}...): the reference would have moved"
        )
    meta, state = load_checkpoint(path, run.policy)
    if (path / SHARDED).exists():  # a sharded run's: weights and AdamW state resharded to this run's
        load_sharded_state(path / SHARDED, run.policy, trainer.optimizer.optimizer)
    # the resumed config's controller and optimizer settings apply from the next step (printed)
    trainer.load_state_dict(state["trainer"], next_step=meta["step"] + 1)
    restore_rng_state(state["rng"], seed=run.config.train.seed, step=meta["step"])
    run.reference_forwards[0] = state["reference_forwards"]
    if not D.is_main():
        return meta["step"] + 1
    w.truncate_after(meta["step"])
    record_resumed_config(run, meta["step"])
    monitor.fired = [Alarm(**a) for a in read_jsonl(w.run_dir / "warnings.jsonl")]
    return meta["step"] + 1


def with_defaults(saved: dict) -> dict:
    """A config.yaml's sections with the fields it lacks at this version's defaults (unresolved).

    A run folder written by an older tether has no key for a field added since; each new field's
    default keeps the older behaviour (``kl.budget_kd`` 0: no derivative term; ``rollout.compile``
    auto: eager decoding unless the run repays a compile, the same samples up to rounding), so the
    missing key is not a change on resume."""
    full = Config().to_dict(resolved=False)
    for section, fields in saved.items():
        if isinstance(fields, dict) and isinstance(full.get(section), dict):
            full[section].update(fields)
        else:
            full[section] = fields
    return full


def record_resumed_config(run: Run, step: int) -> None:
    """When ``--resume`` changed settings, config.yaml becomes the config the run goes on with (so
    a later plain ``--resume`` keeps them) and the one it had is kept as config.until-step-N.yaml,
    the config that trained the steps up to N.

    A config.until-step-N.yaml already there is kept as it is: an earlier resume from the same
    step N wrote it and stopped before its next checkpoint, so config.yaml holds that resume's
    settings, which trained no step that is kept (this resume cut its rows away)."""
    path = run.writer.run_dir / "config.yaml"
    before = with_defaults(read_yaml(path.read_text(), f"--resume: {path}"))
    now = run.config.to_dict(resolved=False)
    now["train"]["output_dir"] = before["train"]["output_dir"]  # --resume names the folder; not a change
    if now == before:
        return
    kept = path.with_name(f"config.until-step-{step}.yaml")
    earlier = kept.exists()
    if not earlier:
        atomic_write_text(kept, path.read_text())
    atomic_write_text(path, dump_yaml(now))
    changed = [
        f"{sec}.{name}: {shown((before.get(sec) or {}).get(name))} -> {shown(value)}"
        for sec, fields in now.items()
        if isinstance(fields, dict)
        for name, value in fields.items()
        if (before.get(sec) or {}).get(name) != value
    ]
    say(
        f"tether: resumed with {len(changed)} changed setting(s), from step {step + 1}: "
        f"{'; '.join(changed)}. "
        f"config.yaml now holds them; the run's earlier config is {kept.name}"
        + (
            f" (written by an earlier resume from step {step}: the settings that resume put in config.yaml "
            "trained no step that is kept)"
            if earlier
            else ""
        ),
        run.config.train.progress,
    )


def write_checkpoint(run: Run, trainer, step: int) -> Path:
    """Rank 0 writes the checkpoint (policy, optimizer and trainer state are the same on every
    process; under FSDP each process writes its shards of weights and AdamW state first). The
    reference is fingerprinted when the run starts, on resume and after the last step, not here:
    hashing copies every weight to the host (seconds for a 7B reference on a GPU)."""
    path = own_folder(run.writer.run_dir / "checkpoints")  # every process: not written through a link
    sharded = sharded_folder(run.writer.run_dir, step) if is_sharded(run.policy) else None
    if sharded is not None:  # every process writes its own shards of weights and AdamW state
        if D.is_main():
            remove_tree(sharded)  # a killed attempt's
        D.barrier()
        save_sharded_state(sharded / SHARDED, run.policy, trainer.optimizer.optimizer)
        weights, trainer_state = None, trainer.state_dict(with_optimizer=False)
    else:
        weights, trainer_state = policy_tensors(run.policy), trainer.state_dict()
    rng = checkpoint_rng_state()  # collective: each rank's Python and NumPy states
    if D.is_main():
        path = save_checkpoint(
            run.writer.run_dir,
            step,
            policy=weights,
            trainer_state={
                "trainer": trainer_state,
                "rng": rng,
                "reference_forwards": run.reference_forwards[0],
            },
            reference_fingerprint=run.reference_fingerprint,
            sharded=sharded,
            keep=run.config.train.keep_checkpoints,
            run_id=run.writer.run_id,
        )
    D.barrier()
    return path


def check_reference(run: Run, when: str) -> None:
    """Every process checks its reference against the fingerprint taken when the run started;
    all stop if any one moved (before a checkpoint or the final evaluation is written)."""
    moved = run.reference is not None and fingerprint(run.reference) != run.reference_fingerprint
    if D.all_reduce_max(torch.tensor(float(moved))) > 0:
        raise RuntimeError(
            f"{when}: the reference model's weights changed since the run started; "
            "stopping (the last checkpoint is kept)"
        )


UserCodeStop = ScorerStopped | ScorerFailed | EnvFailed
"""What user code ends a step with: a scorer's exit or interrupt (:class:`ScorerStopped`), its
failure (:class:`ScorerFailed`), an environment's failure, deadline or interrupt
(:class:`tether.models.turns.EnvFailed`)."""

USER_CODE_STOPS = (ScorerStopped, ScorerFailed, EnvFailed)
""":data:`UserCodeStop`'s classes, as an ``except`` clause takes them."""


class Unmeasured(NamedTuple):
    """User code failed after a step's update, in what measures the step (the periodic
    evaluation, DPO's probe, the gold judge of the step's samples): the step itself is done."""

    error: UserCodeStop
    """The failure, as the user code's caller raised it."""
    missing: str
    """What the step's record lacks, for the message: ``its periodic evaluation``."""


def raise_unmeasured(run: Run, failure: Unmeasured | None, step: int, path: Path) -> NoReturn:
    """Raise the failure of what measured step ``step`` after its update (:class:`Unmeasured`),
    once the checkpoint of that step (``path``) is written: its row is in metrics.jsonl without the
    measurement, and ``--resume`` goes on at step ``step + 1``. Collective: every process calls it
    (``failure`` None where this process had none: rank 0's is raised, which it evaluated alone)."""
    ranks = D.gather_objects((failure, path))
    failure = failure or next(f for f, _ in ranks if f is not None)
    path = ranks[0][1]  # rank 0 wrote the checkpoint: the others hold its folder's parent
    raise_stopped(
        run,
        failure.error,
        f"after step {step}, whose update is kept: its row is logged without {failure.missing}; "
        f"checkpoint {path} holds the run after step {step}; {resume_hint(run.writer.run_dir)}",
    )


def state_before_step(run: Run, trainer) -> dict | None:
    """What an on-policy step moves before it scores (the prompt sampler; the RNGs, which a scorer
    may draw from): copied, so that a scorer that ends the step (:class:`ScorerStopped`) leaves a
    checkpoint of the step before, exactly as it was. None for DPO, whose probe scores after the
    update."""
    if not hasattr(trainer, "sampler"):
        return None
    return {
        "sampler": trainer.sampler.state_dict(),
        "generator": trainer.generator.get_state(),
        "rng": rng_state(),
        "reference_forwards": run.reference_forwards[0],
    }


def told(e: UserCodeStop, note: str) -> UserCodeStop:
    """The user code's stop ``e`` (a scorer's :class:`ScorerStopped`, an environment's
    :class:`tether.models.turns.EnvFailed`), the same kind, with ``note`` (what was kept) added."""
    message = f"{e} ({note})"
    return e.retold(message) if isinstance(e, EnvFailed) else type(e)(message)


def raise_stopped(run: Run, e: UserCodeStop, note: str) -> NoReturn:
    """Raise ``e`` told with ``note`` (:func:`told`); an environment a signal interrupted (a
    second Ctrl-C while it ran) is a stop, not a failure: said, then :class:`Interrupted`."""
    error = told(e, note)
    if isinstance(e, EnvFailed) and e.interrupted:
        say(f"tether: {error}", run.config.train.progress)
        raise Interrupted(str(run.writer.run_dir)) from None
    raise error from None


def raise_stopped_in_step(
    run: Run, trainer, step: int, before: dict | None, e: UserCodeStop, *, saved: int
) -> NoReturn:
    """User code ended step ``step`` before its update: a scorer raised SystemExit or
    KeyboardInterrupt (:class:`ScorerStopped`) or failed (:class:`ScorerFailed`), or the
    environment failed, passed
    ``rollout.env_timeout`` or was interrupted (:class:`tether.models.turns.EnvFailed`). An
    on-policy step samples and scores before it updates, so the policy and the optimizer are those
    after step ``step - 1``; with the sampler and RNGs put back as they were, that checkpoint is
    written (a resume then runs step ``step`` as an uninterrupted run would), unless the newest
    checkpoint already holds that step (``saved``: a resumed run's first step, or
    train.checkpoint_every's). Raises the error with what was kept (:func:`raise_stopped`).

    Args:
        saved: the step the run's newest checkpoint holds (-1: none).
    """
    w = run.writer
    if before is not None and step > 0 and saved < step - 1:
        trainer.sampler.load_state_dict(before["sampler"])
        trainer.generator.set_state(before["generator"])
        set_rng_state(before["rng"])
        run.reference_forwards[0] = before["reference_forwards"]
        path = write_checkpoint(run, trainer, step - 1)
        raise_stopped(
            run, e, f"checkpoint {path} holds the run after step {step - 1}; {resume_hint(w.run_dir)}"
        )
    if step == 0 and not w.history:  # a fresh run's first step: train() removes the folder
        raise_stopped(
            run,
            e,
            "no step completed, so the run folder is removed (files tether did not write are kept): "
            "start the run again",
        )
    kept = latest_checkpoint(w.run_dir)
    raise_stopped(
        run, e, f"{f'the last checkpoint, {kept}, is kept; ' if kept else ''}{resume_hint(w.run_dir)}"
    )
