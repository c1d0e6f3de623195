"""Multi-turn rollouts (tether.models.turns): the environment's tokens are context, not samples."""

from __future__ import annotations

import pytest
import torch

from tether.core.logprobs import logprobs_from_logits
from tether.models.sampling import SamplingSettings, generate
from tether.models.scoring import response_forward
from tether.models.turns import generate_turns, turn_seed

PROMPTS = ["the movie was", "a film with great acting", "the music", "it was"]
TOOL = " [tool: 42]"


def tool_turns(lm, tok, prompts, env, *, seeds, columns=None, **settings):
    """:func:`generate_turns` with its sampling settings by keyword (:class:`SamplingSettings`' fields)."""
    return generate_turns(
        lm, tok, prompts, env, settings=SamplingSettings(**settings), seeds=seeds, columns=columns
    )


def tool(prompt, completion, turn, **columns):
    """Answers the policy's first turn; ends the episode after the second."""
    return TOOL if turn == 0 else None


def turns(lm, tok, env, **settings):
    """generate_turns on :data:`PROMPTS`, seeds 0-3, with this file's usual settings (2 turns, 24
    tokens, temperature 1, stop string "e": in most of the tiny vocabulary's words, so every row
    stops within a few tokens) unless ``settings`` change them."""
    kw = dict(max_turns=2, max_new_tokens=24, temperature=1.0, seeds=list(range(4)), stop_strings=["e"])
    return tool_turns(lm, tok, PROMPTS, env, **{**kw, **settings})


def test_one_turn_without_stop_strings_is_generate(tiny_tokenizer, tiny_lm):
    kw = dict(max_new_tokens=6, temperature=1.0, seeds=list(range(4)))
    one = tool_turns(tiny_lm, tiny_tokenizer, PROMPTS, tool, max_turns=1, **kw)
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


def test_an_episode_the_environment_ends_is_ended_and_one_cut_at_max_turns_is_not(tiny_tokenizer, tiny_lm):
    """``ended`` feeds response/eos_fraction (TRL's 1 - clipped_ratio): an environment's None ends
    the episode on its own, while the last allowed turn stopping to call the tool is a cut. The
    old code counted both as cut. Stop string "e" with a 24-token budget: most rows' first turn
    stops at it before the budget (asserted); a row cut at the budget stays not ended."""
    kw = dict(max_turns=1, max_new_tokens=24, temperature=1.0, seeds=list(range(4)), stop_strings=["e"])
    cut = tool_turns(tiny_lm, tiny_tokenizer, PROMPTS, lambda **k: None, **kw)
    end_id = tiny_tokenizer.eos_token_id
    lengths = cut.response_mask.sum(-1).tolist()
    own = [cut.response_ids[b][cut.response_mask[b]].tolist() for b in range(4)]
    stopped = [b for b in range(4) if lengths[b] < 24 and end_id not in own[b]]
    budget = [b for b in range(4) if lengths[b] == 24 and end_id not in own[b]]
    assert len(stopped) >= 2, "the test needs turns ended by the stop string"
    assert not cut.ended[stopped + budget].any()  # max_turns=1: stopped to call the tool, cut
    over = tool_turns(tiny_lm, tiny_tokenizer, PROMPTS, lambda **k: None, **{**kw, "max_turns": 2})
    assert torch.equal(over.response_ids, cut.response_ids)  # the same turn; then the env's None
    assert over.ended[stopped].all() and not over.ended[budget].any()


def test_an_environment_must_return_text_or_none(tiny_tokenizer, tiny_lm):
    with pytest.raises(ValueError, match=r"rollout.env returned int for row \d after turn 0"):
        turns(tiny_lm, tiny_tokenizer, lambda **kw: 7)


def test_a_reply_that_cannot_be_tokenized_is_the_environments_failure(tiny_tokenizer, tiny_lm):
    """A reply holding a lone surrogate (" \\ud800") ended the run in the tokenizer's raw
    TypeError ("TextEncodeInput must be Union[...]"), a traceback, and the step before was not
    kept. Now it is the environment's failure (EnvReplyError, an EnvFailed: the loop keeps the step
    before), naming the row, the turn and the character; so is any reply the tokenizer refuses."""
    from tether.models.turns import EnvFailed, EnvReplyError

    with pytest.raises(EnvReplyError) as e:
        turns(tiny_lm, tiny_tokenizer, lambda **kw: " \ud800")
    assert isinstance(e.value, EnvFailed)
    assert str(e.value).startswith(
        "rollout.env returned text that is not valid Unicode for row 0 after turn 0: '\\ud800' at character 1"
    ), e.value

    class Refusing:  # a tokenizer that refuses a text (as the fast tokenizer refuses a surrogate)
        def __init__(self, tok):
            self.tok = tok

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def __call__(self, text, **kw):
            if isinstance(text, str) and "refused" in text:
                raise TypeError(
                    "TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]"
                )
            return self.tok(text, **kw)

    with pytest.raises(
        EnvReplyError, match=r"rollout.env's reply for row 0 after turn 0 cannot be tokenized \(TypeError"
    ):
        turns(tiny_lm, Refusing(tiny_tokenizer), lambda **kw: " refused")


