"""The SDK's stream reader against a relay that sends what no relay should: a reply larger than
the bound (refused from its length prefix, before its body is read), bytes that do not decode
as the reply type (the stream ends ``envelope``, a typed end, never an exception that kills the
consumer's task) and compressed replies (``compressed``). Real grpclib server on loopback (a
grpcio one to compress), the SDK's own ``run_stream``; and the grpclib client internals the
bounded reader relies on, named on a live stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpclib.const
import pytest
from grpclib.client import Channel
from grpclib.server import Server

from kvrelay._grpc import (
    CLIENT_CANCEL_NEEDS,
    CLIENT_CHANNEL_NEEDS,
    CLIENT_CLOSE_NEEDS,
    CLIENT_CLOSED_NEEDS,
    CLIENT_CLOSED_STREAMS_NEEDS,
    CLIENT_END_NEEDS,
    CLIENT_LEAVE_NEEDS,
    CLIENT_RECV_NEEDS,
    CLIENT_SSL_NEEDS,
    ClosedStreams,
    RelayChannel,
    missing_client_cancel_needs,
    missing_client_channel_needs,
    missing_client_close_needs,
    missing_client_closed_needs,
    missing_client_closed_streams_needs,
    missing_client_end_needs,
    missing_client_leave_needs,
    missing_client_recv_needs,
    missing_client_ssl_needs,
)
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import errors as E
from kvrelay.client import rpc
from kvrelay.client.codec import ClientCodec, RawCodec
from tests.support.scripted_relay import descriptor


class _Relay:
    def __init__(self, reply: bytes) -> None:
        self.reply = reply

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        async def catalog(stream: Any) -> None:
            await stream.recv_message()
            await stream.send_message(self.reply)

        return {rpc.SERVICE + "WatchKvPoolCatalog": grpclib.const.Handler(
            catalog, grpclib.const.Cardinality.UNARY_STREAM, bytes, bytes)}  # fmt: skip


@pytest.mark.parametrize(
    ("reply", "reason"),
    [(b"\x08", E.ENVELOPE),  # a varint field cut off (EOFError in the decoder)
     (b"\xff" * 10, E.ENVELOPE),  # a tag no varint ends (ValueError)
     (bytes(70_000), "status_resource_exhausted")],  # over the channel's 64 KiB bound here
)  # fmt: skip
async def test_a_reply_the_sdk_cannot_take_ends_its_stream_typed(reply: bytes, reason: str) -> None:
    server = Server([_Relay(reply)], codec=RawCodec())
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]
    ch = Channel("127.0.0.1", port, codec=ClientCodec(64 * 1024))
    seen: list[Any] = []
    try:
        end = await rpc.run_stream(ch, "WatchKvPoolCatalog", rpc.catalog_request("t"),
                                   pb.KvPoolCatalogUpdate, seen.append)  # fmt: skip
        assert end.reason == reason, end
        assert seen == []
    finally:
        ch.close()
        server.close()
        await server.wait_closed()


async def test_a_live_client_stream_has_what_the_reader_and_keeping_ended_streams_use() -> None:
    """On a real connection of the SDK's channel: the bounded reader's stream parts, what
    ``ended_without_status`` reads (the protocol stream's headers and trailers), what
    ``keep_ended_streams`` uses (the processor's streams and its close, which it replaced, and
    each protocol stream's headers and trailers), what ``leave_when_draining`` uses (the
    processor's process and register, which it replaced) and the channel's own parts it
    relies on (to leave a draining connection, to take each connection's TLS context from a
    source, to stay closed), and what ``bound_closed_streams`` replaces (h2's memo of closed
    streams); an object lacking them has each named."""
    server = Server([_Relay(bytes(pb.KvPoolCatalogUpdate()))], codec=RawCodec())
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]
    ch = RelayChannel("127.0.0.1", port, codec=ClientCodec())
    try:
        async with ch.request(rpc.SERVICE + "WatchKvPoolCatalog",
                              grpclib.const.Cardinality.UNARY_STREAM,
                              pb.WatchKvPoolCatalogRequest,
                              pb.KvPoolCatalogUpdate) as stream:  # fmt: skip
            await stream.send_message(rpc.catalog_request("t"), end=True)
            assert missing_client_recv_needs(stream) == []
            assert missing_client_cancel_needs(stream) == []
            assert missing_client_end_needs(stream) == []
            await stream.recv_message()
            proto: Any = ch._protocol
            assert missing_client_close_needs(proto, stream._stream) == []
            assert missing_client_leave_needs(proto) == []
            assert missing_client_closed_streams_needs(proto) == []
            assert missing_client_channel_needs(ch) == []
            assert missing_client_ssl_needs(ch) == []
            assert missing_client_closed_needs(proto) == []
            assert stream._stream.connection.messages_received == 1
        assert type(proto.connection._connection._closed_streams) is ClosedStreams
        assert proto.processor.close.__name__ == "close_open_streams"
        assert proto.processor.process.__name__ == "process_noting_refusals"
        assert proto.processor.register.__name__ == "register_noting_release"
        assert missing_client_leave_needs(object()) == [f"{w}.{a}" for w, a in CLIENT_LEAVE_NEEDS]
        assert missing_client_recv_needs(object()) == [f"{w}.{a}" for w, a in CLIENT_RECV_NEEDS]
        assert "connection.messages_received" in missing_client_recv_needs(object())
        assert missing_client_cancel_needs(object()) == [f"{w}.{a}" for w, a in CLIENT_CANCEL_NEEDS]
        # what tells a stream that ended without a status (``ended_without_status``)
        assert CLIENT_END_NEEDS == (("stream", "_stream"), ("inner", "headers"),
                                    ("inner", "trailers"))  # fmt: skip
        assert missing_client_end_needs(object()) == [f"{w}.{a}" for w, a in CLIENT_END_NEEDS]
        assert missing_client_channel_needs(object()) == [
            f"{w}.{a}" for w, a in CLIENT_CHANNEL_NEEDS
        ]
        assert {a for _, a in CLIENT_CHANNEL_NEEDS} >= {"_protocol", "_protocol_factory"}
        assert {a for _, a in CLIENT_SSL_NEEDS} == {"_ssl", "_create_connection"}
        assert missing_client_ssl_needs(object()) == [
            f"{w}.{a}" for w, a in CLIENT_SSL_NEEDS if w == "channel"
        ]
        assert missing_client_closed_streams_needs(object()) == [
            f"{w}.{a}" for w, a in CLIENT_CLOSED_STREAMS_NEEDS
        ]
        assert missing_client_closed_needs(object()) == [
            f"{w}.{a}" for w, a in CLIENT_CLOSED_NEEDS if w != "grpclib"
        ]
        assert ("grpclib", "_create_connection") in CLIENT_CLOSED_NEEDS
        gone = missing_client_close_needs(object(), object())
        assert gone == [f"{w}.{a}" for w, a in CLIENT_CLOSE_NEEDS]
        # without a stream (or a connection) the parts on it are not asked
        assert missing_client_close_needs(object()) == [
            f"{w}.{a}" for w, a in CLIENT_CLOSE_NEEDS if w != "stream"
        ]
        assert missing_client_closed_needs() == []
    finally:
        ch.close()
        server.close()
        await server.wait_closed()


class _Chatty:
    """A relay whose catalog stream talks every 50 ms and whose pool stream never says a word."""

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        async def catalog(stream: Any) -> None:
            await stream.recv_message()
            while True:
                await stream.send_message(bytes(pb.KvPoolCatalogUpdate()))
                await asyncio.sleep(0.05)

        async def pool(stream: Any) -> None:
            await stream.recv_message()
            await asyncio.sleep(3600)

        def handler(fn: Any) -> grpclib.const.Handler:
            return grpclib.const.Handler(fn, grpclib.const.Cardinality.UNARY_STREAM, bytes, bytes)

        return {
            rpc.SERVICE + "WatchKvPoolCatalog": handler(catalog),
            rpc.SERVICE + "SubscribeKvPool": handler(pool),
        }


async def test_a_first_message_that_never_comes_ends_silent_however_busy_the_channel() -> None:
    """Until its first message a stream is silent only while its whole channel is (its turn
    may come after other streams' snapshots), but never longer than ``FIRST_MESSAGE_FACTOR``
    times its silence: a channel kept busy by another stream cannot hold it open for ever."""
    server = Server([_Chatty()], codec=RawCodec())
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]
    ch = Channel("127.0.0.1", port, codec=ClientCodec())
    talk = asyncio.ensure_future(rpc.run_stream(
        ch, "WatchKvPoolCatalog", rpc.catalog_request("t"), pb.KvPoolCatalogUpdate,
        lambda _m: None, silence_s=5.0))  # fmt: skip
    try:
        t0 = asyncio.get_running_loop().time()
        end = await asyncio.wait_for(rpc.run_stream(
            ch, "SubscribeKvPool", pb.SubscribeKvPoolRequest(), pb.FilterUpdate,
            lambda _m: None, silence_s=0.25), 10)  # fmt: skip
        took = asyncio.get_running_loop().time() - t0
        assert end.reason == E.SILENT
        assert rpc.FIRST_MESSAGE_FACTOR * 0.25 - 0.05 <= took < 5.0, took
        assert not talk.done()
    finally:
        talk.cancel()
        ch.close()
        server.close()
        await server.wait_closed()


async def test_a_compressed_reply_ends_its_stream_as_compressed() -> None:
    """A relay whose replies come gzip-compressed (a grpcio server with compression on, though
    the SDK offers no encoding): the stream ends ``compressed``, with a message that says so. It
    ended ``envelope``, as if the relay had sent garbage, and the SDK looped on that."""

    async def catalog(_request: bytes, _context: Any) -> AsyncIterator[bytes]:
        pools = pb.KvPoolCatalogSnapshot(pools=[descriptor()] * 4)  # (one that gzip shrinks)
        yield bytes(pb.KvPoolCatalogUpdate(protocol_version=1, revision=1, snapshot=pools))

    handlers = {"WatchKvPoolCatalog": grpc.unary_stream_rpc_method_handler(catalog)}
    server = grpc.aio.server(compression=grpc.Compression.Gzip)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        rpc.SERVICE.strip("/"), handlers),))  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ch = rpc.open_channel(rpc.RelayAddress("127.0.0.1", port))
    seen: list[Any] = []
    try:
        end = await rpc.run_stream(ch, "WatchKvPoolCatalog", rpc.catalog_request("t"),
                                   pb.KvPoolCatalogUpdate, seen.append)  # fmt: skip
        assert end.reason == E.COMPRESSED, end
        assert "compressed" in end.message and "identity" in end.message, end
        assert seen == []
    finally:
        ch.close()
        await server.stop(0)


async def test_a_relay_that_answers_a_unary_call_in_one_go_is_heard() -> None:
    """The check that a silent pool stream's connection still carries answers (``channel_deaf``)
    asks ``GetRelayInfo`` and cancels once the reply's headers come. A grpcio server (Dynamo's
    relay likewise) sends headers, message and trailers together: the stream had ended when the
    SDK cancelled it, the cancel raised, and the answer was taken for none. The SDK then
    replaced a working connection, dropping every pool of that relay."""
    calls: list[bytes] = []

    async def info(request: bytes, _context: Any) -> bytes:
        calls.append(request)
        return bytes(pb.RelayInfo(protocol_version=1))

    handlers = {"GetRelayInfo": grpc.unary_unary_rpc_method_handler(info)}
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        rpc.SERVICE.strip("/"), handlers),))  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ch = rpc.open_channel(rpc.RelayAddress("127.0.0.1", port))
    try:
        for _ in range(3):
            assert await rpc._answers(ch, 5.0)
        assert len(calls) == 3
    finally:
        ch.close()
        await server.stop(0)
    ch = rpc.open_channel(rpc.RelayAddress("127.0.0.1", port))  # nothing listens there now
    try:
        assert not await rpc._answers(ch, 1.0)
    finally:
        ch.close()
