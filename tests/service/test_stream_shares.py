"""Fair shares of each stream limit: a lone client may hold the whole limit; on a full relay a
client below its share makes room by preemption; plus the stall reset of plane streams whose
client does not read.

The hostile client is a raw HTTP/2 client (``tests/support/h2_client.py``) on 127.0.0.2 that
advertises a zero flow-control window, so the relay can send it no message until it starts
reading; the router is a grpclib client with the generated stub on 127.0.0.1. Oracles: the
statuses, reasons and messages each client reads, and the first message the router receives.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import pytest
from grpclib.client import Channel

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import LimitsError, PermitCounter, RelayLimits
from kvrelay.contract.wire import CONTRACT_MARKER
from kvrelay.ops.metrics import guard_families
from kvrelay.service.server import RelayServer
from kvrelay.service.shares import StreamShares, peer_addr, share_of
from tests.support.h2_client import RawH2Client, RawStream, plane_request
from tests.support.mem_relay import MemRelayView, sub_request

RESOURCE_EXHAUSTED = "8"
LIMIT = "RELAY_ERROR_REASON_RESOURCE_LIMIT"
MAKE_ROOM = "ended to make room for another client"
KINDS = {
    "catalog": ("WatchKvPoolCatalog", "catalog_permits"),
    "readiness": ("SubscribeServingReadiness", "readiness_permits"),
    "load": ("SubscribeKvPoolLoad", "load_permits"),
    "serving_load": ("SubscribeServingLoad", "serving_load_permits"),
}
ALL_KINDS = {**KINDS, "pool": ("SubscribeKvPool", "pool_permits")}
BC = 1024


async def _eventually(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def _served(limits: RelayLimits) -> tuple[MemRelayView, RelayServer]:
    view = MemRelayView(limits)
    view.add_pool("pool-a", BC)
    server = RelayServer(view, limits)
    await server.start("127.0.0.1", 0)
    return view, server


def _producer(view: MemRelayView) -> pb.ProducerIdentity:
    return next(iter(view.pools.values())).producer


def _request(view: MemRelayView, kind: str, sid: str) -> bytes:
    if kind == "pool":
        return bytes(sub_request(_producer(view), sid))
    return plane_request(sid)


@contextlib.asynccontextmanager
async def _router(port: int, kind: str, view: MemRelayView | None = None) -> AsyncIterator[object]:
    """A well-behaved router's stream, held open: yields the plane's current message (or the
    pool's first snapshot chunk), which it gets at once."""
    async with Channel("127.0.0.1", port) as ch:
        stub = pb.KvEventRelayStub(ch)
        req = {"contract_marker": CONTRACT_MARKER, "subscriber_id": "router"}
        calls = {
            "catalog": lambda: stub.watch_kv_pool_catalog(pb.WatchKvPoolCatalogRequest(**req)),
            "readiness": lambda: stub.subscribe_serving_readiness(
                pb.SubscribeServingReadinessRequest(**req)
            ),
            "load": lambda: stub.subscribe_kv_pool_load(pb.SubscribeKvPoolLoadRequest(**req)),
            "serving_load": lambda: stub.subscribe_serving_load(
                pb.SubscribeServingLoadRequest(**req)
            ),
            "pool": lambda: stub.subscribe_kv_pool(
                sub_request(_producer(view) if view is not None else None, "router")
            ),
        }
        stream: AsyncIterator[object] = calls[kind]()
        yield await asyncio.wait_for(anext(aiter(stream)), 10)


async def _first_message(port: int, kind: str, view: MemRelayView | None = None) -> object:
    async with _router(port, kind, view) as first:
        return first


def _preemptions(svc: object, kind: str, scope: str) -> float:
    for fam in guard_families(svc):
        if fam.name == "kvrelay_stream_share_preemptions":
            return next(
                s.value for s in fam.samples if s.labels == {"kind": kind, "scope": scope}
            )
    raise AssertionError("no preemption counter")


def _refused(streams: list[RawStream]) -> list[RawStream]:
    return [s for s in streams if s.status == RESOURCE_EXHAUSTED and s.reason == LIMIT]


async def _hold(
    client: RawH2Client, view: MemRelayView, kind: str, n: int, permits: PermitCounter, tag: str
) -> list[RawStream]:
    """Open ``n`` streams of ``kind`` on ``client`` and wait until the relay holds them."""
    before = permits.in_use
    streams = [client.open(ALL_KINDS[kind][0], _request(view, kind, f"{tag}{i}")) for i in range(n)]
    await _eventually(lambda: permits.in_use == before + n)
    return streams


@pytest.mark.parametrize("kind", list(ALL_KINDS))
async def test_a_lone_client_may_hold_the_whole_limit(kind: str) -> None:
    """No share applies while the limit has room: one connection holds all 64; the 65th gets
    the contract's RESOURCE_LIMIT (nobody is over a share: there is nobody else)."""
    view, server = await _served(RelayLimits())
    svc = server.service
    permits = getattr(svc, ALL_KINDS[kind][1])
    client = await RawH2Client.connect(server.port, "127.0.0.1", window=0)
    try:
        streams = await _hold(client, view, kind, 64, permits, "s")
        extra = client.open(ALL_KINDS[kind][0], _request(view, kind, "s64"))
        await asyncio.wait_for(extra.ended.wait(), 20)
        assert (extra.status, extra.reason) == (RESOURCE_EXHAUSTED, LIMIT)
        assert "limit 64 reached" in str(extra.message)
        assert not any(s.ended.is_set() for s in streams)
        assert permits.in_use == 64 and not svc.preemption_stats()
    finally:
        await client.close()
        await server.close()
    assert permits.in_use == 0


@pytest.mark.parametrize("kind", list(ALL_KINDS))
async def test_a_router_preempts_a_connection_holding_the_whole_limit(kind: str) -> None:
    view, server = await _served(RelayLimits())
    svc = server.service
    permits = getattr(svc, ALL_KINDS[kind][1])
    hostile = await RawH2Client.connect(server.port, "127.0.0.2", window=0)
    late = None
    try:
        streams = await _hold(hostile, view, kind, 64, permits, "h")
        # a router on another address is served at once, though the relay was full
        async with _router(server.port, kind, view) as first:
            assert first is not None
            assert svc.preemption_stats() == {(kind, "connection"): 1}
            assert _preemptions(svc, kind, "connection") == 1  # what /metrics reports
            assert permits.in_use == 64
            # the hostile client opening more, on this connection or a new one, is refused
            more = hostile.open(ALL_KINDS[kind][0], _request(view, kind, "more"))
            late = await RawH2Client.connect(server.port, "127.0.0.2", window=0)
            other = late.open(ALL_KINDS[kind][0], _request(view, kind, "other"))
            await asyncio.wait_for(asyncio.gather(more.ended.wait(), other.ended.wait()), 20)
            assert _refused([more, other]) == [more, other]
            assert "connection already holds its share (32)" in str(more.message)
            assert "peer already holds its share (48)" in str(other.message)
            refusals = svc.guard_stats()[0]
            assert refusals[(kind, "connection")] == 1 and refusals[(kind, "peer")] == 1
            # the preempted stream (the newest) ends with the status once its client reads
            hostile.start_reading()
            await asyncio.wait_for(streams[-1].ended.wait(), 20)
            assert not streams[-1].reset
            assert (streams[-1].status, streams[-1].reason) == (RESOURCE_EXHAUSTED, LIMIT)
            assert MAKE_ROOM in str(streams[-1].message)
            assert not any(s.ended.is_set() for s in streams[:-1])
    finally:
        for c in (hostile, late):
            if c is not None:
                await c.close()
        await server.close()
    assert permits.in_use == 0


async def test_a_request_that_would_fail_never_preempts() -> None:
    """On a full relay, a subscription to a pool that is not listed (or another generation of
    a listed one) is refused as full: it would fail anyway, so no bystander's stream is ended
    to make room for it. A real request from the same address then preempts as before."""
    view, server = await _served(RelayLimits())
    svc = server.service
    permits = svc.pool_permits
    holder = await RawH2Client.connect(server.port, "127.0.0.1", window=0)
    stranger = await RawH2Client.connect(server.port, "127.0.0.2")
    try:
        streams = await _hold(holder, view, "pool", 64, permits, "h")
        other_dc = pb.ProducerIdentity.parse(bytes(_producer(view)))  # copies
        assert other_dc.pool_id is not None
        other_dc.pool_id.dc_id ^= 1  # a pool this relay does not list
        stale = pb.ProducerIdentity.parse(bytes(_producer(view)))
        stale.layout_generation += 1  # a generation it does not serve
        absent, stale = sub_request(other_dc, "absent"), sub_request(stale, "stale")
        tries = [stranger.open("SubscribeKvPool", bytes(r)) for r in (absent, stale)]
        await asyncio.wait_for(asyncio.gather(*(t.ended.wait() for t in tries)), 20)
        assert _refused(tries) == tries and not svc.preemption_stats()
        assert not any(s.ended.is_set() for s in streams)
        real = stranger.open("SubscribeKvPool", _request(view, "pool", "real"))
        await _eventually(lambda: svc.preemption_stats() == {("pool", "connection"): 1})
        assert not real.ended.is_set()
    finally:
        await holder.close()
        await stranger.close()
        await server.close()


@pytest.mark.parametrize("kind", ["catalog", "pool"])
async def test_a_router_preempts_an_address_over_its_share(kind: str) -> None:
    """Four connections from one address, 16 streams each: no connection is over its share,
    the address is (64 > 48); its newest stream makes room for a router on 127.0.0.1."""
    view, server = await _served(RelayLimits())
    svc = server.service
    permits = getattr(svc, ALL_KINDS[kind][1])
    hostile = [await RawH2Client.connect(server.port, "127.0.0.2", window=0) for _ in range(4)]
    try:
        held = [await _hold(c, view, kind, 16, permits, f"c{i}-") for i, c in enumerate(hostile)]
        async with _router(server.port, kind, view) as first:
            assert first is not None
            assert svc.preemption_stats() == {(kind, "peer"): 1}
            newest = held[-1][-1]
            hostile[-1].start_reading()
            await asyncio.wait_for(newest.ended.wait(), 20)
            assert (newest.status, newest.reason) == (RESOURCE_EXHAUSTED, LIMIT)
            assert MAKE_ROOM in str(newest.message) and "peer held more" in str(newest.message)
            assert not any(s.ended.is_set() for c in held for s in c if s is not newest)
            assert permits.in_use == 64
    finally:
        for c in hostile:
            await c.close()
        await server.close()
    assert permits.in_use == 0


@pytest.mark.parametrize("kind", list(KINDS))
async def test_plane_streams_whose_client_does_not_read_end_lagged(kind: str) -> None:
    """A client that takes no message for ``stalled_stream_reset_s``: nothing of the message
    was written (its window is 0), so the stream ends with its status (HEADERS need no window),
    not a bare reset."""
    method, permits_attr = KINDS[kind]
    _view, server = await _served(RelayLimits(stalled_stream_reset_s=0.5))
    svc = server.service
    permits = getattr(svc, permits_attr)
    hostile = await RawH2Client.connect(server.port, "127.0.0.2", window=0)
    try:
        streams = [hostile.open(method, plane_request(f"h{i}")) for i in range(8)]
        await asyncio.wait_for(asyncio.gather(*(s.ended.wait() for s in streams)), 20)
        assert all(not s.reset and not s.data for s in streams)
        assert {(s.status, s.reason) for s in streams} == {
            ("8", "RELAY_ERROR_REASON_SUBSCRIBER_LAGGED")}
        assert svc.guard_stats()[1][kind] == 8
        await _eventually(lambda: permits.in_use == 0)
        assert not hostile.closed.is_set()  # the connection itself stays up
        assert await _first_message(server.port, kind) is not None
    finally:
        await hostile.close()
        await server.close()


def test_shares_preempt_the_newest_of_the_furthest_over_and_exempt_unix_peers() -> None:
    assert share_of(64, 50) == 32 and share_of(3, 50) == 2 and share_of(1, 1) == 1
    shares = StreamShares(50, 75)
    permits = PermitCounter("pool streams", 4)
    a, b, c = ("10.0.0.1", 1000), ("10.0.0.1", 1001), ("10.0.0.2", 1000)
    held = [shares.admit("pool", permits, a) for _ in range(4)]  # room: no share applies
    assert shares.held("pool", a) == (4, 4) and permits.in_use == 4
    with pytest.raises(Exception, match="connection already holds its share"):
        shares.admit("pool", permits, a)
    with pytest.raises(Exception, match="peer already holds its share"):
        shares.admit("pool", permits, b)  # address share 3, held 4
    newcomer = shares.admit("pool", permits, c)  # below both: the newest of `a` makes room
    assert held[-1].released and held[-1].error is not None and not held[0].released
    assert shares.held("pool", a) == (3, 3) and permits.in_use == 4
    assert shares.preemptions == {("pool", "connection"): 1}
    assert shares.refusals == {("pool", "connection"): 1, ("pool", "peer"): 1}
    held[-1].release()  # idempotent: the handler's finally after the preemption
    assert permits.in_use == 4
    # the internal socket never preempts and is never preempted
    with pytest.raises(Exception, match="limit 4 reached"):
        shares.admit("pool", permits, None)
    for t in (*held[:-1], newcomer):
        t.release()
    assert permits.in_use == 0 and not shares._conns and not shares._peers
    unix = [shares.admit("pool", permits, None) for _ in range(4)]
    with pytest.raises(Exception, match="limit 4 reached"):
        shares.admit("pool", permits, c)  # nobody over a share
    assert not any(t.released for t in unix)
    assert peer_addr(("10.0.0.1", 5)) == ("10.0.0.1", 5)
    assert peer_addr("") is None and peer_addr(None) is None  # UNIX socket peers
    with pytest.raises(LimitsError):
        RelayLimits(stream_share_per_peer_percent=101)
