"""Python callables named in a config as ``module:function`` (a reward, an environment)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from tether.core.text import clipped, shown

PASSED_FROM_PYTHON = "(from Python)"
"""The prefix config.yaml records for a callable passed as an object (``train(config, env=f)``,
``scorer=f``): no spec builds it, so a resume without the object asks for it."""


def python_object_spec(obj) -> str:
    """What config.yaml records for a callable passed from Python: :data:`PASSED_FROM_PYTHON`
    and ``module:qualname`` (an instance's class), e.g. ``(from Python) mytools:adder``."""
    named = obj if hasattr(obj, "__qualname__") else type(obj)
    return f"{PASSED_FROM_PYTHON} {getattr(named, '__module__', '?')}:{named.__qualname__}"


def import_callable(spec: str, field_name: str) -> Callable:
    """The callable ``spec`` names, ``module:function``, imported as ``python -m tether`` would:
    the working directory is on the import path also under the ``tether`` script (which, unlike
    ``python -m``, does not put it there), so a module beside the user's data imports either way.

    Raises:
        ValueError: it cannot be imported or is not callable (``field_name`` and the fix named).
    """
    module, _, attr = spec.partition(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"{field_name}={shown(spec)}: cannot import it ({clipped(str(e))}); give module:function, "
            "with the module in the working directory or on PYTHONPATH"
        ) from None
    if not callable(fn):
        raise ValueError(f"{field_name}={shown(spec)} is a {type(fn).__name__}, not a callable")
    return fn
