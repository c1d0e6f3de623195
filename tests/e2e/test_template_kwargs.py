"""``data.chat_template_kwargs`` (issue 55): a template variable such as Qwen3's
``enable_thinking`` reaches every chat rendering, as TRL's ``chat_template_kwargs`` does; the
same prompt text as TRL's; refused where it would change nothing."""

from __future__ import annotations

import shutil

import pytest
import yaml

from tests.conftest import make_chat_tokenizer, tiny_run_args
from tether.run.config import ConfigError, load_config

# ChatML, and Qwen3's rule for thinking: with enable_thinking false the opened assistant turn
# starts with an empty think block (the model is told not to think)
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
PROMPT = [{"role": "user", "content": "what is 2 + 3"}]


def _tokenizer():
    tok = make_chat_tokenizer()
    tok.chat_template = THINKING
    return tok


def test_prompt_text_equals_trls_with_and_without_the_variable():
    from trl.data_utils import apply_chat_template

    from tether.models.sampling import prompt_texts, set_template_kwargs

    tok = _tokenizer()
    plain = prompt_texts(tok, [PROMPT])[0]
    assert plain == apply_chat_template({"prompt": PROMPT}, tok)["prompt"]
    assert "<think>" not in plain
    set_template_kwargs(tok, {"enable_thinking": False})
    off = prompt_texts(tok, [PROMPT])[0]
    assert off == apply_chat_template({"prompt": PROMPT}, tok, enable_thinking=False)["prompt"]
    assert off == plain + "<think>\n\n</think>\n\n"


def test_a_reward_model_renders_with_the_variables_as_trl_does():
    """TRL renders a reward model's conversations with chat_template_kwargs too."""
    from trl.data_utils import apply_chat_template

    from tether.judges.scorers import RewardModelScorer
    from tether.models.sampling import set_template_kwargs

    tok = _tokenizer()
    set_template_kwargs(tok, {"enable_thinking": False})
    scorer = object.__new__(RewardModelScorer)  # texts() reads the tokenizer alone
    scorer.tokenizer, scorer.__name__ = tok, "rm"
    completion = [{"role": "assistant", "content": "5"}]
    want = apply_chat_template({"messages": PROMPT + completion}, tok, enable_thinking=False)["text"]
    assert scorer.texts([PROMPT], [completion]) == [want]


@pytest.fixture()
def thinking_model(chat_model_dir, tmp_path):
    folder = tmp_path / "thinking"
    shutil.copytree(chat_model_dir, folder)
    tok = _tokenizer()
    tok.save_pretrained(folder)
    return folder


def test_a_run_renders_its_prompts_with_the_variable(thinking_model, tmp_path, capsys):
    """The longest rendered prompt (rollout.max_prompt_tokens, filled and said): with
    enable_thinking=false each prompt is the think block's tokens longer."""
    import re

    from tether import train

    convo = [[{"role": "user", "content": f"tell me about film {i}"}] for i in range(12)]
    lengths = {}
    for name, extra in (("plain", {}), ("off", {"data.chat_template_kwargs.enable_thinking": "false"})):
        args = tiny_run_args(
            thinking_model,
            None,
            tmp_path / name,
            {"data.prompts": None, "eval.fluency_model": "none", **extra},
        )
        capsys.readouterr()
        out = train(load_config(None, args), train_dataset=convo)
        said = capsys.readouterr().out
        lengths[name] = int(re.search(r"rollout.max_prompt_tokens=(\d+): the data's longest prompt", said)[1])
        saved = yaml.safe_load((out / "config.yaml").read_text())
        assert saved["data"]["chat_template_kwargs"] == ({"enable_thinking": False} if extra else {})
    think = len(_tokenizer()("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"])
    assert think > 0 and lengths["off"] == lengths["plain"] + think


def test_variables_that_would_change_nothing_are_refused(tiny_model_dir, prompt_file, tmp_path):
    from tether import train

    args = tiny_run_args(tiny_model_dir, prompt_file, tmp_path / "run", {"data.chat_template_kwargs.x": "1"})
    with pytest.raises(ConfigError, match="would change nothing: the prompts are text"):
        train(load_config(None, args))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.chat_template_kwargs=3", "expected a mapping"),
        ("data.chat_template_kwargs.add_generation_prompt=true", "apply_chat_template's own argument"),
        ("data.chat_template_kwargs={1: 2}", "not a template variable name"),
    ],
)
def test_bad_variables_are_refused_naming_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_both_spellings_on_the_command_line_give_one_mapping():
    a = load_config(None, ["data.chat_template_kwargs.enable_thinking=false"]).data.chat_template_kwargs
    b = load_config(None, ["data.chat_template_kwargs={enable_thinking: false}"]).data.chat_template_kwargs
    assert a == b == {"enable_thinking": False}


def test_nested_tagged_and_reserved_variables_from_the_command_line():
    assert load_config(None, ["data.chat_template_kwargs.a.b=false"]).data.chat_template_kwargs == {
        "a": {"b": False}
    }
    with pytest.raises(ConfigError, match="is not YAML data"):
        load_config(None, ["data.chat_template_kwargs.x=!!python/name:os.system"])
    with pytest.raises(ConfigError, match="messages is apply_chat_template's own argument"):
        load_config(None, ["data.chat_template_kwargs.messages=1"])


def test_conversational_dpo_pairs_take_the_variables(thinking_model, tmp_path):
    """DPO renders its pairs through the template: the variables count there, where data.prompts
    (a text file) alone would say they change nothing; the responses' tokens follow the prompt
    with the think block."""
    import json

    from tether import train
    from tether.trainers.dpo import read_pair_file

    rows = [
        {
            "prompt": [{"role": "user", "content": f"rate film {i}"}],
            "chosen": [{"role": "assistant", "content": "good"}],
            "rejected": [{"role": "assistant", "content": "bad"}],
        }
        for i in range(12)
    ]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"the film {i} was\n" for i in range(20)))
    overrides = {
        "train.algo": "dpo",
        "dpo.pairs": str(pairs),
        "data.chat_template_kwargs.enable_thinking": "false",
        "eval.fluency_model": "none",
    }
    out = train(load_config(None, tiny_run_args(thinking_model, prompts, tmp_path / "dpo", overrides)))
    assert (out / "metrics.jsonl").exists()
    from tether.models.sampling import set_template_kwargs

    tok = _tokenizer()
    set_template_kwargs(tok, {"enable_thinking": False})
    _, chosen, _ = read_pair_file(str(pairs), tok)
    # the response after the opened turn and its think block: the text and ChatML's close
    assert tok.decode(chosen[0]) == "good<|im_end|>\n"
