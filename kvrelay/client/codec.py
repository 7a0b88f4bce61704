"""The SDK's grpclib codecs: betterproto2 messages out, and responses bounded by size.

Snapshot chunks are 4 MiB, so the SDK raises grpclib's receive limit to 8 MiB (what the relay
allows) on both the channel and this codec. ``RawCodec`` hands replies over as the received bytes
(read with ``client/wire.py``), for the mirror and the benchmark subscribers.
"""

from __future__ import annotations

from typing import Any

from grpclib.const import Status
from grpclib.encoding.base import CodecBase
from grpclib.exceptions import GRPCError


class ClientCodec(CodecBase):
    __content_subtype__ = "proto"

    def __init__(self, max_message_bytes: int = 8 * 1024 * 1024) -> None:
        self.max_message_bytes = max_message_bytes

    def encode(self, message: Any, message_type: Any) -> bytes:
        data: bytes = message if isinstance(message, bytes) else bytes(message)
        return data

    def decode(self, data: bytes, message_type: Any) -> Any:
        if len(data) > self.max_message_bytes:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"inbound message of {len(data)} bytes exceeds {self.max_message_bytes}",
            )
        return message_type.FromString(data)


class RawCodec(CodecBase):
    """Requests: betterproto2 messages → bytes. Replies: the received bytes, size-bounded
    (``max_message_bytes=None``: unbounded, for measuring another relay's output as it is)."""

    __content_subtype__ = "proto"

    def __init__(self, max_message_bytes: int | None = None) -> None:
        self.max_message_bytes = max_message_bytes

    def encode(self, message: Any, message_type: Any) -> bytes:
        return message if isinstance(message, bytes) else bytes(message)

    def decode(self, data: bytes, message_type: Any) -> bytes:
        if self.max_message_bytes is not None and len(data) > self.max_message_bytes:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"inbound message of {len(data)} bytes exceeds {self.max_message_bytes}",
            )
        return data
