"""Plain read-only views the SDK hands out (no protobuf objects leak to callers)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, order=True)
class PoolKey:
    """A pool as a router names it: the relay it came from plus its serving endpoint."""

    relay: str
    namespace: str
    component: str
    endpoint: str

    @property
    def endpoint_path(self) -> str:
        return f"{self.namespace}/{self.component}/{self.endpoint}"

    def __str__(self) -> str:
        return f"{self.relay}/{self.endpoint_path}"


@dataclass(frozen=True, slots=True)
class ReadinessView:
    """One topology entry (§9). ``routable`` is True only for READY with a live readiness stream;
    UNKNOWN, UNAVAILABLE and "no readiness received" are never routable."""

    relay: str
    namespace: str
    model: str
    state: str  # READY / UNAVAILABLE / UNKNOWN
    present_roles: tuple[str, ...]
    missing_roles: tuple[str, ...]
    members: tuple[str, ...]  # ns/component/endpoint of each member
    adapters: dict[str, str] = field(default_factory=dict)  # adapter id -> state
    revision: int = 0

    @property
    def routable(self) -> bool:
        return self.state == "READY"


@dataclass(frozen=True, slots=True)
class LoadView:
    """One pool's load window (§10.1). Utilization only when the window is authoritative
    (every expected rank observed and capacity known); never read as zero load otherwise."""

    kv_used_blocks: int
    total_kv_blocks: int
    observed_ranks: int
    expected_ranks: int
    window_sequence: int
    observed_ms: int

    @property
    def authoritative(self) -> bool:
        return (
            self.expected_ranks > 0
            and self.observed_ranks == self.expected_ranks
            and self.total_kv_blocks > 0
        )

    @property
    def utilization(self) -> float | None:
        if not self.authoritative:
            return None
        return min(1.0, self.kv_used_blocks / self.total_kv_blocks)


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    pool: PoolKey
    installed: bool
    layout_generation: int
    bucket_count: int
    sequence: int | None
    occupancy: int  # non-empty fingerprint slots
    staleness_s: float | None  # seconds since the last accepted frame
    frames: dict[str, int]  # accepted frames by kind (all replicas of this pool)
    drops: dict[str, int]  # replica drops by reason
    subscribes: int
    quarantined: bool
