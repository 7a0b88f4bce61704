"""The ingest floor: a process that reads an engine's ZMQ event stream and does nothing else with
it, so that side by side a relay's CPU splits into this floor and the relay's own path.

Two readers (``--reader``):

* ``pyzmq`` reads the way the relay does: a SUB socket and its monitor socket watched from a uvloop
  reader callback, the first read of a wake made at once and ``ZMQ_EVENTS`` checked before each
  further one (``next_message``: the reading pattern of ``kvrelay/ingest/subscriber.py`` without
  decoding, applying or publishing).
  Its CPU per message is what any relay built on pyzmq and this event loop pays before its own
  work.
* ``zmtp`` speaks ZMTP 3.0 itself over one asyncio TCP connection (NULL mechanism, subscribe to
  everything, frames counted as they arrive): no libzmq I/O thread and no mailbox between the
  socket and the loop. It sizes what a reader of that kind would pay instead. It is a
  measurement, not a reader the relay could use: no reconnects, heartbeats or security.

Prints ``READY`` once connected, then, for each ``count`` line on stdin, the number of messages
read so far and the process's CPU time in ns (every thread, libzmq's I/O thread included); exits
on ``quit`` or end of input.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

import zmq

from kvrelay.ingest.subscriber import next_message, readable
from kvrelay.ops.event_loop import loop_factory

_NOBLOCK = int(zmq.NOBLOCK)

# ZMTP 3.0 (RFC 23): signature, version 3.0, mechanism NULL, not as-server, filler.
_GREETING = b"\xff" + bytes(7) + b"\x01\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)
_MORE, _LONG, _COMMAND = 1, 2, 4


def _ready_command() -> bytes:
    name, key, value = b"READY", b"Socket-Type", b"SUB"
    body = bytes([len(name)]) + name + bytes([len(key)]) + key + len(value).to_bytes(4, "big")
    return bytes([_COMMAND, len(body + value)]) + body + value


class _Zmtp(asyncio.Protocol):
    """Counts whole messages; subscribes to every topic once the peer's READY arrives."""

    def __init__(self) -> None:
        self.read = 0
        self._buf = bytearray()
        self._greeted = self._subscribed = False
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._transport.write(_GREETING)

    def data_received(self, data: bytes) -> None:
        buf, t = self._buf, self._transport
        assert t is not None
        buf += data
        if not self._greeted:
            if len(buf) < 64:
                return
            if buf[0] != 0xFF or buf[9] != 0x7F or buf[10] < 3:
                raise ValueError(f"not a ZMTP 3 peer: {bytes(buf[:11])!r}")
            del buf[:64]
            self._greeted = True
            t.write(_ready_command())
        at, n = 0, len(buf)
        while n - at >= 2:
            flags = buf[at]
            if flags & _LONG:
                if n - at < 9:
                    break
                size, head = int.from_bytes(buf[at + 1 : at + 9], "big"), 9
            else:
                size, head = buf[at + 1], 2
            if n - at < head + size:
                break
            if flags & _COMMAND:
                if not self._subscribed:  # the peer's READY: subscribe to everything (0x01 + "")
                    self._subscribed = True
                    t.write(b"\x00\x01\x01")
            elif not flags & _MORE:
                self.read += 1
            at += head + size
        del buf[:at]


async def _pyzmq(endpoint: str) -> tuple[Callable[[], int], Callable[[], None]]:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    mon = sub.get_monitor_socket()
    sub.connect(endpoint)
    loop = asyncio.get_running_loop()
    read = 0

    def on_readable() -> None:
        nonlocal read
        if readable(mon):
            while True:
                try:
                    mon.recv_multipart(_NOBLOCK)
                except zmq.Again:
                    break
        woken = True
        while next_message(sub, woken) is not None:
            woken = False
            read += 1

    fds = [int(sock.getsockopt(zmq.FD)) for sock in (sub, mon)]
    for fd in fds:
        loop.add_reader(fd, on_readable)

    def count() -> int:
        on_readable()
        return read

    def close() -> None:
        for fd in fds:
            loop.remove_reader(fd)
        sub.close(linger=0)
        mon.close(linger=0)
        ctx.term()

    return count, close


async def _zmtp(endpoint: str) -> tuple[Callable[[], int], Callable[[], None]]:
    url = urlsplit(endpoint)
    assert url.scheme == "tcp" and url.hostname and url.port, endpoint
    transport, proto = await asyncio.get_running_loop().create_connection(
        _Zmtp, url.hostname, url.port
    )
    return (lambda: proto.read), transport.close


async def _main(endpoint: str, reader: str) -> None:
    count, close = await (_zmtp if reader == "zmtp" else _pyzmq)(endpoint)
    print("READY", flush=True)
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    while line := (await stdin.readline()).decode().strip():
        if line == "quit":
            break
        if line == "count":
            print(count(), time.process_time_ns(), flush=True)
    close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--endpoint", required=True, help="the engine's PUB endpoint, tcp://host:port")
    ap.add_argument("--reader", choices=("pyzmq", "zmtp"), default="pyzmq")
    a = ap.parse_args()
    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:  # as the relay runs
        runner.run(_main(a.endpoint, a.reader))


if __name__ == "__main__":
    main()
