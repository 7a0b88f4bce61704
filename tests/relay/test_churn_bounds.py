"""What a relay keeps per engine must leave with the engine: a fleet whose engines come back
under new names (pods rescheduled to new addresses, found by DNS) would otherwise grow the
pool's per-source totals, restart backoff and ``/metrics`` series for as long as it runs."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from kvrelay.ingest.sink import SourceKey
from kvrelay.ops.metrics import RelayMetrics
from kvrelay.relay.connected import DEPARTED
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.fleet import eventually
from tests.support.timing import scaled


def _series(metrics: RelayMetrics) -> int:
    text = metrics.render().decode()
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


async def test_engines_that_leave_keep_nothing_per_source() -> None:
    base = SimEngine(SimConfig(name="base", seed=1, capacity_blocks=64))
    await base.start()
    spec = PoolSpec(
        namespace="ns", component="backend", endpoint="generate", expected_blocks=4096,
        engines=(EngineSpec(name="base", host="127.0.0.1", grpc_port=base.grpc_port),),
    )  # fmt: skip
    relay = Relay(RelaySettings(
        dc_name="dc-churn", pools=(spec,), discovery_interval_s=0.05,
        discovery_timeout_s=scaled(0.5), engine_down_grace_s=0.6,
    ))  # fmt: skip
    await relay.start()
    metrics = RelayMetrics(relay)
    p = relay.pools[0]

    def live(n: int) -> bool:
        return sum(1 for s in p.subscribers.values() if s.state == "live") == n

    series: list[int] = []
    delivered = 0
    try:
        await eventually(lambda: live(1), what="the base engine live")
        for i in range(3):
            eng = SimEngine(SimConfig(name=f"pod-{i}", seed=10 + i, dp_size=2, capacity_blocks=64))
            await eng.start()
            name = f"vllm@10.0.0.{i}"  # a new address each time: a new engine name
            try:
                await relay.add_engine(p.name, EngineSpec(name=name, host="127.0.0.1",
                                                          grpc_port=eng.grpc_port))  # fmt: skip
                await eventually(lambda: live(3), what=f"{name}'s two ranks live")
                eng.run(200.0)
                st = p.engines[p.target_of(name) or ""]
                mine = [s for k, s in p.subscribers.items() if k.worker_id == st.worker_id]
                await eventually(lambda m=mine: all(s.counters.messages > 0 for s in m),
                                 what=f"{name} delivering")  # fmt: skip
                await eng.stop_running()
                p._restarts[SourceKey(st.worker_id, 1)] = (1, 0.0)  # a backoff it still had
                await relay.remove_engine(p.name, name)
                delivered += sum(s.counters.messages for s in mine)
            finally:
                await eng.stop()
            series.append(_series(metrics))
        base_id = next(iter(p.engines.values())).worker_id
        assert {k.worker_id for k in p._source_totals} <= {base_id}
        assert all(k.worker_id == base_id for k in p._restarts)
        sources = p.stats().sources
        departed = [s for s in sources if s.engine == DEPARTED]
        assert len(departed) == 1 and departed[0].counters.messages >= delivered > 0
        assert {s.engine for s in sources} == {"base", DEPARTED}
        # the series stop growing once the first engine has left (one departed sum per pool)
        assert series[1] == series[0] and series[2] == series[0], series
    finally:
        await relay.stop()
        await base.stop()


def _pool(endpoint: str, engine: SimEngine) -> PoolSpec:
    return PoolSpec(
        namespace="ns", component="backend", endpoint=endpoint, expected_blocks=4096,
        engines=(EngineSpec(name=engine.cfg.name, host="127.0.0.1", grpc_port=engine.grpc_port),),
    )  # fmt: skip


async def test_pools_a_reload_removes_keep_no_records(tmp_path: Path) -> None:
    """Each pool a reload removed kept its last scrub and checkpoint (and their gauges), and
    its delta-latency histogram (18 series)."""
    base = SimEngine(SimConfig(name="base", seed=1, capacity_blocks=64))
    await base.start()
    settings = RelaySettings(
        dc_name="dc-churn", pools=(_pool("base", base),), discovery_interval_s=0.05,
        discovery_timeout_s=scaled(0.5), engine_down_grace_s=0.6, state_dir=str(tmp_path),
        checkpoint_interval_s=0.1, scrub_interval_s=0.1,
    )  # fmt: skip
    relay = Relay(settings)
    metrics = RelayMetrics(relay)
    await relay.start()

    def latency_of(name: str) -> bool:
        return f'kvrelay_delta_latency_seconds_count{{pool="{name}"}}' in metrics.render().decode()

    try:
        for i in range(2):
            eng = SimEngine(SimConfig(name=f"eng-{i}", seed=10 + i, capacity_blocks=64))
            await eng.start()
            try:
                await relay.reconfigure(dataclasses.replace(
                    settings, pools=(_pool("base", base), _pool(f"gone-{i}", eng))))  # fmt: skip
                name = f"ns/backend/gone-{i}"
                await eventually(lambda n=name: n in relay.scrubber.last
                                 and n in relay.checkpoints.last_unix,
                                 what=f"{name} scrubbed and checkpointed")  # fmt: skip
                await eng.step(2)
                await eventually(lambda n=name: latency_of(n), what=f"{name} published")
                await relay.reconfigure(settings)
                assert not latency_of(name)
            finally:
                await eng.stop()

            def forgotten() -> bool:
                # a scrub pass or checkpoint of the pool still under way at its removal may note
                # it once more as it ends: the next tick (every 0.1 s here) forgets it again
                stats = relay.stats()
                return (set(stats.scrub_last) <= {"ns/backend/base"}
                        and set(stats.checkpoint_unix) <= {"ns/backend/base"})  # fmt: skip

            await eventually(forgotten, what=f"{name}'s records forgotten")
        await asyncio.sleep(0.3)  # a few ticks: nothing stays (what a late pass notes goes)
        await eventually(lambda: set(relay.scrubber.last) <= {"ns/backend/base"}
                         and set(relay.checkpoints.last_unix) <= {"ns/backend/base"},
                         what="the removed pools' records gone for good")  # fmt: skip
        assert not any(latency_of(f"ns/backend/gone-{i}") for i in range(2))
    finally:
        await relay.stop()
        await base.stop()
