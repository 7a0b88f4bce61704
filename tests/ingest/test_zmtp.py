"""The ZMTP reader: its frame cutting against hand-written ZMTP bytes, and the source against
libzmq's own PUB socket (pyzmq) over real TCP and IPC: the same messages libzmq's SUB would
receive, the connection events, heartbeats, reconnects, backpressure and hostile peers."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq

from kvrelay.ingest.live_source import PyzmqSource
from kvrelay.ingest.zmtp import (
    CONNECTED,
    DISCONNECTED,
    GREETING,
    FrameReader,
    ZmtpError,
    ZmtpSource,
    supports,
)
from tests.support.timing import scaled


def _frame(body: bytes, more: bool = False, command: bool = False) -> bytes:
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) > 255:
        return bytes([flags | 2]) + len(body).to_bytes(8, "big") + body
    return bytes([flags, len(body)]) + body


def _ready(kind: bytes) -> bytes:
    key = b"Socket-Type"
    body = b"\x05READY" + bytes([len(key)]) + key + len(kind).to_bytes(4, "big") + kind
    return _frame(body, command=True)


def _peer_greeting(major: int = 3, mech: bytes = b"NULL") -> bytes:
    return b"\xff" + bytes(8) + b"\x7f" + bytes([major, 1]) + mech.ljust(20, b"\0") + bytes(32)


# ---- frame cutting -------------------------------------------------------------------------------


def test_a_stream_cut_anywhere_gives_the_same_messages() -> None:
    big = os.urandom(70_000)
    stream = (
        _peer_greeting() + _ready(b"PUB")
        + _frame(b"kv", more=True) + _frame((7).to_bytes(8, "big"), more=True) + _frame(big)
        + _frame(b"\x04PING\x00\x0aab", command=True)
        + _frame(b"", more=True) + _frame(b"x")
    )  # fmt: skip
    whole = FrameReader(1 << 20).feed(stream)
    want = [[b"kv", (7).to_bytes(8, "big"), big], [b"", b"x"]]
    sized = [(m, sum(len(f) for f in m)) for m in want]
    assert whole == (sized, [(b"PING", b"\x00\x0aab")])
    for step in (1, 7, 64, 1000, 70_000, len(stream)):
        r = FrameReader(1 << 20)
        msgs: list[tuple[list[bytes], int]] = []
        cmds: list[tuple[bytes, bytes]] = []
        for at in range(0, len(stream), step):
            m, c = r.feed(stream[at : at + step])
            msgs += m
            cmds += c
            assert all(type(f) is bytes for x, _ in m for f in x)
        assert (msgs, cmds) == whole


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (b"GET / HTTP/1.1\r\n", "bad_greeting"),
        (_peer_greeting(major=2), "bad_greeting"),
        (_peer_greeting(mech=b"CURVE"), "bad_greeting"),
        (_peer_greeting() + _ready(b"REP"), "peer_type"),
        (_peer_greeting() + _frame(b"data"), "bad_frame"),  # a message before READY
        (_peer_greeting() + _ready(b"PUB") + b"\x08\x01x", "bad_frame"),  # reserved flag bit
        (_peer_greeting() + _ready(b"PUB") + _frame(b"\x04PING", more=True, command=True),
         "bad_frame"),
        (_peer_greeting() + _ready(b"PUB") + _ready(b"PUB"), "bad_command"),
        (_peer_greeting() + _ready(b"PUB") + b"\x02" + (1 << 40).to_bytes(8, "big"), "oversized"),
        (_peer_greeting() + _ready(b"PUB") + _frame(b"a" * 600, more=True) + _frame(b"b" * 600),
         "oversized"),  # each frame fits, the message does not
        (_peer_greeting() + _frame(b"\x05ERROR\x04nope", command=True), "peer_error"),
        (_peer_greeting() + _ready(b"PUB") + _frame(b"", more=True) * 65, "too_many_frames"),
    ],
)
def test_what_a_publisher_would_not_send_is_refused_by_kind(data: bytes, kind: str) -> None:
    with pytest.raises(ZmtpError) as exc:
        FrameReader(1000).feed(data)
    assert exc.value.kind == kind


def test_messages_before_a_fault_in_the_same_read_are_kept() -> None:
    """libzmq delivers frame by frame, so what a read completed before a bad frame is handed on
    with the error, not dropped with it."""
    data = (
        _peer_greeting() + _ready(b"PUB") + _frame(b"kv", more=True) + _frame(b"one")
        + _frame(b"two") + b"\x08\x01x" + _frame(b"never")
    )  # fmt: skip
    with pytest.raises(ZmtpError) as exc:
        FrameReader(1000).feed(data)
    assert exc.value.kind == "bad_frame"
    assert exc.value.messages == [([b"kv", b"one"], 5), ([b"two"], 3)]


def test_a_command_is_bounded_below_the_frame_bound() -> None:
    """A READY of many properties is refused by its size before any property is read."""
    ready = _frame(b"\x05READY" + b"\x01a\x00\x00\x00\x00" * 12_000, command=True)  # 84 KB
    with pytest.raises(ZmtpError) as exc:
        FrameReader(1 << 20).feed(_peer_greeting() + ready)
    assert exc.value.kind == "bad_command" and "command of" in str(exc.value)
    FrameReader(1 << 20).feed(_peer_greeting() + _ready(b"PUB"))  # a real one passes


def test_endpoints_it_connects_to() -> None:
    assert supports("tcp://127.0.0.1:5557") and supports("tcp://[::1]:5557")
    assert supports("tcp://engine-0.svc:5557") and supports("ipc:///tmp/kv.sock")
    for other in ("inproc://x", "tcp://*:5557", "tcp://eth0;10.0.0.1:5557", "tcp://h:0",
                  "tcp://h", "pgm://x", "ipc://", "ipc://@kv-events", "tcp://a..b:5557",
                  "tcp://" + "x" * 64 + ".svc:5557"):  # fmt: skip
        assert not supports(other), other


# ---- against libzmq ------------------------------------------------------------------------------


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(linger=0)


class _Inbox:
    def __init__(self, src: ZmtpSource) -> None:
        self.src = src
        self.messages: list[list[bytes]] = []
        self.events: list[int] = []
        self.take = True

    def __call__(self) -> None:
        self.events += self.src.take_events()
        while self.take and (m := self.src.next_message()) is not None:
            self.messages.append(m)


async def _until(cond: object, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + scaled(timeout)
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def _publish_until_received(
    pub: zmq.Socket[bytes], inbox: _Inbox, frames: list[bytes], n: int = 1
) -> None:
    """PUB drops what it sends before the subscription reached it: send until one arrives."""
    before = len(inbox.messages)
    while len(inbox.messages) < before + n:
        pub.send_multipart(frames)
        await asyncio.sleep(0.01)


async def test_receives_what_libzmq_publishes(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pub = zctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    src = ZmtpSource(f"tcp://127.0.0.1:{port}")
    inbox = _Inbox(src)
    src.open(inbox)
    try:
        await _until(lambda: src.ready)
        assert inbox.events == [CONNECTED]
        await _publish_until_received(pub, inbox, [b"warm"])
        inbox.messages.clear()
        sent = [[b"kv", i.to_bytes(8, "big"), os.urandom(i * 997)] for i in range(40)]
        sent += [[b"", b""], [b"t", b"x" * 300_000], [b"one"]]
        for m in sent:
            pub.send_multipart(m)
        await _until(lambda: len(inbox.messages) >= len(sent))
        assert inbox.messages == sent  # every frame, in order, nothing torn
        pub.close(linger=0)
        await _until(lambda: DISCONNECTED in inbox.events)
        assert inbox.events == [CONNECTED, DISCONNECTED]
        # the publisher comes back on the same port: the reader reconnects by itself
        pub = zctx.socket(zmq.PUB)
        pub.bind(f"tcp://127.0.0.1:{port}")
        await _until(lambda: inbox.events.count(CONNECTED) == 2 and src.ready)
        await _publish_until_received(pub, inbox, [b"again"])
        assert inbox.messages[-1] == [b"again"]
        assert src.error_counts == {}
    finally:
        src.close()
        pub.close(linger=0)


async def test_answers_heartbeats_and_reads_ipc(zctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """A publisher with ZMTP heartbeats on drops a peer that does not answer its PINGs within
    the timeout; the reader answers, so the one connection lasts many timeouts."""
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.HEARTBEAT_IVL, 20)
    pub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 60)
    with tempfile.TemporaryDirectory() as d:
        endpoint = f"ipc://{d}/kv.sock"
        pub.bind(endpoint)
        src = ZmtpSource(endpoint)
        inbox = _Inbox(src)
        src.open(inbox)
        try:
            await _until(lambda: src.ready)
            await asyncio.sleep(0.6)  # ten heartbeat timeouts
            await _publish_until_received(pub, inbox, [b"still", b"here"])
            assert inbox.events == [CONNECTED]  # never dropped
        finally:
            src.close()
            pub.close(linger=0)


async def test_a_full_queue_stops_reading_until_drained(
    zctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    pub = zctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    src = ZmtpSource(f"tcp://127.0.0.1:{port}", hwm=50)
    inbox = _Inbox(src)
    src.open(inbox)
    try:
        await _until(lambda: src.ready)
        await _publish_until_received(pub, inbox, [b"warm"])
        inbox.take = False
        for i in range(20_000):
            pub.send_multipart([b"kv", i.to_bytes(8, "big"), b"p" * 200])
        await _until(lambda: src._paused)
        queued = len(src._messages)
        await asyncio.sleep(0.2)
        assert len(src._messages) == queued  # nothing read while paused
        assert queued < 50 + 2_000  # the bound plus what one read of the socket held
        inbox.take = True
        inbox()
        await _until(lambda: len(inbox.messages) >= 1 + 20_000, timeout=20)
        seqs = [int.from_bytes(m[1], "big") for m in inbox.messages[1:]]
        assert seqs == list(range(20_000))  # paused, not dropped: TCP held the rest
    finally:
        src.close()
        pub.close(linger=0)


async def _serve(handler: object) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
    return server, server.sockets[0].getsockname()[1]


@contextlib.asynccontextmanager
async def _reading(handler: object, **kw: Any) -> AsyncIterator[tuple[ZmtpSource, _Inbox]]:
    """A ZMTP source reading a peer played by ``handler`` (an asyncio stream server)."""
    server, port = await _serve(handler)
    src = ZmtpSource(f"tcp://127.0.0.1:{port}", **kw)
    inbox = _Inbox(src)
    src.open(inbox)
    try:
        yield src, inbox
    finally:
        src.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    ("reply", "kind"),
    [
        (b"HTTP/1.1 400 Bad Request\r\n\r\n", "bad_greeting"),
        (_peer_greeting() + _ready(b"ROUTER"), "peer_type"),
        (_peer_greeting() + _ready(b"PUB") + b"\x02" + (1 << 40).to_bytes(8, "big"), "oversized"),
    ],
)
async def test_a_hostile_peer_is_counted_and_left(reply: bytes, kind: str) -> None:
    accepted = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        w.write(reply)
        while await r.read(1 << 16):  # until the reader hangs up
            pass
        w.close()

    seen: list[str] = []
    async with _reading(handler, reconnect_s=0.05, on_error=seen.append) as (src, inbox):
        await _until(lambda: src.error_counts.get(kind, 0) >= 2)  # and it came back for more
        assert set(seen) == {kind} and accepted >= 2 and inbox.messages == []
        assert inbox.events[:2] == [CONNECTED, DISCONNECTED]


async def test_a_port_that_drops_every_connection_is_tried_less_and_less_often() -> None:
    """A port that accepts each connection and drops it at once (another service; or an
    address a hostile discovery source names, the relay's own ports among them) was connected
    to every 100 ms for ever: 10 connections a second per source, thousands with many
    sources. The wait doubles after each connection without a message, up to 1 s; a
    publisher's connection (a message, or ``HEALTHY_S`` up) brings the 100 ms back, for good:
    that address is an engine's."""
    times: list[float] = []
    loop = asyncio.get_running_loop()
    serve_messages = False

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        times.append(loop.time())
        if serve_messages:  # a publisher this time: a greeting, READY and a message
            w.write(_peer_greeting() + _ready(b"PUB"))
            await r.readexactly(64)
            w.write(_frame(b"m"))
            await w.drain()
            await asyncio.sleep(0.2)
        w.close()

    async with _reading(handler) as (src, inbox):
        await asyncio.sleep(3.2)
        gaps = [b - a for a, b in itertools.pairwise(times)]
        # 0.1, 0.2, 0.4, 0.8, 1.0, ... (each at least that, later on a busy machine)
        assert 3 <= len(times) <= 8, gaps
        assert all(g >= w * 0.9 for g, w in zip(gaps, (0.1, 0.2, 0.4, 0.8, 1.0, 1.0), strict=False))
        serve_messages = True
        n = len(times)
        await _until(lambda: inbox.messages != [] and len(times) >= n + 2)
        assert times[-1] - times[-2] < 0.3 + scaled(0.5)  # the publisher's hang-up: back at 0.1 s
        assert src.messages_in >= 1
        # the publisher gone, its port dropping again: still every 0.1 s (a restarting engine
        # is met at once; without a replay, what it sends first is kept)
        serve_messages = False
        n = len(times)
        await _until(lambda: len(times) >= n + 5)
        quick = [b - a for a, b in itertools.pairwise(times[n:])]
        assert max(quick) < 0.1 + scaled(0.3), quick


async def test_a_faulty_peer_s_earlier_messages_arrive_before_it_is_left() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(_peer_greeting() + _ready(b"PUB"))
        await r.readexactly(64)  # the reader's greeting: its READY and subscription follow
        w.write(_frame(b"kv", more=True) + _frame(b"good") + b"\x08\x01x")  # then a bad frame
        while await r.read(1 << 16):
            pass
        w.close()

    async with _reading(handler, reconnect_s=0.05) as (src, inbox):
        await _until(lambda: src.error_counts.get("bad_frame", 0) >= 1)
        assert inbox.messages[0] == [b"kv", b"good"]
        assert inbox.events[:2] == [CONNECTED, DISCONNECTED]


async def test_a_peer_that_never_reads_its_pongs_is_left() -> None:
    """PINGs from a peer that reads nothing: the PONGs fill its small receive window, then the
    relay's send buffer, then asyncio's write buffer; past its high-water mark the reader
    disconnects (``write_backlog``) instead of buffering PONGs without end."""
    ping = _frame(b"\x04PING\x00\x00" + b"c" * 16, command=True)
    burst = ping * 40_000  # 1 MB of PINGs a write, 23 B of PONG each

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(_peer_greeting() + _ready(b"PUB"))
        with contextlib.suppress(ConnectionError):
            for _ in range(40):
                w.write(burst)
                await w.drain()
        await asyncio.sleep(30)  # never reads

    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # accepted sockets inherit it
    lsock.bind(("127.0.0.1", 0))
    server = await asyncio.start_server(handler, sock=lsock)  # type: ignore[arg-type]
    port = lsock.getsockname()[1]
    src = ZmtpSource(f"tcp://127.0.0.1:{port}", reconnect_s=5.0)
    src.open(_Inbox(src))
    try:
        await _until(lambda: src.error_counts.get("write_backlog", 0) >= 1, timeout=20.0)
    finally:
        src.close()
        server.close()


async def test_libzmq_source_comes_back_after_a_peer_that_broke_the_protocol(
    zctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """libzmq ends its connection to a peer that breaks the protocol and never tries it again;
    the libzmq source renews the connection, so the engine that takes the port over later is
    read (without the renewal: one accept, then nothing)."""
    accepted = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        w.write(_peer_greeting() + _ready(b"REP"))  # not a publisher: a protocol error
        with contextlib.suppress(ConnectionError):
            while await r.read(1 << 16):
                pass
        w.close()

    server, port = await _serve(handler)
    src = PyzmqSource(zctx, f"tcp://127.0.0.1:{port}", 1000)
    inbox = _Inbox(src)  # type: ignore[arg-type]
    src.open(inbox)
    pub = None
    try:
        await _until(lambda: accepted >= 3 and src.renewals >= 2, timeout=10.0)
        server.close()
        await server.wait_closed()
        await asyncio.sleep(0.2)  # the last hostile connection ends
        pub = zctx.socket(zmq.PUB)
        pub.bind(f"tcp://127.0.0.1:{port}")
        deadline = asyncio.get_running_loop().time() + scaled(10.0)
        while not inbox.messages:
            assert asyncio.get_running_loop().time() < deadline, "never read the new publisher"
            pub.send_multipart([b"kv", b"back"])
            await asyncio.sleep(0.02)
        assert inbox.messages[0] == [b"kv", b"back"]
    finally:
        src.close()
        server.close()
        if pub is not None:
            pub.close(linger=0)


async def test_both_readers_leave_a_peer_announcing_a_frame_over_the_bound(
    zctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A frame header claiming 65 MiB, its body never sent: kvrelay's reader and libzmq's both
    end that connection at the header (``MAX_FRAME_BYTES``; libzmq through ``ZMQ_MAXMSGSIZE``)
    instead of waiting, the buffer allocated, for a body of any size."""
    hung_up: list[int] = []  # connections the reader ended

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(_peer_greeting() + _ready(b"PUB") + b"\x02" + (65 << 20).to_bytes(8, "big"))
        with contextlib.suppress(ConnectionError):
            while await r.read(1 << 16):  # until the reader hangs up
                pass
        hung_up.append(1)
        w.close()

    for make in (lambda ep: ZmtpSource(ep, reconnect_s=5.0),
                 lambda ep: PyzmqSource(zctx, ep, 1000)):  # fmt: skip
        hung_up.clear()
        server, port = await _serve(handler)
        src = make(f"tcp://127.0.0.1:{port}")
        src.open(_Inbox(src))  # type: ignore[arg-type]
        try:
            await _until(lambda: hung_up, timeout=10.0)
        finally:
            src.close()
            server.close()


async def test_a_silent_peer_times_out_its_handshake() -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while await r.read(1 << 16):  # says nothing, reads until the reader hangs up
            pass
        w.close()

    async with _reading(handler, handshake_s=0.1, reconnect_s=0.05) as (src, _):
        await _until(lambda: src.error_counts.get("handshake_timeout", 0) >= 2)


async def test_greeting_is_zmtp3_null_as_client() -> None:
    assert len(GREETING) == 64 and GREETING[0] == 0xFF and GREETING[9] == 0x7F
    assert GREETING[10:12] == b"\x03\x00" and GREETING[12:32].rstrip(b"\0") == b"NULL"
    assert GREETING[32] == 0  # not as-server
