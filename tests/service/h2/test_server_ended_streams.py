"""DATA on a stream the relay has already ended counts against the budget of frames that carry
nothing, and DATA dribbled on a stream still open against a budget of its own (``guard.py``).

The relay ends a stream with a status while its client keeps its side open (a request refused
at its length prefix, then RST_STREAM); h2 answers each later DATA frame on it with RST_STREAM.
Unbudgeted, one connection sent 377,447 one-byte frames in 12 s that way, never closed nor
counted, and a router on another connection waited 40 to 50 ms per delta. Real sockets: a raw
TCP client writing frames, the relay's own server.
"""

from __future__ import annotations

import asyncio

import hpack
from grpclib.client import Channel

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.wire import CONTRACT_MARKER
from kvrelay.service.h2.guard import ENHANCE_YOUR_CALM, H2Budgets
from kvrelay.service.h2.request import MAX_REQUEST_BYTES
from kvrelay.service.server import RelayServer
from tests.support.h2_client import PREFACE_AND_SETTINGS, frame
from tests.support.mem_relay import MemRelayView

POOL = "/dynamo.kvrelay.v1.KvEventRelay/SubscribeKvPool"


async def _ended_by_the_relay() -> tuple[RelayServer, asyncio.StreamWriter, bytearray,
                                         asyncio.Future[None]]:  # fmt: skip
    """A relay, and a raw connection whose stream 1 the relay ended (a request over any valid
    one refused at its prefix: trailers, then RST_STREAM) while the client's side stays open."""
    server, writer, got, pump = await _raw_connection()
    block = _request_headers()
    prefix = b"\x00" + (MAX_REQUEST_BYTES + 1).to_bytes(4, "big")  # refused unread
    writer.write(PREFACE_AND_SETTINGS
                 + frame(0x1, 0x4, 1, block) + frame(0x0, 0, 1, prefix))  # fmt: skip
    reset = frame(0x3, 0, 1)[:9]  # RST_STREAM on stream 1 (its length 4 follows)
    for _ in range(200):
        if (b"\x00\x00\x04" + reset[3:]) in got:
            break
        await asyncio.sleep(0.025)
    assert (b"\x00\x00\x04" + reset[3:]) in got, "the relay ends stream 1 with RST_STREAM"
    return server, writer, got, pump


async def _raw_connection() -> tuple[RelayServer, asyncio.StreamWriter, bytearray,
                                      asyncio.Future[None]]:  # fmt: skip
    """A relay and a raw TCP connection to it from 127.0.0.2 (another peer than the checks'),
    whatever the relay sends gathered in ``got`` by ``pump``."""
    server = RelayServer(MemRelayView())
    await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", server.port, local_addr=("127.0.0.2", 0)
    )
    got = bytearray()

    async def read() -> None:
        while data := await reader.read(65536):
            got.extend(data)

    return server, writer, got, asyncio.ensure_future(read())


def _request_headers() -> bytes:
    return bytes(hpack.Encoder().encode([
        (":method", "POST"), (":scheme", "http"), (":authority", "relay"), (":path", POOL),
        ("content-type", "application/grpc"), ("te", "trailers"),
    ]))  # fmt: skip


async def _closed_calm_and_counted(
    server: RelayServer, got: bytearray, pump: asyncio.Future[None], reason: str
) -> None:
    """The connection was closed with GOAWAY ENHANCE_YOUR_CALM, counted once under ``reason``,
    and another client is still answered."""
    await asyncio.wait({pump}, timeout=10)
    assert pump.done(), f"the connection is closed ({reason})"
    assert server.service.guard_stats()[2][reason] == 1
    goaway = got.rfind(b"\x07\x00\x00\x00\x00\x00")  # type 7, flags 0, stream 0
    calm = ENHANCE_YOUR_CALM.to_bytes(4, "big")
    assert goaway >= 0 and got[goaway + 10 : goaway + 14] == calm
    await _info(server.port)


async def _info(port: int) -> None:
    async with Channel("127.0.0.1", port) as ch:
        reply = await asyncio.wait_for(
            pb.KvEventRelayStub(ch).get_relay_info(
                pb.RelayInfoRequest(contract_marker=CONTRACT_MARKER)
            ),
            10,
        )
    assert reply.contract_marker == CONTRACT_MARKER


async def test_data_flooding_a_stream_the_relay_ended_is_closed_and_counted() -> None:
    """One-byte DATA frames on a stream the relay ended, past the budget of frames that carry
    nothing: GOAWAY ENHANCE_YOUR_CALM, counted ``empty_frames``; another client is answered."""
    server, writer, got, pump = await _ended_by_the_relay()
    try:
        flood = H2Budgets().max_empty_frames + 8
        writer.write(frame(0x0, 0, 1, b"x") * flood)
        await _closed_calm_and_counted(server, got, pump, "empty_frames")
    finally:
        pump.cancel()
        writer.close()
        await server.close(grace_s=0.5)


async def test_a_client_ending_its_side_of_a_stream_the_relay_ended_is_not_counted() -> None:
    """The client's own end of such a stream (DATA with END_STREAM, once) is no frame that carries
    nothing: a connection ending it, then sending the whole budget of such frames on it, stays
    open."""
    server, writer, got, pump = await _ended_by_the_relay()
    try:
        budgets = H2Budgets()
        writer.write(frame(0x0, 0x1, 1))  # stream 1's client ends its side
        writer.write(frame(0x0, 0, 1, b"x") * budgets.max_empty_frames)  # then the budget
        writer.write(frame(0x6, 0, 0, b"pingpong"))  # answered once all of the above is read
        for _ in range(400):
            if b"\x00\x00\x08\x06\x01" in got:  # the PING's ACK
                break
            await asyncio.sleep(0.025)
        assert b"\x00\x00\x08\x06\x01" in got and not pump.done()
        assert server.service.guard_stats()[2]["empty_frames"] == 0
    finally:
        pump.cancel()
        writer.close()
        await server.close(grace_s=0.5)


async def test_a_request_dribbled_one_byte_per_frame_is_closed_and_counted() -> None:
    """DATA frames that do not end their stream, past ``max_data_frames`` plus one per stream
    opened in the window (a request is one frame or a few): GOAWAY ENHANCE_YOUR_CALM, counted
    ``data_flood``, while the relay still waits for the rest of the request; another client is
    answered."""
    server, writer, got, pump = await _raw_connection()
    try:
        block = _request_headers()
        dribble = H2Budgets().max_data_frames + 8  # (one stream: its one frame is allowed)
        prefix = b"\x00" + (16000).to_bytes(4, "big")  # a request of 16,000 bytes, never finished
        writer.write(PREFACE_AND_SETTINGS
                     + frame(0x1, 0x4, 1, block) + frame(0x0, 0, 1, prefix)
                     + frame(0x0, 0, 1, b"x") * dribble)  # fmt: skip
        await _closed_calm_and_counted(server, got, pump, "data_flood")
    finally:
        pump.cancel()
        writer.close()
        await server.close(grace_s=0.5)
