"""``TlsGate``: a TLS listener's TCP connection from its accept to the end of its handshake.

Why: with ``create_server(ssl=…)`` the event loop calls the application's ``connection_made``
only once the TLS handshake is done, so the connection caps (``guard.py``) never saw a
connection whose handshake was still under way, and asyncio and uvloop wait 60 s for one. A
stranger needing no certificate could hold thousands of accepted sockets (a descriptor and the
TLS buffers each) by opening connections and never finishing their handshake, and lock routers
out when the descriptors ran out.

The server listens on plain TCP instead. Each accepted connection first gets a gate: it takes a
place under the caps (refused and closed at once when there is none), pauses reading, and
upgrades the connection with ``loop.start_tls`` under ``handshake_timeout_s``, with the context
in use *now* (``context()``: a reload's rotated certificate serves the next handshake without an
SNI callback). A handshake that fails or times out is closed and counted
(``kvrelay_http2_abuse_total{reason="tls_handshake"}``); a completed one hands the TLS transport
to grpclib's protocol, which keeps the place until its connection is lost. A handshake OpenSSL
refused because a CRL revokes the client's certificate is also counted as
``tls_revoked_handshake``, and so is one that ``revoked`` (the server's check against the CRLs
in use now) refuses once done: a reload's new CRLs may come while a handshake runs with the
context of before. A handshake that resumed a TLS session (a ticket, or a TLS 1.2 session id)
skips OpenSSL's certificate checks: the session's client certificate is checked against its
validity period once done, and one that expired since (or is not valid yet) is refused and
counted as a failed handshake, as a full handshake with it would be. A connection that
never gets that far (refused, or its handshake failed) has its grpclib request handler closed
when the gate ends, as a lost connection's is: grpclib's server keeps every handler until then.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import Callable
from typing import Any, cast

from kvrelay.service.h2.guard import H2Counters, peer_address
from kvrelay.service.h2.internals import close_unstarted

__all__ = [
    "REVOKED_HANDSHAKE",
    "TLS_HANDSHAKE_TIMEOUT_S",
    "Handshakes",
    "TlsGate",
    "certificate_current",
    "peer_certificate",
]

#: Seconds a client has to finish its TLS handshake (asyncio's default is 60).
TLS_HANDSHAKE_TIMEOUT_S = 10.0
#: The counter of handshakes refused because a CRL revokes the client's certificate.
REVOKED_HANDSHAKE = "tls_revoked_handshake"
#: X509_V_ERR_CERT_REVOKED: OpenSSL's verify result for a certificate a loaded CRL lists.
_CERT_REVOKED = 23


def _is_revocation(exc: BaseException) -> bool:
    return isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_code == _CERT_REVOKED


def peer_certificate(transport: asyncio.BaseTransport) -> bytes | None:
    """The client certificate (DER) a TLS transport verified; None without one."""
    obj = transport.get_extra_info("ssl_object")
    try:
        der = obj.getpeercert(binary_form=True) if obj is not None else None
    except (ValueError, ssl.SSLError):  # the connection is closing
        return None
    return der if isinstance(der, bytes) else None


def certificate_current(transport: asyncio.BaseTransport, now: float) -> bool:
    """Whether the client certificate a TLS transport holds is within its validity period at
    ``now`` (Unix time), as OpenSSL checks a full handshake's; True without one."""
    obj = transport.get_extra_info("ssl_object")
    try:
        cert = obj.getpeercert() if obj is not None else None
        if not cert:
            return True
        start = ssl.cert_time_to_seconds(str(cert["notBefore"]))
        end = ssl.cert_time_to_seconds(str(cert["notAfter"]))
    except (ValueError, KeyError, ssl.SSLError):  # closing, or no times: nothing to refuse
        return True
    return start <= now <= end


class Handshakes:
    """A server's connections in their TLS handshake, oldest first, in all and per peer address:
    the ones a full port closes first to make room (``ClosingServer._make_room``)."""

    __slots__ = ("_all", "_by_address")

    def __init__(self) -> None:
        self._all: dict[TlsGate, str | None] = {}
        self._by_address: dict[str, dict[TlsGate, None]] = {}

    def add(self, gate: TlsGate, address: str | None) -> None:
        self._all[gate] = address
        if address is not None:
            self._by_address.setdefault(address, {})[gate] = None

    def discard(self, gate: TlsGate) -> None:
        if gate not in self._all:
            return
        address = self._all.pop(gate)
        if address is not None:
            same = self._by_address[address]
            del same[gate]
            if not same:
                del self._by_address[address]

    def oldest(self, address: str | None = None) -> TlsGate | None:
        """The connection longest in its handshake (from ``address``, when given)."""
        gates = self._all if address is None else self._by_address.get(address, {})
        return next(iter(gates), None)


