"""After RelayServer.close(), connections opened before it cannot make new calls; during its
drain, new streams are refused UNAVAILABLE."""

from __future__ import annotations

import asyncio

import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import RelaySettings
from kvrelay.service.server import RelayServer
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
    """While a stream whose client does not read holds the drain open, a new stream on a
    connection opened before is refused UNAVAILABLE with the reason trailer, not handed the
    old relay's data and an OK EOF (a client that reopens on OK would loop until the close)."""
    relay = Relay(RelaySettings(dc_name="dc-drain"))
    await relay.start()
    server = RelayServer(relay)
    await server.start("127.0.0.1", 0)
    holder = await RawH2Client.connect(server.port, window=0)  # never reads: the drain waits
    channel = Channel("127.0.0.1", server.port)
    closing = None
    try:
        held = holder.open("WatchKvPoolCatalog", plane_request("held"))
        await asyncio.sleep(0.2)
        assert not held.ended.is_set()
        stub = pb.KvEventRelayStub(channel)
        await stub.get_relay_info(pb.RelayInfoRequest(contract_marker=MARKER))  # connected
        closing = asyncio.create_task(server.close(grace_s=3.0))
        await asyncio.sleep(0.3)
        assert not closing.done()
        async with channel.request(
            "/dynamo.kvrelay.v1.KvEventRelay/WatchKvPoolCatalog", Cardinality.UNARY_STREAM,
            pb.WatchKvPoolCatalogRequest, pb.KvPoolCatalogUpdate,
        ) as st:  # fmt: skip
            await st.send_message(
                pb.WatchKvPoolCatalogRequest(contract_marker=MARKER, subscriber_id="late"),
                end=True,
            )
            with pytest.raises(GRPCError) as exc:
                await st.recv_message()
            assert exc.value.status is Status.UNAVAILABLE
            trailers = dict(st.trailing_metadata or {})
            assert trailers["kv-relay-error-reason"] == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
    finally:
        if closing is not None:
            await closing
        channel.close()
        await holder.close()
        await relay.stop()
