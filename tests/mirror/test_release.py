"""A mirror releases the pools nobody reads through it (``[mirror] release_idle_s``), so that
an idle mirror does not hold its upstream's hubs for ever; a fan-out worker never does.

Each upstream stream of a mirror is a hub with a reader to its upstream relay. A mirror with no
local subscriber kept the first ``max_initialized_pool_hubs`` pools of the catalog mirrored for
ever, so an upstream at its own hub cap answered every other client (a router, another mirror)
``RESOURCE_LIMIT`` for the other pools, for ever (docs/scaling.md promises every listed pool is
servable behind a mirror, ``RESOURCE_LIMIT`` only while every mirrored pool has a reader).

The upstream here is a relay server over loopback whose view retires the hub idle the longest
at its hub limit, as a relay does (``MemRelayView.evict_idle_hubs``). Oracle: its tables; each
snapshot read is checked by the consumer rules (``Replica``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import structlog
from grpclib.const import Status

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from kvrelay.contract.producer import producer_key
from kvrelay.ops.config import MirrorConfig, parse_config
from kvrelay.ops.front import mirror_settings
from kvrelay.service.server import RelayServer
from tests.mirror.test_eviction import _drop, _hold, _snapshot
from tests.support.mem_relay import (
    Generation,
    MemRelayView,
    Replica,
    grpclib_channel,
    grpclib_collect,
    sub_request,
)
from tests.support.mirror_rig import (
    QUIET_WINDOW_MS,
    UPSTREAM_LIMITS,
    close_served,
    mirror_of,
    mirrored,
    start_worker,
)
from tests.support.rig import eventually
from tests.support.timing import scaled

POOLS = 4
CAP = 2  # the upstream's hub limit (and the mirror's own)
BUCKETS = 1024
RELEASE_S = 0.5
K = "kv-relay-error-reason"
LIMIT = (Status.RESOURCE_EXHAUSTED, "RELAY_ERROR_REASON_RESOURCE_LIMIT")


async def _upstream(cleanup: list[Any]) -> tuple[MemRelayView, RelayServer]:
    """A relay server whose view holds at most ``CAP`` hubs and, at that limit, retires the
    one idle the longest (a relay's rule): a hub a mirror's stream reads is never retired."""
    limits = dataclasses.replace(UPSTREAM_LIMITS, max_initialized_pool_hubs=CAP)
    view = MemRelayView(limits, window_ms=QUIET_WINDOW_MS)
    view.evict_idle_hubs = True
    server = RelayServer(view, limits)
    await server.start("127.0.0.1", 0)
    cleanup.append(server)
    return view, server


async def _served_when_free(ch: Any, gen: Generation, relay: pb.RelayIdentity) -> Replica:
    """Subscribe until the upstream has a hub for ``gen`` (RESOURCE_LIMIT while every hub has a
    reader), for at most 10 s; the snapshot, checked by the consumer rules."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + scaled(10)
    while True:
        probe = await grpclib_collect(ch, "SubscribeKvPool", sub_request(gen.producer),
                                      pb.FilterUpdate, limit=1)  # fmt: skip
        if probe.messages:
            return await _snapshot(ch, gen, relay)
        answer = (probe.status, probe.trailers.get(K))
        assert answer == LIMIT, answer
        assert loop.time() < deadline, "the upstream's hubs stayed held: RESOURCE_LIMIT for ever"
        await asyncio.sleep(0.1)


async def test_an_idle_mirror_frees_its_upstreams_hubs_for_the_upstreams_other_clients() -> None:
    """An upstream of hub limit 2 and four pools; a mirror (limit 2) mirrors the first two ahead
    of demand and nobody reads them. A router of the upstream gets the other two once the mirror
    released its idle pools (before: RESOURCE_LIMIT for ever). A released pool is not mirrored
    again ahead of demand (a new catalog leaves it alone); its next subscriber through the
    mirror starts it and gets the upstream's exact table, and keeps it while it reads."""
    cleanup: list[Any] = []
    try:
        view, upstream = await _upstream(cleanup)
        rng = np.random.default_rng(11)
        gens = [view.add_pool(f"release-{i}", BUCKETS) for i in range(POOLS)]
        for g in gens:
            g.random_step(rng, 16)
        limits = RelayLimits(max_initialized_pool_hubs=CAP)
        with structlog.testing.capture_logs() as logs:
            async with mirrored(upstream.port, limits=limits, release_idle_s=RELEASE_S) as m:
                mirror = m.mirror
                router = grpclib_channel(upstream.port)
                ch = m.channel()
                try:
                    for gen in gens[CAP:]:
                        replica = await _served_when_free(router, gen, view.relay_identity)
                        assert replica.installed == gen.sequence
                        assert np.array_equal(replica.table, gen.table)
                    assert mirror.pools_released == CAP, mirror.stats()
                    assert all(mirror.hub_for(g.producer) is None for g in gens)
                    assert view.hubs_evicted >= CAP  # the mirror's were idle upstream

                    # on demand: a fresh sync, exact, and held while it is read
                    gens[0].random_step(rng, 8)
                    held = await _hold(ch, gens[0])
                    assert held.installed == gens[0].sequence
                    assert np.array_equal(held.table, gens[0].table)
                    hub = mirror.hub_for(gens[0].producer)
                    assert hub is not None

                    # a new catalog: the released pool is not mirrored again ahead of demand
                    view.add_pool("release-new", BUCKETS)
                    await eventually(
                        lambda: mirror.catalog.upstream_version == view.catalog.current()[0],
                        what="the new catalog taken",
                    )  # fmt: skip
                    assert producer_key(gens[1].producer) not in mirror._pools

                    await asyncio.sleep(3 * RELEASE_S)  # read all along: never released
                    gens[0].random_step(rng, 8)
                    await eventually(lambda: held.installed == gens[0].sequence,
                                     what="the held pool follows its upstream")  # fmt: skip
                    assert np.array_equal(held.table, gens[0].table)
                    assert mirror.hub_for(gens[0].producer) is hub
                    released = mirror.pools_released
                    await _drop(held)
                    await eventually(lambda: mirror.hub_for(gens[0].producer) is None,
                                     what="released once nobody reads it")  # fmt: skip
                    assert mirror.pools_released > released
                    assert mirror.stats()["pools_released"] == mirror.pools_released
                finally:
                    router.close()
                    ch.close()
        events = [e for e in logs if e["event"] == "mirror_pool_released"]
        assert len(events) >= CAP + 1
        assert all(e["idle_s"] >= RELEASE_S for e in events)
    finally:
        await close_served(cleanup)


async def test_a_mirror_without_release_holds_the_upstreams_hubs() -> None:
    """``release_idle_s = 0``: the mirror keeps what it mirrored (the fan-out worker's rule), so
    the upstream at its limit refuses its other clients the other pools."""
    cleanup: list[Any] = []
    try:
        view, upstream = await _upstream(cleanup)
        gens = [view.add_pool(f"held-{i}", BUCKETS) for i in range(POOLS)]
        limits = RelayLimits(max_initialized_pool_hubs=CAP)
        async with mirrored(upstream.port, limits=limits, release_idle_s=0.0) as m:
            router = grpclib_channel(upstream.port)
            try:
                await asyncio.sleep(3 * RELEASE_S)
                request = sub_request(gens[CAP].producer)
                r = await grpclib_collect(router, "SubscribeKvPool", request, pb.FilterUpdate,
                                          limit=1)  # fmt: skip
                assert (r.status, r.trailers.get(K)) == LIMIT
                assert m.mirror.pools_released == 0
                assert all(m.mirror.hub_for(g.producer) is not None for g in gens[:CAP])
            finally:
                router.close()
    finally:
        await close_served(cleanup)


async def test_a_fan_out_worker_keeps_the_pools_it_mirrors() -> None:
    """A ``workers = N`` worker never releases: its ingest process admits hubs for every worker
    and spaces their joins itself. An external mirror's default is 60 s."""
    cleanup: list[Any] = []
    try:
        limits = RelayLimits(max_initialized_pool_hubs=CAP)
        view, server = await start_worker(limits, cleanup)
        mirror = mirror_of(server)
        assert mirror is not None
        assert mirror.settings.release_idle_s == 0.0
        gens = [view.add_pool(f"worker-{i}", BUCKETS) for i in range(POOLS)]
        await eventually(lambda: all(mirror.hub_for(g.producer) is not None for g in gens[:CAP]),
                         what="the first pools mirrored")  # fmt: skip
        hubs = [mirror.hub_for(g.producer) for g in gens[:CAP]]
        await asyncio.sleep(3 * RELEASE_S)
        assert [mirror.hub_for(g.producer) for g in gens[:CAP]] == hubs
        assert mirror.pools_released == 0
        assert not any(t.get_name() == "kvrelay-mirror-release" for t in mirror._tasks)
    finally:
        await close_served(cleanup)

    cfg, problems = parse_config({"mirror": {"upstream": "127.0.0.1:50161"}}, env={})
    assert cfg is not None and cfg.mirror is not None, problems
    assert cfg.mirror.release_idle_s == 60.0
    assert mirror_settings(cfg.mirror, cfg.relay.limits).release_idle_s == 60.0
    assert MirrorConfig(upstream="127.0.0.1:1").release_idle_s == 60.0


def test_release_idle_s_is_checked_as_the_mirror_takes_it() -> None:
    """0 (never) to 3600 s, from the file or the environment; check-config refuses what the
    mirror would refuse at start."""

    def parsed(value: object, env: dict[str, str] | None = None) -> Any:
        section: dict[str, object] = {"upstream": "127.0.0.1:50161"}
        if value is not None:
            section["release_idle_s"] = value
        return parse_config({"mirror": section}, env=env or {})

    for ok in (0, 0.25, 3600):
        cfg, problems = parsed(ok)
        assert cfg is not None and cfg.mirror is not None, problems
        assert mirror_settings(cfg.mirror, cfg.relay.limits).release_idle_s == ok
    for bad in (-1, 3601):
        cfg, problems = parsed(bad)
        errors = {p.path: p.reason for p in problems if p.severity == "error"}
        assert cfg is None and "mirror.release_idle_s" in errors, problems
    cfg, problems = parsed(None, {"KVRELAY_MIRROR_RELEASE_IDLE_S": "5"})
    assert cfg is not None and cfg.mirror is not None, problems
    assert cfg.mirror.release_idle_s == 5.0
