"""Mirror fault matrix: upstream restart, fence, unreachable, lag, broken frames, mirror restart.

Every local stream ends with the status the contract gives for the case (§4.6), subscribers
resubscribe, and their replicas equal the producer's table and the simulator's ground truth.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.pool.pool import Pool
from kvrelay.sim.config import SimConfig
from tests.support import scripted_relay as S
from tests.support.mirror_rig import mirrored, start_mirror
from tests.support.rig import (
    MARKER,
    SVC,
    Consumer,
    catalog_producer,
    collect_end,
    eventually,
    relay_info,
    rig,
    start_relay,
    stop_relay,
    verify,
    wait_live,
)
from tests.support.timing import scaled

K = "kv-relay-error-reason"
UNAVAILABLE = "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"


async def through(ch: Any) -> Consumer:
    """A strict consumer of the single pool, catalog and identity read from ``ch``."""
    info = await relay_info(ch)
    assert info.relay is not None
    c = Consumer(ch, await catalog_producer(ch), info.relay).start()
    await asyncio.wait_for(c.first.wait(), scaled(15))
    return c


async def test_upstream_restart_ends_streams_cleanly_and_the_mirror_follows() -> None:
    cfg = SimConfig(name="u0", seed=81, dp_size=2, capacity_blocks=64)
    async with rig([cfg]) as r:
        await wait_live(r.relay, 2)
        await r.engines[0].step(8)
        port = r.port
        async with mirrored(port) as m:
            ch = m.channel()
            try:
                consumer = await through(ch)
                old = await relay_info(ch)
                await r.server.close(grace_s=1.0)
                await stop_relay(r.relay)
                end = await consumer.wait_end()
                assert end.status is None, "upstream shutdown: clean EOF, as directly"
                # while no upstream session exists the mirror refuses rather than guesses
                await eventually(lambda: not m.mirror.catalog.live, what="session lost")
                with pytest.raises(GRPCError) as ei:
                    await relay_info(ch)
                assert ei.value.status == Status.UNAVAILABLE
                await r.engines[0].step(4)
                r.relay, r.server = await start_relay(r.settings, port)
                await eventually(lambda: m.mirror.identity_changes == 1 and m.mirror.catalog.live,
                                 what="new identity, catalog stream up")  # fmt: skip
                info = await relay_info(ch)
                assert info.relay is not None and old.relay is not None
                assert info.relay.relay_incarnation == r.relay.relay_incarnation
                assert info.relay.relay_incarnation != old.relay.relay_incarnation
                await wait_live(r.relay, 2)
                await catalog_producer(ch)  # the new generation is listed: a stale key is
                _m, stale = await collect_end(  # PRODUCER_CHANGED (before: POOL_NOT_FOUND)
                    ch, "SubscribeKvPool",
                    pb.SubscribeKvPoolRequest(subscriber_id="stale",
                                              expected_producer=consumer.producer,
                                              contract_marker=MARKER),
                    pb.FilterUpdate,
                )  # fmt: skip
                assert stale.reason == "RELAY_ERROR_REASON_PRODUCER_CHANGED"
                again = await through(ch)
                await r.engines[0].step(6)
                await verify(r, again, probes=5_000)
                await again.stop()
            finally:
                ch.close()


async def test_upstream_fence_forwards_publication_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = SimConfig(name="u1", seed=82, capacity_blocks=128)
    async with rig([cfg]) as r:
        await wait_live(r.relay, 1)
        await r.engines[0].step(6)
        async with mirrored(r.port) as m:
            ch = m.channel()
            try:
                consumer = await through(ch)
                real = Pool.apply

                def broken(self: Pool, member: int, batch: Any) -> Any:
                    monkeypatch.setattr(Pool, "apply", real)
                    raise MemoryError("injected")

                monkeypatch.setattr(Pool, "apply", broken)
                await r.engines[0].step(3)
                end = await consumer.wait_end()
                assert end.status == Status.UNAVAILABLE and end.reason == UNAVAILABLE
                assert "fenced" in (end.message or ""), "the upstream's own message is forwarded"
                await wait_live(r.relay, 1)
                await eventually(lambda: r.pool.generation is not None
                                 and m.mirror.hub_for(r.pool.generation.producer) is not None,
                                 what="mirror holds the rebuilt generation")  # fmt: skip
                again = await through(ch)
                assert again.producer.layout_generation > consumer.producer.layout_generation
                await r.engines[0].step(3)
                await verify(r, again, probes=5_000)
                await again.stop()
            finally:
                ch.close()


async def test_mirror_restart_on_the_same_port() -> None:
    cfg = SimConfig(name="u2", seed=83, dp_size=2, capacity_blocks=64)
    async with rig([cfg]) as r:
        await wait_live(r.relay, 2)
        await r.engines[0].step(5)
        m = await start_mirror(r.port)
        port = m.port
        ch = m.channel()
        consumer = await through(ch)
        await m.close()
        end = await consumer.wait_end()
        assert end.status is None, "a mirror that shuts down ends its streams with a clean EOF"
        ch.close()
        await r.engines[0].step(5)
        m = await start_mirror(r.port, port=port)
        ch = m.channel()
        try:
            again = await through(ch)
            await r.engines[0].step(5)
            await verify(r, again, probes=5_000)
            await again.stop()
        finally:
            ch.close()
            await m.close()


async def test_unreachable_upstream_refuses_every_rpc_with_a_status() -> None:
    relay = S.ScriptedRelay()
    server = await S.serve(relay)
    port = S.port_of(server)
    server.close()
    await server.wait_closed()
    m = await start_mirror(port, sync=False)
    ch = m.channel()
    try:
        with pytest.raises(GRPCError) as ei:
            await relay_info(ch)
        assert ei.value.status == Status.UNAVAILABLE
        for method, request, reply in (
            ("WatchKvPoolCatalog", pb.WatchKvPoolCatalogRequest(subscriber_id="c",
                                                                contract_marker=MARKER),
             pb.KvPoolCatalogUpdate),
            ("SubscribeKvPool", pb.SubscribeKvPoolRequest(subscriber_id="p",
                                                          expected_producer=S.producer(),
                                                          contract_marker=MARKER),
             pb.FilterUpdate),
        ):  # fmt: skip
            msgs, end = await collect_end(ch, method, request, reply)
            assert not msgs and end.status == Status.UNAVAILABLE and end.reason == UNAVAILABLE
    finally:
        ch.close()
        await m.close()


async def _one_stream(ch: Any) -> tuple[list[Any], Any]:
    """Subscribe the scripted pool through the mirror; returns (frames, end)."""
    req = pb.SubscribeKvPoolRequest(
        subscriber_id="m", expected_producer=S.producer(), contract_marker=MARKER
    )
    return await collect_end(ch, "SubscribeKvPool", req, pb.FilterUpdate)


@pytest.mark.parametrize(
    "end,status,reason,message",
    [
        ((Status.RESOURCE_EXHAUSTED, "SUBSCRIBER_LAGGED"), Status.UNAVAILABLE,
         "PUBLICATION_UNAVAILABLE", "fell behind"),
        ((Status.UNAVAILABLE, "PUBLICATION_UNAVAILABLE"), Status.UNAVAILABLE,
         "PUBLICATION_UNAVAILABLE", "PUBLICATION_UNAVAILABLE"),
        ((Status.INTERNAL, "INTERNAL"), Status.INTERNAL, "INTERNAL", "INTERNAL"),
        (None, None, None, None),
    ],
)  # fmt: skip
async def test_upstream_stream_endings_map_to_local_ones(
    end: tuple[Status, str] | None, status: Status | None, reason: str | None,
    message: str | None,
) -> None:  # fmt: skip
    gate = asyncio.Event()
    relay = S.ScriptedRelay()
    relay.scripts.append(S.Script(S.snapshot(10), end=end, gate=gate, after=[S.delta(10, 11)]))
    server = await S.serve(relay)
    try:
        async with mirrored(S.port_of(server), sync=False) as m:
            ch = m.channel()
            try:
                task = asyncio.ensure_future(_one_stream(ch))
                await eventually(lambda: (h := m.mirror.hub_for(S.producer())) is not None
                                 and h.subscriber_count == 1, what="local subscriber")  # fmt: skip
                gate.set()
                frames, got = await asyncio.wait_for(task, scaled(10))
                # frames queued when a stream fails are dropped, directly too (§4.6): on a busy
                # machine the snapshot itself may still be queued when the end comes
                assert [int(f.kind) for f in frames] in ([], [1], [1, 2])
                assert got.status == status
                assert got.reason == (None if reason is None else f"RELAY_ERROR_REASON_{reason}")
                if message is not None:
                    assert message in (got.message or "")
                # the mirror resubscribes (the default script) and serves the next subscriber
                await next_subscriber_reaches(ch, 11)
            finally:
                ch.close()
    finally:
        server.close()


@pytest.mark.parametrize("behind", ["SUBSCRIBER_LAGGED", "SNAPSHOT_PROGRESS_TIMEOUT"])
async def test_an_upstream_ending_the_sync_as_behind_refuses_waiting_subscribers_unavailable(
    behind: str,
) -> None:
    """The upstream ends the mirror's stream before its snapshot is whole, for the mirror's own
    slowness: a local subscriber waiting for the sync gets PUBLICATION_UNAVAILABLE, as a stream
    the mirror serves would, never the upstream's lag reason (it would blame the local client,
    which has not been sent a byte)."""
    gate = asyncio.Event()
    relay = S.ScriptedRelay()
    relay.scripts.append(S.Script([], gate=gate, end=(Status.RESOURCE_EXHAUSTED, behind)))
    server = await S.serve(relay)
    try:
        async with mirrored(S.port_of(server), sync=False) as m:
            ch = m.channel()
            try:
                await eventually(lambda: m.mirror.catalog.live, what="upstream session")
                task = asyncio.ensure_future(_one_stream(ch))
                await eventually(lambda: any(p._waiting for p in m.mirror._pools.values()),
                                 what="a local subscriber waits for the sync")  # fmt: skip
                gate.set()
                frames, got = await asyncio.wait_for(task, scaled(10))
                assert not frames and got.status == Status.UNAVAILABLE, (got.status, got.reason)
                assert got.reason == UNAVAILABLE and "fell behind" in (got.message or "")
                await eventually(lambda: m.mirror.hub_for(S.producer()) is not None,
                                 what="the next attempt live")  # fmt: skip
                await next_subscriber_reaches(ch, 11)
            finally:
                ch.close()
    finally:
        server.close()


async def next_subscriber_reaches(ch: Any, sequence: int) -> list[Any]:
    """A new subscriber through the mirror gets a snapshot, then frames up to ``sequence``."""
    out: list[Any] = []
    req = pb.SubscribeKvPoolRequest(
        subscriber_id="next", expected_producer=S.producer(), contract_marker=MARKER
    )
    async with asyncio.timeout(scaled(10)):
        async with ch.request(SVC + "SubscribeKvPool", Cardinality.UNARY_STREAM,
                              pb.SubscribeKvPoolRequest, pb.FilterUpdate) as st:  # fmt: skip
            await st.send_message(req, end=True)
            while not out or out[-1].sequence < sequence:
                out.append(await st.recv_message())
            await st.cancel()
    assert int(out[0].kind) == 1 and all(int(f.kind) == 2 for f in out[1:])
    return out


@pytest.mark.parametrize(
    "bad,rule",
    [
        (S.corrupt_checksum(S.delta(10, 11)), "cbi1_checksum_mismatch"),
        (S.delta(11, 12), "sequence_gap"),
        (S.delta(10, 12), "bad_increment"),
        (S.frame(2, 10, 11, S.delta(10, 11).payload, relay=S.OTHER_RELAY),
         "relay_identity_changed"),
        (S.frame(2, 10, 11, S.delta(10, 11).payload, prod=S.producer(layout_generation=2)),
         "producer_identity"),
        (S.delta(10, 11, dc_id=5), "dc_id_mismatch"),
        (S.heartbeat(9), "heartbeat_sequence"),
        (S.frame(9, 10, 10, b""), "unknown_kind"),
    ],
)  # fmt: skip
async def test_a_frame_breaking_a_consumer_rule_is_never_served(bad: Any, rule: str) -> None:
    """The mirror checks like a strict consumer: the bad frame is not forwarded, its local
    subscribers end with PUBLICATION_UNAVAILABLE, the violation is counted, the next
    subscription is clean."""
    gate = asyncio.Event()
    relay = S.ScriptedRelay()
    relay.scripts.append(S.Script(S.snapshot(10), gate=gate, after=[bad], hold=True))
    server = await S.serve(relay)
    try:
        async with mirrored(S.port_of(server), sync=False) as m:
            ch = m.channel()
            try:
                task = asyncio.ensure_future(_one_stream(ch))
                await eventually(lambda: (h := m.mirror.hub_for(S.producer())) is not None
                                 and h.subscriber_count == 1, what="local subscriber")  # fmt: skip
                gate.set()
                frames, got = await asyncio.wait_for(task, scaled(10))
                # the snapshot went out, or the end overtook it on a busy machine (the pool ended
                # before the subscriber's writer ran); never anything after it
                assert [int(f.kind) for f in frames] in ([1], []), "nothing after the snapshot"
                assert got.status == Status.UNAVAILABLE and got.reason == UNAVAILABLE
                assert rule in (got.message or "")
                totals = m.mirror.stats()["pool_totals"]
                assert totals.get(f"violation_{rule}") == 1, totals
                await next_subscriber_reaches(ch, 11)
            finally:
                ch.close()
    finally:
        server.close()


async def test_a_failure_inside_the_mirror_ends_the_pool_with_a_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever raises while a delta is applied (here: the hub), the pool's local subscribers
    end with PUBLICATION_UNAVAILABLE, it is counted, and the pool is mirrored again."""
    from kvrelay.publication.hub import PublicationHub

    real = PublicationHub.publish_encoded

    def broken(self: PublicationHub, *a: Any) -> None:
        monkeypatch.setattr(PublicationHub, "publish_encoded", real)
        raise RuntimeError("injected")

    gate = asyncio.Event()
    relay = S.ScriptedRelay()
    relay.scripts.append(S.Script(S.snapshot(10), gate=gate, after=[S.delta(10, 11)], hold=True))
    server = await S.serve(relay)
    try:
        async with mirrored(S.port_of(server), sync=False) as m:
            ch = m.channel()
            try:
                task = asyncio.ensure_future(_one_stream(ch))
                await eventually(lambda: (h := m.mirror.hub_for(S.producer())) is not None
                                 and h.subscriber_count == 1, what="local subscriber")  # fmt: skip
                monkeypatch.setattr(PublicationHub, "publish_encoded", broken)
                gate.set()
                _frames, got = await asyncio.wait_for(task, scaled(10))
                assert got.status == Status.UNAVAILABLE and got.reason == UNAVAILABLE
                assert "RuntimeError" in (got.message or "")
                assert m.mirror.stats()["pool_totals"].get("end_internal") == 1
                await next_subscriber_reaches(ch, 11)
            finally:
                ch.close()
    finally:
        server.close()


