"""The gRPC status a grpclib client should act on, shared by discovery, the SDK and the mirror.

A grpclib server answers a method it does not have with a trailers-only 200 that lacks a
content-type; grpclib's client reports that as ``UNKNOWN`` "Missing content-type header". It
means ``UNIMPLEMENTED`` (other servers send that code), and callers that decide on
``UNIMPLEMENTED`` (an engine without an optional Control RPC, a relay without
``SubscribeServingLoad``) must see it whichever server answered.

``recv_reply``: the one bounded reader of a client stream's replies (the SDK, the mirror, the
benchmarks' subscribers), on grpclib's private client stream parts (``CLIENT_RECV_NEEDS``).
``count_own_cancels``: how often grpclib itself cancelled a stream's task (``CLIENT_CANCEL_NEEDS``),
so that a cancellation it replaced with a transport error is told from its own.
``ended_without_status``: whether a client stream whose replies ended got no status at all
(``CLIENT_END_NEEDS``), which grpclib would wait on for trailers that cannot come.

``GuardedChannel``: a grpclib ``Channel`` whose connections take a bounded number of the
frames a server sends that ask something back (``budget_server_frames``, ``ServerFrameBudget``);
one past it is closed, its calls failing as a lost connection, and counted by reason. Discovery's
Control channels are such channels, and so is every ``RelayChannel``.

``RelayChannel``: a grpclib ``Channel`` whose streams that have ended keep their replies and
status when the connection closes (``keep_ended_streams``, on ``CLIENT_CLOSE_NEEDS``), which
makes its next calls on a new connection once its server refused one as it drains
(``leave_when_draining``, on ``CLIENT_LEAVE_NEEDS`` and ``CLIENT_CHANNEL_NEEDS``), and whose
connections remember a bounded number of closed streams (``bound_closed_streams``, on
``CLIENT_CLOSED_STREAMS_NEEDS``), which, given a source of its TLS context, asks it at every
connection it makes (``CLIENT_SSL_NEEDS``), and which never connects once closed: a call on it
fails at once with ``ChannelClosed``, and a connection still being made when it closed is closed
as it completes (``CLIENT_CLOSED_NEEDS``).

Every private grpclib or h2 attribute this module touches is named in one of those lists,
checked against the installed versions by ``tests/client/test_hostile_relay.py``; where one is
missing, the part that uses it is left out and grpclib behaves as its own (slower or less,
never wrong, and never an exception raised inside grpclib's event processing).
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.protocol import H2Protocol
from h2.events import ResponseReceived
from h2.settings import SettingCodes

NO_CONTENT_TYPE = "Missing content-type header"


def effective_status(status: Status, message: str | None) -> Status:
    if status is Status.UNKNOWN and message == NO_CONTENT_TYPE:
        return Status.UNIMPLEMENTED
    return status


#: What ``recv_reply`` reads a grpclib client stream through: ``(where, attribute)`` with
#: ``where`` the client ``Stream`` (``stream``), its protocol stream (``inner``) or that one's
#: grpclib ``Connection`` (``connection``, whose count of messages received it keeps, as
#: grpclib's reader does). Without any of them it falls back to grpclib's ``recv_message``
#: (sizes then checked after the read).
CLIENT_RECV_NEEDS: tuple[tuple[str, str], ...] = (
    ("stream", "_recv_initial_metadata_done"),
    ("stream", "recv_initial_metadata"),
    ("stream", "_wrapper"),
    ("stream", "_stream"),
    ("stream", "_codec"),
    ("stream", "_recv_type"),
    ("stream", "_messages_received"),
    ("inner", "recv_data"),
    ("inner", "connection"),
    ("connection", "messages_received"),
)


#: Replies larger than this are decoded in a thread: a 1 MiB catalog of empty entries took two
#: seconds to decode, which on the event loop would stop every other task that long.
DECODE_IN_THREAD_BYTES = 256 * 1024


class BrokenFraming(Exception):
    """A message's framing is broken: the stream ended inside its prefix or before its bytes,
    or it came compressed where the reader can inflate nothing (``CompressedMessage``)."""


class CompressedMessage(BrokenFraming):
    """A message with the compressed flag, read without an ``inflate`` (the SDK's replies: the
    relay never compresses them; a request whose ``grpc-encoding`` the relay cannot inflate).
    Raised at the prefix: none of the body has been read."""


async def read_framed(
    inner: Any, check: Callable[[int], None], inflate: Callable[[bytes], bytes] | None = None
) -> bytes | None:
    """One length-prefixed gRPC message from a grpclib protocol stream (server or client side),
    or None at the stream's end: ``check(size)`` judges the prefix's claim (and raises) before
    any of the body is read. The one reader of both the relay's requests and the SDK's
    replies. A message with the compressed flag is ``inflate(body)`` (which bounds and judges
    what it inflates, and raises); without ``inflate`` it is ``CompressedMessage``."""
    try:  # grpclib's buffer raises AssertionError when the stream ends short of ``size``
        prefix = await inner.recv_data(5)
    except AssertionError:
        raise BrokenFraming("the stream ended inside a message prefix") from None
    if not prefix:
        return None
    if prefix[0] and inflate is None:
        raise CompressedMessage("a compressed message (no grpc-encoding is offered)")
    size = int.from_bytes(prefix[1:5], "big")
    check(size)
    try:
        body: bytes = await inner.recv_data(size)
    except AssertionError:
        body = b""
    if len(body) != size:
        raise BrokenFraming(f"the stream ended before the message's {size} bytes")
    if prefix[0] and inflate is not None:
        return inflate(body)
    return body


class UndecodableReply(Exception):
    """A reply message the client could not take: broken framing, or bytes that do not decode
    as its type. (One larger than the bound is ``RESOURCE_EXHAUSTED``, as grpc clients say.)"""


class CompressedReply(UndecodableReply):
    """A reply with the compressed flag: the client offers no ``grpc-encoding`` (grpclib sends
    no ``grpc-accept-encoding``, and refuses ``grpc-*`` metadata), so a server that compresses
    anyway (a grpcio server with compression on) is misconfigured for it."""


def absent(
    needs: Iterable[tuple[str, str]], objects: Mapping[str, Any], skip: Collection[str] = ()
) -> list[str]:
    """``where.attribute`` for each need whose object (``objects[where]``) lacks the attribute;
    ``where`` in ``skip`` is not asked (that object was not given). One rule for every
    ``missing_*`` checker here and in ``kvrelay.service.h2.internals``."""
    return [f"{w}.{a}" for w, a in needs if w not in skip and not hasattr(objects[w], a)]


def missing_client_recv_needs(stream: Any) -> list[str]:
    """``where.attribute`` for each of ``CLIENT_RECV_NEEDS`` that ``stream`` lacks."""
    inner = getattr(stream, "_stream", None)
    objects = {"stream": stream, "inner": inner, "connection": getattr(inner, "connection", None)}
    return absent(CLIENT_RECV_NEEDS, objects)


async def recv_reply(stream: Any, max_bytes: int | None) -> Any | None:
    """The next reply of a grpclib client stream, or None at its end. Its length prefix is
    checked before its body is read: grpclib's ``recv_message`` buffers whatever a prefix claims
    (up to 4 GiB) before the codec can refuse it. Raises ``GRPCError(RESOURCE_EXHAUSTED)`` for a
    claim over ``max_bytes`` (None: unbounded) and ``UndecodableReply`` for anything it cannot
    decode."""
    if missing_client_recv_needs(stream):
        try:
            return await stream.recv_message()
        except (AssertionError, NotImplementedError, ValueError, EOFError, KeyError) as exc:
            raise UndecodableReply(f"{type(exc).__name__}: {exc}") from None
    if not stream._recv_initial_metadata_done:
        await stream.recv_initial_metadata()

    def check(size: int) -> None:
        if max_bytes is not None and size > max_bytes:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED, f"inbound message of {size} bytes exceeds {max_bytes}"
            )

    with stream._wrapper:
        inner = stream._stream
        try:
            body = await read_framed(inner, check)
        except CompressedMessage as exc:
            raise CompressedReply(str(exc)) from None
        except BrokenFraming as exc:
            raise UndecodableReply(str(exc)) from None
        if body is None:
            return None
        try:
            if len(body) > DECODE_IN_THREAD_BYTES:  # (a message of many tiny entries: seconds)
                message = await asyncio.to_thread(stream._codec.decode, body, stream._recv_type)
            else:
                message = stream._codec.decode(body, stream._recv_type)
        except GRPCError:
            raise
        except Exception as exc:  # betterproto2 raises EOFError, ValueError, KeyError, ...
            raise UndecodableReply(f"{type(exc).__name__}: {exc}") from None
        stream._messages_received += 1
        inner.connection.messages_received += 1
        return message


#: What ``ended_without_status`` reads of a grpclib client stream: ``(where, attribute)`` with
#: ``where`` the client ``Stream`` (``stream``) or its protocol stream (``inner``), whose
#: response headers and trailers grpclib's events processor sets as they arrive. Without any of
#: them no end is judged (False: grpclib's own wait for the trailers).
CLIENT_END_NEEDS: tuple[tuple[str, str], ...] = (
    ("stream", "_stream"),
    ("inner", "headers"),
    ("inner", "trailers"),
)

#: The message of a stream that ended without a status (``ended_without_status``).
NO_STATUS = "the stream ended without a status (no trailers)"


def missing_client_end_needs(stream: Any) -> list[str]:
    """``where.attribute`` for each of ``CLIENT_END_NEEDS`` that ``stream`` lacks."""
    return absent(CLIENT_END_NEEDS, {"stream": stream, "inner": getattr(stream, "_stream", None)})


def ended_without_status(stream: Any) -> bool:
    """Whether a grpclib client stream whose replies have ended (``recv_reply`` returned None)
    ended without a status: its END_STREAM came on a DATA frame, with no trailers and no
    ``grpc-status`` in its headers (a trailers-only reply). gRPC over HTTP/2 makes that an error
    to report at once. Why: grpclib's ``recv_trailing_metadata`` waits for trailers that cannot
    come (the stream is closed), until the caller's silence limit or the connection's end.
    h2 reports a stream's trailers before its end, so at the end they are there or never come."""
    if missing_client_end_needs(stream):
        return False
    return not _status_arrived(stream._stream)


