"""HTTP/2 abuse with real clients: rapid reset, PING and SETTINGS floods, oversized headers, a
stream that never sends its request.

The attacker is a raw ``h2`` client (``tests/support/h2_client.py``) writing frames as fast as
it can; the bystanders are grpclib clients on their own connections. Oracles: the GOAWAY code
the attacker reads, that its connection ends, and that the bystanders' call answers and their
catalog stream receives the next update while it happens. Every test runs on asyncio's loop and
on uvloop's (``conftest.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import h2.exceptions
import h2.settings
import hpack
import pytest
from grpclib.client import Channel

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from kvrelay.contract.wire import CONTRACT_MARKER
from kvrelay.ops.tls import client_ssl_context, server_ssl_context
from kvrelay.service.h2.guard import ENHANCE_YOUR_CALM, H2Budgets, goaway
from kvrelay.service.h2.request import MAX_REQUEST_BYTES
from kvrelay.service.server import RelayServer
from tests.support.h2_client import (
    PREFACE_AND_SETTINGS,
    RawH2Client,
    RawStream,
    frame,
    plane_request,
)
from tests.support.mem_relay import MemRelayView
from tests.support.timing import scaled

BUDGETS = H2Budgets()


INFO = bytes(pb.RelayInfoRequest(contract_marker=CONTRACT_MARKER))


def _rapid_reset(c: RawH2Client) -> None:
    sid = c.h2.get_next_available_stream_id()
    c.h2.send_headers(sid, [
        (":method", "POST"), (":scheme", "http"), (":authority", "relay"),
        (":path", "/dynamo.kvrelay.v1.KvEventRelay/GetRelayInfo"),
        ("content-type", "application/grpc"), ("te", "trailers"),
    ])  # fmt: skip
    c.h2.reset_stream(sid)


def _ping(c: RawH2Client) -> None:
    c.h2.ping(b"12345678")


def _settings(c: RawH2Client) -> None:
    c.h2.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100})


def _oversized(c: RawH2Client) -> None:
    # HPACK's Huffman coding of 75 KB takes about a second in pure Python; the literal is as big
    # either way, so the attacker sends it plain (the guard counts header-block bytes)
    encode = c.h2.encoder.encode
    if not getattr(encode, "plain", False):
        def plain(headers: object, huffman: bool = True) -> bytes:
            return encode(headers, huffman=False)
        plain.plain = True  # type: ignore[attr-defined]
        c.h2.encoder.encode = plain  # type: ignore[method-assign]
    sid = c.h2.get_next_available_stream_id()
    c.h2.send_headers(sid, [
        (":method", "POST"), (":scheme", "http"), (":authority", "relay"),
        (":path", "/dynamo.kvrelay.v1.KvEventRelay/GetRelayInfo"),
        ("content-type", "application/grpc"), ("x-big", "Zq~" * 25_000),
    ])  # fmt: skip


ATTACKS: dict[str, Callable[[RawH2Client], None]] = {
    "rapid_reset": _rapid_reset,
    "ping_flood": _ping,
    "settings_flood": _settings,
    "oversized_headers": _oversized,
}


async def _info(port: int) -> float:
    t0 = time.monotonic()
    async with Channel("127.0.0.1", port) as ch:
        reply = await asyncio.wait_for(
            pb.KvEventRelayStub(ch).get_relay_info(pb.RelayInfoRequest(contract_marker=CONTRACT_MARKER)),
            10,
        )
    assert reply.contract_marker == CONTRACT_MARKER
    return time.monotonic() - t0


@pytest.mark.parametrize("reason", list(ATTACKS))
async def test_abusive_connection_gets_goaway_and_others_keep_their_streams(reason: str) -> None:
    view = MemRelayView()
    server = RelayServer(view)
    await server.start("127.0.0.1", 0)
    svc = server.service
    async with Channel("127.0.0.1", server.port) as bystander:
        stub = pb.KvEventRelayStub(bystander)
        catalog = stub.watch_kv_pool_catalog(pb.WatchKvPoolCatalogRequest(
            contract_marker=CONTRACT_MARKER, subscriber_id="router"))  # fmt: skip
        it = aiter(catalog)
        first = await asyncio.wait_for(anext(it), 10)
        attacker = await RawH2Client.connect(server.port, "127.0.0.2")
        try:
            sent = 0
            while attacker.goaway is None and not attacker.closed.is_set() and sent < 100_000:
                try:
                    for _ in range(1 if reason == "oversized_headers" else 50):
                        ATTACKS[reason](attacker)
                        sent += 1
                except h2.exceptions.ProtocolError:
                    break  # the client's own h2 saw the GOAWAY
                attacker.flush()
                await asyncio.sleep(0)  # let the relay read (the attack is as fast as it gets)
            await asyncio.wait_for(attacker.closed.wait(), 20)
            assert attacker.goaway is not None
            assert attacker.goaway.error_code == ENHANCE_YOUR_CALM
            assert svc.guard_stats()[2][reason] == 1
            limit = {
                "rapid_reset": BUDGETS.max_resets, "ping_flood": BUDGETS.max_pings,
                "settings_flood": BUDGETS.max_settings, "oversized_headers": 1,
            }[reason]  # fmt: skip
            assert sent <= 100 * limit  # closed early in the flood, not at its end
            # the bystander: a new call answers, and its catalog stream gets the next update
            assert await _info(server.port) < 5.0
            view.add_pool("pool-after", 1024)
            update = await asyncio.wait_for(anext(it), 10)
            assert update != first
        finally:
            await attacker.close()
    await server.close(grace_s=0.5)


async def test_a_stream_that_never_sends_its_request_is_ended() -> None:
    view = MemRelayView()
    server = RelayServer(view)
    server.service.request_timeout_s = 0.5
    await server.start("127.0.0.1", 0)
    c = await RawH2Client.connect(server.port, "127.0.0.2")
    try:
        streams = [c.open("WatchKvPoolCatalog", plane_request(), end=False) for _ in range(4)]
        c.open("GetRelayInfo", INFO, end=False)
        await asyncio.wait_for(asyncio.gather(*(s.ended.wait() for s in streams)), 20)
        assert {s.status for s in streams} == {"3"}  # INVALID_ARGUMENT
        assert {s.reason for s in streams} == {"RELAY_ERROR_REASON_INVALID_REQUEST"}
        await _eventually(lambda: server.service.guard_stats()[2]["request_timeout"] == 5)
        assert server.service.catalog_permits.in_use == 0  # no permit was ever taken
    finally:
        await c.close()
        await server.close(grace_s=0.5)


_SERVICE = b"dynamo.kvrelay.v1.KvEventRelay"
HEALTH_CHECK = b"\n" + bytes([len(_SERVICE)]) + _SERVICE  # HealthCheckRequest{service}
REFLECT = b"\x3a\x00"  # ServerReflectionRequest{list_services: ""}


@pytest.mark.parametrize(
    ("method", "body"),
    [("WatchKvPoolCatalog", plane_request()), ("GetRelayInfo", INFO),
     ("/grpc.health.v1.Health/Check", HEALTH_CHECK),
     ("/grpc.health.v1.Health/Watch", HEALTH_CHECK),
     ("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", REFLECT),
     ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", REFLECT)],
)  # fmt: skip
async def test_request_framing_is_checked_before_the_body_is_read(method: str, body: bytes) -> None:
    """A prefix claiming 2 GiB (over the message limit: RESOURCE_LIMIT), or just over the size
    of any valid request (INVALID_REQUEST), is refused at once, before any of the body is
    taken: the relay never buffers what a request claims, on its own RPCs as on grpclib's
    health and reflection services. A body shorter than
    its prefix and a compressed message are the client's fault (INVALID_REQUEST), not a relay
    bug (INTERNAL)."""
    view = MemRelayView()
    server = RelayServer(view)
    server.service.request_timeout_s = 5.0  # what waiting for the claimed body would end in
    await server.start("127.0.0.1", 0)
    c = await RawH2Client.connect(server.port, "127.0.0.2")
    try:
        huge = c.open(method, b"", raw=b"\x00" + (2**31).to_bytes(4, "big") + bytes(16_000),
                      end=False)  # fmt: skip
        over = c.open(method, b"", raw=b"\x00" + (MAX_REQUEST_BYTES + 1).to_bytes(4, "big"),
                      end=False)  # fmt: skip
        short = c.open(method, b"", raw=b"\x00" + (100).to_bytes(4, "big") + bytes(10))
        packed = c.open(method, b"", raw=b"\x01" + len(body).to_bytes(4, "big") + body)
        t0 = time.monotonic()
        await asyncio.wait_for(asyncio.gather(huge.ended.wait(), over.ended.wait()), 20)
        assert time.monotonic() - t0 < 4.0, "waited for the claimed body"
        assert (over.status, over.reason) == ("3", "RELAY_ERROR_REASON_INVALID_REQUEST")
        await asyncio.wait_for(asyncio.gather(short.ended.wait(), packed.ended.wait()), 20)
        assert (huge.status, huge.reason) == ("8", "RELAY_ERROR_REASON_RESOURCE_LIMIT")
        for st in (short, packed):
            assert (st.status, st.reason) == ("3", "RELAY_ERROR_REASON_INVALID_REQUEST")
        assert not any("INTERNAL" in str(k) for k in server.service.errors), server.service.errors
    finally:
        await c.close()
        await server.close(grace_s=0.5)


async def _eventually(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


async def test_idle_connections_are_pinged_every_keepalive_interval() -> None:
    """``keepalive_interval_s`` holds also with no call open and without data (grpclib's own
    defaults would ping at most every 300 s, and twice in all on an idle connection): a peer
    gone silent is noticed within the interval and the timeout."""
    server = RelayServer(MemRelayView(), RelayLimits(keepalive_interval_s=0.3))
    await server.start("127.0.0.1", 0)
    c = await RawH2Client.connect(server.port, "127.0.0.2")
    try:
        deadline = time.monotonic() + 2.0  # four intervals of 0.3 s, with room for a busy machine
        while c.pings < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert c.pings >= 4, c.pings
    finally:
        await c.close()
        await server.close(grace_s=0.5)


async def test_streams_reset_before_their_handler_runs_are_forgotten() -> None:
    """A stream reset in the same read as its HEADERS has its request task cancelled before it
    runs; grpclib forgot a stream only at the end of that task, so such streams stayed for the
    connection's life (within the reset budget, without end). They are released now."""
    server = RelayServer(MemRelayView())
    await server.start("127.0.0.1", 0)
    c = await RawH2Client.connect(server.port, "127.0.0.2")
    try:
        await asyncio.sleep(0.2)  # the connection is up on the server's side
        for _ in range(40):  # within the RST_STREAM budget; one write: HEADERS, RST_STREAM
            _rapid_reset(c)
        c.flush()
        probe = c.open("GetRelayInfo", INFO)  # answered after the resets were read
        await asyncio.wait_for(probe.ended.wait(), 10)
        protos = [p for p in server._server._protocols if hasattr(p, "processor")]
        assert len(protos) == 1
        await _eventually(lambda: not protos[0].processor.streams, timeout=5)
        assert server.service.guard_stats()[2]["rapid_reset"] == 0 and c.goaway is None
    finally:
        await c.close()
        await server.close(grace_s=0.5)


