"""Where grpclib mishandles hostile input on a server connection, mended per connection.

* **Streams reset before their task runs.** grpclib forgets a stream only in its request
  task's ``finally``; a stream reset in the same read as its HEADERS has its task cancelled
  before it ever runs, and grpclib kept the stream (about 1.7 KiB) for the connection's life: a
  client resetting within its budget grew the relay without bound. The task's end releases it.
* **Requests without ``:method`` or ``:path``.** grpclib reads them unchecked (h2 is set not to
  validate): each such stream raised ``KeyError`` into an ERROR log with a traceback and was
  never answered. Such a stream is reset (``PROTOCOL_ERROR``) before grpclib sees it, and counted
  (``malformed_headers``); its client's frames on it from then on count as frames on a closed
  stream (``guard.server_closed``).
* **Frame types HTTP/2 does not define.** RFC 9113 says to ignore them; grpclib raised on h2's
  event for one and the connection died without a GOAWAY. They are ignored.
* **An empty DATA frame that does not end its stream.** It is legal and carries nothing, but
  grpclib's stream buffer took its zero flow-controlled length for the end of the request body:
  the request read as cut short (``INVALID_REQUEST``). h2 has checked the frame against the
  stream's state by then; the event is dropped before grpclib sees it. (Past their budget such
  frames still close the connection: ``guard.py``.)
* **Anything else grpclib's ``data_received`` raises** (a header value that is not ASCII, for
  one) ended the connection through the event loop's "fatal error" log, without a GOAWAY. The
  connection now gets GOAWAY ``PROTOCOL_ERROR`` and is closed, counted (``protocol_error``).
* **Connection errors h2 detects** (DATA on stream 0, a zero WINDOW_UPDATE, a frame over the
  size the relay allows, a SETTINGS value out of range). h2 queues the GOAWAY with the code the
  RFC names, but grpclib closed the transport without writing it: the client saw the socket
  close and could not tell its own bug from a crash. Those bytes are now written before the close,
  and the error counted (``protocol_error``); so is a connection whose preface is not HTTP/2's,
  which RFC 9113 §3.4 lets close without a GOAWAY.
* **The HPACK table of the relay's response headers.** h2 sizes it to whatever the client's
  ``SETTINGS_HEADER_TABLE_SIZE`` says (up to 4 GiB), and hpack adds every response header it
  has not seen to it and searches it entry by entry for each header it encodes. Replies whose
  ``grpc-message`` quotes the request (a wrong ``contract_marker``) are new each time: a client
  that asked for a big table and sent such requests within its stream budget grew the relay by
  about 350 bytes a reply for the connection's life, and made each later reply on it slower to
  encode (1 ms at 10,000 entries, 6 ms at 100,000, on the one event loop). RFC 7541 §4.2 lets
  an encoder use less than the peer allows: the table is held to ``RESPONSE_HEADER_TABLE_BYTES``
  (HTTP/2's default, 4 KiB) whatever the client advertises; a smaller size is still honoured.
* **A stream over the limit in force.** h2 raised ``TooManyStreamsError`` for a HEADERS frame
  that opened one stream more than the connection's limit, a connection error: GOAWAY
  ``PROTOCOL_ERROR``, and every stream of the connection failed with it. RFC 9113 §5.1.2 makes
  it a stream error; a client may well open more streams than the relay allows before it has
  read the relay's SETTINGS (the initial limit is unlimited). That stream alone is now reset
  with ``REFUSED_STREAM`` (which tells a gRPC client it was not processed, so it may retry),
  its header block still decoded, and counted (``refused_stream``); the connection and its
  other streams go on. The guard counts the stream as any new one (``max_streams``), and its
  client's frames on it from then on as frames on a closed stream (``guard.server_closed``).
  (``closing`` puts the relay's own limit in force from the first byte, so a client that opens
  no more than it is told is never refused.)
* **Requests grpclib answers itself** (not gRPC: HTTP 405, 415 or 400; a method the relay
  does not serve: ``UNIMPLEMENTED``; a ``grpc-timeout`` it cannot read: ``UNKNOWN``) were
  counted nowhere; they are now (``not_grpc``, ``unknown_method``, ``malformed_headers``).
  grpclib's gRPC answers (the last two) came without a ``content-type``, which gRPC's
  Trailers-Only response requires: grpc-go and grpc-java then report ``UNKNOWN`` ("missing
  HTTP content-type"), so a Go router probing for an RPC the relay lacks could not tell it
  from a failure. The relay answers those two itself, with the same status and message and
  ``content-type: application/grpc+proto`` (``ANSWER_NEEDS``); the non-gRPC answers stay
  grpclib's.
* **A call's ``grpc-encoding``.** grpclib keeps no ``grpc-*`` request header where a handler can
  see it; the relay's request reader needs it to inflate a compressed request
  (``request.py``). Each accepted stream's is noted (``request.note_request_encoding``).

Uses grpclib's private protocol parts (``internals.PROTOCOL_NEEDS``; for the undefined frame
types and empty DATA also ``PROCESSOR_NEEDS``, for h2's connection errors ``FEED_NEEDS``, for the
header table ``ENCODER_NEEDS`` and ``HPACK_ENCODER_NEEDS``, for a stream over the limit
``REFUSE_NEEDS``, for its own answers ``ANSWER_NEEDS``); without them the protocol is left as
grpclib made it. Installed before the transport exists (uvloop's transports keep the
``data_received`` they find when made).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import weakref
from collections.abc import Callable
from typing import Any

from h2.errors import ErrorCodes
from h2.events import DataReceived, UnknownFrameReceived
from h2.exceptions import ProtocolError, TooManyStreamsError
from hyperframe.frame import HeadersFrame

from kvrelay.service.h2.guard import H2Counters, goaway, server_closed
from kvrelay.service.h2.internals import (
    H2Protocol,
    capped_encoder,
    missing_in_answer,
    missing_in_encoder,
    missing_in_feed,
    missing_in_protocol,
    missing_in_refuse,
    once_connected,
    refuse_headers,
)
from kvrelay.service.h2.request import note_request_encoding

__all__ = ["RESPONSE_HEADER_TABLE_BYTES", "mend_protocol"]

_PROTOCOL_ERROR = 0x1
#: The most HPACK table the relay's response headers use on one connection (module docstring).
RESPONSE_HEADER_TABLE_BYTES = 4096


def mend_protocol(proto: H2Protocol, counters: H2Counters) -> None:
    """See the module docstring."""
    if missing_in_protocol(proto):
        return
    handler: Any = proto.handler
    accept = handler.accept
    # (grpclib's server keeps a connection's handler a while after it closed: what the handler
    # holds must not keep the protocol)
    this = weakref.ref(proto)
    received = proto.data_received
    transport: Any = None

    def accept_checked(stream: Any, headers: Any, release_stream: Callable[[], Any]) -> None:
        released = False

        def release_once(*_: Any) -> None:
            nonlocal released
            if not released:
                released = True
                with contextlib.suppress(Exception):  # the connection is gone: nothing held
                    release_stream()

        names = [h[0] for h in headers]
        timeouts_ok = _timeouts_valid(headers)
        if not timeouts_ok:
            counters.count("malformed_headers")
        if names.count(":method") != 1 or names.count(":path") != 1:
            counters.count("malformed_headers")
            with contextlib.suppress(Exception):
                stream.reset_nowait(ErrorCodes.PROTOCOL_ERROR)
            me = this()  # (its client's frames on it: on a closed stream)
            if me is not None:
                server_closed(me, stream.id)
            release_once()
            return
        unserved = _unserved(headers, handler.mapping)
        if unserved is not None:
            counters.count(unserved)
        answer = (
            _UNIMPLEMENTED if unserved == "unknown_method"
            else _BAD_TIMEOUT if unserved is None and not timeouts_ok
            else None
        )  # fmt: skip
        if answer is not None and not missing_in_answer(stream):
            task = asyncio.get_running_loop().create_task(_answer(stream, *answer))
            handler._tasks[stream] = task  # (cancelled with the connection's other calls)

            def done(t: asyncio.Task[None]) -> None:
                release_once()
                # (grpclib drops its done tasks only at an ``accept``: a client sending only
                # such calls would grow the dict for the connection's life)
                if handler._tasks.get(stream) is t:
                    del handler._tasks[stream]

            task.add_done_callback(done)
            return
        note_request_encoding(stream, headers)  # (the ``stream._stream`` its reader reads)
        accept(stream, headers, release_once)
        task = handler._tasks.get(stream)  # (grpclib replaces the dict every 10 streams)
        if task is not None:
            task.add_done_callback(release_once)

    def note_transport(t: Any) -> None:
        nonlocal transport
        transport = t

    def install(t: Any) -> None:
        # (``internals.PROCESSOR_NEEDS``: grpclib's event handlers by h2 event type)
        processors = getattr(getattr(proto, "processor", None), "processors", None)
        if isinstance(processors, dict):
            processors.setdefault(UnknownFrameReceived, _ignore)
            data = processors.get(DataReceived)
            if data is not None:
                processors[DataReceived] = _without_empty(data)
        if not missing_in_feed(proto):
            _tell_connection_errors(proto.connection, t, counters)
        if not missing_in_refuse(proto):
            _refuse_over_limit(proto, counters)
        if not missing_in_encoder(proto):
            encoder = capped_encoder(RESPONSE_HEADER_TABLE_BYTES)
            if encoder is not None:  # (nothing is encoded before the first request)
                proto.connection._connection.encoder = encoder

    def data_received(data: bytes) -> None:
        try:
            received(data)
        except Exception:
            counters.count("protocol_error")
            t = transport
            if t is not None and not t.is_closing():
                h2 = getattr(getattr(proto, "connection", None), "_connection", None)
                last = getattr(h2, "highest_inbound_stream_id", 0)
                t.write(goaway(last if isinstance(last, int) else 0, _PROTOCOL_ERROR))
                t.close()

    handler.accept = accept_checked
    once_connected(proto, missing_in_protocol, install, before=note_transport)
    proto.data_received = data_received  # type: ignore[method-assign]


def _tell_connection_errors(conn: Any, transport: Any, counters: H2Counters) -> None:
    """Write what h2 queued (its GOAWAY) when it finds a connection error, before grpclib closes
    the transport on the ``ProtocolError`` it re-raises."""
    feed = conn.feed

    def feed_told(data: bytes) -> Any:
        try:
            return feed(data)
        except ProtocolError:
            counters.count("protocol_error")
            with contextlib.suppress(Exception):  # the connection broke meanwhile
                pending = conn._connection.data_to_send()
                if pending and not transport.is_closing():
                    transport.write(pending)
            raise

    conn.feed = feed_told


def _refuse_over_limit(proto: H2Protocol, counters: H2Counters) -> None:
    """Reset a stream h2 finds over the limit in force with ``REFUSED_STREAM`` instead of
    ending the connection (module docstring). h2 checks the limit before it changes anything
    for the frame (``test_internals`` checks it), so the refusal takes the frame from there."""
    h2: Any = proto.connection._connection
    table = h2._frame_dispatch_table
    receive = table[HeadersFrame]

    def receive_headers(frame: HeadersFrame) -> Any:
        try:
            return receive(frame)
        except TooManyStreamsError:
            out = refuse_headers(h2, frame, ErrorCodes.REFUSED_STREAM)
            counters.count("refused_stream")
            server_closed(proto, frame.stream_id)
            return out

    table[HeadersFrame] = receive_headers


#: (grpc-status, grpc-message) of the answers grpclib gave: a method the relay does not serve,
#: a ``grpc-timeout`` that does not read.
_UNIMPLEMENTED = (12, "Method not found")
_BAD_TIMEOUT = (2, "Invalid grpc-timeout header")


async def _answer(stream: Any, status: int, message: str) -> None:
    """A Trailers-Only gRPC response (HTTP status, ``content-type``, status, message), then the
    stream reset (``NO_ERROR``) if its client is still sending, as grpclib ends such a call."""
    with contextlib.suppress(Exception):  # (the stream or its connection went meanwhile)
        await stream.send_headers(
            [
                (":status", "200"),
                ("content-type", "application/grpc+proto"),
                ("grpc-status", str(status)),
                ("grpc-message", message),
            ],
            end_stream=True,
        )
        if stream.closable:
            stream.reset_nowait()


def _unserved(headers: Any, mapping: Any) -> str | None:
    """Why grpclib answers this request itself, before any handler, or None: ``not_grpc`` (not
    a POST, not a gRPC protobuf content type, no ``te: trailers``: HTTP 405, 415, 400) or
    ``unknown_method`` (a path the relay does not serve: ``UNIMPLEMENTED``). Counted so that a
    misconfigured or probing client shows in the metrics, not only in its own errors."""
    found: dict[Any, Any] = dict(headers)
    content_type = str(found.get("content-type", ""))
    base, _, subtype = content_type.partition("+")
    if (
        found.get(":method") != "POST"
        or base != "application/grpc"
        or subtype not in ("", "proto")
        or found.get("te") != "trailers"
    ):
        return "not_grpc"
    return "unknown_method" if found.get(":path") not in mapping else None


_TIMEOUT = re.compile(r"\d+[HMSmun]")


def _timeouts_valid(headers: Any) -> bool:
    """Every ``grpc-timeout`` of a request is one grpclib reads (digits and a unit): grpclib
    answers another with ``UNKNOWN`` "Invalid grpc-timeout header" itself; counted here as a
    malformed header."""
    return all(_TIMEOUT.fullmatch(str(v)) for k, v in headers if k == "grpc-timeout")


def _without_empty(process: Callable[[Any], None]) -> Callable[[Any], None]:
    """grpclib's DATA handling, minus DATA events with nothing in them (no data, no padding):
    grpclib's buffer reads a zero flow-controlled length as the end of the body. A frame that
    ends its stream also gives h2's ``StreamEnded`` event, so nothing is lost."""

    def process_data(event: Any) -> None:
        if event.flow_controlled_length:
            process(event)

    return process_data


def _ignore(_event: Any) -> None:
    """A frame type HTTP/2 does not define (RFC 9113 §5.5: ignored)."""
