"""A plane stream, a health ``Watch`` or a ``GetRelayInfo`` reply blocked in a send when it ends.

The same rule as a pool stream's (``test_blocked_sends.py``): HTTP/2 flow control holds DATA,
never HEADERS, so a stream whose send has written nothing of its message yet ends with its
trailers at once, however little its client reads, whatever ends it: a drain, a preemption, a
lag, its plane losing its source. One that has written part of a message finishes it when its
client reads again, then ends with its status.

A raw HTTP/2 client over loopback advertises a zero (or tiny) stream window and never gives any
back, so the relay's sends wait for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest
from grpclib.const import Cardinality
from grpclib.exceptions import GRPCError

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.errors import RelayError
from kvrelay.contract.limits import RelayLimits
from kvrelay.contract.wire import CONTRACT_MARKER
from kvrelay.mirror.plane import MirrorPlane
from kvrelay.service import server as server_module
from kvrelay.service.server import RelayServer
from tests.support.fleet import eventually
from tests.support.h2_client import RawH2Client, RawStream, plane_request
from tests.support.mem_relay import MARKER, SVC, MemRelayView, grpclib_channel, sub_request
from tests.support.timing import scaled

KINDS = {
    "catalog": "WatchKvPoolCatalog",
    "readiness": "SubscribeServingReadiness",
    "load": "SubscribeKvPoolLoad",
    "serving_load": "SubscribeServingLoad",
}
OK = ("0", None)
UNAVAILABLE = ("14", "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE")
LAGGED = ("8", "RELAY_ERROR_REASON_SUBSCRIBER_LAGGED")
LIMIT = ("8", "RELAY_ERROR_REASON_RESOURCE_LIMIT")
_SERVICE = b"dynamo.kvrelay.v1.KvEventRelay"
HEALTH_CHECK = b"\n" + bytes([len(_SERVICE)]) + _SERVICE  # HealthCheckRequest{service}
WATCH = "/grpc.health.v1.Health/Watch"
INFO = bytes(pb.RelayInfoRequest(contract_marker=CONTRACT_MARKER))


async def _relay(**limits_kw: Any) -> tuple[MemRelayView, RelayServer]:
    limits = RelayLimits(stalled_stream_reset_s=120.0, **limits_kw)
    view = MemRelayView(limits)
    view.add_pool("pool-a", 1024)
    server = RelayServer(view, limits)
    await server.start("127.0.0.1", 0)
    return view, server


async def _blocked(c: RawH2Client, method: str, request: bytes) -> RawStream:
    """A stream whose first message waits for a window: its HEADERS came, none of its DATA."""
    st = c.open(method, request)
    await eventually(lambda: ":status" in st.headers)
    await asyncio.sleep(0.1)
    assert not st.data and not st.ended.is_set()
    return st


async def _ended(st: RawStream, expected: tuple[str, str | None]) -> None:
    await asyncio.wait_for(st.ended.wait(), scaled(10))
    assert (st.status, st.reason) == expected and not st.reset, (st.trailers, st.reset)


async def _close(server: RelayServer, closing: asyncio.Future[None] | None) -> None:
    if closing is not None:
        await asyncio.wait_for(closing, scaled(10))
    else:
        await server.close(grace_s=1.0)


@pytest.mark.parametrize("kind", list(KINDS))
async def test_a_drain_ends_a_plane_stream_waiting_for_a_window_at_once(kind: str) -> None:
    """With a grace of minutes, a plane stream whose message waits for a window the client never
    opens ends OK at once, and the drain does not wait for it."""
    _view, server = await _relay()
    c = await RawH2Client.connect(server.port, window=0)
    closing: asyncio.Future[None] | None = None
    try:
        st = await _blocked(c, KINDS[kind], plane_request())
        closing = asyncio.ensure_future(server.close(grace_s=120.0))
        await _ended(st, OK)
        assert not st.data
        await asyncio.wait_for(asyncio.shield(closing), scaled(10))
    finally:
        await c.close()
        await _close(server, closing)


@pytest.mark.parametrize("kind", ["catalog", "load"])
async def test_a_plane_stream_losing_its_source_while_blocked_ends_at_once(kind: str) -> None:
    """A mirror's plane whose upstream stream fails ends its readers with that status, and one
    whose upstream ended cleanly ends them OK, while their message waits for a window."""
    view, server = await _relay()
    planes = {}
    for name in ("failed", "clean"):
        plane = MirrorPlane(kind)
        plane.offer(0, bytes(view.catalog.current()[1] if kind == "catalog" else
                             view.load.current()[1]))  # fmt: skip
        planes[name] = plane
    enc = server.service._catalog if kind == "catalog" else server.service._load
    c = await RawH2Client.connect(server.port, window=0)
    try:
        enc.plane = planes["failed"]
        failed = await _blocked(c, KINDS[kind], plane_request("a"))
        enc.plane = planes["clean"]
        clean = await _blocked(c, KINDS[kind], plane_request("b"))
        planes["failed"].end(RelayError.publication_unavailable("upstream gone"))
        planes["clean"].end(None)
        await _ended(failed, UNAVAILABLE)
        await _ended(clean, OK)
    finally:
        await c.close()
        await server.close(grace_s=1.0)


async def test_a_closed_plane_ends_its_blocked_stream_at_once() -> None:
    view, server = await _relay()
    c = await RawH2Client.connect(server.port, window=0)
    try:
        st = await _blocked(c, KINDS["readiness"], plane_request())
        view.readiness.close()
        await _ended(st, UNAVAILABLE)
    finally:
        await c.close()
        await server.close(grace_s=1.0)


@pytest.mark.parametrize("kind", ["load", "serving_load"])
async def test_a_load_stream_blocked_past_its_lag_bound_ends_lagged_at_once(kind: str) -> None:
    """Windows published while the first waits for a window, more than
    ``load_fanout_capacity`` past it: SUBSCRIBER_LAGGED, without waiting for the client."""
    view, server = await _relay(load_fanout_capacity=2)
    c = await RawH2Client.connect(server.port, window=0)
    try:
        st = await _blocked(c, KINDS[kind], plane_request())
        plane = view.load if kind == "load" else view.serving_load
        make = view.load_msg if kind == "load" else view.serving_load_msg
        for w in range(1, 3):  # within the bound: nothing ends
            plane.publish(make(w), w)  # type: ignore[arg-type]
        await asyncio.sleep(0.2)
        assert not st.ended.is_set()
        plane.publish(make(3), 3)  # type: ignore[arg-type]
        await _ended(st, LAGGED)
    finally:
        await c.close()
        await server.close(grace_s=1.0)


async def test_a_preempted_plane_stream_waiting_for_a_window_ends_at_once() -> None:
    """The newest catalog stream of a client over its share makes room for another client at
    once, though its message waits for a window."""
    _view, server = await _relay(max_catalog_subscribers=2, stream_share_per_connection_percent=50)
    hog = await RawH2Client.connect(server.port, window=0)
    other = await RawH2Client.connect(server.port, "127.0.0.2")
    try:
        held = [await _blocked(hog, KINDS["catalog"], plane_request(f"h{i}")) for i in range(2)]
        newcomer = other.open(KINDS["catalog"], plane_request("n"))
        await eventually(lambda: len(newcomer.data) > 0)
        await _ended(held[1], LIMIT)
        assert not held[0].ended.is_set()
    finally:
        await hog.close()
        await other.close()
        await server.close(grace_s=1.0)


async def test_a_half_written_plane_message_is_finished_before_the_drain_ends_it() -> None:
    """A catalog message partly written when the drain starts: no trailers while the client
    does not read (they would read as the message's rest), then the message whole and OK."""
    _view, server = await _relay()
    c = await RawH2Client.connect(server.port, window=16)
    closing: asyncio.Future[None] | None = None
    try:
        st = c.open(KINDS["catalog"], plane_request())
        await eventually(lambda: len(st.data) == 16)
        closing = asyncio.ensure_future(server.close(grace_s=120.0))
        await asyncio.sleep(0.3)
        assert not st.ended.is_set() and not st.reset
        c.start_reading()
        await _ended(st, OK)
        size = int.from_bytes(st.data[1:5], "big")
        assert len(st.data) == 5 + size
        pb.KvPoolCatalogUpdate.parse(bytes(st.data[5:]))
    finally:
        await c.close()
        await _close(server, closing)


async def test_a_drain_ends_a_health_watch_waiting_for_a_window_at_once() -> None:
    _view, server = await _relay()
    c = await RawH2Client.connect(server.port, window=0)
    closing: asyncio.Future[None] | None = None
    try:
        st = await _blocked(c, WATCH, HEALTH_CHECK)
        closing = asyncio.ensure_future(server.close(grace_s=120.0))
        await _ended(st, OK)
        await asyncio.wait_for(asyncio.shield(closing), scaled(10))
    finally:
        await c.close()
        await _close(server, closing)


async def test_a_drain_ends_a_relay_info_reply_waiting_for_a_window_with_a_status() -> None:
    """A ``GetRelayInfo`` reply that waits for a window when the drain starts is refused as a
    call during the drain is (UNAVAILABLE), not cut without a status by the close."""
    _view, server = await _relay()
    c = await RawH2Client.connect(server.port, window=0)
    closing: asyncio.Future[None] | None = None
    try:
        st = await _blocked(c, "GetRelayInfo", INFO)
        closing = asyncio.ensure_future(server.close(grace_s=120.0))
        await _ended(st, UNAVAILABLE)
        assert not st.data
    finally:
        await c.close()
        await _close(server, closing)


async def test_a_stalled_plane_stream_ends_lagged_or_is_reset_mid_message() -> None:
    """A client that takes no message for ``stalled_stream_reset_s``: with nothing of the
    message written the stream ends ``SUBSCRIBER_LAGGED`` (trailers need no window); with part
    of it written (trailers would read as its rest) it is reset. Both are counted as stalls."""
    limits = RelayLimits(stalled_stream_reset_s=0.5)
    view = MemRelayView(limits)
    view.add_pool("pool-a", 1024)
    server = RelayServer(view, limits)
    await server.start("127.0.0.1", 0)
    nothing = await RawH2Client.connect(server.port, window=0)
    part = await RawH2Client.connect(server.port, window=16)
    try:
        a = nothing.open(KINDS["catalog"], plane_request("a"))
        b = part.open(KINDS["catalog"], plane_request("b"))
        await _ended(a, LAGGED)
        assert not a.reset and not a.data
        await asyncio.wait_for(b.ended.wait(), scaled(10))
        assert b.reset and len(b.data) == 16 and b.status is None
        assert server.service.stalled_resets.get("catalog") == 2
    finally:
        await nothing.close()
        await part.close()
        await server.close(grace_s=1.0)


async def test_a_fenced_pool_stream_ends_after_the_catalog_reaches_every_watcher_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool stream that ends with an error waits until every catalog stream has handed the
    catalog without its pool to its transport: a watcher on the pool stream's connection reads
    the withdrawal before the stream's status. A catalog client that reads nothing (its message
    waits for a window) holds the end for ``CATALOG_FIRST_S`` at most, counted."""
    monkeypatch.setattr(server_module, "CATALOG_FIRST_S", 0.3)
    view, server = await _relay()
    gen = view.pools[next(iter(view.pools))]
    stalled = await RawH2Client.connect(server.port, window=0)
    ch = grpclib_channel(server.port)
    order: list[str] = []
    try:
        blocked = await _blocked(stalled, KINDS["catalog"], plane_request("stalled"))
        watching = ch.request(SVC + "WatchKvPoolCatalog", Cardinality.UNARY_STREAM,
                              pb.WatchKvPoolCatalogRequest, pb.KvPoolCatalogUpdate)  # fmt: skip
        pool = ch.request(SVC + "SubscribeKvPool", Cardinality.UNARY_STREAM,
                          pb.SubscribeKvPoolRequest, pb.FilterUpdate)  # fmt: skip
        took = -1.0
        watch_request = pb.WatchKvPoolCatalogRequest(subscriber_id="w", contract_marker=MARKER)
        with contextlib.suppress(GRPCError):  # (the pool stream's exit re-raises its status)
            async with watching, pool:
                await watching.send_message(watch_request, end=True)
                first = await watching.recv_message()
                assert first is not None and first.snapshot is not None and first.snapshot.pools
                await pool.send_message(sub_request(gen.producer), end=True)
                assert await pool.recv_message() is not None  # the snapshot: the pump runs

                async def watch() -> None:
                    while (upd := await watching.recv_message()) is not None:
                        if upd.snapshot is not None and not upd.snapshot.pools:
                            order.append("withdrawn")
                            return

                async def stream_end() -> None:
                    with contextlib.suppress(GRPCError):
                        while await pool.recv_message() is not None:
                            pass
                    order.append("ended")

                watcher = asyncio.ensure_future(watch())
                ending = asyncio.ensure_future(stream_end())
                start = time.monotonic()
                view.remove(gen)
                await asyncio.wait_for(asyncio.gather(watcher, ending), scaled(10))
                took = time.monotonic() - start
                await watching.cancel()
        assert order == ["withdrawn", "ended"]
        assert took >= 0.3, took  # the stalled watcher held the end for the bound, no longer
        assert server.service.catalog_first_timeouts == 1
        from kvrelay.ops.metrics import guard_families  # (what /metrics shows of it)

        fams = {f.name: f for f in guard_families(server.service)}
        assert fams["kvrelay_stream_catalog_first_timeouts"].samples[0].value == 1
        assert not blocked.ended.is_set()
    finally:
        ch.close()
        await stalled.close()
        await server.close(grace_s=1.0)


async def test_a_lagged_plane_stream_gives_its_permit_back_while_it_finishes_its_message() -> None:
    """A load stream that falls more than ``load_fanout_capacity`` windows behind with part of a
    message written finishes that message when its client reads again, then ends lagged. It
    held its ``max_load_subscribers`` permit meanwhile (up to ``stalled_stream_reset_s``), and
    newcomers were refused ``RESOURCE_LIMIT``; the permit is now given back when the end is
    decided, as a pool stream's is."""
    view, server = await _relay(load_fanout_capacity=2, max_load_subscribers=1)
    slow = await RawH2Client.connect(server.port, window=16)
    other = await RawH2Client.connect(server.port, "127.0.0.2")
    try:
        st = slow.open(KINDS["load"], plane_request("slow"))
        await eventually(lambda: len(st.data) == 16)  # part of the first window written
        for w in range(1, 4):  # three past it: lagged, once its message is whole
            view.load.publish(view.load_msg(w), w)
        await asyncio.sleep(0.2)
        assert not st.ended.is_set()
        newcomer = other.open(KINDS["load"], plane_request("new"))
        await eventually(lambda: len(newcomer.data) > 0 or newcomer.ended.is_set())
        assert not newcomer.ended.is_set(), (newcomer.status, newcomer.reason)
        slow.start_reading()
        await _ended(st, LAGGED)
        size = int.from_bytes(st.data[1:5], "big")
        pb.KvPoolLoadUpdate.parse(bytes(st.data[5 : 5 + size]))  # the message whole, then LAGGED
    finally:
        await slow.close()
        await other.close()
        await server.close(grace_s=1.0)


