"""The host random number generators a run owns, beside tether's own keyed sampler noise: torch's
CPU generator, Python's ``random`` and NumPy's global one, which a reward, a judge or an
environment (``rollout.env``) may draw from.

A run seeds all three from ``train.seed`` (as TRL's ``set_seed`` does), saves their states in each
checkpoint (a resume goes on with the numbers an uninterrupted run draws next), and forks them
around an evaluation and the gold judge's scoring of the training samples: those draws start from
seeds of their own and leave the training stream where it was, so turning periodic evaluation or
the judge on or off changes no training sample, and the reference's and the policy's held-out
passes start an environment's draws from one state. Under several processes Python's and NumPy's
generators get a seed per process (:func:`host_seed`; TRL's ``set_seed(device_specific=True)``
does the same), so that the ranks' environments do not replay one another's draws, while torch's
stays the same on every rank. tether's own sampling never reads these (:mod:`tether.core.noise`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from tether.core import distributed as D
from tether.models.sampling import keyed_seed


def derived_seed(seed: int, *keys: object) -> int:
    """A seed for a purpose (a process, a step's judging) from the run's: ``seed`` itself without
    ``keys``, else :func:`tether.models.sampling.keyed_seed` of ``seed`` and the keys."""
    return int(seed) if not keys else keyed_seed("tether-rng", int(seed), *keys)


def host_seed(seed: int, rank: int) -> int:
    """The seed of Python's and NumPy's generators on process ``rank``: ``seed`` on rank 0 (a
    one-process run draws what rank 0 draws), :func:`derived_seed` of it and the rank elsewhere."""
    return derived_seed(seed) if rank == 0 else derived_seed(seed, "rank", rank)


def seed_host(seed: int) -> None:
    """Seed Python's ``random`` and NumPy's global generator (NumPy takes ``seed mod 2**32``)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)


def seed_everything(seed: int, rank: int | None = None) -> None:
    """Seed torch's CPU generator with ``seed`` and Python's and NumPy's with
    :func:`host_seed` of this process (``rank`` None: :func:`tether.core.distributed.rank`)."""
    seed_host(host_seed(seed, D.rank() if rank is None else rank))
    torch.manual_seed(seed)


def host_state() -> tuple:
    """Python's and NumPy's generator states, in types ``torch.load(weights_only=True)`` reads
    back: Python's state tuple, and NumPy's MT19937 state with its keys as an int64 tensor."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    numpy = (str(name), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    return random.getstate(), numpy


def set_host_state(state: tuple) -> None:
    """Put back what :func:`host_state` returned."""
    python, (name, keys, pos, has_gauss, cached) = state
    random.setstate(python)
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))


def rng_state() -> dict:
    """This process's generator states: torch's state tensor, Python's and NumPy's
    (:func:`host_state`)."""
    python, numpy = host_state()
    return {"torch": torch.get_rng_state(), "python": python, "numpy": numpy}


def set_rng_state(state: dict) -> None:
    """Put back what :func:`rng_state` returned. A state saved before NumPy's was recorded (a
    checkpoint of an earlier tether) leaves NumPy's generator as it is."""
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        set_host_state((state["python"], state["numpy"]))
    else:
        random.setstate(state["python"])


def checkpoint_rng_state() -> dict:
    """What a checkpoint keeps (collective: every process calls it): rank 0's :func:`rng_state`,
    and with several processes each rank's :func:`host_state` under ``"ranks"``."""
    state = rng_state()
    if D.world_size() > 1:
        state["ranks"] = D.gather_objects(host_state())
    return state


def restore_rng_state(state: dict, *, seed: int, step: int) -> None:
    """Put back a checkpoint's :func:`checkpoint_rng_state` on this process: torch's and rank 0's
    states, then this rank's Python and NumPy states when the checkpoint has them for the same
    number of processes. Otherwise a rank other than 0 is seeded afresh with
    :func:`derived_seed` of ``seed``, the rank and the resumed ``step`` (its old stream, if any,
    belonged to other rows), so that no two ranks draw alike."""
    set_rng_state(state)
    rank, ranks = D.rank(), state.get("ranks")
    if ranks is not None and len(ranks) == D.world_size():
        set_host_state(ranks[rank])
    elif rank > 0:
        seed_host(derived_seed(seed, "rank", rank, "resumed at", step))


@contextmanager
def forked_rngs(seed: int) -> Iterator[None]:
    """Inside: torch's, Python's and NumPy's generators seeded with ``seed``; after: each as it
    was before, whatever was drawn inside or raised."""
    saved = rng_state()
    seed_host(seed)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        set_rng_state(saved)
