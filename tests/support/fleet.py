"""Shared helpers for end-to-end tests: an in-process relay over a simulated fleet."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from kvrelay.contract.limits import RelayLimits
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings
from kvrelay.service.server import RelayServer
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.timing import scaled

MARKER = 0x4B565231
#: Tests stop engines and expect their pool to go: a short grace instead of the default 30 s.
ENGINE_DOWN_GRACE_S = 0.6


async def eventually(check: Callable[[], bool], timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        await asyncio.sleep(0.02)


def engine_spec(e: SimEngine) -> EngineSpec:
    return EngineSpec(name=e.cfg.name, host="127.0.0.1", grpc_port=e.grpc_port)


def metered_pool(engines: list[SimEngine]) -> tuple[PoolSpec, ...]:
    """One aggregated pool of ``engines`` whose ``/metrics`` pages the relay scrapes."""
    return (
        PoolSpec(
            namespace="ns", component="backend", endpoint="generate", expected_blocks=8192,
            engines=tuple(
                EngineSpec(name=e.cfg.name, host="127.0.0.1", grpc_port=e.grpc_port,
                           metrics_port=e.metrics_port)
                for e in engines
            ),
        ),
    )  # fmt: skip


@contextlib.asynccontextmanager
async def fleet_and_relay(
    configs: list[SimConfig],
    *,
    expected_blocks: int = 8192,
    pools: Callable[[list[SimEngine]], tuple[PoolSpec, ...]] | None = None,
    limits: RelayLimits | None = None,
    scrape_interval_s: float = 1.0,
) -> AsyncIterator[tuple[list[SimEngine], Relay, RelayServer]]:
    """Start engines, then a relay over them (one aggregated pool unless ``pools`` says)."""
    engines = [SimEngine(c) for c in configs]
    for e in engines:
        await e.start()
    if pools is None:
        pool_specs: tuple[PoolSpec, ...] = (
            PoolSpec(
                namespace="ns",
                component="backend",
                endpoint="generate",
                engines=tuple(engine_spec(e) for e in engines),
                expected_blocks=expected_blocks,
            ),
        )
    else:
        pool_specs = pools(engines)
    settings = RelaySettings(
        dc_name="dc-e2e",
        pools=pool_specs,
        discovery_interval_s=0.2,
        discovery_timeout_s=scaled(1.0),
        engine_down_grace_s=ENGINE_DOWN_GRACE_S,
        limits=limits or RelayLimits(),
        metrics_scrape_interval_s=scrape_interval_s,
    )
    relay = Relay(settings)
    await relay.start()
    server = RelayServer(relay, settings.limits)
    await server.start("127.0.0.1", 0)
    try:
        yield engines, relay, server
    finally:
        await server.close(grace_s=1.0)
        await relay.stop()
        for e in engines:
            await e.stop()


async def wait_subscribed(relay: Relay, n_sources: int) -> None:
    def live() -> bool:
        subs = [s for p in relay.pools for s in p.subscribers.values()]
        return len(subs) == n_sources and all(s.state == "live" for s in subs)

    await eventually(live, what=f"{n_sources} live subscribers")


def salts_on_wire(e: SimEngine) -> bool:
    """Whether the relay namespaces the engine's salted blocks by default: SGLang layouts with a
    salt slot carry the salt explicitly, and an explicit salt is always honoured."""
    return e.sglang and e.cfg.sglang_layout.carries_salt


def ground_truth(engines: list[SimEngine]) -> dict[tuple[str, int], set[int]]:
    return {
        (e.cfg.name, r): e.ground_truth(r, cache_salt_namespacing=salts_on_wire(e))
        for e in engines
        for r in range(e.cfg.dp_size)
    }


def relay_view(relay: Relay) -> dict[tuple[str, int], set[int]]:
    pool = relay.pools[0]
    gen = pool.generation
    assert gen is not None
    out: dict[tuple[str, int], set[int]] = {}
    for mid, (wid, rank) in gen.pool.members().items():  # configured or connected members
        out[(pool._engine_name(wid), rank)] = {int(h) for h in gen.pool.resident_canonical(mid)}
    return out


def in_sync(engines: list[SimEngine], relay: Relay) -> bool:
    if relay.pools[0].generation is None:
        return False
    truth = ground_truth(engines)
    view = relay_view(relay)
    return all(view.get(k, set()) == v for k, v in truth.items())