async def _raw_connection(
    port: int,
) -> tuple[asyncio.StreamWriter, bytearray, asyncio.Future[None]]:
    """A plain TCP connection from 127.0.0.2 that has sent the preface and empty SETTINGS:
    its writer, every byte the relay sends on it (as they come), and the reader's task (done
    when the relay closes the connection)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
    got = bytearray()

    async def read() -> None:
        while data := await reader.read(65536):
            got.extend(data)

    writer.write(PREFACE_AND_SETTINGS)
    return writer, got, asyncio.ensure_future(read())


def _server_reset_streams(n: int, first: int) -> bytes:
    """``n`` new streams, each ended by the client at once and then sent an empty DATA frame:
    h2 itself resets each (STREAM_CLOSED), so no RST_STREAM comes from the client."""
    block = hpack.Encoder().encode([
        (":method", "POST"), (":scheme", "http"), (":authority", "relay"),
        (":path", "/dynamo.kvrelay.v1.KvEventRelay/GetRelayInfo"),
        ("content-type", "application/grpc"), ("te", "trailers"),
    ])  # fmt: skip
    out = []
    for i in range(n):
        sid = first + 2 * i
        out += [frame(0x1, 0x5, sid, block), frame(0x0, 0x0, sid)]
    return b"".join(out)


@pytest.mark.parametrize(
    "flood", ["stream_flood", "priority", "ping_ack", "settings_ack", "closed_stream"]
)
async def test_floods_the_reset_count_never_sees_are_closed(flood: str) -> None:
    """Streams h2 resets itself (rapid reset without a client RST_STREAM) and frames that carry
    nothing (PRIORITY, PING or SETTINGS ACKs the relay never asked for, one-byte DATA frames on
    a stream the client already ended, each answered by h2 with RST_STREAM) have budgets of
    their own: GOAWAY ENHANCE_YOUR_CALM, counted, and a bystander is answered."""
    reason = "stream_flood" if flood == "stream_flood" else "empty_frames"
    server = RelayServer(MemRelayView())
    await server.start("127.0.0.1", 0)
    writer, got, pump = await _raw_connection(server.port)
    try:
        empty = BUDGETS.max_empty_frames + 8
        if flood == "stream_flood":
            burst = _server_reset_streams(BUDGETS.max_streams + 8, 1)
        elif flood == "priority":
            burst = frame(0x2, 0, 1, b"\x00\x00\x00\x00\x10") * empty
        elif flood == "closed_stream":
            ended = _server_reset_streams(1, 1)[: -9]  # stream 1: HEADERS with END_STREAM
            burst = ended + frame(0x0, 0x0, 1, b"x") * empty
        elif flood == "ping_ack":
            burst = frame(0x6, 0x1, 0, b"pingpong") * empty
        else:
            burst = frame(0x4, 0x1, 0) * empty
        writer.write(burst)
        await asyncio.wait_for(pump, 20)  # the relay closes the connection
        assert server.service.guard_stats()[2][reason] == 1
        goaway = got.rfind(b"\x07\x00\x00\x00\x00\x00")  # type 7, flags 0, stream 0
        calm = ENHANCE_YOUR_CALM.to_bytes(4, "big")
        assert goaway >= 0 and got[goaway + 10 : goaway + 14] == calm
        assert await _info(server.port) < 5.0
    finally:
        pump.cancel()
        writer.close()
        await server.close(grace_s=0.5)


async def test_connections_over_the_caps_are_closed_as_they_are_accepted() -> None:
    """Each connection costs a descriptor: one peer address holds at most
    ``max_connections_per_address``, the port ``max_connections``; others are unaffected."""
    limits = RelayLimits(max_connections=6, max_connections_per_address=3)
    server = RelayServer(MemRelayView(), limits)
    await server.start("127.0.0.1", 0)
    held = []
    try:
        for _ in range(3):
            held.append(await RawH2Client.connect(server.port, "127.0.0.2"))
        extra = await RawH2Client.connect(server.port, "127.0.0.2")
        await asyncio.wait_for(extra.closed.wait(), 10)  # over the address's cap
        held.append(extra)
        assert server.service.guard_stats()[2]["too_many_connections"] == 1
        assert await _info(server.port) < 5.0  # another address (127.0.0.1) is served
        for _ in range(3):
            held.append(await RawH2Client.connect(server.port, "127.0.0.3"))
        last = await RawH2Client.connect(server.port, "127.0.0.4")
        await asyncio.wait_for(last.closed.wait(), 10)  # the port's 6 are taken
        held.append(last)
        assert server.service.guard_stats()[2]["too_many_connections"] == 2
        await held[0].close()  # a place is given back when a connection ends
        await asyncio.sleep(0.2)
        assert await _info(server.port) < 5.0
    finally:
        for c in held:
            await c.close()
        await server.close(grace_s=0.5)


async def _closed_with_goaway(
    server: RelayServer, pump: asyncio.Future[None], got: bytearray, code: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The relay closed the raw connection after a GOAWAY with ``code``, counted it as a
    protocol error, logged no error, and still answers a bystander."""
    await asyncio.wait_for(pump, 10)  # closed
    goaway = got.rfind(b"\x07\x00\x00\x00\x00\x00")
    assert goaway >= 0, bytes(got)
    assert got[goaway + 10 : goaway + 14] == code.to_bytes(4, "big")
    assert server.service.guard_stats()[2].get("protocol_error") == 1
    assert await _info(server.port) < 5.0
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


