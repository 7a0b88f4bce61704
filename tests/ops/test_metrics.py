"""Prometheus metrics scraped over real HTTP after real traffic (simulated fleet → relay).

Oracles are independent of the relay: the simulator's publishers (sequence numbers, replay
requests served), its xxhash ground truth, a gRPC consumer counting the deltas it receives, and
prometheus_client's own text parser.
"""

from __future__ import annotations

import asyncio
import contextlib
import math

import pytest
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from prometheus_client import CollectorRegistry

from kvrelay import __version__
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from kvrelay.ops.metrics import RelayMetrics
from kvrelay.publication.serving_load import ModelServingInput, ServingLoadInputs
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import RelaySettings
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from kvrelay.sim.wire import Era, HashMode
from tests.support.scrape import (
    POOL,
    Samples,
    eventually,
    fleet_and_relay,
    http_request,
    in_sync,
    scrape,
    total,
    value,
    wait_subscribed,
)
from tests.support.timing import scaled

MARKER = 0x4B565231
LAGGED = "RELAY_ERROR_REASON_SUBSCRIBER_LAGGED"  # contract trailer value
CONFIGS = [
    SimConfig(name="e0", seed=1, dp_size=2, capacity_blocks=96, era=Era.MAP),
    SimConfig(
        name="e1", seed=2, dp_size=1, capacity_blocks=96, era=Era.ARRAY,
        hash_mode=HashMode.BYTES, replay_frames=3,
    ),
]


def _member(engine: str, rank: int) -> dict[str, str]:
    return {"pool": POOL, "worker": engine, "dp_rank": str(rank)}


def _check_ingest_against_publishers(samples: Samples, engines: list[SimEngine]) -> None:
    for e in engines:
        for rank, pub in enumerate(e.publishers):
            m = _member(e.cfg.name, rank)
            received = value(samples, "kvrelay_ingest_messages_total", **m)
            dups = value(samples, "kvrelay_ingest_duplicates_total", **m)
            # every sequence number the engine assigned reached the relay exactly once (net)
            assert received - dups == pub.seq, (e.cfg.name, rank)
            assert value(samples, "kvrelay_ingest_replays_total", **m) == pub.stats.replay_requests


async def test_scrape_after_traffic_matches_independent_oracles() -> None:
    async with fleet_and_relay(CONFIGS) as (engines, relay, server):
        metrics = RelayMetrics(relay, CollectorRegistry())
        metrics.attach_service(server.service)
        port = await metrics.start_http("127.0.0.1", 0)
        try:
            await wait_subscribed(relay, 3)
            gen = relay.pools[0].generation
            assert gen is not None
            for e in engines:
                await e.step(20)
            engines[0].drop_next(2, keep_in_replay=True, rank=0)  # a gap the relay must replay
            for _ in range(4):
                for e in engines:
                    await e.step(2)
                await asyncio.sleep(0.01)
            await eventually(lambda: in_sync(engines, relay), what="relay == ground truth")
            await asyncio.sleep(0.05)  # let the publication timer flush the last delta
            s = await scrape(port)

            _check_ingest_against_publishers(s, engines)
            assert value(s, "kvrelay_ingest_gaps_total", **_member("e0", 0)) >= 1
            assert value(s, "kvrelay_ingest_gaps_total", **_member("e0", 1)) == 0
            truth = set().union(*(e.ground_truth(r) for e in engines for r in range(e.cfg.dp_size)))
            assert truth
            assert value(s, "kvrelay_ckf_occupancy_fingerprints", pool=POOL) == len(truth)
            assert value(s, "kvrelay_pool_distinct_blocks", pool=POOL) == len(truth)
            assert value(s, "kvrelay_ckf_capacity_slots", pool=POOL) == 4 * gen.pool.table.size
            assert value(s, "kvrelay_ckf_capacity_omissions_total", pool=POOL) == 0
            assert value(s, "kvrelay_pool_members", pool=POOL) == 3
            stored = total(s, "kvrelay_ingest_events_total", kind="stored")
            assert stored > 0
            assert total(s, "kvrelay_ingest_blocks_total") >= len(truth)
            assert total(s, "kvrelay_ingest_sources", pool=POOL, state="live") == 3
            assert value(s, "kvrelay_engine_reachable", pool=POOL, worker="e1") == 1
            assert value(s, "kvrelay_pool_materialized", pool=POOL) == 1
            # pool-side batches == ingest-side batches (two different layers' counters agree)
            assert value(s, "kvrelay_pool_batches_applied_total", pool=POOL) == total(
                s, "kvrelay_ingest_batches_total"
            )
            # every published delta had its latency observed
            seq = value(s, "kvrelay_pool_sequence", pool=POOL)
            assert seq > 0
            assert value(s, "kvrelay_deltas_published_total", pool=POOL) == seq
            assert value(s, "kvrelay_delta_latency_seconds_count", pool=POOL) == seq
            assert value(s, "kvrelay_delta_latency_seconds_sum", pool=POOL) > 0
            info = value(
                s, "kvrelay_relay_info", version=__version__,
                dc_name=relay.settings.dc_name, dc_id=str(relay.dc_id),
                drt_instance_id=str(relay.relay_identity.drt_instance_id),
                incarnation=str(relay.relay_incarnation),
            )
            assert info == 1
            assert value(s, "kvrelay_catalog_revision") == relay.catalog.revision >= 1
            assert value(s, "kvrelay_readiness_revision") == relay.readiness.revision >= 1
            # an explicit registry gets only kvrelay metrics (no process_* collectors)
            assert not any(n.startswith("process_") for n, _ in s)
        finally:
            await metrics.close()


