"""The ``/metrics`` and ``/healthz`` HTTP endpoint, served on the relay's own event loop.

What a scrape reads from the relay's live state it reads on the loop that mutates it (no locks,
no thread-safety questions). The rest runs in the loop's executor (:class:`Collected`): the text,
and on a relay the families themselves, built from a snapshot the loop took. Both grow with
every pool, and together they are most of a scrape's cost on a relay with many pools.
The port is often reachable by a whole pod network and ``/healthz`` is the liveness probe, so no
peer may be able to make it fail by holding connections:

- every connection must send its whole request head within ``head_timeout_s`` (one deadline for
  the head, not per read, so a slowloris client is cut off as surely as an idle one), and every
  response must drain within ``drain_timeout_s``;
- at most ``max_per_peer`` open connections per peer address: a new one past it evicts that
  address's oldest connection still reading its request head (answered 503 and closed; the new
  one is answered so when there is none), so a peer on the prober's own address (a pod on the
  node's network, the kubelet probing from the node's) cannot hold its probe out either;
- at most ``max_connections`` in all: a new connection past it evicts the oldest one still
  reading its request head, so a probe that sends its request at once is read (unless
  connections from everywhere outpace the loop's turns: then it may be the one evicted, and
  it is answered 503, never dropped without a status);
- at most ``max_scrapes`` ``/metrics`` responses in flight (the body can be megabytes);
  ``/healthz`` is outside that limit (a few bytes).

``/metrics`` answers in the text format 0.0.4 unless the ``Accept`` header names
``application/openmetrics-text`` (as Prometheus does) at least as high as ``text/plain``:
then OpenMetrics 1.0.0, ending in ``# EOF``. A client that accepts ``gzip`` (Prometheus always
does) gets the body gzipped: at 64 pools it is megabytes of repetitive text. Both are done with
the text, off the loop.

Every refusal is counted by reason (``kvrelay_metrics_http_rejections_total``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from kvrelay._aio import stop_all
from kvrelay.logging import get_logger

_log = get_logger(__name__)

MAX_REQUEST_HEAD = 8192
HEAD_TIMEOUT_S = 5.0
DRAIN_TIMEOUT_S = 10.0
MAX_HTTP_CONNECTIONS = 64
MAX_CONNECTIONS_PER_PEER = 8
MAX_SCRAPES = 4
REJECTION_REASONS = (
    "per_peer", "evicted", "head_timeout", "head_too_large", "bad_request", "busy",
    "drain_timeout",
)  # fmt: skip

#: What an OpenMetrics answer says it is (prometheus_client writes version 1.0.0).
CONTENT_TYPE_OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
_OPENMETRICS_VERSIONS = (b"1.0.0", b"0.0.1")  # Prometheus asks for both; 1.0.0 reads as either
GZIP_LEVEL = 6  # zlib's default: most of the gain, a fraction of level 9's time

_REASONS = {
    200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
    431: "Request Header Fields Too Large", 500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass(slots=True)
class HttpLimits:
    """The endpoint's bounds (defaults above; tests shrink them)."""

    max_connections: int = MAX_HTTP_CONNECTIONS
    max_per_peer: int = MAX_CONNECTIONS_PER_PEER
    max_scrapes: int = MAX_SCRAPES
    head_timeout_s: float = HEAD_TIMEOUT_S
    drain_timeout_s: float = DRAIN_TIMEOUT_S


@dataclass(slots=True)
class _Conn:
    peer: str
    writer: asyncio.StreamWriter
    opened: float
    reading: bool = True  # still waiting for its request head (evictable)


@dataclass(slots=True)
class HttpCounters:
    """Connections refused or cut off, by reason (one of ``REJECTION_REASONS``)."""

    rejections: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECTION_REASONS, 0))

    def count(self, reason: str) -> None:
        self.rejections[reason] += 1


