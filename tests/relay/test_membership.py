"""Membership that follows the fleet: engines from DNS (a real DNS server on loopback UDP), each
resolved address an engine on its own loopback IP; records appear and disappear under traffic."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvrelay.ops.metrics import RelayMetrics
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings
from kvrelay.service.server import RelayServer
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.dns_server import DnsServer
from tests.support.rig import Rig, eventually, subscribe, verify, wait_live

NAME = "vllm.kvrelay.test"


def _free_port(hosts: list[str]) -> int:
    """A port free on every one of ``hosts`` (the DNS entry's grpc_port applies to all)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = int(s.getsockname()[1])
        ok = True
        for h in hosts[1:]:
            with socket.socket() as s2:
                try:
                    s2.bind((h, port))
                except OSError:
                    ok = False
        if ok:
            return port
    raise AssertionError("no common free port")


def _engine(ip: str, port: int, seed: int) -> SimEngine:
    return SimEngine(
        SimConfig(name=f"e-{ip}", seed=seed, capacity_blocks=96, host_ip=ip, grpc_port=port)
    )


def _truth(engines: list[SimEngine]) -> dict[tuple[str, int], set[int]]:
    return {(f"vllm@{e.cfg.host_ip}", 0): e.ground_truth(0) for e in engines}


@contextlib.asynccontextmanager
async def dns_rig(
    dns: DnsServer, engines: list[SimEngine], template: EngineSpec | tuple[EngineSpec, ...],
    server: str,
) -> AsyncIterator[Rig]:
    specs = template if isinstance(template, tuple) else (template,)
    settings = RelaySettings(
        dc_name="dc-dns",
        pools=(PoolSpec(namespace="ns", component="backend", endpoint="generate",
                        engines=specs, expected_blocks=8192),),
        discovery_interval_s=0.1,
        discovery_timeout_s=0.5,
        engine_down_grace_s=0.6,
        dns_interval_s=0.2,
        dns_server=server,
    )  # fmt: skip
    relay = Relay(settings)
    await relay.start()
    srv = RelayServer(relay, settings.limits)
    await srv.start("127.0.0.1", 0)
    try:
        yield Rig(engines, relay, srv, settings)
    finally:
        await srv.close(grace_s=1.0)
        await relay.stop()
        for e in engines:
            await e.stop()


@contextlib.asynccontextmanager
async def one_dns_engine(ip: str, seed: int) -> AsyncIterator[tuple[Rig, SimEngine, EngineSpec]]:
    """A relay whose one pool's DNS template finds one live engine at ``ip``: the rig, the
    engine, and the template."""
    port = _free_port([ip])
    dns = DnsServer(records={(NAME, "A"): [ip]})
    server = await dns.start()
    engine = _engine(ip, port, seed)
    await engine.start()
    template = EngineSpec(name="vllm", dns=NAME, grpc_port=port)
    try:
        async with dns_rig(dns, [engine], template, server) as r:
            await wait_live(r.relay, 1)
            yield r, engine, template
    finally:
        dns.close()


def _names(r: Any) -> set[str]:
    return {st.spec.name for st in r.pool.engines.values()}


async def test_a_records_follow_the_fleet_under_traffic() -> None:
    ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    port = _free_port(ips)
    dns = DnsServer(records={(NAME, "A"): ips[:2]})
    server = await dns.start()
    a, b, c = (_engine(ip, port, 90 + i) for i, ip in enumerate(ips))
    for e in (a, b):
        await e.start()
    template = EngineSpec(name="vllm", dns=NAME, grpc_port=port)
    try:
        async with dns_rig(dns, [a, b], template, server) as r, r.channel() as ch:
            await wait_live(r.relay, 2)
            assert _names(r) == {"vllm@127.0.0.2", "vllm@127.0.0.3"}
            ids = {st.spec.name: st.worker_id for st in r.pool.engines.values()}
            consumer = await subscribe(r, ch)
            for e in (a, b):
                await e.step(6)
            await verify(r, consumer, truth=_truth([a, b]), probes=2_000)
            # a pod appears: a new record, a new engine, subscribed and exact
            await c.start()
            r.engines.append(c)
            dns.records[(NAME, "A")] = ips
            await wait_live(r.relay, 3)
            await c.step(6)
            await verify(r, consumer, truth=_truth([a, b, c]), probes=2_000)
            # a pod goes: after two answers without it and its stream down for the grace, its
            # engine and members are removed
            await b.stop()
            dns.records[(NAME, "A")] = [ips[0], ips[2]]
            await eventually(lambda: "vllm@127.0.0.3" not in _names(r), what="engine removed")
            await a.step(4)
            await verify(r, consumer, truth=_truth([a, c]), probes=2_000)
            assert consumer.end is None  # one pool, one generation, all along
            m = r.relay.membership
            assert m is not None
            assert (m.counters.engines_added, m.counters.engines_removed) == (3, 1)
            # names (so worker ids) are stable per address
            now = {st.spec.name: st.worker_id for st in r.pool.engines.values()}
            assert all(now[n] == ids[n] for n in now if n in ids)
            await consumer.stop()
    finally:
        dns.close()


def _sample(page: str, name: str) -> float:
    """The value of the unlabelled sample ``name`` on a /metrics page."""
    (line,) = [x for x in page.splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])


