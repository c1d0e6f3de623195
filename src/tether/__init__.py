"""tether: RLHF fine-tuning that keeps the policy on a visible, controllable KL leash.

The public API, importable from ``tether`` (loaded on first use, so ``import tether.core.kl``
stays torch-only)::

    from tether import train, load_config                       # run a training job
    from tether import kl_k1, kl_k2, kl_k3, estimate_kl, exact_kl_from_logits   # KL estimators
    from tether import FixedKLController, AdaptiveKLController, BudgetKLController, make_controller
    from tether import KLLeash, shape_rewards                   # where the KL goes, once
    from tether import StopTraining, Interrupted                # a callback's stop, and its end
    from tether import push                                     # a run's policy to the Hub

    config = load_config("my.yaml", ["kl.kl_coef=0.1", "train.steps=40"])
    run_dir = train(config)
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "train": "tether.training",
    "load_config": "tether.run.config",
    "Config": "tether.run.config",
    "kl_k1": "tether.core.kl",
    "kl_k2": "tether.core.kl",
    "kl_k3": "tether.core.kl",
    "estimate_kl": "tether.core.kl",
    "exact_kl_from_logits": "tether.core.kl",
    "masked_mean": "tether.core.masked",
    "masked_sum": "tether.core.masked",
    "FixedKLController": "tether.core.controllers",
    "AdaptiveKLController": "tether.core.controllers",
    "BudgetKLController": "tether.core.controllers",
    "make_controller": "tether.core.controllers",
    "KLLeash": "tether.core.leash",
    "shape_rewards": "tether.core.shaping",
    "StopTraining": "tether.run.reporting",
    "Interrupted": "tether.run.signals",
    "push": "tether.run.publish",
}
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    """PEP 562: import the module behind a public name when the name is first used."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tether' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