def test_a_chat_reply_that_is_not_valid_unicode_is_refused():
    from tests.conftest import make_chat_tokenizer
    from tether.models.turns import EnvReplyError

    tok = make_chat_tokenizer()
    with pytest.raises(EnvReplyError, match=r"not valid Unicode for row \d after turn 0"):
        tool_turns(
            chat_lm(tok, end_boost=1.0), tok, CONVERSATIONS, lambda **kw: "4\udc802", max_turns=2,
            max_new_tokens=40, temperature=1.0, seeds=list(range(4)),
        )  # fmt: skip


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


# ---- the chat format: the tool's reply through the chat template -----------------------------
CONVERSATIONS = [[{"role": "user", "content": p}] for p in PROMPTS]


def chat_lm(tok, end_boost: float):
    """A tiny Llama on the ChatML tokenizer whose ``<|im_end|>`` (an end id) is favoured: every
    token's embedding gets +3 on one coordinate, ``<|im_end|>``'s ``end_boost`` more, so through
    the tied output layer its logit leads by about that much times the normed state's positive
    coordinate (1.0: turns of 0-2 tokens on these prompts)."""
    from tests.conftest import make_tiny_llama

    end = tok.convert_tokens_to_ids("<|im_end|>")
    lm = make_tiny_llama(len(tok), eos_token_id=[tok.eos_token_id, end], pad_token_id=tok.pad_token_id)
    lm.generation_config.eos_token_id = [tok.eos_token_id, end]
    with torch.no_grad():
        emb = lm.model.embed_tokens.weight
        emb[:, 5] += 3.0
        emb[end, 5] += end_boost
    return lm


def recording_env(calls: list):
    def env(prompt, completion, turn, **columns):
        calls.append((prompt, [dict(m) for m in completion], turn))
        return "42" if turn == 0 else None

    return env


def context_text(tok, ro, b: int) -> str:
    """Prompt and response of row b as the model saw them: the token ids decoded, specials kept."""
    prompt = ro.prompt_ids[b][ro.prompt_mask[b].bool()].tolist()
    n = int((ro.response_mask[b] | ro.env_mask[b]).nonzero().max()) + 1
    return tok.decode(prompt + ro.response_ids[b, :n].tolist(), skip_special_tokens=False)


