"""Seeded random audit of the mirror promise (docs/scaling.md "Mirrors", docs/contract.md): a
subscriber of a mirror gets what a direct subscriber of the upstream gets.

A real ``Relay`` is fed by simulated engines (random steps, clears, engine restarts) and
reloaded at random (an engine joins or leaves a pool, a second pool comes and goes, a
``ckf_seed`` change re-materializes a pool: a new generation). A mirror serves it and a second
mirror serves the first. Strict consumer replicas (``tests/support/replica.py``) subscribe
directly and through each mirror and join and leave at random (a late joiner takes a snapshot).
After each step, once the relay has applied it: every replica of a live generation is at the
producer's sequence with the producer's filter words (the direct replicas' too), every replica
of a retired generation has ended with a status on every path, and the catalog and readiness
planes and ``GetRelayInfo`` are byte for byte the same through every path. Midway the upstream
restarts (a new relay identity on the same port): both mirrors follow it.

Long run: ``KVRELAY_EQUIV_SEEDS=100:200 [KVRELAY_EQUIV_STEPS=40]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client.codec import RawCodec
from kvrelay.relay.pool_runtime import PoolRuntime
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import PoolSpec, RelaySettings
from kvrelay.service.server import RelayServer
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.fleet import engine_spec, ground_truth
from tests.support.mirror_rig import Mirrored, start_mirror
from tests.support.rig import (
    MARKER,
    SVC,
    Consumer,
    make_settings,
    relay_info_bytes,
    start_relay,
    stop_relay,
)
from tests.support.timing import scaled

POOL_A, POOL_B = "ns/backend/a", "ns/backend/b"
PATHS = ("direct", "m1", "m2")


def _seeds() -> list[int]:
    spec = os.environ.get("KVRELAY_EQUIV_SEEDS")
    if not spec:
        return [1, 2]
    lo, _, hi = spec.partition(":")
    return list(range(int(lo), int(hi))) if hi else [int(lo)]


STEPS = int(os.environ.get("KVRELAY_EQUIV_STEPS", "14"))


async def _until(check: object, what: str, timeout: float = 15.0) -> None:
    """Poll ``check()`` (sync) until true; the message says what was still wrong."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + scaled(timeout)
    last: object = None
    while True:
        last = check()  # type: ignore[operator]
        if last is True:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {last}")
        await asyncio.sleep(0.01)


async def _first_frame(port: int, method: str, request: object) -> bytes:
    """The first message of a server stream, as raw bytes."""
    ch = Channel("127.0.0.1", port, codec=RawCodec(8 << 20))
    try:
        async with asyncio.timeout(scaled(10)):
            async with ch.request(
                SVC + method, Cardinality.UNARY_STREAM, type(request), bytes
            ) as st:
                await st.send_message(request, end=True)
                data = await st.recv_message()
                await st.cancel()
        assert isinstance(data, bytes), method
        return data
    finally:
        ch.close()


def _pool_view(p: PoolRuntime) -> dict[tuple[str, int], set[int]]:
    gen = p.generation
    assert gen is not None
    return {
        (p._engine_name(wid), rank): {int(h) for h in gen.pool.resident_canonical(mid)}
        for mid, (wid, rank) in gen.pool.members().items()
    }


@dataclass
class Sub:
    path: str
    pool: str
    producer: bytes
    consumer: Consumer


