"""Multi-turn rollouts: the policy writes, an environment answers, the policy goes on.

A policy turn ends at an end id (the episode ends) or at a stop string (``rollout.stop_strings``,
e.g. a tool call's closing tag); the environment function then gets the transcript so far and
returns the text to append (a tool's output), or None to end the episode. Its tokens are
appended as context: policy and reference score them alike, and ``response_mask`` is False on
them, so no KL, entropy, policy or value loss counts them (a mask with holes: discounting across
them is by policy step, :func:`tether.core.advantages.gae`). The record keeps which tokens the
environment wrote (:attr:`tether.models.sampling.Rollout.env_mask`).

Each turn is one :func:`tether.models.sampling.sample_tokens` call from the token ids so far (the
policy's own tokens are never re-tokenized), with the row's seed hashed with the turn's number, so
a row's sample still depends only on (run seed, step, sample index).

Two formats (``rollout.env_format``). **raw**: the environment's text is appended as it is, and an
end id ends the episode. **chat** (a prompt rendered by the chat template: a conversation, or
``data.chat_template``): a policy turn is an assistant message, ended by an end id or a stop
string; the environment gets the messages so far and its text becomes a ``tool`` message, whose
tokens are what the template renders between the assistant's text and the next assistant turn
(:func:`chat_reply_text`: the closing of the assistant's message, the tool message, the opening
of the next assistant turn), as TRL's tool loop builds them; the reward gets the messages, TRL's
``completions`` of a tool-calling run.

Built as verl's tool loop is: one :class:`Episode` per row (its tokens, policy flags, log-probs,
replies and status), one :class:`TurnFormat` object for the format (:class:`RawText`,
:class:`ChatTemplate`: the only places the two differ), a :class:`ToolLoop` that takes the
episodes through their turns, and the :class:`Rollout` assembled from the episodes
(:func:`assemble`). Training, evaluation and the frontier reach it through
:class:`tether.models.rollouts.ToolTurns`.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tether.models.callables import (
    PASSED_FROM_PYTHON,
    Abandoned,
    SignalStop,
    awaited,
    call_with_deadline,
    import_callable,
    running,
)
from tether.models.sampling import (
    CHAT_TEMPLATE_FLAG,
    EnvFormat,
    Rollout,
    SamplingSettings,
    end_token_ids,
    keyed_seed,
    new_text,
    render_chat,
    sample_tokens,
    stop_text,
    tokenize_prompts,
)
from tether.models.tools import assistant_close_id, check_tool_template, parse_turn, tool_suffix_ids

EnvFn = Callable[..., "str | None"]
"""``env(prompt=..., completion=..., turn=..., **columns) -> str | None``: the environment's text
after the policy's ``turn``-th turn (0-based), given the prompt and the response so far: as text
(raw format), or as messages (chat format: ``[{"role": "assistant", "content": ...}, {"role":
"tool", ...}, ...]``, the last the turn just written). It may be ``async def``; each call runs
on a worker thread, at most ``rollout.env_timeout`` seconds, or, with no limit, on the calling
thread (:func:`call_env`)."""

ENV_ARGUMENTS = ("prompt", "completion", "turn")
"""The keywords every environment call passes. A dataset column of one of these names is not
passed (a prompt-completion dataset's ``completion`` column, as TRL leaves its ``prompt`` and
``completion`` columns out of a reward function's keywords)."""

ENV_TEXT = "rollout.env's text"
"""How an error names a raw reply (:func:`continuation_ids`)."""

TOOL_ROLE = "tool"
"""The role of the environment's messages in the chat format (TRL's and transformers' role for a
tool's output)."""

SETTLE_CHARS = 4
"""Characters past a word's end (and past the whitespace after it) that a tokenizer's normalizer
and pre-tokenizer read to decide where the word ends: 2 for GPT-2's, Llama 3's and Qwen2's
patterns (``\\s+(?!\\S)`` keeps a run of spaces but its last when a word follows; a word may start
with one non-letter), 3 for the contractions they match first (``'ll``, ``'re``, ``'ve``), 3 for
Hangul jamo that NFC composes into one syllable; 4 covers each (:func:`reply_head`)."""

log = logging.getLogger(__name__)
_said: set[str] = set()  # the warnings said once per process


class EnvFailed(RuntimeError):
    """``rollout.env`` failed a rollout: it raised (``SystemExit`` and ``KeyboardInterrupt``
    included), did not answer within ``rollout.env_timeout``, was interrupted while it ran
    (``interrupted``: a second Ctrl-C), or answered with text that cannot be appended
    (:class:`EnvReplyError`). The step it ran in cannot finish; the training loop then writes the
    checkpoint of the step before (:func:`tether.run.lifecycle.raise_stopped_in_step`)."""

    def __init__(self, message: str, interrupted: bool = False):
        super().__init__(message)
        self.interrupted = interrupted

    def retold(self, message: str) -> EnvFailed:
        """The same error (its kind, ``interrupted``, its cause) told by ``message``: where it
        happened (``step 4: ...``), what was kept."""
        out = type(self)(message, self.interrupted)
        out.__cause__ = self.__cause__
        return out


class EnvReplyError(EnvFailed, ValueError):
    """``rollout.env`` answered with what cannot be appended exactly (not a string or None,
    special tokens, a text the tokenizer cannot append to the context verbatim): a ValueError as
    any refused value, and an :class:`EnvFailed`, as it ends the step."""


def load_env(spec: str | EnvFn) -> EnvFn:
    """The environment ``rollout.env`` names, ``module:function``
    (:func:`tether.models.callables.import_callable`: the working directory is on the path), or
    the callable itself when given one.

    Raises:
        ValueError: it cannot be imported or is not callable (the spec and the fix named); a run's
            environment that was passed from Python (``(from Python) ...``, which no spec rebuilds).
    """
    if callable(spec):
        return spec
    if spec.startswith(PASSED_FROM_PYTHON):
        raise ValueError(
            f"rollout.env names an environment that was passed from Python "
            f"({spec.removeprefix(PASSED_FROM_PYTHON).strip()}), which config.yaml cannot rebuild: pass it "
            "again, tether.train(config, env=...) (with resume=True to go on with a run), or name one, "
            "rollout.env=module:function (--resume RUN rollout.env=module:function)"
        )
    return import_callable(spec, "rollout.env")


def env_column_names(env: EnvFn, columns: Sequence[str]) -> list[str]:
    """The dataset columns an environment call passes: all of ``columns`` but
    :data:`ENV_ARGUMENTS` when ``env`` takes ``**kwargs``, else those it names.

    Raises:
        ValueError: ``env`` cannot take ``prompt``, ``completion`` and ``turn`` by keyword, or
            names a parameter without a default that no column fills (its signature and the fix
            named), so that a run refuses it before any weights load rather than at the first call.
    """
    names = [c for c in columns if c not in ENV_ARGUMENTS]
    try:
        params = inspect.signature(env).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature: passed all
        return names
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        names = [c for c in names if c in params]
    try:
        inspect.signature(env).bind(prompt=None, completion=None, turn=0, **dict.fromkeys(names))
    except TypeError as e:
        raise ValueError(
            f"rollout.env: {getattr(env, '__name__', env)!r}{inspect.signature(env)} cannot be "
            "called as env(prompt=..., completion=..., turn=..., **columns) with the dataset's "
            f"columns {sorted(names)} ({e}); give it those parameters (and **columns for the rest), "
            "or defaults for the ones no column fills"
        ) from None
    return names


SIGNAL_ON_A_THREAD = "signal only works in main thread"
"""The start of the ValueError Python raises when code sets a signal handler (``signal.signal``,
as a ``signal.alarm`` timeout does) on a thread other than the main one."""


def call_env(
    env: EnvFn, kwargs: dict, *, timeout: float | None, where: str, so_far, field: str = "rollout.env"
) -> str | None:
    """``env(**kwargs)``, awaited when it is ``async def``: with a ``timeout``, on a worker thread
    for at most that many seconds (:func:`tether.models.callables.call_with_deadline`), so that an
    environment that never answers ends the rollout instead of the run hanging; with none
    (``rollout.env_timeout=null``), on this thread, so that code that needs the main thread (a
    ``signal.alarm`` timeout of its own) works. Ctrl-C is heard while it runs either way (the first
    said, naming the call; a second ends it). ``where`` (``row 1 after turn 0``) and ``so_far``
    (the completion it got) name the call, ``field`` what the user set (``rollout.tools``).

    Raises:
        EnvFailed: it raised anything (``SystemExit`` and ``KeyboardInterrupt`` too: a tool's
            ``exit()`` would end the run silently; a signal handler set on the worker thread: the
            fix named), its deadline passed (``rollout.env_timeout`` named), or a signal ended the
            wait or the call (``interrupted``).
    """
    what = f"{field} ({where})"
    shown = f"completion so far {str(so_far)[-80:]!r}"
    try:
        if timeout is None:
            with running(what):
                return awaited(env(**kwargs))
        return call_with_deadline(
            lambda: env(**kwargs), timeout=timeout, what=what, limit_name="rollout.env_timeout"
        )
    except Abandoned as e:
        if e.interrupted:
            raise EnvFailed(f"stopped while waiting for {what}", interrupted=True) from None
        raise EnvFailed(
            f"{field} did not answer within rollout.env_timeout={timeout:g} s on {where} ({shown}); "
            "the call is left running on a thread of its own. Find what it waits on (a tool that calls a "
            "service: give it a timeout of its own), or raise rollout.env_timeout (null: no limit)"
        ) from None
    except SignalStop:  # a second Ctrl-C while it ran on this thread
        raise EnvFailed(f"stopped while waiting for {what}", interrupted=True) from None
    except (Exception, SystemExit, KeyboardInterrupt) as e:
        said = f": {e}" if str(e) else ""
        if isinstance(e, ValueError) and str(e).startswith(SIGNAL_ON_A_THREAD):
            said += (
                f". It sets a signal handler (signal.signal, as a signal.alarm timeout does), which Python "
                f"allows on the main thread only, and tether calls it on a worker thread to hold it to "
                f"rollout.env_timeout={timeout:g} s: drop its own timeout (tether enforces "
                "rollout.env_timeout itself), or set rollout.env_timeout=null to call it on the main thread, "
                "with no deadline"
            )
        raise EnvFailed(f"{field} raised {type(e).__name__} on {where} ({shown}){said}") from e


@functools.lru_cache(maxsize=8)
def longest_token_chars(tokenizer) -> int:
    """The most characters one token's text spans: the longest string in the vocabulary (a
    byte-level token's string holds one character per byte, a SentencePiece one ``▁`` per space,
    a byte-fallback one ``<0xE2>`` for less than a character, so no token spans more of the
    normalized text than its string's length)."""
    return max(1, max(len(t) for t in tokenizer.get_vocab()))


def normalized_length(tokenizer, text: str) -> int:
    """``text``'s length once the tokenizer's normalizer ran on it (NFC composes a letter and its
    accent into one character); its length where there is none or it cannot be run alone."""
    normalizer = getattr(getattr(tokenizer, "backend_tokenizer", None), "normalizer", None)
    return len(normalizer.normalize_str(text)) if normalizer is not None else len(text)


def word_ends(backend, text: str) -> list[int]:
    """Where each word of ``text`` ends (character offsets in ``text``), as the fast tokenizer
    ``backend`` splits it before its model runs: its normalizer, then its pre-tokenizer."""
    from tokenizers import PreTokenizedString

    words = PreTokenizedString(text)
    if backend.normalizer is not None:
        words.normalize(lambda n: backend.normalizer.normalize(n))
    if backend.pre_tokenizer is not None:
        backend.pre_tokenizer.pre_tokenize(words)
    return [end for _, (_, end), _ in words.get_splits(offset_referential="original", offset_type="char")]


def reply_head(tokenizer, text: str, budget: int) -> str:
    """The head of ``text`` whose tokens start as ``text``'s own: ``tokenize(head)[:budget] ==
    tokenize(text)[:budget]``, so that a long reply of which ``budget`` tokens are kept is never
    tokenized whole (a 1 MB tool output: seconds and hundreds of MB per reply).

    A fast tokenizer splits a text at its added tokens, normalizes and pre-tokenizes each part into
    words, and tokenizes each word alone. So the tokens of ``text[:c]`` are the first tokens of
    ``text``'s when ``c`` is where a word of ``text`` ends and nothing before ``c`` is split
    otherwise in ``text[:c]`` than in ``text``. A word of a window ``text[:w]`` is one of
    ``text``'s when the pipeline decided its end without reading past the window: when a
    non-space starter character (no accent to compose, no whitespace that a pattern such as
    ``\\s*[\\r\\n]+`` scans to its end) follows it with :data:`SETTLE_CHARS` more characters of the
    window after that. ``head`` ends at the last such word; it is returned once it holds at least
    ``budget`` tokens. The first window spans ``(budget + 1) x`` :func:`longest_token_chars`
    characters, so that it usually holds them; it doubles while it does not.

    ``text`` itself where no cut is proven: a slow tokenizer, an added token's text in the window,
    a window that grew to the whole text (one word longer than it: a pre-tokenizer that does not
    split, such as SentencePiece's ``split=False``, tokenizes the text whole).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    size = (budget + 1) * longest_token_chars(tokenizer) + SETTLE_CHARS
    if backend is None or len(text) <= size:
        return text
    added = [t for t in tokenizer.get_added_vocab() if t]
    reach = max((len(t) for t in added), default=0)  # an added token may start in the window
    while size < len(text):
        window = text[: size + reach]
        if any(t in window for t in added):  # split off first: where, the words do not tell
            return text
        last = size - SETTLE_CHARS - 1  # the last non-space starter with SETTLE_CHARS after it
        while last > 0 and (text[last].isspace() or unicodedata.category(text[last]).startswith("M")):
            last -= 1
        ends = [e for e in word_ends(backend, text[:size]) if e <= last]
        if ends and len(tokenizer(text[: ends[-1]], add_special_tokens=False)["input_ids"]) >= budget:
            return text[: ends[-1]]
        size *= 2
    return text


def say_once(key: str, message: str) -> None:
    """A warning said once per process (``key`` tells which), not once per row or step."""
    if key not in _said:
        _said.add(key)
        log.warning("%s (said once)", message)


def say_long_reply(reply: str, left: int, max_new_tokens: int, *, chat: bool) -> None:
    """Say, once, that a reply was longer than the tokens left for it (cut, or dropped in chat)."""
    kept = "dropped, ending the episode (a tool message is never cut)" if chat else "cut to them"
    say_once(
        f"long reply {chat}",
        f"tether: rollout.env answered with a reply of {len(reply):,} characters, longer than the {left} "
        f"token(s) left of rollout.max_new_tokens={max_new_tokens}: {kept}; only the part that can be "
        "kept is tokenized",
    )


def reply_text(tokenizer, reply, *, left: int, chat: bool, forbidden: set[int], where: str) -> str | None:
    """What of an environment's ``reply`` is tokenized when ``left`` tokens are left: a raw
    reply's :func:`reply_head` (its tokens begin as the whole reply's, of which ``left`` are kept),
    a chat reply whole, or None for a chat reply that surely does not fit (dropped untokenized:
    each token spans at most :func:`longest_token_chars` characters, so a reply of more than
    ``(left + 1)`` times as many normalized characters takes more than ``left`` tokens, with one
    for an accent that composes with the template's last character).

    Raises:
        EnvReplyError: not a string; a string that is not valid Unicode (a lone surrogate, which
            no tokenizer takes); special tokens (:func:`special_ids`) in the text tokenized.
    """
    if not isinstance(reply, str):
        raise EnvReplyError(
            f"rollout.env returned {type(reply).__name__} for {where}; "
            "it must return the text to append (a str) or None to end the episode"
        )
    try:
        reply.encode("utf-8")
    except UnicodeEncodeError as e:
        raise EnvReplyError(
            f"rollout.env returned text that is not valid Unicode for {where}: "
            f"{reply[e.start : e.end]!r} at character {e.start} ({e.reason}), which the tokenizer cannot "
            f"take ({reply[:80]!r}); return text that encodes as UTF-8 (a lone surrogate comes from "
            "bytes decoded with errors='surrogateescape' or a cut UTF-16 pair: decode with errors='replace')"
        ) from None
    if chat and normalized_length(tokenizer, reply) > (left + 1) * longest_token_chars(tokenizer):
        return None
    text = reply if chat else reply_head(tokenizer, reply, left)
    special = sorted(set(tokenizer(text, add_special_tokens=False)["input_ids"]) & forbidden)
    if special:  # '<eos>' or '<|im_end|>' in a tool's text would end or restructure the turn
        names = tokenizer.convert_ids_to_tokens(special)
        raise EnvReplyError(
            f"rollout.env returned text holding special tokens {names} "
            f"for {where} ({reply[:80]!r}); tether appends a tool's output as "
            "plain text: strip or escape them in the environment"
        )
    return text


def special_ids(tokenizer, ends: Sequence[int]) -> set[int]:
    """Ids a tool's text must not hold: the tokenizer's special tokens, every added token marked
    special (Llama 3's ``<|eom_id|>``, ``<|start_header_id|>`` are neither in
    ``all_special_ids``), and the end ids of generation (``generation_config.eos_token_id``)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return (
        set(tokenizer.all_special_ids)
        | {int(i) for i, t in added.items() if getattr(t, "special", False)}
        | {int(t) for t in ends}
    )


def continuation_ids(tokenizer, context: list[int], text: str, what: str) -> list[int]:
    """Token ids that continue ``context`` with exactly ``text``:
    ``decode(context + ids) == decode(context) + text``.

    ``text`` tokenized alone is tried first (exact for byte-level BPE). A SentencePiece
    (Metaspace) tokenizer adds a space to the start of a text tokenized alone (``"5"`` becomes
    ``"▁5"``) that :meth:`decode` hides at the start of a sequence but not after ``context``; then
    ``"\n" + text`` is tokenized and the ids of ``"\n"`` alone are cut from its start.

    Raises:
        ValueError: neither continues ``context`` with ``text`` (``what`` names the text): the
            appended tokens would not read as what the environment wrote.
    """

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def encode(t: str) -> list[int]:
        return tokenizer(t, add_special_tokens=False)["input_ids"]

    head = decode(context)
    ids = encode(text)
    if decode(context + ids) == head + text:
        return ids
    sentinel = encode("\n")
    framed = encode("\n" + text)
    if framed[: len(sentinel)] == sentinel:
        ids = framed[len(sentinel) :]
        if decode(context + ids) == head + text:
            return ids
    raise ValueError(
        f"{what} {text[:80]!r}: the tokenizer of model.name does not append it to the context exactly "
        f"(the context then reads {decode(context + encode(text))[len(head) - 20 :][:120]!r}); "
        + (
            "change the first characters of the environment's text"
            if what == ENV_TEXT
            else "change the first characters of the tool's reply, or use rollout.env_format=raw"
        )
    )


def turn_seed(seed: int, turn: int) -> int:
    """The seed of a row's ``turn``-th policy turn: its sample seed itself at turn 0 (a one-turn
    rollout samples what :func:`tether.models.sampling.generate` samples), then a hash of both."""
    return int(seed) if turn == 0 else keyed_seed("tether-turn", seed, turn)


def _stop_at(tokenizer, context: list[int], tokens: list[int], stop_strings: Sequence[str]) -> int | None:
    """The fewest of ``tokens`` whose text after ``context`` contains a stop string, or None
    (the text the sampler stopped on: :func:`tether.models.sampling.stop_text`)."""
    if not stop_strings:
        return None
    for k in range(1, len(tokens) + 1):
        text = stop_text(tokenizer, context, tokens[:k])
        if any(s in text for s in stop_strings):
            return k
    return None


def chat_turns(tokenizer, prompt, env_format: EnvFormat) -> bool:
    """Whether a row's turns go through the chat template: ``chat``, or ``auto`` and the prompt
    was rendered by it (a conversation, or any prompt with ``data.chat_template``).

    Raises:
        ValueError: ``chat`` for a text prompt the chat template did not render (the fix named).
    """
    if env_format not in ("auto", "chat", "raw"):
        raise ValueError(f"rollout.env_format={env_format!r}: choose auto, chat or raw")
    rendered = isinstance(prompt, list) or bool(getattr(tokenizer, CHAT_TEMPLATE_FLAG, False))
    if env_format == "chat" and not rendered:
        raise ValueError(
            f"rollout.env_format=chat needs prompts rendered by the chat template, and {str(prompt)[:60]!r} "
            "is a text prompt: use conversational prompts, data.chat_template=true, or rollout.env_format=raw"
        )
    return env_format != "raw" and rendered


def turn_formats(
    tokenizer, prompts: Sequence, env_format: EnvFormat, stop_strings: Sequence[str], max_turns: int
) -> list[bool]:
    """Whether each row's turns go through the chat template (:func:`chat_turns`), checked to be
    a format that can be exact.

    Raises:
        ValueError: the rows mix formats (the reward would get messages for some, text for
            others); raw rows without stop strings and ``max_turns > 1`` (an end id ends a raw
            episode, so the environment would never answer); each naming the fix.
    """
    chat = [chat_turns(tokenizer, p, env_format) for p in prompts]
    if any(chat) and not all(chat):
        raise ValueError(
            "the prompts mix conversations and texts, so rollout.env_format=auto would run some rows' turns "
            "through the chat template and others raw; make them all one kind, or set rollout.env_format=raw"
        )
    if chat and not chat[0] and not stop_strings and max_turns > 1:
        raise ValueError(
            "rollout.stop_strings is empty, and these turns are raw (text prompts the chat template does not "
            "render, or rollout.env_format=raw): a raw turn ends only at an end id, which ends the episode, "
            "so rollout.env would never answer. Name the text that ends a policy turn (e.g. "
            "rollout.stop_strings=['</call>']), or use conversational prompts or data.chat_template=true"
        )
    return chat


def tool_turn_formats(tokenizer, prompts: Sequence, env_format: EnvFormat) -> list[bool]:
    """:func:`turn_formats` of a tool-calling run (``rollout.tools``): every row's turns through
    the chat template, which carries the tools' schemas and calls.

    Raises:
        ValueError: a prompt the chat template does not render (the fix named).
    """
    chat = [chat_turns(tokenizer, p, env_format) for p in prompts]
    if not all(chat):
        raise ValueError(
            "rollout.tools needs prompts rendered by the chat template (conversations, or "
            "data.chat_template=true), which carries the tools' schemas and calls; these are text prompts "
            "the template does not render"
        )
    return chat


def prompt_messages(prompt) -> list[dict]:
    """A prompt as messages: a conversation is itself, a text one user message (as
    :func:`tether.models.sampling.prompt_texts` renders it with ``data.chat_template``)."""
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def chat_reply_text(tokenizer, history: list[dict], content: str, reply: str) -> str:
    """The text the chat template puts after an assistant's ``content`` for a tool's ``reply``:
    ``render(history + [assistant, tool], generation prompt) - render(history, generation
    prompt) - content``, e.g. ``"<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"``
    for ChatML.

    Args:
        history: the messages before the assistant's turn (the prompt's, earlier turns').
        content: the assistant's turn as the policy wrote it (its text, special tokens skipped).
        reply: the tool's text.

    Raises:
        ValueError: the template does not render the conversation so far followed by the
            assistant's text verbatim (it trims, reorders or drops some of it): appending the
            reply's tokens would not continue what the policy saw. The fix: rollout.env_format=raw.
    """
    before = render_chat(tokenizer, history, add_generation_prompt=True) + content
    turn = [{"role": "assistant", "content": content}, {"role": TOOL_ROLE, "content": reply}]
    try:
        after = render_chat(tokenizer, history + turn, add_generation_prompt=True)
    except Exception as e:  # a template that knows no tool role raises its own error
        raise ValueError(
            f"rollout.env_format=chat: the chat template of model.name cannot render a {TOOL_ROLE!r} "
            f"message ({type(e).__name__}: {e}); use rollout.env_format=raw"
        ) from e
    if not after.startswith(before):
        at = next((i for i, (x, y) in enumerate(zip(before, after)) if x != y), min(len(before), len(after)))
        raise ValueError(
            "rollout.env_format=chat: the chat template of model.name does not render the conversation "
            "so far and the assistant's text verbatim before a tool message (they first differ at "
            f"{before[max(0, at - 30) : at + 10]!r} against {after[max(0, at - 30) : at + 10]!r}), so "
            "the tool's tokens would not continue what the policy saw; use rollout.env_format=raw"
        )
    return after[len(before) :]


def chat_closing_id(tokenizer, history: list[dict], content: str) -> int | None:
    """The first token the chat template writes after an assistant's ``content`` when a tool
    message follows (ChatML's ``<|im_end|>``): the end id that closes an assistant's turn. None
    when the template writes nothing there."""
    ids = tokenizer(chat_reply_text(tokenizer, history, content, ""), add_special_tokens=False)["input_ids"]
    return ids[0] if ids else None


def check_chat_turns_close(tokenizer, prompt, ends: Sequence[int], stop_strings: Sequence[str]) -> None:
    """Chat turns without stop strings end only at an end id, so the environment answers only if
    the id the template closes an assistant's message with (:func:`chat_closing_id`) is one.

    Raises:
        ValueError: no stop strings, and the template's close is not among ``ends`` (a Qwen base
            model's ``<|im_end|>`` where its generation config lists only ``<|endoftext|>``): a
            turn would go on past the close, end at another end id, which ends the episode, and
            the environment would never be called. The fixes named.
    """
    if stop_strings:
        return
    close = chat_closing_id(tokenizer, prompt_messages(prompt), "2 + 3 =")
    if close is None or int(close) not in {int(e) for e in ends}:
        name = tokenizer.convert_ids_to_tokens(int(close)) if close is not None else None
        raise ValueError(
            f"rollout.stop_strings is empty, and the chat template closes an assistant's message with "
            f"{name!r} (id {close}, the first token it writes after the assistant's text), which is not an "
            f"end id of generation {list(ends)} (the tokenizer's EOS "
            "and the model's generation_config.eos_token_id): a policy turn would not end there, so "
            "rollout.env would never answer. Name the text that ends a policy turn in rollout.stop_strings, "
            "or add the id to the model's generation_config.eos_token_id"
        )


@dataclass
class Episode:
    """One row's episode as the turns build it: verl's per-episode record (its tool loop's
    ``AgentData``), from which :func:`assemble` makes the row of the :class:`Rollout`.

    Attributes:
        row: the row's index in the batch (named by an error: ``row 1 after turn 0``).
        prompt: its prompt, a text or a conversation (what the environment gets, copied).
        prompt_ids: its prompt's token ids, padding left out.
        seed: its sample seed; turn ``t`` is sampled with :func:`turn_seed` of it.
        columns: its dataset columns that the environment takes (:func:`env_column_names`).
        tokens: the response's token ids so far, the policy's and the environment's in order.
        policy: one flag per token of ``tokens``: True where the policy sampled it.
        logprobs: one per token of ``tokens``: the sampler's log-probability (nats) of a policy
            token, 0 on the environment's.
        replies: the environment's texts, in order (a raw row's as appended, maybe cut).
        offsets: a raw row's, where each of ``replies`` starts in its transcript (characters).
        messages: a chat row's response as messages (assistant turns, tool messages).
        ended: the episode ended on its own (an end id, the environment's None), not at a limit.
        done: no turn follows (ended, or cut at a limit).
        tool_calls: a tool-calling row's calls run (:class:`ToolCalls`).
        tool_failures: how many of them failed (:class:`tether.models.tools.ToolReplies`).
    """

    row: int
    prompt: object
    prompt_ids: list[int]
    seed: int
    columns: dict
    tokens: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    ended: bool = False
    done: bool = False
    tool_calls: int = 0
    tool_failures: int = 0

    @property
    def context(self) -> list[int]:
        """The ids the next token follows: the prompt's (unpadded), then the response's so far."""
        return self.prompt_ids + self.tokens

    def append(self, ids: list[int], logprobs: list[float] | None = None) -> None:
        """Append the policy's ``ids`` with their ``logprobs``, or (``logprobs`` None) the
        environment's, whose log-probability is 0 and whose ``policy`` flag is False."""
        self.tokens += ids
        self.policy += [logprobs is not None] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)


