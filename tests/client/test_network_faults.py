"""Seeded random audit of the SDK through a faulty network (``tests/support/faulty_proxy.py``).

A real relay fed by simulated engines serves a ``RelayClient`` through a TCP proxy that, at
seeded random points, delays bytes, splits writes into single bytes, stalls one direction past
the SDK's silence limit (the TCP connection stays up), cuts connections (RST or FIN),
half-closes one direction and black-holes new connections. Throughout, the promise a router
relies on is checked: a replica the SDK holds as installed equals, word for word, the relay's
own filter at the sequence the replica claims (a strict direct subscriber records the relay's
filter at every sequence); otherwise the SDK reports the pool as not installed. After each
fault heals, the SDK catches up with the relay within a bounded time.

Long run: ``KVRELAY_NETFAULT_SEEDS=100:200 [KVRELAY_NETFAULT_STEPS=30]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time

import numpy as np
import pytest

from kvrelay.client import ClientConfig, RelayClient
from kvrelay.client.connection import RelayConnection
from kvrelay.contract.limits import RelayLimits
from kvrelay.sim.config import SimConfig
from tests.support.client_stack import Stack, stack
from tests.support.faulty_proxy import DOWN, UP, FaultyProxy, FilterHistory
from tests.support.rig import Consumer
from tests.support.timing import scaled

HEARTBEAT_S = 0.3
CONFIG = ClientConfig(
    heartbeat_interval_s=HEARTBEAT_S, silence_heartbeats=3, backoff_initial_s=0.02,
    backoff_max_s=0.3, watch_load=False, watch_serving_load=False,
)  # fmt: skip
LIMITS = RelayLimits(
    pool_heartbeat_s=HEARTBEAT_S, readiness_heartbeat_s=HEARTBEAT_S,
    publication_queue_capacity=4096, publication_queue_bytes=64 << 20,
)  # fmt: skip
#: After a fault heals, the SDK is back at the relay's sequence within this (scaled) time: a
#: few silence limits and backoffs, far below grpclib's keepalive (a ping 20 s in, 10 s to
#: answer, at most one per 300 s on a connection).
RECOVERY_S = 8.0
FAULTS = ("delay", "split", "stall_down", "stall_up", "rst", "fin", "half_down", "half_up",
          "blackhole", "none")  # fmt: skip


def _seeds() -> list[int]:
    spec = os.environ.get("KVRELAY_NETFAULT_SEEDS")
    if not spec:
        return [1, 2, 3]
    lo, _, hi = spec.partition(":")
    return list(range(int(lo), int(hi))) if hi else [int(lo)]


STEPS = int(os.environ.get("KVRELAY_NETFAULT_STEPS", "6"))


class Recorder:
    """A strict direct subscriber of the relay's one pool: the relay's filter per sequence."""

    def __init__(self, st: Stack, history: FilterHistory) -> None:
        relay = st.relay
        assert relay is not None and relay.pools[0].generation is not None
        gen = relay.pools[0].generation
        from grpclib.client import Channel

        self.channel = Channel("127.0.0.1", st.port)
        self.producer = bytes(gen.producer)
        self.consumer = Consumer(self.channel, gen.producer, relay.relay_identity, "oracle")
        replica = self.consumer.replica
        feed = replica.feed

        def recorded(fu: object) -> None:
            feed(fu)  # type: ignore[arg-type]
            if replica.table is not None and replica.sequence is not None:
                history.record(self.producer, replica.sequence, replica.table)

        replica.feed = recorded  # type: ignore[method-assign]
        self.consumer.start()

    async def close(self) -> None:
        await self.consumer.stop()
        self.channel.close()


class Audit:
    """Checks the SDK's promise every few milliseconds, on the same loop as everything."""

    def __init__(self, client: RelayClient, history: FilterHistory) -> None:
        self.client = client
        self.history = history
        self.checked = 0
        self.unverified: list[tuple[bytes, int, bytes, float]] = []
        self.wrong: list[str] = []
        self._seen: dict[object, tuple[int, int]] = {}
        self.task = asyncio.create_task(self._run())

    def check_now(self) -> None:
        for conn in self.client.connections:
            for slot in conn.slots.values():
                replica = slot.installed
                if replica is None or replica.table is None or replica.sequence is None:
                    continue
                producer = bytes(slot.descriptor.producer)
                seq = replica.sequence
                if self._seen.get(slot.key) == (id(replica), seq):
                    continue
                self._seen[slot.key] = (id(replica), seq)
                verdict = self.history.verdict(producer, seq, replica.table)
                self.checked += 1
                if verdict is False:
                    self.wrong.append(f"{slot.key} at {seq}: not the relay's filter")
                elif verdict is None:
                    digest = FilterHistory.digest(replica.table)
                    self.unverified.append((producer, seq, digest, time.monotonic()))
        still = []
        for producer, seq, digest, since in self.unverified:
            want = self.history.digests.get((producer, seq))
            if want is None:
                if time.monotonic() - since > scaled(10):
                    self.wrong.append(f"sequence {seq} never published by the relay")
                else:
                    still.append((producer, seq, digest, since))
            elif want != digest:
                self.wrong.append(f"at {seq}: not the relay's filter (checked late)")
        self.unverified = still

    async def _run(self) -> None:
        while True:
            self.check_now()
            await asyncio.sleep(0.005)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        self.check_now()