#: What ``count_own_cancels`` uses of a grpclib client stream: ``(where, attribute)`` with
#: ``where`` the client ``Stream`` (``stream``) or its ``Wrapper`` (``wrapper``), whose
#: ``cancel`` grpclib calls when the stream's connection closes and whose ``_tasks`` are the
#: tasks it then cancels. Without any of them nothing is counted (``count_own_cancels``: None).
CLIENT_CANCEL_NEEDS: tuple[tuple[str, str], ...] = (
    ("stream", "_wrapper"),
    ("wrapper", "cancel"),
    ("wrapper", "_tasks"),
)


def missing_client_cancel_needs(stream: Any) -> list[str]:
    """``where.attribute`` for each of ``CLIENT_CANCEL_NEEDS`` that ``stream`` lacks."""
    objects = {"stream": stream, "wrapper": getattr(stream, "_wrapper", None)}
    return absent(CLIENT_CANCEL_NEEDS, objects)


def count_own_cancels(stream: Any) -> Callable[[], int] | None:
    """How many times grpclib itself cancels the current task for ``stream`` from now on: what
    gives the count of the task's cancellations (``Task.cancelling``) that were not grpclib's.

    Why: when a stream's connection closes, grpclib cancels the tasks inside the stream's
    ``Wrapper`` and its ``__exit__`` raises ``StreamTerminatedError`` in place of the
    ``CancelledError``, whoever asked for that one: a task cancelled by its owner just as the
    channel closed under it (a stop, which closes the channel in the same turn) sees a transport
    error, and its loop reconnects. The caller tells the two apart by this count (``run_stream``).
    None where the stream lacks one of ``CLIENT_CANCEL_NEEDS``."""
    if missing_client_cancel_needs(stream):
        return None
    wrapper = stream._wrapper
    task = asyncio.current_task()
    cancel = wrapper.cancel
    count = 0

    def counted(error: Exception) -> None:
        nonlocal count
        if task in wrapper._tasks:
            count += 1
        cancel(error)

    wrapper.cancel = counted
    return lambda: count


