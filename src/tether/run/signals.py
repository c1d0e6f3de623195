"""Ctrl-C and SIGTERM: finish the step, write a checkpoint, then stop; said at once."""

from __future__ import annotations

import os
import signal
import sys

from tether.core import distributed as D
from tether.models.callables import SignalStop, waiting_for


class Interrupted(Exception):
    """Raised after Ctrl-C / SIGTERM once the checkpoint is written."""


def stopping_line(name: str) -> str:
    """What the first signal ``name`` (``SIGINT``) makes tether say at once: that it stops after
    the step in progress, with a checkpoint, what it waits for (the user code running now, its
    deadline: :func:`tether.models.callables.waiting_for`), and what a second signal does."""
    waiting = waiting_for()
    return (
        f"tether: {name}: stopping after the step in progress, with a checkpoint"
        + (f"; waiting for {waiting}" if waiting else "")
        + f". {name} again stops without waiting"
        + (" (the checkpoint is then of the step before)" if waiting else "")
    )


def install_signal_handlers() -> tuple[list[str], dict]:
    """On SIGINT / SIGTERM, finish the current step, checkpoint, and stop (the list gets the name);
    the first signal is said at once (:func:`stopping_line`, on stderr, by the process that
    speaks), even while user code runs: an environment's call with a deadline runs on a thread of
    its own (:func:`tether.models.callables.call_with_deadline`), so this thread hears it, and one
    without runs on this thread, which runs the handler between its bytecodes and in its waits. A
    second signal raises :class:`tether.models.callables.SignalStop` (a ``KeyboardInterrupt``).

    Returns the stop list and the previous handlers, which ``train`` restores when it returns.
    """
    stop: list[str] = []
    previous: dict = {}

    def handler(signum, frame):
        if stop:  # a second signal: stop now
            raise SignalStop
        name = signal.Signals(signum).name
        stop.append(name)
        if D.is_main():
            line = "\n" + stopping_line(name) + "\n"
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (RuntimeError, OSError, ValueError):  # this thread was writing to it: not reentrant
                os.write(2, line.encode())

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread
            pass
    return stop, previous