def caught_up(client: RelayClient, st: Stack, history: FilterHistory) -> bool:
    """Every catalog pool installed at the relay's published sequence, readiness known."""
    relay = st.relay
    assert relay is not None
    gen = relay.pools[0].generation
    conn: RelayConnection = client.connections[0]
    if gen is None or conn.readiness is None or not conn.slots:
        return False
    producer = bytes(gen.producer)
    for slot in conn.slots.values():
        r = slot.installed
        if r is None or r.sequence is None or bytes(slot.descriptor.producer) != producer:
            return False
        if r.sequence != gen.hub().sequence or history.verdict(producer, r.sequence, r.table) \
                is not True:
            return False
    return True


async def traffic(st: Stack, rnd: random.Random, stop: asyncio.Event) -> None:
    while not stop.is_set():
        e = rnd.choice(st.engines)
        await e.step(rnd.randint(1, 4))
        await asyncio.sleep(rnd.uniform(0.005, 0.05))


async def apply_fault(proxy: FaultyProxy, kind: str, rnd: random.Random, log: list[str]) -> None:
    """Start ``kind``, hold it a while, then heal."""
    silence = HEARTBEAT_S * 3
    hold = rnd.uniform(0.2, 0.8)
    if kind == "delay":
        d = proxy.directions[rnd.choice((UP, DOWN))]
        d.delay_s = rnd.uniform(0.1, 0.4)
    elif kind == "split":
        proxy.directions[rnd.choice((UP, DOWN))].split = True
    elif kind in ("stall_down", "stall_up"):
        proxy.stall(DOWN if kind == "stall_down" else UP)
        hold = silence + rnd.uniform(0.3, 1.0)  # longer than the SDK's silence limit
    elif kind in ("rst", "fin"):
        proxy.cut(rst=kind == "rst")
    elif kind in ("half_down", "half_up"):
        proxy.half_close(DOWN if kind == "half_down" else UP)
    elif kind == "blackhole":
        proxy.blackhole = True
        proxy.cut(rst=rnd.random() < 0.5)  # the reconnection lands in the hole
        hold = silence + rnd.uniform(0.3, 1.0)
    log.append(f"{kind} for {hold:.2f}s")
    await asyncio.sleep(hold)
    proxy.heal()


