"""The relay's ZAP handler (ZMQ RFC 27): who may finish a handshake on a bound socket.

libzmq asks a ZAP handler before it completes the ZMTP handshake of a connection to a socket
that has a ``ZMQ_ZAP_DOMAIN`` (and for every CURVE handshake): it sends a request over inproc to
``inproc://zeromq.zap.01`` of the socket's own context and holds the connection until the
answer. Until then nothing the peer sends is taken as a message, so a refusal here costs the
relay one handshake (and at most the one frame libzmq was reading meanwhile), never a message's
frames. How a refusal ends the connection depends on the status: see ``CLOSE``.

There is one such endpoint per context, so one handler per context serves every bound socket of
it: each socket registers its own domain (``register``) with a function that answers for it;
a request for a domain nobody registered is refused. The handler is a ROUTER served by a thread
of its own, not the event loop: libzmq goes on reading a connection while its handshake waits
for the answer (up to a frame of ``ZMQ_MAXMSGSIZE``), so every moment the answer waits costs
memory, and behind a stalled loop strangers' connections piled up unanswered (200 sending
16 MiB frames held 1.7-2.1 GiB; now 5-14 MB). The thread still needs the GIL (a busy loop hands
it over every switch interval, 1 ms in the relay, at each of the thread's socket calls) and a
CPU. A ``decide`` function therefore runs on that thread: it must be thread-safe. The handler
exists while at least one domain is registered (``acquire`` … ``release``). A ``decide`` function
may also ask the thread to call something of its own later (``call_later``): a follow-up that
must not wait for the event loop either.

If no handler is bound when a handshake needs one, libzmq 4.3 lets NULL and CURVE handshakes
through unless the socket sets ``ZMQ_ZAP_ENFORCE_DOMAIN`` (the connect socket does: with it, such
handshakes fail). A handler that is bound but does not answer (its thread stopped) holds the
handshake until ``ZMQ_HANDSHAKE_IVL``, then libzmq ends the connection: it fails closed.

Request frames (after the ROUTER's routing id and the empty delimiter): version ``1.0``, request
id, domain, address (the peer's IP address, without a port; empty for IPC), routing id,
mechanism (``NULL``, ``PLAIN``, ``CURVE``), then the mechanism's credentials (CURVE: the
client's 32-byte public key). Reply: version, the same request id, status code (``200``, or
``300``/``400``/``500``; and ``CLOSE``, below), status text, user id (what ``decide`` gives,
else empty), metadata (empty).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from kvrelay.logging import get_logger

__all__ = ["CLOSE", "ENDPOINT", "Request", "Verdict", "ZapHandler", "acquire", "release"]

ENDPOINT = "inproc://zeromq.zap.01"
VERSION = b"1.0"
#: A refusal that ends the connection at once. After a 400, libzmq 4.3 sends the peer a ZMTP
#: ``ERROR`` and then keeps the connection, still reading it, until the peer hangs up or the
#: handshake's time runs out: a stranger could hold a frame of up to ``ZMQ_MAXMSGSIZE`` per
#: connection that long (20 connections each sending 16 MiB of one frame held 337 MiB). RFC 27
#: defines no 401; libzmq (since 4.2.3) takes a reply with it as malformed and closes the
#: connection on the spot, without an ``ERROR`` (so a libzmq peer connects again later, and is
#: refused again). A ZAP client that accepted the code would read it as 400, its class.
CLOSE = 401
#: Requests answered per wake-up of the handler's thread.
_BATCH = 64
#: How long ``close`` waits for the handler's thread to stop (it answers in microseconds).
_JOIN_S = 5.0
#: Calls waiting on the thread (``call_later``) at most; past it a new one is dropped (logged).
MAX_LATER = 1024

_log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Request:
    """One handshake libzmq asks about."""

    domain: str
    address: str  # the peer's IP address ("" for IPC)
    mechanism: str  # "NULL", "PLAIN", "CURVE"
    credentials: tuple[bytes, ...]


#: (status code, status text[, user id]): ``(200, "OK")``, ``(400, "…")``. libzmq gives the
#: user id of an admitted connection to each of its messages (their ``User-Id`` property).
Verdict = tuple[int, str] | tuple[int, str, str]
Decide = Callable[[Request], Verdict]


class ZapHandler:
    """The ROUTER bound at ``ENDPOINT`` of one context, served by its own thread; answers by
    domain. Use ``acquire``."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        # a plain socket (the thread blocks in poll), on the same libzmq context
        sock: zmq.Socket[Any] = zmq.Context.shadow(ctx.underlying).socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(ENDPOINT)  # EADDRINUSE: another handler owns this context's ZAP
        except BaseException:
            sock.close(linger=0)
            raise
        self._sock: zmq.Socket[Any] | None = sock
        #: a byte written here stops the thread (a pipe, not a ZMQ socket: a context being
        #: terminated waits for its sockets, and the thread closes its own)
        self._wake_r, self._wake_w = os.pipe()
        #: the answers, read by the thread and replaced whole (never changed in place)
        self._domains: dict[bytes, Decide] = {}
        self._guard = threading.Lock()  # one ``_close_socket`` at a time
        self.loop = asyncio.get_running_loop()
        self.answered = 0
        #: (when, order, function): calls due on the thread (``call_later``; the thread only)
        self._later: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = threading.Thread(
            target=self._serve, args=(sock, self._wake_r), name="kvrelay-zap", daemon=True
        )
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._sock is None or self._sock.closed

    @property
    def serving(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def domains(self) -> int:
        return len(self._domains)

    def register(self, domain: str, decide: Decide) -> None:
        key = domain.encode()
        if key in self._domains:
            raise ValueError(f"ZAP domain {domain!r} is registered already")
        self._domains = {**self._domains, key: decide}

    def unregister(self, domain: str) -> None:
        key = domain.encode()
        if key in self._domains:
            self._domains = {k: v for k, v in self._domains.items() if k != key}

    def call_later(self, delay: float, fn: Callable[[], None]) -> bool:
        """Call ``fn`` on the handler's thread ``delay`` seconds from now (or soon after: between
        answers). Only from that thread (a ``decide`` function); whether it was taken (at most
        ``MAX_LATER`` wait)."""
        if len(self._later) >= MAX_LATER:
            _log.error("connect_zap_failed", error="too many calls waiting on the handler")
            return False
        heapq.heappush(self._later, (time.monotonic() + delay, next(self._order), fn))
        return True

    def _run_due(self) -> int | None:
        """Run the calls that are due; milliseconds until the next one (None: none waits)."""
        later = self._later
        while later:
            due = later[0][0] - time.monotonic()
            if due > 0:
                return max(1, math.ceil(due * 1000))
            fn = heapq.heappop(later)[2]
            try:
                fn()
            except Exception as exc:  # a bug: logged, the handler goes on answering
                _log.exception("connect_zap_failed", error=f"{type(exc).__name__}: {exc}")
        return None

    async def close(self) -> None:
        self._close_socket()

    def _close_socket(self) -> None:
        """Stop the thread, then unbind and close (at once: a handler acquired right after
        binds the name again)."""
        with self._guard:
            thread, self._thread = self._thread, None
            if thread is not None:
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, b"x")
                thread.join(_JOIN_S)
                if thread.is_alive():  # its socket is still in use: left as it is (a bug)
                    _log.error("connect_zap_failed", error="handler thread did not stop")
                    return
                for fd in (self._wake_r, self._wake_w):
                    os.close(fd)
            sock, self._sock = self._sock, None
            if sock is not None and not sock.closed:
                # unbind first: closing alone frees the name only once libzmq reaps the
                # socket, and a handler started right after (a re-bind) would find it taken
                with contextlib.suppress(zmq.ZMQError):
                    sock.unbind(ENDPOINT)
                sock.close(linger=0)

    def _serve(self, sock: zmq.Socket[Any], wake: int) -> None:
        """The thread: answer each request as it comes, until ``wake`` is readable."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            timeout: int | None = None
            while True:
                ready = dict(poller.poll(timeout))
                if wake in ready:
                    return
                for _ in range(_BATCH):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    reply = self.answer(frames)
                    if reply is not None:
                        with contextlib.suppress(zmq.Again):  # its session is gone: dropped
                            sock.send_multipart(reply, zmq.NOBLOCK)
                timeout = self._run_due()
        except zmq.ContextTerminated:  # the context is going: it waits for this socket
            sock.close(linger=0)
        except Exception as exc:
            # handshakes now wait for ZMQ_HANDSHAKE_IVL and fail: closed, not open
            _log.error("connect_zap_failed", error=f"{type(exc).__name__}: {exc}")

    def answer(self, frames: list[bytes]) -> list[bytes] | None:
        """The reply to one request as the ROUTER received it (routing id, delimiter, …)."""
        if len(frames) < 3 or frames[1] != b"":
            return None  # not a request envelope: nobody to answer
        head, body = frames[:2], frames[2:]
        if len(body) < 6 or body[0] != VERSION:
            req_id = body[1] if len(body) > 1 else b""
            return [*head, VERSION, req_id, b"500", b"malformed ZAP request", b"", b""]
        _version, req_id, domain, address, _routing_id, mechanism, *creds = body
        decide = self._domains.get(domain)
        user = ""
        if decide is None:
            status, text = 400, "unknown ZAP domain"
        else:
            try:
                status, text, *rest = decide(
                    Request(
                        domain.decode(errors="replace"), address.decode(errors="replace"),
                        mechanism.decode(errors="replace"), tuple(creds),
                    )
                )  # fmt: skip
                user = rest[0] if rest else ""
            except Exception as exc:  # a bug: refuse this one, keep answering
                _log.exception("connect_zap_failed", error=f"{type(exc).__name__}: {exc}")
                status, text = 500, "internal error"
        self.answered += 1
        return [*head, VERSION, req_id, str(status).encode(), text.encode(), user.encode(), b""]


#: context (its libzmq address) → its handler
_HANDLERS: dict[int, ZapHandler] = {}


async def acquire(ctx: zmq.asyncio.Context, domain: str, decide: Decide) -> ZapHandler:
    """The context's handler (bound and served from now on) with ``domain`` registered.

    Raises ``zmq.ZMQError`` if something else holds the context's ZAP endpoint."""
    key = ctx.underlying
    loop = asyncio.get_running_loop()
    handler = _HANDLERS.get(key)
    carried: dict[bytes, Decide] = {}
    if handler is not None and (handler.closed or handler.loop is not loop or not handler.serving):
        # left over from another event loop (its sockets went with it), a closed context, or a
        # handler that stopped (logged): the sockets of this loop it answered move to the new one
        _HANDLERS.pop(key, None)
        if handler.loop is loop:
            carried = handler._domains
        with contextlib.suppress(Exception):
            handler._close_socket()
        handler = None
    if handler is None:
        handler = ZapHandler(ctx)
        handler._domains = {**carried, **handler._domains}
        _HANDLERS[key] = handler
    handler.register(domain, decide)
    return handler


async def release(ctx: zmq.asyncio.Context, handler: ZapHandler, domain: str) -> None:
    """``domain`` no longer answered; the handler stops with the last one."""
    handler.unregister(domain)
    if handler.domains:
        return
    if _HANDLERS.get(ctx.underlying) is handler:
        del _HANDLERS[ctx.underlying]
    await handler.close()
