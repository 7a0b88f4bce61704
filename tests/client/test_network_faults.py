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
import os

import numpy as np
import pytest

from kvrelay.sim.config import SimConfig
from tests.support.faulty_proxy import DOWN, UP, FilterHistory
from tests.support.netfaults import HEARTBEAT_S, RECOVERY_S, faulty_relay, seeds, until

STEPS = int(os.environ.get("KVRELAY_NETFAULT_STEPS", "4"))


@pytest.mark.parametrize("seed", seeds("KVRELAY_NETFAULT_SEEDS"))
async def test_the_sdk_never_serves_a_wrong_filter_and_recovers_through_a_faulty_network(
    seed: int,
) -> None:
    async with faulty_relay(SimConfig(name="n0", seed=seed, dp_size=2, capacity_blocks=96)) as rig:
        client = await rig.client()
        audit = rig.audit(client)
        run = await rig.schedule(seed, salt=1)
        recorder, log = rig.recorder, rig.log

        def caught_up() -> bool:
            return rig.caught_up(client)

        await until(caught_up, "first install")
        for _ in range(STEPS):
            await run.fault(caught_up)
            assert not audit.wrong, (audit.wrong, log)
            assert not recorder.problems(), (recorder.problems(), log)
        await run.finish(caught_up)
    assert not audit.wrong, (audit.wrong, log)
    assert audit.checked > STEPS, audit.checked
    print(f"seed {seed}: {log}; relay side {run.side.counts}; {audit.checked} checked, "
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
    async with faulty_relay(SimConfig(name="n0", seed=1, dp_size=1, capacity_blocks=64)) as rig:
        client = await rig.installed()
        proxy = rig.proxy
        gen = rig.relay.pools[0].generation
        assert gen is not None
        before = gen.hub().sequence
        if fault == "blackhole":
            proxy.blackhole = True
            proxy.cut(rst=True)
            await asyncio.sleep(HEARTBEAT_S * 3 + 0.5)
            proxy.heal()
        else:
            proxy.stall_open(DOWN)  # for good: only a new connection flows
        await rig.engine.step(4)
        await until(lambda: gen.hub().sequence > before, "the relay moved on")
        await until(lambda: rig.caught_up(client), "recovery", RECOVERY_S)
        assert client.counters()[proxy.address].get("channel_silent", 0) >= 1


async def test_a_connection_dead_towards_the_relay_is_left_when_a_new_stream_goes_unheard() -> (
    None
):
    """The SDK's connection carries nothing towards the relay for good while TCP stays up, and
    the relay's streams still flow down (the catalog, readiness, the pool's heartbeats). The
    relay fences its pool: the catalog lists the new generation, and the SDK's subscription to
    it never arrives. That stream went silent before its first message again and again on the
    same connection, which its other streams kept looking alive, until grpclib's keepalive
    closed it. One unanswered round trip (``rpc.channel_deaf``) now replaces the channel."""
    async with faulty_relay(SimConfig(name="n2", seed=3, dp_size=1, capacity_blocks=64)) as rig:
        client = await rig.installed()
        relay = rig.relay
        rig.proxy.stall_open(UP)  # for good: only a new connection carries requests
        first = relay.pools[0].generation
        assert first is not None
        relay.pools[0].fence(first, "test: the relay ends the pool's streams")
        await rig.engine.step(3)
        await until(lambda: relay.pools[0].generation not in (None, first), "new generation")
        gen = relay.pools[0].generation
        assert gen is not None

        def served() -> bool:
            conn = client.connections[0]
            return any(
                s.installed is not None and s.installed.sequence == gen.hub().sequence
                and bytes(s.descriptor.producer) == bytes(gen.producer)
                for s in conn.slots.values()
            )

        await until(served, "the new generation installed", RECOVERY_S)
        assert client.counters()[rig.proxy.address].get("channel_deaf", 0) >= 1


def test_history_digest_is_of_the_words() -> None:
    a = np.arange(8, dtype=np.uint64)
    assert FilterHistory.digest(a) == FilterHistory.digest(a.copy())
    assert FilterHistory.digest(a) != FilterHistory.digest(a[::-1].copy())
