"""What h2 remembers of a connection's closed streams is bounded by the relay's stream limits.

h2 keeps how each closed stream closed for the last 65,536 streams of a connection (~120 bytes
each): every unary call and resubscription a long-lived client made stayed there, ~7.9 MB per
connection at h2's bound, with thousands of connections admitted."""

from __future__ import annotations

import h2.connection
from grpclib.client import Channel
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest

from kvrelay._grpc import closed_streams_bound
from kvrelay.contract.limits import RelayLimits
from kvrelay.service.h2.internals import CLOSED_STREAMS_NEEDS, missing_in_closed_streams
from kvrelay.service.server import RelayServer, streams_per_connection
from tests.support.mem_relay import MemRelayView


async def test_a_long_lived_connection_keeps_a_bounded_memo_of_closed_streams() -> None:
    limits = RelayLimits()
    kept = closed_streams_bound(streams_per_connection(limits))
    server = RelayServer(MemRelayView(limits), limits)
    await server.start("127.0.0.1", 0)
    ch = Channel("127.0.0.1", server.port)
    try:
        stub = HealthStub(ch)
        calls = kept + 100  # (under the guard's 2,048 new streams per window)
        for _ in range(calls):
            await stub.Check(HealthCheckRequest())
        (proto,) = list(server._server._protocols)
        conn = proto.connection._connection
        assert isinstance(conn, h2.connection.H2Connection)
        assert conn.highest_inbound_stream_id == 2 * calls - 1  # every call on this connection
        assert len(conn._closed_streams) == kept < calls
        assert missing_in_closed_streams(proto) == []
        assert missing_in_closed_streams(object()) == [f"{w}.{a}" for w, a in CLOSED_STREAMS_NEEDS]
    finally:
        ch.close()
        await server.close(grace_s=1.0)
