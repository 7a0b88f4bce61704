"""After RelayServer.close(), connections opened before it cannot make new calls."""

from __future__ import annotations

import pytest
from grpclib.client import Channel
from grpclib.exceptions import StreamTerminatedError

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import RelaySettings
from kvrelay.service.server import RelayServer

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
