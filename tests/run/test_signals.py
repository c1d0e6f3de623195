"""Ctrl-C while user code runs (issue 50's fault campaign): the first is said at once, the second
ends the wait."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tether.models.turns import EnvFailed, generate_turns
from tether.run.signals import install_signal_handlers


def _rollout(lm, tok, env):
    return generate_turns(
        lm, tok, ["the movie was", "a film that"], env, max_turns=2, max_new_tokens=24, temperature=1.0,
        seeds=[0, 1], stop_strings=["e"], env_timeout=30.0,
    )  # fmt: skip


def test_the_first_ctrl_c_is_said_at_once_while_the_environment_runs(tiny_tokenizer, tiny_lm, capsys):
    """The first Ctrl-C said nothing while an environment ran (the run seemed deaf until the step
    ended, if it ever did). Now the line comes while the call runs: tether stops after the step,
    with a checkpoint, and waits for rollout.env (the row, its deadline)."""
    stop, previous = install_signal_handlers()
    heard = []

    def env(prompt, completion, turn, **columns):
        if turn == 0 and not heard:
            os.kill(os.getpid(), signal.SIGINT)
            deadline = time.monotonic() + 20
            while not stop and time.monotonic() < deadline:  # still running: the line comes now
                time.sleep(0.01)
            heard.append(bool(stop))
        return " [tool: 42]" if turn == 0 else None

    try:
        ro = _rollout(tiny_lm, tiny_tokenizer, env)
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
    said = capsys.readouterr().err
    assert heard == [True] and stop == ["SIGINT"]
    assert (
        "tether: SIGINT: stopping after the step in progress, with a checkpoint; waiting for rollout.env "
        "(row 0 after turn 0): 0 s so far, at most rollout.env_timeout=30 s. SIGINT again stops without "
        "waiting (the checkpoint is then of the step before)"
    ) in said, said
    assert any(ro.env_texts), "the rollout went on after the first Ctrl-C"


def test_a_second_ctrl_c_ends_the_wait_for_the_environment(tiny_tokenizer, tiny_lm):
    """The second Ctrl-C raised a KeyboardInterrupt inside the environment, and the run ended in
    a traceback with nothing kept. Now it ends the wait: an EnvFailed marked interrupted, which the
    training loop turns into the checkpoint of the step before and exit status 130."""
    stop, previous = install_signal_handlers()
    stop.append("SIGINT")  # the first came already
    release = threading.Event()

    def env(prompt, completion, turn, **columns):
        os.kill(os.getpid(), signal.SIGINT)
        release.wait(600)  # blocks: only the signal ends the wait

    t0 = time.monotonic()
    try:
        with pytest.raises(
            EnvFailed, match=r"stopped while waiting for rollout.env \(row 0 after turn 0\)"
        ) as e:
            _rollout(tiny_lm, tiny_tokenizer, env)
    finally:
        release.set()
        for sig, h in previous.items():
            signal.signal(sig, h)
    # the signal ended the wait, not the 30 s deadline, wherever the kernel delivered it (the wait
    # wakes every POLL_S so that the main thread runs the handler)
    assert e.value.interrupted and time.monotonic() - t0 < 15


def test_ctrl_c_during_the_reward_names_it(capsys):
    """A reward runs in the main thread, which hears the signal when the reward's sleep (or
    socket wait) is interrupted: the line names it as what tether waits for."""
    from tether.models.callables import running

    stop, previous = install_signal_handlers()
    try:
        with running("the reward (reward.scorer)"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # a reward that blocks: the handler runs in it
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
    said = capsys.readouterr().err
    assert stop == ["SIGINT"] and "waiting for the reward (reward.scorer): 0 s so far, no limit" in said, said
