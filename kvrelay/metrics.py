"""Prometheus metrics: a collector that reads the relay's plain-int counters at scrape time.

Nothing here runs per ZMQ message: subscribers, pools and hubs keep plain ints and the collector
walks them when Prometheus scrapes. The only per-event work is one histogram observation per
*published delta* (``Generation.on_publish``) and one per loop-lag sample.

Counters must never go backwards, but subscribers and generations are replaced at run time (a
fence, an engine leaving, a pool withdrawn). The collector keeps a reference to every object it
has seen; when one disappears it reads that object's final counters once and folds them into a
per-label accumulator, so totals stay monotonic and exact for objects seen by at least one sweep.
Sweeps run on every scrape and every ``sweep_interval_s`` while the HTTP endpoint is up (so a
short-lived generation still gets its latency observer and its totals are kept).

Scrapes are served by a small asyncio HTTP server on the relay's own event loop, so collection
never races the loop that mutates the counters (no locks, no thread-safety questions).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from kvrelay import __version__
from kvrelay._aio import cancel_and_wait
from kvrelay.ingest.counters import SubscriberCounters
from kvrelay.logging import get_logger

if TYPE_CHECKING:
    from kvrelay.ingest.subscriber import Subscriber
    from kvrelay.relay.generation import Generation
    from kvrelay.relay.pool_runtime import PoolRuntime
    from kvrelay.relay.relay import Relay
    from kvrelay.service.server import KvEventRelayService

_log = get_logger(__name__)

#: CKF buckets hold 4 × 16-bit fingerprint slots (spec §6).
SLOTS_PER_BUCKET = 4
DELTA_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: HTTP bounds: request head size, time to send it, concurrent scrapes (beyond → 503).
MAX_REQUEST_HEAD = 8192
REQUEST_TIMEOUT_S = 10.0
MAX_HTTP_CONNECTIONS = 16

_MEMBER = ("pool", "worker", "dp_rank")
MemberKey = tuple[str, str, str]
Flat = Counter[tuple[str, str]]

# Subscriber counters → (metric name without _total, help, extra label or None).
_SUB_SCALARS: dict[str, tuple[str, str]] = {
    "messages": ("kvrelay_ingest_messages", "ZMQ messages received (live and replayed)."),
    "replayed_messages": ("kvrelay_ingest_replayed_messages", "Messages received by replay."),
    "batches": ("kvrelay_ingest_batches", "Event batches delivered to the pool."),
    "events": ("kvrelay_ingest_events_delivered", "Events delivered to the pool."),
    "blocks": ("kvrelay_ingest_blocks", "Block hashes delivered to the pool."),
    "duplicates": ("kvrelay_ingest_duplicates", "Messages already applied (replay overlap)."),
    "gaps": ("kvrelay_ingest_gaps", "Sequence gaps detected on the live stream."),
    "replays": ("kvrelay_ingest_replays", "Replay requests sent to the engine."),
    "replay_failures": ("kvrelay_ingest_replay_failures", "Replays that timed out or broke."),
    "missing_history": (
        "kvrelay_ingest_missing_history", "Replays that started later than requested."
    ),
    "reorder_overflows": (
        "kvrelay_ingest_reorder_overflows", "Reorder buffer bound hit while awaiting a replay."
    ),
}
_SUB_ANOMALIES = ("unknown_tags", "unknown_fields", "malformed_events", "eagle_bigram", "truncated")
_SUB_DICTS: dict[str, tuple[str, str, str]] = {
    "events_by_kind": ("kvrelay_ingest_events", "Decoded events by kind.", "kind"),
    "rejections": (
        "kvrelay_ingest_decode_rejections", "Frames/messages rejected by kind.", "kind"
    ),
    "drops": ("kvrelay_ingest_dropped_events", "Events dropped by reason.", "reason"),
    "resets_by_reason": (
        "kvrelay_ingest_member_resets", "Member state clears by reason (ingest side).", "reason"
    ),
}
# Generation counters → (metric name, help, extra label or None).
_GEN_COUNTERS: dict[str, tuple[str, str, str | None]] = {
    "capacity_omissions": (
        "kvrelay_ckf_capacity_omissions", "Fingerprints the CKF could not place.", None
    ),
    "unknown_removals": ("kvrelay_pool_unknown_removals", "Removals of unknown blocks.", None),
    "invariant_violations": (
        "kvrelay_pool_invariant_violations", "Exact-state invariant violations (fences).", None
    ),
    "errors": ("kvrelay_pool_errors", "Pool apply errors by kind.", "kind"),
    "deltas": ("kvrelay_deltas_published", "Deltas published (sequence advances).", None),
    "hub_resets": (
        "kvrelay_hub_resets", "Oversized publications forcing subscribers to re-snapshot.", None
    ),
    "lagged": (
        "kvrelay_pool_lag_terminations", "Pool subscribers ended for lagging (queue full).", None
    ),
    "snapshots_served": (
        "kvrelay_snapshots_sent", "Snapshots sent to pool subscribers (one per subscription).", None
    ),
    "snapshots_built": (
        "kvrelay_snapshots_built", "Snapshot encodes (shared by joiners at one sequence).", None
    ),
}
# PoolCounters attribute → (metric name, help).
_POOL_COUNTERS: dict[str, tuple[str, str]] = {
    "batches": ("kvrelay_pool_batches_applied", "Batches applied to the pool's exact state."),
    "events": ("kvrelay_pool_events_applied", "Events in applied batches."),
    "events_rejected": ("kvrelay_pool_events_rejected", "Events the pool rejected."),
    "dropped_without_generation": (
        "kvrelay_pool_dropped_without_generation", "Batches dropped while no generation existed."
    ),
    "generations": ("kvrelay_pool_generations", "Generations materialized."),
    "fences": ("kvrelay_pool_fences", "Generations fenced (withdrawn and rebuilt)."),
    "block_size_conflicts": (
        "kvrelay_pool_block_size_conflicts", "Engines skipped for a conflicting kv_block_size."
    ),
}
_STREAM_KINDS = ("catalog", "pool", "readiness", "load")


def _flatten_subscriber(c: SubscriberCounters) -> Flat:
    out: Flat = Counter()
    for attr in _SUB_SCALARS:
        out[(attr, "")] = getattr(c, attr)
    for attr in _SUB_ANOMALIES:
        out[("anomalies", attr)] = getattr(c, attr)
    for attr in _SUB_DICTS:
        d: dict[str, int] = getattr(c, attr)
        for label, n in d.items():
            out[(attr, label)] = n
    return out


def _flatten_generation(gen: Generation) -> Flat:
    p = gen.pool
    out: Flat = Counter()
    out[("capacity_omissions", "")] = p.capacity_omissions
    out[("unknown_removals", "")] = p.unknown_removals
    out[("invariant_violations", "")] = p.invariant_violations
    out[("deltas", "")] = gen.batches_published
    for kind, n in p.errors_by_kind.items():
        out[("errors", kind)] = n
    stats = gen.hub_stats()
    out[("hub_resets", "")] = stats["resets"]
    out[("lagged", "")] = stats["lagged"]
    out[("snapshots_served", "")] = stats["snapshots_served"]
    out[("snapshots_built", "")] = stats["snapshots_built"]
    return out


def default_registry() -> CollectorRegistry:
    """A private registry with the standard process/platform/GC collectors (not the global one,
    so several relays in one process — tests — never clash)."""
    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    PlatformCollector(registry=reg)
    GCCollector(registry=reg)
    return reg


class _Tracker:
    """Monotonic totals over objects that come and go (fold-on-disappear)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[Any, Any]] = {}  # id → (label key, object)
        self.retired: dict[Any, Flat] = {}

    def sweep(
        self, current: Iterable[tuple[Any, Any]], flatten: Callable[[Any], Flat]
    ) -> list[Any]:
        """Replace the live set; fold the final counters of objects gone. Returns new objects."""
        now = {id(obj): (key, obj) for key, obj in current}
        for oid, (key, obj) in self.seen.items():
            if oid not in now:
                self.retired.setdefault(key, Counter()).update(flatten(obj))
        new = [obj for oid, (_k, obj) in now.items() if oid not in self.seen]
        self.seen = now
        return new

    def totals(self, flatten: Callable[[Any], Flat]) -> dict[Any, Flat]:
        out: dict[Any, Flat] = {k: Counter(v) for k, v in self.retired.items()}
        for key, obj in self.seen.values():
            out.setdefault(key, Counter()).update(flatten(obj))
        return out