@dataclass
class World:
    rnd: random.Random
    engines: dict[str, SimEngine]
    relay: Relay
    server: RelayServer
    m1: Mirrored
    m2: Mirrored
    channels: dict[str, Channel]
    members: dict[str, list[str]] = field(default_factory=dict)  # pool -> engine names
    ckf_seeds: dict[str, int] = field(default_factory=dict)
    subs: list[Sub] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def port(self, path: str) -> int:
        return {"direct": self.server.port, "m1": self.m1.port, "m2": self.m2.port}[path]

    def settings(self) -> RelaySettings:
        base = make_settings([self.engines["e0"]], expected_blocks=2048)
        pools = tuple(
            PoolSpec(
                namespace="ns", component="backend", endpoint=name.rsplit("/", 1)[1],
                engines=tuple(engine_spec(self.engines[e]) for e in engines),
                expected_blocks=2048, ckf_seed=self.ckf_seeds[name],
            )
            for name, engines in sorted(self.members.items())
        )  # fmt: skip
        return dataclasses.replace(base, pools=pools)

    def pools(self) -> dict[str, PoolRuntime]:
        return {p.name: p for p in self.relay.pools}

    def sources(self) -> int:
        return sum(self.engines[e].cfg.dp_size for names in self.members.values() for e in names)

    async def wait_live(self) -> None:
        def live() -> object:
            subs = [s for p in self.relay.pools for s in p.subscribers.values()]
            states = [s.state for s in subs]
            return (len(subs) == self.sources() and all(s == "live" for s in states)) or states

        await _until(live, "every source live")

    # ---- actions --------------------------------------------------------------------------

    async def reload(self) -> None:
        await self.relay.reconfigure(self.settings())
        await self.wait_live()

    async def join(self) -> None:
        pools = [p for p in self.relay.pools if p.generation is not None]
        if not pools:
            return
        p = self.rnd.choice(pools)
        gen = p.generation
        assert gen is not None
        path = self.rnd.choice(PATHS)
        sid = f"{path}-{len(self.subs)}"
        c = Consumer(self.channels[path], gen.producer, self.relay.relay_identity, sid).start()
        self.subs.append(Sub(path, p.name, bytes(gen.producer), c))
        self.log.append(f"join {sid} {p.name}")

    async def leave(self) -> None:
        live = [s for s in self.subs if s.consumer.end is None]
        if live:
            s = self.rnd.choice(live)
            await s.consumer.stop()
            self.subs.remove(s)
            self.log.append(f"leave {s.consumer.subscriber_id}")

    async def act(self) -> None:
        rnd = self.rnd
        configured = [e for names in self.members.values() for e in names]
        kind = rnd.choices(
            ("step", "clear", "restart", "join", "leave", "member", "pool", "regen"),
            weights=(8, 1, 1, 4, 2, 1, 1, 1),
        )[0]
        self.log.append(kind)
        if kind == "step":
            for name in rnd.sample(configured, rnd.randint(1, len(configured))):
                await self.engines[name].step(rnd.randint(1, 6))
        elif kind == "clear":
            self.engines[rnd.choice(configured)].reset_prefix_cache()
        elif kind == "restart":
            await self.engines[rnd.choice(configured)].restart()
            await self.wait_live()
        elif kind == "join":
            for _ in range(rnd.randint(1, 3)):
                await self.join()
        elif kind == "leave":
            await self.leave()
        elif kind == "member":
            a = self.members[POOL_A]
            self.members[POOL_A] = ["e0"] if "e1" in a else ["e0", "e1"]
            await self.reload()
        elif kind == "pool":
            if POOL_B in self.members:
                del self.members[POOL_B]
            else:
                self.members[POOL_B] = ["e2"]
                self.ckf_seeds.setdefault(POOL_B, 5)
            await self.reload()
        else:
            name = rnd.choice(sorted(self.members))
            self.ckf_seeds[name] = rnd.randint(1, 1 << 30)
            await self.reload()

    async def restart_upstream(self) -> None:
        """A new relay (a new identity) on the same port; the engines clear, so that its state
        (which starts empty) is the engines' again."""
        port = self.server.port
        settings = self.relay.settings
        await self.server.close(grace_s=1.0)
        await stop_relay(self.relay)
        self.relay, self.server = await start_relay(settings, port=port)
        await self.wait_live()
        for names in self.members.values():
            for e in names:
                self.engines[e].reset_prefix_cache()
        self.log.append("upstream restarted")

    # ---- the audit ------------------------------------------------------------------------

    def _ingested(self) -> object:
        pools = self.pools()
        if sorted(pools) != sorted(self.members):
            return f"pools {sorted(pools)}"
        for name, engines in self.members.items():
            p = pools[name]
            if p.generation is None:
                return f"{name}: no generation"
            truth = ground_truth([self.engines[e] for e in engines])
            view = _pool_view(p)
            bad = [k for k, v in truth.items() if view.get(k, set()) != v]
            if bad:
                return f"{name}: {bad} behind"
        return True

    def _caught_up(self) -> object:
        for p in self.relay.pools:
            gen = p.generation
            assert gen is not None
            gen.flush()
            for m in (self.m1, self.m2):
                hub = m.mirror.hub_for(gen.producer)
                if hub is None or hub.sequence != gen.sequence:
                    seq = None if hub is None else hub.sequence
                    return f"{p.name}: a mirror at {seq}, producer at {gen.sequence}"
        live = {bytes(p.generation.producer): p for p in self.relay.pools if p.generation}
        for s in self.subs:
            c = s.consumer
            if c.task is not None and c.task.done() and c.task.exception() is not None:
                raise AssertionError(f"{c.subscriber_id}: replica broke") from c.task.exception()
            if s.producer not in live or c.replica.relay_bytes != bytes(self.relay.relay_identity):
                if c.end is None:
                    return f"{c.subscriber_id}: a stream of a retired generation still open"
                continue
            p = live[s.producer]
            gen = p.generation
            assert gen is not None
            if c.end is not None:
                return f"{c.subscriber_id}: ended {c.end} while its generation is live"
            if c.replica.sequence != gen.sequence:
                return f"{c.subscriber_id}: at {c.replica.sequence}, producer {gen.sequence}"
        return True

    async def audit(self) -> None:
        await _until(self._ingested, "the relay applied the engines' events")
        await _until(self._caught_up, "mirrors and replicas at the producer's sequence")
        live = {bytes(p.generation.producer): p for p in self.relay.pools if p.generation}
        for s in self.subs:
            p = live.get(s.producer)
            if p is None or s.consumer.end is not None:
                continue
            gen = p.generation
            assert gen is not None and s.consumer.replica.table is not None
            assert np.array_equal(s.consumer.replica.table, gen.pool.table), (
                f"{s.consumer.subscriber_id} ({s.path}) != the producer's table"
            )
        self.subs = [s for s in self.subs if s.consumer.end is None]
        await self._planes()

    async def _planes(self) -> None:
        requests = (
            ("WatchKvPoolCatalog",
             pb.WatchKvPoolCatalogRequest(subscriber_id="c", contract_marker=MARKER)),
            ("SubscribeServingReadiness",
             pb.SubscribeServingReadinessRequest(subscriber_id="r", contract_marker=MARKER)),
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        deadline = loop.time() + scaled(15)
        while True:
            got: dict[str, list[bytes]] = {}
            try:
                for path in PATHS:
                    port = self.port(path)
                    got[path] = [await _first_frame(port, m, r) for m, r in requests]
                    got[path].append(await relay_info_bytes(port))
            except GRPCError as exc:  # a mirror's plane between two sessions of its upstream
                if exc.status != Status.UNAVAILABLE or loop.time() > deadline:  # (restart)
                    raise
                await asyncio.sleep(0.02)
                continue
            if got["m1"] == got["direct"] and got["m2"] == got["direct"]:
                return
            if loop.time() > deadline:
                which = [
                    (path, i) for path in ("m1", "m2") for i in range(3)
                    if got[path][i] != got["direct"][i]
                ]  # fmt: skip
                raise AssertionError(f"planes differ through a mirror: {which}")
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _world(seed: int) -> AsyncIterator[World]:
    engines = {
        f"e{i}": SimEngine(SimConfig(name=f"eq{seed}-{i}", seed=seed * 10 + i, dp_size=1 + (i == 1),
                                     capacity_blocks=48))
        for i in range(3)
    }  # fmt: skip
    for e in engines.values():
        await e.start()
    stack = contextlib.AsyncExitStack()
    try:
        world = World(random.Random(seed), engines, None, None, None, None, {})  # type: ignore[arg-type]
        world.members = {POOL_A: ["e0"]}
        world.ckf_seeds = {POOL_A: 3, POOL_B: 5}
        world.relay, world.server = await start_relay(world.settings())
        await world.wait_live()
        world.m1 = await start_mirror(world.server.port)
        stack.push_async_callback(world.m1.close)
        world.m2 = await start_mirror(world.m1.port)
        stack.push_async_callback(world.m2.close)
        for path in PATHS:
            world.channels[path] = Channel("127.0.0.1", world.port(path))
        yield world
    finally:
        for s in world.subs:
            await s.consumer.stop()
        for ch in world.channels.values():
            ch.close()
        await stack.aclose()
        if world.server is not None:
            await world.server.close(grace_s=1.0)
            await stop_relay(world.relay)
        for e in engines.values():
            await e.stop()


@pytest.mark.parametrize("seed", _seeds())
async def test_replicas_through_mirrors_equal_the_direct_ones(seed: int) -> None:
    async with _world(seed) as w:
        restart_at = w.rnd.randrange(STEPS // 3, STEPS)
        for i in range(STEPS):
            if i == restart_at:
                await w.restart_upstream()
            else:
                await w.act()
            try:
                await w.audit()
            except AssertionError as exc:
                raise AssertionError(f"seed {seed} step {i}: {exc}\nlog: {w.log}") from exc
