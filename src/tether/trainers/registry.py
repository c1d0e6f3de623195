"""The trainers by name: ``train.algo`` -> trainer class, and the one lookup that refuses a name
half registered.

A trainer is registered in three places (docs/architecture.md, "How to add ... a trainer"): its
row of :data:`tether.run.config.TRAINER_DEFAULTS` (what the config knows of it), its class in
:data:`TRAINERS` and, if it samples, its step-6 advantage in
:data:`tether.trainers.steps.ADVANTAGES`. The config checks the first; :func:`trainer_class`
checks the other two, before anything loads.
"""

from __future__ import annotations

from tether.run.config import ConfigError
from tether.trainers.dpo import DPOTrainer
from tether.trainers.group import GRPOTrainer, RLOOTrainer
from tether.trainers.ppo import PPOTrainer
from tether.trainers.steps import ADVANTAGES

TRAINERS: dict[str, type] = {"ppo": PPOTrainer, "grpo": GRPOTrainer, "rloo": RLOOTrainer, "dpo": DPOTrainer}
"""``train.algo`` -> trainer class; each is built from a run (``TRAINERS[algo](run)``) and has
``step(step) -> dict``, ``last_experience`` and ``trainer_state(step)`` (the ``transformers.TrainerState``
after ``step`` steps: rewards and callbacks read it)."""


def trainer_class(algo: str, *, samples: bool) -> type:
    """The trainer class registered as ``algo``, with the step-6 advantage an on-policy one needs.

    Args:
        algo: ``train.algo``, a name with a row of :data:`tether.run.config.TRAINER_DEFAULTS`.
        samples: the row's ``samples``: the trainer samples a rollout every step, so its
            advantage must be registered in :data:`tether.trainers.steps.ADVANTAGES`.

    Raises:
        ConfigError: no class in :data:`TRAINERS`, or no advantage for an on-policy trainer,
            naming what is missing and where it is registered.
    """
    cls = TRAINERS.get(algo)
    if cls is None:
        raise ConfigError(
            f"train.algo={algo}: no trainer class is registered under that name in "
            "tether.trainers.registry.TRAINERS (docs/architecture.md, 'How to add a trainer')"
        )
    if samples and algo not in ADVANTAGES:
        raise ConfigError(
            f"train.algo={algo}: no advantage is registered under that name in "
            "tether.trainers.steps.ADVANTAGES (docs/architecture.md, 'How to add a trainer')"
        )
    return cls