async def test_a_quiet_readiness_plane_is_not_taken_for_a_silent_upstream() -> None:
    """The upstream re-sends an unchanged readiness plane every ``readiness_heartbeat_s``; with a
    pool heartbeat far shorter (a worker takes both from one config), the readiness stream is
    silent only after 3 readiness periods, not 3 pool heartbeats: it is never dropped while the
    upstream keeps its period."""
    from kvrelay.contract.limits import RelayLimits
    from kvrelay.service.server import RelayServer
    from tests.support.mem_relay import MemRelayView

    limits = RelayLimits(readiness_heartbeat_s=1.5)
    view = MemRelayView(limits)
    view.add_pool("p", 1024)
    upstream = RelayServer(view, limits)
    await upstream.start("127.0.0.1", 0)
    try:
        async with mirrored(upstream.port, upstream_heartbeat_s=0.3,
                            upstream_readiness_s=1.5) as m:  # fmt: skip
            await asyncio.sleep(2.0)  # more than 3 pool heartbeats (0.9 s), and one re-send
            assert m.mirror.plane_ends.get("readiness_silent", 0) == 0, m.mirror.plane_ends
            # (on a starved machine the pool heartbeats' 0.9 s bound may drop the connection,
            # which ends the plane as a connection end, not as silent: live again after it)
            await eventually(lambda: m.mirror.readiness.live, what="the readiness plane live")
    finally:
        await upstream.close(grace_s=1.0)


