"""Pass-through protobuf codec: pre-encoded `bytes` go out as-is, messages are encoded normally.

grpclib's ProtoCodec insists on `isinstance(message, reply_type)`; the relay sends FilterUpdate
frames (and plane snapshots) it has already encoded once for all subscribers. Works for both
betterproto2 and official protobuf messages (health, reflection): both have
`SerializeToString`/`FromString`. Inbound and outbound sizes are bounded by `max_message_bytes`.
Inbound betterproto2 requests are first canonicalized (``canonical.py``) so that they parse exactly
as official protobuf would parse them.
"""

from __future__ import annotations

from typing import Any

from grpclib.const import Status
from grpclib.encoding.base import CodecBase
from grpclib.exceptions import GRPCError

from kvrelay.contract.errors import RelayError
from kvrelay.service.canonical import canonicalize, is_betterproto


class PassThroughCodec(CodecBase):
    __content_subtype__ = "proto"

    def __init__(self, max_message_bytes: int = 8 * 1024 * 1024) -> None:
        self.max_message_bytes = max_message_bytes

    def encode(self, message: Any, message_type: Any) -> bytes:
        if isinstance(message, bytes | bytearray | memoryview):
            data = bytes(message) if not isinstance(message, bytes) else message
        else:
            data = message.SerializeToString()
        if len(data) > self.max_message_bytes:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"outbound message of {len(data)} bytes exceeds {self.max_message_bytes}",
            )
        return data

    def decode(self, data: bytes, message_type: Any) -> Any:
        if len(data) > self.max_message_bytes:  # RESOURCE_EXHAUSTED with the reason trailer
            raise RelayError.resource_limit(
                f"inbound message of {len(data)} bytes exceeds {self.max_message_bytes}"
            )
        try:
            if is_betterproto(message_type):
                data = canonicalize(data, message_type)
            return message_type.FromString(data)
        except Exception as exc:  # betterproto2 raises EOFError/ValueError/... on bad bytes
            raise RelayError.invalid_request(
                f"undecodable {getattr(message_type, '__name__', 'request')}: {exc}"
            ) from None