class RelayMetrics:
    """All kvrelay metrics for one ``Relay``, plus the ``/metrics`` HTTP endpoint."""

    def __init__(
        self,
        relay: Relay,
        registry: CollectorRegistry | None = None,
        *,
        sweep_interval_s: float = 1.0,
    ) -> None:
        self.relay = relay
        self.registry = registry if registry is not None else default_registry()
        self.sweep_interval_s = sweep_interval_s
        self._service: KvEventRelayService | None = None
        self._subs = _Tracker()
        self._gens = _Tracker()
        self._observers: dict[int, tuple[Generation, Callable[[float], None]]] = {}
        self.delta_latency = Histogram(
            "kvrelay_delta_latency_seconds",
            "First applied command of a delta to its publication (relay share of latency).",
            ["pool"],
            buckets=DELTA_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.loop_lag = Histogram(
            "kvrelay_event_loop_lag_seconds",
            "Event loop scheduling lag samples.",
            buckets=LOOP_LAG_BUCKETS,
            registry=self.registry,
        )
        self.loop_lag_last = Gauge(
            "kvrelay_event_loop_lag_last_seconds",
            "Most recent event loop lag sample.",
            registry=self.registry,
        )
        self.registry.register(_RelayCollector(self))
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task[Any]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    # ---- wiring ----------------------------------------------------------------------------------

    def attach_service(self, service: KvEventRelayService) -> None:
        """Export the gRPC service's per-stream-kind subscriber counts and error counts.

        The ``Relay`` does not own the service, so the daemon hands it over after creating the
        server (``metrics.attach_service(server.service)``).
        """
        self._service = service

    def observe_loop_lag(self, seconds: float) -> None:
        if math.isnan(seconds):
            return
        s = max(0.0, seconds)
        self.loop_lag.observe(s)
        self.loop_lag_last.set(s)

    def sweep(self) -> None:
        """Fold counters of vanished subscribers/generations; hook new generations' latency.

        Idempotent and cheap; runs on every scrape and periodically while serving. The daemon
        may also call it right after (re)materializing pools.
        """
        subs: list[tuple[MemberKey, Subscriber]] = []
        gens: list[tuple[str, Generation]] = []
        for p in self.relay.pools:
            for key, sub in list(p.subscribers.items()):
                subs.append(((p.name, _worker_name(p, key.worker_id), str(key.dp_rank)), sub))
            if p.generation is not None:
                gens.append((p.name, p.generation))
        self._subs.sweep(subs, lambda s: _flatten_subscriber(s.counters))
        self._gens.sweep(gens, _flatten_generation)
        live = {id(g) for _n, g in gens}
        for oid in [oid for oid in self._observers if oid not in live]:
            gen, _obs = self._observers.pop(oid)
            self._unhook(gen)
        for name, gen in gens:
            if id(gen) not in self._observers:
                self._hook(name, gen)

    def _hook(self, pool: str, gen: Generation) -> None:
        child = self.delta_latency.labels(pool=pool)
        observe: Callable[[float], None] = child.observe
        prev = gen.on_publish
        if prev is None:
            hook = observe
        else:  # keep whatever observer someone else installed

            def hook(seconds: float, _prev: Callable[[float], None] = prev) -> None:
                _prev(seconds)
                observe(seconds)

        gen.on_publish = hook
        self._observers[id(gen)] = (gen, hook)

    def _unhook(self, gen: Generation) -> None:
        entry = self._observers.get(id(gen))
        if entry is not None and gen.on_publish is entry[1]:
            gen.on_publish = None

    # ---- collection (called by the registry at scrape time) -------------------------------------

    def collect(self) -> Iterator[Metric]:
        self.sweep()
        yield from self._relay_metrics()
        yield from self._pool_metrics()
        yield from self._member_metrics()
        yield from self._generation_metrics()
        yield from self._service_metrics()

    def _relay_metrics(self) -> Iterator[Metric]:
        r = self.relay
        info = InfoMetricFamily("kvrelay_relay", "Relay identity.")
        info.add_metric(
            [],
            {
                "version": __version__,
                "dc_name": r.settings.dc_name,
                "dc_id": str(r.dc_id),
                "drt_instance_id": str(r.relay_identity.drt_instance_id),
                "incarnation": str(r.relay_incarnation),
            },
        )
        yield info
        for name, doc, value in (
            ("kvrelay_catalog_revision", "Current pool catalog revision.", r.catalog.revision),
            ("kvrelay_readiness_revision", "Current serving readiness revision.",
             r.readiness.revision),
            ("kvrelay_load_revision", "Current load window version.", r.load.broadcast.version),
            ("kvrelay_pool_hubs_initialized", "Publication hubs holding a permit.",
             r.hub_permits.in_use),
            ("kvrelay_pool_hubs_limit", "max_initialized_pool_hubs.", r.hub_permits.capacity),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily(
            "kvrelay_pool_metadata_rejections",
            "Catalog/topology refreshes that rejected a pool's engine metadata.",
            value=r.metadata_errors,
        )

    def _pool_metrics(self) -> Iterator[Metric]:
        pc = {
            attr: CounterMetricFamily(name, doc, labels=["pool"])
            for attr, (name, doc) in _POOL_COUNTERS.items()
        }
        resets = CounterMetricFamily(
            "kvrelay_pool_member_resets", "Member clears by reason (pool side, incl. incarnation).",
            labels=["pool", "reason"],
        )
        g = {
            name: GaugeMetricFamily(name, doc, labels=["pool"])
            for name, doc in (
                ("kvrelay_ckf_capacity_slots", "CKF fingerprint slots (buckets × 4)."),
                ("kvrelay_ckf_buckets", "CKF bucket count."),
                ("kvrelay_pool_materialized", "1 while the pool has a live generation."),
            )
        }
        sources = GaugeMetricFamily(
            "kvrelay_ingest_sources", "Subscribers by state.", labels=["pool", "state"]
        )
        engines = GaugeMetricFamily(
            "kvrelay_engine_reachable", "1 if the engine's last probe reached it.",
            labels=["pool", "worker"],
        )
        for p in self.relay.pools:
            c = p.counters
            for attr, fam in pc.items():
                fam.add_metric([p.name], getattr(c, attr))
            for reason, n in sorted(c.member_resets.items()):
                resets.add_metric([p.name, reason], n)
            buckets = p.spec.bucket_count
            g["kvrelay_ckf_capacity_slots"].add_metric([p.name], buckets * SLOTS_PER_BUCKET)
            g["kvrelay_ckf_buckets"].add_metric([p.name], buckets)
            g["kvrelay_pool_materialized"].add_metric([p.name], int(p.generation is not None))
            states = Counter(s.state for s in p.subscribers.values())
            for state, n in sorted(states.items()):
                sources.add_metric([p.name, state], n)
            for st in p.engines.values():
                engines.add_metric([p.name, st.spec.name], int(st.reachable))
        yield from pc.values()
        yield resets
        yield from g.values()
        yield sources
        yield engines

    def _member_metrics(self) -> Iterator[Metric]:
        fams: dict[str, CounterMetricFamily] = {}
        for attr, (name, doc) in _SUB_SCALARS.items():
            fams[attr] = CounterMetricFamily(name, doc, labels=list(_MEMBER))
        fams["anomalies"] = CounterMetricFamily(
            "kvrelay_ingest_decode_anomalies", "Tolerated decode anomalies by kind.",
            labels=[*_MEMBER, "kind"],
        )
        for attr, (name, doc, label) in _SUB_DICTS.items():
            fams[attr] = CounterMetricFamily(name, doc, labels=[*_MEMBER, label])
        totals = self._subs.totals(lambda s: _flatten_subscriber(s.counters))
        for key in sorted(totals):
            for (attr, label), n in sorted(totals[key].items()):
                labels = list(key) if attr in _SUB_SCALARS else [*key, label]
                fams[attr].add_metric(labels, n)
        yield from fams.values()

    def _generation_metrics(self) -> Iterator[Metric]:
        fams: dict[str, CounterMetricFamily] = {
            attr: CounterMetricFamily(name, doc, labels=["pool"] + ([label] if label else []))
            for attr, (name, doc, label) in _GEN_COUNTERS.items()
        }
        totals = self._gens.totals(_flatten_generation)
        for pool in sorted(totals):
            for (attr, label), n in sorted(totals[pool].items()):
                fams[attr].add_metric([pool, label] if label else [pool], n)
        yield from fams.values()
        g = {
            name: GaugeMetricFamily(name, doc, labels=["pool"])
            for name, doc in (
                ("kvrelay_ckf_occupancy_fingerprints", "Fingerprints in the CKF table."),
                ("kvrelay_pool_members", "Members (engine, dp_rank) in the generation."),
                ("kvrelay_pool_memberships", "Member-to-block lineage edges."),
                ("kvrelay_pool_distinct_blocks", "Distinct canonical blocks owned."),
                ("kvrelay_pool_state_bytes", "Allocated bytes of the exact state (not the CKF)."),
                ("kvrelay_pool_sequence", "Current producer sequence."),
                ("kvrelay_pool_layout_generation", "Current layout generation."),
                ("kvrelay_pool_subscribers", "Open SubscribeKvPool streams on the pool."),
            )
        }
        for p in self.relay.pools:
            gen = p.generation
            if gen is None:
                continue
            pool = gen.pool
            for name, value in (
                ("kvrelay_ckf_occupancy_fingerprints", pool.occupancy),
                ("kvrelay_pool_members", len(pool.members())),
                ("kvrelay_pool_memberships", pool.memberships),
                ("kvrelay_pool_distinct_blocks", pool.distinct_canonical),
                ("kvrelay_pool_state_bytes", pool.memory_bytes()),
                ("kvrelay_pool_sequence", gen.sequence),
                ("kvrelay_pool_layout_generation", gen.layout_generation),
                ("kvrelay_pool_subscribers", gen.subscriber_count),
            ):
                g[name].add_metric([p.name], value)
        yield from g.values()

    def _service_metrics(self) -> Iterator[Metric]:
        svc = self._service
        if svc is None:
            return
        subs = GaugeMetricFamily(
            "kvrelay_stream_subscribers", "Open streams by kind.", labels=["kind"]
        )
        limit = GaugeMetricFamily(
            "kvrelay_stream_subscriber_limit", "Configured stream limit by kind.", labels=["kind"]
        )
        for kind in _STREAM_KINDS:
            permits = getattr(svc, f"{kind}_permits")
            subs.add_metric([kind], permits.in_use)
            limit.add_metric([kind], permits.capacity)
        errors = CounterMetricFamily(
            "kvrelay_stream_errors", "Streams/calls ended with a contract error, by reason.",
            labels=["reason"],
        )
        for reason, n in sorted(svc.errors.items()):
            errors.add_metric([reason], n)
        yield subs
        yield limit
        yield errors

    # ---- HTTP endpoint ---------------------------------------------------------------------------

    async def start_http(self, host: str, port: int) -> int:
        """Serve ``/metrics`` (text exposition 0.0.4) on the running loop; returns the port."""
        if self._server is not None:
            raise RuntimeError("metrics endpoint already started")
        self._server = await asyncio.start_server(
            self._handle, host, port, limit=MAX_REQUEST_HEAD
        )
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="kvrelay-metrics-sweep")
        bound = int(self._server.sockets[0].getsockname()[1])
        _log.info("metrics_listening", host=host, port=bound)
        return bound

    async def close(self) -> None:
        """Stop listening, end in-flight scrapes, detach latency observers."""
        server, self._server = self._server, None
        sweeper, self._sweeper = self._sweeper, None
        if sweeper is not None:
            await cancel_and_wait(sweeper)
        if server is not None:
            server.close()
            for t in list(self._conns):
                t.cancel()
            for t in list(self._conns):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await server.wait_closed()
        for gen, _hook in list(self._observers.values()):
            self._unhook(gen)
        self._observers.clear()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            try:
                self.sweep()
            except Exception:  # a bug must not kill the endpoint; the next scrape reports it
                _log.exception("metrics_sweep_failed")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            if len(self._conns) > MAX_HTTP_CONNECTIONS:
                await _respond(writer, 503, b"too many concurrent scrapes\n")
                return
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            except (asyncio.LimitOverrunError, ValueError):
                await _respond(writer, 431, b"request head too large\n")
                return
            except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                return
            parts = head.split(b"\r\n", 1)[0].split()
            if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
                await _respond(writer, 400, b"bad request\n")
                return
            method, path = parts[0], parts[1].split(b"?", 1)[0]
            head_only = method == b"HEAD"
            if method not in (b"GET", b"HEAD"):
                await _respond(writer, 405, b"method not allowed\n", extra=b"Allow: GET, HEAD\r\n")
            elif path == b"/metrics":
                try:
                    body = generate_latest(self.registry)
                except Exception:
                    _log.exception("metrics_collect_failed")
                    await _respond(writer, 500, b"collection failed\n")
                    return
                # Classic text format 0.0.4: every Prometheus understands it, and with the default
                # "underscores" escaping generate_latest emits exactly that format.
                await _respond(writer, 200, body, CONTENT_TYPE_PLAIN_0_0_4, head_only=head_only)
            elif path in (b"/", b"/healthz"):
                await _respond(writer, 200, b"ok\n", head_only=head_only)
            else:
                await _respond(writer, 404, b"not found\n", head_only=head_only)
        except ConnectionError:
            pass
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


_REASONS = {
    200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
    431: "Request Header Fields Too Large", 500: "Internal Server Error",
    503: "Service Unavailable",
}


async def _respond(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
    *,
    head_only: bool = False,
    extra: bytes = b"",
) -> None:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
    ).encode() + extra + b"\r\n"
    writer.write(head if head_only else head + body)
    await writer.drain()


def _worker_name(pool: PoolRuntime, worker_id: int) -> str:
    st = pool.by_worker.get(worker_id)
    return st.spec.name if st is not None else str(worker_id)


class _RelayCollector(Collector):
    """Registry adapter; ``describe`` is empty so registration never triggers a collection."""

    def __init__(self, metrics: RelayMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        return self._metrics.collect()
