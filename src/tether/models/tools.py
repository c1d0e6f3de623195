"""TRL's tool convention: Python functions as the policy's tools, called from its own text.

A tool is a typed Python function with a Google-style docstring (TRL's ``tools=[multiply]``,
transformers' ``get_json_schema``). Its JSON schema goes into the prompt through the chat
template's ``tools`` variable; after each policy turn that the template's close ends
(``<|im_end|>``), the turn's tokens are parsed into a message with the tokenizer's response
parser (``tokenizer.parse_response``, a ``response_template`` the tokenizer ships, or the
Hermes ``<tool_call>{json}</tool_call>`` format tether recognizes by rendering one with the
template: Qwen2.5, Qwen3, Hermes, SmolLM3). Each call in it runs as ``fn(**arguments)``; one that
raises, names no tool or is not a function call becomes ``{"error": str(e)}`` as its result and
counts as a failure; every result becomes a tool message ``{"role": "tool", "name": name,
"content": str(result)}``; several calls in a turn become several messages, in order; a turn
without calls ends the episode. These are TRL 1.16's rules (``GRPOTrainer._tool_call_loop``).

The tool messages' tokens are what the template renders for them after a closed assistant turn
(:func:`tool_suffix_ids`, TRL's construction: the tokens after the close, from a conversation
whose assistant turn is a call to the first message's tool), so they never depend on how the
template would re-render the policy's own text. They are context, as any environment's: the
policy's tokens are never re-tokenized and ``response_mask`` is False on the tools' tokens
(:mod:`tether.models.turns`). The reward gets the messages: the parsed assistant turns (with
``tool_calls`` and ``reasoning_content`` where the parser finds them) and the named tool
messages, TRL's ``completions``.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence

from tether.models.callables import PASSED_FROM_PYTHON, awaited, import_callable

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
"""The Hermes format's tags around a call's JSON ``{"name": ..., "arguments": {...}}``."""

_SENTINEL_NAME, _SENTINEL_KEY, _SENTINEL_VALUE = "tool_name_q7", "tool_key_q7", "tool_value_q7"


class ToolReplies(list):
    """The tool messages answering one assistant turn (a list of ``{"role": "tool", "name",
    "content"}``), with ``calls`` (how many it answered) and ``failures`` (how many of those
    raised, named no tool, or were not function calls): TRL's ``tools/call_frequency`` and
    ``tools/failure_frequency`` count them."""

    calls: int = 0
    failures: int = 0


def tool_schema(fn: Callable) -> dict:
    """``fn``'s JSON schema as the chat template's ``tools`` takes it (transformers'
    ``get_json_schema``: its name, the docstring's description and ``Args:``, the type hints).

    Raises:
        ValueError: ``fn`` is not a function, or lacks what the schema needs (a type hint, a
            docstring, an argument's description), the function and the fix named.
    """
    from transformers.utils import get_json_schema

    name = getattr(fn, "__name__", type(fn).__name__)
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        raise ValueError(
            f"rollout.tools: {name!r} is a {type(fn).__name__}; a tool is a function (or a bound method) "
            "with type hints and a Google-style docstring, as TRL's tools=[...] takes"
        )
    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers' DocstringParsingException, TypeHintParsingException
        raise ValueError(
            f"rollout.tools: cannot describe the tool {name!r} to the model ({type(e).__name__}: {e}); "
            "give it a type hint for each parameter and a Google-style docstring with a line per "
            "parameter under Args:, as TRL's tools=[...] needs"
        ) from None


class ToolEnv:
    """The environment of a tool-calling run (``rollout.tools``, ``train(tools=[...])``): called
    after each assistant turn with the messages so far, it runs the last turn's ``tool_calls``
    and returns their :class:`ToolReplies`, or None (the episode ends) when the turn called none.

    Attributes:
        tool_calls: True: :func:`tether.models.turns.generate_turns` takes a tool-calling run's
            turns through :class:`tether.models.turns.ToolCalls`.
        tools: name -> function.
        schemas: the functions' JSON schemas, in order (the chat template's ``tools``).
    """

    tool_calls = True

    def __init__(self, tools: Sequence[Callable]):
        tools = list(tools)
        if not tools:
            raise ValueError("rollout.tools is empty; name at least one tool, or leave rollout.tools unset")
        self.schemas = [tool_schema(fn) for fn in tools]
        self.tools: dict[str, Callable] = {}
        for fn, schema in zip(tools, self.schemas):
            name = schema["function"]["name"]
            if name in self.tools:
                raise ValueError(
                    f"rollout.tools: two tools are named {name!r}; the policy calls a tool by its name, so "
                    "give each a name of its own"
                )
            self.tools[name] = fn
        self.__qualname__ = "tools[" + ",".join(self.tools) + "]"
        self.__module__ = __name__

    def __call__(self, prompt, completion, turn, _row: int | None = None, **columns) -> ToolReplies | None:
        """The tool messages answering the last turn's calls, or None where it calls none
        (``_row``: the row's index in the batch, which :class:`FactoryEnv` reads)."""
        calls = completion[-1].get("tool_calls") if completion else None
        if not calls:
            return None
        replies = ToolReplies()
        for call in calls:
            name, result, failed = self.run(call)
            replies.calls += 1
            replies.failures += failed
            replies.append({"role": "tool", "name": name, "content": str(result)})
        return replies

    def run(self, call: dict) -> tuple[str, object, bool]:
        """One call: ``(name, result, failed)``. ``fn(**arguments)``, awaited when ``async
        def``; TRL's rules where it cannot run: a call that is not ``{"type": "function"}``, a
        name that is no tool, or a tool that raises an ``Exception`` gives ``{"error": ...}``
        and ``failed``. ``SystemExit`` and ``KeyboardInterrupt`` are not caught (the rollout then
        fails: :func:`tether.models.turns.call_env`)."""
        if call.get("type") != "function":
            return (
                call.get("name", "unknown"),
                {"error": f"Unsupported tool call type: {call.get('type')}"},
                True,
            )
        function = call.get("function") or {}
        name = function.get("name")
        try:
            if name not in self.tools:
                raise ValueError(f"Tool {name} not found.")
            return name, awaited(self.tools[name](**function.get("arguments", {}))), False
        except Exception as e:
            return name, {"error": str(e)}, True


class FactoryEnv(ToolEnv):
    """TRL's ``environment_factory``: an object per rollout row, made by ``factory()`` and kept in
    a pool across steps (TRL's "construct once, reset often"), whose public methods are the row's
    tools beside ``tools``. Before a batch is sampled, :meth:`begin` calls each row's
    ``reset(**row)`` (the row's ``prompt`` and dataset columns); text it returns is appended to
    the prompt's last message, as TRL does. A class with ``get_reward()`` gives a reward of its own
    (:meth:`rewards`, weight 1, named after the class); every reward function gets the row's
    objects as ``environments`` (TRL's keyword).

    Raises:
        ValueError: ``factory`` is not callable, its object has no ``reset``, or a method cannot
            be described as a tool (:func:`tool_schema`), each naming the fix.
    """

    def __init__(self, factory: Callable, tools: Sequence[Callable] = ()):
        if not callable(factory) or isinstance(factory, dict):
            raise ValueError(
                "environment_factory takes a class or a function making one environment object, got "
                f"{type(factory).__name__} (a dict of several environments is not supported: give one "
                "factory)"
            )
        self.factory = factory
        probe = factory()
        members = dict(inspect.getmembers(type(probe), predicate=inspect.isfunction))
        if "reset" not in members:
            raise ValueError(
                f"environment_factory: {type(probe).__qualname__} has no reset method; TRL calls "
                "reset(**row) on each rollout's environment before it samples"
            )
        self.methods = [m for m in members if m not in ("reset", "get_reward") and not m.startswith("_")]
        self.has_reward = "get_reward" in members
        self.kind = type(probe)
        super().__init__([*tools, *(getattr(probe, m) for m in self.methods)])
        self.standalone = dict(list(self.tools.items())[: len(tools)])  # name -> function, named once
        self.pool = [probe]
        self.active: list = []
        self.__qualname__ = f"environment_factory[{self.kind.__qualname__}]"

    def begin(self, prompts: list, columns: dict[str, list]) -> list:
        """Reset one environment object per row (made when the pool runs short) with its row,
        ``reset(prompt=..., **columns)``; returns the prompts, each with the text ``reset``
        returned (if any) appended to its last message (TRL's rule).

        Raises:
            ValueError: ``reset`` returned something other than text or None, or a prompt that
                is not a conversation of text messages got an observation.
        """
        import copy

        while len(self.pool) < len(prompts):
            self.pool.append(self.factory())
        self.active = self.pool[: len(prompts)]
        out = []
        for i, (prompt, env) in enumerate(zip(prompts, self.active)):
            row = {"prompt": copy.deepcopy(prompt), **{k: copy.deepcopy(v[i]) for k, v in columns.items()}}
            observation = env.reset(**row)
            if observation is None:
                out.append(prompt)
                continue
            if not isinstance(observation, str):
                raise ValueError(
                    f"environment_factory: {self.kind.__qualname__}.reset returned a "
                    f"{type(observation).__name__}; it returns text to append to the prompt, or None"
                )
            if not (isinstance(prompt, list) and prompt and isinstance(prompt[-1].get("content"), str)):
                raise ValueError(
                    "environment_factory: reset returned text to append to the prompt, and the prompt is "
                    "not a conversation whose last message is text; give conversational prompts"
                )
            out.append(prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}])
        return out

    def __call__(self, prompt, completion, turn, _row: int | None = None, **columns) -> ToolReplies | None:
        if _row is None:
            raise ValueError("environment_factory: a tool call came without its row")
        env = self.active[_row]
        self.tools = {
            **self.standalone,
            **{m: getattr(env, m) for m in self.methods},
        }
        return super().__call__(prompt, completion, turn, **columns)

    def rewards(self, environments=None, **kwargs) -> list[float | None]:
        """``get_reward()`` of each row's object (TRL's reward of an environment that owns it)."""
        return [awaited(e.get_reward()) if type(e) is self.kind else None for e in environments or []]


