"""A test-owned systemd ``NOTIFY_SOCKET``: collects the daemon's sd_notify datagrams."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from pathlib import Path

from tests.support.timing import scaled


class Notifications:
    """Collects datagrams from the test-owned NOTIFY_SOCKET."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.messages: list[str] = []
        self._task = asyncio.create_task(self._recv())

    async def _recv(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            data = await loop.sock_recv(self.sock, 4096)
            self.messages.append(data.decode())

    async def wait_for(self, prefix: str, count: int = 1, timeout: float = 40.0) -> str:
        deadline = time.monotonic() + scaled(timeout)
        while True:
            hits = [m for m in self.messages if m.startswith(prefix)]
            if len(hits) >= count:
                return hits[count - 1]
            if time.monotonic() > deadline:
                raise AssertionError(f"no {prefix!r} x{count}; got {self.messages}")
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sock.close()
