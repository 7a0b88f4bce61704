"""The demo's embedded fleet: simulated vLLM engines on loopback and the relay settings for them.

Three pools show the three things a router cares about: an aggregated pool (2 engines × 2 DP
ranks, one engine serving a LoRA adapter), and a prefill/decode pair whose decode side needs
PREFILL (the readiness plane reports it READY only while both are live).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from kvrelay.sim.traffic import TrafficConfig

AGG_NAMESPACE = "demo"
PD_NAMESPACE = "demo-pd"
AGG_MODEL = "demo-llama-8b"
PD_MODEL = "demo-qwen-7b"
LORA_NAME = "demo-sql-lora"
#: Small filters keep snapshots tiny (4,096 buckets = 32 KiB) for a laptop demo.
EXPECTED_BLOCKS = 8192
STEPS_PER_SECOND = 25.0


@dataclass(frozen=True, slots=True)
class DemoPool:
    namespace: str
    component: str
    role: pb.WorkerRole
    engines: tuple[SimConfig, ...]
    needs: tuple[frozenset[pb.WorkerRole], ...] = ()


def _engine(name: str, seed: int, dp: int, model: str) -> SimConfig:
    return SimConfig(
        name=name,
        seed=seed,
        dp_size=dp,
        capacity_blocks=512,
        model_id=f"demo/{model}",
        served_model_name=model,
        aliases=(),
        bind_host="127.0.0.1",
        traffic=TrafficConfig(arrivals_per_step=0.8, lora_fraction=0.3),
    )


def demo_pools() -> tuple[DemoPool, ...]:
    return (
        DemoPool(
            AGG_NAMESPACE,
            "backend",
            pb.WorkerRole.AGGREGATED,
            (_engine("agg-0", 11, 2, AGG_MODEL), _engine("agg-1", 11, 2, AGG_MODEL)),
        ),
        DemoPool(
            PD_NAMESPACE, "prefill", pb.WorkerRole.PREFILL, (_engine("prefill-0", 21, 1, PD_MODEL),)
        ),
        DemoPool(
            PD_NAMESPACE,
            "decode",
            pb.WorkerRole.DECODE,
            (_engine("decode-0", 21, 1, PD_MODEL),),
            needs=(frozenset({pb.WorkerRole.PREFILL}),),
        ),
    )


@dataclass(slots=True)
class DemoFleet:
    """Starts the engines, loads the adapter, runs traffic; ``settings()`` describes it."""

    pools: tuple[DemoPool, ...] = field(default_factory=demo_pools)
    engines: dict[str, SimEngine] = field(default_factory=dict)
    _runs: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self) -> None:
        for p in self.pools:
            for cfg in p.engines:
                eng = SimEngine(cfg)
                self.engines[cfg.name] = eng
                await eng.start()
        self.engines["agg-0"].load_lora(LORA_NAME, f"/adapters/{LORA_NAME}")

    def hit_tokens(self) -> list[int]:
        """A prompt the aggregated pool holds under traffic: the first block of its engines'
        most popular system prompt (both engines share it: same traffic seed)."""
        eng = self.engines["agg-0"]
        return eng.schedulers[0].traffic.hot_prefix(eng.cfg.block_size)

    def run_traffic(self, rate: float = STEPS_PER_SECOND) -> None:
        for eng in self.engines.values():
            self._runs.append(eng.run(rate))

    async def stop(self) -> None:
        for eng in self.engines.values():
            await eng.stop()  # also stops its traffic task
        self._runs.clear()

    def settings(self, dc_name: str = "demo-dc") -> RelaySettings:
        specs = []
        for p in self.pools:
            engines = []
            for cfg in p.engines:
                eng = self.engines[cfg.name]
                assert eng.grpc_port is not None, "engines must be started first"
                engines.append(
                    EngineSpec(
                        name=cfg.name,
                        host=cfg.host_ip,
                        grpc_port=eng.grpc_port,
                        metrics_port=eng.metrics_port,
                    )
                )
            specs.append(
                PoolSpec(
                    namespace=p.namespace,
                    component=p.component,
                    endpoint="generate",
                    engines=tuple(engines),
                    role=p.role,
                    needs=p.needs,
                    expected_blocks=EXPECTED_BLOCKS,
                )
            )
        return RelaySettings(
            dc_name=dc_name,
            pools=tuple(specs),
            discovery_interval_s=0.5,
            discovery_timeout_s=1.0,
            metrics_scrape_interval_s=1.0,
        )