def test_chat_turns_put_the_tools_reply_in_the_template():
    """Turns that end at the end-of-turn id: the tool's reply becomes a tool message, its tokens
    the template's framing (the policy's own <|im_end|> not repeated), the environment and the
    reward see messages, and the whole context is the template's rendering of them."""
    from tests.conftest import make_chat_tokenizer
    from tether.models.turns import chat_reply_text

    tok = make_chat_tokenizer()
    lm = chat_lm(tok, end_boost=1.0)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    calls: list = []
    ro = tool_turns(
        lm, tok, CONVERSATIONS, recording_env(calls), max_turns=3, max_new_tokens=40, temperature=1.0,
        seeds=list(range(4)),
    )  # fmt: skip
    assert ro.messages is not None
    for b in range(4):
        msgs = ro.messages[b]
        assert [m["role"] for m in msgs] == ["assistant", "tool", "assistant"], msgs
        assert msgs[1]["content"] == "42" and ro.env_texts[b] == ["42"]
        assert ro.responses[b] == "\n".join(m["content"] for m in msgs)  # one per line
        # the context is the template's rendering: prompt, first turn, tool message, next turn
        rendered = tok.apply_chat_template(
            CONVERSATIONS[b] + msgs[:2], tokenize=False, add_generation_prompt=True
        )
        assert context_text(tok, ro, b) == rendered + msgs[2]["content"] + "<|im_end|>" * bool(ro.ended[b])
        # the environment's tokens: the framing after the policy's own end of turn
        policy_first = ro.response_ids[b][: int((~ro.response_mask[b]).nonzero()[0, 0])].tolist()
        assert policy_first[-1] == end  # the policy ended its turn itself
        framing = chat_reply_text(tok, CONVERSATIONS[b], msgs[0]["content"], "42")
        assert framing.startswith("<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
        env_ids = ro.response_ids[b][ro.env_mask[b]].tolist()
        assert env_ids == tok(framing, add_special_tokens=False)["input_ids"][1:]  # <|im_end|> once
        assert env_ids.count(end) == 1  # the tool message's own closing
    # the environment got the messages so far, TRL's form
    assert [(t, [m["role"] for m in c]) for _, c, t in calls[:4]] == [(0, ["assistant"])] * 4
    assert all(c[-2:] and c[1]["content"] == "42" for _, c, t in calls if t == 1)
    # the learner's log-probs equal the sampler's on the policy's tokens
    logits, _ = response_forward(lm, ro)
    learner = logprobs_from_logits(logits, ro.response_ids, 1.0)
    m = ro.response_mask
    assert (learner[m] - ro.sampler_logprobs[m]).abs().max() < 1e-4  # float32, cached vs full forward


def test_chat_turns_that_end_at_a_stop_string_get_the_assistants_closing_from_the_template():
    from tests.conftest import make_chat_tokenizer, make_tiny_llama
    from tether.models.turns import chat_reply_text

    tok = make_chat_tokenizer()
    lm = make_tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ro = tool_turns(
        lm, tok, CONVERSATIONS * 2, recording_env([]), max_turns=2, max_new_tokens=40, temperature=1.0,
        seeds=list(range(8)), stop_strings=["e"],
    )  # fmt: skip
    called = 0
    for b in range(8):
        msgs = ro.messages[b]
        if len(msgs) < 2:
            continue
        called += 1
        framing = chat_reply_text(tok, CONVERSATIONS[b % 4], msgs[0]["content"], "42")
        # not sampled by the policy, so the closing <|im_end|> is the environment's token
        assert (
            ro.response_ids[b][ro.env_mask[b]].tolist() == tok(framing, add_special_tokens=False)["input_ids"]
        )
        assert framing.startswith("<|im_end|>")
        rendered = tok.apply_chat_template(
            CONVERSATIONS[b % 4] + msgs[:2], tokenize=False, add_generation_prompt=True
        )
        assert context_text(tok, ro, b).startswith(rendered + msgs[2]["content"])
    assert called >= 4, f"the test needs rows that called the tool ({called} of 8)"


def test_a_chat_reply_that_does_not_fit_is_dropped_whole():
    from tests.conftest import make_chat_tokenizer

    tok = make_chat_tokenizer()
    lm = chat_lm(tok, end_boost=1.5)  # every first turn is one <|im_end|>; the framing is 19 tokens
    ro = tool_turns(
        lm, tok, CONVERSATIONS, recording_env([]), max_turns=2, max_new_tokens=12, temperature=1.0,
        seeds=list(range(4)),
    )  # fmt: skip
    assert not ro.env_mask.any() and ro.env_texts == [[]] * 4
    assert ro.messages == [[{"role": "assistant", "content": ""}]] * 4
    # the environment answered and the budget dropped its reply: cut, not ended (the old code
    # counted these in response/eos_fraction as ended)
    assert not ro.ended.any()


def test_chat_formats_that_cannot_be_exact_are_refused(tiny_tokenizer, tiny_lm):
    import copy

    from tests.conftest import make_chat_tokenizer
    from tether.models.turns import chat_reply_text

    tok = make_chat_tokenizer()
    trims = copy.deepcopy(tok)
    trims.chat_template = tok.chat_template.replace("m['content'] }}", "m['content'] | trim }}")
    with pytest.raises(ValueError, match="verbatim before a tool message.*rollout.env_format=raw"):
        chat_reply_text(trims, CONVERSATIONS[0], " it was ", "42")
    no_tools = copy.deepcopy(tok)
    no_tools.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
        + tok.chat_template[len("{% for m in messages %}") :]
    )
    with pytest.raises(ValueError, match="cannot render a 'tool' message.*no tool role"):
        chat_reply_text(no_tools, CONVERSATIONS[0], "it was", "42")
    with pytest.raises(ValueError, match="env_format=chat needs prompts rendered by the chat template"):
        turns(tiny_lm, tiny_tokenizer, tool, env_format="chat")
    with pytest.raises(ValueError, match="mix conversations and texts"):
        tool_turns(
            tiny_lm, tok, [CONVERSATIONS[0], "plain"], tool, max_turns=2, max_new_tokens=8, temperature=1.0,
            seeds=[0, 1], stop_strings=["e"],
        )  # fmt: skip
    with pytest.raises(ValueError, match="rollout.stop_strings is empty, and these turns are raw"):
        turns(tiny_lm, tiny_tokenizer, tool, stop_strings=[])
    with pytest.raises(ValueError, match="choose auto, chat or raw"):
        turns(tiny_lm, tiny_tokenizer, tool, env_format="json")