class TlsGate(asyncio.Protocol):
    """One accepted TCP connection until its TLS handshake is done (see the module docstring).

    ``admit(transport)``: the place's release, or None when the connection is refused (the
    caller counted it). ``inner``: grpclib's protocol for the connection once it speaks TLS.
    The gate is the TLS layer's protocol until then: what the client sends right after its
    handshake (its HTTP/2 preface) is kept and handed to ``inner`` once it is made.
    """

    def __init__(
        self,
        inner: Any,
        context: Callable[[], ssl.SSLContext],
        admit: Callable[[asyncio.BaseTransport], Callable[[], None] | None],
        counters: H2Counters,
        handshake_timeout_s: float = TLS_HANDSHAKE_TIMEOUT_S,
        revoked: Callable[[asyncio.BaseTransport], bool] | None = None,
        handshaking: Handshakes | None = None,
    ) -> None:
        self.inner = inner
        #: the server's gates in their handshake, oldest first: this one from its admission
        #: to the end of its handshake
        self._handshaking = handshaking
        self._context = context
        self._admit = admit
        self._counters = counters
        self._timeout_s = handshake_timeout_s
        self._revoked = revoked
        #: the TLS transport once the handshake is done and ``inner`` took it
        self.tls: asyncio.BaseTransport | None = None
        self._release: Callable[[], None] | None = None
        self._raw: asyncio.Transport | None = None
        self._task: asyncio.Task[None] | None = None
        self._early: list[bytes] = []  # at most what arrives in the loop turn of the handover
        self._handed_over = False  # inner's connection_made was called: it owns its handler
        lost = inner.connection_lost

        def connection_lost(exc: BaseException | None) -> None:
            self._give_back()
            lost(exc)

        inner.connection_lost = connection_lost

    @property
    def handshaking(self) -> bool:
        return self._task is not None and not self._task.done()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._raw is not None:
            return  # the TLS layer's call (asyncio makes none; uvloop's may)
        release = self._admit(transport)
        if release is None:
            close_unstarted(self.inner)
            transport.abort()  # type: ignore[attr-defined]
            return
        self._release = release
        if self._handshaking is not None:
            self._handshaking.add(self, peer_address(transport))
        self._raw = cast(asyncio.Transport, transport)  # uvloop's is no asyncio.Transport
        self._raw.pause_reading()  # the ClientHello waits for the TLS layer
        self._task = asyncio.get_running_loop().create_task(self._handshake(self._raw))

    async def _handshake(self, raw: asyncio.Transport) -> None:
        loop = asyncio.get_running_loop()
        upgrade = loop.create_task(loop.start_tls(
            raw, self, self._context(), server_side=True, ssl_handshake_timeout=self._timeout_s,
        ))  # fmt: skip
        try:
            await asyncio.sleep(0)  # its first step (tasks run in order) has taken the transport
            self._hand_over_hello(raw)
            tls = await upgrade
        except asyncio.CancelledError:
            upgrade.cancel()
            raw.abort()
            self._give_back()
            raise
        except Exception as exc:  # a failed or timed-out handshake, a peer gone: closed, counted
            self._counters.count("tls_handshake")
            if _is_revocation(exc):
                self._counters.count(REVOKED_HANDSHAKE)
            raw.abort()
            self._give_back()
            return
        if tls is None or tls.is_closing() or self._release is None:
            self._give_back()
            return
        if self._revoked is not None and self._revoked(tls):
            self._counters.count(REVOKED_HANDSHAKE)
            tls.abort()
            self._give_back()
            return
        if not certificate_current(tls, time.time()):  # a resumed session's, expired since
            self._counters.count("tls_handshake")
            tls.abort()
            self._give_back()
            return
        self._settled()
        tls.set_protocol(self.inner)
        self.tls = tls
        self._handed_over = True
        self.inner.connection_made(tls)
        early, self._early = self._early, []
        for data in early:
            if tls.is_closing():
                break
            self.inner.data_received(data)

    def _hand_over_hello(self, raw: asyncio.Transport) -> None:
        """Bytes this gate read before the TLS layer took the transport (uvloop starts reading
        only after ``connection_made`` returns, so the pause there does not hold it): the
        ClientHello, handed to the TLS layer before its handshake starts reading."""
        early, self._early = self._early, []
        tls_layer: Any = raw.get_protocol()  # both loops' TLS layers are buffered protocols
        if not early or tls_layer is self:
            return
        for data in early:
            view = memoryview(data)
            while view:
                buf = memoryview(tls_layer.get_buffer(len(view)))
                n = min(len(buf), len(view))
                buf[:n] = view[:n]
                tls_layer.buffer_updated(n)
                view = view[n:]

    def data_received(self, data: bytes) -> None:
        """Bytes read before the TLS layer took the transport (raw, handed over to it), then
        application data it decrypted before ``inner`` took over (handed to ``inner``)."""
        self._early.append(data)

    def eof_received(self) -> bool | None:
        return None  # the TLS layer closes the connection

    def connection_lost(self, exc: BaseException | None) -> None:
        """The connection ended while this gate was its protocol: the raw one's (the handshake
        task is cancelled), or the TLS layer's while handshaking (the layer fails the handshake
        itself, which ``_handshake`` counts)."""
        raw = self._raw
        if (self._task is not None and not self._task.done() and raw is not None
                and raw.get_protocol() is self):  # fmt: skip
            self._task.cancel()
        self._give_back()

    def _settled(self) -> None:
        """The handshake is over (done, failed, or the connection gone): not evictable."""
        if self._handshaking is not None:
            self._handshaking.discard(self)

    def evict(self) -> None:
        """Its place given back now, and the connection closed: a connection still handshaking
        makes room for a new one on a full port (``ClosingServer``)."""
        self._counters.count("tls_handshake_evicted")
        self._give_back()
        self.abort()

    def abort(self) -> None:
        """Shutdown: a connection still handshaking is closed now."""
        if self.handshaking and self._raw is not None:
            with contextlib.suppress(Exception):
                self._raw.abort()
            assert self._task is not None
            self._task.cancel()

    def _give_back(self) -> None:
        """The place under the caps back; the handler of a connection inner never got, closed."""
        self._settled()
        release, self._release = self._release, None
        if release is not None:
            release()
        if not self._handed_over:
            close_unstarted(self.inner)
