"""A mirror re-serves its upstream: the same bytes, replicas equal to the producer's table, a
mirror of a mirror, keys decided by the upstream, and the mirror's own limits and liveness."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client.codec import RawCodec
from kvrelay.client.wire import parse_envelope, parse_frame
from kvrelay.contract.limits import RelayLimits
from kvrelay.service.server import RelayServer
from kvrelay.sim.config import SimConfig
from tests.support import scripted_relay as S
from tests.support.mem_relay import MemRelayView, grpclib_channel, grpclib_collect, sub_request
from tests.support.mirror_rig import mirrored
from tests.support.rig import (
    MARKER,
    SVC,
    Consumer,
    catalog_producer,
    eventually,
    in_sync,
    relay_info,
    relay_info_bytes,
    rig,
    verify,
    wait_live,
)
from tests.support.timing import scaled

K = "kv-relay-error-reason"


def raw_channel(port: int) -> Channel:
    return Channel("127.0.0.1", port, codec=RawCodec(8 << 20))


class RawStream:
    """Collects the raw bytes of one server stream until cancelled."""

    def __init__(self, port: int, method: str, request: Any) -> None:
        self.channel = raw_channel(port)
        self.frames: list[bytes] = []
        self.task = asyncio.ensure_future(self._run(method, request))

    async def _run(self, method: str, request: Any) -> None:
        async with self.channel.request(
            SVC + method, Cardinality.UNARY_STREAM, type(request), bytes
        ) as st:
            await st.send_message(request, end=True)
            while (data := await st.recv_message()) is not None:
                self.frames.append(data)

    def last_sequence(self) -> int:
        return parse_frame(self.frames[-1]).sequence if self.frames else -1

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.channel.close()


async def test_mirror_serves_the_bytes_a_direct_subscriber_gets() -> None:
    """Deltas are the upstream's bytes; snapshot chunks cut by the mirror equal the upstream's
    cut at the same sequence except ``send_ts_us``; planes and GetRelayInfo are identical."""
    cfg = SimConfig(name="b0", seed=71, dp_size=2, capacity_blocks=128)
    async with rig([cfg], expected_blocks=2_000_000) as r:  # 2^20 buckets: 2 chunks
        await wait_live(r.relay, 2)
        await r.engines[0].step(8)
        async with mirrored(r.port) as m, r.channel() as ch:
            producer = await catalog_producer(ch)
            gen = r.pool.generation
            assert gen is not None
            gen.flush()
            await eventually(lambda: (h := m.mirror.hub_for(producer)) is not None
                             and h.sequence == gen.sequence, what="mirror caught up")  # fmt: skip
            req = sub_request(producer, "bytes")
            direct = RawStream(r.port, "SubscribeKvPool", req)
            via = RawStream(m.port, "SubscribeKvPool", req)
            try:
                await eventually(lambda: len(direct.frames) >= 2 and len(via.frames) >= 2,
                                 what="both snapshots")  # fmt: skip
                start = gen.sequence
                await r.engines[0].step(30)
                await eventually(lambda: in_sync(r.engines, r.relay), what="relay ingested")
                gen.flush()
                assert gen.sequence > start
                await eventually(
                    lambda: direct.last_sequence() == via.last_sequence() == gen.sequence,
                    what="both streams at the producer's sequence",
                )
            finally:
                await direct.close()
                await via.close()
            d = [parse_frame(f) for f in direct.frames]
            v = [parse_frame(f) for f in via.frames]
            assert [f.kind for f in d[:2]] == [f.kind for f in v[:2]] == [1, 1]
            for fd, fv, bd, bv in zip(d[:2], v[:2], direct.frames, via.frames, strict=False):
                assert fd.payload == fv.payload and fd.sequence == fv.sequence
                assert bd[: fd.prefix] == bv[: fv.prefix] and fd.prefix > 0
            deltas_d = {f.sequence: b for f, b in zip(d, direct.frames, strict=True) if f.kind == 2}
            deltas_v = {f.sequence: b for f, b in zip(v, via.frames, strict=True) if f.kind == 2}
            assert deltas_d and deltas_d == deltas_v  # byte for byte, send_ts_us included
            assert await relay_info_bytes(r.port) == await relay_info_bytes(m.port)
            for method, request in (
                ("WatchKvPoolCatalog", pb.WatchKvPoolCatalogRequest(
                    subscriber_id="c", contract_marker=MARKER)),
                ("SubscribeServingReadiness", pb.SubscribeServingReadinessRequest(
                    subscriber_id="r", contract_marker=MARKER)),
            ):  # fmt: skip
                a, b = RawStream(r.port, method, request), RawStream(m.port, method, request)
                await eventually(lambda a=a, b=b: bool(a.frames and b.frames), what=method)
                await a.close()
                await b.close()
                assert a.frames[0] == b.frames[0], method
            load = pb.SubscribeKvPoolLoadRequest(subscriber_id="l", contract_marker=MARKER)
            a, b = RawStream(r.port, "SubscribeKvPoolLoad", load), RawStream(
                m.port, "SubscribeKvPoolLoad", load
            )

            def windows(s: RawStream) -> dict[int, bytes]:
                return {parse_envelope(f).version: f for f in s.frames}

            await eventually(lambda: bool(windows(a).keys() & windows(b).keys()), what="load")
            await a.close()
            await b.close()
            common = windows(a).keys() & windows(b).keys()
            assert all(windows(a)[w] == windows(b)[w] for w in common)


async def test_replica_through_a_mirror_of_a_mirror_equals_the_producer() -> None:
    cfg = SimConfig(name="c0", seed=72, dp_size=2, capacity_blocks=96)
    async with rig([cfg]) as r:
        await wait_live(r.relay, 2)
        await r.engines[0].step(6)
        async with mirrored(r.port) as first, mirrored(first.port) as second:
            ch = second.channel()
            try:
                info = await relay_info(ch)
                assert info.relay is not None
                assert info.relay.relay_incarnation == r.relay.relay_incarnation
                consumer = Consumer(ch, await catalog_producer(ch), info.relay).start()
                await asyncio.wait_for(consumer.first.wait(), scaled(15))
                for _ in range(4):
                    await r.engines[0].step(5)
                    await asyncio.sleep(0.05)
                await verify(r, consumer, probes=5_000)
                await consumer.stop()
            finally:
                ch.close()


async def test_keys_the_mirror_does_not_hold_are_decided_upstream() -> None:
    """A pool the mirror's catalog does not list yet is served at once (the upstream said yes);
    an unknown or stale key gets exactly the upstream's error."""
    view = MemRelayView()
    up = RelayServer(view)
    await up.start("127.0.0.1", 0)
    try:
        async with mirrored(up.port) as m:
            gen = view.add_pool("pool-new", 1024)  # no await: the mirror has not seen it
            assert m.mirror.hub_for(gen.producer) is None
            ch = grpclib_channel(m.port)
            try:
                ok = await grpclib_collect(ch, "SubscribeKvPool", sub_request(gen.producer),
                                           pb.FilterUpdate, limit=1)  # fmt: skip
                assert ok.status is None and ok.messages[0].kind == 1
                fresh = view.replace(gen)  # the old stream ends; a racing request could
                await eventually(  # still be admitted and then end UNAVAILABLE, like directly
                    lambda: m.mirror.hub_for(fresh.producer) is not None
                    and m.mirror.hub_for(gen.producer) is None,
                    what="the mirror follows the replacement",
                )
                for producer, status, reason in (
                    (gen.producer, Status.FAILED_PRECONDITION, "PRODUCER_CHANGED"),
                    (S.producer(), Status.NOT_FOUND, "POOL_NOT_FOUND"),
                ):
                    r = await grpclib_collect(ch, "SubscribeKvPool", sub_request(producer),
                                              pb.FilterUpdate)  # fmt: skip
                    assert (r.status, r.trailers[K]) == (status, f"RELAY_ERROR_REASON_{reason}")
                assert m.mirror.hub_for(gen.producer) is None  # the stale probe left nothing
            finally:
                ch.close()
    finally:
        await up.close(grace_s=1.0)