async def test_a_window_plane_is_silent_only_after_three_of_its_stated_windows() -> None:
    """A load window plane whose updates state 4 s windows (``window_ms``): the mirror waits
    three of them, from the first update on, before it calls the upstream silent. It waited 3 s
    whatever the windows, so a relay with longer windows had every mirror (every fan-out worker)
    end its local load and serving-load streams UNAVAILABLE after each first window."""
    from kvrelay.service.server import RelayServer
    from tests.support.mem_relay import MemRelayView

    view = MemRelayView()
    view.add_pool("p", 1024)

    def window(n: int) -> None:
        msg = view.load_msg(n)
        msg.window_ms = 4000
        view.load.publish(msg, n)

    window(1)
    upstream = RelayServer(view)
    await upstream.start("127.0.0.1", 0)
    try:
        async with mirrored(upstream.port, upstream_heartbeat_s=0.2) as m:
            await asyncio.sleep(4.0)  # past 3 s, within three stated windows
            window(2)
            # (the plane's own version: ``current`` refuses while the mirror is out of session,
            # as this rig's channel is replaced each time its pool stream goes quiet)
            await eventually(lambda: m.mirror.load.upstream_version == 2,
                             what="window 2 forwarded")  # fmt: skip
            assert m.mirror.plane_ends.get("load_silent", 0) == 0, m.mirror.plane_ends
    finally:
        await upstream.close(grace_s=1.0)


