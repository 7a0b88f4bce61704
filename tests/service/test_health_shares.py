"""Health ``Watch`` streams are admitted under the per-connection and per-address shares of their
limit, as every other stream kind is (``service/shares.py``, kind ``health``).

gRPC client-side health checking watches: with the limit held by one connection, every other
client's ``Watch`` was refused ("256 health watchers already"). The hostile client is a raw
HTTP/2 client (``tests/support/h2_client.py``) on 127.0.0.2 that advertises a zero flow-control
window; the bystander is grpclib's health stub on 127.0.0.1. Oracles: what each client reads,
and the counters ``/metrics`` reports.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from grpclib.client import Channel
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from kvrelay.ops.metrics import guard_families
from kvrelay.service.server import RelayServer
from tests.support.h2_client import RawH2Client
from tests.support.mem_relay import MemRelayView

WATCH = "/grpc.health.v1.Health/Watch"
HEALTH_CHECK = b""  # HealthCheckRequest{service: ""}: the whole server
RESOURCE_EXHAUSTED = "8"
LIMIT = "RELAY_ERROR_REASON_RESOURCE_LIMIT"
CAPACITY = 8  # shares: 4 per connection, 6 per address
HEALTH_KIND = "health"  # the kind its metrics carry


async def _eventually(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def _counted(svc: object, family: str, scope: str) -> float:
    for fam in guard_families(svc):
        if fam.name == family:
            return next(
                s.value for s in fam.samples if s.labels == {"kind": HEALTH_KIND, "scope": scope}
            )
    raise AssertionError(f"no {family}")


async def test_a_watcher_preempts_a_connection_holding_every_watch_stream() -> None:
    """One connection holds every ``Watch`` stream: another client's ``Watch`` is served at once,
    the hog's newest ends RESOURCE_EXHAUSTED / RESOURCE_LIMIT, and its next is refused naming
    its share; both counted by kind ``health``."""
    server = RelayServer(MemRelayView())
    server.health.watchers.capacity = CAPACITY
    await server.start("127.0.0.1", 0)
    svc, watchers = server.service, server.health.watchers
    hog = await RawH2Client.connect(server.port, "127.0.0.2", window=0)
    ch = Channel("127.0.0.1", server.port)
    try:
        held = [hog.open(WATCH, HEALTH_CHECK) for _ in range(CAPACITY)]
        await _eventually(lambda: watchers.in_use == CAPACITY)
        async with HealthStub(ch).Watch.open() as st:
            await st.send_message(HealthCheckRequest(service=""), end=True)
            reply = await asyncio.wait_for(st.recv_message(), 10)
            assert reply is not None and reply.status == HealthCheckResponse.SERVING
            assert _counted(svc, "kvrelay_stream_share_preemptions", "connection") == 1
            assert watchers.in_use == CAPACITY
            more = hog.open(WATCH, HEALTH_CHECK)
            await asyncio.wait_for(more.ended.wait(), 10)
            assert (more.status, more.reason) == (RESOURCE_EXHAUSTED, LIMIT)
            assert "connection already holds its share (4)" in str(more.message)
            assert _counted(svc, "kvrelay_stream_share_refusals", "connection") == 1
            hog.start_reading()
            await asyncio.wait_for(held[-1].ended.wait(), 10)
            assert (held[-1].status, held[-1].reason) == (RESOURCE_EXHAUSTED, LIMIT)
            assert "ended to make room for another client" in str(held[-1].message)
            assert not any(s.ended.is_set() for s in held[:-1])
            await st.cancel()
    finally:
        ch.close()
        await hog.close()
        await server.close(grace_s=0.5)
    assert watchers.in_use == 0


async def test_a_watcher_preempts_an_address_over_its_share() -> None:
    """Two connections of one address hold four ``Watch`` streams each (neither over its
    connection's share of 4, the address over its 6): a client on another address is served,
    and the address's newest stream ends RESOURCE_LIMIT, counted by scope ``peer``."""
    server = RelayServer(MemRelayView())
    server.health.watchers.capacity = CAPACITY
    await server.start("127.0.0.1", 0)
    svc, watchers = server.service, server.health.watchers
    hogs = [await RawH2Client.connect(server.port, "127.0.0.2", window=0) for _ in range(2)]
    ch = Channel("127.0.0.1", server.port)
    try:
        held = []
        for n, hog in enumerate(hogs, 1):
            held += [hog.open(WATCH, HEALTH_CHECK) for _ in range(CAPACITY // 2)]
            await _eventually(lambda n=n: watchers.in_use == n * CAPACITY // 2)
        async with HealthStub(ch).Watch.open() as st:
            await st.send_message(HealthCheckRequest(service=""), end=True)
            reply = await asyncio.wait_for(st.recv_message(), 10)
            assert reply is not None and reply.status == HealthCheckResponse.SERVING
            assert _counted(svc, "kvrelay_stream_share_preemptions", "peer") == 1
            await asyncio.wait_for(held[-1].ended.wait(), 10)
            assert (held[-1].status, held[-1].reason) == (RESOURCE_EXHAUSTED, LIMIT)
            assert not any(s.ended.is_set() for s in held[:-1])
            await st.cancel()
    finally:
        ch.close()
        for hog in hogs:
            await hog.close()
        await server.close(grace_s=0.5)
    assert watchers.in_use == 0
