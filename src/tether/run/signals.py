"""Ctrl-C and SIGTERM: finish the step, write a checkpoint, then stop."""

from __future__ import annotations

import signal


class Interrupted(Exception):
    """Raised after Ctrl-C / SIGTERM once the checkpoint is written."""


def install_signal_handlers() -> tuple[list[str], dict]:
    """On SIGINT / SIGTERM, finish the current step, checkpoint, and stop (the list gets the name).

    Returns the stop list and the previous handlers, which ``train`` restores when it returns.
    """
    stop: list[str] = []
    previous: dict = {}

    def handler(signum, frame):
        if stop:  # a second signal: stop now
            raise KeyboardInterrupt
        stop.append(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread
            pass
    return stop, previous
