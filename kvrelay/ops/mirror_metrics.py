"""Metrics of mirrors and fan-out workers, read from their ``stats()`` at scrape time.

``MirrorCollector`` turns mirror statistics into ``kvrelay_mirror_*`` families labelled by
``worker`` (``""`` for a standalone mirror); ``WorkersCollector`` adds the supervisor's
``kvrelay_workers`` and ``kvrelay_worker_restarts_total`` and every worker's mirror. A ``workers
= N`` relay registers it next to ``RelayMetrics``; ``MirrorMetrics`` is the whole endpoint of a
mirror daemon (mirror, service streams under the relay's metric names, loop lag).
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvrelay.client import errors as E
from kvrelay.mirror import checker
from kvrelay.ops.gc_pauses import pauses
from kvrelay.ops.metrics import (
    LOOP_LAG_BUCKETS,
    STREAM_ERROR_REASONS,
    ReloadSource,
    ServiceSource,
    UpgradeSource,
    default_registry,
    gc_pause_families,
    known_at_zero,
    reload_families,
    service_families,
    tls_families,
    upgrade_families,
)
from kvrelay.ops.metrics_http import Collected, HttpCounters, MetricsServer, http_metrics

MirrorStats = Callable[[], list[tuple[str, dict[str, Any]]]]  # (worker label, Mirror.stats())

#: The planes a mirror's upstream session needs live (``Mirror.in_session``; serving load is
#: optional: a Dynamo 1.6 upstream has none).
SESSION_PLANES = ("catalog", "readiness", "load")
#: Every plane a mirror follows, as its statistics name them.
MIRROR_PLANES = (*SESSION_PLANES, "serving-load")
# The known ends of the mirror's upstream streams, exported at 0 from the start (as the relay's
# by-reason counters, ``metrics.known_at_zero``): how the SDK names a stream's end
# (``rpc.StreamEnd``) and every relay reason; ``status_<code>`` (an end without the reason
# trailer: no kvrelay upstream) appears at its first count. Per worker: 19 reasons for pools,
# 4 planes × 19 for planes.
_ENDS = (E.EOF, E.CONNECTION, E.SILENT, E.ENVELOPE, E.COMPRESSED, E.NO_STATUS,
         *(str(E.reason_from_trailer(r)) for r in STREAM_ERROR_REASONS))  # fmt: skip
#: ``kvrelay_mirror_pool_stream_ends_total{reason}``: with the mirror's own (a frame its checker
#: refused, a failure inside the mirror, a withdrawn pool closed after its grace).
POOL_END_REASONS = tuple(sorted({*_ENDS, "violation", "internal", "withdrawn"}))
#: ``kvrelay_mirror_plane_stream_ends_total{reason}``: with the mirror's own (an upstream
#: without the RPC, a stream started over on a new identity, a failure inside the mirror).
PLANE_END_REASONS = tuple(sorted({*_ENDS, "unimplemented", "superseded", "internal"}))
#: ``kvrelay_mirror_violations_total{reason}``: the checker's closed set of rules.
VIOLATION_REASONS = checker.VIOLATION_REASONS
_POOL_END_KEYS = tuple(f"end_{r}" for r in POOL_END_REASONS)  # as ``pool_totals`` holds them
_VIOLATION_KEYS = tuple(f"violation_{r}" for r in VIOLATION_REASONS)
_PLANE_END_KEYS = tuple(f"{plane}_{r}" for plane in MIRROR_PLANES for r in PLANE_END_REASONS)


def in_session(stats: dict[str, Any]) -> bool:
    """``Mirror.in_session`` from its ``stats()`` (also as a worker reports it, in JSON): an
    upstream identity, and the catalog, readiness and load planes delivering (readiness or load
    answered UNIMPLEMENTED by the upstream counts: the mirror serves without it, as its health
    says)."""
    planes = stats.get("planes", {})
    return stats.get("identity") is not None and all(
        planes.get(name, {}).get("live", False) or planes.get(name, {}).get("unsupported", False)
        for name in SESSION_PLANES
    )


class MirrorCollector(Collector):
    def __init__(self, source: MirrorStats) -> None:
        self.source = source

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        lw = ["worker"]
        synced = GaugeMetricFamily(
            "kvrelay_mirror_synced",
            "1 once the mirror synchronized (the page is served from then on: before, the "
            "mirror_synchronizing log lines say what it waits for).",
            labels=lw,
        )
        session = GaugeMetricFamily(
            "kvrelay_mirror_upstream_session",
            "1 while the mirror holds its upstream session (identity; catalog live; readiness and "
            "load live or answered UNIMPLEMENTED by the upstream); 0: it refuses every RPC and its "
            "health says NOT_SERVING.", labels=lw,
        )  # fmt: skip
        resets = CounterMetricFamily(
            "kvrelay_mirror_upstream_channel_resets",
            "Upstream channels replaced after the upstream connection failed or went away.",
            labels=lw,
        )  # fmt: skip
        deaf = CounterMetricFamily(
            "kvrelay_mirror_upstream_channel_deaf",
            "Upstream channels replaced because a round trip on them went unanswered while they "
            "still received (a path dead towards the upstream only); among the channel resets.",
            labels=lw,
        )  # fmt: skip
        left = CounterMetricFamily(
            "kvrelay_mirror_upstream_channel_left_draining",
            "Upstream connections left for new calls because the upstream refused a call as "
            "draining (the next calls open a new one; the streams open on it go on).", labels=lw,
        )  # fmt: skip
        changes = CounterMetricFamily(
            "kvrelay_mirror_upstream_identity_changes",
            "Upstream relay identity changes followed (upstream restarts).", labels=lw,
        )  # fmt: skip
        pools = GaugeMetricFamily("kvrelay_mirror_pools", "Mirrored pools by state.",
                                  labels=[*lw, "state"])  # fmt: skip
        ends = CounterMetricFamily("kvrelay_mirror_pool_stream_ends",
                                   "Upstream pool streams ended, by how.",
                                   labels=[*lw, "reason"])  # fmt: skip
        violations = CounterMetricFamily(
            "kvrelay_mirror_violations", "Upstream frames refused by the strict checker.",
            labels=[*lw, "reason"],
        )  # fmt: skip
        deltas = CounterMetricFamily("kvrelay_mirror_deltas", "Upstream deltas re-served.",
                                     labels=lw)  # fmt: skip
        lagged = CounterMetricFamily("kvrelay_mirror_subscribers_lagged",
                                     "Local subscribers ended as lagged.", labels=lw)  # fmt: skip
        evicted = CounterMetricFamily(
            "kvrelay_mirror_pools_evicted",
            "Idle mirrored pools dropped to make room for another (hub limit).", labels=lw,
        )  # fmt: skip
        released = CounterMetricFamily(
            "kvrelay_mirror_pools_released",
            "Mirrored pools released after [mirror] release_idle_s without a local subscriber: "
            "their upstream streams ended, freeing the upstream's hubs; each is mirrored again "
            "when a subscriber asks for it.", labels=lw,
        )  # fmt: skip
        planes = CounterMetricFamily("kvrelay_mirror_plane_stream_ends",
                                     "Upstream plane streams ended, by plane and how.",
                                     labels=[*lw, "plane", "reason"])  # fmt: skip
        plane_violations = CounterMetricFamily(
            "kvrelay_mirror_plane_violations",
            "Upstream plane streams the mirror ended for breaking a rule (an undecodable "
            "message, a wrong envelope or relay identity, a version going backwards), by plane.",
            labels=[*lw, "plane"],
        )  # fmt: skip
        invalid = CounterMetricFamily(
            "kvrelay_mirror_catalog_invalid",
            "Upstream catalog descriptors not mirrored: their producer is no valid pool key.",
            labels=lw,
        )  # fmt: skip
        spacing = CounterMetricFamily(
            "kvrelay_mirror_spacing_requests",
            "Requests to the upstream to space a pool's publications while local joiners catch "
            "up, by result: granted, denied (PERMISSION_DENIED: asked again 30 s later), failed "
            "(transport, timeout, another status).", labels=[*lw, "result"],
        )  # fmt: skip
        spacing_on = GaugeMetricFamily(
            "kvrelay_mirror_upstream_spacing",
            "1 while the mirror asks its upstream for spacing; 0 once the upstream said it "
            "cannot (UNIMPLEMENTED: a relay other than kvrelay), until the channel is replaced.",
            labels=lw,
        )  # fmt: skip
        for worker, s in self.source():
            if not s:
                continue
            synced.add_metric([worker], 1.0 if s.get("synced") else 0.0)
            session.add_metric([worker], 1.0 if in_session(s) else 0.0)
            resets.add_metric([worker], float(s.get("channel_resets", 0)))
            deaf.add_metric([worker], float(s.get("channel_deaf", 0)))
            left.add_metric([worker], float(s.get("channel_left_draining", 0)))
            changes.add_metric([worker], float(s.get("identity_changes", 0)))
            states: dict[str, int] = {}
            for p in s.get("pools", {}).values():
                states[p["state"]] = states.get(p["state"], 0) + 1
            for state, n in sorted(states.items()):
                pools.add_metric([worker, state], n)
            totals = s.get("pool_totals", {})
            known = known_at_zero((*_POOL_END_KEYS, *_VIOLATION_KEYS), totals)
            for k, v in sorted(known.items()):
                if k.startswith("end_"):
                    ends.add_metric([worker, k[4:]], float(v))
                elif k.startswith("violation_"):
                    violations.add_metric([worker, k[10:]], float(v))
            deltas.add_metric([worker], float(totals.get("deltas", 0)))
            lagged.add_metric([worker], float(totals.get("lagged", 0)))
            evicted.add_metric([worker], float(s.get("pools_evicted", 0)))
            released.add_metric([worker], float(s.get("pools_released", 0)))
            for k, v in sorted(known_at_zero(_PLANE_END_KEYS, s.get("plane_ends", {})).items()):
                plane, _, reason = k.partition("_")
                planes.add_metric([worker, plane, reason], float(v))
            refused = known_at_zero(MIRROR_PLANES, s.get("plane_violations", {}))
            for plane, n in sorted(refused.items()):
                plane_violations.add_metric([worker, plane], float(n))
            invalid.add_metric([worker], float(s.get("catalog_invalid", 0)))
            failed, denied = int(s.get("hold_failures", 0)), int(s.get("hold_denied", 0))
            spacing.add_metric([worker, "granted"], float(totals.get("holds_sent", 0)))
            spacing.add_metric([worker, "denied"], float(denied))
            spacing.add_metric([worker, "failed"], float(max(0, failed - denied)))
            spacing_on.add_metric([worker], 1.0 if s.get("upstream_spacing", True) else 0.0)
        yield from (synced, session, resets, deaf, left, changes, pools, ends, violations,
                    deltas, lagged, evicted, released, planes, plane_violations, invalid,
                    spacing, spacing_on)  # fmt: skip


class WorkersCollector(Collector):
    """The supervisor's view: configured and serving workers, restarts."""

    def __init__(self, supervisor: Any) -> None:
        self.supervisor = supervisor

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        sup = self.supervisor
        workers = GaugeMetricFamily("kvrelay_workers", "Fan-out worker processes.",
                                    labels=["state"])  # fmt: skip
        workers.add_metric(["configured"], sup.count)
        workers.add_metric(["serving"], sup.alive)
        restarts = CounterMetricFamily("kvrelay_worker_restarts",
                                       "Fan-out workers restarted after exiting.")  # fmt: skip
        restarts.add_metric([], sup.restarts)
        dropped = CounterMetricFamily(
            "kvrelay_worker_reports_dropped",
            "STATS reports a worker dropped because the supervisor read its pipe late.",
            labels=["worker"],
        )  # fmt: skip
        for i, s in enumerate(sup.worker_stats()):
            if s:
                dropped.add_metric([str(i + 1)], float(s.get("reports_dropped", 0)))
        yield workers
        yield restarts
        yield dropped
        yield from MirrorCollector(self._mirrors).collect()

    def _mirrors(self) -> list[tuple[str, dict[str, Any]]]:
        return [
            (str(i + 1), s.get("mirror", {})) for i, s in enumerate(self.supervisor.worker_stats())
        ]