def http_metrics(counters: HttpCounters | None) -> Iterator[Metric]:
    """The endpoint's own families (zero before it starts, so the series always exist)."""
    fam = CounterMetricFamily(
        "kvrelay_metrics_http_rejections",
        "Metrics/health connections refused or cut off, by reason: per_peer (an address's "
        "connections all past their request head), evicted (oldest unfinished request head, "
        "past the per-address or overall connection limit), head_timeout, head_too_large, "
        "bad_request, busy (too many /metrics responses in flight), drain_timeout.",
        labels=["reason"],
    )
    c = counters if counters is not None else HttpCounters()
    for reason in REJECTION_REASONS:
        fam.add_metric([reason], c.rejections[reason])
    yield fam


class Collected:
    """One scrape. Without ``pins`` its families are collected now, on the event loop
    (collectors that read the relay's live state), and :meth:`text` writes them out in the
    loop's executor thread.

    With ``pins`` (``{owner: snapshot}``, each taken on the loop), :meth:`text` collects the whole
    registry in the executor instead, and an owner's collector builds its families from its pinned
    snapshot (:func:`pinned`) rather than from live state. prometheus_client's own metrics lock
    themselves, so they may be read from any thread. At 64 pools the relay's scrape then holds the
    loop for 1.97 ms instead of 12.99 (``benchmarks/results/fleet_planes.json``)."""

    __slots__ = ("_pins", "_registry", "families")

    def __init__(self, registry: Collector, pins: Mapping[object, object] | None = None) -> None:
        self._registry = registry
        self._pins = dict(pins) if pins is not None else None
        self.families: list[Metric] = [] if pins is not None else list(registry.collect())

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)

    def text(self, openmetrics_format: bool = False) -> bytes:
        """The page: text format 0.0.4, or OpenMetrics 1.0.0 (``# EOF`` included)."""
        write = openmetrics.generate_latest if openmetrics_format else generate_latest
        if self._pins is None:
            return write(self)
        held = getattr(_pins, "held", None)
        _pins.held = self._pins
        try:
            return write(self._registry)
        finally:
            _pins.held = held


_pins = threading.local()


def pinned(owner: object) -> object | None:
    """The snapshot a :class:`Collected` pinned for ``owner`` on this thread while it writes its
    text, or None (a collection on the loop, which reads live state)."""
    held: dict[object, object] | None = getattr(_pins, "held", None)
    return None if held is None else held.get(owner)


def _media_ranges(value: bytes) -> Iterator[tuple[bytes, dict[bytes, bytes]]]:
    """An ``Accept``-style header's entries: (lowercase value, its parameters)."""
    for item in value.split(b","):
        name, *params = item.split(b";")
        args: dict[bytes, bytes] = {}
        for p in params:
            k, _, v = p.partition(b"=")
            args[k.strip().lower()] = v.strip().strip(b'"')
        yield name.strip().lower(), args


def _quality(args: Mapping[bytes, bytes]) -> float:
    try:
        q = float(args.get(b"q", b"1"))
    except ValueError:
        return 0.0
    return q if 0.0 <= q <= 1.0 else 0.0


def wants_openmetrics(accept: bytes) -> bool:
    """Whether ``accept`` asks for OpenMetrics (a version this endpoint writes) at least as much
    as for the text format. Only a named ``application/openmetrics-text`` counts: a wildcard
    (``*/*``, curl's default) gets the text format every Prometheus reads."""
    om = text = 0.0
    for name, args in _media_ranges(accept):
        q = _quality(args)
        if name == b"application/openmetrics-text":
            if args.get(b"version", b"1.0.0") in _OPENMETRICS_VERSIONS:
                om = max(om, q)
        elif name in (b"text/plain", b"text/*", b"*/*"):
            text = max(text, q)
    return om > 0.0 and om >= text


