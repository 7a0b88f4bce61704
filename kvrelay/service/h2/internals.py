"""Every grpclib and h2 internal the relay's own HTTP/2 writers rely on, listed and checked once.

Why: the writers in this package (``bulk``, ``direct``, ``batch``, ``reset``, ``closing``,
``drain``, ``mend``; ``guard`` reads what a connection sent and which streams the relay ended)
work beside grpclib on its private stream, connection and h2 state. A grpclib or h2 release
may drop or rename any of it; ``missing`` then names what is gone and ``StreamWriter`` falls back
to grpclib's public path (the relay gets slower, never wrong). Those that set a connection up
once grpclib has made it (``closing``, ``guard``, ``mend``) do it through ``once_connected``,
each only where its needs are there.
``tests/service/h2/test_internals.py`` checks the whole list against the installed versions on a
real stream.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import grpclib.server
from grpclib.protocol import Connection as _GrpclibConnection
from grpclib.protocol import H2Protocol
from grpclib.protocol import Stream as _GrpclibStream
from grpclib.server import Handler, Server
from grpclib.utils import DeadlineWrapper, Wrapper
from h2.connection import ConnectionInputs, ConnectionState, H2Connection
from h2.errors import ErrorCodes
from h2.events import PingAckReceived
from h2.exceptions import DenialOfServiceError, ProtocolError, StreamIDTooLowError
from h2.settings import SettingCodes
from h2.stream import StreamClosedBy, StreamInputs, StreamState
from h2.utilities import SizeLimitDict
from hpack import Encoder
from hpack.exceptions import HPACKError, OversizedHeaderListError
from hyperframe.frame import HeadersFrame, RstStreamFrame

from kvrelay._grpc import absent

__all__ = [
    "ANSWER_NEEDS",
    "CANCEL",
    "CAP_IN_FORCE_NEEDS",
    "CLASS_NEEDS",
    "CLOSED_STREAMS_NEEDS",
    "DEADLINE_NEEDS",
    "DRAIN_NEEDS",
    "EARLY_END_STATE",
    "ENCODER_NEEDS",
    "ENDED_NEEDS",
    "FEED_NEEDS",
    "HPACK_ENCODER_NEEDS",
    "INSTANCE_NEEDS",
    "LINGER_NEEDS",
    "NO_ERROR",
    "PROCESSOR_NEEDS",
    "PROTOCOL_NEEDS",
    "REFUSE_NEEDS",
    "REQUEST_NEEDS",
    "REVOKE_NEEDS",
    "SEND_DATA_CONNECTION",
    "SEND_DATA_CONNECTION_NOOP",
    "SEND_DATA_STREAM",
    "SEND_DATA_STREAM_NOOP",
    "SENT_NEEDS",
    "SERVER_ENDED_STATES",
    "SHUTDOWN_NEEDS",
    "STREAM_CAP_NEEDS",
    "H2Protocol",
    "Parts",
    "bound_closed_streams",
    "capped_encoder",
    "close_unstarted",
    "data_frames_sent",
    "end_requests",
    "flushed_to_client",
    "handlers_closed",
    "live_internals",
    "missing",
    "missing_in_answer",
    "missing_in_cap_in_force",
    "missing_in_classes",
    "missing_in_closed_streams",
    "missing_in_deadline",
    "missing_in_drain",
    "missing_in_encoder",
    "missing_in_ended",
    "missing_in_feed",
    "missing_in_hpack_encoder",
    "missing_in_linger",
    "missing_in_processor",
    "missing_in_protocol",
    "missing_in_refuse",
    "missing_in_revoke",
    "missing_in_sent",
    "missing_in_shutdown",
    "missing_in_stream_cap",
    "once_connected",
    "put_stream_cap_in_force",
    "refuse_headers",
    "server_ended",
    "stream_internals",
]

#: h2's inputs for sending DATA (the transitions its own ``send_data`` makes) and RST_STREAM code.
SEND_DATA_CONNECTION = ConnectionInputs.SEND_DATA
SEND_DATA_STREAM = StreamInputs.SEND_DATA
#: States in which h2 makes those transitions without an action and without leaving the state
#: (its transition tables map them to ``(None, same state)``): a writer that finds the state
#: machines there may skip the two ``process_input`` calls. ``test_internals`` checks it.
SEND_DATA_CONNECTION_NOOP = ConnectionState.SERVER_OPEN
SEND_DATA_STREAM_NOOP = (StreamState.OPEN, StreamState.HALF_CLOSED_REMOTE)
CANCEL = ErrorCodes.CANCEL
#: ``request.finish_early``: a stream's state after the relay's trailers while its client still
#: sends requests, and the RST_STREAM code that then tells the client to stop.
EARLY_END_STATE = StreamState.HALF_CLOSED_LOCAL
NO_ERROR = ErrorCodes.NO_ERROR

#: Methods looked up on the classes: ``(class, attribute)``.
CLASS_NEEDS: tuple[tuple[type, str], ...] = (
    (Server, "_protocol_factory"),  # closing: remember each connection's protocol
    (_GrpclibStream, "send_data"),  # batch: one DATA write for several messages
    (_GrpclibStream, "reset_nowait"),  # reset: RST_STREAM for a client that stopped reading
    (_GrpclibConnection, "data_send_process"),
    (_GrpclibConnection, "flush"),
    (H2Connection, "local_flow_control_window"),
    (H2Connection, "data_to_send"),
)

#: Attributes of one live server stream: ``(where, attribute)``; ``where`` is ``stream`` (the
#: grpclib server ``Stream``), ``inner`` (its ``grpclib.protocol.Stream``), ``connection`` (the
#: grpclib ``Connection``), ``h2`` (the ``H2Connection``), ``h2_stream`` (h2's own stream) or
#: ``h2_state_machine`` / ``h2_stream_state_machine`` (their state machines).
INSTANCE_NEEDS: tuple[tuple[str, str], ...] = (
    ("stream", "_stream"),
    ("stream", "_send_initial_metadata_done"),
    ("stream", "_send_message_done"),
    ("stream", "_messages_sent"),
    ("stream", "_cancel_done"),  # bulk.abandon: no trailers after a message cut short
    ("stream", "send_initial_metadata"),
    ("inner", "_transport"),
    ("inner", "_h2_connection"),
    ("inner", "connection"),
    ("inner", "id"),
    ("inner", "window_updated"),
    ("inner", "data_sent"),
    ("inner", "send_data"),
    ("inner", "reset_nowait"),
    ("connection", "write_ready"),
    ("connection", "data_send_process"),
    ("connection", "flush"),
    ("connection", "data_sent"),
    ("connection", "messages_sent"),
    ("connection", "last_message_sent"),
    ("h2", "outbound_flow_control_window"),
    ("h2", "max_outbound_frame_size"),
    ("h2", "state_machine"),
    ("h2_state_machine", "state"),
    ("h2", "streams"),
    ("h2", "_data_to_send"),
    ("h2", "local_flow_control_window"),
    ("h2", "data_to_send"),
    ("h2_stream", "state_machine"),
    ("h2_stream", "outbound_flow_control_window"),
    ("h2_stream_state_machine", "state"),
)


#: What ``closing.release_cancelled_streams`` uses of a server connection's protocol:
#: ``(where, attribute)`` with ``where`` ``proto`` (grpclib's ``H2Protocol``) or ``handler``
#: (its ``Handler``: the request tasks by stream; ``close``: see ``close_unstarted``).
PROTOCOL_NEEDS: tuple[tuple[str, str], ...] = (
    ("proto", "handler"),
    ("handler", "accept"),
    ("handler", "mapping"),  # mend: count requests for a method not served
    ("handler", "_tasks"),
    ("handler", "close"),
)


#: What ``mend`` answers a request grpclib would answer itself through (a method not served, a
#: ``grpc-timeout`` that does not read): ``inner`` is the protocol stream ``handler.accept`` is
#: given (the answer's task goes in the handler's ``_tasks``, ``PROTOCOL_NEEDS``, so that the
#: connection's close cancels it). Without them grpclib answers, without a ``content-type``.
ANSWER_NEEDS: tuple[tuple[str, str], ...] = (
    ("inner", "send_headers"),
    ("inner", "closable"),
    ("inner", "reset_nowait"),
)


def missing_in_answer(inner: Any) -> list[str]:
    """``where.attribute`` for each of ``ANSWER_NEEDS`` this protocol stream lacks."""
    return absent(ANSWER_NEEDS, {"inner": inner})


def close_unstarted(proto: Any) -> None:
    """Close the request handler of a protocol whose connection never reached it (refused by
    the caps or the peer check, or a TLS handshake that did not complete), as its
    ``connection_lost`` would have. grpclib's ``Server`` makes a handler with each protocol and
    keeps it in ``Server._handlers`` until it is closed: each such connection left one there for
    the server's life (about 1.5 KiB, and every tenth accept walks the whole set)."""
    close = getattr(getattr(proto, "handler", None), "close", None)
    if close is not None:
        close()