class TurnFormat:
    """How a row's turns join its response (``rollout.env_format``): :class:`RawText` or
    :class:`ChatTemplate`, one object per call of :func:`generate_turns` (the rows never mix
    formats, :func:`turn_formats`). The loop (:class:`ToolLoop`) calls it at each point where the
    formats differ; the rest of a turn is the same for both.

    Attributes:
        chat: whether the turns go through the chat template (what :func:`reply_text` checks).
        end_id_ends_episode: whether a policy turn that ends at an end id ends the episode (raw),
            or only the turn (chat: the end id closes an assistant message).
    """

    chat: bool
    end_id_ends_episode: bool

    def __init__(self, tokenizer, ends: Sequence[int], max_new_tokens: int):
        self.tokenizer, self.ends, self.max_new_tokens = tokenizer, ends, max_new_tokens

    def turn_written(self, ep: Episode, content: str, n: int) -> None:
        """A policy turn was appended to ``ep``: its last ``n`` tokens (``content``: their text,
        end ids left out)."""
        raise NotImplementedError

    def checked_reply(self, reply, *, left: int, forbidden: set[int], where: str):
        """What of the environment's ``reply`` is tokenized (:func:`reply_text`), or None where
        it surely does not fit the ``left`` tokens."""
        return reply_text(self.tokenizer, reply, left=left, chat=self.chat, forbidden=forbidden, where=where)

    def completion(self, ep: Episode, at_end: bool) -> str | list[dict] | None:
        """What the environment gets after a policy turn (``at_end``: it ended at an end id), or
        None where the episode ends there without asking it."""
        raise NotImplementedError

    def reply_ids(
        self, ep: Episode, reply: str, text: str | None, *, left: int, at_end: bool
    ) -> list[int] | None:
        """The ids that append the environment's ``reply`` (``text``: the part :func:`reply_text`
        tokenizes) when ``left`` tokens are left, recorded in ``ep``; None where it is dropped."""
        raise NotImplementedError

    def text(self, ep: Episode) -> str:
        """The row's response as the reward reads it."""
        raise NotImplementedError

    def env_offsets(self, ep: Episode, text: str) -> list[int] | None:
        """Where the environment's replies start in ``text`` (characters), or None."""
        raise NotImplementedError