def load_tools(specs: Sequence[str | Callable]) -> ToolEnv:
    """The :class:`ToolEnv` of ``rollout.tools``: each ``module:function`` imported
    (:func:`tether.models.callables.import_callable`), or the function itself.

    Raises:
        ValueError: a spec that does not import, names an object passed from Python (pass it
            again: ``train(tools=[...])``), or a function that cannot be described
            (:func:`tool_schema`).
    """
    tools = []
    for spec in specs:
        if callable(spec):
            tools.append(spec)
        elif str(spec).startswith(PASSED_FROM_PYTHON):
            raise ValueError(
                "rollout.tools names a tool that was passed from Python "
                f"({spec.removeprefix(PASSED_FROM_PYTHON).strip()}), which config.yaml cannot rebuild: pass "
                "the tools again, tether.train(config, tools=[...]) (with resume=True to go on with a "
                "run), or name them, rollout.tools=[module:function, ...]"
            )
        else:
            tools.append(import_callable(str(spec), "rollout.tools"))
    return ToolEnv(tools)


def load_environment_factory(spec: str | Callable, tools: Sequence[str | Callable] = ()) -> FactoryEnv:
    """The :class:`FactoryEnv` of ``rollout.environment_factory`` (``module:Class``, or the
    factory itself) with ``rollout.tools`` beside its methods.

    Raises:
        ValueError: as :func:`load_tools`, for the factory too.
    """
    if not callable(spec):
        if str(spec).startswith(PASSED_FROM_PYTHON):
            raise ValueError(
                "rollout.environment_factory names a factory that was passed from Python "
                f"({str(spec).removeprefix(PASSED_FROM_PYTHON).strip()}), which config.yaml cannot rebuild: "
                "pass it again, tether.train(config, environment_factory=...) (with resume=True to go on "
                "with a run), or name it, rollout.environment_factory=module:Class"
            )
        spec = import_callable(str(spec), "rollout.environment_factory")
    return FactoryEnv(spec, load_tools(tools).tools.values() if tools else ())


