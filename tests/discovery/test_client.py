"""EngineClient against the simulator's Control server over loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from kvrelay.discovery import (
    DiscoveryTimeout,
    EngineClient,
    EngineUnreachable,
    KvSourcesUnsupported,
    StaticSourceConfig,
)
from kvrelay.sim import SimConfig, SimEngine
from kvrelay.sim.ports import free_port_block


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    base = free_port_block(4)
    eng = SimEngine(
        SimConfig(
            dp_size=2,
            pub_port=base,
            replay_port=base + 2,
            topic="kv",
            capacity_blocks=300,
            block_size=16,
        )
    )
    await eng.start()
    yield eng
    await eng.stop()


async def test_all_rpcs_and_wildcard_substitution(engine: SimEngine) -> None:
    base = engine.cfg.pub_port
    engine.load_lora("ad-1")
    async with EngineClient("127.0.0.1", engine.grpc_port or 0) as c:
        info = await c.server_info()
        assert info.instance_id == engine.instance_id and info.total_kv_blocks == 600
        assert (await c.model_info()).served_model_name == "sim-model"
        assert [lo.name for lo in await c.list_loras()] == ["ad-1"]
        assert not await c.is_sleeping() and not await c.is_paused()
        sources, via = await c.kv_event_sources()
        assert via == "control"
        assert [s.endpoint for s in sources] == [f"tcp://127.0.0.1:{base + r}" for r in (0, 1)]
        assert [s.replay_endpoint for s in sources] == [
            f"tcp://127.0.0.1:{base + 2 + r}" for r in (0, 1)
        ]
        assert [s.advertised_endpoint for s in sources] == [f"tcp://*:{base + r}" for r in (0, 1)]
        assert [s.dp_rank for s in sources] == [0, 1] and sources[0].topic == "kv"
        snap = await c.snapshot()
    assert snap.reachable and snap.sources == sources and snap.sources_via == "control"
    assert (snap.data_parallel_size, snap.kv_block_size, snap.model_id) == (2, 16, "sim/model-7b")
    assert snap.lora_names == {"ad-1"} and snap.served_model_aliases == ("sim-model-alias",)
    engine.sleep()
    engine.pause()
    async with EngineClient("127.0.0.1", engine.grpc_port or 0) as c:
        snap2 = await c.snapshot()
    assert snap2.sleeping and snap2.paused


async def test_kv_transfer_fallback() -> None:
    eng = SimEngine(SimConfig(kv_transfer_only=True, dp_size=2))
    await eng.start()
    try:
        async with EngineClient("127.0.0.1", eng.grpc_port or 0) as c:
            sources, via = await c.kv_event_sources()
        assert via == "kv_transfer"
        assert [s.endpoint for s in sources] == [p.endpoint for p in eng.publishers]
    finally:
        await eng.stop()


async def test_unsupported_sources_use_static_config() -> None:
    eng = SimEngine(SimConfig(kv_sources_unimplemented=True))
    await eng.start()
    try:
        async with EngineClient("127.0.0.1", eng.grpc_port or 0) as c:
            with pytest.raises(KvSourcesUnsupported):
                await c.kv_event_sources()
            assert (await c.snapshot()).sources_via == "none"
        static = StaticSourceConfig("tcp://*:5557", dp_ranks=(0, 1))
        async with EngineClient("127.0.0.1", eng.grpc_port or 0, static=static) as c:
            snap = await c.snapshot()
        assert snap.reachable and snap.sources_via == "static"
        assert [s.endpoint for s in snap.sources] == [
            "tcp://127.0.0.1:5557",
            "tcp://127.0.0.1:5558",
        ]
    finally:
        await eng.stop()


async def test_unreachable_and_timeout_are_typed() -> None:
    async with EngineClient("127.0.0.1", _closed_port(), timeout=0.5) as c:
        with pytest.raises(EngineUnreachable):
            await c.server_info()
        snap = await c.snapshot()
    assert not snap.reachable and snap.error

    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await r.read()  # accept, never speak HTTP/2
        w.close()

    srv = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        async with EngineClient("127.0.0.1", port, timeout=0.3) as c:
            with pytest.raises(DiscoveryTimeout):
                await c.is_paused()
    finally:
        srv.close()
        await srv.wait_closed()


async def test_snapshot_follows_restart_with_new_ports() -> None:
    eng = SimEngine(replace(SimConfig(), dp_size=1))
    await eng.start()
    try:
        async with EngineClient("127.0.0.1", eng.grpc_port or 0) as c:
            a = await c.snapshot()
            await eng.restart(rebind=True)  # port-0 config: new ephemeral ports, new incarnation
            b = await c.snapshot()
        assert a.instance_id != b.instance_id
        assert b.sources[0].endpoint == eng.publishers[0].endpoint
    finally:
        await eng.stop()
