"""A ``RelayChannel`` connection's memo of closed streams (h2 keeps 65,536 per connection by
itself, ~7.9 MB when full) is bounded like the relay's own: ``closed_streams_bound`` of the
most concurrent streams its server announced. And the bound never costs the gentle answer to a
late frame: a server's reply that crosses the client's RST_STREAM, arriving after thousands of
other calls on the connection, is answered RST_STREAM and the connection goes on.

Real servers on loopback: grpclib's, and a scripted h2 server that sends the late reply."""

from __future__ import annotations

import asyncio
from typing import Any

import grpclib.const
from grpclib.server import Server
from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import DataReceived, RequestReceived, StreamEnded, StreamReset
from hyperframe.frame import HeadersFrame

from kvrelay._grpc import RelayChannel, closed_streams_bound
from kvrelay.client.codec import RawCodec

UNARY = grpclib.const.Cardinality.UNARY_UNARY
CALLS = 3_000
BATCH = 50


class _Echo:
    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        async def echo(stream: Any) -> None:
            await stream.send_message(await stream.recv_message())

        return {"/t.T/Echo": grpclib.const.Handler(echo, UNARY, bytes, bytes)}


async def _call(ch: RelayChannel, method: str = "/t.T/Echo") -> bytes | None:
    async with ch.request(method, UNARY, bytes, bytes) as stream:
        await stream.send_message(b"x", end=True)
        reply: bytes | None = await stream.recv_message()
        await stream.recv_trailing_metadata()
        return reply


async def _calls(ch: RelayChannel, n: int) -> None:
    for _ in range(n // BATCH):
        await asyncio.gather(*(_call(ch) for _ in range(BATCH)))


def _memo(ch: RelayChannel) -> Any:
    proto: Any = ch._protocol
    return proto.connection._connection._closed_streams


async def test_a_channel_remembers_a_bounded_number_of_its_closed_streams() -> None:
    server = Server([_Echo()], codec=RawCodec())
    await server.start("127.0.0.1", 0)
    listening: Any = server._server
    ch = RelayChannel("127.0.0.1", listening.sockets[0].getsockname()[1], codec=RawCodec())
    try:
        await _calls(ch, CALLS)
        h2 = ch._protocol.connection._connection  # type: ignore[union-attr]
        bound = closed_streams_bound(h2.remote_settings.max_concurrent_streams)
        assert bound == 1024  # (grpclib's server announces h2's 100)
        memo = _memo(ch)
        assert len(memo) == bound, len(memo)  # h2's own: every one of the ~3,000
        newest = max(sid for sid in range(1, 2 * CALLS, 2) if sid not in h2.streams)
        assert newest in memo and min(memo) > newest - 2 * bound  # the newest are kept
    finally:
        ch.close()
        server.close()
        await server.wait_closed()


class _LateReply(asyncio.Protocol):
    """An h2 server that echoes ``/t.T/Echo`` and holds ``/t.T/Hold`` unanswered. Once the
    client reset the held call, it answers it anyway (a trailers-only reply, as if it had
    crossed the reset) just before it answers the next call."""

    def __init__(self) -> None:
        self.h2 = H2Connection(H2Configuration(client_side=False, header_encoding=None))
        self.held: int | None = None
        self.reset: int | None = None
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.h2.initiate_connection()
        transport.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        for event in self.h2.receive_data(data):
            if isinstance(event, RequestReceived):
                if dict(event.headers)[b":path"] == b"/t.T/Hold":
                    self.held = event.stream_id
            elif isinstance(event, DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, StreamReset) and event.stream_id == self.held:
                self.reset = event.stream_id
            elif isinstance(event, StreamEnded) and event.stream_id != self.held:
                if self.reset is not None:
                    self._late_reply(self.reset)
                    self.reset = None
                self._reply(event.stream_id)
        self.transport.write(self.h2.data_to_send())

    def _reply(self, sid: int) -> None:
        self.h2.send_headers(sid, [(":status", "200"), ("content-type", "application/grpc")])
        self.h2.send_data(sid, b"\x00\x00\x00\x00\x01x")
        self.h2.send_headers(sid, [("grpc-status", "0")], end_stream=True)

    def _late_reply(self, sid: int) -> None:
        # h2 sends nothing on a stream it saw reset: the frame is written by hand, its header
        # block from the connection's own encoder (the client's decoder table stays in step)
        block = self.h2.encoder.encode(
            [(":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "0")]
        )
        frame = HeadersFrame(sid, data=block, flags=["END_HEADERS", "END_STREAM"])
        self.transport.write(self.h2.data_to_send() + frame.serialize())


async def test_a_reply_crossing_the_reset_of_a_call_after_thousands_keeps_the_connection() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_LateReply, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ch = RelayChannel("127.0.0.1", port, codec=RawCodec())
    try:
        await _calls(ch, CALLS)
        proto = ch._protocol
        async with ch.request("/t.T/Hold", UNARY, bytes, bytes) as stream:
            await stream.send_message(b"x", end=True)
            await stream.cancel()  # RST_STREAM: its reply comes anyway, with the next call's
        for _ in range(3):  # (the first may go before the server saw the reset)
            assert await asyncio.wait_for(_call(ch), 10) == b"x"
        assert ch._protocol is proto and not proto.handler.connection_lost  # type: ignore[union-attr]
        assert len(_memo(ch)) <= 1024
    finally:
        ch.close()
        server.close()
        await server.wait_closed()
