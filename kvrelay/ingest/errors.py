"""Typed rejections of a whole message. Nothing else ever escapes the frame checks or decoder."""

from __future__ import annotations


class DecodeError(Exception):
    """Base of every rejection; ``kind`` is the counter label."""

    kind = "decode"


class FrameError(DecodeError):
    kind = "frames"


class FrameCountError(FrameError):
    kind = "frame_count"


class SeqLengthError(FrameError):
    kind = "seq_length"


class SeqRangeError(FrameError):
    """A sequence number of 2^63 or more: no engine counts that far (each incarnation counts
    from 0), and the number after the last one would not fit the replay request."""

    kind = "seq_range"


class TopicMismatchError(FrameError):
    """The topic frame does not start with the configured topic; ``seen`` is what it carried."""

    kind = "topic_mismatch"

    def __init__(self, message: str, seen: bytes = b"") -> None:
        super().__init__(message)
        self.seen = seen


class MalformedPayloadError(DecodeError):
    """Bytes are not valid msgpack (truncated, bad type byte, trailing garbage...)."""

    kind = "malformed_payload"


class MalformedEnvelopeError(DecodeError):
    """Valid msgpack but not ``[ts, events, dp_rank?, ...]``."""

    kind = "malformed_envelope"


class MalformedRemovalError(DecodeError):
    """A remove or clear event that does not decode, or an event whose kind cannot be read:
    what the engine took away is unknown, so the batch cannot be applied as if exact."""

    kind = "malformed_removal"


class DpRankMismatchError(DecodeError):
    """The batch names another DP rank than the socket it came from (misconfiguration)."""

    kind = "dp_rank_mismatch"


class InternalDecodeError(DecodeError):
    """Anything unexpected inside the decoder; a bug, but still a typed, counted rejection."""

    kind = "internal"