async def test_pool_stream_subscribers_and_deltas_seen_by_a_consumer() -> None:
    async with fleet_and_relay(CONFIGS[:1]) as (engines, relay, server):
        metrics = RelayMetrics(relay)
        metrics.attach_service(server.service)
        port = await metrics.start_http("127.0.0.1", 0)
        try:
            await wait_subscribed(relay, 2)
            await engines[0].step(5)
            await eventually(lambda: in_sync(engines, relay), what="initial sync")
            s0 = await scrape(port)
            assert value(s0, "kvrelay_stream_subscribers", kind="pool") == 0
            assert value(s0, "kvrelay_pool_hubs_initialized") == 0
            assert any(n.startswith("process_") for n, _ in s0)  # default registry extras

            async with Channel("127.0.0.1", server.port) as channel:
                stub = pb.KvEventRelayStub(channel)
                catalog = None
                async for upd in stub.watch_kv_pool_catalog(
                    pb.WatchKvPoolCatalogRequest(subscriber_id="ops", contract_marker=MARKER)
                ):
                    if upd.snapshot is not None and upd.snapshot.pools:
                        catalog = upd
                        break
                assert catalog is not None and catalog.snapshot is not None
                producer = catalog.snapshot.pools[0].producer
                deltas: list[int] = []
                snap_seq: list[int] = []

                async def consume() -> None:
                    async for fu in stub.subscribe_kv_pool(
                        pb.SubscribeKvPoolRequest(
                            subscriber_id="ops", expected_producer=producer,
                            contract_marker=MARKER,
                        )
                    ):
                        if fu.kind == pb.FilterUpdateKind.DELTA:
                            deltas.append(fu.sequence)
                        elif fu.kind == pb.FilterUpdateKind.SNAPSHOT_CHUNK:
                            snap_seq.append(fu.sequence)

                task = asyncio.create_task(consume())
                try:
                    await eventually(lambda: bool(snap_seq), what="snapshot received")
                    s1 = await scrape(port)
                    assert value(s1, "kvrelay_stream_subscribers", kind="pool") == 1
                    assert value(s1, "kvrelay_pool_subscribers", pool=POOL) == 1
                    assert value(s1, "kvrelay_pool_hubs_initialized") == 1
                    assert value(s1, "kvrelay_snapshots_sent_total", pool=POOL) == 1
                    assert value(s1, "kvrelay_snapshots_built_total", pool=POOL) == 1
                    base = value(s1, "kvrelay_deltas_published_total", pool=POOL)
                    assert base == snap_seq[0]
                    for _ in range(5):
                        await engines[0].step(3)
                        await asyncio.sleep(0.01)
                    await eventually(lambda: in_sync(engines, relay), what="sync after traffic")
                    gen = relay.pools[0].generation
                    assert gen is not None
                    await eventually(
                        lambda: bool(deltas) and deltas[-1] == gen.sequence,
                        what="consumer caught up",
                    )
                    s2 = await scrape(port)
                    assert len(deltas) > 0
                    assert value(s2, "kvrelay_deltas_published_total", pool=POOL) - base == len(
                        deltas
                    )
                    assert value(s2, "kvrelay_pool_sequence", pool=POOL) == deltas[-1]
                finally:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

            async def pool_streams() -> float:
                return value(await scrape(port), "kvrelay_stream_subscribers", kind="pool")

            for _ in range(200):
                if await pool_streams() == 0:
                    break
                await asyncio.sleep(0.02)
            assert await pool_streams() == 0
        finally:
            await metrics.close()


