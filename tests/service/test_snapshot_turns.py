"""Many snapshots on one HTTP/2 connection, as the SDK and every mirror subscribe: the relay
writes them one stream after another, and a stream's clocks run from its turn.

Real gRPC over loopback with an in-memory relay (``MemRelayView``); the oracle is each
generation's own table at the sequence the replica installed, and the bytes the client received.
Traffic is tied to progress, not to time, so the test means the same on a busy machine: every
snapshot the client completes publishes more deltas on every pool than a waiting stream's
queue could hold by the time the last streams' turns come.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Cardinality, Status
from grpclib.server import Server
from grpclib.server import Stream as ServerStream

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import errors as E
from kvrelay.client import rpc
from kvrelay.contract.errors import RelayError
from kvrelay.contract.limits import RelayLimits
from kvrelay.publication import cbi1
from kvrelay.service.server import RelayServer
from tests.support.h2_client import RawH2Client
from tests.support.mem_relay import SVC, Generation, MemRelayView, Replica, sub_request
from tests.support.timing import scaled

LANES = 12
BUCKETS = 1 << 17  # 1 MiB lanes: one chunk each
DELTAS_PER_COMPLETION = 6  # x 11 completions >> the 16 slots of a waiting stream's queue


def _window_channel(port: int, window: int) -> Channel:
    config = Configuration(http2_connection_window_size=window, http2_stream_window_size=window)
    return Channel("127.0.0.1", port, config=config)


async def test_one_connection_subscribing_many_lanes_under_traffic_completes_all() -> None:
    limits = RelayLimits(publication_queue_capacity=16)
    view = MemRelayView(limits)
    server = RelayServer(view, limits)
    await server.start("127.0.0.1", 0)
    rng = np.random.default_rng(24)
    gens = [view.add_pool(f"lane-{i:02d}", BUCKETS) for i in range(LANES)]
    for g in gens:
        g.random_step(rng, 64)
    ch = _window_channel(server.port, 256 * 1024)  # the relay waits on the client's reading
    replicas: dict[int, Replica] = {}
    snapshot_bytes = {"received": 0}
    ends: dict[int, Any] = {}
    exact: dict[int, bool] = {}  # the replica equals the generation's table at its sequence

    def traffic() -> None:
        for g in gens:
            for _ in range(DELTAS_PER_COMPLETION):
                g.random_step(rng, 4)

    async def follow(i: int, gen: Generation) -> None:
        replica = replicas[i] = Replica(view.relay_identity, gen.producer)
        try:
            async with ch.request(SVC + "SubscribeKvPool", Cardinality.UNARY_STREAM,
                                  pb.SubscribeKvPoolRequest, pb.FilterUpdate) as st:  # fmt: skip
                await st.send_message(sub_request(gen.producer, f"lane-{i}"), end=True)
                while (fu := await st.recv_message()) is not None:
                    installed = replica.table is not None
                    if int(fu.kind) == int(pb.FilterUpdateKind.SNAPSHOT_CHUNK):
                        snapshot_bytes["received"] += len(fu.payload)
                    replica.feed(fu)
                    if not installed and replica.table is not None:
                        traffic()
                    if replica.table is not None and replica.installed == gen.sequence:
                        exact[i] = bool(np.array_equal(replica.table, gen.table))
                        ends[i] = None
                        await st.cancel()
                        return
        except Exception as exc:  # a lagged or timed-out stream
            ends[i] = exc

    try:
        tasks = [asyncio.ensure_future(follow(i, g)) for i, g in enumerate(gens)]
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        failed = {i: e for i, e in ends.items() if e is not None}
        assert not failed, (len(failed), failed)
        assert exact == dict.fromkeys(range(LANES), True), exact
        one = 8 * BUCKETS + 128 * cbi1.chunk_count_for(BUCKETS)
        assert snapshot_bytes["received"] <= 1.1 * LANES * one, snapshot_bytes
        # the later streams' cuts went stale while they waited, and were taken again
        assert sum(g.hub_or_none.recuts for g in gens if g.hub_or_none) > 0
    finally:
        ch.close()
        await server.close(grace_s=1.0)


class _Paced:
    """A pool stream per subscriber_id: ``busy`` sends a heartbeat every 0.1 s; ``late`` sends
    its first message only after 1.5 s (it waits for its turn)."""

    def __mapping__(self) -> dict[str, Any]:
        from grpclib.const import Handler

        return {SVC + "SubscribeKvPool": Handler(
            self._pool, Cardinality.UNARY_STREAM, pb.SubscribeKvPoolRequest, pb.FilterUpdate)}

    async def _pool(self, stream: ServerStream[Any, Any]) -> None:
        req = await stream.recv_message()
        assert req is not None
        beat = pb.FilterUpdate(kind=pb.FilterUpdateKind.HEARTBEAT, sequence=1, base_sequence=1)
        if req.subscriber_id == "late":
            await asyncio.sleep(1.5)
            await stream.send_message(beat)
            await asyncio.Event().wait()
        for _ in range(25):
            await stream.send_message(beat)
            await asyncio.sleep(0.1)
        await asyncio.Event().wait()


class _Got(Exception):
    """One message is enough: leave the stream."""


async def _late_stream(ch: Channel) -> rpc.StreamEnd:
    def on(msg: Any) -> None:
        raise _Got

    req = sub_request(None, "late")
    try:
        return await rpc.run_stream(ch, "SubscribeKvPool", req, pb.FilterUpdate, on,
                                    silence_s=0.5)  # fmt: skip
    except _Got:
        return rpc.StreamEnd(E.EOF, Status.OK, "first message", 1)


async def test_a_stream_waiting_its_turn_is_silent_only_while_its_channel_is() -> None:
    """The silence clock of a stream without its first message runs from its channel's last
    message: behind a busy stream of its channel it waits; alone on a channel it is silent."""
    server = Server([_Paced()])
    await server.start("127.0.0.1", 0)
    assert server._server is not None
    port = int(server._server.sockets[0].getsockname()[1])
    shared, alone = Channel("127.0.0.1", port), Channel("127.0.0.1", port)
    try:
        busy = asyncio.ensure_future(rpc.run_stream(
            shared, "SubscribeKvPool", sub_request(None, "busy"), pb.FilterUpdate,
            lambda m: None, silence_s=0.5))  # fmt: skip
        waited, lonely = await asyncio.wait_for(
            asyncio.gather(_late_stream(shared), _late_stream(alone)), 20
        )
        assert waited.messages == 1, waited
        assert lonely.reason == E.SILENT, lonely
        busy.cancel()
    finally:
        shared.close()
        alone.close()
        server.close()


@pytest.mark.parametrize("ending", ["drain", "fence"])
async def test_a_stream_waiting_its_turn_ends_at_once_with_its_status(ending: str) -> None:
    """A client that reads nothing on one connection: the first stream fills its own window and
    steps aside, the second keeps the turn waiting for the connection's window, the third waits
    for its turn. A drain (or a fenced generation) ends the third at once with its status: it
    waited for its turn first, until the close cut it without one (or, for the fence, until the
    stall grace reset it)."""
    limits = RelayLimits(stalled_stream_reset_s=120.0)
    view = MemRelayView(limits)
    server = RelayServer(view, limits)
    await server.start("127.0.0.1", 0)
    gens = [view.add_pool(f"turn-{i}", 1 << 17) for i in range(3)]
    c = await RawH2Client.connect(server.port)
    c._read_data = False  # default windows, never given back: the connection's runs out
    closing: asyncio.Future[None] | None = None
    expected: tuple[str, str | None]
    try:
        streams = []
        for g in gens:
            streams.append(c.open("SubscribeKvPool", bytes(sub_request(g.producer, "raw"))))
            await _eventually(lambda: server.service.pool_permits.in_use == len(streams))
        await _eventually(lambda: len(streams[0].data) > 0)
        waiting = streams[2]
        assert not waiting.ended.is_set() and not waiting.data
        if ending == "drain":
            closing = asyncio.ensure_future(server.close(grace_s=120.0))
            expected = ("0", None)
        else:
            gens[2].retire(RelayError.publication_unavailable("generation fenced"))
            expected = ("14", "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE")
        await asyncio.wait_for(waiting.ended.wait(), scaled(10))
        assert (waiting.status, waiting.reason) == expected, waiting.trailers
        assert not waiting.reset and not waiting.data
    finally:
        await c.close()  # the streams before it end with their connection
        if closing is not None:
            await asyncio.wait_for(closing, scaled(10))
        else:
            await server.close(grace_s=1.0)


async def _eventually(check: Any, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + scaled(timeout)
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)
