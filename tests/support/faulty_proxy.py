"""A TCP proxy for tests that breaks the network between a client and a relay on command.

Every accepted connection gets its own upstream connection and two pumps (client → server,
server → client). A test (or a seeded schedule) then changes how the pumps forward:

* ``delay_s``: each read is held this long before it is written on (order is kept);
* ``split``: each read is written one byte at a time, draining after each byte;
* ``stall(direction)``: that pump stops reading: the peer's bytes pile up in the kernel's
  buffers, nothing arrives on the other side, and the TCP connection stays up (no FIN, no
  RST): heartbeats stop, which only a silence rule or a keepalive notices;
* ``cut(rst=True)``: every connection ends, with RST (``SO_LINGER`` 0) or FIN;
* ``half_close(direction)``: that direction's receiver gets FIN; the other one keeps flowing;
* ``blackhole``: new connections are accepted and never forwarded (nor closed) until cut.

``heal()`` undoes delay, split, stalls and black-holing for connections to come and resumes
stalled pumps (a black-holed or half-closed connection stays as it is: it is gone for good).
Real sockets on loopback only: nothing here mocks the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import struct
from dataclasses import dataclass, field

import numpy as np

UP = "c2s"  # client → server
DOWN = "s2c"  # server → client
READ = 65536


@dataclass
class Direction:
    """How one direction of every connection is forwarded now."""

    delay_s: float = 0.0
    split: bool = False
    flowing: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.flowing.set()


class _Link:
    """One proxied connection: the client's socket, the server's, two pumps."""

    def __init__(
        self,
        proxy: FaultyProxy,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        server: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None,
    ) -> None:
        self.proxy = proxy
        self.client = client
        self.server = server
        self.tasks: list[asyncio.Task[None]] = []
        self.half_closed: set[str] = set()
        if server is not None:
            self.tasks = [
                asyncio.create_task(self._pump(client[0], server[1], UP)),
                asyncio.create_task(self._pump(server[0], client[1], DOWN)),
            ]

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str
    ) -> None:
        d = self.proxy.directions[name]
        try:
            while True:
                await d.flowing.wait()  # a stalled direction reads nothing
                data = await reader.read(READ)
                if not data:
                    break
                if d.delay_s:
                    await asyncio.sleep(d.delay_s)
                await d.flowing.wait()
                if name in self.half_closed:
                    continue  # that receiver got its FIN: the bytes go nowhere
                if d.split:
                    for i in range(len(data)):
                        writer.write(data[i : i + 1])
                        await writer.drain()
                else:
                    writer.write(data)
                    await writer.drain()
            if name not in self.half_closed and writer.can_write_eof():
                writer.write_eof()  # pass the sender's FIN on
        except (OSError, RuntimeError):  # the other side went away
            self.close(rst=False)

    def half_close(self, name: str) -> None:
        """FIN to the receiver of ``name``; its bytes are dropped from now on."""
        if name in self.half_closed or self.server is None:
            return
        self.half_closed.add(name)
        writer = self.server[1] if name == UP else self.client[1]
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()

    def close(self, *, rst: bool) -> None:
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        for _, writer in (self.client, *(() if self.server is None else (self.server,))):
            sock = writer.get_extra_info("socket")
            with contextlib.suppress(OSError, RuntimeError, AttributeError):
                if rst and sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                else:
                    writer.close()
        self.proxy.links.discard(self)


class FaultyProxy:
    """Listens on loopback and forwards to ``target`` under the faults set on it."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.directions = {UP: Direction(), DOWN: Direction()}
        self.blackhole = False
        self.links: set[_Link] = set()
        self.accepted = 0
        self.blackholed = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> FaultyProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.blackhole:
            self.blackholed += 1
            self.links.add(_Link(self, (reader, writer), None))  # held open, never forwarded
            return
        try:
            server = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self.links.add(_Link(self, (reader, writer), server))

    # ---------------------------------------------------------------- faults
    def stall(self, name: str) -> None:
        self.directions[name].flowing.clear()

    def stall_open(self, name: str) -> None:
        """Stall ``name`` on the connections open now for good (a path that died while TCP
        stays up); connections made later flow."""
        self.directions[name].flowing.clear()
        self.directions[name] = Direction()

    def resume(self, name: str) -> None:
        self.directions[name].flowing.set()

    def cut(self, *, rst: bool = True) -> None:
        for link in list(self.links):
            link.close(rst=rst)

    def half_close(self, name: str) -> None:
        for link in list(self.links):
            link.half_close(name)

    def heal(self) -> None:
        self.blackhole = False
        for d in self.directions.values():
            d.delay_s = 0.0
            d.split = False
            d.flowing.set()

    async def close(self) -> None:
        self.heal()
        self.cut(rst=False)
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)


class FilterHistory:
    """The relay's own filter at every sequence it published, per producer: the oracle a
    replica behind the proxy is compared with. Fed by a strict direct subscriber (its own
    channel, no proxy): a digest of its table after every accepted frame."""

    def __init__(self) -> None:
        self.digests: dict[tuple[bytes, int], bytes] = {}
        self.latest: dict[bytes, int] = {}
        #: the first sequence recorded per producer (the oracle's subscription began there)
        self.first: dict[bytes, int] = {}

    @staticmethod
    def digest(table: object) -> bytes:
        return hashlib.blake2b(np.ascontiguousarray(table).tobytes(), digest_size=16).digest()

    def record(self, producer: bytes, sequence: int, table: object) -> None:
        self.digests[(producer, sequence)] = self.digest(table)
        self.first.setdefault(producer, sequence)
        self.latest[producer] = max(sequence, self.latest.get(producer, sequence))

    def verdict(self, producer: bytes, sequence: int, table: object) -> bool | None:
        """True/False: the table is/is not the relay's at ``sequence``; None: not known yet."""
        want = self.digests.get((producer, sequence))
        return None if want is None else want == self.digest(table)
