"""Rigs over simulated SGLang engines (static sources: SGLang has no ``vllm.Control``)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from kvrelay.discovery.endpoints import StaticSourceConfig
from kvrelay.ingest.kinds import EngineKind
from kvrelay.ingest.options import DecodeOptions
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from kvrelay.sim.ports import free_port_block
from tests.support.fleet import ENGINE_DOWN_GRACE_S
from tests.support.rig import Rig, start_relay, stop_relay
from tests.support.timing import scaled


def sglang_config(name: str, seed: int, **kw: Any) -> SimConfig:
    """An SGLang engine on fixed ports (``dp_size`` consecutive PUB and ROUTER ports, as
    SGLang offsets them), bound on loopback so a restart rebinds the same ports."""
    dp = kw.get("dp_size", 1)
    replay = kw.pop("replay", True)
    base = free_port_block(2 * dp + 2, host="127.0.0.1")
    defaults: dict[str, Any] = {
        "name": name, "seed": seed, "flavor": "sglang", "capacity_blocks": 128,
        "grpc_port": None, "metrics_port": None, "bind_host": "127.0.0.1",
        "pub_port": base, "replay_port": base + dp + 1 if replay else None,
    }  # fmt: skip
    defaults.update(kw)
    return SimConfig(**defaults)


def sglang_spec(cfg: SimConfig) -> EngineSpec:
    """The engine entry an operator writes for it (``kind = "sglang"`` + static sources)."""
    return EngineSpec(
        name=cfg.name,
        kind=EngineKind.SGLANG,
        static=StaticSourceConfig(
            endpoint=f"tcp://127.0.0.1:{cfg.pub_port}",
            replay_endpoint=None if cfg.replay_port is None else
            f"tcp://127.0.0.1:{cfg.replay_port}",
            dp_ranks=tuple(range(cfg.dp_size)),
            topic=cfg.topic,
        ),
    )  # fmt: skip


@contextlib.asynccontextmanager
async def sglang_rig(
    configs: list[SimConfig], *, decode: DecodeOptions | None = None, **pool: Any
) -> AsyncIterator[Rig]:
    """Engines started first, then a relay with one pool of them as SGLang static engines."""
    engines = [SimEngine(c) for c in configs]
    for e in engines:
        await e.start()
    spec = PoolSpec(
        namespace="ns", component="backend", endpoint="generate",
        engines=tuple(sglang_spec(c) for c in configs), expected_blocks=8192,
        model="sim-model", kv_block_size=configs[0].block_size,
        decode=decode or DecodeOptions(),
    )  # fmt: skip
    spec = dataclasses.replace(spec, **pool)
    settings = RelaySettings(
        dc_name="dc-sgl", pools=(spec,), discovery_interval_s=0.1,
        discovery_timeout_s=scaled(0.5),
        engine_down_grace_s=ENGINE_DOWN_GRACE_S,
    )  # fmt: skip
    relay, server = await start_relay(settings)
    r = Rig(engines, relay, server, settings)
    try:
        yield r
    finally:
        await server.close(grace_s=1.0)
        await stop_relay(relay)
        for e in engines:
            await e.stop()
