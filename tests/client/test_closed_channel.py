"""A closed ``RelayChannel`` never connects again, over a real loopback socket.

grpclib's channel reconnects whenever a call finds no connection, also after ``close()``: a
call already connecting when its owner closed the channel (a mirror's pool stream resubscribing
on the channel the mirror was replacing) completed its connection and ran on it, a connection
nobody owned (kept open by keepalive), one more per upstream drop. The server here only counts
the connections it is offered: no call needs an answer to show whether it connected."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from grpclib.const import Cardinality

from kvrelay._grpc import RelayChannel
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import errors as E
from kvrelay.client import rpc
from kvrelay.client.codec import ClientCodec
from kvrelay.contract.wire import CONTRACT_MARKER
from kvrelay.service.server import RelayServer
from tests.support.mem_relay import Generation, MemRelayView
from tests.support.timing import scaled


class _Counted(asyncio.Protocol):
    """Takes whatever a client sends, answers nothing, and counts connections made and lost."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.counts["made"] += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.counts["lost"] += 1


async def _info(ch: RelayChannel) -> None:
    """One GetRelayInfo call (never answered here: it fails, or waits until cancelled)."""
    async with ch.request(
        rpc.SERVICE + "GetRelayInfo", Cardinality.UNARY_UNARY, pb.RelayInfoRequest, pb.RelayInfo
    ) as st:  # fmt: skip
        await st.send_message(pb.RelayInfoRequest(contract_marker=CONTRACT_MARKER), end=True)
        await st.recv_message()


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_a_closed_channel_closes_a_late_connection_and_never_connects_again() -> None:
    counts = {"made": 0, "lost": 0}
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Counted(counts), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ch = RelayChannel("127.0.0.1", port, codec=ClientCodec())
    try:
        call = asyncio.create_task(_info(ch))
        await asyncio.sleep(0)  # the call is connecting (grpclib's ``__connect__``)
        ch.close()
        # it connected after the close: that connection is closed at once, and the call fails
        # as one that cannot connect (it ran on a connection nobody owned)
        with pytest.raises(ConnectionError, match="the channel is closed"):  # ``ChannelClosed``
            await asyncio.wait_for(call, 3.0)
        assert ch.closed and ch.closed_late == 1
        await _until(lambda: counts["made"] == counts["lost"] == 1, "the late connection closed")
        # a call on the closed channel fails at once, without connecting
        with pytest.raises(ConnectionError, match="the channel is closed"):  # ``ChannelClosed``
            await asyncio.wait_for(_info(ch), 3.0)
        end = await rpc.run_stream(  # the SDK's and the mirror's streams: a connection end
            ch, "WatchKvPoolCatalog", rpc.catalog_request("t"), pb.KvPoolCatalogUpdate, print
        )  # fmt: skip
        assert (end.reason, end.messages, end.unsent) == (E.CONNECTION, 0, True), end
        assert end.message == "ChannelClosed: the channel is closed"
        # a connection the server refuses is a connection end too, but the call was not refused
        # unsent by its own channel (a mirror follows only the latter to its new channel)
        server.close()
        await server.wait_closed()
        open_ch = RelayChannel("127.0.0.1", port, codec=ClientCodec())
        try:
            end = await rpc.run_stream(
                open_ch, "WatchKvPoolCatalog", rpc.catalog_request("t"), pb.KvPoolCatalogUpdate,
                print,
            )  # fmt: skip
        finally:
            open_ch.close()
        assert (end.reason, end.unsent) == (E.CONNECTION, False), end
        await asyncio.sleep(0.05)  # (a connection made anyway would be counted by now)
        assert counts == {"made": 1, "lost": 1}
        assert ch._protocol is None
    finally:
        ch.close()
        server.close()
        await server.wait_closed()



async def _stopped_at(port: int, gen: Generation, at: int, cancel: bool) -> asyncio.Task[Any]:
    """A pool stream on a fresh channel, its channel closed (and, with ``cancel``, its task
    cancelled in the same turn) once its ``at``-th message is taken: the ended task."""
    ch = rpc.open_channel(rpc.RelayAddress("127.0.0.1", port))
    loop = asyncio.get_running_loop()
    got: list[pb.FilterUpdate] = []

    def stop() -> None:
        if cancel:
            task.cancel()
        ch.close()

    def on(msg: pb.FilterUpdate) -> None:
        got.append(msg)
        if len(got) == 1 and at == 2:
            gen.random_step(np.random.default_rng(3), 8)  # a delta follows
        if len(got) == at:
            loop.call_soon(stop)  # once the stream waits for its next message

    task = asyncio.create_task(rpc.run_stream(
        ch, "SubscribeKvPool", rpc.pool_request("t", gen.producer), pb.FilterUpdate, on,
    ))  # fmt: skip
    done, _ = await asyncio.wait({task}, timeout=scaled(5.0))
    assert done, "the stream never ended"
    assert len(got) == at
    return task


@pytest.mark.parametrize("at", [1, 2])
async def test_a_stream_cancelled_as_its_channel_closes_ends_cancelled(at: int) -> None:
    """A stream task cancelled by its owner as the owner closes its channel in the same turn
    (a mirror's stop, a catalog refresh while a pool replaces the channel) ends cancelled, at
    its snapshot (``at`` 1) or at a delta (2): grpclib, waking the task for the closed
    connection, raised ``StreamTerminatedError`` in place of the ``CancelledError``, and the
    stream ended as a lost connection, its loop connecting again after it was stopped. Without
    a cancellation, the same close is still a connection end."""
    view = MemRelayView()
    gen = view.add_pool("pool-a", 1024)
    server = RelayServer(view)
    await server.start("127.0.0.1", 0)
    try:
        task = await _stopped_at(server.port, gen, at, cancel=True)
        assert task.cancelled(), task.result()
        task = await _stopped_at(server.port, gen, at, cancel=False)
        assert task.result().reason == E.CONNECTION, task.result()
    finally:
        await server.close(grace_s=0.5)
