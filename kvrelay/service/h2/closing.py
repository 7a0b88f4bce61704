"""``ClosingServer``: a grpclib ``Server`` that also closes live HTTP/2 connections on shutdown.

Why: ``Server.close()`` stops listening and cancels running requests but leaves accepted
connections open, so a client could keep calling a relay that has shut down (and see its old
identity). kvrelay closes every connection once all streams have ended (their EOFs and trailers
are already written; the transport flushes them before closing), by halves where it can: FIN
after the last frame, and what the client still sends is read and dropped until it closes its
side (``_half_close``: a socket closed whole answers it with a reset, which can cost the client
the trailers it has not read yet). A stop waits for them to be
gone at most ``CLOSE_WAIT_S`` before it aborts what is left (``wait_closed``: Python 3.12's
asyncio waits for every connection, which an idle client may hold for ever). It needs grpclib's
private ``Server._protocol_factory`` (listed in ``internals.py``). ``announce_drain()`` first
tells each connection's client, with a graceful GOAWAY, to make new calls on a new connection
(``drain.py``).

``peer_check``: a test of each accepted transport (the internal UNIX socket's peer credentials);
a connection that fails it is aborted as soon as it is made, before any HTTP/2 frame is read.

Each connection's protocol is also mended where grpclib mishandles hostile input
(``mend.py``), guarded by the per-connection budgets (``guard.py``) and counted against the
connection caps. A TLS listener listens on plain TCP: each connection is admitted under the caps
before its handshake, which ``tls_gate.py`` then runs under a deadline.

``revoke(is_revoked, ending)``: from then on each TLS connection's client certificate is also
checked against the CRLs in use when its handshake ends, and the open connections are checked at
once (a reload brought new CRLs: OpenSSL checks a certificate only at the handshake). Every
request of an open connection whose certificate is revoked ends with ``ending()`` as its status
(the service's UNAUTHENTICATED, ``status.py``: a router must not retry with that certificate,
where a lost connection's UNAVAILABLE asks it to), a request that arrives meanwhile too; once
they have all ended (their trailers written) and the client has acknowledged a PING sent after
them (it has read them: grpclib's client drops a status it has not read when the connection
closes), the connection gets its GOAWAY and is closed, as a drain ends its connections. A client
that does not read, or does not close its side once told, does not keep the connection:
``revoked_close_s`` after the reload it is aborted (the TLS layer waits 30 s for its close).
A request cut in the middle of a message is reset instead (``bulk.abandon``: trailers there
would read as the rest of the message).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import weakref
from collections.abc import Callable
from typing import Any

from grpclib.server import Server
from h2.settings import SettingCodes

from kvrelay.service.h2 import deadline
from kvrelay.service.h2.drain import DrainNotice
from kvrelay.service.h2.guard import ConnectionCaps, H2Budgets, H2Counters, guard_protocol
from kvrelay.service.h2.internals import (
    H2Protocol,
    bound_closed_streams,
    close_unstarted,
    end_requests,
    flushed_to_client,
    handlers_closed,
    missing_in_closed_streams,
    missing_in_linger,
    missing_in_revoke,
    missing_in_stream_cap,
    once_connected,
    put_stream_cap_in_force,
)
from kvrelay.service.h2.mend import mend_protocol
from kvrelay.service.h2.tls_gate import (
    TLS_HANDSHAKE_TIMEOUT_S,
    Handshakes,
    TlsGate,
    peer_certificate,
)

#: A TLS listener's context: one, or what gives the one in use now (a reload may replace it).
TlsSource = ssl.SSLContext | Callable[[], ssl.SSLContext]

__all__ = ["CLOSE_WAIT_S", "REVOKED_CLOSE_S", "ClosingServer"]

#: Seconds a revoked connection has, from the reload, for its requests' statuses and its
#: close; then it is aborted (a client that does not read must not hold it).
REVOKED_CLOSE_S = 2.0
#: Seconds a connection closed at shutdown has to be gone; then it is aborted (``wait_closed``).
CLOSE_WAIT_S = 2.0
#: How often a revoked connection is looked at for requests that started meanwhile.
_REVOKED_POLL_S = 0.05


class ClosingServer(Server):
    """grpclib ``Server`` with ``close_connections()`` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        deadline.install()  # a call's deadline passed before its handler: DEADLINE_EXCEEDED
        self._protocols: weakref.WeakSet[H2Protocol] = weakref.WeakSet()
        self._notices: weakref.WeakKeyDictionary[H2Protocol, DrainNotice] = (
            weakref.WeakKeyDictionary()
        )
        self.peer_check: Callable[[asyncio.BaseTransport], bool] | None = None
        #: per-connection HTTP/2 budgets (``guard.py``); None: none
        self.h2_guard: tuple[H2Budgets, H2Counters] | None = None
        #: connections per peer address and in all (``guard.py``); None: unbounded
        self.connection_caps: ConnectionCaps | None = None
        self.tls_handshake_timeout_s = TLS_HANDSHAKE_TIMEOUT_S
        #: SETTINGS_MAX_CONCURRENT_STREAMS each connection is told (None: h2's 100)
        self.max_concurrent_streams: int | None = None
        #: closed streams h2 remembers per connection (None: h2's 65,536; ``internals``)
        self.closed_streams_kept: int | None = None
        self._tls: Callable[[], ssl.SSLContext] | None = None
        self._gates: weakref.WeakSet[TlsGate] = weakref.WeakSet()
        #: gates admitted and still in their TLS handshake (``_make_room``)
        self._handshaking = Handshakes()
        #: connections closed by halves at shutdown: what their clients send is dropped
        self._lingering: weakref.WeakSet[H2Protocol] = weakref.WeakSet()
        #: whether a client certificate (DER) is revoked now (``revoke``); None: no check
        self._is_revoked: Callable[[bytes], bool] | None = None
        self.revoked_close_s = REVOKED_CLOSE_S
        #: seconds a connection has, once closed at shutdown, to be gone before it is aborted
        self.close_wait_s = CLOSE_WAIT_S
        #: connections made and not lost yet, with their transports (``_track``)
        self._live: dict[H2Protocol, asyncio.BaseTransport] = {}
        self._none_live = asyncio.Event()
        #: live connections someone waits to see gone (``_when_gone``)
        self._gone_waiters: dict[H2Protocol, asyncio.Future[None]] = {}
        #: revoked connections being ended (``revoke``): their gates, and the tasks ending them
        self._revoking: weakref.WeakSet[TlsGate] = weakref.WeakSet()
        self._endings: set[asyncio.Task[None]] = set()

    async def start(self, *args: Any, ssl: TlsSource | None = None, **kwargs: Any) -> None:
        """grpclib's ``start``; with ``ssl``, on plain TCP, each connection's TLS handshake run
        by its ``TlsGate`` once the connection is admitted (see the module docstring)."""
        if ssl is not None:
            self._tls = ssl if callable(ssl) else (lambda: ssl)
        await super().start(*args, **kwargs)

    def _protocol_factory(self) -> Any:
        proto = super()._protocol_factory()
        self._protocols.add(proto)
        self._track(proto)
        if self.h2_guard is not None:
            mend_protocol(proto, self.h2_guard[1])  # under the guard: it sees frames first
            guard_protocol(proto, *self.h2_guard)
        self._drop_when_lingering(proto)  # outermost: nothing reaches h2 once closed by halves
        notice = DrainNotice.install(proto)
        if notice is not None:
            self._notices[proto] = notice
        if self.max_concurrent_streams is not None:
            _announce_stream_cap(proto, self.max_concurrent_streams)
        if self.closed_streams_kept is not None:
            _bound_closed_streams(proto, self.closed_streams_kept)
        if self._tls is not None:
            counters = self.h2_guard[1] if self.h2_guard is not None else H2Counters()
            gate = TlsGate(proto, self._tls, self._admit, counters, self.tls_handshake_timeout_s,
                           revoked=self._revoked_transport,
                           handshaking=self._handshaking)  # fmt: skip
            self._gates.add(gate)
            return gate
        if self.peer_check is not None or self.connection_caps is not None:
            self._admitted(proto)
        return proto

    def _drop_when_lingering(self, proto: H2Protocol) -> None:
        """What the client sends once its connection was closed by halves (``_half_close``)
        is read and dropped: grpclib's side is closed. Installed before the transport exists
        (uvloop's transports keep the ``data_received`` they find when made)."""
        received = proto.data_received
        lingering = self._lingering

        def data_received(data: bytes) -> None:
            if proto not in lingering:
                received(data)

        proto.data_received = data_received  # type: ignore[method-assign]

    def _track(self, proto: H2Protocol) -> None:
        """``proto`` is in ``_live``, with its transport (with TLS, the TLS one), from its
        ``connection_made`` to its ``connection_lost`` (a connection refused before it started
        never is; grpclib forgets the transport as it closes it). Installed first: the set-ups
        made after it (the caps, the TLS gate) wrap these."""
        made, lost = proto.connection_made, proto.connection_lost

        def connection_made(transport: asyncio.BaseTransport) -> None:
            self._live[proto] = transport
            made(transport)

        def connection_lost(exc: BaseException | None) -> None:
            self._live.pop(proto, None)
            waiter = self._gone_waiters.pop(proto, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            if not self._live:
                self._none_live.set()
            lost(exc)

        proto.connection_made = connection_made  # type: ignore[method-assign]
        proto.connection_lost = connection_lost  # type: ignore[method-assign]

    def _when_gone(self, proto: H2Protocol) -> asyncio.Future[None]:
        """Done once ``proto``'s connection is gone (at once if it is not live)."""
        waiter = self._gone_waiters.get(proto)
        if waiter is None:
            waiter = asyncio.get_running_loop().create_future()
            if proto in self._live:
                self._gone_waiters[proto] = waiter
            else:
                waiter.set_result(None)
        return waiter

    async def _gone(self, timeout: float) -> bool:
        """Whether every connection is gone within ``timeout`` seconds."""
        if self._live:
            self._none_live.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._none_live.wait(), timeout)
        return not self._live

    def _admit(self, transport: asyncio.BaseTransport) -> Callable[[], None] | None:
        """The peer check, then a place under the caps (taken only after the check passed): the
        place's release, or None when the connection is refused."""
        check, caps = self.peer_check, self.connection_caps
        if check is not None and not check(transport):
            return None
        return _nothing if caps is None else caps.admit(transport, self._make_room)

    def _make_room(self, address: str | None) -> bool:
        """A cap is reached (``address``'s own, or None: ``max_connections``): the connection
        longest in its TLS handshake under that cap is closed for the new one. Else peers that
        need no certificate to connect could hold every place by never finishing a handshake,
        each opened again as it is closed, and lock out every router (from a router's own
        address, a NAT's or a sidecar's, its address's places alone); a router's handshake takes
        milliseconds, theirs would have to be replaced faster than that, all of them.
        Established connections are never evicted."""
        gate = self._handshaking.oldest(address)
        if gate is None:
            return False
        gate.evict()  # (its place given back and itself out of ``_handshaking`` at once)
        return True

    def _admitted(self, proto: H2Protocol) -> None:
        """A connection the peer check refuses, or one over the connection caps, is aborted as
        it is accepted, before any frame: the protocol never starts. Both callbacks are replaced
        now: uvloop's transports keep those they find when made."""
        made, lost = proto.connection_made, proto.connection_lost
        release: Callable[[], None] | None = None

        def connection_made(transport: asyncio.BaseTransport) -> None:
            nonlocal release
            release = self._admit(transport)
            if release is None:
                proto.data_received = _ignore  # type: ignore[method-assign,assignment]
                self._protocols.discard(proto)
                close_unstarted(proto)  # or grpclib's Server keeps its handler for ever
                transport.abort()  # type: ignore[attr-defined]
                return
            made(transport)

        def connection_lost(exc: BaseException | None) -> None:
            if release is None:
                return  # refused: the protocol never started
            release()
            lost(exc)

        proto.connection_made = connection_made  # type: ignore[method-assign]
        proto.connection_lost = connection_lost  # type: ignore[method-assign]

    def announce_drain(self) -> None:
        """Graceful GOAWAY on every connection: now where no stream is open, else after its
        last stream ends (``drain.py``)."""
        for notice in list(self._notices.values()):
            notice.drain()

    async def wait_closed(self) -> None:
        """Wait for the requests grpclib's ``close`` cancelled to end, close every connection
        (``close_connections``), wait until each is gone, aborting those still there after
        ``close_wait_s``, then for the listener.

        Why not grpclib's order (the listener's ``wait_closed`` first, then the requests): from
        Python 3.12 asyncio's ``Server.wait_closed`` also waits until every connection it
        accepted is gone, and a client may keep an idle connection open after its GOAWAY
        (grpcio does): the relay's stop waited for ever. And a closed connection may linger: a
        TLS one waits up to 30 s for the client's TLS close, one whose client reads nothing
        until its unsent bytes drain; a stop ends them all."""
        await handlers_closed(self)  # (nothing to wait for without grpclib's handlers)
        self.close_connections()
        if not await self._gone(self.close_wait_s):
            for transport in list(self._live.values()):
                transport.abort()  # type: ignore[attr-defined]
            await self._gone(self.close_wait_s)
        await super().wait_closed()

    def close_connections(self) -> None:
        for task in list(self._endings):
            task.cancel()  # a revoked connection being ended: aborted, as the rest are closed
        for gate in list(self._gates):
            gate.abort()  # still handshaking: it has no stream to end
        for proto in list(self._protocols):
            self._close(proto, "relay shut down", linger=True)

    def _close(self, proto: H2Protocol, reason: str, *, linger: bool = False) -> bool:
        """GOAWAY (``drain.py``), then grpclib's close; False when it never started.
        ``linger`` (a shutdown): by halves where the transport can (``_HalfClose``)."""
        conn = getattr(proto, "connection", None)
        processor = getattr(proto, "processor", None)
        if conn is None or processor is None:
            return False
        notice = self._notices.get(proto)
        if notice is not None:
            notice.final()
        if linger:
            self._half_close(proto)
        processor.close(reason)
        return True

    def _half_close(self, proto: H2Protocol) -> None:
        """Make grpclib's close of ``proto``'s connection shut its write side only, and drop
        what the client sends from then on (``_lingering``): the connection ends when the
        client closes its side, having read everything (``wait_closed`` aborts one still there
        after ``close_wait_s``). Why: closed whole, the socket answered whatever the client
        still sent (a WINDOW_UPDATE for the last DATA, a PING's answer) with a reset, and a
        client whose next write then failed lost the trailers it had received but not read
        yet: a mirror behind a draining relay told its routers "connection lost" where the
        relay had said OK (2 of 4 drains of a mirror chain). TLS transports cannot shut one
        half: closed whole, as before."""
        transport = self._live.get(proto)
        if (
            transport is None or proto in self._lingering or missing_in_linger(proto)
            or transport.is_closing() or not transport.can_write_eof()  # type: ignore[attr-defined]
        ):  # fmt: skip
            return
        conn: Any = proto.connection
        conn._transport = _HalfClose(transport)
        self._lingering.add(proto)

    def revoke(
        self, is_revoked: Callable[[bytes], bool], ending: Callable[[], Exception]
    ) -> int:
        """Check client certificates with ``is_revoked`` from now on, and end the open
        connections it revokes now, each request with ``ending()`` as its status (see the
        module docstring): how many, also counted as ``tls_revoked_open`` with the HTTP/2
        counters."""
        self._is_revoked = is_revoked
        ended = 0
        for gate in list(self._gates):
            tls = gate.tls
            if (tls is None or tls.is_closing() or gate in self._revoking
                    or not self._revoked_transport(tls)):  # fmt: skip
                continue
            if self._end_revoked(gate, ending):
                ended += 1
        if ended and self.h2_guard is not None:
            self.h2_guard[1].count("tls_revoked_open", ended)
        return ended

    def _end_revoked(self, gate: TlsGate, ending: Callable[[], Exception]) -> bool:
        """Start ending a revoked connection; False when its protocol never started."""
        proto = gate.inner
        if getattr(proto, "connection", None) is None or getattr(proto, "processor", None) is None:
            return False
        self._revoking.add(gate)
        task = asyncio.get_running_loop().create_task(self._ending_revoked(gate, ending))
        self._endings.add(task)
        task.add_done_callback(self._endings.discard)
        return True

    async def _ending_revoked(self, gate: TlsGate, ending: Callable[[], Exception]) -> None:
        """Each request's status, then the GOAWAY and the close, all within
        ``revoked_close_s``; the connection is aborted if it is still there then."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.revoked_close_s
        proto = gate.inner
        lost = self._when_gone(proto)
        try:
            if not missing_in_revoke(proto):
                # until none runs: a request the client sent meanwhile is ended too
                while running := end_requests(proto, ending):
                    left = deadline - loop.time()
                    if left <= 0 or lost.done():
                        break
                    await asyncio.wait((*running, lost), timeout=min(left, _REVOKED_POLL_S),
                                       return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            read = None if lost.done() else flushed_to_client(proto)
            if read is not None:  # the client has read the statuses before it sees the close
                await asyncio.wait((read, lost), timeout=max(0.0, deadline - loop.time()),
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            if not lost.done():
                self._close(proto, "client certificate revoked")  # flushes what was written
                await asyncio.wait((lost,), timeout=max(0.0, deadline - loop.time()))
        finally:
            tls: Any = gate.tls
            if not lost.done() and tls is not None:
                tls.abort()  # a client that does not read, or does not close its side

    def _revoked_transport(self, transport: asyncio.BaseTransport) -> bool:
        check = self._is_revoked
        if check is None:
            return False
        der = peer_certificate(transport)
        return der is not None and check(der)


def _announce_stream_cap(proto: H2Protocol, streams: int) -> None:
    """Tell the client, right after grpclib's own SETTINGS, how many streams it may open at once,
    and enforce that from the first byte. h2 says 100, below what the relay's limits allow one
    connection: a mirror (so every fan-out worker) or an SDK subscribing to more than about 96
    pools on one channel had the rest of its streams wait, without a byte or a status, for one
    of the first to end. h2 enforces what it announces only once the client acknowledges it,
    its 100 until then; a client may open streams before it has read the relay's SETTINGS (RFC
    9113's initial limit is unlimited), so the cap is put in force at once
    (``internals.put_stream_cap_in_force``; where that is missing, h2's 100 until the ACK). A
    stream over the limit in force is refused alone (``mend.py``). (Internals gone: h2's 100
    stays.)"""

    def install(_transport: Any) -> None:
        conn = proto.connection
        conn._connection.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: streams})
        put_stream_cap_in_force(proto, streams)
        conn.flush()

    once_connected(proto, missing_in_stream_cap, install)


def _bound_closed_streams(proto: H2Protocol, size: int) -> None:
    """Bound h2's memo of the connection's closed streams once it exists (``internals``)."""

    def install(_transport: Any) -> None:
        bound_closed_streams(proto, size)

    once_connected(proto, missing_in_closed_streams, install)


def _ignore(*_args: Any) -> None:
    """A refused connection's protocol callbacks."""


def _nothing() -> None:
    """The release of a connection no cap counts."""


class _HalfClose:
    """The transport grpclib's ``Connection`` holds, for a connection closed at shutdown: its
    ``close`` shuts the write side (the buffered frames, then FIN) and keeps the read side,
    whose data the server drops, until the client closes (``ClosingServer._half_close``);
    everything else is the transport's."""

    __slots__ = ("_transport",)

    def __init__(self, transport: Any) -> None:
        self._transport = transport

    def close(self) -> None:
        t = self._transport
        if not t.is_closing():
            t.write_eof()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
