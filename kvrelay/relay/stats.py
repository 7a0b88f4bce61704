"""Read-only statistics of a running relay, for metrics and diagnostics.

Counters must never go backwards, but subscribers and generations are replaced while the relay
runs (a fence, an engine restart, a pool withdrawn and re-materialized). So each pool folds the
final counters of what it retires into per-pool and per-member totals, and ``Relay.stats()``
returns those totals plus the live objects' current values: monotonic and exact, with nothing for
the reader to track. Everything here is plain data (snapshots), built on demand.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvrelay.ingest.counters import SubscriberCounters


@dataclass(slots=True)
class PoolCounters:
    """A pool's own counters (``PoolStats.counters`` holds the scalars)."""

    batches: int = 0
    events: int = 0
    events_rejected: int = 0
    dropped_without_generation: int = 0
    member_resets: dict[str, int] = field(default_factory=dict)
    generations: int = 0
    fences: int = 0
    block_size_conflicts: int = 0
    source_duplicates: int = 0  # sources left out for another engine's at the same publisher
    source_failures: int = 0  # subscribers that crashed or failed to start
    engines_down: int = 0  # engines declared down (members cleared)
    identity_changes: int = 0  # re-materialized for a new model / model source / block size
    identity_conflicts: int = 0  # withdrawn because reachable engines disagree
    rebuild_backoffs: int = 0  # rebuilds after a fence that waited (repeated fences)
    reconfigurations: int = 0  # re-materialized because a reload changed filter settings
    members_resumed: int = 0  # restored members whose subscriber resumed (then vouched or reset)
    members_vouched: int = 0  # restored members their engine vouched for (kept)
    scrub_passes: int = 0  # full scrub passes over a generation
    scrub_divergences: int = 0  # passes that found the filter or exact state wrong (fenced)
    restores_discarded: int = 0  # restored state not used: another identity, or unloadable

    def reset(self, reason: str) -> None:
        self.member_resets[reason] = self.member_resets.get(reason, 0) + 1


@dataclass(slots=True)
class GenerationTotals:
    """Counters of a pool's generations (live + retired), per pool."""

    capacity_omissions: int = 0
    unknown_removals: int = 0
    duplicate_stores: int = 0
    report_stores: int = 0
    ambiguous_stores: int = 0
    copy_removals: int = 0
    rebuild_holds: int = 0
    rebuild_holds_broken: int = 0
    invariant_violations: int = 0
    deltas: int = 0
    hub_resets: int = 0
    lagged: int = 0
    snapshots_served: int = 0
    snapshots_built: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def add(self, other: GenerationTotals) -> None:
        for f in fields(self):
            if f.name == "errors":
                for kind, n in other.errors.items():
                    self.errors[kind] = self.errors.get(kind, 0) + n
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def copy(self) -> GenerationTotals:
        out = GenerationTotals()
        out.add(self)
        return out


@dataclass(frozen=True, slots=True)
class GenerationStats:
    """Gauges of the pool's live generation."""

    layout_generation: int
    sequence: int
    subscribers: int
    occupancy: int
    members: int
    memberships: int
    distinct_blocks: int
    state_bytes: int


@dataclass(frozen=True, slots=True)
class SourceStats:
    """One (engine, DP rank) event source: its subscriber state and cumulative counters."""

    engine: str
    dp_rank: int
    state: str  # the live subscriber's state, or "stopped" when none runs
    counters: SubscriberCounters


@dataclass(frozen=True, slots=True)
class EngineStats:
    name: str
    reachable: bool
    down: bool = False
    #: Optional Control RPCs that failed on the last probe (their values are kept, not trusted).
    control_unknown: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PoolStats:
    name: str
    bucket_count: int
    materialized: bool
    counters: dict[str, int]  # PoolCounters scalars
    member_resets: dict[str, int]  # reason → count (pool side, incl. incarnation)
    generations: GenerationTotals
    generation: GenerationStats | None
    sources: tuple[SourceStats, ...]
    engines: tuple[EngineStats, ...]


@dataclass(frozen=True, slots=True)
class RelayStats:
    dc_name: str
    dc_id: int
    drt_instance_id: int
    relay_incarnation: int
    catalog_revision: int
    readiness_revision: int
    load_version: int
    hubs_initialized: int
    hubs_limit: int
    metadata_errors: int
    metadata_rejections: dict[tuple[str, str], int]
    hubs_evicted: int
    scrape_errors: int
    pools: tuple[PoolStats, ...]
    state_restores: dict[str, int] = field(default_factory=dict)
    state_saves: dict[str, int] = field(default_factory=dict)
    dns_removals_deferred: int = 0
    dns_duplicates: int = 0
    dns_resolutions: int = 0
    dns_failures: int = 0  # lookups that failed or were refused (nothing changed)
    dns_engines_added: int = 0
    dns_engines_removed: int = 0
    checkpoint_unix: dict[str, float] = field(default_factory=dict)
    #: pool → (unix time of the last full scrub pass, whether it found nothing wrong)
    scrub_last: dict[str, tuple[float, bool]] = field(default_factory=dict)
    #: (plane, kind) → windows skipped (kind ``window``) or entries dropped (``entry``) by the
    #: load and serving-load planes
    window_errors: dict[tuple[str, str], int] = field(default_factory=dict)
    #: engine ``/metrics`` pages not read, by reason: unreachable, status, malformed
    scrape_failures: dict[str, int] = field(default_factory=dict)


def merged(a: SubscriberCounters, b: SubscriberCounters) -> SubscriberCounters:
    """A new ``SubscriberCounters`` holding ``a + b`` (field by field, dicts by key)."""
    out = SubscriberCounters()
    for c in (a, b):
        for f in fields(c):
            value = getattr(c, f.name)
            if isinstance(value, dict):
                target: dict[str, int] = getattr(out, f.name)
                for k, n in value.items():
                    target[k] = target.get(k, 0) + n
            elif f.metadata.get("merge") == "max":  # a time, not a count
                setattr(out, f.name, max(getattr(out, f.name), value))
            else:
                setattr(out, f.name, getattr(out, f.name) + value)
    return out