@contextlib.asynccontextmanager
async def _pool_stream(ch: Channel) -> AsyncIterator[Any]:
    """A raw SubscribeKvPool stream of the scripted pool, its request sent (the stream's
    trailers stay readable after the block)."""
    async with ch.request(SVC + "SubscribeKvPool", Cardinality.UNARY_STREAM,
                          pb.SubscribeKvPoolRequest, pb.FilterUpdate) as st:  # fmt: skip
        await st.send_message(sub_request(S.producer()), end=True)
        yield st


async def test_heartbeats_only_while_the_upstream_shows_life() -> None:
    """Local heartbeats claim the stream is current: they stop 1.5 upstream heartbeat periods
    (+0.25 s) after the upstream's last frame, and the stream ends when the upstream has been
    silent for 3 periods."""
    relay = S.ScriptedRelay()  # snapshot, one delta, then silence (no upstream heartbeats)
    server = await S.serve(relay)
    limits = RelayLimits(pool_heartbeat_s=0.1)
    period = 0.6
    try:
        async with mirrored(S.port_of(server), limits=limits, upstream_heartbeat_s=period,
                            sync=False) as m:  # fmt: skip
            await eventually(lambda: (h := m.mirror.hub_for(S.producer())) is not None
                             and h.sequence == 11, what="upstream frames applied")  # fmt: skip
            loop = asyncio.get_running_loop()
            last_upstream = loop.time()  # no earlier than the upstream's last frame
            ch = m.channel()
            got: list[tuple[float, int]] = []
            try:
                async with asyncio.timeout(scaled(10)):
                    with contextlib.suppress(GRPCError):
                        async with _pool_stream(ch) as st:
                            while (fu := await st.recv_message()) is not None:
                                got.append((loop.time() - last_upstream, int(fu.kind)))
                    ended = loop.time() - last_upstream
                    trailers = dict(st.trailing_metadata or {})
            finally:
                ch.close()
    finally:
        server.close()
    beats = [t for t, kind in got if kind == 3]
    vouched = 1.5 * period + 0.25
    assert len(beats) >= 3, got
    # heartbeats would go on every 0.1 s until the end; scheduling slack of 0.3 s (on a quiet
    # machine) allowed
    assert max(beats) <= vouched + scaled(0.3), beats
    assert ended - max(beats) >= 0.25, (ended, beats)
    assert ended >= 3 * period - 0.5  # the end came from the upstream staying silent
    assert trailers.get(K) == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"