def missing_in_protocol(proto: Any) -> list[str]:
    """``where.attribute`` for each of ``PROTOCOL_NEEDS`` this server protocol lacks."""
    objects = {"proto": proto, "handler": getattr(proto, "handler", None)}
    return absent(PROTOCOL_NEEDS, objects)


def once_connected(
    proto: H2Protocol,
    missing: Callable[[Any], list[str]],
    install: Callable[[Any], None],
    before: Callable[[Any], None] | None = None,
) -> None:
    """Run ``install`` with the transport once grpclib has made the connection (its
    ``connection`` and events processor exist from then), unless the protocol lacks one of the
    internals it uses (``missing``): the connection is then left as grpclib made it.
    ``before``, given, is run with the transport first, before grpclib's own.

    Why one helper: several set-ups each wrap the protocol's ``connection_made``; each call
    wraps what is there now, so one made later runs after it (the order ``ClosingServer``
    installs them in). Call it before the transport exists: uvloop's transports keep the
    callbacks they find when made."""
    made = proto.connection_made

    def connection_made(transport: Any) -> None:
        if before is not None:
            before(transport)
        made(transport)
        if not missing(proto):
            install(transport)

    proto.connection_made = connection_made  # type: ignore[method-assign]


#: What ``drain.DrainNotice`` uses of a connected server protocol, beside ``PROTOCOL_NEEDS``:
#: ``where`` is ``proto``, ``connection`` (grpclib's ``Connection``) or ``h2`` (its
#: ``H2Connection``).
DRAIN_NEEDS: tuple[tuple[str, str], ...] = (
    ("proto", "connection"),
    ("connection", "_transport"),
    ("connection", "_connection"),
    ("connection", "flush"),
    ("h2", "_data_to_send"),
    ("h2", "highest_inbound_stream_id"),
)


