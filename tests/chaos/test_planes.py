"""Chaos, publication side: load windows never claim what they don't know, a shard with more
pools than hub permits keeps serving, snapshot stamps are fresh, and the catalog withdrawal is
visible before a generation's streams end."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpclib.const
from grpclib.client import Channel

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from kvrelay.contract.wire import CONTRACT_MARKER
from kvrelay.relay.settings import EngineSpec, PoolSpec
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.fleet import engine_spec, eventually, fleet_and_relay, metered_pool
from tests.support.rig import SVC, collect_end, rig, subscribe, wait_live
from tests.support.timing import scaled


def _entry(relay: Any) -> pb.KvPoolLoadEntry | None:
    pools = relay.load.current()[1].pools
    return pools[0] if pools else None


async def test_expected_ranks_are_declared_reachable_or_not_until_the_engine_is_down() -> None:
    """An unreachable engine's ranks stay expected, their usage unknown (never zero), until it is
    declared down (``engine_down_grace_s``, its members cleared): then it has departed, as a
    worker leaving Dynamo's discovery has, and the load of the engines serving is whole again
    (it was partial for as long as the engine stayed down)."""
    cfgs = [SimConfig(name="ld0", seed=71, dp_size=2), SimConfig(name="ld1", seed=72, dp_size=2)]
    async with fleet_and_relay(cfgs, pools=metered_pool, scrape_interval_s=0.25,
                               limits=RelayLimits(load_window_s=0.25)) as (engines, relay, _):
        pool = relay.pools[0]

        def ranks(expected: int, observed: int) -> bool:
            e = _entry(relay)
            return e is not None and (e.kv_expected_ranks, e.kv_observed_ranks) == (
                expected, observed)  # fmt: skip

        await eventually(lambda: ranks(4, 4), what="4 of 4 ranks")
        grace = pool.engine_down_grace_s
        pool.engine_down_grace_s = 3600.0  # unreachable, not down yet
        await engines[1].stop()
        await eventually(lambda: ranks(4, 2), what="2 of 4 ranks unknown")
        pool.engine_down_grace_s = grace
        await eventually(lambda: pool.counters.engines_down == 1, what="engine down")
        await eventually(lambda: ranks(2, 2), what="the engine serving: 2 of 2 ranks")


class _Page:
    """A /metrics server whose body the test controls (malformed on purpose, then fixed)."""

    def __init__(self) -> None:
        self.body = b"0\r\n\r\n"
        self.raw = True
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        if self.raw:  # a chunked body whose chunk size is not hex: ValueError in a naive parser
            w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nnope\r\n0\r\n\r\n")
        else:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(self.body) + self.body)
        await w.drain()
        w.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


async def test_malformed_metrics_page_is_unknown_and_the_scraper_survives() -> None:
    page = _Page()
    port = await page.start()
    eng = SimEngine(SimConfig(name="sc0", seed=73, metrics_port=None))
    await eng.start()
    try:
        def pools(engines: list[SimEngine]) -> tuple[PoolSpec, ...]:
            spec = engine_spec(engines[0])
            return (PoolSpec(namespace="ns", component="backend", endpoint="generate",
                             engines=(EngineSpec(name=spec.name, host=spec.host,
                                                 grpc_port=spec.grpc_port, metrics_port=port),)),
                    )  # fmt: skip

        async with fleet_and_relay([], pools=lambda _e: pools([eng])) as (_e, relay, _s):
            await eventually(lambda: _entry(relay) is not None, what="load entry")
            await asyncio.sleep(1.5)  # a few scrapes of the malformed page
            e = _entry(relay)
            assert e is not None and e.kv_observed_ranks == 0 and e.kv_used_blocks == 0
            # counted as a page that is not one (not only seen as an unknown load)
            assert relay.stats().scrape_failures.get("malformed", 0) >= 1
            assert relay.scrape_errors == 0  # no unexpected exception
            page.raw = False  # the page recovers: the same scraper task reads it
            page.body = b'vllm:kv_cache_usage_perc{engine="0",model_name="sim-model"} 0.5\n'
            await eventually(lambda: (x := _entry(relay)) is not None and x.kv_observed_ranks == 1,
                             timeout=10, what="usage observed")  # fmt: skip
    finally:
        await eng.stop()
        await page.close()


async def test_more_pools_than_hub_permits_keep_serving() -> None:
    cfgs = [SimConfig(name=f"hp{i}", seed=80 + i, capacity_blocks=64) for i in range(3)]

    def pools(engines: list[SimEngine]) -> tuple[PoolSpec, ...]:
        return tuple(
            PoolSpec(namespace="ns", component=f"c{i}", endpoint="generate",
                     engines=(engine_spec(e),), expected_blocks=1024)
            for i, e in enumerate(engines)
        )  # fmt: skip

    limits = RelayLimits(max_initialized_pool_hubs=2)
    async with fleet_and_relay(cfgs, pools=pools, limits=limits) as (_e, relay, server):
        await eventually(lambda: len(relay.catalog.current()[1].snapshot.pools) == 3, what="3")
        producers = [d.producer for d in relay.catalog.current()[1].snapshot.pools]
        async with Channel("127.0.0.1", server.port) as ch:
            for round_ in range(2):
                for prod in producers:  # each subscribes, reads its snapshot, leaves
                    frames = await _snapshot_frames(ch, prod)
                    assert frames, f"round {round_}: no snapshot for a pool"
        assert relay.hubs_evicted >= 4  # 6 subscriptions over 3 pools through 2 permits
        assert relay.hub_permits.in_use <= 2


async def _snapshot_frames(ch: Channel, producer: pb.ProducerIdentity) -> list[pb.FilterUpdate]:
    req = pb.SubscribeKvPoolRequest(
        subscriber_id="hop", expected_producer=producer, contract_marker=CONTRACT_MARKER
    )
    out: list[pb.FilterUpdate] = []
    async with ch.request(SVC + "SubscribeKvPool", grpclib.const.Cardinality.UNARY_STREAM,
                          pb.SubscribeKvPoolRequest, pb.FilterUpdate) as st:  # fmt: skip
        await st.send_message(req, end=True)
        fu = await asyncio.wait_for(st.recv_message(), scaled(10))
        assert fu is not None and fu.kind == pb.FilterUpdateKind.SNAPSHOT_CHUNK
        out.append(fu)
        await st.cancel()
    await asyncio.sleep(0.05)  # the handler notices the cancel and releases the subscription
    return out


async def test_a_shared_snapshot_is_stamped_when_sent() -> None:
    cfg = SimConfig(name="ts0", seed=74, capacity_blocks=64)
    async with rig([cfg]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        first = await subscribe(r, ch, "first")  # cuts the snapshot at the idle sequence
        await asyncio.sleep(1.2)
        producer = first.producer
        hub = r.pool.generation.hub()
        seq = hub.sequence
        before_us = time.time_ns() // 1000
        frames = await _snapshot_frames(ch, producer)
        assert hub.sequence == seq and hub.snapshots_built == 1  # the same cut was shared
        assert frames[0].send_ts_us >= before_us
        await first.stop()


async def test_catalog_withdrawal_is_seen_before_the_stream_ends() -> None:
    cfg = SimConfig(name="wd0", seed=75, capacity_blocks=64)
    async with rig([cfg]) as r, r.channel() as ch:
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        order: list[str] = []
        req = pb.WatchKvPoolCatalogRequest(subscriber_id="cat", contract_marker=CONTRACT_MARKER)

        async def watch() -> None:
            async with ch.request(SVC + "WatchKvPoolCatalog",
                                  grpclib.const.Cardinality.UNARY_STREAM,
                                  pb.WatchKvPoolCatalogRequest, pb.KvPoolCatalogUpdate) as st:
                await st.send_message(req, end=True)
                while True:
                    upd = await st.recv_message()
                    if upd is None:
                        return
                    if upd.snapshot is not None and not upd.snapshot.pools:
                        order.append("catalog_without_pool")
                        await st.cancel()
                        return

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0.2)
        gen = r.pool.generation
        assert gen is not None

        async def stream_end() -> None:
            await consumer.wait_end()
            order.append("stream_ended")

        ended = asyncio.create_task(stream_end())
        r.pool.fence(gen, "injected")
        done, _pending = await asyncio.wait({watcher, ended}, timeout=10)
        assert len(done) == 2, (order, watcher.done(), ended.done(), consumer.end)
        assert order == ["catalog_without_pool", "stream_ended"]
        _msgs, end = await collect_end(ch, "SubscribeKvPool", pb.SubscribeKvPoolRequest(
            subscriber_id="late", expected_producer=consumer.producer,
            contract_marker=CONTRACT_MARKER), pb.FilterUpdate)  # fmt: skip
        assert end.reason in ("RELAY_ERROR_REASON_POOL_NOT_FOUND",
                              "RELAY_ERROR_REASON_PRODUCER_CHANGED")  # fmt: skip


async def test_capacity_is_per_rank_not_the_frontends_sum() -> None:
    """vLLM's ``ServerInfo.total_kv_blocks`` is the frontend's sum over its DP engine cores: a
    DP-2 engine of 64 blocks per rank is 128 blocks in all, not 256."""
    cfg = SimConfig(name="cap0", seed=76, dp_size=2, capacity_blocks=64)
    async with rig([cfg]) as r:
        await wait_live(r.relay, 2)
        await eventually(
            lambda: (e := _entry(r.relay)) is not None and e.total_kv_blocks > 0,
            what="a capacity for both ranks",
        )
        e = _entry(r.relay)
        assert e is not None and e.kv_expected_ranks == 2 and e.total_kv_blocks == 2 * 64