@pytest.mark.parametrize("kind", list(KINDS))
async def test_a_deadline_in_the_middle_of_a_plane_message_resets_the_stream(kind: str) -> None:
    """The call's own deadline (``grpc-timeout``) fires while a plane message waits for a
    client that took its first 8 bytes and stopped: the stream is reset (RST_STREAM CANCEL)
    with no trailers, as a pool stream's cut chunk is. Trailers came after the 8 bytes, read by
    the client as the rest of the message. With nothing written the deadline is a status."""
    _view, server = await _relay()
    part = await RawH2Client.connect(server.port, window=8)
    none = await RawH2Client.connect(server.port, window=0)
    try:
        cut = part.open(KINDS[kind], plane_request("cut"), headers=(("grpc-timeout", "800m"),))
        whole = none.open(KINDS[kind], plane_request("whole"), headers=(("grpc-timeout", "800m"),))
        await asyncio.wait_for(cut.ended.wait(), scaled(10))
        assert 0 < len(cut.data) <= 8
        assert cut.reset and cut.trailers == {}, (cut.reset, cut.trailers)
        await asyncio.wait_for(whole.ended.wait(), scaled(10))
        assert not whole.data and not whole.reset
        assert whole.status == "4", whole.trailers  # DEADLINE_EXCEEDED
    finally:
        await part.close()
        await none.close()
        await server.close(grace_s=1.0)
