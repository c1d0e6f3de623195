"""TRL's tool convention (``rollout.tools``, ``train(tools=[...])``), against TRL 1.16's own loop.

The oracle is TRL's code: ``GRPOTrainer._tool_call_loop`` and ``_get_tool_suffix_ids`` run on a
trainer made without its ``__init__`` (:func:`trl_tool_episode`), on a tiny tokenizer carrying
Qwen3's chat template (TRL's copy) and Qwen3's tool tags. Generation is scripted the same way in
both libraries: each policy turn is the next text of :data:`TURNS`, so the comparison is of what
each library builds around the turns (prompt ids, the tools' tokens, masks, messages), token for
token.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")  # the test extra pins trl==1.16.0

from tests.conftest import make_tiny_llama, make_tokenizer, metric_rows, tiny_run_args  # noqa: E402
from tether.models.sampling import SamplingSettings, set_template_kwargs  # noqa: E402
from tether.models.tools import ToolEnv, tool_schema  # noqa: E402


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def divide(a: int, b: int) -> float:
    """Divide one integer by another.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


async def negate(a: int) -> int:
    """Negate an integer (an async tool, awaited).

    Args:
        a: The integer.
    """
    return -a


TOOLS = [multiply, divide, negate]

PROMPT = [{"role": "user", "content": "What is 3 times 4, and 1 over 0?"}]

TURNS = [
    # two calls in one turn: one answers, one raises (ZeroDivisionError -> {"error": ...})
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n'
    '<tool_call>\n{"name": "divide", "arguments": {"a": 1, "b": 0}}\n</tool_call><|im_end|>',
    # reasoning, text, a call to a tool that does not exist, and an async one
    "<think>\nhm\n</think>\n\nLet me check.\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "negate", "arguments": {"a": 12}}\n</tool_call><|im_end|>',
    # no call: the episode ends
    "It is 12, and 1 over 0 has no value.<|im_end|>",
]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    """The tiny tokenizer with Qwen3's special tokens, tool tags and chat template (TRL's copy of
    Qwen3's), ``<|im_end|>`` its EOS as in Qwen3's instruct models, and a tiny Llama."""
    out = tmp_path_factory.mktemp("tiny-qwen3")
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(
        ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]
    )
    tok.eos_token = "<|im_end|>"
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    tok.save_pretrained(out)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    model = make_tiny_llama(len(tok), eos_token_id=end, pad_token_id=tok.pad_token_id)
    model.config.max_position_embeddings = 2048
    model.generation_config.eos_token_id = end
    model.save_pretrained(out)
    return out


def chat_data(tmp_path: Path) -> Path:
    """12 one-message conversations, as jsonl rows ``{"prompt": [...]}``."""
    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": [{"role": "user", "content": f"q {i}"}]}) + "\n" for i in range(12))
    )
    return data