def test_raw_format_on_conversations_appends_the_text_as_before(tiny_tokenizer):
    """rollout.env_format=raw keeps a conversation's tool text inside the assistant's turn."""
    from tests.conftest import make_chat_tokenizer, make_tiny_llama

    tok = make_chat_tokenizer()
    lm = make_tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ro = tool_turns(
        lm, tok, CONVERSATIONS, tool, max_turns=2, max_new_tokens=24, temperature=1.0,
        seeds=list(range(4)), stop_strings=["e"], env_format="raw",
    )  # fmt: skip
    assert ro.messages is None
    tool_ids = tok(TOOL, add_special_tokens=False)["input_ids"]
    assert any(ro.response_ids[b][ro.env_mask[b]].tolist() == tool_ids for b in range(4))


# ---- found by an adversarial review: each a path that was silently wrong ---------------------
def test_end_ids_and_added_special_tokens_in_a_tools_text_are_refused():
    """Llama 3's <|eom_id|> ends generation through generation_config only, and an added token
    marked special is not in all_special_ids: both were appended as context, hidden in the text."""
    from tokenizers import AddedToken

    from tests.conftest import make_tiny_llama, make_tokenizer

    tok = make_tokenizer()
    tok.add_tokens([AddedToken("<|eot|>", special=True), AddedToken("<|hdr|>", special=True)])
    eot = tok.convert_tokens_to_ids("<|eot|>")
    assert eot not in tok.all_special_ids  # the gap the check closes
    lm = make_tiny_llama(len(tok), eos_token_id=[tok.eos_token_id, eot], pad_token_id=tok.pad_token_id)
    lm.generation_config.eos_token_id = [tok.eos_token_id, eot]
    for text, name in ((" tool<|eot|>says", "<|eot|>"), (" a<|hdr|>b", "<|hdr|>")):
        with pytest.raises(ValueError, match=rf"special tokens \['{re_escape(name)}'\]"):
            turns(lm, tok, lambda text=text, **kw: text)


def re_escape(s: str) -> str:
    import re

    return re.escape(s)


def test_an_environment_that_edits_its_arguments_edits_nothing_else():
    """A group's rows shared one prompt object with the data: an environment appending to it
    changed the data, the other rows and what the reward read."""
    from tests.conftest import make_chat_tokenizer, make_tiny_llama
    from tether.data.prompts import PromptData

    tok = make_chat_tokenizer()
    lm = make_tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)

    data = PromptData([[{"role": "user", "content": p}] for p in PROMPTS], {"notes": [[1]] * 4})
    batch = data.select([0, 0, 1, 1])  # a group of 2: rows 0 and 1 share their prompt's object
    kept = [[dict(m) for m in p] for p in data.prompts]

    def meddles(prompt, completion, turn, notes):
        prompt.append({"role": "tool", "content": "NOTE"})
        prompt[0]["content"] = prompt[0]["content"].upper()
        notes.append(2)
        return " 42" if turn == 0 else None

    ro = tool_turns(
        lm, tok, list(batch), meddles, max_turns=3, max_new_tokens=24, temperature=1.0,
        seeds=list(range(4)), stop_strings=["e"], columns=batch.columns, env_format="raw",
    )  # fmt: skip
    assert ro.env_texts != [[]] * 4, "the test needs rows that called the tool"
    assert data.prompts == kept and data.columns["notes"] == [[1]] * 4
    assert [list(p) for p in ro.prompts] == [kept[0], kept[0], kept[1], kept[1]]