#: What ``keep_ended_streams`` uses of a grpclib client connection: ``(where, attribute)`` with
#: ``where`` its ``H2Protocol`` (``proto``), once connected its events processor
#: (``processor``), or one of its protocol streams (``stream``). Without any of them the
#: connection is left as grpclib made it.
CLIENT_CLOSE_NEEDS: tuple[tuple[str, str], ...] = (
    ("proto", "connection_made"),
    ("proto", "processor"),
    ("processor", "streams"),
    ("processor", "close"),
    ("stream", "headers"),
    ("stream", "trailers"),
)


def missing_client_close_needs(proto: Any, stream: Any = None) -> list[str]:
    """``where.attribute`` for each of ``CLIENT_CLOSE_NEEDS`` this connected protocol (and, given
    one, this protocol stream) lacks."""
    objects = {"proto": proto, "processor": getattr(proto, "processor", None), "stream": stream}
    return absent(CLIENT_CLOSE_NEEDS, objects, skip=() if stream is not None else ("stream",))


def keep_ended_streams(proto: H2Protocol) -> None:
    """When this client connection closes (the server's GOAWAY, or its end), streams whose
    status has already arrived keep what they received; only the others fail.

    Why: grpclib fails every stream still registered on the connection, and a stream stays
    registered until the application has read its trailers. A server that ends each stream with
    a status and then sends GOAWAY (as gRPC servers do at shutdown) often sends both in one
    read: the status was there, unread, and grpclib turned it into ``StreamTerminatedError``.
    A stream whose end came without a status still fails (its reader would wait for ever)."""

    def install(processor: Any) -> None:
        streams, close = processor.streams, processor.close

        def close_open_streams(reason: str = "Connection closed") -> None:
            # (called again by connection_lost after a GOAWAY closed the transport)
            kept = {sid: st for sid, st in streams.items() if _status_arrived(st)}
            for sid in kept:
                del streams[sid]
            try:
                close(reason)
            finally:
                streams.update(kept)  # released by their readers, as before

        processor.close = close_open_streams

    _once_connected(proto, missing_client_close_needs, install)