def load(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def trl_tool_episode(
    tok, tools, prompt, turns, max_iterations=10, max_completion_length=4096, template_kwargs=None
):
    """TRL 1.16's tool episode: the prompt rendered as ``GRPOTrainer._tokenize_prompts`` renders
    it, the first turn parsed as ``_generate`` parses it, then ``_tool_call_loop`` with
    ``_generate_single_turn`` scripted to return the next of ``turns``. Returns ``(prompt_ids,
    completion_ids, tool_mask, completions, calls, failures)``."""
    from trl.chat_template_utils import (
        add_response_schema,
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        parse_response,
    )

    add_response_schema(tok)
    t = trl.GRPOTrainer.__new__(trl.GRPOTrainer)
    t.processing_class = t._tokenizer = tok
    t._is_vlm = False
    t.use_vllm = False
    t.model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=1 << 20))
    t.chat_template = None if is_chat_template_prefix_preserving(tok) else get_training_chat_template(tok)
    t.chat_template_kwargs = dict(template_kwargs or {})
    t.tools = list(tools)
    t.environment_factories = None
    t.max_tool_calling_iterations = max_iterations
    t.max_completion_length = max_completion_length
    t._sync_tool_dicts = [{f.__name__: f for f in tools if not _is_async(f)}]
    t._async_tool_dicts = [{f.__name__: f for f in tools if _is_async(f)}]
    if t._async_tool_dicts[0]:
        from trl.trainer.utils import start_event_loop_in_daemon

        _, t.async_loop, ready = start_event_loop_in_daemon(name="test-tools")
        ready.wait()
    script = iter(tok(x, add_special_tokens=False)["input_ids"] for x in turns)
    t._generate_single_turn = lambda ids, *a, **k: ([next(script) for _ in ids], None)
    prompt_ids = tok.apply_chat_template(
        [prompt],
        tools=t.tools,
        chat_template=t.chat_template,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        **t.chat_template_kwargs,
    )["input_ids"]
    first = next(script)
    completions = [[parse_response(tok, first, prefix=prompt_ids[0], tools=t.tools)]]
    mask, completions, completion_ids, _, calls, failures, _ = t._tool_call_loop(
        [list(prompt)], prompt_ids, [list(first)], completions, None, None, {}
    )
    return prompt_ids[0], completion_ids[0], mask[0], completions[0], calls, failures


def _is_async(f):
    import inspect

    return inspect.iscoroutinefunction(f)


def tether_tool_episode(
    tok, tools, prompt, turns, monkeypatch, *, max_turns=11, max_new_tokens=4096, template_kwargs=None
):
    """tether's episode of the same script: :func:`tether.models.turns.generate_turns` with the
    tools' :class:`ToolEnv`, the prompt's template given the schemas as a run gives them, and
    each policy turn's sampling replaced by the next of ``turns`` (the turn loop, parsing, tools
    and tokens are tether's own)."""
    import tether.models.turns as turns_module

    env = ToolEnv(tools)
    set_template_kwargs(tok, {**(template_kwargs or {}), "tools": env.schemas})
    script = iter(tok(x, add_special_tokens=False)["input_ids"] for x in turns)

    def scripted(lm, ids, mask, *, max_new_tokens, **kwargs):
        rows = [next(script)[:max_new_tokens] for _ in range(ids.shape[0])]
        width = max(len(r) for r in rows)
        new = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
        return new, torch.full(new.shape, -1.0)

    monkeypatch.setattr(turns_module, "sample_tokens", scripted)
    lm = make_tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    settings = SamplingSettings(
        max_new_tokens=max_new_tokens,
        temperature=1.0,
        max_turns=max_turns,
        env_timeout=None,
        max_prompt_tokens=None,
    )
    return turns_module.generate_turns(lm, tok, [prompt], env, settings=settings, seeds=[0])


def test_tool_episode_equals_trls_token_for_token(qwen3_dir, monkeypatch):
    """The same prompt ids, completion ids, masks, tool messages and parsed turns as TRL 1.16."""
    p_ids, c_ids, trl_mask, trl_messages, calls, failures = trl_tool_episode(
        load(qwen3_dir), TOOLS, PROMPT, TURNS
    )
    tok = load(qwen3_dir)
    r = tether_tool_episode(tok, TOOLS, PROMPT, TURNS, monkeypatch)
    assert r.prompt_ids[0][r.prompt_mask[0].bool()].tolist() == p_ids
    n = len(c_ids)
    assert r.response_ids[0, :n].tolist() == c_ids and r.response_ids.shape[1] == n
    assert r.response_mask[0].tolist() == [bool(m) for m in trl_mask]  # the policy's tokens only
    assert r.env_mask[0].tolist() == [not m for m in trl_mask]
    assert r.messages[0] == trl_messages  # the reward's completions: parsed turns, named tool messages
    roles = [m["role"] for m in trl_messages]
    assert roles == ["assistant", "tool", "tool", "assistant", "tool", "tool", "assistant"]
    assert trl_messages[1] == {"role": "tool", "name": "multiply", "content": "12"}
    assert trl_messages[2] == {"role": "tool", "name": "divide", "content": "{'error': 'division by zero'}"}
    assert trl_messages[4] == {"role": "tool", "name": "add", "content": "{'error': 'Tool add not found.'}"}
    assert trl_messages[5] == {"role": "tool", "name": "negate", "content": "-12"}
    assert trl_messages[3]["reasoning_content"] == "hm" and trl_messages[3]["content"] == "Let me check."
    assert (calls, failures) == (4, 2) and (r.tool_calls, r.tool_failures) == ([4], [2])
    assert r.ended.tolist() == [True]
    metrics = r.turn_metrics()
    assert metrics["tool_calls"].tolist() == [4.0] and metrics["tool_failures"].tolist() == [2.0]