def test_columns_named_like_the_environments_arguments_are_not_passed(tiny_tokenizer, tiny_lm):
    """A prompt-completion dataset's ``completion`` column clashed with the keyword (TypeError,
    blamed on the environment); an environment without **columns got columns it does not name."""
    from tether.models.turns import env_column_names

    seen: list = []

    def env(prompt, completion, turn, answer):
        seen.append((completion, answer))
        return " 42" if turn == 0 else None

    columns = {"completion": ["ref"] * 4, "turn": [9] * 4, "answer": [1, 2, 3, 4], "extra": [0] * 4}
    assert env_column_names(env, list(columns)) == ["answer"]
    assert env_column_names(lambda **kw: None, list(columns)) == ["answer", "extra"]
    turns(tiny_lm, tiny_tokenizer, env, columns=columns)
    assert seen and all(c != "ref" and a in (1, 2, 3, 4) for c, a in seen)
    with pytest.raises(ValueError, match=r"rollout.env: .*cannot be called as env\(prompt=.*'answer'"):
        env_column_names(env, ["extra"])  # answer: no column fills it
    with pytest.raises(ValueError, match=r"rollout.env: .*cannot be called"):
        env_column_names(lambda prompt: " 42", [])  # takes no completion or turn


def metaspace_tokenizer():
    """A SentencePiece-style (Metaspace: Llama 2, Mistral, Gemma) tokenizer: a text tokenized alone
    gets a word-start marker, ``"5"`` -> ``"▁5"``, that decoding hides at a sequence's start."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import CORPUS

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    t.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>", "<unk>"], initial_alphabet=list("0123456789=+ \n")
    )
    t.train_from_iterator([*CORPUS, "2 + 3 = 5", "1 + 1 = 2"], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>")
    tok.padding_side = "left"
    return tok


def test_a_metaspace_tokenizer_appends_the_tools_text_without_a_space():
    """The reply tokenized alone was '▁5': the context read '... 5' while env_texts said '5'.
    Now the appended tokens continue the context with exactly the text, and the reward's text,
    the record and the context agree."""
    from tests.conftest import make_tiny_llama
    from tether.models.turns import continuation_ids

    tok = metaspace_tokenizer()
    assert tok.convert_ids_to_tokens(tok("5", add_special_tokens=False)["input_ids"]) == ["▁5"]
    context = tok("the movie was", add_special_tokens=False)["input_ids"]
    for text in ("5", " 5", "\n5 = 2 + 3"):
        ids = continuation_ids(tok, context, text, "text")
        assert tok.decode(context + ids) == tok.decode(context) + text, text
    lm = make_tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ro = tool_turns(
        lm, tok, ["the movie was", "a film that"] * 2, lambda turn, **kw: "5" if turn == 0 else None,
        max_turns=2, max_new_tokens=20, temperature=1.0, seeds=list(range(4)), stop_strings=["e"],
    )  # fmt: skip
    called = 0
    for b in range(4):
        if not ro.env_texts[b]:
            continue
        called += 1
        n = int((ro.response_mask[b] | ro.env_mask[b]).nonzero().max()) + 1
        ids = ro.response_ids[b, :n].tolist()
        first = int(ro.env_mask[b].nonzero()[0, 0])
        assert ro.env_texts[b] == ["5"]
        assert tok.decode(ids[: first + 1]) == tok.decode(ids[:first]) + "5"  # no space before it
        assert ro.responses[b] == tok.decode(
            [t for t in ids if t != tok.eos_token_id], skip_special_tokens=True
        )
    assert called >= 2, "the test needs rows that called the tool"


def test_a_stop_string_with_a_leading_space_stops_a_turns_first_token():
    """A SentencePiece tokenizer decodes a sequence's first token without its word-start space, so
    a turn's new tokens decoded alone read "movie was" where the context reads "the movie was":
    the stop string " movie" was missed when the turn began with it, the environment never
    called. The turn's text is now read after its context, in the sampler and in the rollout."""
    from tests.conftest import make_tiny_llama
    from tether.models.sampling import _StopAfterText
    from tether.models.turns import _stop_at

    tok = metaspace_tokenizer()
    context = tok("the", add_special_tokens=False)["input_ids"]
    new = tok(" movie was", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(new) == ["▁movie", "▁was"] and tok.decode(new[:1]) == "movie"
    assert _stop_at(tok, context, new, [" movie"]) == 1 and _stop_at(tok, context, new, [" was"]) == 2
    row = torch.tensor([context + new[:1]])
    assert _StopAfterText(tok, [" movie"], len(context))(row, None).tolist() == [True]
    # every turn's first token that starts a word holds a space: with stop string " ", every such
    # turn stops at its first token and the environment answers it
    lm = make_tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ro = tool_turns(
        lm, tok, PROMPTS * 2, lambda turn, **kw: "5" if turn == 0 else None,
        max_turns=2, max_new_tokens=12, temperature=1.0, seeds=list(range(8)), stop_strings=[" "],
    )  # fmt: skip
    first_word = 0
    for b in range(8):
        own = ro.response_ids[b][ro.response_mask[b]].tolist()
        pieces = tok.convert_ids_to_tokens(own)
        if pieces[0].startswith("▁"):
            first_word += 1
            assert ro.env_texts[b] == ["5"] and not ro.response_mask[b, 1], (b, pieces)
    assert first_word >= 2, "the test needs turns whose first token starts a word"


def test_a_chat_turn_ended_by_another_end_id_ends_the_episode():
    """The policy ending its turn with <eos> where the template closes an assistant's message with
    <|im_end|>: the framing appended after it read '...<eos><|im_end|>\\n<|im_start|>tool', which
    no template renders. Such a turn now ends the episode (as an end id does in the raw format),
    and the environment is not called."""
    from tests.conftest import make_chat_tokenizer, make_tiny_llama

    tok = make_chat_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    lm = make_tiny_llama(len(tok), eos_token_id=[tok.eos_token_id, end], pad_token_id=tok.pad_token_id)
    lm.generation_config.eos_token_id = [tok.eos_token_id, end]
    with torch.no_grad():  # <eos> favoured, as chat_lm favours <|im_end|>
        lm.model.embed_tokens.weight[:, 5] += 3.0
        lm.model.embed_tokens.weight[tok.eos_token_id, 5] += 1.0
    calls: list = []
    ro = tool_turns(
        lm, tok, CONVERSATIONS, recording_env(calls), max_turns=2, max_new_tokens=40, temperature=1.0,
        seeds=list(range(4)),
    )  # fmt: skip
    last = [ro.response_ids[b][ro.response_mask[b]].tolist()[-1] for b in range(4)]
    assert last == [tok.eos_token_id] * 4, "the test needs turns ended by <eos>"
    assert not calls and not ro.env_mask.any() and ro.ended.all()
    assert [[m["role"] for m in msgs] for msgs in ro.messages] == [["assistant"]] * 4


def test_chat_turns_whose_close_is_not_an_end_id_need_stop_strings():
    """A Qwen base model lists only <|endoftext|> as its end id, while its template closes an
    assistant's message with <|im_end|>: without stop strings a turn ran past <|im_end|>, ended at
    <|endoftext|>, which ends the episode, and the run trained with an environment that never
    answered (rollout/env_tokens 0). Refused by name; a stop string makes it callable."""
    from tests.conftest import make_chat_tokenizer, make_tiny_llama

    tok = make_chat_tokenizer()
    lm = make_tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    lm.generation_config.eos_token_id = tok.eos_token_id  # <|im_end|> is no end id here
    kw = dict(max_turns=2, max_new_tokens=12, temperature=1.0, seeds=list(range(4)))
    with pytest.raises(
        ValueError, match=r"rollout.stop_strings is empty.*'<\|im_end\|>' \(id 301, the first token"
    ):
        tool_turns(lm, tok, CONVERSATIONS, recording_env([]), **kw)
    tool_turns(lm, tok, CONVERSATIONS, recording_env([]), stop_strings=["e"], **kw)
    tool_turns(lm, tok, CONVERSATIONS, recording_env([]), **{**kw, "max_turns": 1})  # no env call


def test_an_async_environment_is_awaited(tiny_tokenizer, tiny_lm):
    """TRL takes async tools: an ``async def`` environment's reply is awaited (it was refused as
    "returned coroutine" after the model had loaded), also where the calling thread already runs
    an event loop (a notebook), and gives the rollout a synchronous one gives."""
    import asyncio

    async def async_tool(prompt, completion, turn, **columns):
        await asyncio.sleep(0)
        return tool(prompt=prompt, completion=completion, turn=turn)

    want = turns(tiny_lm, tiny_tokenizer, tool)
    assert any(want.env_texts), "the test needs rows that called the tool"
    got = turns(tiny_lm, tiny_tokenizer, async_tool)
    assert got.env_texts == want.env_texts and torch.equal(got.response_ids, want.response_ids)

    async def in_a_running_loop():
        return turns(tiny_lm, tiny_tokenizer, async_tool)

    assert asyncio.run(in_a_running_loop()).env_texts == want.env_texts


# ---- faults from a user's environment (issue 50's fault campaign) -----------------------------------
def test_an_environment_that_never_answers_is_abandoned_at_rollout_env_timeout(tiny_tokenizer, tiny_lm):
    """An environment that slept forever hung the run forever. Now each call has its deadline
    (rollout.env_timeout): the rollout stops with the field and the row named, a sync call left on
    its thread, an ``async def`` one cancelled; the next rollout gets a fresh thread."""
    import asyncio
    import threading
    import time

    from tether.models.turns import EnvFailed

    release, cancelled = threading.Event(), []

    def sleeps(**kw):
        release.wait(600)  # "forever": released when the test ends

    async def sleeps_async(**kw):
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    try:
        for env in (sleeps, sleeps_async):
            t0 = time.perf_counter()
            with pytest.raises(
                EnvFailed, match=r"did not answer within rollout.env_timeout=0.2 s on row 0 after turn 0"
            ):
                turns(tiny_lm, tiny_tokenizer, env, env_timeout=0.2)
            # far below the 600 s it would wait: the deadline ended the wait (the bound is slack
            # for a loaded machine, not a measurement)
            assert time.perf_counter() - t0 < 30
        deadline = time.monotonic() + 10  # cancelled on the call's own loop, at its own deadline
        while not cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cancelled == [True]
        ro = turns(tiny_lm, tiny_tokenizer, tool, env_timeout=5.0)  # after an abandoned call
        assert torch.equal(ro.response_ids, turns(tiny_lm, tiny_tokenizer, tool).response_ids)
    finally:
        release.set()


def test_an_environments_exit_or_interrupt_ends_the_rollout_named(tiny_tokenizer, tiny_lm):
    """KeyboardInterrupt from the environment left generate_turns raw (SystemExit was caught, a
    KeyboardInterrupt not): now each is an EnvFailed naming the row, which the training loop
    turns into a checkpoint of the step before."""
    from tether.models.turns import EnvFailed

    def interrupts(**kw):
        raise KeyboardInterrupt

    with pytest.raises(EnvFailed, match=r"rollout.env raised KeyboardInterrupt on row 0 after turn 0") as e:
        turns(tiny_lm, tiny_tokenizer, interrupts)
    assert not e.value.interrupted  # the environment raised it: a failure, not a stop by a signal


def qwen2_like_tokenizer():
    """A byte-level BPE with Qwen2's normalizer (NFC) and pre-tokenizer pattern (Llama 3's, digits
    one by one): words that swallow a space, runs of newlines, contractions, accents composed."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.conftest import CORPUS

    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    t.train_from_iterator([*CORPUS, "  \n\n   x", "café 123 don't", "한국어"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", pad_token="<eos>")


def adversarial_replies(n: int) -> list[str]:
    """Replies of about ``n`` characters built to move a tokenizer's words across a cut: one word
    of n letters, spaces then a newline (a pattern that scans the whole run), a letter with n
    accents then one that NFC reorders before them, contractions, digits, Hangul jamo, emoji, and
    seeded random mixtures of all of them."""
    import random

    rng = random.Random(n)
    parts = list("abcdefghij klmno\n\t  .,!'1") + ["'ll", "'re", "\u0301", "\u0323", "\u0302", "23"]
    parts += ["\u1100", "\u1161", "\u11a8", "😀", "é", "   ", "\n\n", "movie", " the"]
    return [
        "a" * n,
        "a \n" + " " * n + "\n b",
        "e" + "\u0302" * n + "\u0323 z",
        "x'" + "l" * n,
        "1" * n + " a",
        "ab\u0301" * n,
        "the movie \n\n\t " * (n // 14),
        "\u1100\u1161\u11a8" * (n // 3),
        "😀" * n,
        *("".join(rng.choice(parts) for _ in range(n)) for _ in range(8)),
    ]


def test_a_long_reply_keeps_the_tokens_of_the_whole_reply(tiny_tokenizer):
    """The head of a reply that tether tokenizes (reply_head) gives the tokens of the whole reply,
    cut to the budget, on each tiny tokenizer (byte-level BPE, ChatML, SentencePiece-style
    Metaspace, a Qwen2-like NFC one) and adversarial replies, as continuation_ids appends them.
    A cut at the bound alone ((budget + 1) x the longest token + SETTLE_CHARS, the head's first
    window) is not enough: NFC composes an accent met past the cut into the letter before it."""
    from tests.conftest import make_chat_tokenizer
    from tether.models.turns import ENV_TEXT, SETTLE_CHARS, continuation_ids, longest_token_chars, reply_head

    tokenizers = {
        "byte-level": tiny_tokenizer,
        "chatml": make_chat_tokenizer(),
        "metaspace": metaspace_tokenizer(),
        "qwen2-like": qwen2_like_tokenizer(),
    }
    window_alone_differs = 0
    for name, tok in tokenizers.items():
        context = tok("the movie was", add_special_tokens=False)["input_ids"]
        cut = 0
        for n in (40, 300, 2000):
            for text in adversarial_replies(n):
                whole = tok(text, add_special_tokens=False)["input_ids"]
                for budget in (1, 2, 7, 30, 100):
                    head = reply_head(tok, text, budget)
                    cut += len(head) < len(text)
                    assert tok(head, add_special_tokens=False)["input_ids"][:budget] == whole[:budget], (
                        name,
                        text,
                    )
                    window = text[: (budget + 1) * longest_token_chars(tok) + SETTLE_CHARS]
                    window_alone_differs += (
                        tok(window, add_special_tokens=False)["input_ids"][:budget] != whole[:budget]
                    )
                    try:
                        want = continuation_ids(tok, context, text, ENV_TEXT)[:budget]
                    except ValueError:  # the whole reply cannot be appended (NFC changes it)
                        continue
                    assert continuation_ids(tok, context, head, ENV_TEXT)[:budget] == want, (name, text)
        assert cut >= 50, f"{name}: the test needs replies that are cut"
    assert window_alone_differs > 0


def test_a_long_reply_is_cut_before_it_is_tokenized_and_said_once(
    tiny_tokenizer, tiny_lm, caplog, monkeypatch
):
    """A 1 MB tool output was tokenized whole before the cut to the tokens left (seconds and
    hundreds of MB per reply, nothing said). Now only its head is tokenized, the rollout is the one
    the whole reply gives, and a warning names the size and the budget, once."""
    from tether.models import turns as T

    reply = ("the movie was great and the acting was wonderful. " * 21000)[: 2**20]
    longest = []
    real_call = type(tiny_tokenizer).__call__

    def recording(self, text, *a, **k):
        longest.append(len(text) if isinstance(text, str) else 0)
        return real_call(self, text, *a, **k)

    def env(turn, **kw):
        return reply if turn == 0 else None

    monkeypatch.setattr(T, "_said", set())
    monkeypatch.setattr(type(tiny_tokenizer), "__call__", recording)
    with caplog.at_level("WARNING"):
        ro = turns(tiny_lm, tiny_tokenizer, env)
    assert max(longest) < 1000, "the whole reply was tokenized"
    said = [
        r.getMessage() for r in caplog.records if "rollout.env answered with a reply of" in r.getMessage()
    ]
    assert (
        len(said) == 1 and "1,048,576 characters, longer than the" in said[0] and "token(s) left" in said[0]
    ), said
    monkeypatch.setattr(T, "reply_head", lambda tok, text, budget: text)  # the old way: whole
    whole = turns(tiny_lm, tiny_tokenizer, env)
    assert torch.equal(ro.response_ids, whole.response_ids) and ro.env_texts == whole.env_texts
    assert sum(bool(e) for e in ro.env_texts) >= 3, "the test needs rows that called the tool"


def test_a_long_chat_reply_is_dropped_untokenized():
    """A chat reply never fits cut; one that surely takes more tokens than are left is dropped
    without tokenizing it (the framing's tokens were counted on the whole megabyte): the rollout
    is the one the tokenized reply gave."""
    from tests.conftest import make_chat_tokenizer

    tok = make_chat_tokenizer()
    lm = chat_lm(tok, end_boost=1.5)
    reply = "the movie was great. " * 50000
    longest = []
    real_call = type(tok).__call__

    def recording(self, text, *a, **k):
        longest.append(len(text) if isinstance(text, str) else 0)
        return real_call(self, text, *a, **k)

    kw = dict(max_turns=2, max_new_tokens=40, temperature=1.0, seeds=list(range(4)))
    type(tok).__call__ = recording
    try:
        ro = tool_turns(lm, tok, CONVERSATIONS, lambda turn, **k: reply if turn == 0 else None, **kw)
    finally:
        type(tok).__call__ = real_call
    assert max(longest) < 1000 and not ro.env_mask.any() and not ro.ended.any()
    short = tool_turns(lm, tok, CONVERSATIONS, lambda turn, **k: reply[:400] if turn == 0 else None, **kw)
    assert torch.equal(ro.response_ids, short.response_ids)  # also dropped: the same rollout
