"""Seeded random audit of the SDK through a faulty network (``tests/support/faulty_proxy.py``).

A real relay fed by simulated engines serves a ``RelayClient`` through a TCP proxy that, at
seeded random points, delays bytes, splits writes into single bytes, stalls one direction past
the SDK's silence limit (the TCP connection stays up), cuts connections (RST or FIN),
half-closes one direction and black-holes new connections. At seeded random points, while a
fault is in place and right after it heals, the relay side acts too (``netfaults.RelaySide``):
a pool fenced (a new generation), reloads (an engine joins or leaves, a second pool comes and
goes, a ``ckf_seed`` change), an engine restart, a relay restart on the same port (a new relay
identity). Throughout, the promise a router relies on is checked: a replica the SDK holds as
installed equals, word for word, the relay's own filter for that producer at the sequence the
replica claims (strict direct subscribers of every generation record the relay's filter at
every sequence); otherwise the SDK reports the pool as not installed. After each fault heals,
the SDK holds every pool at the relay's current generation and sequence within a bounded
time.

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
from kvrelay.contract.limits import RelayLimits
from kvrelay.sim.config import SimConfig
from tests.support.client_stack import stack
from tests.support.faulty_proxy import DOWN, UP, FaultyProxy, FilterHistory
from tests.support.netfaults import (
    FAULTS,
    STALL_OPEN,
    Audit,
    Recorder,
    RelaySide,
    apply_fault,
    traffic,
)
from tests.support.netfaults import sdk_caught_up as caught_up
from tests.support.netfaults import until as _until

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


def _seeds() -> list[int]:
    spec = os.environ.get("KVRELAY_NETFAULT_SEEDS")
    if not spec:
        return [1]
    lo, _, hi = spec.partition(":")
    return list(range(int(lo), int(hi))) if hi else [int(lo)]


STEPS = int(os.environ.get("KVRELAY_NETFAULT_STEPS", "4"))


#: How often the relay side acts (``RelaySide``) while a fault is in place, and right after it
#: healed (before the recovery is awaited).
P_DURING, P_BETWEEN = 0.45, 0.3


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
        log: list[str] = []
        side = await RelaySide(st, random.Random(seed * 7919 + 1), log).start()
        stop = asyncio.Event()
        driver = asyncio.create_task(traffic(side.configured, random.Random(~seed), stop))
        acts: list[asyncio.Task[str]] = []
        try:
            await _until(lambda: caught_up(client, st, history), "first install")
            for _ in range(STEPS):
                kind = rnd.choice(FAULTS + STALL_OPEN)

                async def act_after(delay: float) -> str:
                    await asyncio.sleep(delay)
                    return await side.act()

                def started(kind: str, hold: float) -> None:
                    if rnd.random() < P_DURING:
                        acts.append(asyncio.create_task(act_after(rnd.uniform(0.0, hold))))

                await apply_fault(proxy, kind, rnd, log, 3 * HEARTBEAT_S, started)
                if rnd.random() < P_BETWEEN:
                    acts.append(asyncio.create_task(side.act()))
                while acts:
                    await acts.pop(0)
                await side.settle()
                t0 = time.monotonic()
                await _until(lambda: caught_up(client, st, history),
                             f"recovery after {log[-1]} (seed {seed}: {log})",
                             RECOVERY_S)  # fmt: skip
                log.append(f"recovered in {time.monotonic() - t0:.2f}s")
                assert not audit.wrong, (audit.wrong, log)
                assert not recorder.problems(), (recorder.problems(), log)
            stop.set()
            await driver
            await _until(lambda: caught_up(client, st, history), "final catch-up")
            assert not recorder.problems(), (recorder.problems(), log)
        finally:
            stop.set()
            driver.cancel()
            for task in acts:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await driver
            await audit.close()
            await client.close()
            await proxy.close()
            await recorder.close()
            await side.close()
        assert not audit.wrong, (audit.wrong, log)
        assert audit.checked > STEPS, audit.checked
        print(f"seed {seed}: {log}; relay side {side.counts}; {audit.checked} checked, "
              f"{audit.before_oracle} before the oracle")


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


async def test_a_connection_dead_towards_the_relay_is_left_when_a_new_stream_goes_unheard() -> (
    None
):
    """The SDK's connection carries nothing towards the relay for good while TCP stays up, and
    the relay's streams still flow down (the catalog, readiness, the pool's heartbeats). The
    relay fences its pool: the catalog lists the new generation, and the SDK's subscription to
    it never arrives. That stream went silent before its first message again and again on the
    same connection, which its other streams kept looking alive, until grpclib's keepalive
    closed it. One unanswered round trip (``rpc.channel_deaf``) now replaces the channel."""
    configs = [SimConfig(name="n2", seed=3, dp_size=1, capacity_blocks=64)]
    async with stack(configs, LIMITS, expected_blocks=1024) as st:
        relay = st.relay
        assert relay is not None
        await _until(lambda: relay.pools[0].generation is not None, "generation")
        history = FilterHistory()
        recorder = Recorder(st, history)
        proxy = await FaultyProxy("127.0.0.1", st.port).start()
        client = RelayClient([proxy.address], config=CONFIG)
        await client.start()
        try:
            await st.engines[0].step(4)
            await _until(lambda: caught_up(client, st, history), "first install")
            proxy.stall_open(UP)  # for good: only a new connection carries requests
            first = relay.pools[0].generation
            assert first is not None
            relay.pools[0].fence(first, "test: the relay ends the pool's streams")
            await st.engines[0].step(3)
            await _until(lambda: relay.pools[0].generation not in (None, first), "new generation")
            gen = relay.pools[0].generation
            assert gen is not None

            def served() -> bool:
                conn = client.connections[0]
                return any(
                    s.installed is not None and s.installed.sequence == gen.hub().sequence
                    and bytes(s.descriptor.producer) == bytes(gen.producer)
                    for s in conn.slots.values()
                )

            await _until(served, "the new generation installed", RECOVERY_S)
            assert client.counters()[proxy.address].get("channel_deaf", 0) >= 1
        finally:
            await client.close()
            await proxy.close()
            await recorder.close()


def test_history_digest_is_of_the_words() -> None:
    a = np.arange(8, dtype=np.uint64)
    assert FilterHistory.digest(a) == FilterHistory.digest(a.copy())
    assert FilterHistory.digest(a) != FilterHistory.digest(a[::-1].copy())