def test_tool_messages_that_do_not_fit_are_dropped_as_trl_drops_them(qwen3_dir, monkeypatch):
    """A budget that ends inside the first tools' answer: TRL rolls the answer back and the
    episode ends with the first turn; tether drops it whole (a tool message is never cut)."""
    tok = load(qwen3_dir)
    first = len(tok(TURNS[0], add_special_tokens=False)["input_ids"])
    _, c_ids, trl_mask, trl_messages, _, _ = trl_tool_episode(
        load(qwen3_dir), TOOLS, PROMPT, TURNS, max_completion_length=first + 5
    )
    r = tether_tool_episode(tok, TOOLS, PROMPT, TURNS, monkeypatch, max_new_tokens=first + 5)
    assert len(c_ids) == first and r.response_ids.shape[1] == first
    assert r.response_ids[0].tolist() == c_ids and r.messages[0] == trl_messages == trl_messages[:1]
    assert r.ended.tolist() == [False]  # cut at the token budget, not ended on its own
    assert r.tool_calls == [2]  # the calls ran (TRL counts them too)


def test_max_turns_is_trls_iterations_plus_one(qwen3_dir, monkeypatch):
    """rollout.max_turns=2 is TRL's max_tool_calling_iterations=1: one answer, then the turn after
    it is the last (its calls not run)."""
    _, c_ids, trl_mask, trl_messages, _, _ = trl_tool_episode(
        load(qwen3_dir), TOOLS, PROMPT, TURNS, max_iterations=1
    )
    r = tether_tool_episode(load(qwen3_dir), TOOLS, PROMPT, TURNS, monkeypatch, max_turns=2)
    assert r.response_ids[0].tolist() == c_ids and r.messages[0] == trl_messages
    assert [m["role"] for m in trl_messages] == ["assistant", "tool", "tool", "assistant"]


def test_tool_schema_refuses_what_cannot_be_described():
    def untyped(a):
        """Add.

        Args:
            a: a number.
        """

    with pytest.raises(ValueError, match=r"cannot describe the tool 'untyped'.*type hint"):
        tool_schema(untyped)
    with pytest.raises(ValueError, match=r"is a int; a tool is a function"):
        tool_schema(3)
    with pytest.raises(ValueError, match="two tools are named 'multiply'"):
        ToolEnv([multiply, multiply])
    with pytest.raises(ValueError, match="rollout.tools is empty"):
        ToolEnv([])
    assert tool_schema(multiply)["function"]["parameters"]["required"] == ["a", "b"]


def test_a_template_without_tools_is_refused(tmp_path, monkeypatch):
    """ChatML without tool support (the tiny chat tokenizer's template drops tool_calls): refused
    before sampling, naming the fix."""
    from tests.conftest import make_chat_tokenizer

    tok = make_chat_tokenizer()
    tok.save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match=r"closes an assistant's message with '<\|im_end\|>' \(id 301\), which is not"
    ):
        tether_tool_episode(load(tmp_path), TOOLS, PROMPT, TURNS, monkeypatch)
    tok.eos_token = "<|im_end|>"  # now a turn ends at the close; the template still drops tool calls
    tok.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="drops part of a tool exchange"):
        tether_tool_episode(load(tmp_path), TOOLS, PROMPT, TURNS, monkeypatch)


