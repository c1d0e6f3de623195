"""The run's sampler (tether.models.rollouts): one kind chosen once, the same samples as the
functions it calls, the compile decision it holds."""

from __future__ import annotations

import typing

import pytest
import torch

from tether.data.prompts import PromptData
from tether.models import rollouts
from tether.models.rollouts import (
    SAMPLERS,
    CompileChoice,
    OneTurn,
    RolloutKind,
    SamplingSettings,
    ToolTurns,
    make_sampler,
    register,
)
from tether.models.sampling import generate, sample_seeds
from tether.models.turns import generate_turns

PROMPTS = ["the movie was", "a film with great acting", "the music", "it was"]


def tool(prompt, completion, turn, **columns):
    return " [tool: 42]" if turn == 0 else None


def test_each_kind_of_the_literal_is_registered_once():
    assert sorted(SAMPLERS) == sorted(typing.get_args(RolloutKind))
    assert SAMPLERS["one_turn"] is OneTurn and SAMPLERS["tool_turns"] is ToolTurns
    with pytest.raises(ValueError, match="'one_turn' is registered already"):
        register("one_turn")(OneTurn)


def test_the_kind_is_chosen_once_by_the_environment(tiny_tokenizer):
    settings = SamplingSettings(max_new_tokens=4, temperature=1.0)
    assert isinstance(make_sampler(tiny_tokenizer, settings), OneTurn)
    assert isinstance(make_sampler(tiny_tokenizer, settings, tool), ToolTurns)
    with pytest.raises(ValueError, match="tool turns need an environment"):
        ToolTurns(tiny_tokenizer, settings)


def test_one_turn_samples_what_generate_samples(tiny_tokenizer, tiny_lm):
    """The sampler is generate with the run's settings; the seeds and the columns travel in the
    rollout (the compile check samples the same rows again from them)."""
    settings = SamplingSettings(max_new_tokens=6, temperature=0.9, max_prompt_tokens=32)
    sampler = OneTurn(tiny_tokenizer, settings)
    seeds = sample_seeds(3, 1, range(4))
    data = PromptData(PROMPTS, {"answer": [1, 2, 3, 4]})
    ro = sampler.sample(tiny_lm, data, seeds)
    ref = generate(tiny_lm, tiny_tokenizer, PROMPTS, 6, 0.9, max_prompt_tokens=32, seeds=seeds)
    assert torch.equal(ro.response_ids, ref.response_ids) and ro.responses == ref.responses
    assert torch.equal(ro.sampler_logprobs, ref.sampler_logprobs)
    assert ro.seeds == seeds and ro.columns == {"answer": [1, 2, 3, 4]} and not ro.compiled
    assert ro.select(torch.tensor([2, 0])).seeds == [seeds[2], seeds[0]]
    assert sampler.sample(tiny_lm, PROMPTS, seeds).columns is None  # a plain list has no columns


def test_tool_turns_sample_what_generate_turns_samples(tiny_tokenizer, tiny_lm):
    settings = SamplingSettings(
        max_new_tokens=24, temperature=1.0, stop_strings=("e",), max_turns=2, env_timeout=5.0
    )
    sampler = ToolTurns(tiny_tokenizer, settings, tool)
    seeds = list(range(4))
    ro = sampler.sample(tiny_lm, PromptData(PROMPTS, {"answer": [1, 2, 3, 4]}), seeds)
    ref = generate_turns(
        tiny_lm,
        tiny_tokenizer,
        PROMPTS,
        tool,
        settings=SamplingSettings(max_new_tokens=24, temperature=1.0, stop_strings=("e",), max_turns=2),
        seeds=seeds,
    )
    assert torch.equal(ro.response_ids, ref.response_ids) and torch.equal(ro.env_mask, ref.env_mask)
    assert ro.responses == ref.responses and ro.env_texts == ref.env_texts
    assert ro.seeds == seeds and ro.columns == {"answer": [1, 2, 3, 4]}
    with pytest.raises(ValueError, match="a seed per row"):
        sampler.sample(tiny_lm, PROMPTS, None)


def test_the_compile_choice_is_taken_at_set_up_and_decided_once(monkeypatch):
    """rollout.compile resolved when the sampler is built (true refused where it cannot compile,
    auto pending only on a CPU that can), decided after the first training rollout."""
    monkeypatch.setattr(rollouts, "can_compile", lambda device: "no C++ compiler")
    with pytest.raises(ValueError, match="rollout.compile=true: no C\\+\\+ compiler; install one"):
        CompileChoice(True, torch.device("cpu"))
    assert not CompileChoice("auto", torch.device("cpu")).pending
    assert not CompileChoice(False, torch.device("cpu")).pending
    monkeypatch.setattr(rollouts, "can_compile", lambda device: None)
    assert CompileChoice(True, torch.device("cpu")).pending
    assert CompileChoice("auto", torch.device("cpu")).pending
    assert not CompileChoice("auto", torch.device("meta")).pending  # auto's numbers are a CPU's


def test_auto_says_its_verdict_and_stays_eager_when_compiling_does_not_repay(
    monkeypatch, tiny_tokenizer, tiny_lm
):
    monkeypatch.setattr(rollouts, "can_compile", lambda device: None)
    choice = CompileChoice("auto", torch.device("cpu"))
    ro = generate(tiny_lm, tiny_tokenizer, PROMPTS, 4, 1.0, seeds=range(4))
    again = []
    lines = list(choice.decide(ro, step=0, steps=3, generate_s=0.5, again=lambda: again.append(1)))
    assert lines == [
        "tether: rollout.compile=auto: eager decoding (2 step(s) left x 0.50 s generate x 9% saved at "
        "4 rows = 0 s, against ~40 s of compiling)"
    ]
    assert not again and not choice.pending and not choice.compiled


def test_a_compiled_decode_that_differs_is_refused(monkeypatch, tiny_tokenizer, tiny_lm):
    """true stops naming why; auto stays eager and says so."""
    monkeypatch.setattr(rollouts, "can_compile", lambda device: None)
    ro = generate(tiny_lm, tiny_tokenizer, PROMPTS, 4, 1.0, seeds=range(4))
    off = generate(tiny_lm, tiny_tokenizer, PROMPTS, 4, 1.0, seeds=range(4))
    off.sampler_logprobs = torch.full_like(off.sampler_logprobs, float("nan"))
    with pytest.raises(RuntimeError, match="step 0's rollout does not reproduce the eager one"):
        list(
            CompileChoice(True, torch.device("cpu")).decide(
                ro, step=0, steps=3, generate_s=1.0, again=lambda: off
            )
        )
    monkeypatch.setattr(rollouts, "compile_repays", lambda *a: True)
    auto = CompileChoice("auto", torch.device("cpu"))
    lines = list(auto.decide(ro, step=0, steps=3, generate_s=1.0, again=lambda: off))
    assert "compiling the decode step" in lines[0] and "eager decoding after all" in lines[1]
    assert not auto.compiled
    same = CompileChoice(True, torch.device("cpu"))
    assert list(same.decide(ro, step=0, steps=3, generate_s=1.0, again=lambda: ro)) == []
    assert same.compiled