def _once_connected(
    proto: H2Protocol, missing: Callable[[Any], list[str]], install: Callable[[Any], None]
) -> None:
    """Run ``install`` on the connection's events processor once it is made (grpclib makes the
    processor then), unless the protocol lacks one of the internals it uses (``missing``): the
    connection is then left as grpclib made it."""
    made = proto.connection_made

    def connection_made(transport: Any) -> None:
        made(transport)
        if not missing(proto):
            install(proto.processor)

    proto.connection_made = connection_made  # type: ignore[method-assign]


#: The fewest closed streams whose ending a client connection remembers (``bound_closed_streams``;
#: the relay's own connections keep as many at least).
CLOSED_STREAMS_KEPT = 1024

#: How many h2 itself remembers per connection (``H2Connection.MAX_CLOSED_STREAMS``).
H2_CLOSED_STREAMS = 2**16


def closed_streams_bound(concurrent: int) -> int:
    """How many closed streams a connection must remember when at most ``concurrent`` of its
    streams are open at once: twice that, at least ``CLOSED_STREAMS_KEPT``, never more than h2
    keeps by itself. The relay sizes its own connections' memo by the same rule."""
    return min(H2_CLOSED_STREAMS, max(CLOSED_STREAMS_KEPT, 2 * concurrent))


#: What ``bound_closed_streams`` uses of a grpclib client connection: ``(where, attribute)``
#: with ``where`` its ``H2Protocol`` (``proto``), once connected its grpclib ``Connection``
#: (``connection``) or that one's ``H2Connection`` (``h2``). Without any of them h2 keeps its
#: own 65,536.
CLIENT_CLOSED_STREAMS_NEEDS: tuple[tuple[str, str], ...] = (
    ("proto", "connection_made"),
    ("proto", "connection"),
    ("connection", "_connection"),
    ("h2", "_closed_streams"),
    ("h2", "remote_settings"),
)


def missing_client_closed_streams_needs(proto: Any) -> list[str]:
    """``where.attribute`` for each of ``CLIENT_CLOSED_STREAMS_NEEDS`` this connected protocol
    lacks."""
    conn = getattr(proto, "connection", None)
    objects = {"proto": proto, "connection": conn, "h2": getattr(conn, "_connection", None)}
    return absent(CLIENT_CLOSED_STREAMS_NEEDS, objects)


class ClosedStreams(OrderedDict[int, Any]):
    """h2's memo of how each closed stream of a client connection closed (stream id -> how),
    keeping the newest ``closed_streams_bound(n)``, ``n`` the most concurrent streams its
    server has announced (``SETTINGS_MAX_CONCURRENT_STREAMS``) so far.

    Why the most so far: a server may lower its limit while streams opened under the higher
    one are still closing. Until the server has announced one (it may never: no limit), h2's
    own 65,536 are kept. The memo decides how h2 takes a late frame on a closed
    stream: one the client reset is answered RST_STREAM (its reply or trailers crossed the
    reset), while a stream h2 no longer remembers fails the whole connection."""

    def __init__(self, h2: Any) -> None:
        self._h2 = h2
        self._limit: int | None = None  # (none announced yet)
        super().__init__()

    def __setitem__(self, key: int, value: Any) -> None:
        super().__setitem__(key, value)
        announced = self._h2.remote_settings.get(SettingCodes.MAX_CONCURRENT_STREAMS)
        if announced is not None:
            self._limit = max(self._limit or 0, closed_streams_bound(announced))
        limit = H2_CLOSED_STREAMS if self._limit is None else self._limit
        while len(self) > limit:
            self.popitem(last=False)