class RawText(TurnFormat):
    """The raw format (module docstring): the environment's text appended as it is (cut to the
    tokens left), and an end id ends the episode; the reward reads the transcript as text."""

    chat = False
    end_id_ends_episode = True

    def turn_written(self, ep: Episode, content: str, n: int) -> None:
        """Nothing to record: the transcript is the tokens."""

    def completion(self, ep: Episode, at_end: bool) -> str | None:
        """What the environment gets after a policy turn: the response so far, as text."""
        return self.tokenizer.decode(ep.tokens, skip_special_tokens=True)

    def reply_ids(self, ep: Episode, reply: str, text: str | None, *, left: int, at_end: bool) -> list[int]:
        """The ids that append ``reply`` (of which ``text`` was tokenized, :func:`reply_text`),
        cut to the ``left`` tokens left (said once); the reply recorded as appended, and where it
        starts in the transcript.

        Raises:
            ValueError: ``text`` cannot be appended exactly (:func:`continuation_ids`).
        """
        context = ep.context
        env_ids = continuation_ids(self.tokenizer, context, text, ENV_TEXT)
        if len(env_ids) > left or text != reply:
            say_long_reply(reply, left, self.max_new_tokens, chat=False)
        env_ids = env_ids[:left]
        # as appended (maybe cut), a SentencePiece word-start space kept
        ep.replies.append(new_text(self.tokenizer, context, env_ids, skip_special_tokens=True))
        ep.offsets.append(len(self.text(ep)))
        return env_ids

    def text(self, ep: Episode) -> str:
        """The row's transcript (end ids and special tokens left out): what the reward reads."""
        return self.tokenizer.decode([t for t in ep.tokens if t not in self.ends], skip_special_tokens=True)

    def env_offsets(self, ep: Episode, text: str) -> list[int] | None:
        """Where the replies stand in ``text``; None where the text does not hold them there (a
        decoding that is not local)."""
        return ep.offsets if all(text[o : o + len(r)] == r for o, r in zip(ep.offsets, ep.replies)) else None