async def test_malformed_requests_and_unknown_frames_are_answered_not_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A request without ``:path`` is reset (``PROTOCOL_ERROR``) and counted, not an ERROR
    with a traceback per stream; a frame type HTTP/2 does not define is ignored (RFC 9113), the
    connection goes on; a header value that is not ASCII ends the connection with GOAWAY
    ``PROTOCOL_ERROR``, counted. A bystander is answered throughout."""
    server = RelayServer(MemRelayView())
    await server.start("127.0.0.1", 0)
    writer, got, pump = await _raw_connection(server.port)
    enc = hpack.Encoder()
    try:
        no_path = enc.encode([(":method", "POST"), (":scheme", "http"),
                              ("content-type", "application/grpc")])  # fmt: skip
        for sid in range(1, 40, 2):
            writer.write(frame(0x1, 0x5, sid, no_path))
        writer.write(frame(0x20, 0, 0, b"whatever"))  # an extension frame type
        writer.write(frame(0x6, 0, 0, b"pingpong"))  # answered: the connection goes on
        svc = server.service
        await _eventually(lambda: svc.guard_stats()[2].get("malformed_headers") == 20)
        await _eventually(lambda: b"\x06\x01\x00\x00\x00\x00pingpong" in got)
        assert not pump.done()
        rst = b"\x00\x00\x04\x03\x00"  # RST_STREAM frames, PROTOCOL_ERROR
        # (the resets are written as each stream is mended, the PING's ACK at once: on a busy
        # machine some of them come after it)
        await _eventually(lambda: got.count(rst) >= 20)
        assert got.count(rst) == 20 and got.count(rst + b"\x00\x00\x00\x01" + bytes(3) + b"\x01")
        bad = enc.encode([(":method", "POST"), (":path", "/x"), ("x-name", "caf\xe9")])
        writer.write(frame(0x1, 0x5, 41, bad))
        await _closed_with_goaway(server, pump, got, 0x1, caplog)
    finally:
        pump.cancel()
        writer.close()
        await server.close(grace_s=0.5)


async def test_a_client_cannot_grow_the_response_header_table() -> None:
    """A client advertises a 2 GiB HPACK table, then sends requests whose error replies quote
    what it sent (a wrong ``contract_marker``): each ``grpc-message`` is new. The client's own
    decoder table mirrors the relay's encoder table entry for entry; it stays within HTTP/2's
    default 4 KiB, where it grew by every reply (about 190 bytes each, for the connection's
    life, searched entry by entry on each later reply). Every reply is still read right."""
    server = RelayServer(MemRelayView())
    await server.start("127.0.0.1", 0)
    c = await RawH2Client.connect(server.port, "127.0.0.2")
    try:
        c.h2.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: 2**31 - 1})
        c.flush()
        streams = [
            c.open("GetRelayInfo", bytes(pb.RelayInfoRequest(contract_marker=1000 + i)))
            for i in range(60)
        ]
        for st in streams:
            await asyncio.wait_for(st.ended.wait(), 20)
        assert {st.status for st in streams} == {"9"}  # FAILED_PRECONDITION, each one read
        assert len({st.message for st in streams}) == 60
        table = c.h2.decoder.header_table
        held = sum(32 + len(n) + len(v) for n, v in table.dynamic_entries)
        assert held <= 4096, (held, len(table.dynamic_entries))
        assert await _info(server.port) < 5.0
    finally:
        await c.close()
        await server.close(grace_s=0.5)


async def test_empty_data_frames_inside_a_request_are_not_its_end() -> None:
    """Empty DATA frames that do not end the stream are legal and carry nothing: a request sent
    with them before, inside and after its message is answered, not read as cut short
    (grpclib took such a frame for the end of the body: INVALID_REQUEST)."""
    server = RelayServer(MemRelayView())
    await server.start("127.0.0.1", 0)
    c = await RawH2Client.connect(server.port, "127.0.0.2")
    try:
        st = c.open("GetRelayInfo", b"", raw=b"", end=False)  # headers, then an empty DATA
        sid = max(c.streams)
        framed = b"\x00" + len(INFO).to_bytes(4, "big") + INFO
        c.h2.send_data(sid, framed[:3], end_stream=False)
        c.h2.send_data(sid, b"", end_stream=False)
        c.h2.send_data(sid, framed[3:], end_stream=False)
        c.h2.send_data(sid, b"", end_stream=False)
        c.h2.end_stream(sid)
        c.flush()
        await asyncio.wait_for(st.ended.wait(), 10)
        assert (st.status, st.reason) == ("0", None), (st.status, st.message)
        reply = pb.RelayInfo().parse(bytes(st.data[5:]))
        assert reply.contract_marker == CONTRACT_MARKER
    finally:
        await c.close()
        await server.close(grace_s=0.5)


#: Connection errors h2 finds, each with the GOAWAY code RFC 9113 gives it.
CONNECTION_ERRORS: dict[str, tuple[bytes, int]] = {
    "data_on_stream_0": (frame(0x0, 0, 0, b"x"), 0x1),
    "zero_window_update": (frame(0x8, 0, 0, bytes(4)), 0x1),
    "frame_too_large": (frame(0x0, 0, 1, bytes(20_000)), 0x6),
    "window_setting_out_of_range": (frame(0x4, 0, 0, b"\x00\x04\x80\x00\x00\x00"), 0x3),
}


@pytest.mark.parametrize("error", sorted(CONNECTION_ERRORS))
async def test_connection_errors_h2_finds_are_answered_with_its_goaway(
    error: str, caplog: pytest.LogCaptureFixture
) -> None:
    """h2 queues a GOAWAY for a connection error and grpclib closed the socket without writing
    it: the client now reads the GOAWAY with the RFC's code before the close, the error is
    counted, nothing is logged as an error, and a bystander is answered."""
    frame, code = CONNECTION_ERRORS[error]
    server = RelayServer(MemRelayView())
    await server.start("127.0.0.1", 0)
    writer, got, pump = await _raw_connection(server.port)
    try:
        writer.write(frame)
        await _closed_with_goaway(server, pump, got, code, caplog)
    finally:
        pump.cancel()
        writer.close()
        await server.close(grace_s=0.5)


async def test_a_connection_that_does_not_speak_http2_is_closed_and_counted() -> None:
    """A preface that is not HTTP/2's: the connection is closed (RFC 9113 §3.4 lets the GOAWAY be
    left out) and counted, and a bystander is answered."""
    server = RelayServer(MemRelayView())
    await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: relay\r\n\r\n")
        while await asyncio.wait_for(reader.read(65536), 10):
            pass
        assert server.service.guard_stats()[2].get("protocol_error") == 1
        assert await _info(server.port) < 5.0
    finally:
        writer.close()
        await server.close(grace_s=0.5)


async def test_a_relay_info_reply_never_taken_ends_lagged() -> None:
    """A client with a zero window never takes a ``GetRelayInfo`` reply: after
    ``stalled_stream_reset_s`` the call ends ``SUBSCRIBER_LAGGED`` (nothing of the reply was
    written, and trailers need no window) and is counted, as a stalled plane stream is, and its
    task ends."""
    server = RelayServer(MemRelayView(), RelayLimits(stalled_stream_reset_s=0.5))
    await server.start("127.0.0.1", 0)
    c = await RawH2Client.connect(server.port, "127.0.0.2", window=0)
    try:
        calls = [c.open("GetRelayInfo", INFO) for _ in range(3)]
        await asyncio.wait_for(asyncio.gather(*(s.ended.wait() for s in calls)), 10)
        assert all(not s.reset and s.reason == "RELAY_ERROR_REASON_SUBSCRIBER_LAGGED"
                   for s in calls)  # fmt: skip
        await _eventually(lambda: server.service.stalled_resets.get("relay_info") == 3)
        assert await _info(server.port) < 5.0
    finally:
        await c.close()
        await server.close(grace_s=0.5)


async def test_health_watch_streams_are_bounded() -> None:
    """Each ``Health/Watch`` stays until its client leaves: past the watcher limit one more is
    answered ``RESOURCE_EXHAUSTED``, and a place comes back when a watcher leaves."""
    server = RelayServer(MemRelayView())
    server.health.watchers.capacity = 2
    await server.start("127.0.0.1", 0)
    c = await RawH2Client.connect(server.port, "127.0.0.2")
    try:
        watch = "/grpc.health.v1.Health/Watch"
        held = [c.open(watch, HEALTH_CHECK) for _ in range(2)]
        await _eventually(lambda: server.health.watchers.in_use == 2)
        extra = c.open(watch, HEALTH_CHECK)
        await asyncio.wait_for(extra.ended.wait(), 10)
        assert extra.status == "8" and not any(s.ended.is_set() for s in held)
        c.h2.reset_stream(min(c.streams))  # one watcher leaves
        c.flush()
        await _eventually(lambda: server.health.watchers.in_use == 1)
    finally:
        await c.close()
        await server.close(grace_s=0.5)


async def test_a_connection_refused_by_the_peer_check_takes_no_place() -> None:
    """The internal socket's peer check refuses a stranger as it connects: that connection must
    not keep one of the connection caps' places, or strangers would lock the workers out."""
    server = RelayServer(MemRelayView(), RelayLimits(max_connections=2))
    await server.start("127.0.0.1", 0)
    server._server.peer_check = lambda _t: False
    try:
        for _ in range(4):
            c = await RawH2Client.connect(server.port, "127.0.0.2")
            await asyncio.wait_for(c.closed.wait(), 10)
            await c.close()
        await asyncio.sleep(0.1)
        server._server.peer_check = None
        assert await _info(server.port) < 5.0
        assert server.service.guard_stats()[2]["too_many_connections"] == 0
    finally:
        await server.close(grace_s=0.5)