async def test_no_snapshot_of_state_the_upstream_stopped_vouching_for() -> None:
    """Past 1.5 upstream heartbeat periods of silence the mirror's heartbeats stop (nobody
    vouches for the state); a subscriber that joins then is not handed that state as a
    snapshot either: it waits for the upstream to show life, and gets PUBLICATION_UNAVAILABLE
    when its wait (``sync_wait_s``) runs out first. Only a snapshot of a later install (the
    silent stream ended and the pool subscribed again) may reach it."""
    relay = S.ScriptedRelay()  # snapshot, one delta, then silence (no upstream heartbeats)
    server = await S.serve(relay)
    period = 2.0  # vouched for 3.25 s after the last frame; the stream silent after 6 s
    try:
        async with mirrored(S.port_of(server), upstream_heartbeat_s=period, sync_wait_s=0.5,
                            sync=False) as m:  # fmt: skip
            await eventually(lambda: (h := m.mirror.hub_for(S.producer())) is not None
                             and h.sequence == 11, what="upstream frames applied")  # fmt: skip
            (pool,) = m.mirror._pools.values()
            await asyncio.sleep(1.5 * period + 0.25 + 0.5)  # past the vouch
            ch = m.channel()
            installs_at_first: int | None = None
            try:
                async with asyncio.timeout(scaled(10)):
                    with contextlib.suppress(GRPCError):
                        async with _pool_stream(ch) as st:
                            if await st.recv_message() is not None:
                                installs_at_first = pool.installs
                    trailers = dict(st.trailing_metadata or {})
            finally:
                ch.close()
    finally:
        server.close()
    if installs_at_first is None:
        assert trailers.get(K) == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE", trailers
    else:
        assert installs_at_first >= 2, "a snapshot of state nobody vouched for"