class ChatTemplate(TurnFormat):
    """The chat format (module docstring): a policy turn is an assistant message, the
    environment's text a tool message whose tokens are the template's framing (never cut: one that
    does not fit is dropped), and an end id closes the turn, not the episode; the reward reads
    the messages."""

    chat = True
    end_id_ends_episode = False

    def turn_written(self, ep: Episode, content: str, n: int) -> None:
        ep.messages.append({"role": "assistant", "content": content})

    def history(self, ep: Episode) -> list[dict]:
        """The messages before the assistant's last turn: the prompt's, then earlier turns'."""
        return prompt_messages(ep.prompt) + ep.messages[:-1]

    def completion(self, ep: Episode, at_end: bool) -> list[dict] | None:
        """The messages so far (copies), or None where the policy ended its turn with an end id
        that is not the template's close of an assistant message (``<|endoftext|>`` where the
        template writes ``<|im_end|>``): the episode ends there, as in the raw format."""
        content = ep.messages[-1]["content"]
        if at_end and ep.tokens[-1:] != [chat_closing_id(self.tokenizer, self.history(ep), content)]:
            return None
        return [dict(m) for m in ep.messages]

    def reply_ids(
        self, ep: Episode, reply: str, text: str | None, *, left: int, at_end: bool
    ) -> list[int] | None:
        """The ids of the template's framing around ``reply`` (the closing of the assistant's
        message, the tool message, the next turn's opening), or None where they do not fit the
        ``left`` tokens (``text`` None: surely not, untokenized), said once: a tool message is
        never cut (TRL's rule). Where the policy wrote the close of its turn itself (``at_end``),
        the framing continues the context before it, and its first token, that close, is the
        policy's.

        Raises:
            ValueError: the template cannot frame the reply exactly (:func:`chat_reply_text`,
                :func:`continuation_ids`), or its framing does not start with the end id that
                closed the turn.
        """
        if text is None:
            say_long_reply(reply, left, self.max_new_tokens, chat=True)
            return None
        framing = chat_reply_text(self.tokenizer, self.history(ep), ep.messages[-1]["content"], reply)
        context = ep.context[:-1] if at_end else ep.context
        env_ids = continuation_ids(self.tokenizer, context, framing, "the chat template's tool message")
        if at_end:
            if env_ids[:1] != ep.tokens[-1:]:
                raise ValueError(
                    "rollout.env_format=chat: the chat template's tool message does not start "
                    f"with the end id {ep.tokens[-1]} that closed the assistant's turn, once "
                    "tokenized after it; use rollout.env_format=raw"
                )
            env_ids = env_ids[1:]
        if len(env_ids) > left:
            say_long_reply(reply, left, self.max_new_tokens, chat=True)
            return None
        ep.messages.append({"role": TOOL_ROLE, "content": reply})
        ep.ended = False
        ep.replies.append(reply)
        return env_ids

    def text(self, ep: Episode) -> str:
        """The messages' contents, one per line (:func:`tether.judges.contract.completion_texts`)."""
        return "\n".join(m["content"] for m in ep.messages)

    def env_offsets(self, ep: Episode, text: str) -> None:
        """None: a chat row's messages tell where the environment's text is."""
        return None


