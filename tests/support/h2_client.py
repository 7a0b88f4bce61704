"""A raw HTTP/2 gRPC client over a real TCP socket, for hostile-peer tests.

The ``h2`` state machine drives the frames, so the client can do what no gRPC library does:
bind a chosen source address (another loopback address is another "peer"), advertise a zero
flow-control window so the server can send no DATA (a client that never reads), and open many
streams on one connection. Every response is recorded per stream: headers, trailers, whether the
server reset it, and the gRPC messages that arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.settings

from kvrelay.contract.wire import CONTRACT_MARKER


@dataclass
class RawStream:
    headers: dict[str, str] = field(default_factory=dict)
    trailers: dict[str, str] = field(default_factory=dict)
    data: bytearray = field(default_factory=bytearray)
    reset: bool = False
    reset_code: int | None = None  # the RST_STREAM's error code (0: NO_ERROR)
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def status(self) -> str | None:
        return self.trailers.get("grpc-status", self.headers.get("grpc-status"))

    @property
    def message(self) -> str | None:
        return self.trailers.get("grpc-message", self.headers.get("grpc-message"))

    @property
    def reason(self) -> str | None:
        return self.trailers.get("kv-relay-error-reason", self.headers.get("kv-relay-error-reason"))


class RawH2Client:
    """One HTTP/2 connection; ``window=0``: the server cannot send this client any DATA."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, read_data: bool
    ) -> None:
        self._reader, self._writer = reader, writer
        self._read_data = read_data
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        )
        self.streams: dict[int, RawStream] = {}
        self.goaway: h2.events.ConnectionTerminated | None = None
        #: what arrived, in order: ``("ended", stream id)`` (its trailers came, or a reply that
        #: is trailers only), ``("reset", stream id)``, ``("goaway", last stream id)``
        self.order: list[tuple[str, int]] = []
        self.pings = 0  # PINGs the server sent (h2 answers each)
        self.closed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def connect(
        cls, port: int, source: str = "127.0.0.1", *, window: int | None = None
    ) -> RawH2Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
        client = cls(reader, writer, read_data=window is None)
        client.h2.initiate_connection()
        if window is not None:
            client.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        client.flush()
        client._task = asyncio.create_task(client._pump())
        return client

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data and not self._writer.is_closing():
            self._writer.write(data)

    def open(
        self, method: str, message: bytes, *, end: bool = True, raw: bytes | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> RawStream:
        """Start a call to ``/dynamo.kvrelay.v1.KvEventRelay/<method>`` (or to ``method`` when
        it is a whole path) and send ``message`` (``end=False``: the request body is never
        finished; ``raw``: these DATA bytes as they are, gRPC prefix included, instead of
        ``message`` framed; ``headers``: more request headers, e.g. ``grpc-timeout``)."""
        sid = self.h2.get_next_available_stream_id()
        path = method if method.startswith("/") else f"/dynamo.kvrelay.v1.KvEventRelay/{method}"
        self.h2.send_headers(sid, [
            (":method", "POST"), (":scheme", "http"), (":authority", "relay"),
            (":path", path),
            ("content-type", "application/grpc"), ("te", "trailers"), *headers,
        ])  # fmt: skip
        if raw is not None:
            self.h2.send_data(sid, raw, end_stream=end)
        elif end:
            framed = b"\x00" + len(message).to_bytes(4, "big") + message
            self.h2.send_data(sid, framed, end_stream=True)
        st = self.streams[sid] = RawStream()
        self.flush()
        return st

    def start_reading(self) -> None:
        """From now on read everything: open every stream's window and acknowledge DATA."""
        self._read_data = True
        self.h2.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 65535})
        self.flush()

    async def _pump(self) -> None:
        try:
            while data := await self._reader.read(65536):
                for ev in self.h2.receive_data(data):
                    self._event(ev)
                self.flush()
        except (ConnectionError, h2.exceptions.ProtocolError):
            pass
        finally:
            self.closed.set()
            for st in self.streams.values():
                st.ended.set()
            # the relay's FIN (or a failure): close our side too, as HTTP/2 clients do (a relay
            # that shuts down waits for it, up to its close wait)
            self._writer.close()

    def _event(self, ev: h2.events.Event) -> None:
        sid = getattr(ev, "stream_id", None)
        st = self.streams.get(sid) if sid is not None else None
        if isinstance(ev, h2.events.ResponseReceived) and st is not None:
            st.headers.update(_text(ev.headers))
        elif isinstance(ev, h2.events.TrailersReceived) and st is not None:
            st.trailers.update(_text(ev.headers))
        elif isinstance(ev, h2.events.DataReceived) and st is not None:
            st.data += ev.data
            if self._read_data:
                self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        elif isinstance(ev, h2.events.StreamReset) and st is not None:
            st.reset = True
            st.reset_code = int(ev.error_code) if ev.error_code is not None else None
            st.ended.set()
            self.order.append(("reset", ev.stream_id))
        elif isinstance(ev, h2.events.StreamEnded) and st is not None:
            st.ended.set()
            self.order.append(("ended", ev.stream_id))
        elif isinstance(ev, h2.events.ConnectionTerminated):
            self.goaway = ev
            self.order.append(("goaway", ev.last_stream_id or 0))
        elif isinstance(ev, h2.events.PingReceived):
            self.pings += 1

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self.h2.close_connection()
            self.flush()
        self._writer.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


#: What an HTTP/2 client sends first, with an empty SETTINGS frame after it.
PREFACE_AND_SETTINGS = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(3) + bytes([0x4, 0]) + bytes(4)


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    """One raw HTTP/2 frame (RFC 9113 §4.1): its 9-byte header, then ``payload``."""
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + sid.to_bytes(4, "big") + payload


def _text(headers: list[tuple[str, str]] | list[tuple[bytes, bytes]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in headers:
        out[k.decode() if isinstance(k, bytes) else k] = v.decode() if isinstance(v, bytes) else v
    return out


def plane_request(subscriber_id: str = "raw") -> bytes:
    """The request every plane RPC takes (``subscriber_id`` = 1, ``contract_marker`` = 127)."""
    from kvrelay._proto.dynamo.kvrelay import v1 as pb

    return bytes(
        pb.WatchKvPoolCatalogRequest(contract_marker=CONTRACT_MARKER, subscriber_id=subscriber_id)
    )
