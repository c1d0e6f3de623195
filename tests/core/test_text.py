"""A user's value in an error message (tether.core.text.shown): whole when short, cut when long,
at a cost that does not grow with the value."""

from __future__ import annotations

import time

import pytest

from tether.core.text import SHOWN_CHARS, shown

SMALL = [
    "abc",
    "it's",
    "",
    b"ab",
    None,
    True,
    1.5,
    -7,
    [],
    [1, "a", [2.5, None]],
    (),
    (1,),
    (1, 2),
    set(),
    {3},
    frozenset(),
    frozenset({3}),
    {},
    {"a": [1, (2,)], 3: {"b": None}},
]


@pytest.mark.parametrize("value", SMALL, ids=[repr(v) for v in SMALL])
def test_a_short_value_is_its_repr(value):
    assert shown(value) == repr(value)


def test_a_long_text_is_cut_and_says_how_long_it_was():
    text = "x" * 10_000_000
    out = shown(text)
    # the first SHOWN_CHARS characters of the repr: the quote and SHOWN_CHARS - 1 x's
    assert out == "'" + "x" * (SHOWN_CHARS - 1) + "... (cut: a text of 10,000,000 characters)"
    assert shown(text, 8) == "'xxxxxxx... (cut: a text of 10,000,000 characters)"


def test_a_long_container_is_the_start_of_its_repr():
    value = {"k": [list(range(50))] * 40, "z": ("t" * 500,)}
    out = shown(value, 100)
    assert out == repr(value)[:100] + "... (cut: a mapping of 2 keys)"
    assert shown([0] * 1000, 10) == "[0, 0, 0, ... (cut: a list of 1,000 items)"
    assert shown(list(range(3)), 9) == "[0, 1, 2]"  # exactly the limit: whole


def test_an_alias_bomb_is_shown_without_being_walked():
    # the value 400 bytes of YAML aliases make: 9 levels of 9 references to one list, 9**9 =
    # 387,420,489 strings; its repr would be ~2 GB and take minutes
    bomb: list = ["x"] * 9
    for _ in range(8):
        bomb = [bomb] * 9
    start = time.perf_counter()
    out = shown({"i": bomb})
    took = time.perf_counter() - start
    assert out.startswith("{'i': [[[[[[[[['x', 'x'") and out.endswith("... (cut: a mapping of 1 key)")
    assert len(out) == SHOWN_CHARS + len("... (cut: a mapping of 1 key)")
    # it walks ~SHOWN_CHARS / 5 strings, not 387 million: microseconds; a second is 10**4 times that
    assert took < 1.0


def test_a_self_containing_list_and_an_integer_too_long_for_repr():
    loop: list = []
    loop.append(loop)
    assert shown(loop, 6) == "[[[[[[... (cut: a list of 1 item)"
    assert shown(10**5000) == f"<an integer of {(10**5000).bit_length():,} bits>"  # repr() raises
