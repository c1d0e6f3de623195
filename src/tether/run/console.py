"""The run's console voice: one process speaks, through tqdm's writer while a progress bar shows."""

from __future__ import annotations

import math
import numbers

from tqdm.auto import tqdm

from tether.core import distributed as D


def say(msg: str, progress: bool) -> None:
    """Print ``msg`` on the main process (one voice for all), above the bar when ``progress``."""
    if D.is_main():
        (tqdm.write if progress else print)(msg)


def number(value, spec: str = ".3f") -> str:
    """``value`` formatted by ``spec``, or ``n/a`` where there is no number to show: None (a NaN
    that JSON saved as null: a mean of no scored sample, a distinct-2 of responses under two
    words), NaN, or what is not a real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        return "n/a"
    return format(value, spec)
