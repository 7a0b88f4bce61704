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
class PoolServingView:
    """One pool's serving-load window (Dynamo 1.7). ``status``: COMPLETE / DEGRADED /
    UNAVAILABLE, or UNSPECIFIED for a value this SDK does not know (treat as unknown). A gauge is
    None when the relay left it unset (unknown, never zero) or the view is not COMPLETE (a
    partial sum would read as lower load)."""

    status: str
    active_decode_blocks: int | None
    active_prefill_tokens: int | None
    live_workers: int | None
    max_concurrency: int | None
    source_observed_ms: int
    window_sequence: int

    @property
    def complete(self) -> bool:
        return self.status == "COMPLETE"


@dataclass(frozen=True, slots=True)
class ModelServingView:
    """One (namespace, model)'s serving-load window. The ``*_total`` counters are cumulative
    within one relay incarnation (``relay_incarnation``): compute rates only between windows of
    the same incarnation. Gauges and token figures are None when unset, and gauges also when
    the view is not COMPLETE."""

    relay: str
    namespace: str
    model: str
    status: str
    requests_started_total: int
    requests_completed_total: int
    requests_failed_total: int
    requests_cancelled_total: int
    requests_awaiting_first_token: int | None
    requests_generating: int | None
    input_tokens_total: int | None
    output_tokens_total: int | None
    inflight_input_tokens: int | None
    awaiting_first_token_input_tokens: int | None
    expected_frontends: int
    observed_frontends: int
    ready_frontends: int
    serving_pools: tuple[PoolKey, ...]
    source_observed_ms: int
    window_sequence: int
    relay_incarnation: int

    @property
    def complete(self) -> bool:
        return self.status == "COMPLETE"


@dataclass(frozen=True, slots=True)
class ServingLoadViews:
    """What ``RelayClient.serving_load()`` returns: pools by key, models in relay order.
    ``unsupported`` lists the relays that do not implement the RPC (Dynamo 1.6)."""

    pools: dict[PoolKey, PoolServingView] = field(default_factory=dict)
    models: list[ModelServingView] = field(default_factory=list)
    unsupported: tuple[str, ...] = ()


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
