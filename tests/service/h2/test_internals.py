"""Every grpclib/h2 internal ``kvrelay/service/h2/`` relies on is there in the installed versions.

The list lives in ``kvrelay/service/h2/internals.py``; this checks it on a real server stream over
loopback (grpclib's own objects, not stand-ins), so an h2 or grpclib upgrade that drops one fails
here with its name instead of slowing the relay down unnoticed.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import socket
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpclib.server
import hpack
from grpclib.client import Channel
from grpclib.const import Cardinality, Handler
from grpclib.encoding.base import CodecBase
from grpclib.utils import Wrapper

import kvrelay
from kvrelay.service.h2.closing import ClosingServer
from kvrelay.service.h2.internals import (
    ANSWER_NEEDS,
    DEADLINE_NEEDS,
    DRAIN_NEEDS,
    EARLY_END_STATE,
    ENCODER_NEEDS,
    ENDED_NEEDS,
    FEED_NEEDS,
    HPACK_ENCODER_NEEDS,
    INSTANCE_NEEDS,
    LINGER_NEEDS,
    NO_ERROR,
    PROCESSOR_NEEDS,
    PROTOCOL_NEEDS,
    SEND_DATA_CONNECTION,
    SEND_DATA_CONNECTION_NOOP,
    SEND_DATA_STREAM,
    SEND_DATA_STREAM_NOOP,
    SENT_NEEDS,
    SERVER_ENDED_STATES,
    STREAM_CAP_NEEDS,
    capped_encoder,
    data_frames_sent,
    missing,
    missing_in_answer,
    missing_in_classes,
    missing_in_deadline,
    missing_in_drain,
    missing_in_encoder,
    missing_in_ended,
    missing_in_feed,
    missing_in_hpack_encoder,
    missing_in_linger,
    missing_in_processor,
    missing_in_protocol,
    missing_in_revoke,
    missing_in_sent,
    missing_in_shutdown,
    missing_in_stream_cap,
    server_ended,
    stream_internals,
)
from kvrelay.service.h2.request import missing_request_needs, recv_request
from kvrelay.service.h2.writer import StreamWriter
from tests.support.h2_client import RawH2Client

PATH = "/kvrelay.test.Internals/Probe"


class _Raw(CodecBase):
    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        return bytes(message)

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data


class _Without:
    """A real stream with one attribute hidden."""

    def __init__(self, stream: Any, hidden: str) -> None:
        self._target, self._hidden = stream, hidden

    def __getattr__(self, name: str) -> Any:
        if name == self._hidden:
            raise AttributeError(name)
        return getattr(self._target, name)


class _Probe:
    def __init__(self) -> None:
        self.seen: list[tuple[list[str], list[str], StreamWriter]] = []
        self.request: tuple[list[str], Any] | None = None
        self.wrapped = False  # the request's protocol stream has grpclib's Wrapper (REVOKE_NEEDS)
        self.answer: list[str] | None = None  # what mend's own answers lack (ANSWER_NEEDS)

    async def probe(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        need = missing_request_needs(stream)
        self.request = (need, await recv_request(stream, 1 << 20))  # the checked path
        hidden = missing(_Without(stream, "_messages_sent"))
        self.seen.append((missing(stream), hidden, StreamWriter(stream, 1 << 20)))
        self.wrapped = isinstance(stream._stream.wrapper, Wrapper)
        self.answer = missing_in_answer(stream._stream)
        await stream.send_message(b"ok")

    def __mapping__(self) -> dict[str, Handler]:
        return {PATH: Handler(self.probe, Cardinality.UNARY_STREAM, bytes, bytes)}


def test_the_classes_have_every_method_the_writers_use() -> None:
    gone = missing_in_classes()
    assert not gone, f"grpclib/h2 no longer have: {', '.join(gone)}"


def test_grpclib_s_server_makes_its_deadline_wrapper_where_the_relay_replaces_it() -> None:
    """``DEADLINE_NEEDS``: the server module's own ``DeadlineWrapper`` name, looked up at each
    call (so replacing the module's name takes effect), with a ``start`` to override."""
    import inspect

    assert missing_in_deadline() == [], DEADLINE_NEEDS
    source = inspect.getsource(grpclib.server.request_handler)
    assert "DeadlineWrapper()" in source and ".start(deadline)" in source


async def test_a_live_server_stream_has_every_internal_and_gets_every_writer() -> None:
    probe = _Probe()
    server = grpclib.server.Server([probe], codec=_Raw())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    await server.start(sock=sock)
    ch = Channel("127.0.0.1", port, codec=_Raw())
    try:
        async with ch.request(PATH, Cardinality.UNARY_STREAM, bytes, bytes) as st:
            await st.send_message(b"x", end=True)
            assert await st.recv_message() == b"ok"
    finally:
        ch.close()
        server.close()
        await server.wait_closed()
    [(gone, hidden, writer)] = probe.seen
    assert probe.request == ([], b"x"), "the request reader lacks grpclib internals"
    assert not gone, f"grpclib/h2 internals missing on a live stream: {', '.join(gone)}"
    assert hidden == ["stream._messages_sent"]  # a missing one is named, and only it
    assert probe.answer == [], "mend's own answers lack grpclib internals"
    assert missing_in_answer(object()) == [f"{w}.{a}" for w, a in ANSWER_NEEDS]
    assert probe.wrapped, "a request's grpclib stream has no Wrapper to end it with a status"
    assert writer.bulk is not None and writer.send_batch is not None
    assert writer.reset is not None and writer.send_now is not None
    writer.close()


async def test_a_server_protocol_has_what_releasing_cancelled_streams_uses() -> None:
    """``closing.release_cancelled_streams``: the protocol's handler, its ``accept`` and its
    request tasks by stream; a protocol without them is named, each need once."""
    server = grpclib.server.Server([_Probe()], codec=_Raw())
    proto = server._protocol_factory()
    assert missing_in_protocol(proto) == []
    assert isinstance(proto.handler._tasks, dict)
    assert missing_in_protocol(object()) == [f"{w}.{a}" for w, a in PROTOCOL_NEEDS]
    assert missing_in_revoke(proto) == []
    assert missing_in_revoke(object()) == ["handler._tasks"]
    # ``ClosingServer.wait_closed``: the server's handlers (one per connection), each awaitable
    assert missing_in_shutdown(server) == [] and proto.handler in server._handlers
    assert missing_in_shutdown(object()) == ["server._handlers"]


@contextlib.asynccontextmanager
async def _called() -> AsyncIterator[Any]:
    """The server protocol of a real connection after one call on it."""
    server = ClosingServer([_Probe()], codec=_Raw())
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    ch = Channel("127.0.0.1", port, codec=_Raw())
    try:
        async with ch.request(PATH, Cardinality.UNARY_STREAM, bytes, bytes) as st:
            await st.send_message(b"x", end=True)
            assert await st.recv_message() == b"ok"
        (proto,) = list(server._protocols)
        yield proto
    finally:
        ch.close()
        server.close()
        await server.wait_closed()


async def test_a_connected_server_protocol_has_what_the_drain_notice_and_mend_use() -> None:
    """``drain.DrainNotice``: the connection's transport and flush, h2's outbound buffer and
    the highest stream id it received; ``mend``: the connection's ``feed`` and h2's
    ``data_to_send`` and h2's HPACK ``encoder``, and the events processor's handlers by event
    type (a dict; ``closing`` closes the processor); ``closing``'s stream cap: h2's connection
    and the connection's flush, and its close by halves: the connection's ``_transport``; on a
    real connection after a call."""
    async with _called() as proto:
        assert missing_in_drain(proto) == []
        assert isinstance(proto.connection._connection._data_to_send, bytearray)
        assert proto.connection._connection.highest_inbound_stream_id == 1
        assert missing_in_drain(object()) == [f"{w}.{a}" for w, a in DRAIN_NEEDS]
        assert missing_in_feed(proto) == []
        assert missing_in_feed(object()) == [f"{w}.{a}" for w, a in FEED_NEEDS]
        assert missing_in_encoder(proto) == []
        assert isinstance(proto.connection._connection.encoder, hpack.Encoder)
        assert missing_in_encoder(object()) == [f"{w}.{a}" for w, a in ENCODER_NEEDS]
        assert missing_in_stream_cap(proto) == []
        assert missing_in_stream_cap(object()) == [f"{w}.{a}" for w, a in STREAM_CAP_NEEDS]
        assert missing_in_processor(proto) == []
        assert missing_in_processor(object()) == [f"{w}.{a}" for w, a in PROCESSOR_NEEDS]
        odd = SimpleNamespace(processor=SimpleNamespace(processors=(), close=None))
        assert missing_in_processor(odd) == ["processor.processors (a dict)"]
        # ``closing``'s close by halves: the transport grpclib's connection closes
        assert missing_in_linger(proto) == []
        assert missing_in_linger(object()) == [f"{w}.{a}" for w, a in LINGER_NEEDS]


async def test_the_stream_accept_is_given_is_the_one_the_request_reader_reads() -> None:
    """``mend`` notes a call's ``grpc-encoding`` by the protocol stream grpclib's
    ``handler.accept`` gets; ``recv_request`` finds it by ``stream._stream``: they must be one
    object, or a gzip request would read as one without an encoding (INVALID_REQUEST)."""
    import zlib

    from kvrelay.service.h2.guard import H2Budgets, H2Counters

    probe = _Probe()
    server = ClosingServer([probe], codec=_Raw())
    server.h2_guard = (H2Budgets(), H2Counters())  # (what installs ``mend``)
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    raw = await RawH2Client.connect(port)
    try:
        packed = zlib.compress(b"x")
        st = raw.open(PATH, b"", raw=b"\x01" + len(packed).to_bytes(4, "big") + packed,
                      headers=(("grpc-encoding", "deflate"),))  # fmt: skip
        await asyncio.wait_for(st.ended.wait(), 5)
        assert probe.request == ([], b"x"), st.message
    finally:
        await raw.close()
        server.close()
        await server.wait_closed()


class _EarlyEnd:
    """Ends a bidirectional stream whose client still sends, as ``request.finish_early``."""

    def __init__(self) -> None:
        self.states: list[Any] = []

    async def early(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        assert await stream.recv_message() == b"x"
        parts = stream_internals(stream)
        assert parts is not None
        h2_stream = parts.h2.streams[parts.inner.id]
        await stream.send_trailing_metadata()
        self.states.append(h2_stream.state_machine.state)
        parts.inner.reset_nowait(NO_ERROR)
        self.states.append(h2_stream.state_machine.state)

    def __mapping__(self) -> dict[str, Handler]:
        return {EARLY: Handler(self.early, Cardinality.STREAM_STREAM, bytes, bytes)}


EARLY = "/kvrelay.test.Internals/Early"


@contextlib.asynccontextmanager
async def _ended_early(
    server_type: type[grpclib.server.Server],
) -> AsyncIterator[tuple[_EarlyEnd, Any, RawH2Client, Any]]:
    """A server of ``server_type`` with the ``_EarlyEnd`` probe, and a raw connection whose
    stream 1 (a request sent, the client's side left open) the probe has already ended."""
    probe = _EarlyEnd()
    server = server_type([probe], codec=_Raw())
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    raw = await RawH2Client.connect(port)
    try:
        st = raw.open(EARLY, b"", raw=b"\x00\x00\x00\x00\x01x", end=False)
        await asyncio.wait_for(st.ended.wait(), 5)
        yield probe, server, raw, st
    finally:
        await raw.close()
        server.close()
        await server.wait_closed()


async def test_a_stream_ended_while_its_client_sends_is_half_closed_then_reset_no_error() -> None:
    """``request.finish_early``: after the trailers of a stream whose client has not finished
    its requests, h2 holds it in ``EARLY_END_STATE`` (half closed, local), and the client gets
    the RST_STREAM with ``NO_ERROR`` after them, which closes the stream."""
    from h2.stream import StreamState

    async with _ended_early(grpclib.server.Server) as (probe, _, raw, st):
        await asyncio.sleep(0.1)  # the reset comes after the trailers
        assert probe.states == [EARLY_END_STATE, StreamState.CLOSED]
        assert st.status == "0" and raw.order == [("ended", 1), ("reset", 1)]
        assert st.reset_code == NO_ERROR == 0


async def test_the_guard_reads_which_streams_the_relay_ended() -> None:
    """``guard`` counts a client's DATA on a stream the relay ended (``server_ended``): on a real
    connection, a stream the relay half closed and then reset reads as ended (both states are
    ``SERVER_ENDED_STATES``), one whose request has not come does not, nor one h2 has not seen
    yet; a protocol without h2's streams is named, each need once, and gets no reader."""
    async with _ended_early(ClosingServer) as (probe, server, raw, _):
        raw.open(EARLY, b"", end=False)  # stream 3: no request yet, its handler waits
        await asyncio.sleep(0.1)
        (proto,) = list(server._protocols)
        assert missing_in_ended(proto) == []
        ended = server_ended(proto)
        assert ended is not None
        assert set(probe.states) <= SERVER_ENDED_STATES
        assert ended(1) and not ended(3) and not ended(5)
        assert missing_in_ended(object()) == [f"{w}.{a}" for w, a in ENDED_NEEDS]
        assert server_ended(object()) is None


def test_an_object_that_is_no_grpclib_stream_gets_no_writer_and_every_need_named() -> None:
    gone = missing(object())
    assert gone[0] == "stream._stream"
    assert missing_request_needs(object())[0] == "stream._stream"
    assert {f"{w}.{a}" for w, a in INSTANCE_NEEDS if not w.startswith("h2_stream")} <= set(gone)
    w = StreamWriter(object(), 1 << 20)
    assert (w.bulk, w.send_batch, w.reset, w.send_now) == (None, None, None, None)


def test_the_send_data_transitions_a_writer_may_skip_are_no_ops_in_h2() -> None:
    """``direct`` skips h2's two SEND_DATA transitions in these states: h2 must take each without
    an action, without events, and leave the state as it was."""
    from h2.connection import H2ConnectionStateMachine
    from h2.stream import H2StreamStateMachine

    conn = H2ConnectionStateMachine()
    conn.state = SEND_DATA_CONNECTION_NOOP
    assert conn.process_input(SEND_DATA_CONNECTION) == []
    assert conn.state is SEND_DATA_CONNECTION_NOOP
    for state in SEND_DATA_STREAM_NOOP:
        st = H2StreamStateMachine(1)
        st.state = state
        assert st.process_input(SEND_DATA_STREAM) == []
        assert st.state is state


def test_h2_is_a_bounded_dependency_next_to_grpclib() -> None:
    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    for name in ("grpclib", "h2"):
        [spec] = [d for d in deps if d.split(">")[0].split("<")[0].split("=")[0] == name]
        assert ">=" in spec and "<" in spec.replace("<=", ""), spec


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return out


def test_no_module_outside_service_h2_imports_h2_or_grpclib_internals() -> None:
    """The SDK (``client/``) may catch h2's public exceptions; ``_grpc.py`` is the client
    side's one room for grpclib's and h2's internals (as ``service/h2/`` is the server's);
    nothing else touches h2 or grpclib's protocol layer."""
    root = Path(kvrelay.__file__).resolve().parent
    private = ("h2", "grpclib.protocol", "grpclib.stream")
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[:2] == ("service", "h2") or rel == ("_grpc.py",):
            continue
        for mod in sorted(_imports(path)):
            if any(mod == p or mod.startswith(p + ".") for p in private):
                if rel[0] == "client" and mod == "h2.exceptions":
                    continue
                bad.append(f"{'/'.join(rel)} imports {mod}")
    assert not bad, "\n".join(bad)


def test_hpack_encoders_have_what_the_capped_encoder_uses() -> None:
    """``capped_encoder`` overrides ``header_table_size`` and uses the table's ``maxsize`` and
    ``resized`` and the encoder's ``table_size_changes``: on the installed hpack each is there,
    and a size over the cap is held to it (announced once), a smaller one honoured."""
    assert missing_in_hpack_encoder(hpack.Encoder()) == []
    assert missing_in_hpack_encoder(object()) == [f"{w}.{a}" for w, a in HPACK_ENCODER_NEEDS]
    encoder = capped_encoder(4096)
    assert encoder is not None
    encoder.header_table_size = 1 << 31
    assert encoder.header_table_size == 4096 and encoder.header_table.maxsize == 4096
    encoder.header_table_size = 1024
    assert encoder.header_table_size == 1024 and encoder.table_size_changes == [1024]


async def test_a_connected_server_protocol_counts_what_it_sent() -> None:
    """``guard`` bounds a client's WINDOW_UPDATEs by the DATA frames the relay sent it, read from
    grpclib's per-connection counts of messages and DATA bytes: there on a real connection after
    a call (one message of a few bytes: one frame); a protocol without them is named, each need
    once, and gets no reader."""
    async with _called() as proto:
        assert missing_in_sent(proto) == []
        sent = data_frames_sent(proto)
        assert sent is not None and sent() == 1
        assert missing_in_sent(object()) == [f"{w}.{a}" for w, a in SENT_NEEDS]
        assert data_frames_sent(object()) is None


async def test_a_connected_server_protocol_has_what_the_stream_limit_uses() -> None:
    """``closing`` puts its stream cap in force before the client acknowledges it (h2's local
    settings: the value in force, then those announced); ``mend`` refuses a stream over the limit
    from h2's HEADERS handler, which checks the limit before it decodes the header block or
    takes the stream id (so the refusal takes the whole frame), and ``refuse_headers`` decodes
    the block, takes the id and remembers the stream as reset. On a real connection; a protocol
    without them is named, each need once."""
    import h2.exceptions
    import pytest
    from h2.settings import SettingCodes
    from h2.stream import StreamClosedBy
    from hyperframe.frame import HeadersFrame

    from kvrelay.service.h2.internals import (
        CAP_IN_FORCE_NEEDS,
        REFUSE_NEEDS,
        missing_in_cap_in_force,
        missing_in_refuse,
        put_stream_cap_in_force,
        refuse_headers,
    )

    async with _called() as proto:
        assert missing_in_cap_in_force(proto) == []
        assert missing_in_cap_in_force(object()) == [f"{w}.{a}" for w, a in CAP_IN_FORCE_NEEDS]
        assert missing_in_refuse(proto) == []
        assert missing_in_refuse(object()) == [f"{w}.{a}" for w, a in REFUSE_NEEDS]
        conn = proto.connection._connection
        settings = conn.local_settings
        settings[SettingCodes.MAX_CONCURRENT_STREAMS] = 7  # (what ``update_settings`` queues)
        assert settings.max_concurrent_streams == 100  # h2: not before the client's ACK
        assert put_stream_cap_in_force(proto, 7) and settings.max_concurrent_streams == 7
        assert settings.acknowledge()[SettingCodes.MAX_CONCURRENT_STREAMS].new_value == 7
        assert settings.max_concurrent_streams == 7
        assert put_stream_cap_in_force(proto, 0)  # every new stream over the limit
        block = hpack.Encoder().encode([(":path", "/x"), ("x-new", "adds a table entry")])
        highest = conn.highest_inbound_stream_id
        frame = HeadersFrame(highest + 2, data=block, flags=["END_HEADERS"])
        table = conn.decoder.header_table
        entries = len(table.dynamic_entries)
        with pytest.raises(h2.exceptions.TooManyStreamsError):
            conn._frame_dispatch_table[HeadersFrame](frame)
        assert len(table.dynamic_entries) == entries  # nothing of the frame taken
        assert conn.highest_inbound_stream_id == highest and frame.stream_id not in conn.streams
        frames, events = refuse_headers(conn, frame, 7)
        assert [(type(f).__name__, f.stream_id, f.error_code) for f in frames] == [
            ("RstStreamFrame", highest + 2, 7)
        ]
        assert events == [] and frame.stream_id not in conn.streams
        assert len(table.dynamic_entries) == entries + 2
        assert conn.highest_inbound_stream_id == highest + 2
        assert conn._closed_streams[highest + 2] is StreamClosedBy.SEND_RST_STREAM
        with pytest.raises(h2.exceptions.StreamIDTooLowError):  # a closed stream's: not new
            refuse_headers(conn, HeadersFrame(highest, data=b"", flags=["END_HEADERS"]), 7)