def tool_specs(tools: Sequence[Callable]) -> list[str]:
    """What config.yaml records for tools passed from Python: ``(from Python) module:name``."""
    return [
        f"{PASSED_FROM_PYTHON} {getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
        for fn in tools
    ]


def sentinel_conversation() -> list[dict]:
    """A user message, an assistant turn calling a tool, the tool's answer (TRL's
    ``supports_tool_calling`` probe): what a template must render whole to carry tools."""
    call = {
        "type": "function",
        "function": {"name": _SENTINEL_NAME, "arguments": {_SENTINEL_KEY: _SENTINEL_VALUE}},
    }
    return [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": _SENTINEL_NAME, "content": "tool_content_q7"},
    ]


def hermes_response_template(anchor: str, close: str) -> dict:
    """A transformers ``response_template`` for the Hermes format: optional ``<think>``
    reasoning, then the content, then ``<tool_call>{json}</tool_call>`` blocks, up to the
    template's ``close`` (``<|im_end|>``); ``anchor`` is the text that opens an assistant turn
    (``<|im_start|>assistant\\n``), where the parser starts reading the prompt's prefill."""
    import re

    return {
        "defaults": {"role": "assistant"},
        "start_anchor": anchor,
        "fields": {
            "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
            "tool_calls": {
                "open": TOOL_CALL_OPEN,
                "close_pattern": re.escape(TOOL_CALL_CLOSE) + r"\s*",
                "repeats": True,
                "content": "json",
                "transform": {"type": "function", "function": "{content}"},
            },
            "content": {"close_pattern": re.escape(close) + r"\s*", "content": "text"},
        },
    }


