"""The ``/metrics`` and ``/healthz`` HTTP endpoint, served on the relay's own event loop.

Collection then never races the loop that mutates the counters (no locks, no thread-safety
questions). Bounded: request heads of at most 8 KiB, 10 s to send one, 16 concurrent connections
(beyond that: 503), one response per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from kvrelay.logging import get_logger

_log = get_logger(__name__)

MAX_REQUEST_HEAD = 8192
REQUEST_TIMEOUT_S = 10.0
MAX_HTTP_CONNECTIONS = 16

_REASONS = {
    200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
    431: "Request Header Fields Too Large", 500: "Internal Server Error",
    503: "Service Unavailable",
}


class MetricsServer:
    """``GET /metrics`` → ``render()`` (text format 0.0.4); ``GET /healthz`` → ``healthy()``."""

    def __init__(
        self, render: Callable[[], bytes], healthy: Callable[[], bool] = lambda: True
    ) -> None:
        self._render = render
        self._healthy = healthy
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task[Any]] = set()

    async def start(self, host: str, port: int, sock: socket.socket | None = None) -> int:
        """Listen; returns the bound port (``port`` 0 = ephemeral). ``sock``: accept on this
        already listening socket instead (a hot upgrade's inherited listener)."""
        if self._server is not None:
            raise RuntimeError("metrics endpoint already started")
        if sock is not None:
            self._server = await asyncio.start_server(
                self._handle, sock=sock, limit=MAX_REQUEST_HEAD
            )
        else:
            self._server = await asyncio.start_server(
                self._handle, host, port, limit=MAX_REQUEST_HEAD
            )
        bound = int(self._server.sockets[0].getsockname()[1])
        _log.info("metrics_listening", host=host, port=bound)
        return bound

    def listening_socket(self) -> socket.socket:
        """The listener (a hot upgrade hands its descriptor to the successor)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("metrics endpoint not listening")
        return self._server.sockets[0]

    async def close(self) -> None:
        """Stop listening and end in-flight requests."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for t in list(self._conns):
            t.cancel()
        for t in list(self._conns):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            if len(self._conns) > MAX_HTTP_CONNECTIONS:
                await _respond(writer, 503, b"too many concurrent scrapes\n")
                return
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            except (asyncio.LimitOverrunError, ValueError):
                await _respond(writer, 431, b"request head too large\n")
                return
            except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                return
            parts = head.split(b"\r\n", 1)[0].split()
            if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
                await _respond(writer, 400, b"bad request\n")
                return
            method, path = parts[0], parts[1].split(b"?", 1)[0]
            head_only = method == b"HEAD"
            if method not in (b"GET", b"HEAD"):
                await _respond(writer, 405, b"method not allowed\n", extra=b"Allow: GET, HEAD\r\n")
            elif path == b"/metrics":
                try:
                    body = self._render()
                except Exception:
                    _log.exception("metrics_collect_failed")
                    await _respond(writer, 500, b"collection failed\n")
                    return
                # Classic text format 0.0.4: every Prometheus understands it.
                await _respond(writer, 200, body, CONTENT_TYPE_PLAIN_0_0_4, head_only=head_only)
            elif path in (b"/", b"/healthz"):
                if self._healthy():
                    await _respond(writer, 200, b"ok\n", head_only=head_only)
                else:
                    await _respond(writer, 503, b"not serving\n", head_only=head_only)
            else:
                await _respond(writer, 404, b"not found\n", head_only=head_only)
        except ConnectionError:
            pass
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _respond(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
    *,
    head_only: bool = False,
    extra: bytes = b"",
) -> None:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
    ).encode() + extra + b"\r\n"
    writer.write(head if head_only else head + body)
    await writer.drain()