class _Beating(S.ScriptedRelay):
    """Scripted streams first; then healthy ones: a snapshot, a delta, a heartbeat each second."""

    async def _pool(self, stream: Any) -> None:
        if self.scripts:
            await super()._pool(stream)
            return
        await stream.recv_message()
        self.subscriptions += 1
        for fu in [*S.snapshot(10), S.delta(10, 11)]:
            await stream.send_message(fu)
        while True:
            await asyncio.sleep(1.0)
            await stream.send_message(S.heartbeat(11))


async def test_a_heartbeat_delivered_with_its_delta_teaches_no_wrong_period() -> None:
    """A delta and the heartbeat its upstream sent a period later reach the mirror together (a
    stalled network or loop), then that stream ends. The mirror learned the period from the
    arrivals (nothing: 0.05 s) and kept it: every later stream of the pool was called silent
    after 0.15 s, its local subscribers ended UNAVAILABLE each time. The period comes from the
    upstream's send stamps, and each stream starts from the configured one."""
    relay = _Beating()
    d, hb = S.delta(10, 11), S.heartbeat(11)
    d.send_ts_us, hb.send_ts_us = 5_000_000, 6_000_000  # sent a period (1 s) apart
    relay.scripts.append(S.Script([*S.snapshot(10), d, hb],
                                  end=(Status.RESOURCE_EXHAUSTED, "SUBSCRIBER_LAGGED")))
    server = await S.serve(relay)
    try:
        async with mirrored(S.port_of(server), sync=False, upstream_heartbeat_s=1.0) as m:
            await eventually(lambda: relay.subscriptions >= 2, what="subscribed again")
            await asyncio.sleep(1.5)  # ten times the wrong period's silence (0.15 s)
            (pool,) = m.mirror._pools.values()
            assert pool.ends.get("silent", 0) == 0, dict(pool.ends)
            assert relay.subscriptions == 2
            assert pool._heartbeat_s == 1.0
    finally:
        server.close()