async def test_a_dns_outage_changes_nothing() -> None:
    ips = ["127.0.0.5", "127.0.0.6"]
    port = _free_port(ips)
    dns = DnsServer(records={(NAME, "A"): ips})
    server = await dns.start()
    engines = [_engine(ip, port, 95 + i) for i, ip in enumerate(ips)]
    for e in engines:
        await e.start()
    try:
        async with dns_rig(dns, engines, EngineSpec(name="vllm", dns=NAME, grpc_port=port),
                           server) as r, r.channel() as ch:  # fmt: skip
            await wait_live(r.relay, 2)
            consumer = await subscribe(r, ch)
            m = r.relay.membership
            assert m is not None
            for mode in ("servfail", "silent"):
                dns.mode = mode
                before = m.counters.failures
                await eventually(lambda b=before: m.counters.failures >= b + 2, timeout=20,
                                 what=f"{mode} counted")  # fmt: skip
                assert len(_names(r)) == 2 and m.counters.engines_removed == 0
            page = RelayMetrics(r.relay).render().decode()  # on /metrics too
            assert _sample(page, "kvrelay_dns_resolution_failures_total") == m.counters.failures
            dns.mode = "answer"
            for e in engines:
                await e.stop()
            dns.records[(NAME, "A")] = []  # the name resolves to nothing: every pod gone
            await eventually(lambda: not _names(r), what="engines removed")
            page = RelayMetrics(r.relay).render().decode()
            assert _sample(page, "kvrelay_dns_engines_removed_total") == 2
            assert _sample(page, "kvrelay_dns_engines_added_total") == 2
            end = await consumer.wait_end()
            assert end.reason == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
    finally:
        dns.close()


async def test_srv_records_give_hosts_and_ports() -> None:
    ips = ["127.0.0.7", "127.0.0.8"]
    engines = [_engine(ip, 0, 97 + i) for i, ip in enumerate(ips)]  # ephemeral, distinct ports
    for e in engines:
        await e.start()
    srv_name = "_grpc._tcp." + NAME
    dns = DnsServer(records={
        (srv_name, "SRV"): [f"0 0 {e.grpc_port} e{i}.{NAME}." for i, e in enumerate(engines)],
        **{(f"e{i}.{NAME}", "A"): [ip] for i, ip in enumerate(ips)},
    })  # fmt: skip
    server = await dns.start()
    try:
        async with dns_rig(dns, engines, EngineSpec(name="vllm", dns=srv_name, dns_srv=True),
                           server) as r, r.channel() as ch:  # fmt: skip
            await wait_live(r.relay, 2)
            assert _names(r) == {f"vllm@{e.cfg.host_ip}:{e.grpc_port}" for e in engines}
            consumer = await subscribe(r, ch)
            for e in engines:
                await e.step(5)
            truth = {(f"vllm@{e.cfg.host_ip}:{e.grpc_port}", 0): e.ground_truth(0)
                     for e in engines}  # fmt: skip
            await verify(r, consumer, truth=truth, probes=2_000)
            await consumer.stop()
    finally:
        dns.close()