async def test_counters_stay_monotonic_across_engine_restart_and_withdrawal() -> None:
    cfg = SimConfig(name="r0", seed=7, dp_size=1, capacity_blocks=64)
    async with fleet_and_relay([cfg]) as (engines, relay, _server):
        (eng,) = engines
        metrics = RelayMetrics(relay, CollectorRegistry())
        port = await metrics.start_http("127.0.0.1", 0)
        try:
            await wait_subscribed(relay, 1)
            await eng.step(12)
            await eventually(lambda: in_sync(engines, relay), what="initial sync")
            s1 = await scrape(port)
            m = _member("r0", 0)
            first_msgs = value(s1, "kvrelay_ingest_messages_total", **m) - value(
                s1, "kvrelay_ingest_duplicates_total", **m
            )
            assert first_msgs == eng.publishers[0].seq
            old_sub = next(iter(relay.pools[0].subscribers.values()))

            await eng.restart()  # new incarnation, new ports: a new subscriber replaces the old
            await eventually(
                lambda: any(s is not old_sub for s in relay.pools[0].subscribers.values()),
                what="replacement subscriber",
            )
            await wait_subscribed(relay, 1)
            await eng.step(6)
            await eventually(lambda: in_sync(engines, relay), what="sync after restart")
            s2 = await scrape(port)
            msgs = value(s2, "kvrelay_ingest_messages_total", **m) - value(
                s2, "kvrelay_ingest_duplicates_total", **m
            )
            # the retired subscriber's messages are kept: old incarnation + new incarnation
            assert msgs == first_msgs + eng.publishers[0].seq
            resets = value(s2, "kvrelay_pool_member_resets_total", pool=POOL, reason="incarnation")
            assert resets >= 1
            published = value(s2, "kvrelay_deltas_published_total", pool=POOL)
            assert published >= value(s1, "kvrelay_deltas_published_total", pool=POOL)

            await eng.stop()  # the only engine leaves: the generation is withdrawn
            await eventually(lambda: relay.pools[0].generation is None, what="pool withdrawn")
            s3 = await scrape(port)
            assert value(s3, "kvrelay_pool_materialized", pool=POOL) == 0
            assert value(s3, "kvrelay_engine_reachable", pool=POOL, worker="r0") == 0
            assert value(s3, "kvrelay_deltas_published_total", pool=POOL) == published
            assert value(s3, "kvrelay_ingest_messages_total", **m) >= value(
                s2, "kvrelay_ingest_messages_total", **m
            )
            assert ("kvrelay_pool_sequence", frozenset({("pool", POOL)})) not in s3
        finally:
            await metrics.close()