async def test_an_upstream_plane_ending_internal_reaches_the_mirrors_readers_as_is() -> None:
    """An upstream plane stream that ends INTERNAL (a fault injected in the upstream's view):
    the mirror's readers get the status, reason and message a direct reader gets (contract
    §4.9). It was rewritten to UNAVAILABLE / PUBLICATION_UNAVAILABLE."""
    from kvrelay.service.server import RelayServer
    from tests.support.mem_relay import MARKER, MemRelayView, grpclib_collect
    from tests.support.mirror_rig import UPSTREAM_LIMITS

    view = MemRelayView(UPSTREAM_LIMITS)
    view.add_pool("p", 1024)
    boom = asyncio.Event()

    async def broken(_version: int) -> Any:
        await boom.wait()
        raise RuntimeError("injected upstream fault")

    view.readiness.wait_newer = broken  # type: ignore[method-assign]
    upstream = RelayServer(view, UPSTREAM_LIMITS)
    await upstream.start("127.0.0.1", 0)
    try:
        async with mirrored(upstream.port) as m:
            request = pb.SubscribeServingReadinessRequest(subscriber_id="r",
                                                          contract_marker=MARKER)  # fmt: skip
            direct, through = Channel("127.0.0.1", upstream.port), m.channel()
            try:
                ends = [asyncio.ensure_future(grpclib_collect(
                    ch, "SubscribeServingReadiness", request, pb.ServingReadinessUpdate,
                    limit=100, timeout=10,
                )) for ch in (direct, through)]  # fmt: skip
                await asyncio.sleep(0.5)
                boom.set()
                d, t = [await e for e in ends]
            finally:
                direct.close()
                through.close()
        assert d.status == Status.INTERNAL
        assert (t.status, t.message) == (d.status, d.message)
        assert t.trailers["kv-relay-error-reason"] == d.trailers["kv-relay-error-reason"]
    finally:
        await upstream.close(grace_s=1.0)