async def test_a_connection_closed_between_drain_turns_feeds_nothing_more() -> None:
    """A read larger than one turn's 16 KiB is handed on over several loop turns; a connection
    closed in between (a missed keepalive, the shutdown's close) gets nothing more fed to its
    torn-down HTTP/2 state, which would count as a protocol error."""
    server = RelayServer(MemRelayView())
    await server.start("127.0.0.1", 0)
    writer, got, pump = await _raw_connection(server.port)
    try:
        await _eventually(lambda: b"\x00\x00\x00\x04\x01" in got)  # our SETTINGS acknowledged
        (proto,) = [p for p in server._server._protocols if hasattr(p, "processor")]
        window_update = frame(0x8, 0, 0, (1).to_bytes(4, "big"))
        proto.data_received(window_update * 8000)  # a 104 KB read: seven turns
        proto.processor.close("keepalive timeout")  # what grpclib does on a missed PING ack
        for _ in range(20):
            await asyncio.sleep(0)
        assert server.service.guard_stats()[2].get("protocol_error", 0) == 0
    finally:
        pump.cancel()
        writer.close()
        await server.close(grace_s=0.5)


async def _feed(c: RawH2Client, sid: int, data: bytes, timeout: float = 20.0) -> None:
    """Send ``data`` on stream ``sid`` as the relay's flow-control windows let it through."""
    deadline = time.monotonic() + timeout
    while data:
        window = min(c.h2.local_flow_control_window(sid), c.h2.max_outbound_frame_size)
        if window > 0:
            c.h2.send_data(sid, data[:window])
            data = data[window:]
            c.flush()
        else:
            assert time.monotonic() < deadline, "the relay stopped granting window"
            await asyncio.sleep(0.01)


