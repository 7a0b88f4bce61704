"""Contract reasons → gRPC status codes and the ``kv-relay-error-reason`` trailer.

The only place a ``RelayError`` meets grpclib: everything below the service raises neutral
reasons, and this adapter picks the status a router expects for each (``docs/contract.md`` §3.2).
The trailer carries the full enum name, as Dynamo's relay sends it.
"""

from __future__ import annotations

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.errors import RelayError
from kvrelay.contract.wire import TRAILER_KEY

Reason = pb.RelayErrorReason

STATUS_FOR_REASON: dict[pb.RelayErrorReason, Status] = {
    Reason.UNSPECIFIED: Status.UNKNOWN,
    Reason.CONTRACT_MISMATCH: Status.FAILED_PRECONDITION,
    Reason.INVALID_REQUEST: Status.INVALID_ARGUMENT,
    Reason.UNSUPPORTED_FEATURE: Status.FAILED_PRECONDITION,
    Reason.POOL_NOT_FOUND: Status.NOT_FOUND,
    Reason.PRODUCER_CHANGED: Status.FAILED_PRECONDITION,
    Reason.RESOURCE_LIMIT: Status.RESOURCE_EXHAUSTED,
    Reason.SUBSCRIBER_LAGGED: Status.RESOURCE_EXHAUSTED,
    Reason.SNAPSHOT_PROGRESS_TIMEOUT: Status.RESOURCE_EXHAUSTED,
    Reason.PUBLICATION_UNAVAILABLE: Status.UNAVAILABLE,
    Reason.INVALID_PUBLICATION: Status.FAILED_PRECONDITION,
    Reason.INTERNAL: Status.INTERNAL,
}


def status_of(err: RelayError) -> Status:
    """The gRPC status a router expects for ``err``'s reason."""
    return STATUS_FOR_REASON.get(err.reason, Status.UNKNOWN)


#: An RPC the source does not implement: plain gRPC, no relay reason (a relay that predates the
#: RPC answers so, and a mirror of one answers the same).
UNSUPPORTED_RPC = Status.UNIMPLEMENTED


#: A call on a connection whose client certificate a reload's CRLs revoke: plain gRPC, no relay
#: reason (it is about the client, not a pool). UNAUTHENTICATED tells a router not to retry with
#: that certificate, where the UNAVAILABLE of a lost connection asks it to retry.
CERTIFICATE_REVOKED = Status.UNAUTHENTICATED
CERTIFICATE_REVOKED_MESSAGE = "client certificate revoked"


def certificate_revoked() -> GRPCError:
    """What ends each call of a connection whose client certificate was revoked."""
    return GRPCError(CERTIFICATE_REVOKED, CERTIFICATE_REVOKED_MESSAGE)


def trailers_of(err: RelayError) -> dict[str, str]:
    """The trailing metadata that carries ``err``'s reason."""
    return {TRAILER_KEY: err.trailer_value}