def missing_in_drain(proto: Any) -> list[str]:
    """``where.attribute`` for each of ``DRAIN_NEEDS`` this connected server protocol lacks."""
    return _missing_on_connection(proto, DRAIN_NEEDS)


def _missing_on_connection(proto: Any, needs: tuple[tuple[str, str], ...]) -> list[str]:
    conn = getattr(proto, "connection", None)
    objects = {"proto": proto, "connection": conn, "h2": getattr(conn, "_connection", None)}
    return absent(needs, objects)


#: What ``closing`` uses to close a connection at shutdown by halves (``_HalfClose``): grpclib's
#: ``Connection`` closes the transport it holds as ``_transport``; closing puts a stand-in
#: there whose ``close`` shuts the write side only. ``where`` as in ``DRAIN_NEEDS``. Without
#: it the connection is closed whole, as grpclib does.
LINGER_NEEDS: tuple[tuple[str, str], ...] = (
    ("proto", "connection"),
    ("connection", "_transport"),
)


def missing_in_linger(proto: Any) -> list[str]:
    """``where.attribute`` for each of ``LINGER_NEEDS`` this connected protocol lacks."""
    return _missing_on_connection(proto, LINGER_NEEDS)


#: What ``closing`` uses to tell each client its SETTINGS_MAX_CONCURRENT_STREAMS right after
#: grpclib's own SETTINGS (h2's public ``update_settings``, then the connection's ``flush``),
#: ``where`` as in ``DRAIN_NEEDS``. Without them h2's 100 stays.
STREAM_CAP_NEEDS: tuple[tuple[str, str], ...] = (
    ("proto", "connection"),
    ("connection", "_connection"),
    ("connection", "flush"),
)


def missing_in_stream_cap(proto: Any) -> list[str]:
    """``where.attribute`` for each of ``STREAM_CAP_NEEDS`` this connected protocol lacks."""
    return _missing_on_connection(proto, STREAM_CAP_NEEDS)


