"""Helpers for ops tests: a simulated fleet behind an in-process relay, and a raw HTTP scraper."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings
from kvrelay.service.limits import RelayLimits
from kvrelay.service.server import RelayServer
from kvrelay.sim.engine import SimConfig, SimEngine

POOL = "ns/backend/generate"


async def eventually(check: Callable[[], bool], timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or check}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def fleet_and_relay(
    configs: list[SimConfig], *, expected_blocks: int = 8192, limits: RelayLimits | None = None
) -> AsyncIterator[tuple[list[SimEngine], Relay, RelayServer]]:
    engines = [SimEngine(c) for c in configs]
    for e in engines:
        await e.start()
    settings = RelaySettings(
        dc_name="dc-ops",
        pools=(
            PoolSpec(
                namespace="ns", component="backend", endpoint="generate",
                engines=tuple(
                    EngineSpec(name=e.cfg.name, host="127.0.0.1", grpc_port=e.grpc_port)
                    for e in engines
                ),
                expected_blocks=expected_blocks,
            ),
        ),
        discovery_interval_s=0.2,
        discovery_timeout_s=1.0,
        limits=limits or RelayLimits(),
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


def in_sync(engines: list[SimEngine], relay: Relay) -> bool:
    """Relay exact state == the simulator's ground truth (computed with the xxhash package)."""
    pool = relay.pools[0]
    gen = pool.generation
    if gen is None:
        return False
    names = {st.worker_id: st.spec.name for st in pool.engines.values()}
    view = {
        (names[wid], rank): {int(h) for h in gen.pool.resident_canonical(mid)}
        for mid, (wid, rank) in gen.pool.members().items()
    }
    return all(
        view.get((e.cfg.name, r), set()) == e.ground_truth(r)
        for e in engines for r in range(e.cfg.dp_size)
    )


@dataclass
class HttpReply:
    status: int
    headers: dict[str, str]
    body: bytes


async def http_request(port: int, raw: bytes) -> HttpReply:
    """Send ``raw`` and read the whole reply (the server closes after one response)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(raw)
        await w.drain()
        data = await asyncio.wait_for(r.read(), 10)
    finally:
        w.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    return HttpReply(status, headers, body)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(port: int) -> Samples:
    reply = await http_request(
        port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n"
    )
    assert reply.status == 200, reply
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert int(reply.headers["content-length"]) == len(reply.body)
    out: Samples = {}
    for fam in text_string_to_metric_families(reply.body.decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    if key not in samples:
        raise KeyError(f"no sample {name}{labels}")
    return samples[key]


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of every sample of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)
