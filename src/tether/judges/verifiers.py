"""Checker rewards for verifiable tasks: 1.0 when the response states the right answer, 0.0
otherwise (a wrong answer and a wrong format alike), called as TRL calls a reward function.

``reward.scorer=integer-answer`` (:func:`integer_answer`) reads the ``answer`` column of the
data (the built-in ``data.prompts=arithmetic``, or any dataset with an integer ``answer``).
The parsing rule, in full: the response (for a conversation, the content of its last message),
leading whitespace skipped, must start with an integer, ``[+-]?`` and 1 to 30 digits not
followed by another digit; its value must equal the answer's. For answer 75: ``" 75\\n41 + 17"``,
``"75 apples"`` and ``"+075"`` score 1; ``"The sum is 75"``, ``"7 5"``, ``"76"`` and ``""``
score 0.
"""

from __future__ import annotations

import re

from tether.core.text import shown

_LEADING_INTEGER = re.compile(r"\s*([+-]?\d{1,30})(?!\d)")
_INTEGER = re.compile(r"\s*[+-]?\d{1,30}\s*")


def response_text(completion) -> str:
    """A completion as text: a string as it is, a conversation (a list of ``{role, content}``
    messages, as TRL passes for conversational data) as its last message's content."""
    if isinstance(completion, list):
        return str(completion[-1].get("content", "")) if completion else ""
    return str(completion)


def leading_integer(text: str) -> int | None:
    """The integer ``text`` starts with (after whitespace), by this module's rule, or None."""
    m = _LEADING_INTEGER.match(text)
    return int(m.group(1)) if m else None


def integer_answer(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 for each completion whose leading integer equals its row's ``answer``, else 0.0.

    Args:
        completions: B responses, strings or conversations (:func:`response_text`).
        answer: B answers, each an int or a string holding one (``"75"``).
        **kwargs: the other arguments TRL passes (prompts, completion_ids, trainer_state ...).

    Returns:
        B floats, each 0.0 or 1.0.

    Raises:
        ValueError: an answer is not an integer (names it): this checker is for integer answers.
    """
    if len(answer) != len(completions):
        raise ValueError(f"integer-answer: {len(answer)} answers for {len(completions)} completions")
    out = []
    for completion, want in zip(completions, answer):
        if isinstance(want, bool) or not (isinstance(want, int) or _INTEGER.fullmatch(str(want))):
            raise ValueError(
                f"integer-answer: the answer {shown(want)} is not an integer; this checker compares integers "
                "(write your own reward.scorer=module:function for other answers)"
            )
        got = leading_integer(response_text(completion))
        out.append(float(got is not None and got == int(want)))
    return out
