"""The ingest floor: a process that reads an engine's ZMQ event stream and does nothing else with
it, so that side by side a relay's CPU splits into this floor and the relay's own path.

Two readers (``--reader``):

* ``pyzmq`` reads the way the relay does with ``zmq_reader = "libzmq"``: a SUB socket and its
  monitor socket watched from a uvloop reader callback, the first read of a wake made at once
  and ``ZMQ_EVENTS`` checked before each further one (``live_source.next_message``: the reading
  pattern of ``kvrelay/ingest/subscriber.py`` without decoding, applying or publishing).
  Its CPU per message is what any relay built on pyzmq and this event loop pays before its own
  work.
* ``zmtp`` reads with the relay's own ZMTP reader (``kvrelay/ingest/zmtp.py``, the default
  ``zmq_reader``): the loop's transport reads the socket, no libzmq I/O thread and no mailbox
  between the socket and the loop.

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

import zmq

from kvrelay.ingest.live_source import next_message, readable
from kvrelay.ingest.zmtp import ZmtpSource
from kvrelay.ops.event_loop import loop_factory

_NOBLOCK = int(zmq.NOBLOCK)

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
    src = ZmtpSource(endpoint)
    read = 0

    def on_input() -> None:
        nonlocal read
        src.take_events()
        while src.next_message() is not None:
            read += 1

    src.open(on_input)
    while src.connect_failures == 0 and not src.ready:  # as pyzmq: up once connected
        await asyncio.sleep(0.01)
    return (lambda: read), src.close


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
