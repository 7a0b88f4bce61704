"""A router that stops reading (GC pause, overloaded loop) and then reads again gets the frames
already sent and then its status — never an HTTP/2 stream left open for ever.

The stalled peer is grpcio (official protobuf stubs generated at test time, BDP probing off so its
64 KiB stream window really fills), independent of the relay's grpclib. The relay serves a
simulated fleet; after each stall a healthy subscriber's replica must still equal the engines'
ground truth.
"""

from __future__ import annotations

import asyncio
import time
from types import ModuleType
from typing import Any

import grpc

from kvrelay.contract.limits import RelayLimits
from kvrelay.contract.wire import CONTRACT_MARKER, TRAILER_KEY
from kvrelay.sim.config import SimConfig
from tests.support.rig import catalog_producer, eventually, rig, subscribe, verify, wait_live
from tests.support.timing import scaled

TIMEOUT_S = 1.0  # snapshot_progress_timeout_s for these tests
STALL_S = 5 * TIMEOUT_S  # how long the lag test may take to overflow the stalled queue

OPTIONS = [
    ("grpc.http2.bdp_probe", 0),  # keep the initial 64 KiB window: a stalled reader stalls
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
]


def _request(pb2: ModuleType, producer: Any, sid: str) -> Any:
    relay = pb2["relay"]
    return relay.SubscribeKvPoolRequest(
        subscriber_id=sid,
        contract_marker=CONTRACT_MARKER,
        expected_producer=relay.ProducerIdentity.FromString(bytes(producer)),
    )


async def _stall_then_drain(
    pb2: dict[str, ModuleType], port: int, producer: Any, read_first: int, stalled: asyncio.Event,
    resume: asyncio.Event,
) -> tuple[int, grpc.StatusCode, str, float]:
    """Read ``read_first`` frames, stall until ``resume`` (the test has seen the relay act on the
    stall), then read to the end.

    Returns (frames read, final status, reason trailer, seconds from resuming to the status)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
        stub = pb2["relay_grpc"].KvEventRelayStub(channel)
        call = stub.SubscribeKvPool(_request(pb2, producer, "stalls"))
        frames = 0
        for _ in range(read_first):
            await call.read()
            frames += 1
        stalled.set()
        await resume.wait()
        resumed = time.monotonic()
        try:
            while (await call.read()) is not grpc.aio.EOF:
                frames += 1
        except grpc.aio.AioRpcError:
            pass  # the status below says why
        took = time.monotonic() - resumed
        code = await call.code()
        trailers = dict(await call.trailing_metadata() or ())
        return frames, code, str(trailers.get(TRAILER_KEY)), took


async def test_stall_during_a_snapshot_ends_with_snapshot_progress_timeout(
    official_pb2: dict[str, ModuleType],
) -> None:
    limits = RelayLimits(snapshot_progress_timeout_s=TIMEOUT_S)
    cfg = SimConfig(name="st0", seed=31, dp_size=1, capacity_blocks=64)
    # 524,288 buckets: one 4 MiB chunk, far beyond the stalled reader's 64 KiB window
    async with rig([cfg], limits=limits, expected_blocks=1_048_576) as r:
        await wait_live(r.relay, 1)
        await r.engines[0].step(8)
        async with r.channel() as ch:
            producer = await catalog_producer(ch)
            stalled, resume = asyncio.Event(), asyncio.Event()
            drain = _stall_then_drain(official_pb2, r.port, producer, 0, stalled, resume)
            task = asyncio.create_task(drain)
            await stalled.wait()
            svc = r.server.service
            await eventually(
                lambda: any(s.error is not None for s in svc._subscriptions),
                what="snapshot progress deadline passed",
                timeout=10,
            )
            # the failed stream stops counting against the limits at once, while still blocked
            hub = r.pool.generation.hub()
            assert hub.subscriber_count == 0 and svc.pool_permits.in_use == 0
            resume.set()
            frames, code, reason, took = await asyncio.wait_for(task, scaled(30))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert reason == "RELAY_ERROR_REASON_SNAPSHOT_PROGRESS_TIMEOUT"
            assert frames <= 1 and took <= scaled(2 * TIMEOUT_S)
            assert r.stream_errors("SNAPSHOT_PROGRESS_TIMEOUT") == 1
            consumer = await subscribe(r, ch)
            await r.engines[0].step(4)
            await verify(r, consumer, probes=2_000)
            await consumer.stop()


async def test_stall_during_deltas_ends_with_subscriber_lagged(
    official_pb2: dict[str, ModuleType],
) -> None:
    limits = RelayLimits(snapshot_progress_timeout_s=TIMEOUT_S, publish_every_n_events=1)
    cfg = SimConfig(name="st1", seed=32, dp_size=1, capacity_blocks=256)
    async with rig([cfg], limits=limits, expected_blocks=8192) as r:  # a 32 KiB snapshot
        await wait_live(r.relay, 1)
        await r.engines[0].step(4)
        async with r.channel() as ch:
            good = await subscribe(r, ch, "healthy")
            producer = await catalog_producer(ch)
            stalled, resume = asyncio.Event(), asyncio.Event()
            drain = _stall_then_drain(official_pb2, r.port, producer, 1, stalled, resume)
            task = asyncio.create_task(drain)
            await stalled.wait()
            hub = r.pool.generation.hub()
            deadline = time.monotonic() + scaled(STALL_S)
            while not hub.lagged and time.monotonic() < deadline:
                await r.engines[0].step(1)
                await asyncio.sleep(0.002)
            assert hub.lagged == 1, "the stalled reader's bounded queue must overflow"
            assert hub.subscriber_count == 1  # only the healthy one still counts
            resume.set()
            frames, code, reason, took = await asyncio.wait_for(task, scaled(30))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert reason == "RELAY_ERROR_REASON_SUBSCRIBER_LAGGED"
            # the deltas already sent came first
            assert frames > 1 and took <= scaled(2 * TIMEOUT_S)
            assert r.stream_errors("SUBSCRIBER_LAGGED") == 1
            await verify(r, good, probes=2_000)
            await good.stop()


async def test_a_reader_that_never_resumes_is_reset(official_pb2: dict[str, ModuleType]) -> None:
    """After ``stalled_stream_reset_s`` the stream is reset: the client learns the stream is gone
    even though it never drained what was in flight, and the handler is released."""
    limits = RelayLimits(snapshot_progress_timeout_s=0.5, stalled_stream_reset_s=1.0)
    cfg = SimConfig(name="st2", seed=33, dp_size=1, capacity_blocks=64)
    async with rig([cfg], limits=limits, expected_blocks=1_048_576) as r:
        await wait_live(r.relay, 1)
        async with r.channel() as ch:
            producer = await catalog_producer(ch)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{r.port}", options=OPTIONS) as channel:
            stub = official_pb2["relay_grpc"].KvEventRelayStub(channel)
            call = stub.SubscribeKvPool(_request(official_pb2, producer, "gone"))
            svc = r.server.service
            await eventually(lambda: svc._active == 1, what="stream admitted")
            await eventually(lambda: svc._active == 0, what="stalled stream reset", timeout=10)
            code = await asyncio.wait_for(call.code(), scaled(10))
            assert code != grpc.StatusCode.OK
