"""What a pool keeps per source is bounded by the DP ranks its engines declare now: a
``vllm.Control`` server (a real grpclib server on loopback) that names other ranks at every
probe, some of them at endpoints ZMQ refuses, grew the pool's per-source totals, restart backoff
and members, and ``/metrics`` by one set of (†) series per rank it ever named."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpclib.const
import pytest
from grpclib.server import Server

from kvrelay._proto import vllm as vpb
from kvrelay.client.codec import RawCodec
from kvrelay.ops.metrics import RelayMetrics
from kvrelay.relay.connected import DEPARTED
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings
from kvrelay.sim.config import SimConfig
from tests.support.fleet import eventually, fleet_and_relay, in_sync, relay_view, wait_subscribed
from tests.support.timing import scaled

PER_PROBE = 6  # ranks named at each probe: as many refused by ZMQ, as many connectable
PROBES = 8


class _ChurningControl:
    """A Control whose every ``GetKvEventSources`` names rank 0 and ``2 * PER_PROBE`` ranks it
    never named before (the first ``PER_PROBE`` at an endpoint ZMQ refuses)."""

    def __init__(self) -> None:
        self.probes = 0

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        par = vpb.ParallelismInfo(data_parallel_size=1, data_parallel_size_local=1)
        info = bytes(vpb.ServerInfo(engine_version="x", instance_id="inc-1", kv_block_size=16,
                                    total_kv_blocks=1000, parallelism=par))  # fmt: skip
        model = bytes(vpb.ModelInfo(model_id="m", served_model_name="m"))

        def fixed(reply: bytes) -> Callable[[Any], Awaitable[None]]:
            async def handle(stream: Any) -> None:
                await stream.recv_message()
                await stream.send_message(reply)

            return handle

        async def sources(stream: Any) -> None:
            await stream.recv_message()
            first = 1 + self.probes * 2 * PER_PROBE
            self.probes += 1
            named = [vpb.KvEventSource(transport="zmq", endpoint="tcp://127.0.0.1:9",
                                       data_parallel_rank=0)]  # fmt: skip
            for i in range(2 * PER_PROBE):
                endpoint = "bogus://refused" if i < PER_PROBE else "tcp://127.0.0.1:9"
                named.append(vpb.KvEventSource(transport="zmq", endpoint=endpoint,
                                               data_parallel_rank=first + i))  # fmt: skip
            await stream.send_message(bytes(vpb.GetKvEventSourcesResponse(sources=named)))

        unary = grpclib.const.Cardinality.UNARY_UNARY
        out = {
            f"/vllm.Control/{name}": grpclib.const.Handler(fixed(reply), unary, bytes, bytes)
            for name, reply in (("GetServerInfo", info), ("GetModelInfo", model),
                                ("ListLoras", b""), ("IsSleeping", b""), ("IsPaused", b""))
        }  # fmt: skip
        out["/vllm.Control/GetKvEventSources"] = grpclib.const.Handler(
            sources, unary, bytes, bytes
        )
        return out


def _ranks_in_metrics(metrics: RelayMetrics) -> set[str]:
    return {
        line.split('dp_rank="', 1)[1].split('"', 1)[0]
        for line in metrics.render().decode().splitlines()
        if 'worker="e"' in line and 'dp_rank="' in line
    }


async def test_ranks_an_engine_stops_naming_keep_nothing_per_source() -> None:
    control = _ChurningControl()
    server = Server([control], codec=RawCodec())
    await server.start("127.0.0.1", 0)
    assert isinstance(server._server, asyncio.Server)
    port = int(server._server.sockets[0].getsockname()[1])
    spec = PoolSpec(
        namespace="ns", component="backend", endpoint="generate", expected_blocks=4096,
        engines=(EngineSpec(name="e", host="127.0.0.1", grpc_port=port),),
    )  # fmt: skip
    relay = Relay(RelaySettings(dc_name="dc-ranks", pools=(spec,), discovery_interval_s=0.02,
                                discovery_timeout_s=scaled(1.0)))  # fmt: skip
    await relay.start()
    metrics = RelayMetrics(relay)
    p = relay.pools[0]
    try:
        await eventually(lambda: control.probes >= PROBES, what=f"{PROBES} probes")
        async with p._reconcile_lock:  # the last probe's sources started (or failed)
            pass
        named_once = 1 + 2 * PER_PROBE  # what one probe names
        assert len(p._source_totals) <= 2 * named_once, len(p._source_totals)
        assert len(p._restarts) <= 2 * PER_PROBE, len(p._restarts)
        gen = p.generation
        assert gen is not None
        assert len(gen.pool.members()) <= 2 * named_once, len(gen.pool.members())
        assert len(_ranks_in_metrics(metrics)) <= 2 * named_once, _ranks_in_metrics(metrics)
        # the members failed sources left are removed, counted; what the sources of the ranks
        # no longer named counted is kept, in one sum
        assert p.counters.member_resets.get("rank_removed", 0) >= PER_PROBE
        assert sum(1 for s in p.stats().sources if s.engine == DEPARTED) == 1
    finally:
        await relay.stop()
        server.close()
        await server.wait_closed()


async def test_a_rank_control_stops_naming_or_moves_is_a_counted_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A live rank its engine's Control stops listing, and one it reports at another endpoint:
    each member's blocks were dropped with no count and no ``member_reset`` line. Each is now a
    reset (``rank_removed``, ``source_changed``), and the moved rank is exact again."""
    from kvrelay.sim import control as sim_control

    real = sim_control.event_sources
    async with fleet_and_relay([SimConfig(name="r0", seed=9, dp_size=2)]) as (engines, relay, _s):
        (eng,) = engines
        await wait_subscribed(relay, 2)
        await eng.step(10)
        await eventually(lambda: in_sync(engines, relay), what="in sync")
        p = relay.pools[0]

        def without_rank_1(e: Any) -> vpb.GetKvEventSourcesResponse:
            reply = real(e)
            return vpb.GetKvEventSourcesResponse(
                sources=[s for s in reply.sources if s.data_parallel_rank != 1]
            )

        monkeypatch.setattr(sim_control, "event_sources", without_rank_1)
        await eventually(lambda: p.counters.member_resets.get("rank_removed") == 1,
                         what="rank 1 removed, counted")  # fmt: skip
        gen = p.generation
        assert gen is not None and sorted(r for _w, r in gen.pool.members().values()) == [0]

        def moved(e: Any) -> vpb.GetKvEventSourcesResponse:
            reply = without_rank_1(e)
            for s in reply.sources:  # the same publisher, spelled as another endpoint
                s.endpoint = s.endpoint.replace("127.0.0.1", "localhost")
            return reply

        monkeypatch.setattr(sim_control, "event_sources", moved)
        await eventually(lambda: p.counters.member_resets.get("source_changed") == 1,
                         what="rank 0 moved, counted")  # fmt: skip
        await eng.step(5)
        truth = eng.ground_truth(0)
        await eventually(lambda: relay_view(relay).get(("r0", 0)) == truth, what="exact again")