async def test_larger_requests_being_read_share_one_bounded_budget() -> None:
    """Bodies of requests over 16 KiB being read hold places in one budget for the port
    (``max_request_bytes_in_flight``): one that would pass it is refused RESOURCE_LIMIT at once,
    on the relay's RPCs as on grpclib's health service, and counted; small requests are still
    answered; a place comes back when its request ends. The relay grants clients the HTTP/2
    minimum window (65,535), and a request larger than it is still read whole."""
    size = 200_000
    limits = RelayLimits(max_request_bytes_in_flight=3 * size)
    server = RelayServer(MemRelayView(), limits)
    await server.start("127.0.0.1", 0)
    c = await RawH2Client.connect(server.port, "127.0.0.2")
    prefix = b"\x00" + size.to_bytes(4, "big")
    try:
        await asyncio.sleep(0.1)  # the relay's SETTINGS
        assert c.h2.remote_settings.initial_window_size == 65_535
        assert c.h2.outbound_flow_control_window <= 65_535
        holders = []
        for _ in range(3):
            st = c.open("WatchKvPoolCatalog", b"", raw=prefix, end=False)
            await _feed(c, max(c.streams), bytes(size - 1))  # all but the last byte
            holders.append((max(c.streams), st))
        await _eventually(lambda: server.service.request_guards.budget.held == 3 * size)
        over = c.open("WatchKvPoolCatalog", b"", raw=prefix, end=False)
        health = c.open("/grpc.health.v1.Health/Check", b"", raw=prefix, end=False)
        await asyncio.wait_for(asyncio.gather(over.ended.wait(), health.ended.wait()), 5)
        for st in (over, health):
            assert (st.status, st.reason) == ("8", "RELAY_ERROR_REASON_RESOURCE_LIMIT")
        assert server.service.guard_stats()[2]["request_bytes"] == 2
        assert await _info(server.port) < 5.0  # a small request is answered meanwhile
        assert not any(st.ended.is_set() for _, st in holders)
        sid, _ = holders[0]
        c.h2.reset_stream(sid)  # a place comes back with its request's end
        c.flush()
        await _eventually(lambda: server.service.request_guards.budget.held == 2 * size)
        again = c.open("WatchKvPoolCatalog", b"", raw=prefix, end=False)
        await _feed(c, max(c.streams), b"\xff" * size)  # read whole: not protobuf
        await asyncio.wait_for(again.ended.wait(), 10)
        assert (again.status, again.reason) == ("3", "RELAY_ERROR_REASON_INVALID_REQUEST")
        assert server.service.request_guards.budget.held == 2 * size
    finally:
        await c.close()
        await server.close(grace_s=0.5)
    assert server.service.request_guards.budget.held == 0


async def test_streams_waiting_for_their_request_are_bounded_for_the_port() -> None:
    """Past ``max_pending_requests`` streams waiting for their request, each new stream ends the
    one that has waited longest (once it has waited the grace): RESOURCE_LIMIT, counted; a real
    call, whose request comes with its headers, is answered meanwhile. Within the grace, a burst
    of streams is let through."""
    limits = RelayLimits(max_pending_requests=50)
    server = RelayServer(MemRelayView(), limits)
    pending = server.service.request_guards.pending
    # a grace the burst cannot outlast on a loaded machine (70 streams took over 0.3 s there)
    pending.grace_s = scaled(3.0)
    await server.start("127.0.0.1", 0)
    c = await RawH2Client.connect(server.port, "127.0.0.2")
    try:
        first = [c.open("WatchKvPoolCatalog", b"", end=False) for _ in range(50)]
        burst = [c.open("GetRelayInfo", b"", end=False) for _ in range(20)]
        await _eventually(lambda: len(pending) == 70)  # a burst within the grace: all wait
        assert not any(st.ended.is_set() for st in first + burst)
        pending.grace_s = 0.3  # read at each new stream: every waiting one is past it below
        await asyncio.sleep(0.4)
        late = [c.open("WatchKvPoolCatalog", b"", end=False) for _ in range(10)]
        await asyncio.wait_for(asyncio.gather(*(st.ended.wait() for st in first[:30])), 5)
        for st in first[:30]:  # the oldest make room: 70 + 10 new, 50 may wait
            assert (st.status, st.reason) == ("8", "RELAY_ERROR_REASON_RESOURCE_LIMIT")
        assert not any(st.ended.is_set() for st in first[30:] + burst + late)
        assert server.service.guard_stats()[2]["request_evicted"] == 30
        assert len(pending) == 50
        assert await _info(server.port) < 5.0  # answered; to wait, it ended one more
        assert len(pending) == 49
        assert server.service.guard_stats()[2]["request_evicted"] == 31
    finally:
        await c.close()
        await server.close(grace_s=0.5)
    assert len(pending) == 0


async def test_a_waiting_stream_its_client_resets_is_not_taken_for_an_evicted_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """At the bound, a client resets its oldest waiting stream and opens a new one in one write:
    the reset call is cancelled, as any reset call, not counted as ended to make room, and the
    relay logs nothing about it (it answered the reset stream, and grpclib logged an ERROR)."""
    server = RelayServer(MemRelayView(), RelayLimits(max_pending_requests=5))
    pending = server.service.request_guards.pending
    pending.grace_s = 0.2
    await server.start("127.0.0.1", 0)
    c = await RawH2Client.connect(server.port, "127.0.0.2")
    try:
        for _ in range(5):
            c.open("WatchKvPoolCatalog", b"", end=False)
        await _eventually(lambda: len(pending) == 5)
        await asyncio.sleep(0.3)
        c.h2.reset_stream(min(c.streams))
        c.open("WatchKvPoolCatalog", b"", end=False)  # the same write
        await _eventually(lambda: len(pending) == 5)
        await asyncio.sleep(0.3)
        assert server.service.guard_stats()[2].get("request_evicted", 0) == 0
        assert not server.service.errors
    finally:
        await c.close()
        await server.close(grace_s=0.5)
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


