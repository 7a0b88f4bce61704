"""Multipart frame checks for live messages ``[topic, seq(8 B big-endian u64), payload]``.

The configured topic is a prefix, exactly as a ZMQ subscription is (and as vLLM's and Dynamo's
subscribers use it): ``kv`` accepts ``kv-events``, ``""`` accepts every message. The subscriber
subscribes to everything and filters here, so a message dropped for its topic is counted and can
be reported with the topic it carried, where a ZMQ-side filter would drop it silently.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrelay.ingest.errors import (
    FrameCountError,
    SeqLengthError,
    SeqRangeError,
    TopicMismatchError,
)
from kvrelay.ingest.sglang import EPOCH_MARKER, split_topic

END_SEQ = b"\xff" * 8
#: The largest frame read from an engine, live or replayed, whichever reader: kvrelay's ZMTP
#: reader refuses a larger one (counted), libzmq's sockets are told the same (``ZMQ_MAXMSGSIZE``:
#: libzmq ends the connection at the frame's header). A batch is kilobytes; no real one is near it.
MAX_FRAME_BYTES = 64 << 20


#: Sequence numbers from here up are refused (``SeqRangeError``).
SEQ_LIMIT = 1 << 63


def parse_seq(frame: bytes) -> int:
    """8-byte big-endian unsigned sequence number, below ``SEQ_LIMIT``."""
    if len(frame) != 8:
        raise SeqLengthError(f"sequence frame has {len(frame)} bytes, expected 8")
    seq = int.from_bytes(frame, "big", signed=False)
    if seq >= SEQ_LIMIT:
        raise SeqRangeError(f"sequence number {seq} is 2^63 or more")
    return seq


def check_live(frames: Sequence[bytes], topic: bytes) -> tuple[int, bytes]:
    """Validate a live message; returns ``(seq, payload)`` or raises a ``FrameError``."""
    if len(frames) != 3:
        raise FrameCountError(f"live message has {len(frames)} frames, expected 3")
    seen = bytes(frames[0])
    if not seen.startswith(topic):
        raise TopicMismatchError("topic frame does not start with the configured topic", seen)
    return parse_seq(frames[1]), bytes(frames[2])


def check_live_sglang(frames: Sequence[bytes], topic: bytes) -> tuple[int, bytes, bytes | None]:
    """``check_live`` for SGLang: after the topic prefix the frame may carry the publisher's
    epoch (and a snapshot barrier id, §21.3); returns ``(seq, payload, epoch or None)``. A
    malformed epoch decoration is a topic mismatch."""
    if len(frames) != 3:
        raise FrameCountError(f"live message has {len(frames)} frames, expected 3")
    seen = bytes(frames[0])
    if not seen.startswith(topic):
        raise TopicMismatchError("topic frame does not start with the configured topic", seen)
    epoch = None
    cut = seen.find(EPOCH_MARKER, len(topic))
    if cut >= 0:
        parts = split_topic(seen, seen[:cut])
        if parts is None:
            raise TopicMismatchError("malformed SGLang epoch in the topic frame", seen)
        epoch = parts[0]
    return parse_seq(frames[1]), bytes(frames[2]), epoch


def check_replay(frames: Sequence[bytes], topic: bytes) -> tuple[int, bytes] | None:
    """Validate a replay reply as seen by a DEALER; ``None`` means the end-of-replay marker.

    vLLM <= 0.25 sends ``[b"", seq, payload]``; >= 0.26 sends ``[b"", topic, seq, payload]``
    (the end marker then has an empty topic). End = seq bytes all 0xFF and an empty payload.
    """
    n = len(frames)
    if n not in (3, 4) or len(frames[0]) != 0:
        raise FrameCountError(f"replay reply has {n} frames or no empty delimiter")
    seq_frame, payload = bytes(frames[-2]), bytes(frames[-1])
    if seq_frame == END_SEQ and not payload:
        return None
    if n == 4 and not bytes(frames[1]).startswith(topic):
        raise TopicMismatchError(
            "replay topic frame does not start with the configured topic", bytes(frames[1])
        )
    return parse_seq(seq_frame), payload