async def test_a_burst_of_upstream_deltas_does_not_lag_local_subscribers() -> None:
    """Deltas buffered upstream arrive back to back; the mirror lets its senders run before a
    local queue (4 frames here) can fill, so subscribers that read get every delta."""
    gate = asyncio.Event()
    burst = [S.delta(10 + i, 11 + i, buckets=(i % 64,), words=(i + 1,)) for i in range(60)]
    relay = S.ScriptedRelay()
    relay.scripts.append(S.Script(S.snapshot(10), gate=gate, after=burst, hold=True))
    server = await S.serve(relay)
    limits = RelayLimits(publication_queue_capacity=4)
    try:
        async with mirrored(S.port_of(server), limits=limits, sync=False) as m:
            chans = [m.channel() for _ in range(4)]
            try:
                installed = 0  # subscribers that have their snapshot: they read deltas now

                async def read(ch: Channel) -> int:
                    nonlocal installed
                    deltas = 0
                    async with ch.request(SVC + "SubscribeKvPool", Cardinality.UNARY_STREAM,
                                          pb.SubscribeKvPoolRequest, pb.FilterUpdate) as st:
                        await st.send_message(sub_request(S.producer()), end=True)
                        while (fu := await st.recv_message()) is not None:
                            deltas += int(fu.kind) == 2
                            installed += int(fu.kind) == 1
                            if fu.sequence == 70:
                                await st.cancel()
                                break
                    return deltas

                tasks = [asyncio.ensure_future(read(ch)) for ch in chans for _ in range(2)]
                # the burst once every subscriber has its snapshot: on a busy machine a snapshot
                # still being written when it comes has the deltas queue behind it (a joiner
                # catching up, which spacing is for), and 4 frames fill
                await eventually(lambda: installed == 8, what="8 subscribers with their snapshot")
                hub = m.mirror.hub_for(S.producer())
                gate.set()
                got = await asyncio.wait_for(asyncio.gather(*tasks), scaled(20))
                assert got == [60] * 8 and hub is not None and hub.lagged == 0
            finally:
                for ch in chans:
                    ch.close()
    finally:
        server.close()


async def test_a_stopped_mirror_still_counts_what_its_pools_did() -> None:
    """``Mirror.stop`` lets its pools go with their counters folded into the totals, once: a
    fan-out worker's last report may be taken after its stop, and a total that went down (or
    doubled) there would be wrong on ``/metrics``. And they go: the stop closes the upstream
    channel under a pool's open stream, whose end (a transport error) took the stop's
    cancellation, and the pool tried again for as long as the process ran (a worker's exit
    waited for it)."""
    relay = S.ScriptedRelay()  # a snapshot and one delta
    server = await S.serve(relay)
    try:
        async with mirrored(S.port_of(server), sync=False) as m:
            await eventually(lambda: (h := m.mirror.hub_for(S.producer())) is not None
                             and h.sequence == 11, what="upstream frames applied")  # fmt: skip
            before = m.mirror.stats()["pool_totals"]
            assert before["installs"] >= 1 and before["deltas"] >= 1, before
        after = m.mirror.stats()["pool_totals"]  # (the mirror is stopped)
        for _ in range(3):
            await asyncio.sleep(0)
        left = [t for t in asyncio.all_tasks()
                if t.get_name().startswith("kvrelay-mirror-pool") and not t.done()]  # fmt: skip
    finally:
        server.close()
    assert after == before
    assert not left, left