class ToolCalls(ChatTemplate):
    """The chat format of a tool-calling run (``rollout.tools``, :mod:`tether.models.tools`):
    each assistant turn parsed into a message (``tool_calls``, ``reasoning_content``) by the
    tokenizer's response parser; a turn the template's close ended and that calls tools is
    answered by the tools' messages, whose tokens follow the close
    (:func:`tether.models.tools.tool_suffix_ids`, TRL's construction, which never re-renders the
    policy's text); any other turn ends the episode. The reward reads the messages.

    Args:
        schemas: the tools' JSON schemas (arguments typed by them when parsed).
        close_id: the id that closes an assistant turn (``<|im_end|>``).
        render: the run's chat rendering without the tools' schemas (TRL renders the tools'
            tokens so).
    """

    def __init__(self, tokenizer, ends: Sequence[int], max_new_tokens: int, *, schemas, close_id, render):
        super().__init__(tokenizer, ends, max_new_tokens)
        self.schemas, self.close_id, self.render = schemas, close_id, render

    def turn_written(self, ep: Episode, content: str, n: int) -> None:
        prefix = ep.context[: len(ep.context) - n]
        ep.messages.append(
            parse_turn(self.tokenizer, ep.tokens[len(ep.tokens) - n :], prefix=prefix, schemas=self.schemas)
        )

    def completion(self, ep: Episode, at_end: bool) -> list[dict] | None:
        """The messages so far (copies) after a turn the template's close ended with tool
        calls; None (the episode ends) after any other turn."""
        if not (at_end and ep.tokens[-1:] == [self.close_id] and ep.messages[-1].get("tool_calls")):
            return None
        return copy.deepcopy(ep.messages)

    def checked_reply(self, reply, *, left: int, forbidden: set[int], where: str):
        """The tool messages, each content checked as a chat reply (:func:`reply_text`), or None
        where they surely do not fit ``left`` tokens together. A result that cannot be appended
        (special tokens such as ``<|im_end|>``, which a tool echoing the policy's text may return;
        text that is not valid Unicode) becomes the call's ``{"error": ...}`` and counts as a failed
        call, said once: a sampled call cannot stop the run (TRL would append the tokens and
        restructure the conversation).

        Raises:
            EnvReplyError: not tool messages.
        """
        if not isinstance(reply, list) or not all(
            isinstance(m, dict) and m.get("role") == TOOL_ROLE and isinstance(m.get("content"), str)
            for m in reply
        ):
            raise EnvReplyError(
                f"the tools' answer for {where} is not a list of tool messages: {str(reply)[:80]!r}"
            )
        room = (left + 1) * longest_token_chars(self.tokenizer)
        if sum(normalized_length(self.tokenizer, m["content"]) for m in reply) > room:
            return None
        for m in reply:  # a result that cannot be appended is the call's error, as a raising tool's
            try:
                reply_text(
                    self.tokenizer, m["content"], left=1 << 30, chat=True, forbidden=forbidden, where=where
                )
            except EnvReplyError as e:
                # (the error names no token: its text would hold the special tokens again)
                m["content"] = str({"error": "the output holds special tokens or invalid text, not appended"})
                if hasattr(reply, "failures"):
                    reply.failures += 1
                say_once(
                    "tool output", f"tether: rollout.tools: {e}; the call's result is that error instead"
                )
        return reply

    def reply_ids(self, ep: Episode, reply, text, *, left: int, at_end: bool) -> list[int] | None:
        """The ids of the tool messages after the closed turn (the close is the policy's), or None
        where they do not fit the ``left`` tokens (a tool message is never cut: TRL's rule)."""
        ep.tool_calls += getattr(reply, "calls", len(reply))  # run, whether their answer fits or not
        ep.tool_failures += getattr(reply, "failures", 0)
        if text is None:
            say_long_reply(str(reply), left, self.max_new_tokens, chat=True)
            return None
        env_ids = tool_suffix_ids(self.tokenizer, list(reply), close_id=self.close_id, render=self.render)
        if len(env_ids) > left:
            say_long_reply(str(reply), left, self.max_new_tokens, chat=True)
            return None
        ep.messages += [dict(m) for m in reply]
        ep.ended = False
        ep.replies += [m["content"] for m in reply]
        return env_ids