def bound_closed_streams(proto: H2Protocol) -> None:
    """Once this client connection is made, its h2 connection remembers a bounded number of
    closed streams (``ClosedStreams``).

    Why: h2 remembers the last 65,536 closed streams of each connection (~7.9 MB when full),
    and a mirror's or the SDK's channel lives for days, opening a stream for each call and
    each resubscription: the relay bounds its side of the same connections the same way."""

    def install(_processor: Any) -> None:
        h2 = proto.connection._connection
        memo = ClosedStreams(h2)
        memo.update(h2._closed_streams)  # (none yet: no stream has closed)
        h2._closed_streams = memo

    _once_connected(proto, missing_client_closed_streams_needs, install)


def _status_arrived(stream: Any) -> bool:
    """The stream's trailers came, or a reply that is trailers only (its headers carry the
    status)."""
    if getattr(stream, "trailers", None) is not None:
        return True
    headers = getattr(stream, "headers", None) or ()
    return any(name in ("grpc-status", b"grpc-status") for name, _ in headers)


#: The refusal of a call a relay (kvrelay, or a mirror) makes while it drains: ``UNAVAILABLE``
#: with this in its message, before any reply (trailers only; contract §4.8).
DRAINING_MESSAGE = "shutting down"

#: What ``leave_when_draining`` uses of a grpclib client connection: ``(where, attribute)`` as
#: for ``CLIENT_CLOSE_NEEDS``. Without any of them the channel keeps using the connection until
#: it closes, as grpclib's own does.
CLIENT_LEAVE_NEEDS: tuple[tuple[str, str], ...] = (
    ("proto", "connection_made"),
    ("proto", "processor"),
    ("processor", "process"),
    ("processor", "register"),
    ("processor", "streams"),
    ("processor", "close"),
)


def missing_client_leave_needs(proto: Any) -> list[str]:
    """``where.attribute`` for each of ``CLIENT_LEAVE_NEEDS`` this connected protocol lacks."""
    objects = {"proto": proto, "processor": getattr(proto, "processor", None)}
    return absent(CLIENT_LEAVE_NEEDS, objects)


#: What ``RelayChannel`` uses of grpclib's ``Channel`` to leave a draining connection:
#: ``(where, attribute)`` with ``where`` the channel. Its ``_protocol_factory`` makes each
#: connection (the override installs everything above), and its ``_protocol`` is the connection
#: its calls go on, made anew by ``__connect__`` once it is None. Without any of them the
#: channel does not leave connections (``CLIENT_LEAVE_NEEDS``) and is grpclib's own there.
CLIENT_CHANNEL_NEEDS: tuple[tuple[str, str], ...] = (
    ("channel", "_protocol_factory"),
    ("channel", "_protocol"),
    ("channel", "__connect__"),
)


def missing_client_channel_needs(channel: Any) -> list[str]:
    """``where.attribute`` for each of ``CLIENT_CHANNEL_NEEDS`` this channel lacks."""
    return absent(CLIENT_CHANNEL_NEEDS, {"channel": channel})


def refused_as_draining(headers: Any) -> bool:
    """A trailers-only reply (its headers carry the status) that refuses the call
    ``UNAVAILABLE`` because the server is shutting down."""
    found: dict[str, str] = {}
    for name, value in headers or ():
        key = name.decode("ascii", "replace") if isinstance(name, bytes) else str(name)
        if key in ("grpc-status", "grpc-message"):
            found[key] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return (
        found.get("grpc-status") == str(Status.UNAVAILABLE.value)
        and DRAINING_MESSAGE in found.get("grpc-message", "")
    )