async def test_reflection_streams_are_bounded_and_later_requests_small() -> None:
    """A reflection stream may stay open, idle between requests: at most
    ``MAX_REFLECTION_STREAMS`` are open at once (the next is refused RESOURCE_LIMIT), and a
    later request on one may be 16 KiB at most, refused RESOURCE_LIMIT past it (the first is
    read as every request)."""
    server = RelayServer(MemRelayView())
    server.reflection_streams.capacity = 3
    await server.start("127.0.0.1", 0)
    c = await RawH2Client.connect(server.port, "127.0.0.2")
    path = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
    framed = b"\x00" + len(REFLECT).to_bytes(4, "big") + REFLECT
    try:
        held = [c.open(path, b"", raw=framed, end=False) for _ in range(3)]
        await _eventually(lambda: all(st.data for st in held))  # each answered, still open
        extra = c.open(path, b"", raw=framed, end=False)
        await asyncio.wait_for(extra.ended.wait(), 5)
        assert (extra.status, extra.reason) == ("8", "RELAY_ERROR_REASON_RESOURCE_LIMIT")
        sid = min(c.streams)
        c.h2.send_data(sid, b"\x00" + (16 * 1024 + 1).to_bytes(4, "big"))
        c.flush()
        await asyncio.wait_for(held[0].ended.wait(), 5)
        assert (held[0].status, held[0].reason) == ("8", "RELAY_ERROR_REASON_RESOURCE_LIMIT")
        again = c.open(path, b"", raw=framed, end=False)  # its place came back
        await _eventually(lambda: bool(again.data))
        assert not again.ended.is_set()
    finally:
        await c.close()
        await server.close(grace_s=0.5)


def _client_hello(server_name: bytes) -> bytes:
    """A real ClientHello (Python's own TLS client), its server name replaced with
    ``server_name`` (8 bytes): the bytes a hostile peer can put there."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="relay-01")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    hello = outgoing.read()
    assert hello.count(b"relay-01") == 1 and len(server_name) == 8
    return hello.replace(b"relay-01", server_name)


async def _closed_by_peer(reader: asyncio.StreamReader, timeout: float) -> bool:
    """The relay closed this raw connection within ``timeout`` (whatever it sent first)."""
    try:
        async with asyncio.timeout(timeout):
            while await reader.read(65536):
                pass
        return True
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def test_tls_handshakes_are_capped_timed_out_and_counted(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """On a TLS port, a connection takes its place under the caps when it is accepted, not when
    its handshake is done: a stranger who never finishes handshakes holds no more than
    ``max_connections_per_address`` sockets (one more closes its oldest), and each is closed
    after the handshake deadline and counted (``tls_handshake``), its place given back. They
    were neither capped nor counted, and held for asyncio's 60 s. A ClientHello whose server
    name is not ASCII is answered like any other: no traceback on stderr (a servername callback
    printed one per connection)."""
    from tests.support.certs import make_pki

    pki = make_pki(tmp_path)
    ctx = server_ssl_context(str(pki.server_cert), str(pki.server_key), None)
    limits = RelayLimits(max_connections=16, max_connections_per_address=3)
    server = RelayServer(MemRelayView(), limits)
    await server.start("127.0.0.1", 0, ssl=ctx, tls_handshake_timeout_s=1.0)
    def counted(reason: str) -> int:
        return server.service.guard_stats()[2][reason]

    stalled: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def dial(hello: bytes = b"") -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        conn = await asyncio.open_connection("127.0.0.1", server.port, local_addr=("127.0.0.2", 0))
        if hello:
            conn[1].write(hello)
        stalled.append(conn)
        return conn

    async def info() -> pb.RelayInfo:
        tls = client_ssl_context(str(pki.server_ca))
        async with Channel("127.0.0.1", server.port, ssl=tls) as ch:
            return await asyncio.wait_for(
                pb.KvEventRelayStub(ch).get_relay_info(pb.RelayInfoRequest(
                    contract_marker=CONTRACT_MARKER)), 10)  # fmt: skip

    try:
        for round_ in (1, 2):  # the second: the first round's places were given back
            t0 = time.monotonic()
            held = [(await dial())[0] for _ in range(3)]
            over, _ = await dial()
            assert await _closed_by_peer(held[0], 0.5), "the 4th connection closes the 1st"
            assert counted("tls_handshake_evicted") == round_
            assert counted("too_many_connections") == 0
            assert (await info()).contract_marker == CONTRACT_MARKER  # another address is served
            for reader in (*held[1:], over):
                assert await _closed_by_peer(reader, 5.0), "a stalled handshake is closed"
            assert time.monotonic() - t0 >= 0.9  # by the deadline, not at once
            async with asyncio.timeout(5):  # counted as the handshake task ends
                while counted("tls_handshake") < 3 * round_:
                    await asyncio.sleep(0.01)
            assert counted("tls_handshake") == 3 * round_
        reader, _ = await dial(_client_hello(b"\xff" * 8))
        assert await _closed_by_peer(reader, 5.0)
        assert (await info()).contract_marker == CONTRACT_MARKER
    finally:
        for _, writer in stalled:
            writer.close()
        await server.close(grace_s=0.5)
    assert "Exception ignored" not in capfd.readouterr().err


@pytest.mark.parametrize("cap", ["total", "address"])
async def test_stalled_handshakes_on_a_full_port_make_room_for_a_router(
    tmp_path: Path, cap: str
) -> None:
    """Connections that need no certificate to be accepted and never finish their handshake
    filled ``max_connections`` (or, from a router's own address, a NAT's or a sidecar's, that
    address's cap) for the handshake deadline each, opened again as they were closed: every
    router was refused. Under a full cap the connection longest in its handshake is now closed
    for a new one (``tls_handshake_evicted``); a connection past its handshake is never closed
    for another, and a cap full of those refuses the next one."""
    from tests.support.certs import make_pki

    pki = make_pki(tmp_path)
    ctx = server_ssl_context(str(pki.server_cert), str(pki.server_key), None)
    limits = (RelayLimits(max_connections=4, max_connections_per_address=4) if cap == "total"
              else RelayLimits(max_connections=64, max_connections_per_address=4))  # fmt: skip
    server = RelayServer(MemRelayView(), limits)
    await server.start("127.0.0.1", 0, ssl=ctx, tls_handshake_timeout_s=30.0)
    counted = server.service.guard_stats

    async def dial(source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", server.port, local_addr=(source, 0))

    # the total: from four addresses, none of them the routers'; an address: from the routers'
    sources = [f"127.0.0.{2 + i}" if cap == "total" else "127.0.0.1" for i in range(4)]
    stalled = [await dial(source) for source in sources]  # the cap is full
    tls = client_ssl_context(str(pki.server_ca))
    channels: list[Channel] = []
    try:
        caps = server._server.connection_caps  # type: ignore[attr-defined]
        async with asyncio.timeout(5):  # all four accepted, each in its handshake
            while caps.open < 4:
                await asyncio.sleep(0.01)
        for i in range(4):  # each router closes the oldest stalled handshake, in order
            ch = Channel("127.0.0.1", server.port, ssl=tls)
            channels.append(ch)
            info = await asyncio.wait_for(pb.KvEventRelayStub(ch).get_relay_info(
                pb.RelayInfoRequest(contract_marker=CONTRACT_MARKER)), 10)  # fmt: skip
            assert info.contract_marker == CONTRACT_MARKER
            assert await _closed_by_peer(stalled[i][0], 5.0), f"stalled handshake {i} evicted"
            assert counted()[2]["tls_handshake_evicted"] == i + 1
        # four routers hold the cap: the next connection is refused, no router evicted
        extra = await dial("127.0.0.9" if cap == "total" else "127.0.0.1")
        assert await _closed_by_peer(extra[0], 5.0)
        assert counted()[2]["too_many_connections"] == 1
        for ch in channels:
            await asyncio.wait_for(pb.KvEventRelayStub(ch).get_relay_info(
                pb.RelayInfoRequest(contract_marker=CONTRACT_MARKER)), 10)  # fmt: skip
        assert counted()[2]["tls_handshake_evicted"] == 4
        extra[1].close()
    finally:
        for ch in channels:
            ch.close()
        for _, writer in stalled:
            writer.close()
        await server.close(grace_s=0.5)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_connections_that_never_reach_http2_leave_nothing_behind(
    tmp_path: Path, tls: bool
) -> None:
    """grpclib's server makes a request handler with each connection's protocol and keeps it
    until the connection is lost. A connection refused by the caps, or on a TLS port one whose
    handshake fails (a TCP probe, a scanner), never got that far: each left its handler in the
    server for good (3,000 of them: 3,000 handlers, about 5 MiB). Now only the live ones stay,
    with at most grpclib's collection interval (10) of closed ones."""
    from tests.support.certs import make_pki

    ctx = None
    if tls:
        pki = make_pki(tmp_path)
        ctx = server_ssl_context(str(pki.server_cert), str(pki.server_key), None)
    limits = RelayLimits(max_connections=16, max_connections_per_address=1)
    server = RelayServer(MemRelayView(), limits)
    await server.start("127.0.0.1", 0, ssl=ctx, tls_handshake_timeout_s=5.0)
    # the address's place, held by a connection past its handshake (one still in it would be
    # closed for each newcomer of its address)
    held = await asyncio.open_connection(
        "127.0.0.1", server.port, local_addr=("127.0.0.2", 0),
        ssl=client_ssl_context(str(pki.server_ca)) if tls else None,
        server_hostname="localhost" if tls else None,
    )  # fmt: skip
    handshaking = server._server._handshaking  # type: ignore[attr-defined]
    async with asyncio.timeout(5):  # the relay's side of the handshake done too
        while handshaking.oldest() is not None:
            await asyncio.sleep(0.01)
    churn = 60

    async def dial(source: str) -> None:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", server.port, local_addr=(source, 0)
        )
        writer.close()  # a TLS port: no handshake (or refused: held has the address's place)
        await _closed_by_peer(reader, 5.0)

    try:
        for i in range(churn):
            await dial("127.0.0.2")  # over the address's cap: refused as it is accepted
            if tls:
                await dial(f"127.0.0.{3 + i % 4}")  # admitted, its handshake never done
        stats = server.service.guard_stats()[2]
        async with asyncio.timeout(10):  # the last refusals and failed handshakes are counted
            while stats["too_many_connections"] < churn or (tls and stats["tls_handshake"] < churn):
                await asyncio.sleep(0.01)
                stats = server.service.guard_stats()[2]
        await dial("127.0.0.3")  # one accept more: grpclib collects closed handlers as it accepts
        handlers = len(server._server._handlers)  # type: ignore[attr-defined]
        made = 2 + churn * (1 + tls)
        assert handlers <= 1 + 10 + 1, f"{handlers} handlers kept for {made} connections"
    finally:
        held[1].close()
        await server.close(grace_s=0.5)


