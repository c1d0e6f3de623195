"""The host random number generators a run owns, beside tether's own keyed sampler noise: torch's
CPU generator, Python's ``random`` and NumPy's global one, which a reward, a judge or an
environment (``rollout.env``) may draw from.

A run seeds all three from ``train.seed`` (as TRL's ``set_seed`` does), saves their states in each
checkpoint (a resume goes on with the numbers an uninterrupted run draws next), and forks them
around an evaluation: the evaluation's draws start from its own seed and leave the training
stream where it was, so turning periodic evaluation on or off changes no training sample, and
the reference's and the policy's held-out passes start an environment's draws from one state.
tether's own sampling never reads these (:mod:`tether.core.noise`).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed torch's CPU generator, Python's ``random`` and NumPy's global generator with ``seed``
    (NumPy takes ``seed mod 2**32``, the range it accepts)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """The three generators' states, in types ``torch.load(weights_only=True)`` reads back: torch's
    state tensor, Python's state tuple, and NumPy's MT19937 state with its keys as an int64 tensor."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (
            str(name),
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ),
    }


def set_rng_state(state: dict) -> None:
    """Put back what :func:`rng_state` returned. A state saved before NumPy's was recorded (a
    checkpoint of an earlier tether) leaves NumPy's generator as it is."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))


@contextmanager
def forked_rngs(seed: int) -> Iterator[None]:
    """Inside: the three generators seeded with ``seed`` (:func:`seed_everything`); after: each as
    it was before, whatever was drawn inside or raised."""
    saved = rng_state()
    seed_everything(seed)
    try:
        yield
    finally:
        set_rng_state(saved)