#: What ``closing`` changes to put the stream cap it announces in force at once: h2's local
#: settings keep, per setting, the value in force followed by those announced and not yet
#: acknowledged (``local_settings._settings``, a deque per setting), ``where`` as in
#: ``DRAIN_NEEDS`` or ``local_settings``. Without them h2's 100 is in force until the client
#: acknowledges the relay's SETTINGS.
CAP_IN_FORCE_NEEDS: tuple[tuple[str, str], ...] = (
    ("proto", "connection"),
    ("connection", "_connection"),
    ("h2", "local_settings"),
    ("local_settings", "_settings"),
)


def missing_in_cap_in_force(proto: Any) -> list[str]:
    """``where.attribute`` for each of ``CAP_IN_FORCE_NEEDS`` this connected protocol lacks."""
    h2 = getattr(getattr(proto, "connection", None), "_connection", None)
    objects = {"proto": proto, "connection": getattr(proto, "connection", None), "h2": h2,
               "local_settings": getattr(h2, "local_settings", None)}  # fmt: skip
    return absent(CAP_IN_FORCE_NEEDS, objects)


def put_stream_cap_in_force(proto: Any, streams: int) -> bool:
    """Make h2 enforce ``streams`` as the connected ``proto``'s limit of concurrent inbound
    streams now, rather than once the client acknowledges the SETTINGS that announced it (False,
    nothing changed, where the internals are missing). The values announced and not yet
    acknowledged stay queued behind it, so the client's ACK changes nothing more.

    Why: RFC 9113 lets a client open streams before it has read the server's SETTINGS (the
    initial limit is unlimited), and h2 holds its built-in 100 until the ACK: a client opening
    more in its first flight (tonic does) was over a limit it had not been told."""
    if missing_in_cap_in_force(proto):
        return False
    values = proto.connection._connection.local_settings._settings
    held = values.get(SettingCodes.MAX_CONCURRENT_STREAMS) if isinstance(values, dict) else None
    if not isinstance(held, deque) or not held:
        return False
    held[0] = streams
    return True


#: What ``mend`` uses to refuse a stream over the limit in force with RST_STREAM instead of
#: h2's connection error: h2's frame handlers by frame class (a dict; the HEADERS one wrapped),
#: its HPACK ``decoder`` (a refused header block still changes the table), its connection
#: state machine, the highest stream id it received and its memo of how streams closed
#: (``CLOSED_STREAMS_NEEDS``), ``where`` as in ``DRAIN_NEEDS``. Without them h2 ends the
#: connection (GOAWAY ``PROTOCOL_ERROR``).
REFUSE_NEEDS: tuple[tuple[str, str], ...] = (
    ("proto", "connection"),
    ("connection", "_connection"),
    ("h2", "_frame_dispatch_table"),
    ("h2", "decoder"),
    ("h2", "state_machine"),
    ("h2", "highest_inbound_stream_id"),
    ("h2", "_closed_streams"),
)


def missing_in_refuse(proto: Any) -> list[str]:
    """``where.attribute`` for each of ``REFUSE_NEEDS`` this connected protocol lacks."""
    out = _missing_on_connection(proto, REFUSE_NEEDS)
    table = getattr(getattr(getattr(proto, "connection", None), "_connection", None),
                    "_frame_dispatch_table", None)  # fmt: skip
    if table is not None and not (isinstance(table, dict) and HeadersFrame in table):
        out.append("h2._frame_dispatch_table (a dict with HeadersFrame)")
    return out


def refuse_headers(h2: Any, frame: HeadersFrame, error_code: int) -> tuple[list[Any], list[Any]]:
    """h2's handling of a HEADERS frame that opens a stream, for one refused (a frame handler's
    ``(frames to send, events)``): the header block decoded (the HPACK table changes with every
    block), the stream id taken and remembered as reset by the relay, so that the client's later
    frames on it are answered as on any stream the relay reset, and RST_STREAM ``error_code``
    queued; no stream, no event. A frame h2 would not open a stream for raises what h2 raises
    for it then."""
    try:
        h2.decoder.decode(frame.data, raw=True)
    except OversizedHeaderListError as e:  # (as h2 reads a header block)
        raise DenialOfServiceError(f"Oversized header block: {e}") from e
    except (HPACKError, IndexError, TypeError, UnicodeDecodeError) as e:
        raise ProtocolError(f"Error decoding header block: {e}") from e
    events = h2.state_machine.process_input(ConnectionInputs.RECV_HEADERS)
    sid, highest = frame.stream_id, h2.highest_inbound_stream_id
    if sid <= highest:
        raise StreamIDTooLowError(sid, highest)  # a closed stream's: h2 answers it as such
    if sid % 2 != 1:
        raise ProtocolError("Invalid stream ID for peer.")
    h2.highest_inbound_stream_id = sid
    h2._closed_streams[sid] = StreamClosedBy.SEND_RST_STREAM
    return [RstStreamFrame(sid, error_code=error_code)], list(events)


