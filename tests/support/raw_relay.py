"""A relay on raw HTTP/2 (the ``h2`` package over a loopback socket), for the stream ends no gRPC
server library sends: END_STREAM on a DATA frame with no trailers at all (no ``grpc-status``).

It answers as ``scripted_relay.ScriptedRelay`` does: one catalog listing its pool, a READY
readiness revision and one load window (stating a minute-long period: neither plane goes silent
in a test), each sent once and their streams then held open; ``SubscribeServingLoad`` is answered
``UNIMPLEMENTED``. Each pool stream sends the snapshot at 10, then ends as the next of
``pool_ends`` says (``"no_status"``: an empty DATA frame with END_STREAM; ``"hold"``: it stays
open), ``"hold"`` once they are used up.
"""

from __future__ import annotations

import asyncio
import struct
from collections import Counter, deque
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from tests.support import scripted_relay as S


def framed(message: Any) -> bytes:
    """One gRPC length-prefixed message, uncompressed."""
    body = bytes(message)
    return struct.pack(">BI", 0, len(body)) + body


def _catalog() -> pb.KvPoolCatalogUpdate:
    return pb.KvPoolCatalogUpdate(
        protocol_version=1, relay=S.RELAY, revision=1, contract_marker=S.MARKER,
        snapshot=pb.KvPoolCatalogSnapshot(pools=[S.descriptor()]),
    )  # fmt: skip


def _readiness() -> pb.ServingReadinessUpdate:
    d = S.descriptor()
    member = pb.TopologyMember(endpoint=d.serving_endpoint, roles=[pb.WorkerRole.AGGREGATED],
                               pool_id=S.producer().pool_id)  # fmt: skip
    return pb.ServingReadinessUpdate(
        protocol_version=1, relay=S.RELAY, revision=1, contract_marker=S.MARKER,
        entries=[pb.TopologyEntry(namespace="ns", canonical_model_id="m", state=2,
                                  present_roles=[pb.WorkerRole.AGGREGATED], members=[member])],
    )  # fmt: skip


def _load() -> pb.KvPoolLoadUpdate:
    return pb.KvPoolLoadUpdate(
        protocol_version=1, relay=S.RELAY, window_sequence=1, observed_ms=5, window_ms=60_000,
        contract_marker=S.MARKER,
    )  # fmt: skip


class RawRelay:
    """Serve on loopback with ``start()`` (its port); ``calls``: streams opened, by method."""

    def __init__(self, pool_ends: list[str]) -> None:
        self.pool_ends = deque(pool_ends)
        self.calls: Counter[str] = Counter()
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    def _connection(self) -> _Connection:
        conn = _Connection(self)
        self._connections.add(conn)
        return conn

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in self._connections:
                conn.transport.close()
            await self._server.wait_closed()


class _Connection(asyncio.Protocol):
    def __init__(self, relay: RawRelay) -> None:
        self.relay = relay
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        )
        self.transport: Any = None
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.h2.initiate_connection()
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.relay._connections.discard(self)
        for task in list(self.tasks):
            task.cancel()

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data and not self.transport.is_closing():
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError:
            self.transport.close()
            return
        for ev in events:
            if isinstance(ev, h2.events.RequestReceived):
                method = dict(ev.headers)[":path"].rsplit("/", 1)[-1]
                task = asyncio.get_running_loop().create_task(self._answer(ev.stream_id, method))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            elif isinstance(ev, h2.events.DataReceived):
                self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        self.flush()

    def _send(self, sid: int, *messages: Any) -> None:
        for m in messages:
            self.h2.send_data(sid, framed(m))  # (each far below the initial window)
        self.flush()

    async def _answer(self, sid: int, method: str) -> None:
        self.relay.calls[method] += 1
        ok = [(":status", "200"), ("content-type", "application/grpc")]
        try:
            if method == "SubscribeServingLoad":
                self.h2.send_headers(sid, [*ok, ("grpc-status", "12")], end_stream=True)
                self.flush()
                return
            self.h2.send_headers(sid, ok)
            if method == "WatchKvPoolCatalog":
                self._send(sid, _catalog())
            elif method == "SubscribeServingReadiness":
                self._send(sid, _readiness())
            elif method == "SubscribeKvPoolLoad":
                self._send(sid, _load())
            elif method == "SubscribeKvPool":
                self._send(sid, *S.snapshot(10))
                end = self.relay.pool_ends.popleft() if self.relay.pool_ends else "hold"
                if end == "no_status":
                    await asyncio.sleep(0.2)  # (installed first)
                    self.h2.send_data(sid, b"", end_stream=True)  # no trailers, no status
                    self.flush()
                    return
            await asyncio.Event().wait()
        except h2.exceptions.StreamClosedError:
            pass  # the client reset it