async def test_a_source_that_never_reaches_its_publisher_is_not_shown_live(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Control reports a publisher nothing listens on: the source is past its (failed) replay
    and was shown ``live`` on ``kvrelay_ingest_sources``, however long it had no connection.
    It shows ``disconnected`` until it connects; the rank whose publisher is there stays live."""
    from kvrelay.sim import control as sim_control

    real = sim_control.event_sources

    def rank_1_nowhere(e: Any) -> vpb.GetKvEventSourcesResponse:
        reply = real(e)
        for s in reply.sources:
            if s.data_parallel_rank == 1:
                s.endpoint, s.replay_endpoint = "tcp://127.0.0.1:9", ""
        return reply

    monkeypatch.setattr(sim_control, "event_sources", rank_1_nowhere)
    async with fleet_and_relay([SimConfig(name="n0", seed=9, dp_size=2)]) as (_e, relay, _s):
        p = relay.pools[0]
        await eventually(lambda: len(p.subscribers) == 2
                         and all(s.state == "live" for s in p.subscribers.values()),
                         what="both past their bootstrap")  # fmt: skip
        await eventually(lambda: {s.dp_rank: s.state for s in p.stats().sources}
                         == {0: "live", 1: "disconnected"},
                         what="rank 1 shown disconnected")  # fmt: skip
        page = RelayMetrics(relay).render().decode()
        assert 'kvrelay_ingest_sources{pool="ns/backend/generate",state="disconnected"} 1.0' in page
        assert 'kvrelay_ingest_sources{pool="ns/backend/generate",state="live"} 1.0' in page