def leave_when_draining(
    proto: H2Protocol,
    refused: Callable[[H2Protocol], None],
    released: Callable[[H2Protocol], None],
) -> None:
    """Tell the channel when this connection's server refuses a call as draining
    (``refused``), and each time one of its streams is released (``released``).

    Why: kvrelay sends grpclib's client no GOAWAY when it drains (grpclib would fail every
    stream it holds), so grpclib would keep making calls on the draining connection, each
    refused, until that connection closed at the drain's end: up to its grace, while in a hot
    upgrade the successor already accepts on the same port. (A GOAWAY needs nothing here:
    grpclib closes the connection, and the channel makes its next call on a new one.)"""

    def install(processor: Any) -> None:
        process, register = processor.process, processor.register

        def process_noting_refusals(event: Any) -> None:
            process(event)
            if isinstance(event, ResponseReceived) and refused_as_draining(event.headers):
                refused(proto)

        def register_noting_release(stream: Any) -> Callable[[], None]:
            release = register(stream)

            def release_and_tell() -> None:
                release()
                released(proto)

            return release_and_tell

        processor.process = process_noting_refusals
        processor.register = register_noting_release

    _once_connected(proto, missing_client_leave_needs, install)


#: What ``RelayChannel`` uses of grpclib's ``Channel`` to take its TLS context from a source
#: at each connection: ``(where, attribute)`` with ``where`` the channel (``channel``: the
#: context ``_ssl`` its connections are made with) or grpclib's ``Channel`` class (``grpclib``:
#: ``_create_connection``, which makes each one from ``_ssl`` and which ``RelayChannel``
#: overrides). Without any of them the channel keeps the context the source gave at its
#: creation, as grpclib's own does: a new channel is needed for a new context.
CLIENT_SSL_NEEDS: tuple[tuple[str, str], ...] = (
    ("channel", "_ssl"),
    ("grpclib", "_create_connection"),
)

#: A TLS context, or what gives the one to use now (a reloadable context's ``in_use``).
SslSource = _ssl.SSLContext | Callable[[], _ssl.SSLContext]


def missing_client_ssl_needs(channel: Any) -> list[str]:
    """``where.attribute`` for each of ``CLIENT_SSL_NEEDS`` this channel (and grpclib's
    ``Channel`` class) lacks."""
    objects = {"channel": channel, "grpclib": Channel}
    return absent(CLIENT_SSL_NEEDS, objects)


#: What ``RelayChannel`` uses to stay closed: ``(where, attribute)`` with ``where`` grpclib's
#: ``Channel`` class (``grpclib``: ``_create_connection``, which makes each connection, the
#: reconnections of ``__connect__`` included, and which ``RelayChannel`` overrides), a connection
#: made after the close (``proto``: its events processor) or that processor (``processor``: its
#: ``close``, grpclib's own way to close a connection). Without any of them a closed channel
#: connects again as grpclib's own does, when its next call (or one already connecting) finds
#: no connection: that connection is its owner's to close no more.
CLIENT_CLOSED_NEEDS: tuple[tuple[str, str], ...] = (
    ("grpclib", "_create_connection"),
    ("proto", "processor"),
    ("processor", "close"),
)


def missing_client_closed_needs(proto: Any = None) -> list[str]:
    """``where.attribute`` for each of ``CLIENT_CLOSED_NEEDS`` grpclib's ``Channel`` class (and,
    given one, this connected protocol) lacks."""
    processor = getattr(proto, "processor", None)
    objects = {"grpclib": Channel, "proto": proto, "processor": processor}
    return absent(CLIENT_CLOSED_NEEDS, objects,
                  skip=() if proto is not None else ("proto", "processor"))  # fmt: skip


#: The message of ``ChannelClosed``.
CHANNEL_CLOSED = "the channel is closed"


PING, SETTINGS, WINDOW_UPDATE = 0x6, 0x4, 0x8
ACK = 0x1
_HEADER = 9

#: Per window, frames a server may send of each kind: far above what any server sends, far
#: below what holds the loop (h2 took about 0.1 ms for each PING it answered).
WINDOW_S = 10.0
MAX_PINGS = 64  # PING without ACK (each asks for an ACK)
MAX_SETTINGS = 64  # SETTINGS without ACK (each asks for an ACK)
MAX_WINDOW_UPDATES = 1024