async def test_lagging_pool_subscriber_is_counted() -> None:
    """A subscriber that stops reading fills its HTTP/2 window, then its 1-frame queue, and its
    stream ends with SUBSCRIBER_LAGGED; the lag is counted on both the pool and the service."""
    limits = RelayLimits(publication_queue_capacity=1, publish_every_n_events=1)
    cfg = SimConfig(name="lag0", seed=3, dp_size=1, capacity_blocks=256)
    async with fleet_and_relay([cfg], limits=limits) as (engines, relay, server):
        (eng,) = engines
        metrics = RelayMetrics(relay, CollectorRegistry())
        metrics.attach_service(server.service)
        port = await metrics.start_http("127.0.0.1", 0)
        try:
            await wait_subscribed(relay, 1)
            await eng.step(3)
            await eventually(lambda: relay.pools[0].generation is not None, what="generation")
            await eventually(lambda: bool(relay.catalog.current()[1].snapshot.pools),
                             what="catalog entry")
            gen = relay.pools[0].generation
            assert gen is not None
            ended: list[GRPCError] = []
            got_snapshot = asyncio.Event()
            resume = asyncio.Event()
            # the smallest HTTP/2 windows grpclib allows (64 KiB): a stalled reader blocks the
            # server's sends after 64 KiB, so the relay's own queue must overflow
            small = Configuration(
                http2_connection_window_size=2**16 - 1, http2_stream_window_size=2**16 - 1
            )
            async with Channel("127.0.0.1", server.port, config=small) as channel:
                stub = pb.KvEventRelayStub(channel)

                async def consume() -> None:
                    try:
                        async for fu in stub.subscribe_kv_pool(
                            pb.SubscribeKvPoolRequest(
                                subscriber_id="slow", expected_producer=gen.producer,
                                contract_marker=MARKER,
                            )
                        ):
                            if fu.kind == pb.FilterUpdateKind.SNAPSHOT_CHUNK:
                                got_snapshot.set()
                                await resume.wait()  # stall: read nothing more for now
                    except GRPCError as exc:
                        ended.append(exc)

                task = asyncio.create_task(consume())
                try:
                    await asyncio.wait_for(got_snapshot.wait(), scaled(10))
                    for _ in range(5000):
                        if gen.hub_stats()["lagged"]:
                            break
                        await eng.step(2)
                        await asyncio.sleep(0)
                    assert gen.hub_stats()["lagged"] == 1
                    resume.set()
                    await asyncio.wait_for(task, scaled(10))
                finally:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            assert len(ended) == 1
            assert ended[0].status == Status.RESOURCE_EXHAUSTED
            s = await scrape(port)
            assert value(s, "kvrelay_pool_lag_terminations_total", pool=POOL) == 1
            assert value(s, "kvrelay_stream_errors_total", reason=LAGGED) == 1
            assert value(s, "kvrelay_hub_resets_total", pool=POOL) == 0
        finally:
            await metrics.close()


# ---- endpoint behaviour (no fleet needed) -----------------------------------------------------


async def _bare_metrics() -> tuple[Relay, RelayMetrics, int]:
    relay = Relay(RelaySettings(dc_name="dc-bare"))
    metrics = RelayMetrics(relay, CollectorRegistry())
    port = await metrics.start_http("127.0.0.1", 0)
    return relay, metrics, port


async def test_loop_lag_observations() -> None:
    _relay, metrics, port = await _bare_metrics()
    try:
        metrics.observe_loop_lag(0.003)
        metrics.observe_loop_lag(0.2)
        metrics.observe_loop_lag(-1.0)  # clock oddity: clamped to 0
        metrics.observe_loop_lag(math.nan)  # ignored
        s = await scrape(port)
        assert value(s, "kvrelay_event_loop_lag_seconds_count") == 3
        assert math.isclose(value(s, "kvrelay_event_loop_lag_seconds_sum"), 0.203)
        assert value(s, "kvrelay_event_loop_lag_seconds_bucket", le="0.005") == 2
        assert value(s, "kvrelay_event_loop_lag_seconds_bucket", le="0.1") == 2
        assert value(s, "kvrelay_event_loop_lag_seconds_bucket", le="0.25") == 3
        assert value(s, "kvrelay_event_loop_lag_last_seconds") == 0
        assert value(s, "kvrelay_catalog_revision") == 0
        assert "kvrelay_stream_subscribers" not in {n for n, _ in s}  # no service attached
        # no ``_created`` family beside a histogram (the metric table lists none)
        assert [n for n, _ in s if n.endswith("_created")] == []
    finally:
        await metrics.close()