#: What is used of a connected server protocol's events processor (grpclib makes it in
#: ``connection_made``): ``where`` is ``proto`` or ``processor``. ``mend`` changes its handlers
#: by h2 event type (a dict: frame types HTTP/2 does not define ignored, empty DATA dropped;
#: without it they stay grpclib's); ``closing.close_connections`` closes it at shutdown.
PROCESSOR_NEEDS: tuple[tuple[str, str], ...] = (
    ("proto", "processor"),
    ("processor", "processors"),
    ("processor", "close"),
)


def missing_in_processor(proto: Any) -> list[str]:
    """``where.attribute`` for each of ``PROCESSOR_NEEDS`` this connected protocol lacks."""
    processor: Any = getattr(proto, "processor", None)
    objects = {"proto": proto, "processor": processor}
    out = absent(PROCESSOR_NEEDS, objects)
    if hasattr(processor, "processors") and not isinstance(processor.processors, dict):
        out.append("processor.processors (a dict)")
    return out


#: What ``mend`` uses to write the GOAWAY h2 queued on a connection error (grpclib closes the
#: transport without it): ``where`` as in ``DRAIN_NEEDS``.
FEED_NEEDS: tuple[tuple[str, str], ...] = (
    ("proto", "connection"),
    ("connection", "feed"),
    ("connection", "_connection"),
    ("h2", "data_to_send"),
)


def missing_in_feed(proto: Any) -> list[str]:
    """``where.attribute`` for each of ``FEED_NEEDS`` this connected server protocol lacks."""
    return _missing_on_connection(proto, FEED_NEEDS)


#: What ``guard`` reads to bound a client's WINDOW_UPDATE frames by the DATA the relay sent it:
#: grpclib's per-connection counts of messages and DATA bytes sent (grpclib's own send keeps
#: them, and so does every writer of this package), ``where`` as in ``DRAIN_NEEDS``.
SENT_NEEDS: tuple[tuple[str, str], ...] = (
    ("proto", "connection"),
    ("connection", "messages_sent"),
    ("connection", "data_sent"),
)
#: The smallest SETTINGS_MAX_FRAME_SIZE HTTP/2 allows (RFC 9113 §6.5.2): no DATA frame the relay
#: sends is cut shorter than this but at the end of a message (or of the window open to it).
MIN_FRAME_LIMIT = 16384


def missing_in_sent(proto: Any) -> list[str]:
    """``where.attribute`` for each of ``SENT_NEEDS`` this connected server protocol lacks."""
    return _missing_on_connection(proto, SENT_NEEDS)


def data_frames_sent(proto: Any) -> Callable[[], int] | None:
    """How many DATA frames, at most, the relay has sent on the connected ``proto``'s connection
    so far (read when called): one per message, one more per 16 KiB sent. None where the
    counts are missing."""
    if missing_in_sent(proto):
        return None
    conn = proto.connection

    def sent() -> int:
        return int(conn.messages_sent) + int(conn.data_sent) // MIN_FRAME_LIMIT

    return sent


#: What ``guard`` reads to tell a stream the relay has ended (its trailers or RST_STREAM sent)
#: from one still open: h2's streams by id (each stream's state machine: ``INSTANCE_NEEDS``) and
#: the highest stream id it received, ``where`` as in ``DRAIN_NEEDS``. Without them the client's
#: frames on such a stream count only once it ends or resets the stream itself.
ENDED_NEEDS: tuple[tuple[str, str], ...] = (
    ("proto", "connection"),
    ("connection", "_connection"),
    ("h2", "streams"),
    ("h2", "highest_inbound_stream_id"),
)
#: A stream's h2 states once the relay has ended its side (``EARLY_END_STATE``) or it is reset.
SERVER_ENDED_STATES = frozenset((StreamState.HALF_CLOSED_LOCAL, StreamState.CLOSED))


