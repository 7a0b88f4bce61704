"""After RelayServer.close(), connections opened before it cannot make new calls; during its
drain each connection is told with a graceful GOAWAY, after its last stream ended, to make new
calls elsewhere, and new streams on a connection not told yet are refused UNAVAILABLE."""

from __future__ import annotations

import asyncio
import gc
from types import ModuleType

import grpc
import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import StreamTerminatedError

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client.rpc import RelayAddress, open_channel
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import RelaySettings
from kvrelay.service.h2 import drain
from kvrelay.service.server import RelayServer
from tests.support.fleet import eventually
from tests.support.h2_client import RawH2Client, plane_request

MARKER = 0x4B565231


async def test_open_connections_are_closed_on_shutdown() -> None:
    relay = Relay(RelaySettings(dc_name="dc-close"))
    await relay.start()
    server = RelayServer(relay)
    await server.start("127.0.0.1", 0)
    channel = Channel("127.0.0.1", server.port)
    try:
        stub = pb.KvEventRelayStub(channel)
        info = await stub.get_relay_info(pb.RelayInfoRequest(contract_marker=MARKER))
        assert info.relay is not None
        assert info.relay.relay_incarnation == relay.relay_incarnation
        await server.close(grace_s=1.0)
        # the old connection is gone and a fresh connect is refused: no stale answers
        with pytest.raises((OSError, StreamTerminatedError)):
            await stub.get_relay_info(pb.RelayInfoRequest(contract_marker=MARKER), timeout=2.0)
    finally:
        channel.close()
        await relay.stop()


async def test_a_stream_started_during_the_drain_is_refused_unavailable() -> None:
    """While a stream whose client stopped reading in the middle of a message holds the drain
    open, a new stream on that connection (which has had no GOAWAY yet: a stream of it is open)
    is refused UNAVAILABLE with the reason trailer, not handed the old relay's data and an OK
    EOF (a client that reopens on OK would loop until the close). An idle connection got its
    GOAWAY at the drain's start."""
    relay = Relay(RelaySettings(dc_name="dc-drain"))
    await relay.start()
    server = RelayServer(relay)
    await server.start("127.0.0.1", 0)
    # never reads, its message half written: the drain waits (one with nothing written ends
    # at once: test_blocked_plane_sends.py)
    holder = await RawH2Client.connect(server.port, window=8)
    idle = await RawH2Client.connect(server.port)
    closing = None
    try:
        held = holder.open("WatchKvPoolCatalog", plane_request("held"))
        info = idle.open("GetRelayInfo", bytes(pb.RelayInfoRequest(contract_marker=MARKER)))
        await asyncio.wait_for(info.ended.wait(), 5)
        await asyncio.sleep(0.2)
        assert not held.ended.is_set()
        closing = asyncio.create_task(server.close(grace_s=3.0))
        await asyncio.sleep(0.3)
        assert not closing.done()
        assert idle.goaway is not None and idle.goaway.error_code == 0  # NO_ERROR
        assert idle.order == [("ended", 1), ("goaway", 1)]
        assert holder.goaway is None  # its stream is still open
        late = holder.open("WatchKvPoolCatalog", plane_request("late"))
        await asyncio.wait_for(late.ended.wait(), 5)
        assert late.status == str(Status.UNAVAILABLE.value)
        assert late.reason == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
        await closing
        # the held stream outlasted the grace: its connection's GOAWAY comes as it is closed
        await asyncio.wait_for(holder.closed.wait(), 5)
        assert holder.goaway is not None and holder.goaway.error_code == 0
        assert holder.goaway.last_stream_id == 3
    finally:
        if closing is not None:
            await closing
        await idle.close()
        await holder.close()
        await relay.stop()


