"""The SDK's channel and a relay that drains while its successor already accepts on the same
port (a hot upgrade's hand-over), over real loopback sockets.

kvrelay sends grpclib's client no GOAWAY (grpclib fails every stream it holds on one), so the
SDK's connection stays open through the drain, and every call made on it meanwhile is refused
``UNAVAILABLE`` / ``PUBLICATION_UNAVAILABLE`` ("the relay is shutting down"). The channel must
make its next call on a new connection, which reaches the successor: it retried on the draining
one until that connection closed, up to the drain's grace (here held open by another client
that does not read)."""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest
from grpclib.client import Channel

from kvrelay._grpc import RelayChannel
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import errors as E
from kvrelay.client import rpc
from kvrelay.client.rpc import RelayAddress, open_channel
from kvrelay.service.h2 import drain
from kvrelay.service.server import RelayServer
from tests.support.h2_client import RawH2Client, plane_request
from tests.support.mem_relay import MemRelayView

GRACE_S = 20.0  # the drain, held open by a client that never reads, outlasts the test


class _First(Exception):
    """A stream's first reply (ends the stream: the test wants to know who answered)."""

    def __init__(self, msg: pb.KvPoolCatalogUpdate) -> None:
        super().__init__()
        self.msg = msg


async def _who_answers(channel: Channel) -> int | rpc.StreamEnd:
    """The relay incarnation of the first catalog on a new call, or how that call ended."""

    def first(msg: pb.KvPoolCatalogUpdate) -> None:
        raise _First(msg)

    try:
        return await asyncio.wait_for(
            rpc.run_stream(
                channel, "WatchKvPoolCatalog", rpc.catalog_request("drain"),
                pb.KvPoolCatalogUpdate, first,
            ),
            10,
        )  # fmt: skip
    except _First as got:
        assert got.msg.relay is not None
        return int(got.msg.relay.relay_incarnation)