async def test_a_dns_flap_keeps_an_engine_whose_stream_is_live() -> None:
    """DNS absence is treated like an unreachable Control: an engine whose ZMQ stream is live
    stays, with its state, however long its record is missing; it goes only once it is absent
    and disconnected for ``engine_down_grace_s``."""
    ips = ["127.0.0.7", "127.0.0.8"]
    port = _free_port(ips)
    dns = DnsServer(records={(NAME, "A"): ips})
    server = await dns.start()
    a, b = (_engine(ip, port, 97 + i) for i, ip in enumerate(ips))
    for e in (a, b):
        await e.start()
    try:
        async with dns_rig(dns, [a, b], EngineSpec(name="vllm", dns=NAME, grpc_port=port),
                           server) as r, r.channel() as ch:  # fmt: skip
            await wait_live(r.relay, 2)
            consumer = await subscribe(r, ch)
            for e in (a, b):
                await e.step(6)
            await verify(r, consumer, truth=_truth([a, b]), probes=2_000)
            m = r.relay.membership
            assert m is not None
            dns.records[(NAME, "A")] = [ips[0]]  # b's record flaps away; b keeps publishing
            await eventually(lambda: m.counters.removals_deferred == 1, what="kept, counted")
            seen = m.counters.resolutions
            await eventually(lambda: m.counters.resolutions >= seen + 6, timeout=20,
                             what="absent for longer than the grace")  # fmt: skip
            assert "vllm@127.0.0.8" in _names(r) and m.counters.engines_removed == 0
            assert m.counters.removals_deferred == 1, "counted once per absence"
            assert r.metric("kvrelay_dns_removals_deferred_total") == 1
            await b.step(4)
            await verify(r, consumer, truth=_truth([a, b]), probes=2_000)
            dns.records[(NAME, "A")] = ips  # back: nothing to add, nothing changed
            seen = m.counters.resolutions
            await eventually(lambda: m.counters.resolutions >= seen + 2, what="answers")
            assert m.counters.engines_added == 2
            await b.stop()  # now the pod is really gone: absent and disconnected
            dns.records[(NAME, "A")] = [ips[0]]
            await eventually(lambda: "vllm@127.0.0.8" not in _names(r), timeout=20,
                             what="removed once absent and down for the grace")  # fmt: skip
            assert m.counters.engines_removed == 1 and m.counters.removals_deferred in (1, 2)
            await a.step(3)
            await verify(r, consumer, truth=_truth([a]), probes=2_000)
            assert consumer.end is None  # one pool, one generation, all along
            await consumer.stop()
    finally:
        dns.close()


@pytest.mark.parametrize("first", ["template", "configured"])
async def test_an_address_reached_twice_is_one_engine(first: str) -> None:
    """A second DNS name for the same pods, or a DNS answer naming a configured engine's
    address, is not a second engine: it was one more entry for the same endpoint (the first one
    unwatched), and with another spelling of the address the engine's blocks counted twice.
    It is counted once and logged; the pool stays exact with the one engine."""
    ip = "127.0.0.9"
    port = _free_port([ip])
    dns = DnsServer(records={(NAME, "A"): [ip], ("alias.kvrelay.test", "A"): [ip]})
    server = await dns.start()
    engine = _engine(ip, port, 99)
    await engine.start()
    lead = (EngineSpec(name="vllm", dns=NAME, grpc_port=port) if first == "template"
            else EngineSpec(name="vllm@127.0.0.9", host=f"::ffff:{ip}", grpc_port=port))
    specs = (lead, EngineSpec(name="alias", dns="alias.kvrelay.test", grpc_port=port))
    try:
        async with dns_rig(dns, [engine], specs, server) as r, r.channel() as ch:
            await wait_live(r.relay, 1)
            m = r.relay.membership
            assert m is not None
            await eventually(lambda: m.counters.resolutions >= 6, what="resolutions")
            assert _names(r) == {"vllm@127.0.0.9"}
            assert m.counters.duplicates == 1  # once, not once per resolution
            consumer = await subscribe(r, ch)
            await engine.step(6)
            await verify(r, consumer, truth=_truth([engine]), probes=2_000)
            await consumer.stop()
    finally:
        dns.close()


