"""Ctrl-C while user code runs (issue 50's fault campaign): the first is said at once, the second
ends the wait."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tether.models.sampling import SamplingSettings
from tether.models.turns import EnvFailed, generate_turns
from tether.run.signals import install_signal_handlers


def tool_turns(lm, tok, prompts, env, *, seeds, columns=None, **settings):
    """:func:`generate_turns` with its sampling settings by keyword (:class:`SamplingSettings`' fields)."""
    return generate_turns(
        lm, tok, prompts, env, settings=SamplingSettings(**settings), seeds=seeds, columns=columns
    )


def _rollout(lm, tok, env):
    return tool_turns(
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


def alarm_env(prompt, completion, turn, **columns):
    """An environment with a timeout of its own: signal.alarm, which needs the main thread."""

    def expired(*args):
        raise TimeoutError("the tool took too long")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(5)
    try:
        return " [tool: 42]" if turn == 0 else None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_an_environment_with_a_signal_alarm_runs_without_a_deadline(tiny_tokenizer, tiny_lm):
    """Since every call of rollout.env ran on a worker thread, an environment timing itself with
    signal.alarm always failed ("signal only works in main thread"), even with
    rollout.env_timeout=null. With no deadline it runs on the calling thread again, as before."""
    ro = tool_turns(
        tiny_lm, tiny_tokenizer, ["the movie was", "a film that"], alarm_env, max_turns=2, max_new_tokens=24,
        temperature=1.0, seeds=[0, 1], stop_strings=["e"], env_timeout=None,
    )  # fmt: skip
    assert any(ro.env_texts), ro.env_texts


def test_an_environment_with_a_signal_alarm_under_a_deadline_is_told_the_fix(tiny_tokenizer, tiny_lm):
    """Under rollout.env_timeout it runs on a worker thread, where Python refuses a signal
    handler: the error says why and names both fixes, not the bare ValueError."""
    with pytest.raises(EnvFailed) as e:
        _rollout(tiny_lm, tiny_tokenizer, alarm_env)
    said = str(e.value)
    assert said.startswith("rollout.env raised ValueError on row 0 after turn 0") and "main thread" in said
    assert (
        "tether calls it on a worker thread to hold it to rollout.env_timeout=30 s: drop its own timeout "
        "(tether enforces rollout.env_timeout itself), or set rollout.env_timeout=null to call it on the "
        "main thread, with no deadline"
    ) in said, said


def test_ctrl_c_while_an_environment_without_a_deadline_runs(tiny_tokenizer, tiny_lm, capsys):
    """On the calling thread (rollout.env_timeout=null) the first Ctrl-C is said at once, naming
    the call, and the call goes on; a second ends it: an EnvFailed marked interrupted, which the
    training loop turns into the checkpoint of the step before and exit status 130."""
    stop, previous = install_signal_handlers()
    heard = []

    def env(prompt, completion, turn, **columns):
        if turn == 0 and not heard:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)  # the handler runs in this wait
            heard.append(bool(stop))
        return " [tool: 42]" if turn == 0 else None

    def hangs(prompt, completion, turn, **columns):
        os.kill(os.getpid(), signal.SIGINT)  # the second: stop now
        threading.Event().wait(600)

    settings = dict(
        max_turns=2, max_new_tokens=24, temperature=1.0, seeds=[0, 1], stop_strings=["e"], env_timeout=None
    )
    t0 = time.monotonic()
    try:
        ro = tool_turns(tiny_lm, tiny_tokenizer, ["the movie was", "a film that"], env, **settings)
        said = capsys.readouterr().err
        with pytest.raises(
            EnvFailed, match=r"stopped while waiting for rollout.env \(row 0 after turn 0\)"
        ) as e:
            tool_turns(tiny_lm, tiny_tokenizer, ["the movie was", "a film that"], hangs, **settings)
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
    assert heard == [True] and any(ro.env_texts)
    assert (
        "tether: SIGINT: stopping after the step in progress, with a checkpoint; waiting for rollout.env "
        "(row 0 after turn 0): 0 s so far, no limit. SIGINT again stops without waiting"
    ) in said, said
    assert e.value.interrupted and time.monotonic() - t0 < 15
