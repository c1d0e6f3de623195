"""A user's value shown in an error message: its ``repr``, cut to a bounded length. Pure Python.

A value a user gives can be huge: a 10 MB text in a config file, or 400 bytes of YAML aliases
that expand to 387 million strings. ``f"{value!r}"`` builds the whole repr (gigabytes, minutes)
and prints an error the size of the value. :func:`shown` walks the value only as far as the
characters it shows, so its cost is O(``limit``) whatever the value's size, and says what it cut.
Every refusal that formats a value a user gave uses it, and :func:`clipped` cuts another
error's message (which may hold such a value) the same way.
"""

from __future__ import annotations

from collections.abc import Iterator

SHOWN_CHARS = 200
"""The most characters of a value's repr an error message shows (a path, a Hub id, a few stop
strings fit whole; then the message stays a few lines)."""


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` when it is at most ``limit`` characters long, else its first ``limit``
    characters and a note of what was cut.

    Texts, lists, tuples, sets and dicts are walked piece by piece and only as far as the
    characters shown (their repr is the builtin one, quotes included); any other value is its
    own ``repr``, cut the same way. An integer too long for ``repr`` (over 4300 digits) is named by
    its size in bits.

    Example:
        ``shown("abc")`` is ``'abc'``; ``shown("x" * 10**7, 8)`` is
        ``'xxxxxxx... (cut: a text of 10,000,000 characters)``; ``shown([[1] * 9] * 9, 12)`` is
        ``[[1, 1, 1, 1... (cut: a list of 9 items)``.

    Args:
        value: any value, as a user gave it.
        limit: the most characters of its repr to show (>= 1).

    Returns:
        The repr, or its first ``limit`` characters, ``...`` and ``(cut: WHAT)``, where WHAT is
        the value's type and length (for a text or a builtin container the note is under 60
        characters).
    """
    text, size = "", 0
    for piece in _pieces(value, limit):
        text += piece
        size += len(piece)
        if size > limit:
            return f"{text[:limit]}... (cut: {_whole(value)})"
    return text


def clipped(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` as it is (no quotes: another error's message, which may hold a user's value)
    when at most ``limit`` characters long, else its first ``limit`` characters and a note.

    Example:
        ``clipped("No module named 'aaaa'", 18)`` is ``No module named 'a... (cut: 22 characters)``.
    """
    return text if len(text) <= limit else f"{text[:limit]}... (cut: {_count(len(text), 'character')})"


_BRACKETS = {list: ("[", "]"), tuple: ("(", ")"), set: ("{", "}"), frozenset: ("frozenset({", "})")}


def _pieces(value: object, limit: int) -> Iterator[str]:
    """``repr(value)`` in pieces, lazily: a caller that stops after ``limit`` characters has walked
    at most that many characters' worth of the value (a text is cut before its repr is built)."""
    if isinstance(value, (str, bytes)):
        yield repr(value if len(value) <= limit else value[: limit + 1])
    elif type(value) is dict:
        yield "{"
        for i, (k, v) in enumerate(value.items()):
            yield ", " if i else ""
            yield from _pieces(k, limit)
            yield ": "
            yield from _pieces(v, limit)
        yield "}"
    elif isinstance(value, (list, tuple, set, frozenset)) and type(value) in _BRACKETS and value:
        # builtin containers only: a subclass (a NamedTuple) has a repr of its own
        open_, close = _BRACKETS[type(value)]
        yield open_
        for i, item in enumerate(value):
            yield ", " if i else ""
            yield from _pieces(item, limit)
        yield ("," if type(value) is tuple and len(value) == 1 else "") + close
    else:
        try:
            yield repr(value)
        except ValueError:  # an integer over sys.get_int_max_str_digits() (4300 by default) digits
            if not isinstance(value, int):
                raise
            yield f"<an integer of {value.bit_length():,} bits>"


def _whole(value: object) -> str:
    """What a cut value was: its type and length."""
    if isinstance(value, str):
        return f"a text of {_count(len(value), 'character')}"
    if isinstance(value, bytes):
        return _count(len(value), "byte")
    if isinstance(value, dict):
        return f"a mapping of {_count(len(value), 'key')}"
    if isinstance(value, (list, tuple, set, frozenset)):
        return f"a {type(value).__name__} of {_count(len(value), 'item')}"
    return f"a {type(value).__name__} whose repr is longer"


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"
