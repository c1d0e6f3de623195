"""Multi-turn rollouts (tether.models.turns): the environment's tokens are context, not samples."""

from __future__ import annotations

import pytest
import torch

from tether.core.logprobs import logprobs_from_logits
from tether.models.sampling import generate
from tether.models.scoring import response_forward
from tether.models.turns import generate_turns, turn_seed

PROMPTS = ["the movie was", "a film with great acting", "the music", "it was"]
TOOL = " [tool: 42]"


def tool(prompt, completion, turn, **columns):
    """Answers the policy's first turn; ends the episode after the second."""
    return TOOL if turn == 0 else None


def turns(lm, tok, env, **settings):
    """generate_turns on :data:`PROMPTS`, seeds 0-3, with this file's usual settings (2 turns, 24
    tokens, temperature 1, stop string "e": in most of the tiny vocabulary's words, so every row
    stops within a few tokens) unless ``settings`` change them."""
    kw = dict(max_turns=2, max_new_tokens=24, temperature=1.0, seeds=list(range(4)), stop_strings=["e"])
    return generate_turns(lm, tok, PROMPTS, env, **{**kw, **settings})


def test_one_turn_without_stop_strings_is_generate(tiny_tokenizer, tiny_lm):
    kw = dict(max_new_tokens=6, temperature=1.0, seeds=list(range(4)))
    one = generate_turns(tiny_lm, tiny_tokenizer, PROMPTS, tool, max_turns=1, **kw)
    ref = generate(tiny_lm, tiny_tokenizer, PROMPTS, 6, 1.0, seeds=range(4))
    assert torch.equal(one.response_mask, ref.response_mask)
    assert torch.equal(one.response_ids[ref.response_mask], ref.response_ids[ref.response_mask])
    assert torch.equal(one.sampler_logprobs[ref.response_mask], ref.sampler_logprobs[ref.response_mask])
    assert not one.env_mask.any() and one.responses == ref.responses


def test_tool_turns_mask_the_environment_and_score_it_as_context(tiny_tokenizer, tiny_lm):
    """A stop string ends a policy turn, the tool's text is appended unmasked-as-context, the
    policy goes on: the tool's tokens are exactly env_mask, the sampler's log-probs equal the
    learner's on the policy's tokens, and the first turn is what plain generation samples."""
    ro = turns(tiny_lm, tiny_tokenizer, tool)  # stop string "e"
    assert not (ro.response_mask & ro.env_mask).any()
    tool_ids = tiny_tokenizer(TOOL, add_special_tokens=False)["input_ids"]
    with_tool = 0
    for b in range(4):
        env = ro.response_ids[b][ro.env_mask[b]].tolist()
        if env:
            with_tool += 1
            assert env == tool_ids[: len(env)]
            first = ro.env_mask[b].nonzero()[0, 0]
            assert ro.response_mask[b, :first].all()  # the first policy turn, then the tool
            assert "e" in tiny_tokenizer.decode(ro.response_ids[b, :first])
            assert TOOL in ro.responses[b] or len(env) < len(tool_ids)
    assert with_tool >= 3, "the test needs rows that called the tool"
    # the learner (one full forward over prompt, policy and tool tokens) against the sampler
    logits, _ = response_forward(tiny_lm, ro)
    learner = logprobs_from_logits(logits, ro.response_ids, 1.0)
    m = ro.response_mask
    assert (learner[m] - ro.sampler_logprobs[m]).abs().max() < 1e-4  # float32, cached vs full forward
    # turn 0 uses the row's own seed: its tokens are plain generation's, up to the stop
    plain = generate(tiny_lm, tiny_tokenizer, PROMPTS, 24, 1.0, seeds=range(4))
    for b in range(4):
        n = int(ro.env_mask[b].nonzero()[0, 0]) if ro.env_mask[b].any() else int(m[b].sum())
        assert torch.equal(ro.response_ids[b, :n], plain.response_ids[b, :n])


def test_the_token_budget_covers_policy_and_environment(tiny_tokenizer, tiny_lm):
    ro = turns(
        tiny_lm,
        tiny_tokenizer,
        lambda **kw: " [tool output that is long]" * 3,
        max_turns=5,
        max_new_tokens=10,
    )
    assert ro.response_ids.shape[1] <= 10
    assert ((ro.response_mask | ro.env_mask).sum(-1) <= 10).all()


def test_an_environment_must_return_text_or_none(tiny_tokenizer, tiny_lm):
    with pytest.raises(ValueError, match=r"rollout.env returned int for row \d after turn 0"):
        turns(tiny_lm, tiny_tokenizer, lambda **kw: 7)


def test_turn_seeds():
    assert turn_seed(123, 0) == 123  # a one-turn rollout samples what generate samples
    assert len({turn_seed(123, t) for t in range(5)}) == 5 and 0 <= turn_seed(123, 3) < 2**63


def test_an_environment_that_raises_or_exits_is_named(tiny_tokenizer, tiny_lm):
    import sys

    def boom(**kw):
        raise KeyError("missing")

    def quits(**kw):
        sys.exit(0)  # would end the run with status 0 and nothing written

    for env, kind in ((boom, "KeyError"), (quits, "SystemExit")):
        with pytest.raises(RuntimeError, match=rf"rollout.env raised {kind} on row \d after turn 0"):
            turns(tiny_lm, tiny_tokenizer, env)


def test_special_tokens_in_a_tools_text_are_refused(tiny_tokenizer, tiny_lm):
    # '<eos>' in the text would tokenize to the real end id inside the context
    with pytest.raises(ValueError, match=r"special tokens \['<eos>'\].*strip or escape them"):
        turns(tiny_lm, tiny_tokenizer, lambda **kw: " movie<eos> was")


def test_the_policys_own_text_leaves_the_tools_out(tiny_tokenizer, tiny_lm):
    ro = turns(tiny_lm, tiny_tokenizer, tool)
    for b in range(4):
        ids = ro.response_ids[b][ro.response_mask[b]].tolist()
        own = tiny_tokenizer.decode(
            [t for t in ids if t != tiny_tokenizer.eos_token_id], skip_special_tokens=True
        )
        assert ro.own_texts[b] == own and "[tool" not in own


def test_an_environment_beside_the_data_imports_under_the_tether_script(tmp_path, monkeypatch):
    """The `tether` script does not put the working directory on sys.path (python -m does)."""
    import sys

    from tether.models.turns import load_env

    (tmp_path / "my_tools_mod.py").write_text("def tool(**kw):\n    return ' ok'\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert load_env("my_tools_mod:tool")() == " ok"
    with pytest.raises(ValueError, match=r"rollout.env='my_tools_mod:nope': cannot import it .*PYTHONPATH"):
        load_env("my_tools_mod:nope")