def test_config_fields_are_checked():
    from tether.run.config import ConfigError, RolloutConfig

    assert RolloutConfig(tools="m:a, m:b", max_turns=3).tools == ["m:a", "m:b"]
    assert RolloutConfig(tools="[m:a, m:b]", max_turns=3).tools == ["m:a", "m:b"]
    with pytest.raises(ConfigError, match=r"rollout.max_turns.*>= 2 with rollout.tools"):
        RolloutConfig(tools=["m:a"])
    with pytest.raises(ConfigError, match="rollout.tools.*both answer"):
        RolloutConfig(tools=["m:a"], env="m:e", max_turns=2)
    with pytest.raises(ConfigError, match="rollout.stop_strings.*must be empty with rollout.tools"):
        RolloutConfig(tools=["m:a"], max_turns=2, stop_strings=["</tool_call>"])
    with pytest.raises(ConfigError, match="rollout.tools.*module:function"):
        RolloutConfig(tools=["multiply"], max_turns=2)


def count_tool_calls(prompts, completions, **kwargs) -> list[float]:
    """A TRL-style reward reading the parsed ``tool_calls`` of each completion's messages."""
    return [float(sum(len(m.get("tool_calls") or []) for m in c)) for c in completions]


def test_train_with_tools_end_to_end(qwen3_dir, tmp_path, monkeypatch):
    """``tether.train(config, tools=[...], reward_funcs=...)`` on a conversational dataset, each
    policy turn scripted (:data:`TURNS`, by the tool answers in its context): the run calls the
    tools, its reward reads the parsed ``tool_calls``, it logs the tools' metrics (TRL's
    ``tools/call_frequency`` and ``tools/failure_frequency``), records the tools in config.yaml,
    and a resume without them asks for them."""
    import yaml

    import tether
    import tether.models.turns as turns_module
    from tether.run.config import load_config

    tok = load(qwen3_dir)
    answer = tok.convert_tokens_to_ids("<tool_response>")
    script = [tok(x, add_special_tokens=False)["input_ids"] for x in TURNS]

    def scripted(lm, ids, mask, *, max_new_tokens, **kwargs):  # the turn after 0, 2 or 4 tool answers
        rows = [script[min(2, int((row == answer).sum()) // 2)][:max_new_tokens] for row in ids]
        width = max(len(r) for r in rows)
        new = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
        return new, torch.zeros(new.shape)

    monkeypatch.setattr(turns_module, "sample_tokens", scripted)

    data = chat_data(tmp_path)
    out = tmp_path / "run"
    args = tiny_run_args(
        qwen3_dir,
        data,
        out,
        {
            "train.algo": "grpo",
            "rollout.max_turns": 3,
            "rollout.max_new_tokens": 400,
            "rollout.batch_size": 4,
            "train.steps": 1,
            "reward.scorer": None,
            "train.save_model": None,
        },
    )
    config = load_config(None, args)
    run = tether.train(config, tools=[multiply, negate], reward_funcs=count_tool_calls)
    rows = metric_rows(run)
    # each row: turn 0 calls multiply and divide (no such tool here), turn 1 add (none) and negate
    assert rows[-1]["rollout/tool_calls"] == 4 and rows[-1]["rollout/tool_failures"] == 2
    assert rows[-1]["rollout/tool_failure_fraction"] == 0.5
    assert rows[-1]["objective/scores"] == 4  # count_tool_calls read 2 + 2 parsed calls per completion
    recorded = yaml.safe_load((run / "config.yaml").read_text())["rollout"]["tools"]
    assert recorded == [
        "(from Python) tests.e2e.test_tools:multiply",
        "(from Python) tests.e2e.test_tools:negate",
    ]
    with pytest.raises(ValueError, match="passed from Python.*tools=\\[...\\]"):
        tether.train(load_config(run / "config.yaml", []), resume=True, reward_funcs=count_tool_calls)


def test_tools_named_on_the_command_line(qwen3_dir, tmp_path, capsys):
    """``rollout.tools=module:function,...`` from the CLI: the run finishes with the schemas in its
    prompts (the tiny model calls nothing) and config.yaml names the tools, which a resume imports."""
    import yaml

    from tether.cli import main

    data = chat_data(tmp_path)
    out = tmp_path / "run"
    overrides = {
        "train.algo": "grpo",
        "rollout.tools": "tests.e2e.test_tools:multiply,tests.e2e.test_tools:negate",
        "rollout.max_turns": 2,
        "rollout.max_new_tokens": 4,
        "rollout.batch_size": 4,
        "train.steps": 1,
        "train.save_model": None,
        "train.checkpoint_every": 1,
    }
    assert main(tiny_run_args(qwen3_dir, data, out, overrides, command=True)) == 0
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["rollout"]["tools"] == ["tests.e2e.test_tools:multiply", "tests.e2e.test_tools:negate"]
    said = capsys.readouterr()
    longest = int(re.search(r"rollout.max_prompt_tokens=(\d+)", said.out + said.err).group(1))
    assert longest > 800  # the schemas are in the prompt (the bare one: 10 tokens)
    assert main(["train", "--resume", str(out), "train.steps=2"]) == 0
    assert [r["step"] for r in metric_rows(out)] == [0, 1]
    warned = [json.loads(x) for x in (out / "warnings.jsonl").read_text().splitlines()]
    assert any("the policy called no tool in the 2 steps" in w["message"] for w in warned), warned


def test_a_model_whose_template_cannot_carry_tools_is_refused_before_loading(
    chat_model_dir, tmp_path, capsys
):
    """ChatML without tool support (it renders no tool_calls): refused before the run folder is kept."""
    from tether.cli import main

    data = chat_data(tmp_path)
    out = tmp_path / "run"
    overrides = {
        "train.algo": "grpo",
        "rollout.tools": "tests.e2e.test_tools:multiply",
        "rollout.max_turns": 2,
    }
    assert main(tiny_run_args(chat_model_dir, data, out, overrides, command=True)) != 0
    assert "drops part of a tool exchange" in capsys.readouterr().err
    assert not out.exists()


class Shop:
    """An environment object as TRL's environment_factory takes it: reset(**row), a public method
    as the row's tool, get_reward()."""

    def __init__(self):
        self.bought: list[str] = []
        self.budget = 0

    def reset(self, prompt, budget, **kwargs) -> str:
        self.bought, self.budget = [], int(budget)
        return f" You have {self.budget} coins."

    def buy(self, item: str) -> str:
        """Buy an item.

        Args:
            item: The item's name.
        """
        if len(self.bought) >= self.budget:
            raise RuntimeError("no coins left")
        self.bought.append(item)
        return f"bought {item}"

    def get_reward(self) -> float:
        return float(len(self.bought))

    def _private(self) -> None:
        """Not a tool (TRL skips names that start with _)."""


SHOP_TURNS = [
    '<tool_call>\n{"name": "buy", "arguments": {"item": "tea"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "buy", "arguments": {"item": "jam"}}\n</tool_call><|im_end|>',
    "Done.<|im_end|>",
]


def test_environment_factory_episode_equals_trls(qwen3_dir, monkeypatch):
    """One object per row, reset with its row (the observation appended to the prompt as TRL
    appends it), its methods the row's tools: the same ids, masks and messages as TRL's loop run
    with that object's methods; the object's state after the rollout is the reward's."""
    import tether.models.turns as turns_module
    from tether.models.tools import FactoryEnv

    tok = load(qwen3_dir)
    env = FactoryEnv(Shop)
    assert list(env.tools) == ["buy"]  # reset, get_reward and _private are not tools
    set_template_kwargs(tok, {"tools": env.schemas})
    script = iter(tok(x, add_special_tokens=False)["input_ids"] for x in SHOP_TURNS)

    def scripted(lm, ids, mask, *, max_new_tokens, **kwargs):
        row = next(script)
        return torch.tensor([row]), torch.zeros(1, len(row))

    monkeypatch.setattr(turns_module, "sample_tokens", scripted)
    lm = make_tiny_llama(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    settings = SamplingSettings(max_new_tokens=4096, temperature=1.0, max_turns=4, env_timeout=None)
    r = turns_module.generate_turns(
        lm, tok, [PROMPT], env, settings=settings, seeds=[0], columns={"budget": [1]}
    )
    shown = [{"role": "user", "content": PROMPT[0]["content"] + " You have 1 coins."}]
    assert r.prompts == [shown]  # the reward's prompts, as TRL's
    trl_shop = Shop()
    trl_shop.reset(prompt=PROMPT, budget=1)
    p_ids, c_ids, trl_mask, trl_messages, calls, failures = trl_tool_episode(
        load(qwen3_dir), [trl_shop.buy], shown, SHOP_TURNS
    )
    assert r.prompt_ids[0][r.prompt_mask[0].bool()].tolist() == p_ids
    assert r.response_ids[0].tolist() == c_ids and r.response_mask[0].tolist() == [bool(m) for m in trl_mask]
    assert r.messages[0] == trl_messages
    assert trl_messages[2] == {"role": "tool", "name": "buy", "content": "{'error': 'no coins left'}"}
    assert r.environments[0].bought == trl_shop.bought == ["tea"] and (calls, failures) == (2, 1)
    assert env.rewards(environments=r.environments) == [1.0]


def shop_spent(prompts, completions, environments, **kwargs) -> list[float]:
    """A TRL-style reward reading the rows' environment objects."""
    return [-0.5 * len(e.bought) for e in environments]


def test_train_with_environment_factory_end_to_end(qwen3_dir, tmp_path, monkeypatch):
    """``tether.train(config, environment_factory=Shop, reward_funcs=[...])``: the rows' objects
    are reset with their rows, their methods called, ``environments`` reaches the reward, and
    ``get_reward`` is a reward of its own (``reward/Shop``, weight 1)."""
    import yaml

    import tether
    import tether.models.turns as turns_module
    from tether.run.config import load_config

    tok = load(qwen3_dir)
    answer = tok.convert_tokens_to_ids("<tool_response>")
    script = [tok(x, add_special_tokens=False)["input_ids"] for x in SHOP_TURNS]

    def scripted(lm, ids, mask, *, max_new_tokens, **kwargs):
        rows = [script[min(1, int((row == answer).sum()))][:max_new_tokens] for row in ids]
        width = max(len(r) for r in rows)
        return torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows]), torch.zeros(
            len(rows), width
        )

    monkeypatch.setattr(turns_module, "sample_tokens", scripted)
    data = tmp_path / "shop.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"buy {i}"}], "budget": 2} for i in range(12)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    overrides = {
        "train.algo": "grpo",
        "rollout.max_turns": 3,
        "rollout.max_new_tokens": 300,
        "rollout.batch_size": 4,
        "train.steps": 1,
        "reward.scorer": None,
        "train.save_model": None,
    }
    config = load_config(None, tiny_run_args(qwen3_dir, data, out, overrides))
    run = tether.train(config, environment_factory=Shop, reward_funcs=[shop_spent])
    last = metric_rows(run)[-1]
    # each row bought tea and jam (budget 2): Shop's reward 2, shop_spent -1, the sum 1
    assert last["reward/Shop"] == 2 and last["reward/shop_spent"] == -1 and last["objective/scores"] == 1
    assert last["rollout/tool_calls"] == 2 and last["rollout/tool_failures"] == 0
    recorded = yaml.safe_load((run / "config.yaml").read_text())["rollout"]
    assert recorded["environment_factory"] == "(from Python) tests.e2e.test_tools:Shop"
    with pytest.raises(ValueError, match="environment_factory names a factory that was passed from Python"):
        tether.train(load_config(run / "config.yaml", []), resume=True, reward_funcs=[shop_spent])


def test_environment_factory_refusals():
    from tether.models.tools import FactoryEnv

    class NoReset:
        def act(self, x: int) -> int:
            """Act.

            Args:
                x: a number.
            """
            return x

    with pytest.raises(ValueError, match="NoReset has no reset method"):
        FactoryEnv(NoReset)
    with pytest.raises(ValueError, match="a dict of several environments is not supported"):
        FactoryEnv({"a": Shop})
    env = FactoryEnv(Shop)
    with pytest.raises(ValueError, match="not a conversation whose last message is text"):
        env.begin(["a text prompt"], {"budget": [1]})

    class Weird(Shop):
        def reset(self, **row):
            return 3

    with pytest.raises(ValueError, match=r"Weird.reset returned a int"):
        FactoryEnv(Weird).begin([PROMPT], {"budget": [1]})
    from tether.models.tools import load_environment_factory

    named = load_environment_factory("tests.e2e.test_tools:Shop", ["tests.e2e.test_tools:multiply"])
    assert list(named.tools) == ["multiply", "buy"] and named.has_reward
    with pytest.raises(ValueError, match=r"passed from Python.*environment_factory=\.\.\."):
        load_environment_factory("(from Python) tests.e2e.test_tools:Shop")


@pytest.mark.parametrize("as_text", [False, True])
def test_a_dpo_tools_column_gives_trls_tokens(qwen3_dir, tmp_path, as_text):
    """A conversational preference row with TRL's per-row ``tools`` column (a list of schemas, or
    its JSON text, which TRL parses) and ``chat_template_kwargs`` column: the prompt tokens and
    the chosen and rejected ids TRL's DPO tokenizes (its ``tokenize_fn``, the schemas rendered
    into the prompt, thinking off)."""
    from trl.data_utils import _tokenize, common_prefix_length

    from tether.models.sampling import prompt_texts
    from tether.trainers.dpo import read_pair_file

    tok = load(qwen3_dir)
    schemas = [tool_schema(multiply)]
    row = {
        "prompt": PROMPT,
        "chosen": [{"role": "assistant", "content": "12"}],
        "rejected": [{"role": "assistant", "content": "7"}],
        "tools": json.dumps(schemas) if as_text else schemas,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
    prompts, chosen, rejected = read_pair_file(str(tmp_path / "p.jsonl"), tok)
    kwargs = {"tools": schemas, "enable_thinking": False}  # TRL's apply_chat_template_kwargs
    p = _tokenize(tok, row["prompt"], add_generation_prompt=True, **kwargs)["input_ids"]
    pc = _tokenize(tok, row["prompt"] + row["chosen"], **kwargs)["input_ids"]
    pr = _tokenize(tok, row["prompt"] + row["rejected"], **kwargs)["input_ids"]
    n = min(common_prefix_length(p, pc), common_prefix_length(p, pr))
    assert (chosen[0].tolist(), rejected[0].tolist()) == (pc[n:], pr[n:])
    text = prompt_texts(tok, prompts)[0]
    assert tok(text, add_special_tokens=False)["input_ids"] == p and '"name": "multiply"' in text
    assert "<think>\n\n</think>" in text  # the row's enable_thinking=False reached the template


ODD_TURNS = [
    # arguments null (TRL: {}, the tool called), a list (TRL: the call raises, {"error": ...}), and
    # a tool that echoes a special token (tether: an error result, where TRL would append it)
    '<tool_call>\n{"name": "negate", "arguments": null}\n</tool_call>\n'
    '<tool_call>\n{"name": "multiply", "arguments": [3, 4]}\n</tool_call><|im_end|>',
    "Done.<|im_end|>",
]


def negate_nothing(a: int = 5) -> int:
    """Negate an integer.

    Args:
        a: The integer.
    """
    return -a


@pytest.mark.parametrize("thinking", [None, False])
def test_odd_calls_and_a_prefilled_turn_as_trl(qwen3_dir, monkeypatch, thinking):
    """Calls TRL's validation lets through (arguments null; arguments a list, which makes the call
    raise) handled as TRL handles them, with Qwen3's thinking off too (its template prefills the
    opened turn with an empty think block, data.chat_template_kwargs), token for token."""
    negate = negate_nothing
    negate.__name__ = "negate"
    tools = [multiply, negate]
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    p_ids, c_ids, trl_mask, trl_messages, calls, failures = trl_tool_episode(
        load(qwen3_dir), tools, PROMPT, ODD_TURNS, template_kwargs=kwargs
    )
    r = tether_tool_episode(load(qwen3_dir), tools, PROMPT, ODD_TURNS, monkeypatch, template_kwargs=kwargs)
    assert r.prompt_ids[0][r.prompt_mask[0].bool()].tolist() == p_ids
    assert r.response_ids[0].tolist() == c_ids and r.response_mask[0].tolist() == [bool(m) for m in trl_mask]
    assert r.messages[0] == trl_messages
    assert trl_messages[1] == {"role": "tool", "name": "negate", "content": "-5"}
    assert "must be a mapping" in trl_messages[2]["content"] and (calls, failures) == (2, 1)
    assert (r.tool_calls, r.tool_failures) == ([2], [1])


def echo(text: str) -> str:
    """Repeat a text.

    Args:
        text: The text.
    """
    return text


def test_a_tool_output_with_special_tokens_is_the_calls_error(qwen3_dir, monkeypatch):
    """A tool that echoes ``<|im_start|>`` (the policy sampled it into its arguments): the call's
    result is an error (counted failed), the episode goes on; a sampled call never stops the run."""
    turns = [
        '<tool_call>\n{"name": "echo", "arguments": {"text": "a<|im_start|>b"}}\n</tool_call><|im_end|>',
        TURNS[2],
    ]
    r = tether_tool_episode(load(qwen3_dir), [echo], PROMPT, turns, monkeypatch)
    tool = r.messages[0][1]
    assert tool["name"] == "echo" and tool["content"].startswith("{'error': 'the output holds special tokens")
    assert (r.tool_calls, r.tool_failures) == ([1], [1]) and [m["role"] for m in r.messages[0]][
        -1
    ] == "assistant"


def test_text_prompts_with_tools_are_refused_naming_the_fix(qwen3_dir, monkeypatch):
    with pytest.raises(ValueError, match=r"rollout.tools needs prompts rendered by the chat template"):
        tether_tool_episode(load(qwen3_dir), TOOLS, "a text prompt", TURNS, monkeypatch)


def test_a_dpo_response_that_only_calls_a_tool_is_trls_tokens(qwen3_dir, tmp_path):
    """A chosen response that is an assistant turn with tool_calls and no content (TRL renders
    it): the same ids as TRL's DPO."""
    from trl.data_utils import _tokenize, common_prefix_length

    from tether.trainers.dpo import read_pair_file

    tok = load(qwen3_dir)
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    row = {
        "prompt": PROMPT,
        "chosen": [{"role": "assistant", "content": None, "tool_calls": [call]}],
        "rejected": [{"role": "assistant", "content": "7"}],
        "tools": [tool_schema(multiply)],
    }
    (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
    _, chosen, rejected = read_pair_file(str(tmp_path / "p.jsonl"), tok)
    kwargs = {"tools": row["tools"]}
    p = _tokenize(tok, row["prompt"], add_generation_prompt=True, **kwargs)["input_ids"]
    pc = _tokenize(tok, row["prompt"] + row["chosen"], **kwargs)["input_ids"]
    pr = _tokenize(tok, row["prompt"] + row["rejected"], **kwargs)["input_ids"]
    n = min(common_prefix_length(p, pc), common_prefix_length(p, pr))
    assert (chosen[0].tolist(), rejected[0].tolist()) == (pc[n:], pr[n:])
    assert "<tool_call>" in tok.decode(chosen[0].tolist())