def missing_in_ended(proto: Any) -> list[str]:
    """``where.attribute`` for each of ``ENDED_NEEDS`` this connected server protocol lacks."""
    return _missing_on_connection(proto, ENDED_NEEDS)


def server_ended(proto: Any) -> Callable[[int], bool] | None:
    """Whether the relay has ended a stream of the connected ``proto`` that its client opened
    (read when called: h2 has it half closed by the relay or closed, or has forgotten it as
    closed). A stream h2 has not seen yet (its HEADERS in the same read) is not ended. None
    where the internals are missing."""
    if missing_in_ended(proto):
        return None
    h2 = proto.connection._connection

    def ended(stream_id: int) -> bool:
        stream = h2.streams.get(stream_id)
        if stream is None:
            return bool(stream_id <= h2.highest_inbound_stream_id)
        machine = getattr(stream, "state_machine", None)
        return getattr(machine, "state", None) in SERVER_ENDED_STATES

    return ended


#: What ``mend`` uses to bound the HPACK table of a connection's response headers: h2's
#: ``encoder`` (an ``hpack.Encoder``, replaced by one whose table size is capped), ``where`` as
#: in ``DRAIN_NEEDS``.
ENCODER_NEEDS: tuple[tuple[str, str], ...] = (
    ("proto", "connection"),
    ("connection", "_connection"),
    ("h2", "encoder"),
)


def missing_in_encoder(proto: Any) -> list[str]:
    """``where.attribute`` for each of ``ENCODER_NEEDS`` this connected server protocol lacks."""
    return _missing_on_connection(proto, ENCODER_NEEDS)


#: What ``bound_closed_streams`` replaces: h2's memo of how each closed stream of a connection
#: closed (an ``h2.utilities.SizeLimitDict`` of stream id → how), ``where`` as in ``DRAIN_NEEDS``.
CLOSED_STREAMS_NEEDS: tuple[tuple[str, str], ...] = (
    ("proto", "connection"),
    ("connection", "_connection"),
    ("h2", "_closed_streams"),
)


def missing_in_closed_streams(proto: Any) -> list[str]:
    """``where.attribute`` for each of ``CLOSED_STREAMS_NEEDS`` this connected protocol lacks."""
    return _missing_on_connection(proto, CLOSED_STREAMS_NEEDS)


def bound_closed_streams(proto: Any, size: int) -> bool:
    """Make the connected ``proto``'s h2 connection remember how at most ``size`` of its closed
    streams closed (the newest; False, nothing changed, where the internals are missing).

    h2 keeps that for the last 65,536 streams of each connection, about 120 bytes each: every
    stream a connection ever carried (a unary call, a resubscription) stays until then, so a
    long-lived connection grew to ~7.9 MB, and the relay admits thousands. The memo only tells
    a late frame on a reset stream (answered RST_STREAM) from one on a stream closed otherwise
    (a connection error): it needs the streams closed while such frames can still be in
    flight, at most what a connection may hold open at once, twice over."""
    if missing_in_closed_streams(proto) or size <= 0:
        return False
    h2 = proto.connection._connection
    kept = SizeLimitDict(size_limit=size)
    kept.update(h2._closed_streams)  # (the newest kept: it drops the oldest as it fills)
    h2._closed_streams = kept
    return True


#: What ``capped_encoder`` overrides and uses of an ``hpack.Encoder``: ``(where, attribute)`` with
#: ``where`` the encoder (``encoder``) or its table (``table``). Without any of them h2's own
#: encoder is kept.
HPACK_ENCODER_NEEDS: tuple[tuple[str, str], ...] = (
    ("encoder", "header_table_size"),
    ("encoder", "header_table"),
    ("encoder", "table_size_changes"),
    ("table", "maxsize"),
    ("table", "resized"),
)


def missing_in_hpack_encoder(encoder: Any) -> list[str]:
    """``where.attribute`` for each of ``HPACK_ENCODER_NEEDS`` this encoder lacks."""
    objects = {"encoder": encoder, "table": getattr(encoder, "header_table", None)}
    return absent(HPACK_ENCODER_NEEDS, objects)


