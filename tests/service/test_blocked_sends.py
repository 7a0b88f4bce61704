"""A pool stream blocked in a send when it ends: a drain, a fence, a lag.

HTTP/2 flow control holds DATA, never HEADERS: a stream whose send has written nothing of its
message yet can end with its trailers at once, however little its client reads; one that has
written part of a message cannot (the trailers would be read as the message's rest), so it
finishes the message when its client reads again, or is reset after the stall grace.

A raw HTTP/2 client over loopback that never gives a window back (``_read_data = False``): the
connection's window runs out, and the relay's sends wait for it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from kvrelay.contract.errors import RelayError
from kvrelay.contract.limits import RelayLimits
from kvrelay.service.server import RelayServer
from tests.support.fleet import eventually
from tests.support.h2_client import RawH2Client
from tests.support.mem_relay import MemRelayView, sub_request
from tests.support.timing import scaled

UNAVAILABLE = ("14", "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE")


def _messages(data: bytes | bytearray) -> int:
    """Whole gRPC messages in ``data``."""
    n, off = 0, 0
    while off + 5 <= len(data):
        size = int.from_bytes(data[off + 1 : off + 5], "big")
        if off + 5 + size > len(data):
            break
        n, off = n + 1, off + 5 + size
    return n


async def _relay(**limits_kw: Any) -> tuple[MemRelayView, RelayServer]:
    limits = RelayLimits(stalled_stream_reset_s=120.0, **limits_kw)
    view = MemRelayView(limits)
    server = RelayServer(view, limits)
    await server.start("127.0.0.1", 0)
    return view, server


@pytest.mark.parametrize("ending", ["drain", "fence"])
async def test_a_snapshot_send_that_wrote_nothing_ends_at_once_with_its_status(ending: str) -> None:
    """The first stream fills the connection's window in the middle of its chunk and steps
    aside (its own window is empty too); the second holds the turn, its chunk not begun,
    waiting for the connection's window. Ended, the second sends its status at once; the
    first, in the middle of a message, keeps waiting for its client (no trailers, no reset)."""
    view, server = await _relay()
    gens = [view.add_pool(f"blocked-{i}", 1 << 17) for i in range(2)]
    c = await RawH2Client.connect(server.port)
    c._read_data = False
    closing: asyncio.Future[None] | None = None
    try:
        first = c.open("SubscribeKvPool", bytes(sub_request(gens[0].producer, "raw")))
        await eventually(lambda: len(first.data) > 0)
        second = c.open("SubscribeKvPool", bytes(sub_request(gens[1].producer, "raw")))
        await eventually(lambda: server.service.pool_permits.in_use == 2)
        await eventually(lambda: "grpc-status" in second.headers or ":status" in second.headers)
        await asyncio.sleep(0.2)  # it holds the turn, waiting for the connection's window
        assert not second.data and not second.ended.is_set()
        if ending == "drain":
            closing = asyncio.ensure_future(server.close(grace_s=120.0))
            expected: tuple[str, str | None] = ("0", None)
        else:
            gens[1].retire(RelayError.publication_unavailable("generation fenced"))
            expected = UNAVAILABLE
        await asyncio.wait_for(second.ended.wait(), scaled(10))
        assert (second.status, second.reason) == expected, second.trailers
        assert not second.reset and not second.data
        await asyncio.sleep(0.2)
        assert not first.ended.is_set() and not first.trailers  # its message is half written
    finally:
        await c.close()
        if closing is not None:
            await asyncio.wait_for(closing, scaled(10))
        else:
            await server.close(grace_s=1.0)


@pytest.mark.parametrize("ending", ["drain", "lag"])
async def test_a_delta_send_that_wrote_nothing_ends_at_once_with_its_status(ending: str) -> None:
    """A caught-up stream whose delta waits for the connection's window (another stream's
    snapshot took it) ends with its status at once, before its client reads: OK in a drain,
    SUBSCRIBER_LAGGED once the deltas queued behind it overflow its queue."""
    view, server = await _relay(publication_queue_capacity=4)
    small = view.add_pool("small", 1 << 10)
    big = view.add_pool("big", 1 << 17)
    c = await RawH2Client.connect(server.port)
    closing: asyncio.Future[None] | None = None
    try:
        live = c.open("SubscribeKvPool", bytes(sub_request(small.producer, "raw")))
        await eventually(lambda: _messages(live.data) >= 1)  # its snapshot (one chunk)
        c._read_data = False  # from now on nothing is given back
        snap = c.open("SubscribeKvPool", bytes(sub_request(big.producer, "raw")))
        await eventually(lambda: len(snap.data) > 0)
        sent = len(live.data)
        rng = np.random.default_rng(7)
        small.random_step(rng, 4)  # queued: the connection's window is empty
        await asyncio.sleep(0.2)
        assert len(live.data) == sent and not live.ended.is_set()
        if ending == "drain":
            closing = asyncio.ensure_future(server.close(grace_s=120.0))
            expected: tuple[str, str | None] = ("0", None)
        else:
            for _ in range(8):  # the queue holds 4
                small.random_step(rng, 4)
            expected = ("8", "RELAY_ERROR_REASON_SUBSCRIBER_LAGGED")
        await asyncio.wait_for(live.ended.wait(), scaled(10))
        assert (live.status, live.reason) == expected and not live.reset, live.trailers
        assert len(live.data) == sent
    finally:
        await c.close()
        if closing is not None:
            await asyncio.wait_for(closing, scaled(10))
        else:
            await server.close(grace_s=1.0)


async def test_a_stream_reset_with_its_status_unread_is_counted() -> None:
    """A client that takes part of a snapshot chunk and stops: the stream ends
    SNAPSHOT_PROGRESS_TIMEOUT, its status waits behind the half-written chunk, and after the
    stall grace the stream is reset. Nothing counted that end
    (``kvrelay_stream_errors_total`` counted only statuses written); it is counted now, by its
    reason, as the stream is reset."""
    limits = RelayLimits(stalled_stream_reset_s=0.5, snapshot_progress_timeout_s=0.3)
    view = MemRelayView(limits)
    server = RelayServer(view, limits)
    await server.start("127.0.0.1", 0)
    gen = view.add_pool("stalled", 1 << 17)
    c = await RawH2Client.connect(server.port)
    c._read_data = False  # the connection's window runs out in the middle of the chunk
    reason = "RELAY_ERROR_REASON_SNAPSHOT_PROGRESS_TIMEOUT"
    try:
        st = c.open("SubscribeKvPool", bytes(sub_request(gen.producer, "raw")))
        await asyncio.wait_for(st.ended.wait(), scaled(10))
        assert st.reset and not st.trailers and len(st.data) > 0
        await eventually(lambda: server.service.errors.get(reason, 0) == 1)
    finally:
        await c.close()
        await server.close(grace_s=1.0)
