"""Frame checks: exact shapes, typed rejections, fuzz (only FrameError escapes)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay.ingest.errors import (
    DecodeError,
    FrameCountError,
    FrameError,
    SeqLengthError,
    SeqRangeError,
    TopicMismatchError,
)
from kvrelay.ingest.frames import check_live, check_replay

FF = b"\xff" * 8


def test_live_ok_and_big_endian_unsigned() -> None:
    assert check_live([b"t", (2**63 - 1).to_bytes(8, "big"), b"p"], b"t") == (2**63 - 1, b"p")
    assert check_live([b"", (258).to_bytes(8, "big"), b""], b"") == (258, b"")


@pytest.mark.parametrize("seq", [2**63, 2**64 - 1])
def test_a_sequence_number_no_engine_reaches_is_refused(seq: int) -> None:
    """From 2^63 on (no engine counts that far: each incarnation counts from 0), refused on
    both paths: a replayed 2^64-1 with a payload was applied, and the number after it did not
    fit the next replay request (8 bytes), nor could any live batch come after it."""
    with pytest.raises(SeqRangeError) as info:
        check_live([b"t", seq.to_bytes(8, "big"), b"p"], b"t")
    assert info.value.kind == "seq_range"
    with pytest.raises(SeqRangeError):
        check_replay([b"", seq.to_bytes(8, "big"), b"p"], b"t")


def test_topic_is_a_prefix_like_a_zmq_subscription() -> None:
    """The configured topic matches every topic starting with it; "" matches every message."""
    seq = (5).to_bytes(8, "big")
    assert check_live([b"kv-events", seq, b"p"], b"kv") == (5, b"p")
    assert check_live([b"kv-events", seq, b"p"], b"") == (5, b"p")
    assert check_replay([b"", b"kv-events", seq, b"p"], b"kv") == (5, b"p")
    with pytest.raises(TopicMismatchError) as info:
        check_live([b"vk", seq, b"p"], b"kv")
    assert info.value.seen == b"vk"
    with pytest.raises(TopicMismatchError):
        check_replay([b"", b"k", seq, b"p"], b"kv")


@pytest.mark.parametrize(
    ("frames", "err"),
    [
        ([b"t", b"\0" * 8], FrameCountError),
        ([b"t", b"\0" * 8, b"p", b"x"], FrameCountError),
        ([b"t", b"\0" * 7, b"p"], SeqLengthError),
        ([b"t", b"\0" * 9, b"p"], SeqLengthError),
        ([b"x", b"\0" * 8, b"p"], TopicMismatchError),
        ([b"", b"\0" * 8, b"p"], TopicMismatchError),
    ],
)
def test_live_rejections(frames: list[bytes], err: type[FrameError]) -> None:
    with pytest.raises(err):
        check_live(frames, b"t")


def test_replay_shapes_and_end_marker() -> None:
    seq = (7).to_bytes(8, "big")
    assert check_replay([b"", seq, b"p"], b"t") == (7, b"p")  # vLLM <= 0.25
    assert check_replay([b"", b"t", seq, b"p"], b"t") == (7, b"p")  # >= 0.26
    assert check_replay([b"", FF, b""], b"t") is None
    assert check_replay([b"", b"", FF, b""], b"t") is None
    # all-0xFF seq with a payload is no end marker: a batch numbered 2^64-1, refused
    with pytest.raises(SeqRangeError):
        check_replay([b"", FF, b"p"], b"t")
    with pytest.raises(TopicMismatchError):
        check_replay([b"", b"x", seq, b"p"], b"t")
    with pytest.raises(FrameCountError):
        check_replay([b"x", seq, b"p"], b"t")
    with pytest.raises(FrameCountError):
        check_replay([b"", b"p"], b"t")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=12), max_size=5), st.binary(max_size=3))
def test_fuzz_frames(frames: list[bytes], topic: bytes) -> None:
    for fn in (check_live, check_replay):
        try:
            fn(frames, topic)
        except DecodeError as exc:
            assert isinstance(exc, FrameError)
