"""Rigs for connect mode: a relay whose pool binds one SUB, sim engines whose PUB connects."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from kvrelay.ingest.kinds import EngineKind
from kvrelay.relay.settings import ConnectConfig, PoolSpec, RelaySettings
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from kvrelay.sim.ports import free_port_block
from tests.support.fleet import ENGINE_DOWN_GRACE_S, eventually
from tests.support.rig import Rig, start_relay, stop_relay
from tests.support.timing import scaled

MODEL = "sim-model"
PATTERN = "kv@{engine}@{model}"


@dataclasses.dataclass
class ConnectRig:
    rig: Rig
    bind: str
    flavor: str

    def engine(self, name: str, seed: int, **kw: Any) -> SimEngine:
        """An engine (not started) whose PUB connects to the pool, topic ``kv@name@model``."""
        cfg = SimConfig(
            name=name, seed=seed, flavor=self.flavor, grpc_port=None, metrics_port=None,
            replay_port=None, capacity_blocks=kw.pop("capacity_blocks", 128),
            topic=kw.pop("topic", f"kv@{name}@{MODEL}"), pub_connect=self.bind, **kw,
        )  # fmt: skip
        eng = SimEngine(cfg)
        self.rig.engines.append(eng)  # the rig stops it
        return eng

    async def join(self, eng: SimEngine) -> None:
        """Start ``eng`` and wait until the relay's bound SUB has subscribed it."""
        await eng.start()
        await eng.wait_subscribed()


@contextlib.asynccontextmanager
async def connect_rig(
    flavor: str = "vllm", *, silence_s: float = 600.0, max_members: int = 1024,
    allow: tuple[str, ...] = (), **pool: Any,
) -> AsyncIterator[ConnectRig]:  # fmt: skip
    bind = f"tcp://127.0.0.1:{free_port_block(1, host='127.0.0.1')}"
    spec = PoolSpec(
        namespace="ns", component="backend", endpoint="generate", engines=(),
        expected_blocks=8192, model=MODEL, kv_block_size=16,
        connect=ConnectConfig(
            bind=(bind,), topic_pattern=PATTERN, kind=EngineKind(flavor),
            max_members=max_members, member_silence_s=silence_s, allow=allow,
        ),
    )  # fmt: skip
    spec = dataclasses.replace(spec, **pool)
    settings = RelaySettings(
        dc_name="dc-connect", pools=(spec,), discovery_interval_s=0.1,
        discovery_timeout_s=scaled(0.5), engine_down_grace_s=ENGINE_DOWN_GRACE_S,
    )  # fmt: skip
    relay, server = await start_relay(settings)
    r = Rig([], relay, server, settings)
    try:
        pool = relay.pools[0]
        await eventually(
            lambda: pool.connected is not None and pool.connected.source is not None,
            what="connect endpoint up",
        )
        yield ConnectRig(r, bind, flavor)
    finally:
        await server.close(grace_s=1.0)
        await stop_relay(relay)
        for e in r.engines:
            await e.stop()