async def test_window_errors_of_both_planes_are_exported() -> None:
    """A window that could not be built (skipped) and an entry dropped from one are counted by
    plane and kind: the contract says "counted", and a log line alone is no count."""
    relay, metrics, port = await _bare_metrics()

    def broken() -> ServingLoadInputs:
        raise RuntimeError("provider bug")

    try:
        bad = ModelServingInput("ns", "m", 0, 1, 0)  # more observed than expected: dropped
        relay.serving_load.set_provider(lambda: ServingLoadInputs(models=[bad]))
        assert relay.serving_load.publish_window()
        relay.serving_load.set_provider(broken)
        assert not relay.serving_load.publish_window()
        relay.load.set_provider(broken)
        assert not relay.load.publish_window()
        s = await scrape(port)
        got = {(p, k): value(s, "kvrelay_window_errors_total", plane=p, kind=k)
               for p in ("load", "serving_load") for k in ("window", "entry")}  # fmt: skip
        assert got == {("load", "window"): 1, ("load", "entry"): 0,
                       ("serving_load", "window"): 1, ("serving_load", "entry"): 1}  # fmt: skip
    finally:
        await metrics.close()


async def test_http_endpoint_edges_and_clean_close() -> None:
    _relay, metrics, port = await _bare_metrics()
    try:
        r = await http_request(port, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
        assert r.status == 404
        r = await http_request(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        assert r.status == 405 and r.headers["allow"] == "GET, HEAD"
        r = await http_request(port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert r.status == 200 and r.body == b"" and int(r.headers["content-length"]) > 0
        r = await http_request(port, b"GET /metrics?x=1 HTTP/1.0\r\n\r\n")
        assert r.status == 200 and b"kvrelay_relay_info" in r.body
        r = await http_request(port, b"garbage\r\n\r\n")
        assert r.status == 400
        r = await http_request(port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 10_000 + b"\r\n\r\n")
        assert r.status == 431
        with pytest.raises(RuntimeError):
            await metrics.start_http("127.0.0.1", 0)
        # a client that connects and says nothing is cut off by close(), not awaited forever
        idle_r, idle_w = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.05)
    finally:
        await asyncio.wait_for(metrics.close(), scaled(5))
    assert await asyncio.wait_for(idle_r.read(), scaled(5)) == b""
    idle_w.close()
    try:
        _r, w = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        pass
    else:
        w.close()
        raise AssertionError("metrics port still accepting after close()")


async def test_lag_staleness_and_per_pool_aggregation() -> None:
    """Oracles: the engines' own clocks (staleness stays within the test's wall-clock window),
    the ingest counters (every live batch observed once in the lag histogram), and a second
    collector with ``per_member=False`` whose per-pool series must equal the per-member sums."""
    import time

    async with fleet_and_relay(CONFIGS) as (engines, relay, _server):
        members = RelayMetrics(relay, CollectorRegistry())
        pooled = RelayMetrics(relay, CollectorRegistry(), per_member=False)
        p1, p2 = await members.start_http("127.0.0.1", 0), await pooled.start_http("127.0.0.1", 0)
        try:
            def live() -> bool:
                sources = [x for p in relay.stats().pools for x in p.sources]
                return len(sources) == 3 and all(x.state == "live" for x in sources)

            await eventually(live, what="every source live")
            before = {
                (x.engine, x.dp_rank): x.counters.batches
                for p in relay.stats().pools for x in p.sources
            }
            t0 = time.time()
            for _ in range(5):
                for e in engines:
                    await e.step(3)
                await asyncio.sleep(0.01)
            await eventually(lambda: in_sync(engines, relay), what="relay == ground truth")
            s, agg = await scrape(p1), await scrape(p2)
            t1 = time.time()
            for e in engines:
                for rank in range(e.cfg.dp_size):
                    m = _member(e.cfg.name, rank)
                    last = value(s, "kvrelay_ingest_last_message_timestamp_seconds", **m)
                    assert t0 - 30 <= last <= t1, (m, last, t0, t1)
                    count = value(s, "kvrelay_ingest_engine_lag_seconds_count", **m)
                    batches = value(s, "kvrelay_ingest_batches_total", **m)
                    # every batch applied since the source went live, none of the replayed ones
                    after_live = batches - before[(e.cfg.name, rank)]
                    assert 0 < after_live <= count <= batches, (m, count, batches, after_live)
                    inf = value(s, "kvrelay_ingest_engine_lag_seconds_bucket", le="+Inf", **m)
                    assert inf == count
                    # loopback, same clock: nothing lags a minute
                    assert value(s, "kvrelay_ingest_engine_lag_seconds_sum", **m) < 60 * count
            for name in ("kvrelay_ingest_messages_total", "kvrelay_ingest_batches_total",
                         "kvrelay_ingest_engine_lag_seconds_count"):  # fmt: skip
                assert value(agg, name, pool=POOL) == total(s, name, pool=POOL) > 0, name
            stored = total(s, "kvrelay_ingest_events_total", kind="stored")
            assert value(agg, "kvrelay_ingest_events_total", pool=POOL, kind="stored") == stored
            assert not any(
                "worker" in dict(labels) for (n, labels) in agg
                if n.startswith("kvrelay_ingest_") and "last_message" not in n
            )
            # staleness stays per source in both modes
            assert total(agg, "kvrelay_ingest_last_message_timestamp_seconds") == total(
                s, "kvrelay_ingest_last_message_timestamp_seconds"
            )
        finally:
            await members.close()
            await pooled.close()


def test_retired_counters_fold_lag_by_bucket_and_keep_the_newest_message_time() -> None:
    from kvrelay.ingest.counters import SubscriberCounters
    from kvrelay.relay.stats import merged

    a, b = SubscriberCounters(), SubscriberCounters()
    a.observe_applied(1000.0, live=False)  # replay: a message time, no lag sample
    assert a.lag_count == 0 and a.last_message_unix > 0
    a.last_message_unix = 200.0
    b.last_message_unix = 100.0
    a.lag_buckets, a.lag_sum_s, a.lag_count = {"0.001": 2, "+Inf": 1}, 30.0, 3
    b.lag_buckets, b.lag_sum_s, b.lag_count = {"0.001": 1, "0.5": 4}, 1.0, 5
    m = merged(a, b)
    assert m.last_message_unix == 200.0  # max, not a sum of two times
    assert m.lag_buckets == {"0.001": 3, "0.5": 4, "+Inf": 1}
    assert (m.lag_sum_s, m.lag_count) == (31.0, 8)
    c = SubscriberCounters()
    c.observe_applied(c_ts := 0.0, live=True)  # an engine clock far behind: the +Inf bucket
    c.observe_applied(c_ts + 1e12, live=True)  # an engine clock ahead: clamped to 0, first bucket
    assert c.lag_buckets == {"+Inf": 1, "0.001": 1} and c.lag_count == 2


def test_frozen_counters_copy_every_dict_and_never_follow_the_live_ones() -> None:
    """A scrape builds its families from ``frozen`` copies off the loop, while the loop goes on
    counting into the live ones. The dict fields are named here: a new one must be copied too."""
    from dataclasses import fields

    from kvrelay.ingest.counters import _DICT_FIELDS, SubscriberCounters

    assert set(_DICT_FIELDS) == {
        "events_by_kind", "rejections", "drops", "resets_by_reason", "lag_buckets",
    }  # fmt: skip
    live = SubscriberCounters(messages=5)
    live.reject("oversized")
    live.count_reset("gap")
    live.observe_applied(0.0, live=True)
    copy = live.frozen()
    assert copy == live and copy is not live
    for f in fields(live):
        value = getattr(live, f.name)
        if isinstance(value, dict):
            assert getattr(copy, f.name) is not value, f.name
            value["added-later"] = 1
        else:
            setattr(live, f.name, value + 1)
    assert all("added-later" not in getattr(copy, name) for name in _DICT_FIELDS)
    assert copy.messages == 5 and live.messages == 6


async def test_a_scrape_is_the_relay_as_it_was_when_taken_and_built_off_the_loop() -> None:
    """``collected()`` takes the relay's snapshot on the loop; traffic after that does not reach
    its text, which is written (families included) in the executor; a new scrape sees the traffic.
    Oracle: the simulator's publishers' sequence numbers."""
    import threading

    from prometheus_client.parser import text_string_to_metric_families

    import kvrelay.ops.metrics as metrics_mod

    built: list[int] = []
    orig = metrics_mod._member_metrics

    def tracked(*args: object, **kwargs: object) -> object:
        built.append(threading.get_ident())
        return orig(*args, **kwargs)  # type: ignore[arg-type]

    def net_messages(body: bytes) -> float:
        """Messages received less duplicates, over every member: each sequence number once."""
        out = 0.0
        for fam in text_string_to_metric_families(body.decode()):
            for s in fam.samples:
                if s.name == "kvrelay_ingest_messages_total":
                    out += s.value
                elif s.name == "kvrelay_ingest_duplicates_total":
                    out -= s.value
        return out

    async with fleet_and_relay(CONFIGS[:1]) as (engines, relay, _server):
        metrics = RelayMetrics(relay, CollectorRegistry())
        await wait_subscribed(relay, 2)
        await engines[0].step(6)
        await eventually(lambda: in_sync(engines, relay), what="initial sync")
        sent = sum(p.seq for p in engines[0].publishers)
        metrics_mod._member_metrics = tracked  # type: ignore[assignment]
        try:
            taken = metrics.collected()
            assert built == []  # only the snapshot was read on the loop
            await engines[0].step(4)
            await eventually(lambda: in_sync(engines, relay), what="second sync")
            loop = asyncio.get_running_loop()
            old = await loop.run_in_executor(None, taken.text)
            new = await loop.run_in_executor(None, metrics.collected().text)
        finally:
            metrics_mod._member_metrics = orig  # type: ignore[assignment]
        assert built and threading.get_ident() not in built
        now = sum(p.seq for p in engines[0].publishers)
        assert sent < now
        assert net_messages(old) == sent
        assert net_messages(new) == now
        await metrics.close()


def test_garbage_collection_pauses_are_timed_by_generation() -> None:
    """Oracle: CPython's own count of collections per generation (``gc.get_stats``), which
    the hook never reads. Every collection from the first ``RelayMetrics`` on is in the
    histogram, once, in the bucket of its duration."""
    import gc

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvrelay.ops.gc_pauses import BUCKETS_S

    def read(metrics: RelayMetrics) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {"0": {}, "1": {}, "2": {}}
        text = generate_latest(metrics.registry).decode()
        for fam in text_string_to_metric_families(text):
            if fam.name == "kvrelay_gc_pause_seconds":
                for s in fam.samples:
                    key = s.name.rsplit("_", 1)[1] + s.labels.get("le", "")
                    out[s.labels["generation"]][key] = s.value
        return out

    relay = Relay(RelaySettings(dc_name="dc-gc", pools=()))  # not started: nothing to collect
    metrics = RelayMetrics(relay, CollectorRegistry())
    gc.disable()  # only the collections made here, none started by the test's own allocations
    try:
        before, cpython = read(metrics), [g["collections"] for g in gc.get_stats()]
        for _ in range(3):
            gc.collect(2)
        gc.collect(0)
        after, now = read(metrics), [g["collections"] for g in gc.get_stats()]
    finally:
        gc.enable()
    for gen in ("0", "1", "2"):
        counted = after[gen]["count"] - before[gen]["count"]
        assert counted == now[int(gen)] - cpython[int(gen)], gen  # every one, once
        assert after[gen]["bucket+Inf"] == after[gen]["count"]
        bounds = [after[gen][f"bucket{b!r}"] for b in BUCKETS_S] + [after[gen]["bucket+Inf"]]
        assert bounds == sorted(bounds)  # cumulative
    assert after["2"]["count"] - before["2"]["count"] >= 3
    assert after["2"]["sum"] > before["2"]["sum"]