@dataclass
class ToolLoop:
    """The turns of a batch of episodes: a policy turn for every active row at once
    (:meth:`sample_turn`), then each row's step (:meth:`policy_turn`, :meth:`env_turn`) through
    its format (:class:`RawText`, :class:`ChatTemplate`). Arguments as :func:`generate_turns`'."""

    lm: nn.Module
    tokenizer: object
    env: EnvFn
    fmt: TurnFormat
    settings: SamplingSettings
    ends: list[int]
    pad: int

    def run(self, episodes: list[Episode]) -> None:
        """Turns until every episode is done, ``max_turns`` are taken or no token is left."""
        forbidden = special_ids(self.tokenizer, self.ends)
        for turn in range(self.settings.max_turns):
            active = [ep for ep in episodes if not ep.done and len(ep.tokens) < self.settings.max_new_tokens]
            if not active:
                break
            new_ids, new_logps = self.sample_turn(active, turn)
            for i, ep in enumerate(active):
                at_end = self.policy_turn(ep, new_ids[i], new_logps[i])
                if (
                    ep.done
                    or turn == self.settings.max_turns - 1
                    or len(ep.tokens) >= self.settings.max_new_tokens
                ):
                    ep.done = True
                    continue
                self.env_turn(ep, turn, at_end=at_end, forbidden=forbidden)

    def sample_turn(self, active: list[Episode], turn: int) -> tuple[Tensor, Tensor]:
        """One policy turn of the ``active`` episodes, decoded together from their contexts
        (left-padded): ``(new_ids, sampler_logprobs)``, (A, T) each
        (:func:`tether.models.sampling.sample_tokens`)."""
        device = next(self.lm.parameters()).device
        budget = self.settings.max_new_tokens - min(len(ep.tokens) for ep in active)
        contexts = [ep.context for ep in active]
        width = max(len(c) for c in contexts)
        ids = torch.tensor([[self.pad] * (width - len(c)) + c for c in contexts], device=device)  # (A, W)
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts], device=device)
        return sample_tokens(
            self.lm,
            ids,
            mask,
            max_new_tokens=budget,
            temperature=self.settings.temperature,
            seeds=[turn_seed(ep.seed, turn) for ep in active],
            ends=self.ends,
            pad_token_id=self.pad,
            stop_strings=list(self.settings.stop_strings),
            tokenizer=self.tokenizer,
        )[:2]

    def policy_turn(self, ep: Episode, new_ids: Tensor, new_logps: Tensor) -> bool:
        """Append a turn the policy sampled, (T,) ids and log-probs: up to and including its
        first end id, or the token completing a stop string, whichever comes first, within the
        tokens left. Returns whether it ended at an end id (``ended``; in the raw format
        ``done``); a turn that reached neither was cut at the token budget (``done``)."""
        tokens = new_ids[: self.settings.max_new_tokens - len(ep.tokens)].tolist()
        cut = next((k + 1 for k, t in enumerate(tokens) if t in self.ends), None)
        stop = _stop_at(self.tokenizer, ep.context, tokens[: cut or len(tokens)], self.settings.stop_strings)
        at_end = cut is not None and (stop is None or cut <= stop)
        if at_end:
            tokens, ep.ended = tokens[:cut], True
            ep.done = self.fmt.end_id_ends_episode
        elif stop is not None:
            tokens = tokens[:stop]
        else:
            ep.done = True  # cut at the token budget
        ep.append(tokens, new_logps[: len(tokens)].tolist())
        content = self.tokenizer.decode([t for t in tokens if t not in self.ends], skip_special_tokens=True)
        self.fmt.turn_written(ep, content, len(tokens))
        return at_end

    def env_turn(self, ep: Episode, turn: int, *, at_end: bool, forbidden: set[int]) -> None:
        """Call the environment after the policy's ``turn`` and append its reply (its format's
        ids), or end the episode: on its None (ended), on a reply that does not fit (cut), or, in
        the chat format, on an end id that does not close an assistant's message.

        Raises:
            EnvFailed: the environment failed (:func:`call_env`).
            EnvReplyError: its reply cannot be tokenized or appended (:func:`reply_text`, the
                format's ``reply_ids``), the row and the turn named.
        """
        so_far = self.fmt.completion(ep, at_end)
        if so_far is None:
            ep.done = True
            return
        # copies: an environment that edits what it gets must not edit the data, the group's
        # other rows or the transcript the reward reads
        row_columns = {k: copy.deepcopy(v) for k, v in ep.columns.items()}
        where = f"row {ep.row} after turn {turn}"
        if getattr(self.env, "tool_calls", False):  # rollout.tools: the row picks its environment object
            row_columns["_row"] = ep.row
        reply = call_env(
            self.env,
            dict(prompt=copy.deepcopy(ep.prompt), completion=so_far, turn=turn, **row_columns),
            timeout=self.settings.env_timeout,
            where=where,
            so_far=so_far,
            field="rollout.tools" if getattr(self.env, "tool_calls", False) else "rollout.env",
        )
        if reply is None:  # the environment ended the episode: it ended, not cut at a limit
            ep.done = ep.ended = True
            return
        left = self.settings.max_new_tokens - len(ep.tokens)
        try:
            text = self.fmt.checked_reply(reply, left=left, forbidden=forbidden, where=where)
            env_ids = self.fmt.reply_ids(ep, reply, text, left=left, at_end=at_end)
        except EnvReplyError:
            raise
        except ValueError as e:  # the reply cannot be appended exactly: the environment's doing
            raise EnvReplyError(f"{e} ({where})") from None
        except TypeError as e:  # the tokenizer (or the chat template) refused the reply's text
            raise EnvReplyError(
                f"rollout.env's reply for {where} cannot be tokenized ({type(e).__name__}: {e}): "
                f"{str(reply)[:80]!r}"
            ) from None
        if env_ids is None:  # a chat reply that does not fit, dropped: cut at the token budget
            ep.done, ep.ended = True, False  # (the environment answered, so it had not ended)
            return
        ep.append(env_ids)
        ep.done = len(ep.tokens) >= self.settings.max_new_tokens


