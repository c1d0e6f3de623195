"""The host generators a reward or an environment may draw from: seeded, checkpointed through a
weights-only load, and forked around an evaluation (tether.run.rngs)."""

from __future__ import annotations

import io
import random

import numpy as np
import torch

from tether.run import rngs
from tether.run.rngs import forked_rngs, rng_state, seed_everything, set_rng_state


def draws() -> tuple:
    """One draw from each generator a user's code may use."""
    return random.random(), float(np.random.random()), float(np.random.normal()), float(torch.rand(()))


def test_seed_everything_seeds_numpy_as_well():
    seed_everything(7)
    a = draws()
    seed_everything(7)
    assert draws() == a
    seed_everything(8)
    assert draws() != a
    seed_everything(2**40 + 7)  # beyond NumPy's 32-bit seeds: taken mod 2**32, not refused
    draws()


def test_a_saved_state_comes_back_through_a_weights_only_load():
    seed_everything(3)
    np.random.normal()  # a cached Gaussian is part of NumPy's state
    buf = io.BytesIO()
    torch.save({"rng": rng_state()}, buf)
    want = draws()
    buf.seek(0)
    set_rng_state(torch.load(buf, weights_only=True)["rng"])  # nothing but tensors and numbers
    assert draws() == want


def test_a_state_without_numpys_leaves_numpy_alone():
    # a checkpoint of an earlier tether recorded torch's and Python's states only
    seed_everything(0)
    old = {k: v for k, v in rng_state().items() if k != "numpy"}
    np.random.seed(123)
    expected = np.random.random()
    np.random.seed(123)
    set_rng_state(old)
    assert np.random.random() == expected


def test_forked_generators_start_from_the_seed_and_leave_the_stream_alone():
    seed_everything(1)
    undisturbed = [draws() for _ in range(2)]
    seed_everything(1)
    first = draws()
    with forked_rngs(99):
        inside = [draws() for _ in range(5)]
    assert [first, draws()] == undisturbed  # the evaluation drew 5 times; training never sees it
    with forked_rngs(99):
        assert [draws() for _ in range(5)] == inside  # each pass with one seed: the same draws
    seed_everything(1)
    draws()
    try:
        with forked_rngs(99):
            draws()
            raise KeyError("a scorer failed")
    except KeyError:
        pass
    assert draws() == undisturbed[1]  # put back when the evaluation raised, too


def test_each_process_draws_its_own_host_numbers_and_resumes_them(monkeypatch):
    """Rank 0 seeds Python and NumPy with train.seed itself (a one-process run draws as rank 0),
    another rank with a hash of it and the rank; torch's seed is the same on every rank. A
    checkpoint keeps every rank's state and each rank takes its own back; on another number of
    processes a rank other than 0 is seeded afresh, never with rank 0's stream."""
    world = {"rank": 0, "size": 2}
    monkeypatch.setattr(rngs.D, "rank", lambda: world["rank"])
    monkeypatch.setattr(rngs.D, "world_size", lambda: world["size"])
    streams = {}
    for r in (0, 1):
        seed_everything(5, rank=r)
        streams[r] = draws()
    seed_everything(5, rank=0)
    assert streams[0] == draws()  # rank 0 is the one-process run
    assert streams[0][:3] != streams[1][:3] and streams[0][3] == streams[1][3]  # torch's alike
    # a checkpoint: rank 0's full state and each rank's host state (gathered here by hand)
    states = {}
    for r in (0, 1):
        seed_everything(5, rank=r)
        draws()
        states[r] = rngs.host_state()
    state = {**rng_state(), "ranks": [states[0], states[1]]}
    for r in (0, 1):
        seed_everything(5, rank=r)
        draws()
        want = draws()
        world["rank"] = r
        seed_everything(99, rank=0)  # whatever the process holds before the resume
        rngs.restore_rng_state(state, seed=5, step=0)
        assert draws()[:3] == want[:3]
    world["size"] = 3  # resumed on three processes: rank 1's stream is new, not rank 0's
    world["rank"] = 1
    rngs.restore_rng_state(state, seed=5, step=0)
    fresh = draws()
    world["rank"] = 0
    rngs.restore_rng_state(state, seed=5, step=0)
    assert draws()[:3] != fresh[:3]
