"""Fault matrix, consumer side: stalled, lagging, vanishing and surplus gRPC subscribers, relay
restart, pool withdrawal and re-materialization."""

from __future__ import annotations

import asyncio
import dataclasses

from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.rig import (
    MARKER,
    SVC,
    Consumer,
    Rig,
    StreamEnd,
    catalog_pool_count,
    catalog_producer,
    collect_end,
    eventually,
    relay_info,
    rig,
    start_relay,
    stop_relay,
    subscribe,
    verify,
    wait_live,
)
from tests.support.timing import scaled

LAGGED = "RELAY_ERROR_REASON_SUBSCRIBER_LAGGED"
TIMEOUT = "RELAY_ERROR_REASON_SNAPSHOT_PROGRESS_TIMEOUT"
LIMIT = "RELAY_ERROR_REASON_RESOURCE_LIMIT"
UNAVAILABLE = "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
CHANGED = "RELAY_ERROR_REASON_PRODUCER_CHANGED"
NOT_FOUND = "RELAY_ERROR_REASON_POOL_NOT_FOUND"


def sub_req(producer: pb.ProducerIdentity, sid: str = "t") -> pb.SubscribeKvPoolRequest:
    return pb.SubscribeKvPoolRequest(
        subscriber_id=sid, expected_producer=producer, contract_marker=MARKER
    )


async def read_later(
    channel: Channel, producer: pb.ProducerIdentity, stall: asyncio.Event
) -> tuple[int, StreamEnd]:
    """Open SubscribeKvPool, read nothing until ``stall`` is set, then drain to the end."""
    end = StreamEnd()
    n = 0
    async with channel.request(
        SVC + "SubscribeKvPool", Cardinality.UNARY_STREAM, pb.SubscribeKvPoolRequest,
        pb.FilterUpdate,
    ) as st:
        await st.send_message(sub_req(producer, "stalled"), end=True)
        await stall.wait()
        try:
            while await st.recv_message() is not None:
                n += 1
            await st.recv_trailing_metadata()
        except GRPCError as exc:
            end.status, end.message = exc.status, exc.message
        end.trailers = dict(st.trailing_metadata or {})
    return n, end


def errors(r: Rig, reason: str) -> int:
    return r.server.service.errors.get(reason, 0)


async def test_subscriber_stalling_mid_snapshot_times_out() -> None:
    # Per 4 MiB chunk. Short, but not so short that the healthy subscriber below (which must
    # also drain two chunks under it) trips it on a scheduling stall of a loaded 2-core box.
    limits = RelayLimits(snapshot_progress_timeout_s=1.0)
    cfg = SimConfig(name="t0", seed=21, dp_size=1, capacity_blocks=64)
    # 1,048,576 buckets = two 4 MiB chunks: far beyond a 64 KiB HTTP/2 window
    async with rig([cfg], limits=limits, expected_blocks=2_000_000) as r:
        await wait_live(r.relay, 1)
        await r.engines[0].step(10)
        # a window just short of one chunk: the stall leaves little to drain once reading resumes
        async with r.channel(window=4_000_000) as slow, r.channel() as ch:
            producer = await catalog_producer(ch)
            go = asyncio.Event()
            task = asyncio.create_task(read_later(slow, producer, go))
            svc = r.server.service
            await eventually(
                lambda: any(s.error is not None for s in svc._subscriptions),
                what="snapshot progress deadline passed",
            )
            go.set()
            frames, end = await asyncio.wait_for(task, scaled(20))
            assert end.status == Status.RESOURCE_EXHAUSTED and end.reason == TIMEOUT
            assert errors(r, TIMEOUT) == 1 and r.stream_errors("SNAPSHOT_PROGRESS_TIMEOUT") == 1
            assert frames <= 2, "the stream must end before any delta"
            # not a producer fault: the generation is not fenced and serves the next subscriber
            assert r.pool.counters.fences == 0
            await eventually(lambda: r.server.service.pool_permits.in_use == 0, what="cleanup")
            consumer = await subscribe(r, ch)
            await r.engines[0].step(5)
            await verify(r, consumer, probes=5_000)
            await consumer.stop()


