"""Topic patterns: syntax, matches, typed rejections (only ``TopicError`` escapes a match)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.ingest.topic_pattern import (
    PatternError,
    TopicError,
    TopicMalformedError,
    TopicMatch,
    TopicPattern,
    TopicUnmatchedError,
)


@pytest.mark.parametrize(
    ("pattern", "topic", "want"),
    [
        ("kv@{engine}@{model}", b"kv@10.0.0.7:8000@Qwen/Qwen3-32B",
         TopicMatch("10.0.0.7:8000", None, "Qwen/Qwen3-32B")),
        ("kv@{engine}@{model}", b"kv@pod@m@x", TopicMatch("pod", None, "m@x")),  # last: the rest
        ("{engine}", b"any thing", TopicMatch("any thing", None, None)),
        ("kv/{engine}/dp{rank}", b"kv/e-1/dp12", TopicMatch("e-1", 12, None)),
        ("{{x}}{engine}", b"{x}pod", TopicMatch("pod", None, None)),  # escaped braces
        ("t:{engine}", "t:λ-ĉ".encode(), TopicMatch("λ-ĉ", None, None)),
    ],
)  # fmt: skip
def test_matches(pattern: str, topic: bytes, want: TopicMatch) -> None:
    assert TopicPattern(pattern).match(topic) == want


def test_prefix_is_the_literal_head() -> None:
    assert TopicPattern("kv@{engine}@{model}").prefix == b"kv@"
    assert TopicPattern("{engine}@x").prefix == b""
    assert TopicPattern("{{a{engine}").prefix == b"{a"


@pytest.mark.parametrize(
    ("topic", "err"),
    [
        (b"kv@pod", TopicUnmatchedError),  # no model part
        (b"kv@@m", TopicUnmatchedError),  # empty engine
        (b"xx@pod@m", TopicUnmatchedError),  # another prefix
        (b"kv@\xff@m", TopicMalformedError),  # not UTF-8
        (b"kv@ pod@m", TopicMalformedError),  # padded name
        (b"kv@p\x00d@m", TopicMalformedError),  # not printable
        (b"kv@" + b"e" * 257 + b"@m", TopicMalformedError),  # too long
    ],
)
def test_rejections(topic: bytes, err: type[TopicError]) -> None:
    with pytest.raises(err):
        TopicPattern("kv@{engine}@{model}").match(topic)


@pytest.mark.parametrize("rank", [b"x", b"-1", b"1024", b"\xd9\xa3", b"00001"])
def test_bad_ranks(rank: bytes) -> None:
    with pytest.raises(TopicMalformedError):
        TopicPattern("{engine}/{rank}").match(b"e/" + rank)


@pytest.mark.parametrize(
    "pattern",
    ["kv", "{engine}{model}", "{engine}/{engine}", "{rank}/{rank}/{engine}", "{pod}",
     "{engine", "engine}", "{ engine }", "{model}@{model}@{engine}"],
)  # fmt: skip
def test_pattern_errors(pattern: str) -> None:
    with pytest.raises(PatternError):
        TopicPattern(pattern)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=40), st.sampled_from(["kv@{engine}@{model}", "{engine}/dp{rank}",
                                                "{engine}", "a{engine}b{rank}c"]))  # fmt: skip
def test_fuzz_only_typed_rejections(topic: bytes, pattern: str) -> None:
    try:
        m = TopicPattern(pattern).match(topic)
    except TopicError:
        return
    assert m.engine and m.engine == m.engine.strip()
    assert m.rank is None or 0 <= m.rank <= 1023