class _ServiceCollector(Collector):
    def __init__(self, metrics: MirrorMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        svc = self.metrics.service
        if svc is not None:
            yield from service_families(svc)
        yield from gc_pause_families(pauses())
        yield from http_metrics(self.metrics.http_counters)
        yield from tls_families(self.metrics.tls)
        yield from reload_families(self.metrics.reloads)
        yield from upgrade_families(self.metrics.upgrades)


class MirrorMetrics:
    """The ``/metrics`` endpoint of a mirror daemon (same surface as ``RelayMetrics``)."""

    def __init__(self, mirror: Any, registry: CollectorRegistry | None = None) -> None:
        self.mirror = mirror
        self.registry = registry if registry is not None else default_registry()
        self.service: ServiceSource | None = None
        self.http_counters = HttpCounters()
        self.tls: Callable[[], Iterable[Any]] | None = None
        self.upgrades: UpgradeSource | None = None
        self.reloads: ReloadSource | None = None
        self.loop_lag = Histogram("kvrelay_event_loop_lag_seconds",
                                  "Event loop scheduling lag samples.",
                                  buckets=LOOP_LAG_BUCKETS, registry=self.registry)  # fmt: skip
        self.loop_lag_last = Gauge("kvrelay_event_loop_lag_last_seconds",
                                   "Most recent event loop lag sample.",
                                   registry=self.registry)  # fmt: skip
        self.registry.register(MirrorCollector(lambda: [("", self.mirror.stats())]))
        self.registry.register(_ServiceCollector(self))
        pauses()  # garbage collections are timed from now on
        self._http: MetricsServer | None = None

    def attach_service(self, service: ServiceSource) -> None:
        self.service = service

    def attach_tls(self, certificates: Callable[[], Iterable[Any]]) -> None:
        self.tls = certificates

    def attach_upgrades(self, upgrades: UpgradeSource) -> None:
        self.upgrades = upgrades

    def attach_reloads(self, reloads: ReloadSource) -> None:
        self.reloads = reloads

    def listening_socket(self) -> socket.socket | None:
        """The endpoint's listener, if it serves one (a hot upgrade hands it on)."""
        return None if self._http is None else self._http.listening_socket()

    def observe_loop_lag(self, seconds: float) -> None:
        if not math.isnan(seconds):
            self.loop_lag.observe(max(0.0, seconds))
            self.loop_lag_last.set(max(0.0, seconds))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collected(self) -> Collected:
        """What the endpoint serves: collected now, written out off the loop."""
        return Collected(self.registry)

    async def start_http(
        self,
        host: str,
        port: int,
        healthy: Callable[[], bool] | None = None,
        sock: socket.socket | None = None,
    ) -> int:
        """As ``RelayMetrics.start_http`` (the daemon passes ``sock`` for either)."""
        self._http = MetricsServer(
            self.collected, healthy or (lambda: True), counters=self.http_counters
        )
        return await self._http.start(host, port, sock)

    async def close(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            await http.close()
