"""Small validators of contract messages shared by the planes (``docs/contract.md`` §3.3).

Text fields are non-empty without surrounding whitespace; roles are defined, non-UNSPECIFIED
values (unknown numbers fail closed).
"""

from __future__ import annotations

from kvrelay._proto.dynamo.kvrelay import v1 as pb


def copy_relay(relay: pb.RelayIdentity) -> pb.RelayIdentity:
    """Private copy so a caller mutating its object cannot change already-published messages."""
    return pb.RelayIdentity(
        drt_instance_id=relay.drt_instance_id, relay_incarnation=relay.relay_incarnation
    )


def text_problem(value: object) -> str | None:
    """Why ``value`` is not a valid contract text field (§3.3), or None if it is."""
    if not isinstance(value, str):
        return f"expected str, got {type(value).__name__}"
    if not value:
        return "must be non-empty"
    if value != value.strip():
        return f"{value!r} has leading/trailing whitespace"
    return None


def as_role(role: object) -> pb.WorkerRole | None:
    """The defined, non-UNSPECIFIED ``WorkerRole`` for ``role`` (enum or int), else None.

    Unknown numbers and UNSPECIFIED fail closed (§3.1).
    """
    if isinstance(role, bool) or not isinstance(role, int):
        return None
    try:
        value = pb.WorkerRole(role)
    except ValueError:
        return None
    return value if value in _ROLES else None


_ROLES = frozenset(
    {
        pb.WorkerRole.PREFILL,
        pb.WorkerRole.DECODE,
        pb.WorkerRole.ENCODE,
        pb.WorkerRole.AGGREGATED,
        pb.WorkerRole.LEGACY,
    }
)
