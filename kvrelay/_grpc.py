"""The gRPC status a grpclib client should act on, shared by discovery, the SDK and the mirror.

A grpclib server answers a method it does not have with a trailers-only 200 that lacks a
content-type; grpclib's client reports that as ``UNKNOWN`` "Missing content-type header". It
means ``UNIMPLEMENTED`` (other servers send that code), and callers that decide on
``UNIMPLEMENTED`` (an engine without an optional Control RPC, a relay without
``SubscribeServingLoad``) must see it whichever server answered.
"""

from __future__ import annotations

from grpclib.const import Status

NO_CONTENT_TYPE = "Missing content-type header"


def effective_status(status: Status, message: str | None) -> Status:
    if status is Status.UNKNOWN and message == NO_CONTENT_TYPE:
        return Status.UNIMPLEMENTED
    return status