def check_tool_template(tokenizer, *, close_id: int, render) -> None:
    """That ``tokenizer``'s chat template carries tools and that their calls can be parsed from
    the policy's text: a tool call and a tool message rendered whole (TRL's
    ``supports_tool_calling``), and a response parser, the tokenizer's own or, for a template
    that renders calls in the Hermes format, :func:`hermes_response_template` set on it (as
    TRL's ``add_response_schema`` sets one for the templates it knows).

    Args:
        close_id: the id that closes an assistant turn (``<|im_end|>``).
        render: ``render(messages, add_generation_prompt=...)``, the run's chat rendering.

    Raises:
        ValueError: the template drops or refuses a part of the tool exchange, or renders calls in a
            format tether does not know and the tokenizer has no response parser (the fixes named).
    """
    try:
        text = render(sentinel_conversation(), add_generation_prompt=False)
    except Exception as e:
        raise ValueError(
            f"rollout.tools: the chat template of model.name cannot render a tool call and its answer "
            f"({type(e).__name__}: {e}); use a model whose template takes tools (Qwen2.5, Qwen3, "
            "Llama 3.1 ...)"
        ) from None
    missing = [
        s for s in (_SENTINEL_NAME, _SENTINEL_KEY, _SENTINEL_VALUE, "tool_content_q7") if s not in text
    ]
    if missing:
        raise ValueError(
            "rollout.tools: the chat template of model.name drops part of a tool exchange (it renders no "
            f"{missing[0]!r}), so the policy would never see its tools' calls or answers; use a model whose "
            "template takes tools (Qwen2.5, Qwen3, Llama 3.1 ...)"
        )
    if getattr(tokenizer, "response_template", None) is not None or getattr(
        tokenizer, "response_schema", None
    ):
        return
    call = json.dumps({"name": _SENTINEL_NAME, "arguments": {_SENTINEL_KEY: _SENTINEL_VALUE}})
    hermes = f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"
    if hermes not in text:
        raise ValueError(
            "rollout.tools: the chat template of model.name writes tool calls in a format tether does not "
            "parse, and its tokenizer has no response parser; set tokenizer.response_template (transformers' "
            "response parsing, or TRL's trl.chat_template_utils.add_response_schema(tokenizer)) and pass it, "
            "train(..., tokenizer=tokenizer)"
        )
    user = render([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    opened = render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    opening = opened[len(user) :] if opened.startswith(user) else ""
    anchor = opening.split("\n")[0] + "\n" if "\n" in opening else opening
    if not anchor.strip():
        raise ValueError(
            "rollout.tools: the chat template of model.name opens an assistant turn with no text of its "
            "own, so a response parser cannot tell where the turn starts; set tokenizer.response_template "
            "and pass it"
        )
    close = tokenizer.convert_ids_to_tokens(int(close_id))
    tokenizer.response_template = hermes_response_template(anchor, close)


def assistant_close_id(tokenizer, *, render) -> int | None:
    """The id the chat template writes right after an assistant's text (``<|im_end|>``): where a
    tool-calling turn ends. Read from a conversation of one user and one assistant message, so a
    template that prefills the opened turn (Qwen3's empty think block with
    ``enable_thinking=false``) or re-renders earlier turns gives it as well; None where the text
    is followed by no token of its own."""
    content = "2 + 3 ="
    text = render(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}],
        add_generation_prompt=False,
    )
    at = text.rfind(content)
    if at < 0:
        return None
    head = tokenizer(text[: at + len(content)], add_special_tokens=False)["input_ids"]
    full = tokenizer(text, add_special_tokens=False)["input_ids"]
    return full[len(head)] if full[: len(head)] == head and len(full) > len(head) else None


