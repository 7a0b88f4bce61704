"""Shared parts of the seeded network-fault audits (the SDK's and the mirror's).

``Recorder`` is the oracle's feed: a strict direct subscriber of the relay (its own channel, no
proxy) that records the relay's filter at every sequence in a ``FilterHistory``, and when each
sequence was first seen, so a frame that claims "nothing changed up to now" long after the relay
moved on can be called stale. ``Audit`` checks an SDK client's installed replicas against that
history. ``apply_fault`` starts one of ``FAULTS`` on a ``FaultyProxy``, holds it, and heals.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable

from grpclib.client import Channel

from kvrelay.client import RelayClient
from tests.support.client_stack import Stack
from tests.support.faulty_proxy import DOWN, UP, FaultyProxy, FilterHistory
from tests.support.rig import Consumer
from tests.support.timing import scaled

FAULTS = ("delay", "split", "stall_down", "stall_up", "rst", "fin", "half_down", "half_up",
          "blackhole", "none")  # fmt: skip
#: Also: the connections open now stall for good in one direction (a path that died while TCP
#: stays up); connections made later flow.
STALL_OPEN = ("stall_open_down", "stall_open_up")


class Recorder:
    """A strict direct subscriber of the relay's one pool: the relay's filter per sequence."""

    def __init__(self, st: Stack, history: FilterHistory) -> None:
        relay = st.relay
        assert relay is not None and relay.pools[0].generation is not None
        gen = relay.pools[0].generation
        self.channel = Channel("127.0.0.1", st.port)
        self.producer = bytes(gen.producer)
        self.consumer = Consumer(self.channel, gen.producer, relay.relay_identity, "oracle")
        #: wall-clock time each sequence was first seen (the relay published it about then;
        #: wall clock, to compare with the ``send_ts_us`` stamps of other subscribers' frames)
        self.seen_at: dict[int, float] = {}
        replica = self.consumer.replica
        feed = replica.feed

        def recorded(fu: object) -> None:
            feed(fu)  # type: ignore[arg-type]
            if replica.table is not None and replica.sequence is not None:
                history.record(self.producer, replica.sequence, replica.table)
                self.seen_at.setdefault(replica.sequence, time.time())

        replica.feed = recorded  # type: ignore[method-assign]
        self.consumer.start()

    def superseded_at(self, sequence: int) -> float | None:
        """When (wall clock) the relay published the sequence after ``sequence`` (None: not
        yet)."""
        return self.seen_at.get(sequence + 1)

    async def close(self) -> None:
        await self.consumer.stop()
        self.channel.close()


class Audit:
    """Checks an SDK client's promise every few milliseconds: an installed replica equals the
    relay's filter at the sequence it claims."""

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


async def traffic(
    st: Stack, rnd: random.Random, stop: asyncio.Event, quiet: float = 0.0
) -> None:
    """Engine steps at random small intervals until ``stop``; with probability ``quiet`` after
    a step, a quiet spell of a few heartbeat periods (the relay then sends heartbeats, which a
    consumer's vouching and silence rules depend on)."""
    while not stop.is_set():
        e = rnd.choice(st.engines)
        await e.step(rnd.randint(1, 4))
        pause = rnd.uniform(0.4, 1.5) if rnd.random() < quiet else rnd.uniform(0.005, 0.05)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), pause)


async def apply_fault(
    proxy: FaultyProxy, kind: str, rnd: random.Random, log: list[str], silence_s: float,
    on_start: Callable[[str, float], None] | None = None,
) -> None:  # fmt: skip
    """Start ``kind`` (of ``FAULTS`` or ``STALL_OPEN``), hold it a while, then heal. The
    stalls and the black hole are held longer than ``silence_s`` (the consumer's silence
    limit). ``on_start(kind, hold)`` is called once the fault is in place."""
    hold = rnd.uniform(0.2, 0.8)
    if kind == "delay":
        d = proxy.directions[rnd.choice((UP, DOWN))]
        d.delay_s = rnd.uniform(0.1, 0.4)
    elif kind == "split":
        proxy.directions[rnd.choice((UP, DOWN))].split = True
    elif kind in ("stall_down", "stall_up"):
        proxy.stall(DOWN if kind == "stall_down" else UP)
        hold = silence_s + rnd.uniform(0.3, 1.0)
    elif kind in ("stall_open_down", "stall_open_up"):
        proxy.stall_open(DOWN if kind == "stall_open_down" else UP)  # for good
        hold = silence_s + rnd.uniform(0.3, 1.0)
    elif kind in ("rst", "fin"):
        proxy.cut(rst=kind == "rst")
    elif kind in ("half_down", "half_up"):
        proxy.half_close(DOWN if kind == "half_down" else UP)
    elif kind == "blackhole":
        proxy.blackhole = True
        proxy.cut(rst=rnd.random() < 0.5)  # the reconnection lands in the hole
        hold = silence_s + rnd.uniform(0.3, 1.0)
    if on_start is not None:
        on_start(kind, hold)
    log.append(f"{kind} for {hold:.2f}s")
    await asyncio.sleep(hold)
    proxy.heal()


async def until(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Poll ``check`` every 10 ms until true; fail after ``scaled(timeout)``."""
    deadline = time.monotonic() + scaled(timeout)
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