def tool_template(tokenizer, ends: Sequence[int] | None = None) -> tuple[int, Callable]:
    """A tool-calling run's chat template, checked before any weights load and again when it
    samples: ``(close_id, render)``, the id that ends an assistant's turn
    (:func:`tether.models.tools.assistant_close_id`) and the run's rendering without the tools'
    schemas (TRL renders the tools' tokens so), the template checked to carry tools and its
    parser set (:func:`tether.models.tools.check_tool_template`).

    Args:
        ends: the end ids of generation, where known (the model loaded): the close must be one.

    Raises:
        ValueError: the template writes no token after an assistant's text, its close is not
            among ``ends``, or it cannot carry tools (the fixes named).
    """
    render = functools.partial(render_chat, tokenizer, tools=None)
    close = assistant_close_id(tokenizer, render=render)
    if close is None:
        raise ValueError(
            "rollout.tools: the chat template of model.name writes no token of its own after an "
            "assistant's text, so a tool-calling turn has no end to stop at"
        )
    if ends is not None and int(close) not in {int(e) for e in ends}:
        name = tokenizer.convert_ids_to_tokens(int(close))
        raise ValueError(
            f"rollout.tools: the chat template closes an assistant's message with {name!r} (id {close}), "
            f"which is not an end id of generation {list(ends)} (the tokenizer's EOS and the model's "
            "generation_config.eos_token_id), so a turn would not end there and no tool would be called; add "
            "the id to the model's generation_config.eos_token_id (a base model's lists only its own EOS)"
        )
    check_tool_template(tokenizer, close_id=close, render=render)
    return close, render


def tool_format(tokenizer, env, ends: Sequence[int], settings: SamplingSettings) -> ToolCalls:
    """The :class:`ToolCalls` format of a tool-calling run (``env``: a
    :class:`tether.models.tools.ToolEnv`; its prompts checked to be chat ones by
    :func:`tool_turn_formats`), its template checked (:func:`tool_template`).

    Raises:
        ValueError: stop strings are set (a tool-calling turn ends at the template's close, as
            TRL's), the close is not an end id, or the template cannot carry tools (each naming
            the fix).
    """
    if settings.stop_strings:
        raise ValueError(
            f"rollout.stop_strings={list(settings.stop_strings)}: with rollout.tools a policy turn ends "
            "where the chat template closes an assistant message, and its tool calls are parsed from the "
            "whole turn (TRL's tool loop); leave rollout.stop_strings empty"
        )
    close, render = tool_template(tokenizer, ends=ends)
    return ToolCalls(
        tokenizer, ends, settings.max_new_tokens, schemas=env.schemas, close_id=close, render=render
    )


