"""One client cannot take every plane stream: per-connection and per-peer shares, and the stall
reset of plane streams whose client does not read.

The hostile client is a raw HTTP/2 client (``tests/support/h2_client.py``) on 127.0.0.2 that
advertises a zero flow-control window, so the relay can send it no message at all; the router
is a grpclib client with the generated stub on 127.0.0.1. Oracles: the statuses and reasons
each client reads, and the first message the router receives.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
from grpclib.client import Channel

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import LimitsError, RelayLimits
from kvrelay.contract.wire import CONTRACT_MARKER
from kvrelay.service.server import RelayServer
from kvrelay.service.shares import StreamShares, peer_addr, share_of
from tests.support.h2_client import RawH2Client, RawStream, plane_request
from tests.support.mem_relay import MemRelayView

RESOURCE_EXHAUSTED = "8"
LIMIT = "RELAY_ERROR_REASON_RESOURCE_LIMIT"
KINDS = {
    "catalog": ("WatchKvPoolCatalog", "catalog_permits"),
    "readiness": ("SubscribeServingReadiness", "readiness_permits"),
    "load": ("SubscribeKvPoolLoad", "load_permits"),
    "serving_load": ("SubscribeServingLoad", "serving_load_permits"),
}


async def _eventually(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def _served(limits: RelayLimits) -> tuple[MemRelayView, RelayServer]:
    view = MemRelayView(limits)
    server = RelayServer(view, limits)
    await server.start("127.0.0.1", 0)
    return view, server


async def _first_message(port: int, kind: str) -> object:
    """What a well-behaved router gets: the plane's current message, at once."""
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
        }
        stream: AsyncIterator[object] = calls[kind]()
        return await asyncio.wait_for(anext(aiter(stream)), 10)


def _refused(streams: list[RawStream]) -> list[RawStream]:
    return [s for s in streams if s.status == RESOURCE_EXHAUSTED and s.reason == LIMIT]


@pytest.mark.parametrize("kind", list(KINDS))
async def test_one_client_holding_unread_streams_cannot_lock_routers_out(kind: str) -> None:
    method, permits_attr = KINDS[kind]
    limits = RelayLimits(stalled_stream_reset_s=600.0)  # the shares alone must protect here
    _view, server = await _served(limits)
    svc = server.service
    permits = getattr(svc, permits_attr)
    hostile = [await RawH2Client.connect(server.port, "127.0.0.2", window=0) for _ in range(3)]
    try:
        per_conn, per_peer = svc.shares.limits(permits.capacity)
        assert (per_conn, per_peer) == (32, 48)  # 50 % and 75 % of 64
        # first connection: its share; second: what is left of the address's share; third: none
        opened: list[list[RawStream]] = []
        for c, admitted in zip(hostile, (per_conn, per_peer - per_conn, 0), strict=True):
            streams = [c.open(method, plane_request(f"h{i}")) for i in range(64)]
            opened.append(streams)
            await _eventually(lambda s=streams, n=admitted: len(_refused(s)) == 64 - n)
        assert permits.in_use == per_peer
        refusals, _stalled, _h2 = svc.guard_stats()
        assert refusals[(kind, "connection")] == 64 - per_conn
        assert refusals[(kind, "peer")] == 64 + 64 - (per_peer - per_conn)
        assert "share 32 per connection" in str(_refused(opened[0])[0].message)
        assert "share 48 per peer" in str(_refused(opened[1])[0].message)
        # a router on another address is served at once
        assert await _first_message(server.port, kind) is not None
    finally:
        for c in hostile:
            await c.close()
        await server.close()
    assert permits.in_use == 0


@pytest.mark.parametrize("kind", list(KINDS))
async def test_plane_streams_whose_client_does_not_read_are_reset(kind: str) -> None:
    method, permits_attr = KINDS[kind]
    _view, server = await _served(RelayLimits(stalled_stream_reset_s=0.5))
    svc = server.service
    permits = getattr(svc, permits_attr)
    hostile = await RawH2Client.connect(server.port, "127.0.0.2", window=0)
    try:
        streams = [hostile.open(method, plane_request(f"h{i}")) for i in range(8)]
        await asyncio.wait_for(asyncio.gather(*(s.ended.wait() for s in streams)), 20)
        assert all(s.reset for s in streams)  # RST_STREAM: no window needed to receive it
        assert svc.guard_stats()[1][kind] == 8
        await _eventually(lambda: permits.in_use == 0)
        assert not hostile.closed.is_set()  # the connection itself stays up
        assert await _first_message(server.port, kind) is not None
    finally:
        await hostile.close()
        await server.close()


def test_shares_round_up_keep_one_and_exempt_unix_peers() -> None:
    assert share_of(64, 50) == 32 and share_of(3, 50) == 2 and share_of(1, 1) == 1
    shares = StreamShares(50, 75)
    a, b = ("10.0.0.1", 1000), ("10.0.0.1", 1001)
    assert [shares.try_acquire("pool", 4, a) for _ in range(3)] == [None, None, "connection"]
    assert shares.try_acquire("pool", 4, b) is None  # address share 3
    assert shares.try_acquire("pool", 4, b) == "peer"
    assert shares.try_acquire("catalog", 4, b) is None  # each kind has its own shares
    for _ in range(2):
        shares.release("pool", a)
    shares.release("pool", b)
    shares.release("catalog", b)
    assert shares.held("pool", a) == (0, 0) and not shares._conns and not shares._peers
    assert shares.refusals == {("pool", "connection"): 1, ("pool", "peer"): 1}
    assert peer_addr(("10.0.0.1", 5)) == ("10.0.0.1", 5)
    assert peer_addr("") is None and peer_addr(None) is None  # UNIX socket peers
    assert shares.try_acquire("pool", 4, None) is None
    with pytest.raises(LimitsError):
        RelayLimits(stream_share_per_peer_percent=101)