async def test_subscriber_that_never_reads_is_dropped_as_lagged() -> None:
    limits = RelayLimits(publication_queue_capacity=2, publish_every_n_events=1)
    cfg = SimConfig(name="q0", seed=22, dp_size=1, capacity_blocks=128)
    # 32,768 buckets: a 256 KiB snapshot never fits the reader's 64 KiB window
    async with rig([cfg], limits=limits, expected_blocks=65_536) as r:
        await wait_live(r.relay, 1)
        async with r.channel(window=65_535) as slow, r.channel() as ch:
            good = await subscribe(r, ch, "healthy")
            producer = good.producer
            go = asyncio.Event()
            task = asyncio.create_task(read_later(slow, producer, go))
            hub = r.pool.generation.hub()
            await eventually(lambda: hub.subscriber_count == 2, what="stalled subscriber admitted")
            # while it is a joiner the relay spaces deltas out (up to 0.25 s apart) so that a
            # reader that reads gets through; one that never reads still overflows its queue
            for _ in range(600):
                await r.engines[0].step(1)
                await asyncio.sleep(0.003)
                if hub.lagged:
                    break
            assert hub.lagged == 1, "the stalled subscriber's bounded queue must overflow"
            go.set()
            _frames, end = await asyncio.wait_for(task, scaled(20))
            assert end.status == Status.RESOURCE_EXHAUSTED and end.reason == LAGGED
            assert errors(r, LAGGED) == 1 and r.stream_errors("SUBSCRIBER_LAGGED") == 1
            assert r.metric("kvrelay_pool_lag_terminations_total") == 1
            # the healthy subscriber kept up and is still exact
            await verify(r, good, probes=5_000)
            assert good.end is None and hub.subscriber_count == 1
            await good.stop()


async def test_subscriber_disconnecting_mid_stream_is_cleaned_up() -> None:
    cfg = SimConfig(name="d0", seed=23, dp_size=1, capacity_blocks=64)
    async with rig([cfg]) as r:
        await wait_live(r.relay, 1)
        svc = r.server.service
        for abrupt in (False, True):
            ch = r.channel()
            consumer = await subscribe(r, ch, "leaver")
            gen = r.pool.generation
            assert gen is not None
            await eventually(lambda g=gen: g.subscriber_count == 1, what="subscribed")
            task = asyncio.create_task(_steps(r.engines[0], 30))
            await asyncio.sleep(0.02)
            if abrupt:
                ch.close()  # TCP connection gone mid-stream
            else:
                await consumer.stop()  # RST_STREAM mid-stream
            await task
            await eventually(
                lambda g=gen: g.subscriber_count == 0 and svc.pool_permits.in_use == 0,
                what="server released the subscriber",
            )
            await consumer.stop()
            ch.close()
        assert svc._subscriptions == set()
        assert r.metric("kvrelay_pool_subscribers") == 0
        assert r.metric("kvrelay_stream_subscribers", kind="pool") == 0
        async with r.channel() as ch:
            consumer = await subscribe(r, ch)
            await verify(r, consumer)
            await consumer.stop()


async def _steps(e: SimEngine, n: int) -> None:
    for _ in range(n):
        await e.step(1)
        await asyncio.sleep(0.002)


async def test_65th_subscriber_gets_resource_limit() -> None:
    cfg = SimConfig(name="m0", seed=24, dp_size=1, capacity_blocks=64)
    # every consumer is on 127.0.0.1: the contract limit alone, without the per-peer share
    shares_off = RelayLimits(stream_share_per_peer_percent=100)
    async with rig([cfg], limits=shares_off) as r:
        await wait_live(r.relay, 1)
        await r.engines[0].step(5)
        svc = r.server.service
        chans = [r.channel() for _ in range(4)]
        try:
            info = await relay_info(chans[0])
            assert info.relay is not None
            producer = await catalog_producer(chans[0])
            consumers = [
                Consumer(chans[i % 4], producer, info.relay, f"s{i}").start() for i in range(64)
            ]
            await asyncio.wait_for(asyncio.gather(*(c.first.wait() for c in consumers)), scaled(30))
            assert svc.pool_permits.in_use == 64
            _msgs, end = await collect_end(
                chans[1], "SubscribeKvPool", sub_req(producer, "s64"), pb.FilterUpdate
            )
            assert end.status == Status.RESOURCE_EXHAUSTED and end.reason == LIMIT
            assert errors(r, LIMIT) == 1 and r.stream_errors("RESOURCE_LIMIT") == 1
            assert r.metric("kvrelay_stream_subscribers", kind="pool") == 64
            await r.engines[0].step(5)
            await verify(r, consumers[0], probes=5_000)  # the 64 admitted streams are unaffected
            assert all(c.end is None for c in consumers)
            await consumers[-1].stop()
            await eventually(lambda: svc.pool_permits.in_use == 63, what="slot released")
            again = await subscribe(r, chans[2], "s64-retry")
            await asyncio.gather(*(c.stop() for c in [*consumers, again]))
            await eventually(lambda: svc.pool_permits.in_use == 0, what="all released")
        finally:
            for c in chans:
                c.close()