async def test_one_connection_may_hold_every_stream_the_limits_allow_it() -> None:
    """One channel opening 150 catalog streams (a mirror's or an SDK's many pools, which all
    share one connection): every one is served. The relay told clients h2's default of 100
    streams at once, so the 101st on a channel waited, without a byte or a status, for one of
    the first to end."""
    limits = RelayLimits(max_catalog_subscribers=200)
    server = RelayServer(MemRelayView(), limits)
    await server.start("127.0.0.1", 0)
    try:
        async with Channel("127.0.0.1", server.port) as ch:
            stub = pb.KvEventRelayStub(ch)

            served: list[int] = []
            everyone = asyncio.Event()

            async def first(i: int) -> None:
                it = aiter(stub.watch_kv_pool_catalog(pb.WatchKvPoolCatalogRequest(
                    contract_marker=CONTRACT_MARKER, subscriber_id=f"r{i}")))  # fmt: skip
                await anext(it)
                served.append(i)
                if len(served) == 150:
                    everyone.set()
                await everyone.wait()  # every stream stays open until all were served

            waiting = asyncio.gather(*(first(i) for i in range(150)))
            try:
                await asyncio.wait_for(asyncio.shield(waiting), 20)
            except TimeoutError:
                waiting.cancel()
                raise AssertionError(f"{len(served)} of 150 streams served") from None
    finally:
        await server.close(grace_s=0.5)


async def test_a_client_cancelling_every_stream_it_held_is_no_rapid_reset() -> None:
    """A router closing its subscriptions all at once (325 streams held for a while, one
    RST_STREAM each, in one write) keeps its connection: the next call on it is answered. Every
    RST_STREAM counted against the 256 of a rapid reset, and the connection was ended with
    GOAWAY ENHANCE_YOUR_CALM. Resetting streams right after opening them still is a rapid reset
    (``test_abusive_connection_gets_goaway_and_others_keep_their_streams``)."""
    n = 325
    assert n > BUDGETS.max_resets
    limits = RelayLimits(max_catalog_subscribers=400)
    server = RelayServer(MemRelayView(), limits)
    await server.start("127.0.0.1", 0)
    c = await RawH2Client.connect(server.port, "127.0.0.2")
    try:
        await asyncio.sleep(0.2)  # the relay's SETTINGS (its stream limit) are in effect
        held = {}
        for i in range(n):
            sid = c.h2.get_next_available_stream_id()
            held[sid] = c.open("WatchKvPoolCatalog", plane_request(f"r{i}"))
        await _eventually(lambda: all(st.data for st in held.values()))  # each was served
        await asyncio.sleep(1.2)  # held (past held_stream_s, 1 s), as a router holds them
        for sid in held:
            c.h2.reset_stream(sid, 8)  # CANCEL, as gRPC clients cancel a call
        c.flush()
        await _eventually(lambda: server.service.catalog_permits.in_use == 0)
        assert c.goaway is None, c.goaway
        probe = c.open("GetRelayInfo", INFO)
        await asyncio.wait_for(probe.ended.wait(), 10)
        assert probe.status == "0" and c.goaway is None
        assert server.service.guard_stats()[2]["rapid_reset"] == 0
    finally:
        await c.close()
        await server.close(grace_s=0.5)


