"""A relay that shuts down closes each connection by halves: FIN after the last frame, then it
reads (and drops) what the client still sends until the client closes.

Closed whole, the socket answered whatever the client still sent (a WINDOW_UPDATE for the last
DATA, a PING) with a reset; a client whose next write then failed lost the trailers it had
received but not read yet (a mirror behind a draining relay told its routers "connection lost"
where the relay had said OK). Real parts: the relay's gRPC server over loopback, a raw TCP
client writing HTTP/2 frames, an h2 client for the plane stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import hpack

from kvrelay.client import rpc
from kvrelay.service.server import RelayServer
from tests.support.h2_client import PREFACE_AND_SETTINGS, frame
from tests.support.mem_relay import MemRelayView
from tests.support.timing import scaled


def _catalog_call() -> bytes:
    headers = hpack.Encoder().encode([
        (":method", "POST"), (":scheme", "http"), (":authority", "relay"),
        (":path", "/dynamo.kvrelay.v1.KvEventRelay/WatchKvPoolCatalog"),
        ("content-type", "application/grpc"), ("te", "trailers"),
    ])  # fmt: skip
    body = bytes(rpc.catalog_request("linger"))
    framed = b"\x00" + len(body).to_bytes(4, "big") + body
    return frame(0x1, 0x4, 1, headers) + frame(0x0, 0x1, 1, framed)


async def _read_until(sock: socket.socket, got: bytearray, cond: bytes | None) -> None:
    """Read into ``got`` until ``cond`` is in it (None: until the relay's FIN)."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + scaled(10)
    while cond is None or cond not in got:
        assert time.monotonic() < deadline, bytes(got[-200:])
        data = await asyncio.wait_for(loop.sock_recv(sock, 65536), scaled(10))
        if not data:
            assert cond is None, "closed before " + repr(cond)
            return
        got.extend(data)


@contextlib.asynccontextmanager
async def _raw_client(first: bytes) -> AsyncIterator[tuple[RelayServer, socket.socket]]:
    """A relay with one pool, and a plain TCP client that has sent ``first`` (non-blocking: its
    writes fail as soon as the relay resets the connection). Both closed at the end."""
    view = MemRelayView()
    view.add_pool("p", 4096)
    server = RelayServer(view)
    await server.start("127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, ("127.0.0.1", server.port))
        await loop.sock_sendall(sock, first)
        yield server, sock
    finally:
        sock.close()
        await server.close(grace_s=0.1)


async def test_a_client_still_writing_after_the_shutdown_is_not_reset() -> None:
    loop = asyncio.get_running_loop()
    async with _raw_client(PREFACE_AND_SETTINGS + _catalog_call()) as (server, sock):
        got = bytearray()
        await _read_until(sock, got, b"\x00\x00\x00\x01")  # a DATA frame on stream 1 came
        closing = asyncio.ensure_future(server.close(grace_s=scaled(2)))
        await _read_until(sock, got, None)  # the relay's FIN, after its last frame
        assert b"grpc-status=" in hpack_decoded_blocks(got)  # the catalog ended with a status
        for _ in range(3):  # what a client sends as it reads the end: PINGs here
            await loop.sock_sendall(sock, frame(0x6, 0, 0, b"pingpong"))  # never reset
            await asyncio.sleep(0.05)
        assert not closing.done()  # the relay waits for the client's close (a while at most)
        sock.close()
        await asyncio.wait_for(closing, scaled(5))


def hpack_decoded_blocks(got: bytes) -> bytes:
    """Every header block the relay sent, decoded and joined (its frames walked in order)."""
    dec, out, i = hpack.Decoder(), bytearray(), 0
    while i + 9 <= len(got):
        n, kind = int.from_bytes(got[i : i + 3], "big"), got[i + 3]
        payload = bytes(got[i + 9 : i + 9 + n])
        if kind == 0x1:
            for k, v in dec.decode(payload, raw=True):
                out += k + b"=" + v + b"\n"
        i += 9 + n
    return bytes(out)


async def test_a_client_that_never_closes_holds_a_stop_a_quarter_of_its_grace_at_most() -> None:
    """The relay waits for a connection closed by halves to be closed by its client; one that
    never closes (a stopped process, a router whose loop is blocked) held the stop for the close
    wait, 2 s, whatever the shutdown's budget: with ``shutdown_timeout_s = 1`` the daemon
    exited 1 without saving its state. The wait is a quarter of the grace at most."""
    async with _raw_client(PREFACE_AND_SETTINGS) as (server, sock):
        await _read_until(sock, bytearray(), b"\x04\x01")  # the relay's SETTINGS ack came
        started = time.monotonic()
        await asyncio.wait_for(server.close(grace_s=0.4), scaled(5))
        assert time.monotonic() - started < 0.4 + scaled(0.5)  # (a quarter of it is 0.1 s)
