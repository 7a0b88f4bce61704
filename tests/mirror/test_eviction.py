"""More listed pools than a mirror may hold (``max_initialized_pool_hubs``): every one stays
servable, through a mirror over TCP and over a UNIX socket (as a fan-out worker of a
``workers = N`` daemon reads its ingest process), as a relay serves them by retiring idle hubs.

Oracle: the upstream's authoritative tables (``MemRelayView``); each snapshot read through the
mirror is checked by the consumer rules (``Replica``) and compared with the upstream's table.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from typing import Any

import numpy as np
import pytest
from grpclib.const import Cardinality, Status

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from kvrelay.mirror.settings import UpstreamAddress
from kvrelay.service.server import RelayServer
from tests.support.mem_relay import (
    SVC,
    Generation,
    MemRelayView,
    Replica,
    grpclib_channel,
    grpclib_collect,
    sub_request,
)
from tests.support.mirror_rig import QUIET_WINDOW_MS, close_served, mirrored
from tests.support.rig import eventually

POOLS = 70  # > the default 64 pools a mirror holds at once
BUCKETS = 1024
K = "kv-relay-error-reason"


async def _upstream(mode: str, cleanup: list[Any]) -> tuple[MemRelayView, UpstreamAddress]:
    # the upstream holds a hub for every pool (it is not what is under test)
    limits = RelayLimits(max_initialized_pool_hubs=4 * POOLS, max_pool_streams_total=4 * POOLS)
    view = MemRelayView(limits, window_ms=QUIET_WINDOW_MS)
    server = RelayServer(view, limits)
    cleanup.append(server)
    if mode == "workers":
        folder = tempfile.mkdtemp(prefix="kvrelay-test-")
        cleanup.append(lambda: shutil.rmtree(folder, ignore_errors=True))
        path = os.path.join(folder, "ingest.sock")
        await server.start_unix(path)
        return view, UpstreamAddress(path=path)
    await server.start("127.0.0.1", 0)
    return view, UpstreamAddress(host="127.0.0.1", port=server.port)


async def _snapshot(ch: Any, gen: Generation, relay: pb.RelayIdentity) -> Replica:
    """Subscribe, install the snapshot under the consumer rules, leave."""
    replica = Replica(relay, gen.producer)
    async with asyncio.timeout(20):
        async with ch.request(SVC + "SubscribeKvPool", Cardinality.UNARY_STREAM,
                              pb.SubscribeKvPoolRequest, pb.FilterUpdate) as st:  # fmt: skip
            await st.send_message(sub_request(gen.producer, "evict"), end=True)
            while replica.table is None:
                fu = await st.recv_message()
                assert fu is not None, "stream ended before its snapshot"
                replica.feed(fu)
            await st.cancel()
    return replica


@pytest.mark.parametrize("mode", ["mirror", "workers"])
async def test_every_listed_pool_is_served_beyond_the_hub_limit(mode: str) -> None:
    cleanup: list[Any] = []
    try:
        view, address = await _upstream(mode, cleanup)
        rng = np.random.default_rng(24)
        gens = [view.add_pool(f"pool-{i:03d}", BUCKETS) for i in range(POOLS)]
        for g in gens:
            g.random_step(rng, 16)
        limits = RelayLimits()
        assert limits.max_initialized_pool_hubs < POOLS
        async with mirrored(address, limits=limits, sync=False) as m:
            await asyncio.wait_for(m.mirror.synced.wait(), 30)
            assert m.mirror.stats()["pools_over_limit"] == POOLS - limits.max_initialized_pool_hubs
            ch = grpclib_channel(m.port)
            try:
                # one router keeps reading the first pool all along: it is in use, never evicted
                kept = await _hold(ch, gens[0])
                kept_hub = m.mirror.hub_for(gens[0].producer)
                assert kept_hub is not None
                for rounds in range(2):
                    for i, gen in enumerate(gens[1:], start=1):
                        gen.random_step(rng, 8)
                        await eventually(lambda g=gen: (h := m.mirror.hub_for(g.producer)) is None
                                         or h.sequence == g.sequence,
                                         what="mirrored pool caught up")  # fmt: skip
                        replica = await _snapshot(ch, gen, view.relay_identity)
                        assert replica.table is not None and replica.installed is not None
                        assert replica.installed == gen.sequence, (rounds, i)
                        assert np.array_equal(replica.table, gen.table), (rounds, i)
                        held = [p for p in m.mirror.stats()["pools"].values()
                                if p["state"] != "gone"]  # fmt: skip
                        assert len(held) <= limits.max_initialized_pool_hubs
                gens[0].random_step(rng, 8)
                await eventually(lambda: kept.installed == gens[0].sequence,
                                 what="the held pool kept its stream")  # fmt: skip
                assert m.mirror.hub_for(gens[0].producer) is kept_hub
                assert np.array_equal(kept.table, gens[0].table)
                assert m.mirror.pools_evicted >= POOLS - limits.max_initialized_pool_hubs
                await _drop(kept)
            finally:
                ch.close()
    finally:
        await close_served(cleanup)


class _Held(Replica):
    stream_task: asyncio.Task[None]


async def _hold(ch: Any, gen: Generation) -> _Held:
    """A subscriber that keeps reading ``gen`` (its replica follows every delta)."""
    replica = _Held(gen.view.relay_identity, gen.producer)

    async def run() -> None:
        async with ch.request(SVC + "SubscribeKvPool", Cardinality.UNARY_STREAM,
                              pb.SubscribeKvPoolRequest, pb.FilterUpdate) as st:  # fmt: skip
            await st.send_message(sub_request(gen.producer, "held"), end=True)
            while (fu := await st.recv_message()) is not None:
                replica.feed(fu)

    replica.stream_task = asyncio.ensure_future(run())
    await eventually(lambda: replica.table is not None, what="held snapshot")
    return replica


async def _drop(held: _Held) -> None:
    held.stream_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await held.stream_task


async def test_resource_limit_only_when_every_mirrored_pool_is_in_use() -> None:
    """Two pools held by readers, a hub limit of 2: the third gets RESOURCE_LIMIT (as from a
    relay whose hubs are all in use); once a reader leaves, the third is served."""
    cleanup: list[Any] = []
    try:
        view, address = await _upstream("mirror", cleanup)
        gens = [view.add_pool(f"busy-{i}", BUCKETS) for i in range(3)]
        limits = RelayLimits(max_initialized_pool_hubs=2)
        async with mirrored(address, limits=limits, sync=False) as m:
            await asyncio.wait_for(m.mirror.synced.wait(), 30)
            ch = grpclib_channel(m.port)
            try:
                a, b = await _hold(ch, gens[0]), await _hold(ch, gens[1])
                r = await grpclib_collect(ch, "SubscribeKvPool", sub_request(gens[2].producer),
                                          pb.FilterUpdate)  # fmt: skip
                assert (r.status, r.trailers[K]) == (Status.RESOURCE_EXHAUSTED,
                                                     "RELAY_ERROR_REASON_RESOURCE_LIMIT")
                assert m.mirror.pools_evicted == 0
                await _drop(a)
                await eventually(lambda: (h := m.mirror.hub_for(gens[0].producer)) is not None
                                 and h.subscriber_count == 0, what="reader gone")  # fmt: skip
                third = await _snapshot(ch, gens[2], view.relay_identity)
                assert np.array_equal(third.table, gens[2].table)
                assert m.mirror.pools_evicted == 1 and m.mirror.hub_for(gens[0].producer) is None
                assert m.mirror.hub_for(gens[1].producer) is not None, "the busy one stays"
                await _drop(b)
            finally:
                ch.close()
    finally:
        await close_served(cleanup)
