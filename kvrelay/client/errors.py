"""Consumer-rule violations and the drop-reason vocabulary shared by the SDK and the CLI.

Every way a pool replica can end has one stable lower-case reason string; counters are keyed by
it, so operators can tell a lagging consumer from a relay breaking the contract.
"""

from __future__ import annotations

from typing import Final

from kvrelay._proto.dynamo.kvrelay import v1 as pb

TRAILER_KEY: Final = "kv-relay-error-reason"
_REASON_PREFIX: Final = "RELAY_ERROR_REASON_"

# --- consumer-rule violations (raised by PoolReplica.feed) -------------------------------------
ENVELOPE = "envelope"  # wrong contract_marker / protocol_version
RELAY_IDENTITY_CHANGED = "relay_identity_changed"  # frame's relay differs from the session's
PRODUCER_IDENTITY = "producer_identity"  # frame's producer is not exactly the subscribed one
UNKNOWN_KIND = "unknown_kind"
KIND_MISMATCH = "kind_mismatch"  # FilterUpdate kind disagrees with the CBI1 flags
SNAPSHOT_SEQUENCE = "snapshot_sequence"  # chunk with base != sequence or from another cut
UNEXPECTED_SNAPSHOT = "unexpected_snapshot"  # snapshot chunk after the replica was installed
EPOCH_MISMATCH = "epoch_mismatch"  # CBI1 epoch/base_epoch != FilterUpdate sequence/base
DC_ID_MISMATCH = "dc_id_mismatch"  # CBI1 dc_id != producer pool_id.dc_id
DELTA_BEFORE_SNAPSHOT = "delta_before_snapshot"
SEQUENCE_GAP = "sequence_gap"  # delta base_sequence > installed sequence (frames missing)
WRONG_BASE = "wrong_base"  # delta base_sequence < installed sequence (stale/replayed)
BAD_INCREMENT = "bad_increment"  # delta sequence != base_sequence + 1
HEARTBEAT_BEFORE_SNAPSHOT = "heartbeat_before_snapshot"
HEARTBEAT_SEQUENCE = "heartbeat_sequence"  # heartbeat seq != installed or base != seq
HEARTBEAT_PAYLOAD = "heartbeat_payload"  # heartbeat with a non-empty payload
CBI1_PREFIX = "cbi1_"  # + Cbi1Error.reason, e.g. cbi1_checksum_mismatch
# --- plane-stream rules (catalog, readiness, load, serving load) --------------------------------
VERSION_BACKWARDS = "version_backwards"  # revision / window_sequence below the stream's newest

# --- stream endings and client decisions --------------------------------------------------------
EOF = "eof"  # clean end of stream (relay shutdown): treated as invalidation
CONNECTION = "connection"  # transport failure (refused, reset, h2 error)
NO_STATUS = "no_status"  # END_STREAM with no status (no trailers); not a relay's UNKNOWN
SILENT = "silent"  # no frame (not even a heartbeat) for silence_heartbeats heartbeat periods
COMPRESSED = "compressed"  # a reply with the compressed flag (the SDK takes identity only)
WITHDRAWN = "withdrawn"  # pool absent from the newest catalog snapshot
CATALOG_REPLACED = "catalog_replaced"  # catalog now lists another producer for the endpoint
RELAY_RESTARTED = "relay_restarted"  # the relay's identity changed: every replica dropped
TOO_LARGE = "too_large"  # bucket_count above ClientConfig.max_bucket_count (quarantined)

#: Server reasons after which resubscribing cannot help until the catalog changes (§3.2).
QUARANTINE = frozenset(
    {"contract_mismatch", "unsupported_feature", "invalid_request", TOO_LARGE}
)


class ConsumerViolation(Exception):
    """The relay broke a consumer rule (§4.7/§5); the replica must be dropped."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def reason_from_trailer(value: str | None) -> str | None:
    """``RELAY_ERROR_REASON_SUBSCRIBER_LAGGED`` → ``subscriber_lagged``; unknown → None."""
    if not value or not value.startswith(_REASON_PREFIX):
        return None
    name = value[len(_REASON_PREFIX) :]
    known = pb.RelayErrorReason.betterproto_value_to_renamed_proto_names().values()
    if value not in known or name == "UNSPECIFIED":
        return None
    return name.lower()