def assemble(
    episodes: list[Episode],
    fmt: TurnFormat,
    *,
    prompts: list,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    pad: int,
) -> Rollout:
    """The :class:`Rollout` of finished ``episodes`` (module docstring, :func:`generate_turns`'s
    Returns): their tokens right-padded with ``pad``, (B, R) each, the masks from their policy
    flags, their texts, replies and messages through ``fmt``."""
    device = prompt_ids.device
    B, R = len(episodes), max(1, max((len(ep.tokens) for ep in episodes), default=0))
    response_ids = torch.full((B, R), pad, dtype=torch.long, device=device)
    response_mask = torch.zeros((B, R), dtype=torch.bool, device=device)
    env_mask = torch.zeros((B, R), dtype=torch.bool, device=device)
    sampler_logprobs = torch.zeros((B, R), dtype=torch.float32, device=device)
    for b, ep in enumerate(episodes):
        n = len(ep.tokens)
        response_ids[b, :n] = torch.tensor(ep.tokens, dtype=torch.long)
        response_mask[b, :n] = torch.tensor(ep.policy, dtype=torch.bool)
        env_mask[b, :n] = ~torch.tensor(ep.policy, dtype=torch.bool)
        sampler_logprobs[b, :n] = torch.tensor(ep.logprobs, dtype=torch.float32)
    texts = [fmt.text(ep) for ep in episodes]
    return Rollout(
        prompts,
        prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        responses=texts,
        ended=torch.tensor([ep.ended for ep in episodes], dtype=torch.bool, device=device),
        sampler_logprobs=sampler_logprobs,
        env_mask=env_mask,
        env_texts=[ep.replies for ep in episodes],
        env_offsets=[fmt.env_offsets(ep, text) for ep, text in zip(episodes, texts)],
        # the policy's own text (its turns, the environment's text left out): what the diversity
        # and fluency metrics read
        policy_texts=[
            fmt.tokenizer.decode(
                [t for t, p in zip(ep.tokens, ep.policy) if p and t not in fmt.ends], skip_special_tokens=True
            )
            for ep in episodes
        ],
        messages=[ep.messages for ep in episodes] if fmt.chat else None,
        seeds=[ep.seed for ep in episodes],
        tool_calls=[ep.tool_calls for ep in episodes] if isinstance(fmt, ToolCalls) else None,
        tool_failures=[ep.tool_failures for ep in episodes] if isinstance(fmt, ToolCalls) else None,
    )


@torch.no_grad()
def generate_turns(
    lm: nn.Module,
    tokenizer,
    prompts: list,
    env: EnvFn,
    *,
    settings: SamplingSettings,
    seeds: Sequence[int],
    columns: dict[str, list] | None = None,
) -> Rollout:
    """Sample multi-turn responses: up to ``settings.max_turns`` policy turns,
    ``settings.max_new_tokens`` response tokens in all (the policy's and the environment's).

    One :class:`Episode` per row, taken through its turns by a :class:`ToolLoop` in the rows'
    format (:class:`RawText` or :class:`ChatTemplate`), then assembled (:func:`assemble`).

    Args:
        lm: the policy (a causal LM).
        prompts: B prompt texts or conversations.
        env: the environment (:data:`EnvFn`); called after each policy turn that ended at a stop
            string (chat format: or at an end id), while turns and tokens are left.
        settings: the run's :class:`tether.models.sampling.SamplingSettings`; read here:

            * ``max_turns``: policy turns at most (>= 1);
            * ``max_new_tokens``: response tokens at most, policy and environment together. A raw
              reply is cut to the tokens left; a chat one that does not fit whole is dropped and
              the episode ends (TRL's rule: a tool message is never cut);
            * ``temperature``: sampling temperature of every policy turn;
            * ``stop_strings``: texts that end a policy turn (the token completing one is the
              turn's last);
            * ``max_prompt_tokens``: as in :func:`tether.models.sampling.generate`;
            * ``env_format``: ``raw``, ``chat`` or ``auto`` (chat for the rows whose prompt the
              chat template rendered), module docstring;
            * ``env_timeout``: seconds one call of ``env`` may take (``rollout.env_timeout``),
              None for no limit. With a limit every call runs on a worker thread, without one on
              this thread (:func:`call_env`).
        seeds: B sample seeds (:func:`tether.models.sampling.sample_seeds`).
        columns: the rows' other dataset columns, passed to ``env`` by name, one value per row.

    Returns:
        A :class:`tether.models.sampling.Rollout` whose ``response_mask`` is True on the policy's
        tokens only (up to and including an end id), ``env_mask`` True on the environment's,
        ``sampler_logprobs`` 0 off the policy's tokens, and ``responses`` the policy's and the
        environment's texts in order (end ids and the chat template's framing left out): what
        the reward reads; in the chat format ``messages`` holds the same as messages. ``ended``
        is True where the episode ended on its own (the policy's end id, or the environment's
        None) and False where a limit cut it (the token budget, a chat reply dropped because it
        did not fit, or ``max_turns`` after a turn that stopped at a stop string to call the
        environment). A chat turn the policy closed with an end id at ``max_turns`` counts as
        ended, as TRL counts a completion that ends with its end token (the environment was not
        asked whether it would answer). ``seeds`` holds ``seeds``.

    Raises:
        ValueError: ``max_turns < 1``, a seed count that is not B; a raw row without stop strings,
            or chat turns without them whose close is not an end id (its environment would never
            be called: :func:`check_chat_turns_close`); the chat format where the template cannot
            carry it (:func:`chat_turns`).
        EnvReplyError: ``env`` returned something other than a string or None, special tokens in
            its text, or a text that cannot be appended exactly (:func:`continuation_ids`,
            :func:`chat_reply_text`); the row and the turn named. A ValueError.
        EnvFailed: ``env`` raised (``sys.exit`` and ``KeyboardInterrupt`` too), did not answer
            within ``env_timeout``, or a signal ended the wait (:func:`call_env`); the row and the
            turn named. A RuntimeError.
    """
    s = settings
    if s.max_turns < 1:
        raise ValueError(f"rollout.max_turns={s.max_turns} must be >= 1")
    device = next(lm.parameters()).device
    prompts = list(prompts)
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    chat = (
        tool_turn_formats(tokenizer, prompts, s.env_format)
        if getattr(env, "tool_calls", False)
        else turn_formats(tokenizer, prompts, s.env_format, s.stop_strings, s.max_turns)
    )
    columns = columns or {}
    if hasattr(env, "begin"):  # environment_factory: each row's object reset with its row, first
        prompts = env.begin(prompts, columns)
    passed = env_column_names(env, list(columns))
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompts, s.max_prompt_tokens, device)
    ends = end_token_ids(tokenizer, lm)
    if chat and chat[0] and s.max_turns > 1 and not getattr(env, "tool_calls", False):
        check_chat_turns_close(tokenizer, prompts[0], ends, s.stop_strings)
    if getattr(env, "tool_calls", False):  # rollout.tools: TRL's tool loop
        fmt: TurnFormat = tool_format(tokenizer, env, ends, s)
    else:
        fmt = (ChatTemplate if chat and chat[0] else RawText)(tokenizer, ends, s.max_new_tokens)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ends[0]
    episodes = [
        Episode(
            row=b,
            prompt=prompt,
            prompt_ids=prompt_ids[b][prompt_mask[b].bool()].tolist(),
            seed=int(seeds[b]),
            columns={k: columns[k][b] for k in passed},
        )
        for b, prompt in enumerate(prompts)
    ]
    ToolLoop(lm=lm, tokenizer=tokenizer, env=env, fmt=fmt, settings=s, ends=ends, pad=pad).run(episodes)
    rollout = assemble(
        episodes, fmt, prompts=prompts, prompt_ids=prompt_ids, prompt_mask=prompt_mask, pad=pad
    )
    if hasattr(env, "begin"):
        rollout.environments = list(env.active)
    return rollout
