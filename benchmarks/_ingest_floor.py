"""The ingest floor: a process that reads an engine's ZMQ event stream the way the relay does and
does nothing else with it.

It subscribes to ``--endpoint`` with pyzmq, watches the socket and a monitor socket from a uvloop
reader callback, checks readiness (``ZMQ_EVENTS``) before each read and drains with non-blocking
``recv_multipart``: the reading pattern of ``kvrelay/ingest/subscriber.py`` without decoding,
applying or publishing. Its CPU per message is what any relay built on pyzmq and this event loop
pays before its own work starts, so side by side it splits the relay's CPU into that floor and
the relay's own path. Prints ``READY`` once subscribed, then, for each ``count`` line on stdin,
the number of messages read so far; exits on ``quit`` or end of input.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

import zmq

from kvrelay.ops.event_loop import loop_factory

_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)


def _readable(sock: zmq.Socket[Any]) -> bool:
    return bool(int(sock.getsockopt(_EVENTS)) & _POLLIN)


async def _main(endpoint: str) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    mon = sub.get_monitor_socket()
    sub.connect(endpoint)
    loop = asyncio.get_running_loop()
    read = 0

    def on_readable() -> None:
        nonlocal read
        if _readable(mon):
            while True:
                try:
                    mon.recv_multipart(_NOBLOCK)
                except zmq.Again:
                    break
        while _readable(sub):
            sub.recv_multipart(_NOBLOCK)
            read += 1

    for sock in (sub, mon):
        loop.add_reader(int(sock.getsockopt(zmq.FD)), on_readable)
    print("READY", flush=True)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().strip():
        if line == "quit":
            break
        if line == "count":
            on_readable()
            print(read, time.process_time_ns(), flush=True)
    for sock in (sub, mon):
        loop.remove_reader(int(sock.getsockopt(zmq.FD)))
    sub.close(linger=0)
    mon.close(linger=0)
    ctx.term()


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--endpoint", required=True)
    a = ap.parse_args()
    with asyncio.Runner(loop_factory=loop_factory("auto")) as runner:  # as the relay runs
        runner.run(_main(a.endpoint))


if __name__ == "__main__":
    main()