async def test_a_frozen_load_plane_is_silent_after_three_windows_whatever_the_heartbeat() -> None:
    """The upstream's load plane stops producing windows (1 s each), its stream open. A mirror
    with the default pool heartbeat (10 s; a worker's is its daemon's) served the last window
    as current for 30 s; it is silent after three windows."""
    import time

    from kvrelay.service.server import RelayServer
    from tests.support.mem_relay import MemRelayView
    from tests.support.mirror_rig import UPSTREAM_LIMITS

    view = MemRelayView(UPSTREAM_LIMITS)
    view.add_pool("p", 1024)
    view.load.publish(view.load_msg(1), 1)  # window_ms = 1000, and no window after it
    upstream = RelayServer(view, UPSTREAM_LIMITS)
    await upstream.start("127.0.0.1", 0)
    try:
        async with mirrored(upstream.port, upstream_heartbeat_s=10.0) as m:
            t0 = time.monotonic()
            await eventually(lambda: m.mirror.plane_ends.get("load_silent", 0) >= 1,
                             timeout=15, what="load plane silent")  # fmt: skip
            assert time.monotonic() - t0 < scaled(6.0)
    finally:
        await upstream.close(grace_s=1.0)


async def test_a_mirror_leaves_a_black_holed_upstream_connection() -> None:
    """The mirror's upstream connection is cut and its reconnection lands in a black hole
    (accepted, never forwarded) until the network heals. Every stream on it went silent and
    was opened again on the same dead connection until grpclib's keepalive closed it (a ping
    20 s in, then one per 300 s): the mirror stayed without its upstream that long. A catalog
    stream without a first message on a channel that received nothing that long replaces the
    channel: the mirror is synchronized again within a few of those bounds."""
    from kvrelay.contract.limits import RelayLimits
    from tests.support.client_stack import stack
    from tests.support.faulty_proxy import FaultyProxy

    period = 0.3
    limits = RelayLimits(pool_heartbeat_s=period, readiness_heartbeat_s=period)
    configs = [SimConfig(name="bh0", seed=3, dp_size=1, capacity_blocks=64)]
    async with stack(configs, limits, expected_blocks=1024) as st:
        proxy = await FaultyProxy("127.0.0.1", st.port).start()
        m = await start_mirror(proxy.port, upstream_heartbeat_s=period,
                               upstream_readiness_s=period)  # fmt: skip
        try:
            resets = m.mirror.upstream.resets
            proxy.blackhole = True
            proxy.cut(rst=True)
            await eventually(lambda: not m.mirror.catalog.live, what="session lost")
            await asyncio.sleep(3 * period + 0.5)  # past the catalog's first-message bound
            proxy.heal()
            await eventually(lambda: m.mirror.catalog.live and m.mirror.upstream.resets > resets,
                             timeout=8, what="a new channel, the session back")  # fmt: skip
        finally:
            await m.close()
            await proxy.close()


