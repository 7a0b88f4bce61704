"""The WINDOW_UPDATE budget: a flood is closed and counted, busy subscribers are never cut.

The flood comes from a raw ``h2`` client writing WINDOW_UPDATE frames (increment 1) as fast as it
can, on the connection or on a stream it holds open; the bystander is a grpclib client on its own
connection. The busy subscribers are the SDK (``kvrelay.client``, grpclib), an official grpcio
client, and a raw client that acknowledges every DATA frame it gets for its stream and for the
connection at once (the most any receiver sends), each on its own connection with every pool,
while the pools publish tiny deltas as fast as the relay takes them, across several budget
windows. Every test runs on asyncio's loop and on uvloop's (``conftest.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import ModuleType

import h2.events
import h2.exceptions
import numpy as np
import pytest
from grpclib.client import Channel

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import ClientConfig, PoolKey, RelayClient
from kvrelay.contract.limits import RelayLimits
from kvrelay.contract.wire import CONTRACT_MARKER
from kvrelay.service.h2.guard import ENHANCE_YOUR_CALM, H2Budgets
from kvrelay.service.server import RelayServer
from tests.support.h2_client import RawH2Client, plane_request
from tests.support.mem_relay import GrpcioClient, MemRelayView, sub_request
from tests.support.timing import scaled

BUDGETS = H2Budgets()


def _window_update(sid: int, increment: int = 1) -> bytes:
    return b"\x00\x00\x04\x08\x00" + sid.to_bytes(4, "big") + increment.to_bytes(4, "big")


async def _info(port: int) -> float:
    t0 = time.monotonic()
    async with Channel("127.0.0.1", port) as ch:
        reply = await asyncio.wait_for(
            pb.KvEventRelayStub(ch).get_relay_info(
                pb.RelayInfoRequest(contract_marker=CONTRACT_MARKER)
            ),
            scaled(10),
        )
    assert reply.contract_marker == CONTRACT_MARKER
    return time.monotonic() - t0


@pytest.mark.parametrize("on", ["connection", "open_stream"])
async def test_a_window_update_flood_is_closed_and_counted(on: str) -> None:
    """Before: 1.3 million WINDOW_UPDATEs in 5 s kept a core busy, never closed nor counted.
    Now GOAWAY ENHANCE_YOUR_CALM early in the flood, ``window_update_flood`` counted once, and
    a bystander's call answers and its catalog stream gets the next update."""
    view = MemRelayView()
    server = RelayServer(view)
    await server.start("127.0.0.1", 0)
    async with Channel("127.0.0.1", server.port) as bystander:
        catalog = pb.KvEventRelayStub(bystander).watch_kv_pool_catalog(
            pb.WatchKvPoolCatalogRequest(contract_marker=CONTRACT_MARKER, subscriber_id="router")
        )
        it = aiter(catalog)
        first = await asyncio.wait_for(anext(it), scaled(10))
        attacker = await RawH2Client.connect(server.port, "127.0.0.2")
        try:
            sid = 0
            if on == "open_stream":  # a catalog watch it holds (the relay's side stays open)
                st = attacker.open("WatchKvPoolCatalog", plane_request())
                deadline = time.monotonic() + scaled(10)
                while not st.data:
                    assert time.monotonic() < deadline, "no catalog snapshot"
                    await asyncio.sleep(0.01)
                sid = 1
            burst = _window_update(sid) * 10_000
            writer, sent = attacker._writer, 0
            while not attacker.closed.is_set() and sent < 1_000_000:
                try:
                    writer.write(burst)
                    await writer.drain()
                except ConnectionError:
                    break  # the relay closed it
                sent += 10_000
            assert sent < 1_000_000, "the relay took the whole flood"  # closed early in it
            await asyncio.wait_for(attacker.closed.wait(), scaled(20))
            assert attacker.goaway is not None
            assert attacker.goaway.error_code == ENHANCE_YOUR_CALM
            assert server.service.guard_stats()[2]["window_update_flood"] == 1
            assert await _info(server.port) < scaled(5)
            view.add_pool("pool-after", 1024)
            assert await asyncio.wait_for(anext(it), scaled(10)) != first
        finally:
            await attacker.close()
    await server.close(grace_s=0.5)