def parse_turn(tokenizer, ids: list[int], *, prefix: list[int], schemas: list[dict]) -> dict:
    """One assistant turn's tokens as a message, TRL's ``parse_response``:
    ``tokenizer.parse_response(ids, prefix=..., tools=...)``, the EOS text stripped from the
    content, an empty content as ``""``; a turn the parser cannot read (a call without a name) is its
    decoded text (special tokens skipped) as the content, with no ``tool_calls``.

    Args:
        ids: the turn's token ids (its close included).
        prefix: the token ids before it (the prompt, the earlier turns and tool messages).
        schemas: the tools' schemas (arguments typed by them).
    """
    try:
        if getattr(tokenizer, "response_template", None) is not None:
            parsed = tokenizer.parse_response(ids, prefix=prefix, tools=schemas)
        else:
            parsed = tokenizer.parse_response(ids)
        if parsed is None:
            raise ValueError("no message parsed")
        if isinstance(parsed.get("content"), str) and tokenizer.eos_token:
            parsed["content"] = parsed["content"].removesuffix(tokenizer.eos_token)
        if not parsed.get("content"):
            parsed["content"] = ""
        calls = parsed.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise ValueError("tool_calls must be a list")
        for call in calls or []:  # TRL's checks: a name; arguments None or missing are {}
            if not isinstance(call, dict):
                raise ValueError("a tool call that is not an object")
            function = call["function"] if "function" in call else call
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError("a tool call without a name")
            if function.get("arguments") is None:
                function["arguments"] = {}
    except (ValueError, TypeError, json.JSONDecodeError):
        parsed = {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    return parsed


def tool_suffix_ids(tokenizer, messages: list[dict], *, close_id: int, render) -> list[int]:
    """The token ids the chat template puts after a closed assistant turn for the tool
    ``messages`` and the next assistant turn's opening (TRL's ``_get_tool_suffix_ids``): in the
    ids of ``[user, assistant calling messages[0]'s tool] + messages`` rendered with the
    generation prompt, those after the assistant's close (the ``close_id`` that ends its turn:
    the first after the user's message), e.g.
    ``"\\n<|im_start|>user\\n<tool_response>\\n12\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"``.
    Only the tokens after the close are taken, so a template that renders the assistant's own
    turn otherwise once tool messages follow (Qwen3 drops an empty ``<think>`` block from it) gives
    the same tokens as one that does not; the policy's turn is never re-rendered.

    Raises:
        ValueError: the template renders the user's message otherwise once the conversation
            goes on, or writes no ``close_id`` after the assistant's turn: the tools' tokens would
            not continue a closed turn.
    """
    call = {"type": "function", "function": {"name": messages[0]["name"], "arguments": {}}}
    user = [{"role": "user", "content": "dummy"}]
    head = user + [{"role": "assistant", "content": "", "tool_calls": [call]}]

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    opening = ids(render(user, add_generation_prompt=False))
    full = ids(render(head + messages, add_generation_prompt=True))
    closes = [i for i, t in enumerate(full) if t == close_id and i >= len(opening)]
    if full[: len(opening)] != opening or not closes:
        raise ValueError(
            "rollout.tools: the chat template of model.name does not render a conversation's first "
            "message the same once an assistant's tool call and its answer follow, or closes the "
            "assistant's turn with no end id, so the tools' tokens would not continue the policy's turn"
        )
    return full[closes[0] + 1 :]