async def test_a_mirror_leaves_an_upstream_connection_that_died_with_tcp_up() -> None:
    """A live upstream connection stops carrying anything towards the mirror for good while
    TCP stays up (connections made later work). Its pool stream ends silent and was opened
    again on the same dead connection until grpclib's keepalive closed it (minutes): the
    mirror's pool stayed unavailable that long. A pool stream ending silent on a channel that
    received nothing that long now replaces the channel: the pool is live again at the
    upstream's sequence."""
    from kvrelay.contract.limits import RelayLimits
    from tests.support.client_stack import stack
    from tests.support.faulty_proxy import DOWN, FaultyProxy

    period = 0.3
    limits = RelayLimits(pool_heartbeat_s=period, readiness_heartbeat_s=period)
    configs = [SimConfig(name="dd0", seed=4, dp_size=1, capacity_blocks=64)]
    async with stack(configs, limits, expected_blocks=1024) as st:
        relay = st.relay
        assert relay is not None
        await eventually(lambda: relay.pools[0].generation is not None, what="generation")
        gen = relay.pools[0].generation
        assert gen is not None
        proxy = await FaultyProxy("127.0.0.1", st.port).start()
        m = await start_mirror(proxy.port, upstream_heartbeat_s=period,
                               upstream_readiness_s=period)  # fmt: skip
        try:
            await st.engines[0].step(4)
            resets = m.mirror.upstream.resets
            proxy.stall_open(DOWN)  # for good: only a new connection flows
            before = gen.hub().sequence
            await st.engines[0].step(4)
            await eventually(lambda: gen.hub().sequence > before, what="the upstream moved on")
            target = gen.hub().sequence

            def caught_up() -> bool:
                hub = m.mirror.hub_for(gen.producer)
                return hub is not None and hub.sequence >= target

            await eventually(lambda: m.mirror.upstream.resets > resets and caught_up(),
                             timeout=8, what="a new channel, the pool caught up")  # fmt: skip
        finally:
            await m.close()
            await proxy.close()