async def test_a_configured_engine_skipped_for_a_dns_one_is_added_once_that_one_goes() -> None:
    """A reload adds a configured engine at an address a DNS template already reaches: it is
    skipped (one engine, watched once). A later reload retires the template: its engine goes,
    and the configured one is added then, not left unwatched until another reload."""
    async with one_dns_engine("127.0.0.10", 98) as (r, engine, template), r.channel() as ch:
        configured = EngineSpec(name="pinned", host="127.0.0.10", grpc_port=template.grpc_port)
        pool = r.relay.settings.pools[0]
        await r.relay.reconfigure(dataclasses.replace(r.relay.settings, pools=(
            dataclasses.replace(pool, engines=(template, configured)),)))  # fmt: skip
        assert _names(r) == {"vllm@127.0.0.10"}  # the DNS engine, once
        await r.relay.reconfigure(dataclasses.replace(r.relay.settings, pools=(
            dataclasses.replace(pool, engines=(configured,)),)))  # fmt: skip
        await eventually(lambda: _names(r) == {"pinned"}, what="configured engine added")
        await wait_live(r.relay, 1)
        consumer = await subscribe(r, ch)
        await engine.step(6)
        await verify(r, consumer, truth={("pinned", 0): engine.ground_truth(0)},
                     probes=2_000)  # fmt: skip
        await consumer.stop()


async def test_a_new_pools_engine_reached_by_another_pool_waits_for_it() -> None:
    """A reload adds a pool whose configured engine a DNS template of another pool already
    reaches: it is not watched twice (it waits, skipped), and is added once that pool goes."""
    async with one_dns_engine("127.0.0.11", 97) as (r, _, template):
        first = r.relay.settings.pools[0]
        pinned = EngineSpec(name="pinned", host="127.0.0.11", grpc_port=template.grpc_port)
        other = dataclasses.replace(first, namespace="ns2", engines=(pinned,))
        await r.relay.reconfigure(dataclasses.replace(r.relay.settings,
                                                      pools=(first, other)))  # fmt: skip
        second = next(p for p in r.relay.pools if p.name.startswith("ns2/"))
        assert not second.engines and list(r.relay._skipped) == [(second.name, "pinned")]
        await r.relay.reconfigure(dataclasses.replace(r.relay.settings, pools=(other,)))
        await eventually(lambda: [st.spec.name for st in second.engines.values()] == [
            "pinned"], what="the engine added to the new pool")  # fmt: skip
        assert not r.relay._skipped


async def test_two_control_endpoints_naming_one_engine_subscribe_it_once() -> None:
    """A second ``vllm.Control`` front for the same engine (a proxy, a second port) reports
    the same publisher: both were subscribed, the engine's blocks held twice (16 memberships
    for 8 blocks), and kept by the second member after the engine went. One subscription per
    publisher: the second is left out, counted, logged."""
    from kvrelay.sim.control import start_control_server

    eng = SimEngine(SimConfig(name="e0", seed=11, capacity_blocks=256))
    await eng.start()
    front, front_port = await start_control_server(eng)
    spec = PoolSpec(namespace="ns", component="backend", endpoint="generate", engines=(
        EngineSpec(name="direct", host="127.0.0.1", grpc_port=eng.grpc_port),
        EngineSpec(name="front", host="127.0.0.1", grpc_port=front_port),
    ), expected_blocks=4096)  # fmt: skip
    relay = Relay(RelaySettings(dc_name="dc", pools=(spec,), discovery_interval_s=0.2))
    await relay.start()
    try:
        pool = relay.pools[0]
        await eventually(lambda: pool.generation is not None and pool.counters.source_duplicates
                         == 1 and all(s.state == "live" for s in pool.subscribers.values()),
                         what="subscribed once")  # fmt: skip
        await eng.step(20)
        truth = eng.ground_truth(0)
        gen = pool.generation
        assert gen is not None and truth

        def held() -> list[set[int]]:
            return [{int(h) for h in gen.pool.resident_canonical(mid)}
                    for mid in gen.pool.members()]  # fmt: skip

        await eventually(lambda: held() == [truth], what="the engine's blocks, once")
        assert len(pool.subscribers) == 1
        await asyncio.sleep(0.6)  # more discovery passes: counted once, nothing added
        assert pool.counters.source_duplicates == 1 and len(pool.subscribers) == 1
    finally:
        await relay.stop()
        front.close()
        await front.wait_closed()
        await eng.stop()