def accepts_gzip(accept_encoding: bytes) -> bool:
    """Whether ``Accept-Encoding`` accepts ``gzip`` (by name, or ``*``, with a q above 0)."""
    named: float | None = None
    star: float | None = None
    for name, args in _media_ranges(accept_encoding):
        if name in (b"gzip", b"x-gzip"):
            named = max(named or 0.0, _quality(args))
        elif name == b"*":
            star = _quality(args)
    q = named if named is not None else star
    return q is not None and q > 0.0


def _headers(head: bytes) -> dict[bytes, bytes]:
    """A request head's header fields (lowercase names; a repeated field's values joined)."""
    out: dict[bytes, bytes] = {}
    for line in head.split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            key = name.strip().lower()
            out[key] = out[key] + b"," + value.strip() if key in out else value.strip()
    return out


def _page(body: bytes | Collected, openmetrics_format: bool, compress: bool) -> bytes:
    """The response body (in the executor: writing and compressing grow with every pool)."""
    data = body.text(openmetrics_format) if isinstance(body, Collected) else body
    return gzip.compress(data, GZIP_LEVEL, mtime=0) if compress else data


class MetricsServer:
    """``GET /metrics`` → ``render()`` (text format 0.0.4 or, when asked for, OpenMetrics; a
    :class:`Collected` is written out off the loop, gzipped when the client accepts it);
    ``GET /healthz`` → ``healthy()``."""

    def __init__(
        self,
        render: Callable[[], bytes | Collected],
        healthy: Callable[[], bool] = lambda: True,
        limits: HttpLimits | None = None,
        counters: HttpCounters | None = None,
    ) -> None:
        self._render = render
        self._healthy = healthy
        self.limits = limits if limits is not None else HttpLimits()
        self.counters = counters if counters is not None else HttpCounters()
        self._server: asyncio.base_events.Server | None = None
        self._conns: dict[asyncio.Task[Any], _Conn] = {}
        self._per_peer: dict[str, int] = {}
        self._scrapes = 0

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
                self._handle, host, port, limit=MAX_REQUEST_HEAD, backlog=256
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
        await stop_all(list(self._conns))
        await server.wait_closed()

    def _admit(self, task: asyncio.Task[Any], conn: _Conn) -> str | None:
        """Track ``conn``, or say why it is refused (``per_peer``/``busy``)."""
        lim = self.limits
        if self._per_peer.get(conn.peer, 0) >= lim.max_per_peer and not self._evict(conn.peer):
            return "per_peer"
        if len(self._conns) >= lim.max_connections and not self._evict(None):
            return "busy"
        self._conns[task] = conn
        self._per_peer[conn.peer] = self._per_peer.get(conn.peer, 0) + 1
        return None

    def _evict(self, peer: str | None) -> bool:
        """End the oldest connection still reading its request head (of ``peer``, or of anyone
        with None); False when there is none."""
        oldest = min(
            (t for t, c in self._conns.items() if c.reading and (peer is None or c.peer == peer)),
            key=lambda t: self._conns[t].opened, default=None,
        )  # fmt: skip
        if oldest is None:
            return False
        # answered, not dropped: its whole request may already be in the socket (its task not
        # yet run), and a probe cut off with no status cannot tell the relay from a dead one
        with contextlib.suppress(Exception):  # (a few bytes into the socket buffer)
            self._conns[oldest].writer.write(_TOO_MANY)
        self._forget(oldest)
        oldest.cancel()
        self.counters.count("evicted")
        return True

    def _forget(self, task: asyncio.Task[Any]) -> None:
        conn = self._conns.pop(task, None)
        if conn is None:
            return
        left = self._per_peer[conn.peer] - 1
        if left:
            self._per_peer[conn.peer] = left
        else:
            del self._per_peer[conn.peer]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        peername = writer.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) else str(peername)
        conn = _Conn(peer, writer, time.monotonic())
        refused = self._admit(task, conn)
        try:
            if refused is not None:
                self.counters.count(refused)
                # a few bytes into the socket buffer; never waits on the peer
                writer.write(_TOO_MANY)
                return
            await self._serve(reader, writer, conn)
        except asyncio.CancelledError:
            pass  # evicted, or the endpoint is closing
        except ConnectionError:
            pass
        finally:
            self._forget(task)
            _shut(writer)

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Conn
    ) -> None:
        try:
            head = await asyncio.wait_for(
                reader.readuntil(b"\r\n\r\n"), self.limits.head_timeout_s
            )
        except (asyncio.LimitOverrunError, ValueError):
            self.counters.count("head_too_large")
            await self._respond(writer, 431, b"request head too large\n")
            return
        except TimeoutError:
            self.counters.count("head_timeout")
            return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        if asyncio.current_task() not in self._conns:
            return  # evicted (answered 503) as its head arrived: the cancel was lost on the way
        conn.reading = False
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            self.counters.count("bad_request")
            await self._respond(writer, 400, b"bad request\n")
            return
        method, path = parts[0], parts[1].split(b"?", 1)[0]
        head_only = method == b"HEAD"
        if method not in (b"GET", b"HEAD"):
            await self._respond(
                writer, 405, b"method not allowed\n", extra=b"Allow: GET, HEAD\r\n"
            )
        elif path == b"/metrics":
            fields = _headers(head)
            await self._scrape(
                writer, head_only, wants_openmetrics(fields.get(b"accept", b"")),
                accepts_gzip(fields.get(b"accept-encoding", b"")),
            )  # fmt: skip
        elif path in (b"/", b"/healthz"):
            if self._healthy():
                await self._respond(writer, 200, b"ok\n", head_only=head_only)
            else:
                await self._respond(writer, 503, b"not serving\n", head_only=head_only)
        else:
            await self._respond(writer, 404, b"not found\n", head_only=head_only)

    async def _scrape(
        self, writer: asyncio.StreamWriter, head_only: bool, om: bool = False, gz: bool = False
    ) -> None:
        if self._scrapes >= self.limits.max_scrapes:
            self.counters.count("busy")
            await self._respond(writer, 503, b"too many concurrent scrapes\n")
            return
        self._scrapes += 1
        try:
            try:
                rendered = self._render()
                om = om and isinstance(rendered, Collected)  # plain bytes are text format
                if isinstance(rendered, Collected) or gz:
                    body = await asyncio.get_running_loop().run_in_executor(
                        None, _page, rendered, om, gz
                    )
                else:
                    body = rendered
            except Exception:
                _log.exception("metrics_collect_failed")
                await self._respond(writer, 500, b"collection failed\n")
                return
            # The classic text format 0.0.4 unless OpenMetrics was asked for: every Prometheus
            # understands the text format.
            extra = b"Vary: Accept, Accept-Encoding\r\n"
            if gz:
                extra += b"Content-Encoding: gzip\r\n"
            await self._respond(
                writer, 200, body, CONTENT_TYPE_OPENMETRICS if om else CONTENT_TYPE_PLAIN_0_0_4,
                head_only=head_only, extra=extra,
            )  # fmt: skip
        finally:
            self._scrapes -= 1

    async def _respond(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
        *,
        head_only: bool = False,
        extra: bytes = b"",
    ) -> None:
        head = _head(status, body, content_type, extra)
        writer.write(head if head_only else head + body)
        try:
            await asyncio.wait_for(writer.drain(), self.limits.drain_timeout_s)
        except TimeoutError:
            self.counters.count("drain_timeout")


def _head(
    status: int, body: bytes, content_type: str = "text/plain; charset=utf-8", extra: bytes = b""
) -> bytes:
    return (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
    ).encode() + extra + b"\r\n"


#: The answer of a connection refused, or evicted, for want of a place.
_TOO_MANY = _head(503, b"too many connections\n") + b"too many connections\n"


def _shut(writer: asyncio.StreamWriter) -> None:
    """Close without waiting on the peer: flush what the kernel takes, drop the rest on abort."""
    transport = writer.transport
    if transport.get_write_buffer_size():
        transport.abort()
    else:
        writer.close()