class ServerFrameBudget:
    """What a server may make one of the relay's own HTTP/2 client connections do. Feed every
    read of one connection; ``feed`` says once the server went past a budget.

    Why: the relay is a client too: of every engine's ``vllm.Control`` (discovery), and, as a
    mirror or through the SDK, of an upstream relay. h2 answers every PING and SETTINGS a
    server sends (an ACK each) and takes every WINDOW_UPDATE, however many; a Control endpoint
    that flooded PING or SETTINGS frames held the relay's event loop for seconds at a time (a
    router on another connection got no delta for 4-9 s, ``/healthz`` timed out), and nothing
    was counted. No server needs more than a few: one SETTINGS at the start and when it changes
    them, a keepalive PING every few seconds, a WINDOW_UPDATE per request message the client
    sends. The frame headers are read here, before h2, from the reads as they come (a header
    may span two); payloads are skipped."""

    __slots__ = ("_counts", "_head", "_skip", "_window_end", "tripped")

    def __init__(self) -> None:
        self._head = b""  # a frame header split between two reads
        self._skip = 0  # payload bytes of the current frame still to come
        self._counts = {PING: 0, SETTINGS: 0, WINDOW_UPDATE: 0}
        self._window_end = time.monotonic() + WINDOW_S
        #: why the connection went past a budget (``ping_flood``, ...), None while within
        self.tripped: str | None = None

    def feed(self, data: bytes) -> bool:
        """Account for ``data``; False once the server went past a budget (then always)."""
        if self.tripped is not None:
            return False
        pos, n = 0, len(data)
        while pos < n:
            if self._skip:  # the current frame's payload
                step = min(self._skip, n - pos)
                self._skip -= step
                pos += step
                continue
            piece = data[pos : pos + _HEADER - len(self._head)]
            self._head += piece
            pos += len(piece)
            if len(self._head) < _HEADER:
                break  # the rest of the header comes with the next read
            head, self._head = self._head, b""
            if not self._frame(head[3], head[4], int.from_bytes(head[:3], "big")):
                return False
        return True

    def _frame(self, kind: int, flags: int, length: int) -> bool:
        self._skip = length
        if kind not in self._counts or (kind != WINDOW_UPDATE and flags & ACK):
            return True
        now = time.monotonic()
        if now >= self._window_end:
            self._window_end = now + WINDOW_S
            for k in self._counts:
                self._counts[k] = 0
        self._counts[kind] += 1
        limit = {PING: MAX_PINGS, SETTINGS: MAX_SETTINGS}.get(kind, MAX_WINDOW_UPDATES)
        if self._counts[kind] > limit:
            self.tripped = {PING: "ping_flood", SETTINGS: "settings_flood"}.get(
                kind, "window_update_flood"
            )
            return False
        return True


def budget_server_frames(proto: H2Protocol, on_trip: Callable[[str], None]) -> None:
    """Read the frame headers the server sends before h2 does (``ServerFrameBudget``): once
    past a budget, nothing more of it reaches h2, the connection is aborted (its calls fail as a
    lost connection) and ``on_trip`` is told why, once. Only the protocol's public asyncio
    callbacks are wrapped."""
    budget = ServerFrameBudget()
    made, received = proto.connection_made, proto.data_received
    transport: list[Any] = []

    def connection_made(t: Any) -> None:
        transport.append(t)
        made(t)

    def data_received(data: bytes) -> None:
        if budget.feed(data):
            received(data)
        elif transport:
            t = transport.pop()  # (once: what the server still sends is dropped unread)
            t.abort()
            on_trip(budget.tripped or "flood")

    proto.connection_made = connection_made  # type: ignore[method-assign,assignment]
    proto.data_received = data_received  # type: ignore[method-assign]