class _EagerAcker(RawH2Client):
    """Acknowledges each DATA frame as it comes, for its stream and for the connection: two
    WINDOW_UPDATEs per frame (grpclib's and grpcio's clients send one per half window)."""

    acks = 0
    frames = 0

    def _event(self, ev: h2.events.Event) -> None:
        if isinstance(ev, h2.events.DataReceived) and ev.flow_controlled_length:
            self.frames += 1
            size = ev.flow_controlled_length
            with contextlib.suppress(h2.exceptions.StreamClosedError):
                self.h2.increment_flow_control_window(size, stream_id=ev.stream_id)
                self.acks += 1
            self.h2.increment_flow_control_window(size)
            self.acks += 1
            st = self.streams.get(ev.stream_id)
            if st is not None:
                st.data += ev.data
            return
        super()._event(ev)


POOLS = 24


async def test_busy_subscribers_are_never_cut(official_pb2: dict[str, ModuleType]) -> None:
    """Three subscribers, each with every pool on one connection, while the pools publish tiny
    deltas as fast as the relay takes them (thousands of messages a second per connection) for
    several budget windows: none is closed, nothing is counted, every one of them keeps its
    streams to the last delta, and the one that acknowledges every DATA frame sent many times
    the fixed part of the budget."""
    # a small budget, so what the relay sends must carry the subscribers: four rounds of a
    # window update on every stream a client here holds (its pools, four planes, the connection)
    tight = H2Budgets(window_s=0.5, max_window_updates=4 * (POOLS + 5))
    view = MemRelayView()
    gens = [view.add_pool(f"busy-{i}", 1024) for i in range(POOLS)]
    for i, g in enumerate(gens):  # one SDK pool key each
        g.endpoint = pb.DynamoEndpointId(namespace="ns", component="c", endpoint=f"e{i}")
    view._republish_catalog()
    server = RelayServer(view, RelayLimits(max_pool_streams_total=4 * POOLS))
    server._server.h2_guard = (tight, server.service.h2_counters)
    await server.start("127.0.0.1", 0)
    address = f"127.0.0.1:{server.port}"
    keys = [PoolKey(address, "ns", "c", f"e{i}") for i in range(POOLS)]
    sdk = RelayClient([address], config=ClientConfig(subscriber_id="sdk"))
    grpcio = GrpcioClient(official_pb2, server.port)
    acker = await _EagerAcker.connect(server.port)
    assert isinstance(acker, _EagerAcker)
    got = dict.fromkeys(range(POOLS), 0)

    async def official(i: int) -> None:
        call = grpcio.stub.SubscribeKvPool(
            grpcio.convert(sub_request(gens[i].producer, subscriber_id="grpcio"))
        )
        async for _ in call:
            got[i] += 1

    reads = [asyncio.create_task(official(i)) for i in range(POOLS)]
    raw = [
        acker.open("SubscribeKvPool", bytes(sub_request(g.producer, subscriber_id="raw")))
        for g in gens
    ]
    try:
        await sdk.start()
        deadline = time.monotonic() + scaled(20)
        while not (
            all(s.installed for s in sdk.replica_stats().values())
            and len(sdk.replica_stats()) == POOLS
            and all(got.values())
            and all(st.data for st in raw)
        ):
            assert time.monotonic() < deadline, "the subscribers did not all start"
            await asyncio.sleep(0.02)
        rng = np.random.default_rng(7)
        start, acks, before = time.monotonic(), acker.acks, dict(got)
        while time.monotonic() - start < 5 * tight.window_s:
            for g in gens:
                g.random_step(rng, 2)
            await asyncio.sleep(0)
        deadline = time.monotonic() + scaled(20)
        while not all(
            sdk.replica_stats()[k].sequence == g.sequence for k, g in zip(keys, gens, strict=True)
        ):
            assert time.monotonic() < deadline, "the SDK stopped receiving deltas"
            await asyncio.sleep(0.05)
        assert all(s.subscribes == 1 for s in sdk.replica_stats().values())
        assert not any(t.done() for t in reads), [t.exception() for t in reads if t.done()]
        assert all(got[i] > before[i] for i in range(POOLS))
        assert acker.goaway is None and not acker.closed.is_set()
        assert server.service.guard_stats()[2]["window_update_flood"] == 0
        # the acknowledgements the relay's DATA earned: far past the fixed part of the budget
        assert acker.acks - acks > 10 * tight.max_window_updates
    finally:
        for t in reads:
            t.cancel()
        await sdk.close()
        await grpcio.close()
        await acker.close()
        await server.close(grace_s=0.5)
