"""Python callables named in a config as ``module:function`` (a reward, an environment), and
how tether waits for one: :func:`call_with_deadline` runs it on a thread of its own, so that a
deadline can end the wait and Ctrl-C is heard while it runs (:data:`RUNNING` says what runs)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable

import torch

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


RUNNING: list[tuple[str, float, str]] = []
"""The user code tether waits for now, innermost last: (what, its start on ``time.monotonic()``,
its limit in words), for the line Ctrl-C prints (:func:`waiting_for`)."""


def waiting_for() -> str | None:
    """What tether waits for now, e.g. ``rollout.env (row 1 after turn 0): 12 s so far, at most
    rollout.env_timeout=60 s``; None when no user code runs under :func:`call_with_deadline` or
    :func:`running`."""
    if not RUNNING:
        return None
    what, start, limit = RUNNING[-1]
    return f"{what}: {time.monotonic() - start:.0f} s so far, {limit}"


@contextlib.contextmanager
def running(what: str):
    """Mark user code that runs in this thread (a reward) for :func:`waiting_for`, with no limit."""
    RUNNING.append((what, time.monotonic(), "no limit"))
    try:
        yield
    finally:
        RUNNING.pop()


class SignalStop(KeyboardInterrupt):
    """What tether's handler raises on a second Ctrl-C or SIGTERM
    (:func:`tether.run.signals.install_signal_handlers`): a ``KeyboardInterrupt``, told apart from
    one a user's code raises itself when it ends a call that runs on this thread."""


class Abandoned(Exception):
    """tether stopped waiting for a user's call (:func:`call_with_deadline`): its deadline passed
    (``interrupted`` False) or a signal came while it ran (a second Ctrl-C: ``interrupted`` True).
    The call is left to finish on its thread, whose result nothing reads."""

    def __init__(self, message: str, interrupted: bool):
        super().__init__(message)
        self.interrupted = interrupted


class _Call:
    """One call handed to a worker thread, with what came of it."""

    def __init__(self, fn: Callable[[], object], timeout: float | None):
        self.fn, self.timeout = fn, timeout
        self.grad = torch.is_grad_enabled()  # thread-local: the caller's, as a call in place would have
        self.done = threading.Event()
        self.value: object = None
        self.error: BaseException | None = None
        self.expired = False  # an awaitable's deadline passed (cancelled on the worker's loop)

    def run(self) -> None:
        try:
            with torch.set_grad_enabled(self.grad):
                value = self.fn()
                if inspect.isawaitable(value):  # an async def: awaited on this thread's own loop
                    value = asyncio.run(self._until(value))
            self.value = value
        except BaseException as e:  # SystemExit, KeyboardInterrupt too: handed to the caller
            self.error = e
        finally:
            self.done.set()

    async def _until(self, awaitable):
        task = asyncio.ensure_future(awaitable)
        finished, _ = await asyncio.wait({task}, timeout=self.timeout)
        if not finished:  # cancelled, so its finally blocks run and its sockets close
            self.expired = True
            task.cancel()
            return None
        return task.result()


class _Worker:
    """A daemon thread that runs :class:`_Call` objects one at a time: the same thread for every
    call of a caller's thread (a resource the user's code opens on its first call serves the
    next), a new one once a call is abandoned. Daemon: an abandoned call never holds the process."""

    def __init__(self):
        self.calls: list[_Call | None] = []
        self.ready = threading.Condition()
        self.thread = threading.Thread(target=self._serve, name="tether user code", daemon=True)
        self.thread.start()

    def submit(self, call: _Call | None) -> None:
        with self.ready:
            self.calls.append(call)
            self.ready.notify()

    def _serve(self) -> None:
        while True:
            with self.ready:
                while not self.calls:
                    self.ready.wait()
                call = self.calls.pop(0)
            if call is None:  # abandoned: end once the call it ran returns
                return
            call.run()


_workers = threading.local()

POLL_S = 0.1
"""How often, in seconds, :func:`call_with_deadline`'s wait wakes: Python runs a signal's handler
in the main thread, and a signal the kernel hands another thread (the worker, a torch or
tokenizers thread) only sets a flag there, read when the main thread next runs, not when it
sleeps in a lock; so Ctrl-C is heard within this, wherever it lands."""


def call_with_deadline(fn: Callable[[], object], *, timeout: float | None, what: str, limit_name: str = ""):
    """``fn()`` run on a worker thread (:class:`_Worker`) while this thread waits, at most
    ``timeout`` seconds (None: no limit); a result that is awaitable (an ``async def``) is awaited
    there on an event loop of its own, and cancelled at the deadline. The wait hears signals: a
    handler that returns (the first Ctrl-C) lets it go on, one that raises ends it (within
    :data:`POLL_S`).

    The call runs with this thread's grad mode (torch's is per thread). ``what`` names it in
    :func:`waiting_for` and in the errors, ``limit_name`` the setting ``timeout`` comes from.

    Returns:
        What ``fn`` returned (awaited).

    Raises:
        Abandoned: the deadline passed, or a signal handler raised ``KeyboardInterrupt`` during the
            wait; the call is left running on its thread (a daemon: it does not keep the process
            alive).
        BaseException: whatever ``fn`` raised, as it raised it (``SystemExit`` and
            ``KeyboardInterrupt`` included).
    """
    worker = getattr(_workers, "worker", None)
    if worker is None:
        worker = _workers.worker = _Worker()
    call = _Call(fn, timeout)
    limit = (
        "no limit" if timeout is None else f"at most {f'{limit_name}=' if limit_name else ''}{timeout:g} s"
    )
    start = time.monotonic()
    RUNNING.append((what, start, limit))
    try:
        worker.submit(call)
        finished = False
        while not finished and (timeout is None or time.monotonic() - start < timeout):
            left = POLL_S if timeout is None else min(POLL_S, timeout - (time.monotonic() - start))
            finished = call.done.wait(max(left, 0.0))
    except KeyboardInterrupt:
        _workers.worker = None
        worker.submit(None)
        raise Abandoned(
            f"stopped waiting for {what} (a signal: Ctrl-C or SIGTERM)", interrupted=True
        ) from None
    finally:
        RUNNING.pop()
    if not finished or call.expired:
        if not finished:
            _workers.worker = None
            worker.submit(None)
        raise Abandoned(f"{what} did not return within {timeout:g} s", interrupted=False)
    if call.error is not None:
        raise call.error
    return call.value


def awaited(reply):
    """A user's function's result, awaited when it is a coroutine (an ``async def`` callback
    hook; an environment's is awaited by :func:`call_env`): run to its end on an event loop of its
    own, in a worker thread when this thread already runs one (a notebook), so that it never meets
    the caller's loop."""
    if not inspect.isawaitable(reply):
        return reply

    async def wait():
        return await reply

    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop here: the usual script
        return asyncio.run(wait())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, wait()).result()
