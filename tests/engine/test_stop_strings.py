"""StopStringMatcher: fixed cases, and a property test over random splits of a text.

The property test's reference works on the whole text by brute force: the first prefix of
the text that ends with a stop string (the longest one ending there) decides the output.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioserve.engine.stop_strings import StopStringMatcher


def run(stop: list[str], include: bool, pieces: list[str]) -> tuple[list[str], str | None]:
    """Feed the pieces as the output processor does; the emitted parts and the stop string.

    After a match nothing more is fed; a request that ends without one flushes.
    """
    matcher = StopStringMatcher(stop, include)
    emitted = []
    for piece in pieces:
        safe, matched = matcher.process(piece)
        emitted.append(safe)
        if matched is not None:
            return emitted, matched
    emitted.append(matcher.flush())
    return emitted, None


def reference(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    for end in range(1, len(text) + 1):
        ending_here = [s for s in stop if s and text[:end].endswith(s)]
        if ending_here:
            stop_str = max(ending_here, key=len)
            return (text[:end] if include else text[: end - len(stop_str)]), stop_str
    return text, None


@pytest.mark.parametrize("include", [False, True])
def test_no_stop_strings_pass_text_through_unbuffered(include):
    matcher = StopStringMatcher([], include)
    assert matcher.process("Hello") == ("Hello", None)
    assert matcher.process(" world") == (" world", None)
    assert matcher.flush() == ""


@pytest.mark.parametrize(
    ("pieces", "include", "expected"),
    [
        (["Hello STOP there"], False, "Hello "),
        (["Hello STOP there"], True, "Hello STOP"),
        (["Hello ST", "OP there"], False, "Hello "),
        (["Hello ST", "OP there"], True, "Hello STOP"),
        (["Hello S", "T", "OP there"], False, "Hello "),
        (["Hello S", "T", "OP there"], True, "Hello STOP"),
        (["STOP and more"], False, ""),
        (["STOP and more"], True, "STOP"),
        (["ST", "OP"], False, ""),
    ],
    ids=["inside", "inside-incl", "two", "two-incl", "three", "three-incl", "start",
         "start-incl", "start-split"],
)  # fmt: skip
def test_match(pieces, include, expected):
    emitted, matched = run(["STOP"], include, pieces)
    assert "".join(emitted) == expected
    assert matched == "STOP"


def test_the_stop_string_is_reported_by_the_piece_that_completes_it():
    matcher = StopStringMatcher(["STOP"], False)
    assert matcher.process("a S") == ("", None)
    assert matcher.process("TO") == ("a ", None)
    assert matcher.process("P b") == ("", "STOP")


def test_nothing_after_a_match_is_emitted():
    matcher = StopStringMatcher(["END"], True)
    assert matcher.process("x END y") == ("x END", "END")
    assert matcher.process("more text END") == ("", None)
    assert matcher.flush() == ""


def test_a_partial_stop_string_is_held_back_then_flushed():
    matcher = StopStringMatcher(["STOP", "\n\n"], False)
    # The last len("STOP") - 1 characters are held: they could start a stop string.
    assert matcher.process("Hello S") == ("Hell", None)
    assert matcher.process("T") == ("o", None)
    assert matcher.process("Y and ") == (" STY a", None)
    assert matcher.flush() == "nd "
    assert matcher.flush() == ""


def test_with_include_stop_str_in_output_nothing_is_held_back():
    matcher = StopStringMatcher(["STOP"], True)
    assert matcher.process("Hello ST") == ("Hello ST", None)
    assert matcher.process("O") == ("O", None)
    assert matcher.process("P!") == ("P", "STOP")


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("split", [None, 1, 2, 3])
def test_the_stop_string_complete_first_wins(include, split):
    text = "xx abcde yy"
    pieces = [text] if split is None else [text[i : i + split] for i in range(0, len(text), split)]
    # "bcd" starts after "abcde" but is complete first.
    assert run(["abcde", "bcd"], include, pieces) == run(["bcd", "abcde"], include, pieces)
    emitted, matched = run(["abcde", "bcd"], include, pieces)
    assert matched == "bcd"
    assert "".join(emitted) == ("xx abcd" if include else "xx a")
    # Of two that end together, the one that starts first (the longer one).
    emitted, matched = run(["cd", "abcd", "xx"], include, pieces)
    assert matched == "xx"
    emitted, matched = run(["cd", "abcd"], include, pieces)
    assert matched == "abcd"
    assert "".join(emitted) == ("xx abcd" if include else "xx ")


def test_overlapping_candidates():
    # "aab" can only be seen after the first "a" of "aa" stopped being a candidate.
    emitted, matched = run(["aab", "abx"], False, ["a", "a", "a", "b", "x"])
    assert (matched, "".join(emitted)) == ("aab", "a")
    emitted, matched = run(["aaa"], False, ["a", "a", "b", "a", "a", "a"])
    assert (matched, "".join(emitted)) == ("aaa", "aab")


def test_unicode_stop_strings():
    emitted, matched = run(["。\n", "🛑"], False, ["日本", "語。", "\n続き"])
    assert ("".join(emitted), matched) == ("日本語", "。\n")
    emitted, matched = run(["。\n", "🛑"], True, ["go 🛑 now"])
    assert ("".join(emitted), matched) == ("go 🛑", "🛑")


def test_empty_and_repeated_stop_strings_are_ignored():
    emitted, matched = run(["", "STOP", "STOP"], False, ["a", "b STOP"])
    assert ("".join(emitted), matched) == ("ab ", "STOP")
    emitted, matched = run([""], False, ["abc"])
    assert ("".join(emitted), matched) == ("abc", None)


def test_empty_pieces_change_nothing():
    emitted, matched = run(["STOP"], False, ["", "a", "", "STO", "", "P"])
    assert ("".join(emitted), matched) == ("a", "STOP")


_ALPHABET = "ab\nS"


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(_ALPHABET, max_size=30),
    stop=st.lists(st.text(_ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    cuts=st.lists(st.integers(0, 30), max_size=12),
)
def test_any_split_emits_what_the_whole_text_gives(text, stop, include, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[i:j] for i, j in pairwise(bounds)] or [""]
    expected_text, expected_stop = reference(text, stop, include)

    matcher = StopStringMatcher(stop, include)
    emitted, fed = "", ""
    for piece in pieces:
        fed += piece
        safe, matched = matcher.process(piece)
        emitted += safe
        # Never anything the final output will not have: no partial stop string.
        assert expected_text.startswith(emitted)
        # The match is reported by the piece that completes it, not earlier, not later.
        assert matched == (expected_stop if reference(fed, stop, include)[1] else None)
        if matched is not None:
            break
    else:
        emitted += matcher.flush()
    assert emitted == expected_text


@pytest.mark.parametrize(
    "include, before, after", [(False, "Hello", " "), (True, "Hello wor", "ld")]
)
def test_a_stop_string_may_start_in_text_from_before_min_tokens(include, before, after):
    """Text before min_tokens is held back as any other: the start of a stop string that
    ends later is never emitted (the output is "Hello " without the stop string)."""
    matcher = StopStringMatcher(["world"], include)
    assert matcher.emit_unchecked("Hello wor") == before
    assert matcher.process("ld and more") == (after, "world")


def test_a_stop_string_wholly_before_min_tokens_does_not_stop():
    matcher = StopStringMatcher(["ab", "xyzzy"], include_stop_str_in_output=False)
    out = matcher.emit_unchecked("--ab")
    safe, matched = matcher.process("cd")
    assert matched is None
    assert out + safe + matcher.flush() == "--abcd"


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(_ALPHABET, max_size=30),
    stop=st.lists(st.text(_ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    unchecked=st.integers(0, 30),
    cuts=st.lists(st.integers(0, 30), max_size=12),
)
def test_text_before_min_tokens_is_unchecked_and_only_later_endings_stop(
    text, stop, include, unchecked, cuts
):
    """vLLM's look-back: a stop string counts if it ends after the unchecked text, and the
    output is cut at its start wherever that is."""
    unchecked = min(unchecked, len(text))
    bounds = sorted({0, unchecked, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[i:j] for i, j in pairwise(bounds)]
    expected_stop, expected_text = None, text
    for end in range(unchecked + 1, len(text) + 1):
        ending_here = [s for s in stop if text[:end].endswith(s)]
        if ending_here:
            expected_stop = max(ending_here, key=len)
            cut = end if include else end - len(expected_stop)
            expected_text = text[:cut]
            break

    matcher = StopStringMatcher(stop, include)
    emitted, matched, position = "", None, 0
    for piece in pieces:
        if position < unchecked:
            emitted += matcher.emit_unchecked(piece)
        else:
            safe, matched = matcher.process(piece)
            emitted += safe
            if matched is not None:
                break
        position += len(piece)
    else:
        emitted += matcher.flush()
    assert (emitted, matched) == (expected_text, expected_stop)