class GuardedChannel(Channel):
    """A grpclib ``Channel`` whose connections a server cannot flood with frames that ask
    something back (``budget_server_frames``). ``floods``: connections closed for it, by
    reason; ``take_flood`` the reason of the latest one not taken yet."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.floods: dict[str, int] = {}
        self._flood: str | None = None

    def _protocol_factory(self) -> H2Protocol:
        proto = super()._protocol_factory()
        budget_server_frames(proto, self._tripped)
        return proto

    def _tripped(self, reason: str) -> None:
        self.floods[reason] = self.floods.get(reason, 0) + 1
        self._flood = reason

    def take_flood(self) -> str | None:
        reason, self._flood = self._flood, None
        return reason


class ChannelClosed(ConnectionError):
    """A call on a ``RelayChannel`` after its ``close()``, or one whose connection was still
    being made then. A ``ConnectionError``, as grpclib reports a channel that cannot connect:
    callers retry it as such (on their current channel)."""

    def __init__(self) -> None:
        super().__init__(CHANNEL_CLOSED)


class RelayChannel(GuardedChannel):
    """A grpclib ``Channel`` whose connections ``keep_ended_streams`` and
    ``bound_closed_streams``, and which leaves a connection whose server refused a call as
    draining (``leave_when_draining``): its next calls go on a new connection (in a hot
    upgrade, to the successor on the same port), while the streams still open on the old one
    go on there; it is closed after the last of them.

    ``ssl`` may be a source of the context (a callable): it is asked at every connection the
    channel makes, the first one and each reconnection after its connection was lost or left.
    Why: grpclib keeps the context a channel was created with, and a channel reconnects by
    itself when its next call finds its connection gone, so after a reload of the client's
    files (a renewed or revoked client certificate, a new CA) the next handshake would present
    what the files held at the channel's creation.

    Once ``close()`` ran it never connects again: a call on it fails at once with
    ``ChannelClosed``, and a connection being made meanwhile (a call that found the connection
    lost, in grpclib's ``__connect__``) is closed as it completes, its call failing the same
    way. Why: grpclib's channel reconnects whenever a call finds no connection, so a stream a
    mirror's pool opened again on its channel just as the mirror replaced (and closed) it ran on
    a connection nobody owned, kept open by keepalive: one more per upstream drop."""

    def __init__(self, *args: Any, ssl: SslSource | None = None, **kwargs: Any) -> None:
        source, context = (ssl, ssl()) if callable(ssl) else (None, ssl)
        super().__init__(*args, ssl=context, **kwargs)
        #: asked at each connection (None: the context of the creation, grpclib's rule)
        self._ssl_source = None if missing_client_ssl_needs(self) else source
        #: connections left for new calls, still serving their open streams
        self._leaving: set[H2Protocol] = set()
        #: connections left because their server refused a call as draining
        self.left_draining = 0
        #: ``close()`` ran: the channel connects no more (``CLIENT_CLOSED_NEEDS``)
        self.closed = False
        #: connections that completed after ``close()`` and were closed at once
        self.closed_late = 0

    def _protocol_factory(self) -> H2Protocol:
        proto = super()._protocol_factory()
        keep_ended_streams(proto)
        bound_closed_streams(proto)
        if not missing_client_channel_needs(self):  # (``_leave`` reads and sets ``_protocol``)
            leave_when_draining(proto, self._leave, self._released)
        return proto

    async def _create_connection(self) -> H2Protocol:
        if self.closed:
            raise ChannelClosed()  # (grpclib's ``__connect__`` reports it, its state a failure)
        if self._ssl_source is not None:
            self._ssl = self._ssl_source()  # (a TLS channel stays one: https, the same host)
        proto = await super()._create_connection()
        if self.closed and not missing_client_closed_needs(proto):
            self.closed_late += 1  # closed while it connected: never the channel's connection
            proto.processor.close(CHANNEL_CLOSED)
            raise ChannelClosed()
        return proto

    def _leave(self, proto: H2Protocol) -> None:
        if self._protocol is not proto:
            return  # left already (several calls refused), or closed
        self._protocol = None  # the next call connects anew (grpclib's ``__connect__``)
        self.left_draining += 1
        self._leaving.add(proto)  # closed once its streams are released, the refused one too
        self._released(proto)  # (none left: its reader has gone already)

    def _released(self, proto: H2Protocol) -> None:
        if proto in self._leaving and not proto.processor.streams:
            self._leaving.discard(proto)
            proto.processor.close("left: its server drains")

    def close(self) -> None:
        self.closed = not missing_client_closed_needs()  # (else grpclib's own: it reconnects)
        super().close()
        leaving, self._leaving = self._leaving, set()
        for proto in leaving:
            proto.processor.close()

    def retire(self, grace_s: float) -> None:
        """Connect no more, and close the connection once the streams still open on it have
        ended, ``grace_s`` from now at the latest. Why: a relay that drains ends its streams one
        after another; a mirror that closed the channel at its catalog's clean end cut the
        others before their own clean ends were read, and told its subscribers UNAVAILABLE
        where the relay said OK."""
        if missing_client_channel_needs(self) or missing_client_closed_needs():
            self.close()  # (without the hooks, nothing would close it later)
            return
        self.closed = True  # ``_create_connection`` refuses from now on
        proto, self._protocol = self._protocol, None
        if proto is not None:
            self._leaving.add(proto)
            self._released(proto)  # (no stream left on it: closed now)
        if self._leaving:
            asyncio.get_running_loop().call_later(grace_s, self.close)
