"""The concurrent-stream limit before a client has acknowledged the relay's SETTINGS.

RFC 9113's initial SETTINGS_MAX_CONCURRENT_STREAMS is unlimited: a client may open many streams
in its first flight, before it has read the relay's SETTINGS (tonic's does). h2 enforced its
built-in 100 until the client acknowledged the relay's announced cap, and treated the 101st
stream as a connection error: GOAWAY ``PROTOCOL_ERROR``, every stream of the connection lost.
Now the relay's cap is in force from the first byte, and a stream over the limit in force is
refused alone (RST_STREAM ``REFUSED_STREAM``), bounded by the guard's budgets.

The clients are raw ``h2`` clients over loopback TCP (``tests/support/h2_client.py``); every
stream they open here is written before the client reads a byte, so before its ACK.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import hpack
from h2.errors import ErrorCodes
from hyperframe.frame import DataFrame

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from kvrelay.contract.wire import CONTRACT_MARKER
from kvrelay.service.h2.guard import ENHANCE_YOUR_CALM, H2Budgets
from kvrelay.service.server import RelayServer
from tests.support.h2_client import (
    PREFACE_AND_SETTINGS,
    RawH2Client,
    RawStream,
    frame,
    plane_request,
)
from tests.support.mem_relay import MemRelayView

INFO = bytes(pb.RelayInfoRequest(contract_marker=CONTRACT_MARKER))
REFUSED = int(ErrorCodes.REFUSED_STREAM)


async def _eventually(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def _relay(
    cap: int | None = None, budgets: H2Budgets | None = None, limits: RelayLimits | None = None
) -> RelayServer:
    server = RelayServer(MemRelayView(limits), limits)
    if cap is not None:
        server._server.max_concurrent_streams = cap
    if budgets is not None:
        server._server.h2_guard = (budgets, server.service.h2_counters)
    await server.start("127.0.0.1", 0)
    return server


def _abuse(server: RelayServer) -> dict[str, int]:
    return {k: v for k, v in server.service.guard_stats()[2].items() if v}


def _finish(client: RawH2Client, streams: list[RawStream], message: bytes) -> None:
    """Send the request of each of ``streams`` (opened with ``end=False``) and end it."""
    by_stream = {id(st): sid for sid, st in client.streams.items()}
    framed = b"\x00" + len(message).to_bytes(4, "big") + message
    for st in streams:
        client.h2.send_data(by_stream[id(st)], framed, end_stream=True)
    client.flush()


async def test_more_streams_than_h2s_default_before_the_settings_ack_are_all_served() -> None:
    """150 unary calls in the first flight, on the relay's cap (832 by its limits): all are
    answered and the connection stays up (before: the 101st ended the connection, GOAWAY
    PROTOCOL_ERROR, and none was answered)."""
    server = await _relay()
    client = await RawH2Client.connect(server.port)
    try:
        calls = [client.open("GetRelayInfo", INFO) for _ in range(150)]
        await asyncio.wait_for(asyncio.gather(*(c.ended.wait() for c in calls)), 20)
        assert client.goaway is None and not client.closed.is_set()
        assert [c.status for c in calls] == ["0"] * 150
        assert _abuse(server) == {}
        # and the connection goes on
        later = client.open("GetRelayInfo", INFO)
        await asyncio.wait_for(later.ended.wait(), 10)
        assert later.status == "0"
    finally:
        await client.close()
        await server.close(grace_s=0.5)


async def test_streams_over_the_cap_in_force_are_refused_alone() -> None:
    """A cap of 20, in force from the first byte: of 30 streams opened in the first flight (each
    with a header of its own, so each header block changes the HPACK table), the 10 over it get
    RST_STREAM REFUSED_STREAM, counted; the 20 complete once their requests come, and a stream
    opened after them is read right (the refused blocks were decoded too)."""
    server = await _relay(cap=20)
    client = await RawH2Client.connect(server.port)
    try:
        opened = [client.open("GetRelayInfo", b"", end=False, headers=(("x-n", str(i)),))
                  for i in range(30)]  # fmt: skip
        held, over = opened[:20], opened[20:]
        await asyncio.wait_for(asyncio.gather(*(s.ended.wait() for s in over)), 10)
        assert [(s.reset, s.reset_code) for s in over] == [(True, REFUSED)] * 10
        assert not any(s.ended.is_set() for s in held)
        assert client.goaway is None
        assert _abuse(server) == {"refused_stream": 10}
        _finish(client, held, INFO)
        await asyncio.wait_for(asyncio.gather(*(s.ended.wait() for s in held)), 10)
        assert [s.status for s in held] == ["0"] * 20
        later = client.open("GetRelayInfo", INFO, headers=(("x-n", "later"),))
        await asyncio.wait_for(later.ended.wait(), 10)
        assert later.status == "0" and client.goaway is None
    finally:
        await client.close()
        await server.close(grace_s=0.5)


async def test_a_client_that_keeps_opening_refused_streams_is_bounded() -> None:
    """Refused streams count as new streams: past ``max_streams`` per window the connection
    gets GOAWAY ENHANCE_YOUR_CALM (stream_flood), as for streams that were served."""
    server = await _relay(cap=4, budgets=H2Budgets(max_streams=64))
    client = await RawH2Client.connect(server.port)
    try:
        for _ in range(100):
            client.open("GetRelayInfo", b"", end=False)
        await asyncio.wait_for(client.closed.wait(), 10)
        assert client.goaway is not None and client.goaway.error_code == ENHANCE_YOUR_CALM
        counts = _abuse(server)
        # (how many h2 refused before the flood ended it depends on how the 100 HEADERS were
        # read: in one read, the guard counts them all before h2 sees one past the cap)
        assert counts["stream_flood"] == 1 and counts.get("refused_stream", 0) <= 60
    finally:
        await client.close()
        await server.close(grace_s=0.5)


async def test_frames_on_a_refused_stream_count_as_frames_on_a_closed_stream() -> None:
    """h2 answers each DATA frame on a refused stream with RST_STREAM (STREAM_CLOSED); the guard
    counts them as frames on a closed stream, so a flood of them ends the connection (before
    it knew of no refusal: they were a request's own frames, never counted)."""
    server = await _relay(cap=2, budgets=H2Budgets(max_empty_frames=64))
    client = await RawH2Client.connect(server.port)
    try:
        opened = [client.open("GetRelayInfo", b"", end=False) for _ in range(3)]
        await asyncio.wait_for(opened[2].ended.wait(), 10)
        assert opened[2].reset_code == REFUSED
        sid = max(client.streams)
        # (the client's own h2 refuses to send on a reset stream: the frames are written raw)
        data_frame = DataFrame(sid, data=b"x").serialize()
        for _ in range(10):
            if client.closed.is_set():
                break
            client._writer.write(data_frame * 20)
            await asyncio.sleep(0.05)
        await asyncio.wait_for(client.closed.wait(), 10)
        assert client.goaway is not None and client.goaway.error_code == ENHANCE_YOUR_CALM
        assert _abuse(server) == {"refused_stream": 1, "empty_frames": 1}
    finally:
        await client.close()
        await server.close(grace_s=0.5)


async def test_frames_on_a_stream_reset_for_malformed_headers_count_as_on_a_closed_one() -> None:
    """The same for a stream the relay resets because its request lacks ``:path`` (``mend``):
    its client's DATA frames on it, each answered with RST_STREAM, were a request's own frames
    to the guard, never counted."""
    server = await _relay(budgets=H2Budgets(max_empty_frames=64))
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        no_path = hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"),
                                          ("content-type", "application/grpc")])  # fmt: skip
        writer.write(PREFACE_AND_SETTINGS + frame(0x1, 0x4, 1, no_path))
        got = bytearray()

        async def pump() -> None:  # every byte the relay sends, to its close
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(65536):
                    got.extend(data)

        reading = asyncio.ensure_future(pump())
        await _eventually(lambda: _abuse(server).get("malformed_headers") == 1)
        data_frame = DataFrame(1, data=b"x").serialize()
        for _ in range(10):
            if reading.done():
                break
            with contextlib.suppress(ConnectionError):  # (closed by the relay meanwhile)
                writer.write(data_frame * 20)
            await asyncio.sleep(0.05)
        await asyncio.wait_for(reading, 10)
        goaway = got.rfind(b"\x07\x00\x00\x00\x00\x00")
        assert goaway >= 0
        assert got[goaway + 10 : goaway + 14] == ENHANCE_YOUR_CALM.to_bytes(4, "big")
        assert _abuse(server) == {"malformed_headers": 1, "empty_frames": 1}
    finally:
        writer.close()
        await server.close(grace_s=0.5)


async def test_streams_opened_before_the_ack_keep_their_shares() -> None:
    """A lone client may hold a whole stream limit of 150 catalog streams, all opened in its
    first flight; a router on another address is still served by preempting its newest."""
    limits = RelayLimits(max_catalog_subscribers=150)
    server = await _relay(limits=limits)
    svc = server.service
    hostile = await RawH2Client.connect(server.port, "127.0.0.2", window=0)
    router = None
    try:
        streams = [hostile.open("WatchKvPoolCatalog", plane_request(f"h{i}")) for i in range(150)]
        await _eventually(lambda: svc.catalog_permits.in_use == 150)
        assert hostile.goaway is None and not any(s.ended.is_set() for s in streams)
        router = await RawH2Client.connect(server.port, "127.0.0.1")
        mine = router.open("WatchKvPoolCatalog", plane_request("router"))
        await _eventually(lambda: svc.preemption_stats() == {("catalog", "connection"): 1})
        await _eventually(lambda: len(mine.data) > 0)
        assert not mine.ended.is_set() and svc.catalog_permits.in_use == 150
    finally:
        for c in (hostile, router):
            if c is not None:
                await c.close()
        await server.close(grace_s=0.5)
