"""Relay limits (``docs/contract.md`` §3.4) and non-blocking permit counters.

Every subscriber/hub bound is a `PermitCounter`: acquisition never waits; failure is the
RESOURCE_LIMIT error the caller turns into RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

MiB = 1024 * 1024
#: Largest CBI1 frame (one full 524,288-bucket snapshot chunk).
MAX_CBI1_FRAME_BYTES = 4_194_368
#: Per-frame overhead counted against `publication_queue_bytes` (§3.4).
QUEUE_FRAME_OVERHEAD = 256
_ONE_YEAR_S = 365 * 24 * 3600.0
#: Durations for which 0 means "at once" rather than a misconfiguration.
MAY_BE_ZERO = frozenset({"publication_delay_s"})


class LimitsError(ValueError):
    """A RelayLimits field is out of range."""


@dataclass(frozen=True, slots=True)
class RelayLimits:
    """Defaults mirror Dynamo's relay; durations are seconds (float)."""

    max_message_bytes: int = 8 * MiB
    keepalive_interval_s: float = 20.0
    keepalive_timeout_s: float = 10.0
    pool_heartbeat_s: float = 10.0
    readiness_heartbeat_s: float = 10.0
    snapshot_progress_timeout_s: float = 60.0
    #: A stream that ended while its client was not reading is reset after this long.
    stalled_stream_reset_s: float = 60.0
    load_window_s: float = 1.0
    publication_queue_capacity: int = 16
    publication_queue_bytes: int = 16 * MiB
    publication_encoding_concurrency: int = 2
    max_catalog_subscribers: int = 64
    max_pool_streams_total: int = 64
    max_subscribers_per_pool: int = 64
    max_initialized_pool_hubs: int = 64
    max_readiness_subscribers: int = 64
    max_load_subscribers: int = 64
    load_fanout_capacity: int = 16
    publish_every_n_events: int = 16
    #: Cuts below ``publish_every_n_events`` are this far apart at least: a command that arrives
    #: after a quiet spell is cut at the end of the loop iteration that applied it, one that
    #: follows a cut sooner waits for the rest of this delay (0: never waits).
    publication_delay_s: float = 0.001
    #: Pacing (``publication.cadence``): publishing takes at most about this share of the time…
    publication_cpu_percent: int = 10
    #: …and never holds a pending command back longer than this.
    publication_max_delay_s: float = 0.005
    #: While a subscriber catches up (its snapshot, then what queued meanwhile), publications are
    #: spaced so that a reader at this rate always gets through (§8.4) ...
    snapshot_reader_bytes_per_second: int = 80_000_000
    #: ... but never further apart than this.
    snapshot_publication_delay_s: float = 0.25
    #: The share of each stream limit (rounded up) one HTTP/2 connection is guaranteed when the
    #: limit is full (a newcomer below it preempts whoever is furthest over; service/shares.py)...
    stream_share_per_connection_percent: int = 50
    #: ... and one peer address (all its connections together).
    stream_share_per_peer_percent: int = 75
    #: Connections the gRPC port holds in all, and per TCP peer address: each takes a file
    #: descriptor and its buffers; one over a cap is closed as it is accepted.
    max_connections: int = 4096
    max_connections_per_address: int = 512
    #: Bytes of requests larger than 16 KiB (no valid request is) the relay reads at once, in
    #: all: one that would pass it is refused before its body is read (RESOURCE_LIMIT).
    max_request_bytes_in_flight: int = 32 * 1024 * 1024
    #: Streams that may wait longer than a second for their request, in all: past it, each new
    #: stream ends the one that has waited longest (RESOURCE_LIMIT).
    max_pending_requests: int = 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise LimitsError(f"{f.name} must be a number, got {value!r}")
            if f.name in MAY_BE_ZERO:
                if not 0 <= float(value) <= _ONE_YEAR_S:
                    raise LimitsError(f"{f.name} must be >= 0 and <= 1 year, got {value}")
            elif f.name.endswith("_s"):
                if not 0 < float(value) <= _ONE_YEAR_S:
                    raise LimitsError(f"{f.name} must be > 0 and <= 1 year, got {value}")
            elif not isinstance(value, int) or value < 1:
                raise LimitsError(f"{f.name} must be a positive integer, got {value!r}")
        if self.max_message_bytes < MAX_CBI1_FRAME_BYTES + 64 * 1024:
            raise LimitsError(
                f"max_message_bytes must be >= {MAX_CBI1_FRAME_BYTES + 64 * 1024} "
                "(a full snapshot chunk plus envelope)"
            )
        if self.publication_queue_bytes < MAX_CBI1_FRAME_BYTES + QUEUE_FRAME_OVERHEAD:
            raise LimitsError(
                "publication_queue_bytes must hold one full snapshot chunk "
                f"(>= {MAX_CBI1_FRAME_BYTES + QUEUE_FRAME_OVERHEAD})"
            )
        if self.load_fanout_capacity > 65_536:
            raise LimitsError("load_fanout_capacity must be <= 65536")
        for name in (
            "publication_cpu_percent", "stream_share_per_connection_percent",
            "stream_share_per_peer_percent",
        ):  # fmt: skip
            if getattr(self, name) > 100:
                raise LimitsError(f"{name} must be <= 100")


class PermitCounter:
    """A non-blocking counting semaphore. `try_acquire` never waits."""

    __slots__ = ("_in_use", "capacity", "name")

    def __init__(self, name: str, capacity: int) -> None:
        if capacity < 1:
            raise LimitsError(f"{name}: capacity must be >= 1")
        self.name = name
        self.capacity = capacity
        self._in_use = 0

    @property
    def in_use(self) -> int:
        return self._in_use

    def try_acquire(self) -> bool:
        if self._in_use >= self.capacity:
            return False
        self._in_use += 1
        return True

    def release(self) -> None:
        if self._in_use <= 0:
            raise RuntimeError(f"{self.name}: release without acquire")
        self._in_use -= 1