@pytest.mark.parametrize("tell_grpclib", [False, True])
async def test_the_drain_ends_each_stream_before_its_connections_goaway(
    tell_grpclib: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection with open streams gets its GOAWAY (NO_ERROR) right after its last stream's
    trailers, never before. grpclib's client fails every stream it holds on any GOAWAY, so its
    connections get none and end as before; the SDK's stream ends with status OK (the drain's
    EOF). ``tell_grpclib``: the relay treats grpclib like any client, as other gRPC servers do,
    and the SDK's channel still reads that OK although the GOAWAY came in the same write."""
    if tell_grpclib:
        monkeypatch.setattr(drain, "_GRPCLIB_AGENT", "no-such-agent/")
    relay = Relay(RelaySettings(dc_name="dc-order"))
    await relay.start()
    server = RelayServer(relay)
    await server.start("127.0.0.1", 0)
    raw = await RawH2Client.connect(server.port)
    channel = open_channel(RelayAddress("127.0.0.1", server.port))
    try:
        streams = [raw.open("WatchKvPoolCatalog", plane_request(f"r{i}")) for i in range(3)]
        await eventually(lambda: all(st.data for st in streams), what="first catalogs")
        async with channel.request(
            "/dynamo.kvrelay.v1.KvEventRelay/WatchKvPoolCatalog", Cardinality.UNARY_STREAM,
            pb.WatchKvPoolCatalogRequest, pb.KvPoolCatalogUpdate,
        ) as st:  # fmt: skip
            await st.send_message(
                pb.WatchKvPoolCatalogRequest(contract_marker=MARKER, subscriber_id="lib"),
                end=True,
            )
            assert await st.recv_message() is not None
            closing = asyncio.create_task(server.close(grace_s=3.0))
            while await st.recv_message() is not None:
                pass
            await st.recv_trailing_metadata()  # raises on anything but OK
        await closing
        await asyncio.wait_for(raw.closed.wait(), 5)
        assert [s.status for s in streams] == ["0", "0", "0"]
        assert raw.order[-1] == ("goaway", 5)
        assert sorted(raw.order[:-1]) == [("ended", 1), ("ended", 3), ("ended", 5)]
        assert raw.goaway is not None and raw.goaway.error_code == 0
    finally:
        channel.close()
        await raw.close()
        await relay.stop()


async def test_a_router_reopening_at_the_drain_reaches_the_successor(
    official_pb2: dict[str, ModuleType],
) -> None:
    """A hot upgrade's hand-over, on one port: the old relay drains while the new one already
    accepts. A grpcio router whose stream ended OK reopens at once on the same channel; the
    GOAWAY sends that call to a new connection, so the successor answers it. Without one it
    went to the draining relay, on the connection closing under it ("Socket closed"),
    about one round in three here."""
    m = official_pb2["relay"]
    port = 0
    for round_ in range(8):
        old = Relay(RelaySettings(dc_name="dc-old"))
        new = Relay(RelaySettings(dc_name="dc-new"))
        await old.start()
        await new.start()
        old_server, new_server = RelayServer(old), RelayServer(new)
        await old_server.start("127.0.0.1", port)
        port = old_server.port
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = official_pb2["relay_grpc"].KvEventRelayStub(channel)
        try:
            call = stub.WatchKvPoolCatalog(
                m.WatchKvPoolCatalogRequest(contract_marker=MARKER, subscriber_id=f"r{round_}")
            )
            assert await call.read() is not grpc.aio.EOF
            closing = asyncio.create_task(old_server.close(grace_s=3.0))
            await asyncio.sleep(0)  # the old listener is closed: the new one binds the port
            await new_server.start("127.0.0.1", port)
            while await call.read() is not grpc.aio.EOF:
                pass
            assert await call.code() == grpc.StatusCode.OK
            info = await stub.GetRelayInfo(m.RelayInfoRequest(contract_marker=MARKER))
            assert info.relay.relay_incarnation == new.relay_incarnation, f"round {round_}"
            await closing
        finally:
            await channel.close()
            await new_server.close(grace_s=1.0)
            await old.stop()
            await new.stop()


async def test_closed_connections_are_not_kept_by_the_server() -> None:
    """The server tracks each connection (to close it, and for its drain notice) only while it
    lives: a client reconnecting all day must not grow the relay."""
    relay = Relay(RelaySettings(dc_name="dc-gone"))
    await relay.start()
    server = RelayServer(relay)
    await server.start("127.0.0.1", 0)
    try:
        for _ in range(40):
            raw = await RawH2Client.connect(server.port)
            st = raw.open("GetRelayInfo", bytes(pb.RelayInfoRequest(contract_marker=MARKER)))
            await asyncio.wait_for(st.ended.wait(), 5)
            await raw.close()
        await asyncio.sleep(0.2)  # the server sees each close
        gc.collect()
        assert len(server._server._protocols) == 0
        assert len(server._server._notices) == 0
    finally:
        await server.close(grace_s=1.0)
        await relay.stop()
