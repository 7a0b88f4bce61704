"""Relay application errors: reason enum → gRPC status + the `kv-relay-error-reason` trailer.

The trailer carries the full enum name (not the number), as Dynamo's relay does (contract §3.2).
"""

from __future__ import annotations

from grpclib.const import Status

from kvrelay._proto.dynamo.kvrelay import v1 as pb

TRAILER_KEY = "kv-relay-error-reason"

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

_NAMES: dict[int, str] = pb.RelayErrorReason.betterproto_value_to_renamed_proto_names()


def reason_name(reason: pb.RelayErrorReason) -> str:
    """Full proto enum name, e.g. ``RELAY_ERROR_REASON_SUBSCRIBER_LAGGED``."""
    return _NAMES[int(reason)]


class RelayError(Exception):
    """A contract error: ends an RPC with `status`, `message` and the reason trailer."""

    def __init__(self, reason: pb.RelayErrorReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = STATUS_FOR_REASON[reason]
        self.message = message

    @property
    def trailer_value(self) -> str:
        return reason_name(self.reason)

    def trailers(self) -> dict[str, str]:
        return {TRAILER_KEY: self.trailer_value}

    def __repr__(self) -> str:
        return f"RelayError({self.trailer_value}, {self.message!r})"

    # --- one constructor per reason (keeps call sites short and greppable) ---
    @classmethod
    def contract_mismatch(cls, message: str) -> RelayError:
        return cls(Reason.CONTRACT_MISMATCH, message)

    @classmethod
    def invalid_request(cls, message: str) -> RelayError:
        return cls(Reason.INVALID_REQUEST, message)

    @classmethod
    def unsupported_feature(cls, message: str) -> RelayError:
        return cls(Reason.UNSUPPORTED_FEATURE, message)

    @classmethod
    def pool_not_found(cls, message: str = "pool is not active") -> RelayError:
        return cls(Reason.POOL_NOT_FOUND, message)

    @classmethod
    def producer_changed(
        cls, message: str = "pool generation differs from expected_producer"
    ) -> RelayError:
        return cls(Reason.PRODUCER_CHANGED, message)

    @classmethod
    def resource_limit(cls, message: str) -> RelayError:
        return cls(Reason.RESOURCE_LIMIT, message)

    @classmethod
    def subscriber_lagged(
        cls, message: str = "subscriber queue overflow; resubscribe from a snapshot"
    ) -> RelayError:
        return cls(Reason.SUBSCRIBER_LAGGED, message)

    @classmethod
    def snapshot_progress_timeout(
        cls, message: str = "client stopped draining the bootstrap snapshot"
    ) -> RelayError:
        return cls(Reason.SNAPSHOT_PROGRESS_TIMEOUT, message)

    @classmethod
    def publication_unavailable(
        cls, message: str = "publication reset; requires a fresh snapshot"
    ) -> RelayError:
        return cls(Reason.PUBLICATION_UNAVAILABLE, message)

    @classmethod
    def invalid_publication(cls, message: str) -> RelayError:
        return cls(Reason.INVALID_PUBLICATION, message)

    @classmethod
    def internal(cls, message: str = "internal relay error") -> RelayError:
        return cls(Reason.INTERNAL, message)