async def test_relay_restart_is_a_new_incarnation() -> None:
    cfg = SimConfig(name="i0", seed=25, dp_size=2, capacity_blocks=64)
    async with rig([cfg]) as r:
        await wait_live(r.relay, 2)
        await r.engines[0].step(10)
        port = r.port
        async with r.channel() as ch:
            consumer = await subscribe(r, ch)
            old_info = await relay_info(ch)
            old_producer = consumer.producer
            await r.server.close(grace_s=1.0)
            await stop_relay(r.relay)
            end = await consumer.wait_end()
            assert end.status is None, "relay shutdown ends streams with a clean EOF"
        await r.engines[0].step(5)  # traffic while no relay runs: recovered by replay
        r.relay, r.server = await start_relay(r.settings, port)
        assert r.port == port
        async with r.channel() as ch:
            info = await relay_info(ch)
            assert info.relay is not None and old_info.relay is not None
            assert info.relay.relay_incarnation != old_info.relay.relay_incarnation
            new_producer = await catalog_producer(ch)
            assert new_producer.producer_incarnation == info.relay.relay_incarnation
            _m, stale = await collect_end(
                ch, "SubscribeKvPool", sub_req(old_producer), pb.FilterUpdate
            )
            assert stale.status == Status.FAILED_PRECONDITION and stale.reason == CHANGED
            assert r.stream_errors("PRODUCER_CHANGED") == 1
            consumer = await subscribe(r, ch)
            await r.engines[0].step(5)
            await verify(r, consumer)
            await consumer.stop()


async def test_pool_withdrawal_and_rematerialization() -> None:
    cfg = SimConfig(name="w0", seed=26, dp_size=1, capacity_blocks=64)
    async with rig([cfg]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        await r.engines[0].step(10)
        consumer = await subscribe(r, ch)
        old_producer = consumer.producer
        grpc_port = r.engines[0].grpc_port
        await r.engines[0].stop()  # every engine of the pool gone
        end = await consumer.wait_end()
        assert end.status == Status.UNAVAILABLE and end.reason == UNAVAILABLE
        await eventually(lambda: r.pool.generation is None, what="withdrawn")
        assert await catalog_pool_count(ch) == 0
        _m, gone = await collect_end(ch, "SubscribeKvPool", sub_req(old_producer), pb.FilterUpdate)
        assert gone.status == Status.NOT_FOUND and gone.reason == NOT_FOUND
        assert r.pool.subscribers == {}
        assert r.metric("kvrelay_pool_materialized") == 0
        assert r.stream_errors("POOL_NOT_FOUND") == 1
        # the engine comes back (a fresh process on the same Control port)
        fresh = SimEngine(dataclasses.replace(cfg, grpc_port=grpc_port))
        await fresh.start()
        r.engines[0] = fresh
        await wait_live(r.relay, 1)
        new_producer = await catalog_producer(ch, differs_from=old_producer)
        assert new_producer.layout_generation > old_producer.layout_generation
        assert r.pool.counters.generations == 2
        assert r.metric("kvrelay_pool_generations_total") == 2
        assert r.metric("kvrelay_pool_materialized") == 1
        _m, stale = await collect_end(ch, "SubscribeKvPool", sub_req(old_producer), pb.FilterUpdate)
        assert stale.status == Status.FAILED_PRECONDITION and stale.reason == CHANGED
        consumer = await subscribe(r, ch)
        await fresh.step(10)
        await verify(r, consumer)
        await consumer.stop()