@pytest.mark.parametrize("tell_grpclib", [False, True])
async def test_a_call_refused_by_a_draining_relay_sends_the_next_to_the_successor(
    tell_grpclib: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tell_grpclib``: the relay sends grpclib its GOAWAY too (as other gRPC servers do):
    the channel then reconnects at once, and no call is refused."""
    if tell_grpclib:
        monkeypatch.setattr(drain, "_GRPCLIB_AGENT", "no-such-agent/")
    old, new = MemRelayView(), MemRelayView()
    new.relay_identity = pb.RelayIdentity(drt_instance_id=77, relay_incarnation=0x5EC04D)
    new._republish_catalog()  # (its catalog names the new identity)
    old_server, new_server = RelayServer(old), RelayServer(new)
    await old_server.start("127.0.0.1", 0)
    port = old_server.port
    # never reads, its message half written: the drain waits for it
    holder = await RawH2Client.connect(port, window=8)
    channel = open_channel(RelayAddress("127.0.0.1", port))
    assert isinstance(channel, RelayChannel)
    closing = None
    try:
        holder.open("WatchKvPoolCatalog", plane_request("holder"))
        assert await _who_answers(channel) == old.relay_identity.relay_incarnation
        # an open stream of the channel, ended OK by the drain
        got: list[pb.KvPoolCatalogUpdate] = []
        watch = asyncio.create_task(
            rpc.run_stream(
                channel, "WatchKvPoolCatalog", rpc.catalog_request("w"), pb.KvPoolCatalogUpdate,
                got.append,
            )
        )  # fmt: skip
        while not got:
            await asyncio.sleep(0.01)
        closing = asyncio.create_task(old_server.close(grace_s=GRACE_S))
        await asyncio.sleep(0)  # the old listener is closed: the successor binds the port
        await new_server.start("127.0.0.1", port)
        assert (await asyncio.wait_for(watch, 10)).reason == E.EOF
        started = time.monotonic()
        answers = [await _who_answers(channel)]
        if not tell_grpclib:  # the draining relay refuses the first call made on its connection
            refused = answers[0]
            assert isinstance(refused, rpc.StreamEnd)
            assert refused.reason == "publication_unavailable", refused
            answers.append(await _who_answers(channel))
        assert answers[-1] == new.relay_identity.relay_incarnation, answers
        assert not closing.done()  # served by the successor while the old relay still drains
        assert time.monotonic() - started < GRACE_S / 2
        # the draining connection was left once, and closed after its last stream (the refused
        # one): nothing of the channel holds the old relay's drain
        assert channel.left_draining == (0 if tell_grpclib else 1)
        assert not channel._leaving
    finally:
        channel.close()
        await holder.close()
        if closing is not None:
            await closing
        await new_server.close(grace_s=1.0)


class _Draining(asyncio.Protocol):
    """A server that keeps each connection's first call open (one catalog message, then the
    rest when ``finish`` is set) and refuses every later call on it as draining, trailers only."""

    def __init__(self, connections: list[_Draining], finish: asyncio.Event) -> None:
        connections.append(self)
        self.finish = finish
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        )
        self.transport: Any = None
        self.calls: list[int] = []
        self.closed = asyncio.Event()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.h2.initiate_connection()
        transport.write(self.h2.data_to_send())

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed.set()

    def data_received(self, data: bytes) -> None:
        for ev in self.h2.receive_data(data):
            if isinstance(ev, h2.events.RequestReceived):
                self.calls.append(ev.stream_id)
                if len(self.calls) == 1:
                    self.h2.send_headers(ev.stream_id, _OK_HEADERS)
                    self.h2.send_data(ev.stream_id, _CATALOG)
                    asyncio.get_running_loop().create_task(self._end_later(ev.stream_id))
                else:
                    self.h2.send_headers(ev.stream_id, [*_OK_HEADERS, *_REFUSAL], end_stream=True)
        self.transport.write(self.h2.data_to_send())

    async def _end_later(self, sid: int) -> None:
        await self.finish.wait()
        self.h2.send_data(sid, _CATALOG)
        self.h2.send_headers(sid, [("grpc-status", "0")], end_stream=True)
        self.transport.write(self.h2.data_to_send())


_OK_HEADERS = [(":status", "200"), ("content-type", "application/grpc")]
_REFUSAL = [
    ("grpc-status", "14"),
    ("grpc-message", "the relay is shutting down"),
    ("kv-relay-error-reason", "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"),
]
_SCRIPTED = bytes(pb.KvPoolCatalogUpdate(relay=pb.RelayIdentity(relay_incarnation=7)))
_CATALOG = b"\0" + struct.pack(">I", len(_SCRIPTED)) + _SCRIPTED


async def test_a_left_connection_keeps_its_open_streams_and_closes_after_the_last() -> None:
    """Leaving a connection sends new calls elsewhere; it cuts nothing: a stream still open on
    it reads the rest of its replies and its OK end there, and the channel then closes it."""
    loop = asyncio.get_running_loop()
    connections: list[_Draining] = []
    finish = asyncio.Event()
    server = await loop.create_server(lambda: _Draining(connections, finish), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    channel = open_channel(RelayAddress("127.0.0.1", port))
    got: list[pb.KvPoolCatalogUpdate] = []
    try:
        held = asyncio.create_task(
            rpc.run_stream(
                channel, "WatchKvPoolCatalog", rpc.catalog_request("held"),
                pb.KvPoolCatalogUpdate, got.append,
            )
        )  # fmt: skip
        while not got:
            await asyncio.sleep(0.01)
        refused = await _who_answers(channel)  # the second call on connection 1
        assert isinstance(refused, rpc.StreamEnd) and refused.reason == "publication_unavailable"
        opened = await _who_answers(channel)  # a new connection's first call
        assert opened == 7 and len(connections) == 2, (opened, len(connections))
        assert [len(c.calls) for c in connections] == [2, 1]
        assert not connections[0].closed.is_set() and not held.done()
        finish.set()  # the held stream ends OK on the left connection, which is then closed
        end = await asyncio.wait_for(held, 10)
        assert (end.reason, end.messages) == (E.EOF, 2)
        await asyncio.wait_for(connections[0].closed.wait(), 10)
        assert not connections[1].closed.is_set()  # the channel's current connection stays
    finally:
        channel.close()
        server.close()
        await server.wait_closed()
