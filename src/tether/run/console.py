"""The run's console voice: one process speaks, through tqdm's writer while a progress bar shows."""

from __future__ import annotations

from tqdm.auto import tqdm

from tether.core import distributed as D


def say(msg: str, progress: bool) -> None:
    """Print ``msg`` on the main process (one voice for all), above the bar when ``progress``."""
    if D.is_main():
        (tqdm.write if progress else print)(msg)
