"""Snapshot chunks written as raw HTTP/2 DATA frames (``service/h2/bulk.py``), over real loopback.

The oracle is the producer's table: every client — grpclib (h2) and grpcio (the C core) — must
reassemble exactly it, whatever the windows and frame sizes its client advertises. The
connection's order is checked from the outside: on one connection the snapshots complete in the
order the streams asked for them, and a stream whose client stops reading does not hold up the
next one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
from grpclib.client import Channel
from grpclib.config import Configuration

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.publication import cbi1
from kvrelay.service.h2.bulk import _Lane, bulk_sender
from tests.support.h2_client import RawH2Client
from tests.support.mem_relay import (
    GrpcioClient,
    Replica,
    StartRelay,
    pool_call,
    sub_request,
)
from tests.support.timing import scaled

MIB = 1 << 20


def test_lane_order_skips_idle_and_keeps_the_first_place() -> None:
    lane = _Lane()
    a, b, c = lane.join(), lane.join(), lane.join()
    assert lane._writer() is None  # all idle: nobody wants to write
    lane.set_idle(c, False)
    lane.set_idle(b, False)
    assert lane._writer() is b  # b joined before c
    lane.set_idle(a, False)
    assert lane._writer() is a  # a joined first: it goes on before b as soon as it is ready
    lane.set_idle(a, True)  # its own window is empty
    assert lane._writer() is b
    lane.leave(b)
    assert lane._writer() is c
    lane.leave(b)  # idempotent
    lane.leave(c)
    lane.leave(a)
    assert lane._writer() is None


def test_no_bulk_sender_without_the_grpclib_internals() -> None:
    assert bulk_sender(object(), 8 * MIB) is None


async def _snapshot(st: object, replica: Replica) -> None:
    while replica.table is None:
        msg = await st.recv_message()  # type: ignore[attr-defined]
        assert msg is not None
        replica.feed(msg)


async def test_concurrent_snapshots_on_one_connection_exact_and_in_order(
    start_relay: StartRelay, grpcio_client: Callable[[int], GrpcioClient]
) -> None:
    view, server = await start_relay()
    gen = view.add_pool("pool-a", 1 << 20)  # two 4 MiB chunks per snapshot
    rng = np.random.default_rng(11)
    gen.random_step(rng, 50_000)
    # windows larger than the socket buffers: the socket, not flow control, paces the writes
    ch = Channel(
        "127.0.0.1",
        server.port,
        config=Configuration(
            http2_connection_window_size=64 * MIB, http2_stream_window_size=16 * MIB
        ),
    )
    gio = grpcio_client(server.port)
    done: list[int] = []
    replicas = [Replica(view.relay_identity, gen.producer) for _ in range(4)]
    try:
        async with contextlib_streams(ch, 4) as streams:
            for i, st in enumerate(streams):
                await st.send_message(sub_request(gen.producer, f"s{i}"), end=True)
            official = asyncio.ensure_future(
                gio.collect("SubscribeKvPool", sub_request(gen.producer, "gio"), limit=2)
            )

            chunks = [0] * 4
            at_first: list[int] = []

            async def read(i: int) -> None:
                r = replicas[i]
                while r.table is None:
                    msg = await streams[i].recv_message()
                    assert msg is not None
                    r.feed(msg)
                    chunks[i] += 1
                done.append(i)
                if i == 0:
                    at_first.extend(chunks)

            await asyncio.wait_for(asyncio.gather(*(read(i) for i in range(4))), scaled(30))
            res = await asyncio.wait_for(official, scaled(30))
            snap = gen.table.copy()
            gen.random_step(rng, 100)  # and the deltas after it
            for st, r in zip(streams, replicas, strict=True):
                r.feed(await st.recv_message())
                assert r.installed == gen.sequence
                await st.cancel()
    finally:
        ch.close()
    assert done == [0, 1, 2, 3]  # one after another, in the order they asked:
    assert at_first[0] == 2 and at_first[3] == 0  # the last had no chunk when the first was done
    for r in replicas:
        assert r.table is not None and r.table.tobytes() == gen.table.tobytes()
    assert res.status is None and len(res.messages) == 2
    words = np.zeros(1 << 20, dtype=np.uint64)
    for m in res.messages:  # grpcio reassembles the same bytes
        assert m.kind == pb.FilterUpdateKind.SNAPSHOT_CHUNK and m.sequence == 1
        chunk = cbi1.decode(m.payload, expected_seed=gen.seed, expected_bucket_count=1 << 20)
        assert isinstance(chunk, cbi1.SnapshotChunk)
        words[chunk.bucket_offset : chunk.bucket_offset + len(chunk.words)] = chunk.words
    assert words.tobytes() == snap.tobytes()


async def test_a_stalled_stream_steps_aside_for_the_next_on_its_connection(
    start_relay: StartRelay,
) -> None:
    """Stream A asks first and then reads nothing: once its own 1 MiB window is full, stream B
    on the same connection gets its whole snapshot; A still gets its own when it reads again."""
    view, server = await start_relay()
    gen = view.add_pool("pool-a", 1 << 19)  # one 4 MiB chunk
    gen.random_step(np.random.default_rng(12), 20_000)
    ch = Channel(
        "127.0.0.1",
        server.port,
        config=Configuration(
            http2_connection_window_size=32 * MIB, http2_stream_window_size=MIB
        ),
    )
    a, b = Replica(view.relay_identity, gen.producer), Replica(view.relay_identity, gen.producer)
    try:
        async with contextlib_streams(ch, 2) as (sa, sb):
            await sa.send_message(sub_request(gen.producer, "stalled"), end=True)
            await asyncio.sleep(0.3)  # A's snapshot is on its way and stuck at its window
            await sb.send_message(sub_request(gen.producer, "reader"), end=True)
            await asyncio.wait_for(_snapshot(sb, b), scaled(20))
            await asyncio.wait_for(_snapshot(sa, a), scaled(20))
            await sa.cancel()
            await sb.cancel()
    finally:
        ch.close()
    for r in (a, b):
        assert r.table is not None and r.table.tobytes() == gen.table.tobytes()


class contextlib_streams:
    """``n`` SubscribeKvPool streams on one channel, entered and exited together."""

    def __init__(self, ch: Channel, n: int) -> None:
        self._cms = [
            pool_call(ch)
            for _ in range(n)
        ]

    async def __aenter__(self) -> list:  # type: ignore[type-arg]
        return [await cm.__aenter__() for cm in self._cms]

    async def __aexit__(self, *exc: object) -> None:
        for cm in reversed(self._cms):
            await cm.__aexit__(None, None, None)


async def test_a_deadline_in_the_middle_of_a_chunk_resets_the_stream(
    start_relay: StartRelay,
) -> None:
    """The call's own deadline (``grpc-timeout``) fires while its 4 MiB chunk waits for a client
    that reads 64 KiB and stops: the chunk is cut short, so the stream is reset (RST_STREAM
    CANCEL) with no trailers after it. Trailers after a partial message read, to the client, as
    the rest of the message: a framing error instead of a status."""
    view, server = await start_relay()
    gen = view.add_pool("pool-a", 1 << 19)  # one 4 MiB chunk
    gen.random_step(np.random.default_rng(13), 20_000)
    client = await RawH2Client.connect(server.port, window=65_535)
    try:
        st = client.open(
            "SubscribeKvPool", bytes(sub_request(gen.producer, "slow")),
            headers=(("grpc-timeout", "800m"),),
        )  # fmt: skip
        await asyncio.wait_for(st.ended.wait(), scaled(10))
        assert 0 < len(st.data) < 4 * MIB, len(st.data)  # a message cut short
        assert st.reset and st.trailers == {}, (st.reset, st.trailers)
        assert (await _info(server.port)) is not None  # the connection and relay go on
    finally:
        await client.close()


async def _info(port: int) -> pb.RelayInfo:
    async with Channel("127.0.0.1", port) as ch:
        return await asyncio.wait_for(pb.KvEventRelayStub(ch).get_relay_info(
            pb.RelayInfoRequest(contract_marker=0x4B565231)), 10)  # fmt: skip