async def test_a_flood_of_resets_on_streams_long_gone_is_closed() -> None:
    """Resets of streams held a while have a budget of their own (at least twice the streams a
    connection may hold): RST_STREAM frames sent again and again on old streams past it end
    the connection with GOAWAY ENHANCE_YOUR_CALM, counted as a rapid reset."""
    server = RelayServer(MemRelayView())
    await server.start("127.0.0.1", 0)
    guard, per_connection = server._server.h2_guard, server._server.max_concurrent_streams
    assert guard is not None and per_connection is not None
    assert guard[0].max_held_resets >= 2 * per_connection
    server._server.h2_guard = (H2Budgets(max_held_resets=64), guard[1])
    writer, got, pump = await _raw_connection(server.port)
    try:
        block = hpack.Encoder().encode([
            (":method", "POST"), (":scheme", "http"), (":authority", "relay"),
            (":path", "/dynamo.kvrelay.v1.KvEventRelay/GetRelayInfo"),
            ("content-type", "application/grpc"), ("te", "trailers"),
        ])  # fmt: skip
        writer.write(frame(0x1, 0x5, 1, block))  # one call, ended at once (no request: refused)
        await asyncio.sleep(BUDGETS.held_stream_s + 0.2)
        writer.write(frame(0x3, 0, 1, (8).to_bytes(4, "big")) * 100)
        await asyncio.wait_for(pump, 20)  # the relay closes the connection
        assert server.service.guard_stats()[2]["rapid_reset"] == 1
        assert goaway(1) in bytes(got)  # ENHANCE_YOUR_CALM
    finally:
        writer.close()
        await server.close(grace_s=0.5)


async def test_requests_grpclib_answers_itself_are_counted() -> None:
    """A request that is not gRPC (a GET: HTTP 405; a JSON content type: 415) and one for a
    method the relay does not serve (``UNIMPLEMENTED``) are answered as before and counted
    (``not_grpc``, ``unknown_method``); a served method (health) counts nothing."""
    server = RelayServer(MemRelayView())
    await server.start("127.0.0.1", 0)
    c = await RawH2Client.connect(server.port)
    try:
        base = [(":scheme", "http"), (":authority", "relay")]
        get = c.h2.get_next_available_stream_id()
        c.h2.send_headers(get, [(":method", "GET"), (":path", "/"), *base, ("te", "trailers")],
                          end_stream=True)  # fmt: skip
        c.streams[get] = RawStream()
        json = c.h2.get_next_available_stream_id()
        c.h2.send_headers(json, [(":method", "POST"), (":path", "/grpc.health.v1.Health/Check"),
                                 *base, ("content-type", "application/json"), ("te", "trailers")],
                          end_stream=True)  # fmt: skip
        c.streams[json] = RawStream()
        c.flush()
        unknown = c.open("/dynamo.kvrelay.v1.KvEventRelay/NoSuchMethod", b"")
        health = c.open("/grpc.health.v1.Health/Check", b"")
        for st in (c.streams[get], c.streams[json], unknown, health):
            await asyncio.wait_for(st.ended.wait(), 10)
        assert c.streams[get].headers.get(":status") == "405"
        assert c.streams[json].headers.get(":status") == "415"
        assert unknown.status == "12" and health.status == "0"  # UNIMPLEMENTED; OK
        # a Trailers-Only gRPC answer carries its content type: grpc-go and grpc-java read one
        # without it as UNKNOWN ("missing HTTP content-type"), not as UNIMPLEMENTED
        assert unknown.trailers == {} and unknown.message == "Method not found"
        assert unknown.headers.get("content-type") == "application/grpc+proto"
        assert unknown.headers.get(":status") == "200"
        # a client sending only such calls: the answers' tasks are not kept (grpclib's handler
        # drops done tasks only when it accepts a call of its own)
        more = [c.open("/dynamo.kvrelay.v1.KvEventRelay/NoSuchMethod", b"") for _ in range(40)]
        for st in more:
            await asyncio.wait_for(st.ended.wait(), 10)
        assert {st.status for st in more} == {"12"}
        (proto,) = list(server._server._protocols)
        assert len(proto.handler._tasks) <= 3, proto.handler._tasks  # (grpclib's own three)
        closed = server.service.guard_stats()[2]
        assert (closed.get("not_grpc"), closed.get("unknown_method")) == (2, 41)
    finally:
        await c.close()
        await server.close(grace_s=0.5)


async def test_a_call_whose_deadline_passed_before_its_handler_is_deadline_exceeded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``grpc-timeout`` of a nanosecond or a few microseconds: the deadline has passed when the
    handler starts. grpclib raised at once, took it for its own failure, answered ``UNKNOWN``
    ("Internal Server Error") and logged an ERROR with a traceback, per stream (500 calls, 504
    ERROR lines). Now such a call ends ``DEADLINE_EXCEEDED`` as any call at its deadline, with
    no line above DEBUG; one whose timeout does not read is answered ``UNKNOWN`` and counted as
    a malformed header."""
    server = RelayServer(MemRelayView())
    await server.start("127.0.0.1", 0)
    c = await RawH2Client.connect(server.port)
    caplog.set_level("DEBUG")
    try:
        expired = [c.open("GetRelayInfo", INFO, headers=(("grpc-timeout", t),))
                   for t in ("1n", "1u", "10u") * 20]  # fmt: skip
        bad = [c.open("GetRelayInfo", INFO, headers=(("grpc-timeout", t),))
               for t in ("5x", "-1S", "")]  # fmt: skip
        ok = c.open("GetRelayInfo", INFO, headers=(("grpc-timeout", "5S"),))
        for st in (*expired, *bad, ok):
            await asyncio.wait_for(st.ended.wait(), scaled(10))
        assert {st.status for st in expired} == {"4"}, [st.message for st in expired]
        assert {st.status for st in bad} == {"2"}
        assert {st.headers.get("content-type") for st in bad} == {"application/grpc+proto"}
        assert ok.status == "0"
        assert server.service.guard_stats()[2].get("malformed_headers") == 3
        # (grpclib's INFO "Deadline exceeded" goes to DEBUG once logging is configured:
        # tests/test_logging.py)
        loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert not loud, [r.getMessage() for r in loud]
    finally:
        await c.close()
        await server.close(grace_s=0.5)