class _CappedEncoder(Encoder):
    """hpack's encoder with a table of at most ``limit`` bytes: h2 sets ``header_table_size``
    to the client's setting, this takes the smaller of the two (RFC 7541 §4.2 lets an encoder
    use less than its peer allows; the size change is announced as hpack announces any)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self._limit = limit

    @property
    def header_table_size(self) -> int:
        return int(self.header_table.maxsize)

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        self.header_table.maxsize = min(int(value), self._limit)
        if self.header_table.resized:
            self.table_size_changes.append(self.header_table.maxsize)


def capped_encoder(limit: int) -> Encoder | None:
    """An HPACK encoder whose table never exceeds ``limit`` bytes, or None where the installed
    hpack lacks what it uses (``HPACK_ENCODER_NEEDS``)."""
    encoder = _CappedEncoder(limit)
    return None if missing_in_hpack_encoder(encoder) else encoder


#: What ``request.recv_request`` reads a request through (its ``where`` as above); without any
#: of them it falls back to grpclib's ``recv_message``. ``inner`` is also the protocol stream
#: grpclib's ``handler.accept`` (``PROTOCOL_NEEDS``) is given with the request headers: ``mend``
#: notes the call's ``grpc-encoding`` by it there, and the reader finds it by ``stream._stream``
#: (where they differ, no encoding is known and a compressed request stays INVALID_REQUEST).
#: A request in an encoding it cannot read is refused after response headers naming those it
#: can (``grpc-accept-encoding``), written as grpclib writes its own.
REQUEST_NEEDS: tuple[tuple[str, str], ...] = (
    ("stream", "_stream"),
    ("stream", "_codec"),
    ("stream", "_recv_type"),
    ("stream", "_messages_received"),
    ("stream", "_send_initial_metadata_done"),
    ("stream", "_content_type"),
    ("inner", "recv_data"),
    ("inner", "send_headers"),
    ("inner", "connection"),
    ("connection", "messages_received"),
)


class Parts(NamedTuple):
    """The private objects behind one grpclib server stream."""

    stream: Any
    inner: Any
    connection: Any
    h2: Any


def missing_in_classes() -> list[str]:
    """``Class.attribute`` for each class-level need the installed versions lack."""
    return [f"{c.__module__}.{c.__qualname__}.{a}" for c, a in CLASS_NEEDS if not hasattr(c, a)]


def missing(stream: Any) -> list[str]:
    """``where.attribute`` for each need this grpclib server stream lacks (empty: all there).

    ``h2_stream`` (and its state machine) is looked up only while h2 holds the stream (an ended
    stream has none)."""
    inner: Any = getattr(stream, "_stream", None)
    h2: Any = getattr(inner, "_h2_connection", None)
    streams = getattr(h2, "streams", None)
    objects: dict[str, Any] = {
        "stream": stream,
        "inner": inner,
        "connection": getattr(inner, "connection", None),
        "h2": h2,
    }
    sid = getattr(inner, "id", None)
    objects["h2_state_machine"] = getattr(h2, "state_machine", None)
    if isinstance(streams, dict) and sid in streams:
        objects["h2_stream"] = streams[sid]
        objects["h2_stream_state_machine"] = getattr(streams[sid], "state_machine", None)
    out = absent(INSTANCE_NEEDS, objects, skip={w for w, _ in INSTANCE_NEEDS} - objects.keys())
    if hasattr(h2, "streams") and not isinstance(streams, dict):
        out.append("h2.streams (a dict)")
    if hasattr(h2, "_data_to_send") and not isinstance(h2._data_to_send, bytearray):
        out.append("h2._data_to_send (a bytearray)")
    return out


def stream_internals(stream: Any) -> Parts | None:
    """The private objects of a grpclib server stream when every need is there; None otherwise."""
    if missing(stream) or missing_in_classes():
        return None
    inner = stream._stream
    return Parts(stream, inner, inner.connection, inner._h2_connection)


def live_internals(stream: Any) -> Parts | None:
    """``stream_internals`` of a stream whose transport is still there (the frame writers write
    to it directly); None otherwise."""
    parts = stream_internals(stream)
    if parts is None or parts.inner._transport is None:
        return None
    return parts


#: What ``closing`` uses to end each request of a connection whose client certificate a reload
#: revoked with a status: the request tasks by stream (``PROTOCOL_NEEDS``) and each request's
#: grpclib ``Wrapper`` (``wrapper`` on grpclib's protocol stream, set as the request starts):
#: ``Wrapper.cancel(error)`` cancels the task and raises ``error`` where it leaves the wrapper,
#: as grpclib's own deadline does, so a ``GRPCError`` is written as the call's trailers.
#: ``where`` is ``handler`` or ``Wrapper`` (the class; a live stream's ``wrapper`` is checked by
#: ``test_internals``). Without them the connection is closed as at shutdown, its streams
#: without a status.
REVOKE_NEEDS: tuple[tuple[str, str], ...] = (
    ("handler", "_tasks"),
    ("Wrapper", "cancel"),
    ("Wrapper", "cancelled"),
)


def missing_in_revoke(proto: Any) -> list[str]:
    """``where.attribute`` for each of ``REVOKE_NEEDS`` this server protocol lacks."""
    objects = {"handler": getattr(proto, "handler", None), "Wrapper": Wrapper}
    return absent(REVOKE_NEEDS, objects)


def end_requests(proto: Any, error: Callable[[], Exception]) -> list[Any]:
    """End each running request of ``proto``'s connection with ``error()`` (see
    ``REVOKE_NEEDS``; once per request); returns the tasks of those still running. A request
    whose task has not started yet (no wrapper) is ended by a later call."""
    running = []
    for stream, task in list(proto.handler._tasks.items()):
        if task.done():
            continue
        running.append(task)
        wrapper = getattr(stream, "wrapper", None)
        if isinstance(wrapper, Wrapper) and not wrapper.cancelled:
            wrapper.cancel(error())
    return running


def flushed_to_client(proto: Any) -> asyncio.Future[None] | None:
    """Send a PING on the connected ``proto``: the future is done once the client acknowledges
    it, so has read every frame written before it (a revoked connection's statuses: grpclib's
    client drops a status it has not read yet when the connection closes). None where the
    internals are missing (``PROCESSOR_NEEDS``, ``DRAIN_NEEDS``; grpclib's handler of PING ACKs,
    by h2 event type, is wrapped)."""
    if missing_in_processor(proto) or missing_in_drain(proto):
        return None
    processors = proto.processor.processors
    acked = processors.get(PingAckReceived)
    if acked is None:
        return None
    opaque = os.urandom(8)
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_ack(event: PingAckReceived) -> None:
        if event.ping_data == opaque and not done.done():
            done.set_result(None)
        acked(event)

    processors[PingAckReceived] = on_ack
    conn = proto.connection
    conn._connection.ping(opaque)
    conn.flush()
    return done


#: What ``deadline`` replaces: the deadline wrapper class grpclib's server module makes for each
#: call with a ``grpc-timeout`` (``grpclib.server.DeadlineWrapper``, looked up at every call)
#: and its ``start`` (a context manager that arms the call's timer). ``where`` is
#: ``grpclib.server`` (the module) or ``DeadlineWrapper`` (grpclib's class). Without them
#: grpclib's own wrapper stays.
DEADLINE_NEEDS: tuple[tuple[str, str], ...] = (
    ("grpclib.server", "DeadlineWrapper"),
    ("DeadlineWrapper", "start"),
)


def missing_in_deadline() -> list[str]:
    """``where.attribute`` for each of ``DEADLINE_NEEDS`` the installed grpclib lacks."""
    objects = {"grpclib.server": grpclib.server, "DeadlineWrapper": DeadlineWrapper}
    return absent(DEADLINE_NEEDS, objects)


#: What ``closing.ClosingServer.wait_closed`` uses to stop in an order that ends: grpclib's
#: server's handlers, one per connection (``server._handlers``, each with ``wait_closed``: the
#: end of the requests grpclib's ``close`` cancelled). ``where`` is ``server`` or ``Handler``
#: (grpclib's class). Without them the connections are closed without waiting for those
#: requests.
SHUTDOWN_NEEDS: tuple[tuple[str, str], ...] = (
    ("server", "_handlers"),
    ("Handler", "wait_closed"),
)


def missing_in_shutdown(server: Any) -> list[str]:
    """``where.attribute`` for each of ``SHUTDOWN_NEEDS`` this server lacks."""
    objects = {"server": server, "Handler": Handler}
    return absent(SHUTDOWN_NEEDS, objects)


async def handlers_closed(server: Any) -> None:
    """Until the requests grpclib's ``Server.close`` cancelled have ended (nothing to wait for
    where the internals are missing)."""
    if missing_in_shutdown(server) or not server._handlers:
        return
    await asyncio.wait({asyncio.ensure_future(h.wait_closed()) for h in list(server._handlers)})

