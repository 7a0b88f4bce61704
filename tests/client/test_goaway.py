"""The SDK's channel and a server that ends its streams and then sends GOAWAY in the same write,
as gRPC servers do when they shut down (a raw h2 server over loopback scripts the frames).

grpclib fails every stream still registered on a connection that closes; ``RelayChannel`` keeps
a stream whose status has already arrived, whatever the reader does meanwhile (a mirror yields
after each message), through grpclib's second close at the transport's end. A stream that ended
without a status still fails instead of waiting for trailers that will never come."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import errors as E
from kvrelay.client import rpc
from kvrelay.client.rpc import RelayAddress, open_channel


class _Scripted(asyncio.Protocol):
    """Answers the first call with ``mode``'s frames, all in one write."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        )
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.h2.initiate_connection()
        transport.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        for ev in self.h2.receive_data(data):
            if isinstance(ev, h2.events.RequestReceived):
                self._answer(ev.stream_id)
                return
        self.transport.write(self.h2.data_to_send())

    def _answer(self, sid: int) -> None:
        msg = bytes(pb.KvPoolCatalogUpdate())
        frame = b"\0" + struct.pack(">I", len(msg)) + msg
        self.h2.send_headers(sid, [(":status", "200"), ("content-type", "application/grpc")])
        if self.mode == "no_status":
            self.h2.send_data(sid, frame, end_stream=True)  # an end without trailers
            self.transport.write(self.h2.data_to_send())
            self.transport.close()
            return
        for _ in range(3):
            self.h2.send_data(sid, frame)
        self.h2.send_headers(sid, [("grpc-status", "0")], end_stream=True)
        self.h2.close_connection(last_stream_id=sid)  # GOAWAY NO_ERROR, same write
        self.transport.write(self.h2.data_to_send())
        if self.mode == "goaway_then_close":
            self.transport.close()


async def _run(mode: str, yield_every: int) -> tuple[rpc.StreamEnd, int]:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Scripted(mode), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    channel = open_channel(RelayAddress("127.0.0.1", port))
    got: list[Any] = []
    try:
        end = await asyncio.wait_for(
            rpc.run_stream(
                channel, "WatchKvPoolCatalog", rpc.catalog_request("t"),
                pb.KvPoolCatalogUpdate, got.append, yield_every=yield_every,
            ),
            5,
        )  # fmt: skip
    finally:
        channel.close()
        server.close()
    return end, len(got)


@pytest.mark.parametrize("mode", ["goaway", "goaway_then_close"])
@pytest.mark.parametrize("yield_every", [0, 1])
async def test_a_status_followed_by_goaway_in_the_same_write_is_read(
    mode: str, yield_every: int
) -> None:
    end, messages = await _run(mode, yield_every)
    assert (end.reason, messages) == (E.EOF, 3), end


async def test_an_end_without_a_status_still_fails_when_the_connection_closes() -> None:
    """Never kept as ``eof``: the reader sees the end without a status (``no_status``) or,
    when the connection's close is processed first, the lost connection."""
    end, messages = await _run("no_status", 1)
    assert end.reason in (E.NO_STATUS, E.CONNECTION), end
    assert messages == 1
