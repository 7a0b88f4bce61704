"""Stream semantics over real loopback gRPC: replica equality, heartbeats, planes, terminations."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
from grpclib.const import Cardinality, Status

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from kvrelay.publication import cbi1
from tests.support.mem_relay import (
    MARKER,
    SVC,
    GrpcioClient,
    Replica,
    StartRelay,
    expect_error,
    grpclib_channel,
    grpclib_collect,
    pool_call,
    sub_request,
)
from tests.support.mirror_rig import served_hub, settle
from tests.support.timing import scaled

K = "kv-relay-error-reason"


async def _reader(st: Any, replica: Replica, stop_at: Callable[[], int]) -> None:
    """Feed a replica until it has installed sequence `stop_at()`."""
    while replica.installed is None or replica.installed < stop_at():
        msg = await st.recv_message()
        assert msg is not None
        replica.feed(msg)


async def test_replica_equals_producer_after_long_random_run(
    start_relay: StartRelay, grpcio_client: Callable[[int], GrpcioClient]
) -> None:
    """Two clients (grpclib/betterproto2 and grpcio/official pb2) + a late joiner rebuild the
    producer table byte for byte from the stream alone. The lane has 2 snapshot chunks."""
    view, server = await start_relay()
    gen = view.add_pool("pool-a", 1 << 20)
    rng = np.random.default_rng(7)
    for _ in range(5):  # history before the hub exists (barrier snapshot at S=5)
        gen.random_step(rng, 50)
    ch = grpclib_channel(server.port)
    gio = grpcio_client(server.port)
    req = sub_request(gen.producer, "replica-a")
    r1 = Replica(view.relay_identity, gen.producer)
    r2 = Replica(view.relay_identity, gen.producer)
    r3 = Replica(view.relay_identity, gen.producer)
    try:
        async with pool_call(ch) as st:
            await st.send_message(req, end=True)
            call = gio.stub.SubscribeKvPool(gio.convert(sub_request(gen.producer, "replica-b")))
            first = await call.read()
            r2.feed(pb.FilterUpdate.parse(first.SerializeToString()))
            late_task = None
            for step in range(400):
                gen.random_step(rng, int(rng.integers(1, 400)))
                if step % 7 == 0:
                    await asyncio.sleep(0)
                if step % 16 == 0:  # drain so queues (16 frames) never overflow
                    await _reader(st, r1, lambda: gen.sequence)
                    while r2.installed is None or r2.installed < gen.sequence:
                        r2.feed(pb.FilterUpdate.parse((await call.read()).SerializeToString()))
                    if late_task is not None:
                        await late_task
                        late_task = None
                if step == 200:
                    await settle(view, server)  # the late joiner's cut is at gen.sequence
                    ch3 = grpclib_channel(server.port)
                    cm3 = pool_call(ch3)
                    st3 = await cm3.__aenter__()
                    await st3.send_message(sub_request(gen.producer, "late"), end=True)
                    late_start = gen.sequence
                    first3 = await st3.recv_message()
                    r3.feed(first3)
                if step > 200:
                    late_task = asyncio.ensure_future(_reader(st3, r3, lambda: gen.sequence))
                    await late_task
                    late_task = None
            await _reader(st, r1, lambda: gen.sequence)
            while r2.installed < gen.sequence:  # type: ignore[operator]
                r2.feed(pb.FilterUpdate.parse((await call.read()).SerializeToString()))
            await st.cancel()
        call.cancel()
        await st3.cancel()
        await cm3.__aexit__(None, None, None)
        ch3.close()
    finally:
        ch.close()
    for r in (r1, r2, r3):
        assert r.table is not None and r.installed == gen.sequence
        assert r.table.tobytes() == gen.table.tobytes()
    assert r1.snapshot_frames == r2.snapshot_frames == 2
    assert r3.snapshot_frames == 2 and r3.deltas == gen.sequence - late_start
    assert r1.deltas == gen.sequence - 5


async def test_heartbeats_after_silence_only_after_snapshot(start_relay: StartRelay) -> None:
    view, server = await start_relay(RelayLimits(pool_heartbeat_s=0.15))
    gen = view.add_pool("pool-a", 4096)
    rng = np.random.default_rng(1)
    gen.random_step(rng, 10)
    ch = grpclib_channel(server.port)
    replica = Replica(view.relay_identity, gen.producer)
    loop = asyncio.get_running_loop()
    try:
        async with pool_call(ch) as st:
            await st.send_message(sub_request(gen.producer), end=True)
            snap = await st.recv_message()
            t0 = loop.time()
            assert snap.kind == pb.FilterUpdateKind.SNAPSHOT_CHUNK and snap.sequence == 1
            replica.feed(snap)
            hb = await st.recv_message()
            dt = loop.time() - t0
            assert hb.kind == pb.FilterUpdateKind.HEARTBEAT and 0.1 <= dt < scaled(1.0)
            assert (hb.base_sequence, hb.sequence, hb.payload) == (1, 1, b"")
            replica.feed(hb)
            hb2 = await st.recv_message()
            replica.feed(hb2)
            assert hb2.send_ts_us > hb.send_ts_us
            gen.random_step(rng, 3)
            d = await st.recv_message()
            t1 = loop.time()
            replica.feed(d)
            assert d.kind == pb.FilterUpdateKind.DELTA
            hb3 = await st.recv_message()
            assert loop.time() - t1 >= 0.1
            replica.feed(hb3)
            assert hb3.sequence == 2 and replica.heartbeats == 3
            await st.cancel()
    finally:
        ch.close()
    assert replica.table is not None and replica.table.tobytes() == gen.table.tobytes()


async def test_small_deltas_are_written_by_the_publisher_to_both_clients(
    start_relay: StartRelay, grpcio_client: Callable[[int], GrpcioClient]
) -> None:
    """Deltas published while the streams are idle go straight to the HTTP/2 transport (the
    hub's ``direct_frames``), and both an independent grpcio client and grpclib rebuild the
    producer table exactly from base+1 contiguous deltas."""
    view, server = await start_relay()
    gen = view.add_pool("pool-a", 4096)
    rng = np.random.default_rng(5)
    gen.random_step(rng, 10)
    ch = grpclib_channel(server.port)
    gio = grpcio_client(server.port)
    r1 = Replica(view.relay_identity, gen.producer)
    r2 = Replica(view.relay_identity, gen.producer)
    try:
        async with pool_call(ch) as st:
            await st.send_message(sub_request(gen.producer, "direct-a"), end=True)
            call = gio.stub.SubscribeKvPool(gio.convert(sub_request(gen.producer, "direct-b")))
            r1.feed(await st.recv_message())
            r2.feed(pb.FilterUpdate.parse((await call.read()).SerializeToString()))
            hub = served_hub(server, gen)
            assert hub is not None
            await asyncio.sleep(0.05)  # both pumps idle after their snapshots
            published = 0
            for _ in range(60):
                gen.random_step(rng, int(rng.integers(1, 50)))
                published += 1
                await _reader(st, r1, lambda: gen.sequence)
                while r2.installed is None or r2.installed < gen.sequence:
                    r2.feed(pb.FilterUpdate.parse((await call.read()).SerializeToString()))
            assert hub.direct_frames == 2 * published
            call.cancel()
            await st.cancel()
    finally:
        ch.close()
    for r in (r1, r2):
        assert r.deltas == published
        assert r.table is not None and r.table.tobytes() == gen.table.tobytes()


async def test_streams_sharing_a_connection_get_every_delta_in_order(
    start_relay: StartRelay,
) -> None:
    """Six streams on one HTTP/2 connection: the frames written directly for all of them go
    out in one write per connection and loop iteration, interleaved with heartbeats grpclib
    writes itself; every stream rebuilds the table from base+1 contiguous deltas."""
    view, server = await start_relay(RelayLimits(pool_heartbeat_s=0.05))
    gen = view.add_pool("pool-a", 4096)
    rng = np.random.default_rng(11)
    gen.random_step(rng, 10)
    ch = grpclib_channel(server.port)
    replicas = [Replica(view.relay_identity, gen.producer) for _ in range(6)]
    try:
        cms = [
            pool_call(ch)
            for _ in replicas
        ]
        streams = [await cm.__aenter__() for cm in cms]
        for i, st in enumerate(streams):
            await st.send_message(sub_request(gen.producer, f"shared-{i}"), end=True)
        for st, r in zip(streams, replicas, strict=True):
            r.feed(await st.recv_message())
        hub = served_hub(server, gen)
        assert hub is not None
        await asyncio.sleep(0.05)
        for step in range(40):
            gen.random_step(rng, int(rng.integers(1, 30)))
            if step % 10 == 9:
                await asyncio.sleep(0.08)  # idle long enough for heartbeats in between
            for st, r in zip(streams, replicas, strict=True):
                await _reader(st, r, lambda: gen.sequence)
        assert hub.direct_frames >= 6 * 30  # (a delta may meet a pump busy with a heartbeat)
        for st in streams:
            await st.cancel()
        for cm in cms:
            await cm.__aexit__(None, None, None)
    finally:
        ch.close()
    for r in replicas:
        assert r.deltas == 40 and r.heartbeats > 0
        assert r.table is not None and r.table.tobytes() == gen.table.tobytes()


async def test_catalog_stream_both_clients(
    start_relay: StartRelay, grpcio_client: Callable[[int], GrpcioClient]
) -> None:
    view, server = await start_relay()
    view.add_pool("pool-a", 1024)
    await settle(view, server)
    ch = grpclib_channel(server.port)
    gio = grpcio_client(server.port)
    req = pb.WatchKvPoolCatalogRequest(subscriber_id="cat", contract_marker=MARKER)
    try:
        async with ch.request(
            SVC + "WatchKvPoolCatalog",
            Cardinality.UNARY_STREAM,
            pb.WatchKvPoolCatalogRequest,
            pb.KvPoolCatalogUpdate,
        ) as st:
            await st.send_message(req, end=True)
            call = gio.stub.WatchKvPoolCatalog(gio.convert(req))
            first = await st.recv_message()
            gfirst = await call.read()
            assert first.revision == gfirst.revision == 1
            assert len(first.snapshot.pools) == len(gfirst.snapshot.pools) == 1
            assert gfirst.contract_marker == MARKER and gfirst.protocol_version == 1
            b = view.add_pool("pool-b", 2048)
            nxt = await st.recv_message()
            gnxt = await call.read()
            assert nxt.revision == gnxt.revision == 2 and len(gnxt.snapshot.pools) == 2
            view.remove(b)
            third = await st.recv_message()
            assert third.revision == 3 and len(third.snapshot.pools) == 1
            assert bytes(third) == (await call.read()).SerializeToString()
            call.cancel()
            await st.cancel()
    finally:
        ch.close()


async def test_readiness_initial_change_and_resend(
    start_relay: StartRelay, grpcio_client: Callable[[int], GrpcioClient]
) -> None:
    view, server = await start_relay(RelayLimits(readiness_heartbeat_s=0.2))
    gio = grpcio_client(server.port)
    req = pb.SubscribeServingReadinessRequest(subscriber_id="r", contract_marker=MARKER)
    call = gio.stub.SubscribeServingReadiness(gio.convert(req))
    loop = asyncio.get_running_loop()
    m0 = await call.read()
    t0 = loop.time()
    assert m0.revision == 0 and m0.contract_marker == MARKER
    entry = pb.TopologyEntry(namespace="ns", canonical_model_id="m", state=2)
    view.readiness.publish(view.readiness_msg(5, [entry]), 5)
    m1 = await call.read()
    assert m1.revision == 5 and m1.entries[0].canonical_model_id == "m"
    m2 = await call.read()  # fixed-interval re-send from subscription, same revision
    assert m2.revision == 5 and m2 == m1
    assert 0.15 <= loop.time() - t0 < scaled(1.0)
    m3 = await call.read()
    assert m3.revision == 5 and 0.35 <= loop.time() - t0 < scaled(1.5)
    call.cancel()


async def test_load_windows_lag_and_close(start_relay: StartRelay) -> None:
    view, server = await start_relay(RelayLimits(load_fanout_capacity=3))
    view.add_pool("pool-a", 1024)
    view.load.publish(view.load_msg(1, used=1), 1)
    await settle(view, server)
    ch = grpclib_channel(server.port)
    req = pb.SubscribeKvPoolLoadRequest(subscriber_id="l", contract_marker=MARKER)
    try:
        async with ch.request(
            SVC + "SubscribeKvPoolLoad",
            Cardinality.UNARY_STREAM,
            pb.SubscribeKvPoolLoadRequest,
            pb.KvPoolLoadUpdate,
        ) as st:
            await st.send_message(req, end=True)
            w1 = await st.recv_message()
            assert w1.window_sequence == 1 and w1.pools[0].kv_used_blocks == 1
            for i in (2, 3):
                view.load.publish(view.load_msg(i, used=i), i)
                w = await st.recv_message()
                assert w.window_sequence == i and w.pools[0].kv_used_blocks == i
            view.load.publish(view.load_msg(6, used=9), 6)  # 3 behind: still allowed
            assert (await st.recv_message()).window_sequence == 6
            view.load.publish(view.load_msg(10, used=9), 10)  # 4 behind > capacity 3
            err = await expect_error(st)
            assert err.status == Status.RESOURCE_EXHAUSTED
            assert st.trailing_metadata[K] == "RELAY_ERROR_REASON_SUBSCRIBER_LAGGED"
        async with ch.request(
            SVC + "SubscribeKvPoolLoad",
            Cardinality.UNARY_STREAM,
            pb.SubscribeKvPoolLoadRequest,
            pb.KvPoolLoadUpdate,
        ) as st:
            await st.send_message(req, end=True)
            assert (await st.recv_message()).window_sequence == 10
            view.load.close()
            err = await expect_error(st)
            assert err.status == Status.UNAVAILABLE
            assert st.trailing_metadata[K] == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
    finally:
        ch.close()


async def test_lagging_subscriber_alone_is_dropped(start_relay: StartRelay) -> None:
    """A client that stops reading overflows its 2-frame queue → SUBSCRIBER_LAGGED after it
    drains; a reading client on the same pool gets every delta."""
    view, server = await start_relay(RelayLimits(publication_queue_capacity=2))
    gen = view.add_pool("pool-a", 1 << 16)
    rng = np.random.default_rng(3)
    slow_ch = grpclib_channel(server.port, window=65535)
    fast_ch = grpclib_channel(server.port)
    slow = Replica(view.relay_identity, gen.producer)
    fast = Replica(view.relay_identity, gen.producer)
    try:
        async with (
            pool_call(slow_ch) as s1,
            pool_call(fast_ch) as s2,
        ):
            await s1.send_message(sub_request(gen.producer, "slow"), end=True)
            await s2.send_message(sub_request(gen.producer, "fast"), end=True)
            slow.feed(await s1.recv_message())
            fast.feed(await s2.recv_message())
            hub = served_hub(server, gen)
            assert hub is not None
            for _ in range(40):  # 40 × 24 KB deltas: far beyond a 64 KiB window + 2 frames
                gen.random_step(rng, 2000)
                await _reader(s2, fast, lambda: gen.sequence)
                await asyncio.sleep(0.002)
            # the lagged subscriber stops counting at once (its stream is still draining)
            assert hub.lagged == 1 and hub.subscriber_count == 1
            assert server.service.pool_permits.in_use == 1
            err = await expect_error(s1, slow.feed)  # contiguous up to the drop point
            assert err.status == Status.RESOURCE_EXHAUSTED
            assert s1.trailing_metadata[K] == "RELAY_ERROR_REASON_SUBSCRIBER_LAGGED"
            assert 0 < slow.deltas < 40
            assert hub.direct_frames == 0  # 24 KB deltas exceed one HTTP/2 frame: queued
            await s2.cancel()
    finally:
        slow_ch.close()
        fast_ch.close()
    assert fast.table is not None and fast.table.tobytes() == gen.table.tobytes()


async def test_snapshot_progress_timeout(start_relay: StartRelay) -> None:
    view, server = await start_relay(RelayLimits(snapshot_progress_timeout_s=0.3))
    gen = view.add_pool("pool-a", 1 << 18)  # 2 MiB snapshot vs a 64 KiB client window
    gen.random_step(np.random.default_rng(5), 100)
    ch = grpclib_channel(server.port, window=65535)
    try:
        async with pool_call(ch) as st:
            await st.send_message(sub_request(gen.producer), end=True)
            await asyncio.sleep(0.6)  # stop draining the bootstrap snapshot
            hub = served_hub(server, gen)
            assert hub is not None
            gen.random_step(np.random.default_rng(6), 10)  # timed-out subscriber is detached
            await settle(view, server)
            got: list[Any] = []
            err = await expect_error(st, got.append)
            assert err.status == Status.RESOURCE_EXHAUSTED
            assert st.trailing_metadata[K] == "RELAY_ERROR_REASON_SNAPSHOT_PROGRESS_TIMEOUT"
            assert [m.kind for m in got] == [pb.FilterUpdateKind.SNAPSHOT_CHUNK]
    finally:
        ch.close()
    # the generation is not fenced: a fresh subscriber bootstraps normally
    r = await grpclib_collect(
        grpclib_channel(server.port),
        "SubscribeKvPool",
        sub_request(gen.producer),
        pb.FilterUpdate,
        limit=1,
    )
    assert r.status is None and r.messages[0].sequence == 2


async def test_oversize_publication_resets_and_retire_closes(
    start_relay: StartRelay, grpcio_client: Callable[[int], GrpcioClient]
) -> None:
    view, server = await start_relay()
    gen = view.add_pool("pool-a", 1 << 20)
    ch = grpclib_channel(server.port)
    gio = grpcio_client(server.port)
    rng = np.random.default_rng(11)
    try:
        async with pool_call(ch) as st:
            await st.send_message(sub_request(gen.producer), end=True)
            call = gio.stub.SubscribeKvPool(gio.convert(sub_request(gen.producer, "gio")))
            for _ in range(2):
                assert (await st.recv_message()).kind == pb.FilterUpdateKind.SNAPSHOT_CHUNK
                assert (await call.read()).kind == pb.FilterUpdateKind.SNAPSHOT_CHUNK
            gen.random_step(rng, cbi1.MAX_DELTA_IMAGES)  # the largest delta is fine
            assert (await st.recv_message()).kind == pb.FilterUpdateKind.DELTA
            assert (await call.read()).kind == pb.FilterUpdateKind.DELTA
            gen.random_step(rng, cbi1.MAX_DELTA_IMAGES + 1)
            err = await expect_error(st)
            assert err.status == Status.UNAVAILABLE
            assert st.trailing_metadata[K] == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
            try:
                await call.read()
                raise AssertionError("expected the grpcio stream to fail")
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE
                assert (
                    dict(exc.trailing_metadata())[K] == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
                )
        # resubscribe: fresh snapshot of the mirror at the new sequence, equal to the producer
        replica = Replica(view.relay_identity, gen.producer)
        async with pool_call(ch) as st:
            await st.send_message(sub_request(gen.producer), end=True)
            await _reader(st, replica, lambda: gen.sequence)
            assert replica.installed == 2 and replica.table.tobytes() == gen.table.tobytes()  # type: ignore[union-attr]
            view.remove(gen)  # retire → UNAVAILABLE / PUBLICATION_UNAVAILABLE
            err = await expect_error(st)
            assert err.status == Status.UNAVAILABLE
            assert st.trailing_metadata[K] == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
    finally:
        ch.close()


async def test_server_close_ends_streams_with_clean_eof(start_relay: StartRelay) -> None:
    view, server = await start_relay()
    gen = view.add_pool("pool-a", 1024)
    ch = grpclib_channel(server.port)
    results: list[Any] = []

    async def pool_reader() -> None:
        results.append(
            await grpclib_collect(
                ch, "SubscribeKvPool", sub_request(gen.producer), pb.FilterUpdate, timeout=10
            )
        )

    async def cat_reader() -> None:
        results.append(
            await grpclib_collect(
                ch,
                "WatchKvPoolCatalog",
                pb.WatchKvPoolCatalogRequest(subscriber_id="c", contract_marker=MARKER),
                pb.KvPoolCatalogUpdate,
                timeout=10,
            )
        )

    tasks = [asyncio.ensure_future(pool_reader()), asyncio.ensure_future(cat_reader())]
    for _ in range(200):
        hub = served_hub(server, gen)
        if server.service._active == 2 and hub is not None and hub.subscriber_count:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    await server.close(grace_s=2.0)
    await asyncio.gather(*tasks)
    ch.close()
    for r in results:
        assert r.status is None and K not in r.trailers and len(r.messages) == 1


async def test_health_and_reflection(start_relay: StartRelay, official_pb2: Any) -> None:
    from grpclib.health.v1.health_grpc import HealthStub
    from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
    from grpclib.reflection.v1.reflection_grpc import ServerReflectionStub
    from grpclib.reflection.v1.reflection_pb2 import ServerReflectionRequest

    _view, server = await start_relay()
    ch = grpclib_channel(server.port)
    try:
        resp = await HealthStub(ch).Check(HealthCheckRequest())
        assert resp.status == HealthCheckResponse.SERVING
        refl = ServerReflectionStub(ch)
        replies = await refl.ServerReflectionInfo(
            [
                ServerReflectionRequest(list_services=""),
                ServerReflectionRequest(file_containing_symbol="dynamo.kvrelay.v1.KvEventRelay"),
            ]
        )
        names = {s.name for s in replies[0].list_services_response.service}
        assert "dynamo.kvrelay.v1.KvEventRelay" in names and "grpc.health.v1.Health" in names
        from google.protobuf import descriptor_pb2

        fd = descriptor_pb2.FileDescriptorProto.FromString(
            replies[1].file_descriptor_response.file_descriptor_proto[0]
        )
        methods = [m.name for m in fd.service[0].method]
        assert methods == [
            "GetRelayInfo",
            "WatchKvPoolCatalog",
            "SubscribeKvPool",
            "SubscribeServingReadiness",
            "SubscribeKvPoolLoad",
            "SubscribeServingLoad",
        ]
        official = official_pb2["relay"].DESCRIPTOR.services_by_name["KvEventRelay"]
        assert [m.name for m in official.methods] == methods
    finally:
        ch.close()


async def test_retired_generation_during_admission_and_closed_planes(
    start_relay: StartRelay,
) -> None:
    view, server = await start_relay()
    gen = view.add_pool("pool-a", 1024)
    gen.retired = True  # still in the catalog, but retired before its hub could initialize
    ch = grpclib_channel(server.port)
    try:
        r = await grpclib_collect(ch, "SubscribeKvPool", sub_request(gen.producer), pb.FilterUpdate)
        assert (r.status, r.trailers[K]) == (
            Status.UNAVAILABLE,
            "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE",
        )
        assert gen.hub_inits == 0
    finally:
        ch.close()
    for method, req_t, rep_t, plane_of in (
        ("WatchKvPoolCatalog", pb.WatchKvPoolCatalogRequest, pb.KvPoolCatalogUpdate,
         lambda v: v.catalog),
        ("SubscribeServingReadiness", pb.SubscribeServingReadinessRequest,
         pb.ServingReadinessUpdate, lambda v: v.readiness),
    ):  # fmt: skip
        # a source of its own for each plane: a mirror whose upstream closed one plane has no
        # session and refuses every new call (a second plane's request would not get its first
        # message), as its health says
        view, server = await start_relay()
        ch = grpclib_channel(server.port)
        try:
            task = asyncio.ensure_future(
                grpclib_collect(ch, method, req_t(subscriber_id="p", contract_marker=MARKER), rep_t)
            )
            await asyncio.sleep(0.05)
            plane_of(view).close()
            r = await task
            assert len(r.messages) == 1 and r.status == Status.UNAVAILABLE
            assert r.trailers[K] == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
        finally:
            ch.close()


async def test_inbound_message_limit(start_relay: StartRelay) -> None:
    _view, server = await start_relay()
    ch = grpclib_channel(server.port)
    try:
        big = pb.WatchKvPoolCatalogRequest(
            subscriber_id="x" * (9 * 1024 * 1024), contract_marker=MARKER
        )
        r = await grpclib_collect(ch, "WatchKvPoolCatalog", big, pb.KvPoolCatalogUpdate)
        assert r.status == Status.RESOURCE_EXHAUSTED and not r.messages
    finally:
        ch.close()


def test_server_runs_on_uvloop() -> None:
    """The same server under uvloop (kvrelay can switch loops): info + one pool stream."""
    import uvloop

    from kvrelay.service.server import RelayServer
    from tests.support.mem_relay import MemRelayView

    async def main() -> None:
        view = MemRelayView()
        gen = view.add_pool("pool-a", 1024)
        server = RelayServer(view)
        await server.start("127.0.0.1", 0)
        ch = grpclib_channel(server.port)
        try:
            info = await pb.KvEventRelayStub(ch).get_relay_info(
                pb.RelayInfoRequest(contract_marker=MARKER)
            )
            assert info.protocol_version == 1
            replica = Replica(view.relay_identity, gen.producer)
            async with pool_call(ch) as st:
                await st.send_message(sub_request(gen.producer), end=True)
                replica.feed(await st.recv_message())
                rng = np.random.default_rng(2)
                for _ in range(12):  # < 16 queued frames: no lag
                    gen.random_step(rng, 30)
                await _reader(st, replica, lambda: gen.sequence)
                await st.cancel()
            assert replica.table is not None
            assert replica.table.tobytes() == gen.table.tobytes()
        finally:
            ch.close()
            await server.close(grace_s=1.0)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main())


async def test_withdrawal_reaches_the_catalog_before_the_pool_stream_ends(
    start_relay: StartRelay,
) -> None:
    """§8.6: a withdrawn pool's subscribers end only after the catalog without it, in every
    mode. A mirror parses a catalog over 16 KiB in a thread: its pool streams waited for none."""
    view, server = await start_relay()
    gen = view.add_pool("pool-a", 1024)
    big = view.add_pool("pool-b", 1024)  # its descriptor keeps the catalog over 16 KiB
    build = view._catalog_msg

    def catalog(revision: int) -> pb.KvPoolCatalogUpdate:
        msg = build(revision)
        for d in msg.snapshot.pools if msg.snapshot is not None else []:
            if d.producer == big.producer:
                d.registrations += [
                    pb.ModelRegistration(canonical_model_id=f"lora-{i}", target=pb.ModelTarget(
                        lora=pb.LoraModelTarget(base_model="m", adapter=f"lora-{i}")))
                    for i in range(1000)
                ]  # fmt: skip
        return msg

    view._catalog_msg = catalog  # type: ignore[method-assign]
    view._republish_catalog()
    await settle(view, server)
    ch = grpclib_channel(server.port)  # one connection: its frames arrive in the server's order
    seen: list[Any] = []
    try:
        cat: Any
        async with ch.request(
            SVC + "WatchKvPoolCatalog",
            Cardinality.UNARY_STREAM,
            pb.WatchKvPoolCatalogRequest,
            pb.KvPoolCatalogUpdate,
        ) as cat:
            await cat.send_message(
                pb.WatchKvPoolCatalogRequest(subscriber_id="c", contract_marker=MARKER), end=True
            )
            assert len((await cat.recv_message()).snapshot.pools) == 2
            st: Any
            async with pool_call(ch) as st:
                await st.send_message(sub_request(gen.producer), end=True)
                assert (await st.recv_message()).kind == pb.FilterUpdateKind.SNAPSHOT_CHUNK

                async def catalog_reader() -> None:
                    seen.append(("catalog", len((await cat.recv_message()).snapshot.pools)))

                async def pool_reader() -> None:
                    seen.append(("end", (await expect_error(st)).status))

                readers = asyncio.gather(catalog_reader(), pool_reader())
                await asyncio.sleep(0.05)
                view.remove(gen)
                async with asyncio.timeout(scaled(10)):
                    await readers
            await cat.cancel()
    finally:
        ch.close()
    assert seen == [("catalog", 1), ("end", Status.UNAVAILABLE)]