@pytest.mark.parametrize("seed", _seeds())
async def test_the_sdk_never_serves_a_wrong_filter_and_recovers_through_a_faulty_network(
    seed: int,
) -> None:
    rnd = random.Random(seed)
    configs = [SimConfig(name="n0", seed=seed, dp_size=2, capacity_blocks=96)]
    async with stack(configs, LIMITS, expected_blocks=1024) as st:
        assert st.relay is not None
        relay = st.relay
        await _until(lambda: relay.pools[0].generation is not None, "generation")
        history = FilterHistory()
        recorder = Recorder(st, history)
        proxy = await FaultyProxy("127.0.0.1", st.port).start()
        client = RelayClient([proxy.address], config=CONFIG)
        await client.start()
        audit = Audit(client, history)
        stop = asyncio.Event()
        driver = asyncio.create_task(traffic(st, random.Random(~seed), stop))
        log: list[str] = []
        try:
            await _until(lambda: caught_up(client, st, history), "first install")
            for _ in range(STEPS):
                kind = rnd.choice(FAULTS)
                await apply_fault(proxy, kind, rnd, log)
                t0 = time.monotonic()
                await _until(lambda: caught_up(client, st, history),
                             f"recovery after {log[-1]} (seed {seed}: {log})",
                             RECOVERY_S)  # fmt: skip
                log[-1] += f", recovered in {time.monotonic() - t0:.2f}s"
                assert not audit.wrong, (audit.wrong, log)
            stop.set()
            await driver
            await _until(lambda: caught_up(client, st, history), "final catch-up")
            assert recorder.consumer.end is None, recorder.consumer.end
        finally:
            stop.set()
            driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await driver
            await audit.close()
            await client.close()
            await proxy.close()
            await recorder.close()
        assert not audit.wrong, (audit.wrong, log)
        assert audit.checked > STEPS, audit.checked


async def _until(check: object, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("fault", ["blackhole", "dead"])
async def test_a_connection_that_carries_nothing_is_left_after_the_silence_limit(
    fault: str,
) -> None:
    """``blackhole`` (seed 1's second fault): the connection is cut and the reconnection lands
    in a black hole (accepted, never forwarded) until the network heals; every stream on it
    ended ``silent`` and was opened again on the same dead connection until grpclib's keepalive
    closed it: 28.5 s to recover with a 0.9 s silence limit. ``dead``: a live connection stops
    carrying anything towards the client for good while TCP stays up (connections made later
    work); its pool stream went silent on it in turn the same way (a ping 20 s in, 10 s to
    answer, then at most one per 300 s). A catalog stream without a first message, or a pool
    stream ending silent, on a channel that received nothing that long now replaces the
    channel: back within a few silence limits."""
    configs = [SimConfig(name="n0", seed=1, dp_size=1, capacity_blocks=64)]
    async with stack(configs, LIMITS, expected_blocks=1024) as st:
        assert st.relay is not None
        relay = st.relay
        await _until(lambda: relay.pools[0].generation is not None, "generation")
        history = FilterHistory()
        recorder = Recorder(st, history)
        proxy = await FaultyProxy("127.0.0.1", st.port).start()
        client = RelayClient([proxy.address], config=CONFIG)
        await client.start()
        try:
            await st.engines[0].step(4)
            await _until(lambda: caught_up(client, st, history), "first install")
            gen = relay.pools[0].generation
            assert gen is not None
            before = gen.hub().sequence
            if fault == "blackhole":
                proxy.blackhole = True
                proxy.cut(rst=True)
                await asyncio.sleep(HEARTBEAT_S * 3 + 0.5)
                proxy.heal()
            else:
                proxy.stall_open(DOWN)  # for good: only a new connection flows
            await st.engines[0].step(4)
            await _until(lambda: gen.hub().sequence > before, "the relay moved on")
            await _until(lambda: caught_up(client, st, history), "recovery", RECOVERY_S)
            assert client.counters()[proxy.address].get("channel_silent", 0) >= 1
        finally:
            await client.close()
            await proxy.close()
            await recorder.close()


def test_history_digest_is_of_the_words() -> None:
    a = np.arange(8, dtype=np.uint64)
    assert FilterHistory.digest(a) == FilterHistory.digest(a.copy())
    assert FilterHistory.digest(a) != FilterHistory.digest(a[::-1].copy())
