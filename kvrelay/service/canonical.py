"""Request bytes → the encoding official protobuf resolves them to, before betterproto2 parses.

A request is valid exactly when ``protoc``-generated parsers accept it, and the relay must judge
it as they would (only undecodable bytes are INVALID_REQUEST). betterproto2 0.10 differs on
well-formed input: a known field number arriving with another wire type raises (protobuf keeps it
aside as an unknown field), and a singular message field occurring twice keeps the last occurrence
(protobuf merges them). So each request is parsed by the official protobuf runtime — a dependency
already, for health and reflection — from the descriptor kvrelay embeds for reflection, stripped
of unknown fields and re-serialized; betterproto2 then only ever sees canonical bytes.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from google.protobuf import message_factory
from google.protobuf.message import DecodeError, Message

from kvrelay.service.descriptor import relay_descriptor_pool

_PACKAGE = "dynamo.kvrelay.v1"


class WireFormatError(ValueError):
    """The bytes are not a valid protobuf encoding (official parsers reject them too)."""


@cache
def _official(name: str) -> type[Message]:
    desc = relay_descriptor_pool().FindMessageTypeByName(f"{_PACKAGE}.{name}")
    cls: type[Message] = message_factory.GetMessageClass(desc)
    return cls


def is_betterproto(cls: Any) -> bool:
    return hasattr(cls, "_betterproto")


def canonicalize(data: bytes, cls: type) -> bytes:
    """Re-encode ``data`` (an encoding of the contract message ``cls``) as protobuf resolves it:
    unknown fields (and known ones with a mismatched wire type) dropped, singular messages merged,
    last scalar wins. Raises ``WireFormatError`` where official protobuf rejects the bytes."""
    msg = _official(cls.__name__)()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise WireFormatError(str(exc)) from None
    msg.DiscardUnknownFields()
    out: bytes = msg.SerializeToString(deterministic=True)
    return out
