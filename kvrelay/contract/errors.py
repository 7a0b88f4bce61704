"""``RelayError``: a contract error as a reason and a message, independent of any transport.

The relay core, the publication layer and the SDK raise and inspect these; only the gRPC adapter
(``kvrelay.service.status``) turns a reason into a status code and the trailer
(``docs/contract.md`` §3). Keeping the kind neutral is what lets a second transport (or a mirror
relaying another relay's statuses) reuse everything below the service.
"""

from __future__ import annotations

from kvrelay._proto.dynamo.kvrelay import v1 as pb

Reason = pb.RelayErrorReason

_NAMES: dict[int, str] = pb.RelayErrorReason.betterproto_value_to_renamed_proto_names()


def reason_name(reason: pb.RelayErrorReason) -> str:
    """Full proto enum name, e.g. ``RELAY_ERROR_REASON_SUBSCRIBER_LAGGED`` (the trailer value)."""
    return _NAMES[int(reason)]


def reason_from_name(name: str) -> pb.RelayErrorReason | None:
    """The reason whose full enum name is ``name``; None for anything unknown."""
    for value, known in _NAMES.items():
        if known == name:
            return pb.RelayErrorReason(value)
    return None


class RelayError(Exception):
    """A contract error: ends an RPC (or a stream) with ``reason`` and ``message``."""

    def __init__(self, reason: pb.RelayErrorReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message

    @property
    def trailer_value(self) -> str:
        return reason_name(self.reason)

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
