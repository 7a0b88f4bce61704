"""One pool's ``PoolStats``: its counters, its live generation's gauges and the totals of what it
retired, so the numbers never go backwards while generations and subscribers are replaced."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import fields

from kvrelay.ingest.counters import SubscriberCounters
from kvrelay.ingest.sink import SourceKey
from kvrelay.ingest.subscriber import Subscriber
from kvrelay.relay.connected import DEPARTED, ConnectedMembers, counter_values
from kvrelay.relay.engines import EngineState
from kvrelay.relay.generation import Generation
from kvrelay.relay.stats import (
    EngineStats,
    GenerationStats,
    GenerationTotals,
    PoolCounters,
    PoolStats,
    SourceStats,
    merged,
)

__all__ = ["generation_totals", "pool_stats"]


def generation_totals(gen: Generation) -> GenerationTotals:
    """The counters of one generation, to fold into the pool's totals when it retires."""
    p = gen.pool
    hub = gen.hub_stats()
    return GenerationTotals(
        capacity_omissions=p.capacity_omissions,
        unknown_removals=p.unknown_removals,
        duplicate_stores=p.duplicate_stores,
        report_stores=p.report_stores,
        ambiguous_stores=p.ambiguous_stores,
        copy_removals=p.copy_removals,
        rebuild_holds=gen.rebuild_holds,
        rebuild_holds_broken=gen.rebuild_holds_broken,
        invariant_violations=p.invariant_violations,
        deltas=gen.batches_published,
        hub_resets=hub["resets"],
        lagged=hub["lagged"],
        snapshots_served=hub["snapshots_served"],
        snapshots_built=hub["snapshots_built"],
        errors=dict(p.errors_by_kind),
    )


def pool_stats(
    *,
    name: str,
    bucket_count: int,
    gen: Generation | None,
    retired: GenerationTotals,
    source_totals: Mapping[SourceKey, SubscriberCounters],
    departed: SubscriberCounters | None = None,
    subscribers: Mapping[SourceKey, Subscriber],
    connected: ConnectedMembers | None,
    counters: PoolCounters,
    engines: Iterable[EngineState],
    engine_name: Callable[[int], str],
) -> PoolStats:
    """A snapshot of the pool's counters and gauges (monotonic across replacements).
    ``departed``: the sum of what the sources of engines no longer in the pool counted."""
    totals = retired.copy()
    gstats: GenerationStats | None = None
    if gen is not None:
        totals.add(generation_totals(gen))
        pool = gen.pool
        gstats = GenerationStats(
            layout_generation=gen.layout_generation,
            sequence=gen.sequence,
            subscribers=gen.subscriber_count,
            occupancy=pool.occupancy,
            members=len(pool.members()),
            memberships=pool.memberships,
            distinct_blocks=pool.distinct_canonical,
            state_bytes=pool.memory_bytes(),
        )
    sources: list[SourceStats] = []
    for key in sorted(set(source_totals) | set(subscribers)):
        sub = subscribers.get(key)
        prev = source_totals.get(key)
        if sub is None:  # frozen: the snapshot is read off the loop (a scrape's families)
            assert prev is not None
            sc, state = prev.frozen(), "stopped"
        else:
            sc = sub.counters.frozen() if prev is None else merged(prev, sub.counters)
            # a source past its replay with no connection to its publisher (never reached: no
            # listener, an unresolvable host; or reconnecting) is not shown as live
            state = "disconnected" if sub.state == "live" and not sub.connected else sub.state
        sources.append(SourceStats(engine_name(key.worker_id), key.dp_rank, state, sc))
    if departed is not None:  # engines that left the pool: one sum, not a series each
        sources.append(SourceStats(DEPARTED, 0, "stopped", departed.frozen()))
    if connected is not None:
        sources += connected.source_stats()
    c = counters
    return PoolStats(
        name=name,
        bucket_count=bucket_count,
        materialized=gen is not None,
        counters={f.name: getattr(c, f.name) for f in fields(c) if f.name != "member_resets"}
        | counter_values(connected.counters if connected else None),
        member_resets=dict(c.member_resets),
        generations=totals,
        generation=gstats,
        sources=tuple(sources),
        engines=tuple(
            EngineStats(
                st.spec.name, st.reachable, st.down,
                tuple(sorted(st.snapshot.unknown)) if st.snapshot is not None else (),
            )
            for st in engines
        ),
    )
