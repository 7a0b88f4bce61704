"""Shared parts of the seeded network-fault audits (the SDK's and the mirror's).

``faulty_relay`` sets up what every such test stands on: a relay fed by one simulated engine, a
``FaultyProxy`` in front of it and the oracle; the ``Rig`` it yields closes what a test opens on
it, last opened first. ``Recorder`` is the oracle's feed: a strict direct subscriber of the relay
(its own channel, no proxy) that records the relay's filter at every sequence in a
``FilterHistory``, and when each sequence was first seen, so a frame that claims "nothing changed
up to now" long after the relay moved on can be called stale. ``Verifier`` checks what a
downstream subscriber holds against that history; ``Audit`` does so for an SDK client's installed
replicas. ``apply_fault`` starts one of ``FAULTS`` on a ``FaultyProxy``, holds it, and heals;
``Schedule`` is an audit's seeded run of them, with traffic and relay-side events.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence

import numpy as np
from grpclib.client import Channel

from kvrelay.client import ClientConfig, RelayClient
from kvrelay.contract.limits import RelayLimits
from kvrelay.relay.generation import Generation
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.client_stack import Stack, stack
from tests.support.faulty_proxy import DOWN, UP, FaultyProxy, FilterHistory
from tests.support.rig import Consumer, start_relay
from tests.support.timing import scaled

HEARTBEAT_S = 0.3
#: The consumers' silence limit: the SDK's (``CONFIG``) and a mirror's for its upstream streams
#: (three upstream heartbeat periods).
SILENCE_S = 3 * HEARTBEAT_S
LIMITS = RelayLimits(
    pool_heartbeat_s=HEARTBEAT_S, readiness_heartbeat_s=HEARTBEAT_S,
    publication_queue_capacity=4096, publication_queue_bytes=64 << 20,
)  # fmt: skip
CONFIG = ClientConfig(
    heartbeat_interval_s=HEARTBEAT_S, silence_heartbeats=3, backoff_initial_s=0.02,
    backoff_max_s=0.3, watch_load=False, watch_serving_load=False,
)  # fmt: skip
#: After a fault heals, every reader is back at the relay's sequence within this (scaled) time:
#: a few silence limits and backoffs, far below grpclib's keepalive (a ping 20 s in, 10 s to
#: answer, at most one per 300 s on a connection).
RECOVERY_S = 8.0
#: How often the relay side acts (``RelaySide``) while a fault is in place, and right after it
#: healed (before the recovery is awaited).
P_DURING, P_BETWEEN = 0.45, 0.3

FAULTS = ("delay", "split", "stall_down", "stall_up", "rst", "fin", "half_down", "half_up",
          "blackhole", "none")  # fmt: skip
#: Also: the connections open now stall for good in one direction (a path that died while TCP
#: stays up); connections made later flow.
STALL_OPEN = ("stall_open_down", "stall_open_up")


def seeds(env: str) -> list[int]:
    """The seeds a long run names in ``env`` (``LO:HI`` or one seed); seed 1 by default."""
    spec = os.environ.get(env)
    if not spec:
        return [1]
    lo, _, hi = spec.partition(":")
    return list(range(int(lo), int(hi))) if hi else [int(lo)]


class _Feed:
    """The oracle's subscription to one generation (one producer) of the relay."""

    def __init__(self, channel: Channel, gen: Generation, relay: Relay, history: FilterHistory,
                 pool: str) -> None:  # fmt: skip
        self.pool = pool
        self.producer = bytes(gen.producer)
        self.generation = gen
        self.consumer = Consumer(channel, gen.producer, relay.relay_identity, "oracle")
        #: wall-clock time each sequence was first seen (the relay published it about then;
        #: wall clock, to compare with the ``send_ts_us`` stamps of other subscribers' frames)
        self.seen_at: dict[int, float] = {}
        replica = self.consumer.replica
        feed = replica.feed
        producer = self.producer

        def recorded(fu: object) -> None:
            feed(fu)  # type: ignore[arg-type]
            if replica.table is not None and replica.sequence is not None:
                history.record(producer, replica.sequence, replica.table)
                self.seen_at.setdefault(replica.sequence, time.time())

        replica.feed = recorded  # type: ignore[method-assign]
        self.consumer.start()

    @property
    def sequence(self) -> int | None:
        return self.consumer.replica.sequence


class Recorder:
    """Strict direct subscribers of every generation of every pool of the relay (its own
    channel, no proxy): the relay's filter per producer and sequence. It looks at the relay in
    process every few milliseconds and subscribes to each new generation at once (before a
    catalog round trip could bring anyone else), on a new channel when the relay restarted."""

    def __init__(self, st: Stack, history: FilterHistory) -> None:
        self.st = st
        self.history = history
        self.feeds: dict[bytes, _Feed] = {}
        self._relay: Relay | None = None
        self._channels: list[Channel] = []
        self.poll()
        self.task = asyncio.create_task(self._run())

    def poll(self) -> None:
        relay = self.st.relay
        if relay is None:
            return
        if relay is not self._relay:
            self._relay = relay
            self._channels.append(Channel("127.0.0.1", self.st.port))
        for p in relay.pools:
            gen = p.generation
            if gen is None or gen.retired or bytes(gen.producer) in self.feeds:
                continue
            self.feeds[bytes(gen.producer)] = _Feed(self._channels[-1], gen, relay, self.history,
                                                    p.name)  # fmt: skip

    async def _run(self) -> None:
        while True:
            self.poll()
            await asyncio.sleep(0.002)

    def current(self, pool_index: int = 0) -> _Feed | None:
        """The feed of the relay's live generation of ``relay.pools[pool_index]``."""
        relay = self.st.relay
        if relay is None or pool_index >= len(relay.pools):
            return None
        gen = relay.pools[pool_index].generation
        return None if gen is None else self.feeds.get(bytes(gen.producer))

    @property
    def producer(self) -> bytes:
        """The producer of the relay's first pool now."""
        feed = self.current()
        assert feed is not None
        return feed.producer

    def superseded_at(self, producer: bytes, sequence: int) -> float | None:
        """When (wall clock) the relay published the sequence after ``sequence`` of
        ``producer`` (None: not yet, or a generation that ended there)."""
        feed = self.feeds.get(producer)
        return None if feed is None else feed.seen_at.get(sequence + 1)

    def problems(self) -> list[str]:
        """The subscriptions to live generations that ended or broke (the relay must not end
        a live generation's stream; a direct subscriber sees no network fault)."""
        relay = self.st.relay
        out: list[str] = []
        for p in () if relay is None else relay.pools:
            gen = p.generation
            feed = None if gen is None else self.feeds.get(bytes(gen.producer))
            if feed is None or gen is None or gen.retired:
                continue
            task = feed.consumer.task
            if feed.consumer.end is not None:
                out.append(f"{p.name}: the oracle's stream ended {feed.consumer.end}")
            elif task is not None and task.done() and task.exception() is not None:
                out.append(f"{p.name}: the oracle's stream raised {task.exception()!r}")
        return out

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        for feed in self.feeds.values():
            await feed.consumer.stop()
            task = feed.consumer.task
            if task is not None and task.done() and not task.cancelled():
                task.exception()  # retrieved: a stream that a relay restart cut
        for ch in self._channels:
            ch.close()


class Verifier:
    """What a downstream subscriber holds, checked against the oracle's history. A replica at a
    sequence the oracle has not recorded yet is checked again later (``check_pending``): the
    relay must publish that sequence, with that filter."""

    def __init__(self, history: FilterHistory) -> None:
        self.history = history
        self.wrong: list[str] = []
        self.pending: list[tuple[bytes, int, bytes, float]] = []
        #: replicas at a sequence before the oracle's first one of that producer (the
        #: subscriber came first): not verifiable, counted
        self.before_oracle = 0

    def verify(self, producer: bytes, seq: int, table: np.ndarray, where: str = "") -> None:
        """``table`` is the relay's filter of ``producer`` at ``seq`` (``where``: who holds it)."""
        verdict = self.history.verdict(producer, seq, table)
        if verdict is False:
            self.wrong.append(f"{where}at {seq}: not the relay's filter")
        elif verdict is None:
            self.pending.append((producer, seq, FilterHistory.digest(table), time.monotonic()))

    def check_pending(self) -> bool:
        """Check the replicas whose sequence the history lacked before; True when none is left."""
        still = []
        for producer, seq, digest, since in self.pending:
            want = self.history.digests.get((producer, seq))
            first = self.history.first.get(producer)
            if want is None and first is not None and seq < first:
                self.before_oracle += 1
            elif want is None:
                if time.monotonic() - since > scaled(10):
                    self.wrong.append(f"sequence {seq} never published by the relay")
                else:
                    still.append((producer, seq, digest, since))
            elif want != digest:
                self.wrong.append(f"at {seq}: not the relay's filter (checked late)")
        self.pending = still
        return not still


class Audit(Verifier):
    """Checks an SDK client's promise every few milliseconds: an installed replica equals the
    relay's filter at the sequence it claims."""

    def __init__(self, client: RelayClient, history: FilterHistory) -> None:
        super().__init__(history)
        self.client = client
        self.checked = 0
        self._seen: dict[object, tuple[int, int]] = {}
        self.task = asyncio.create_task(self._run())

    def check_now(self) -> None:
        for conn in self.client.connections:
            for slot in conn.slots.values():
                replica = slot.installed
                if replica is None or replica.table is None or replica.sequence is None:
                    continue
                seq = replica.sequence
                if self._seen.get(slot.key) == (id(replica), seq):
                    continue
                self._seen[slot.key] = (id(replica), seq)
                self.checked += 1
                self.verify(bytes(slot.descriptor.producer), seq, replica.table, f"{slot.key} ")
        self.check_pending()

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
    engines: Callable[[], Sequence[SimEngine]], rnd: random.Random, stop: asyncio.Event,
    quiet: float = 0.0,
) -> None:  # fmt: skip
    """Engine steps (of the engines ``engines()`` names now) at random small intervals until
    ``stop``; with probability ``quiet`` after a step, a quiet spell of a few heartbeat periods
    (the relay then sends heartbeats, which a consumer's vouching and silence rules depend
    on)."""
    while not stop.is_set():
        live = engines()
        if live:
            await rnd.choice(live).step(rnd.randint(1, 4))
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


MAIN, SECOND = "generate", "second"
#: What the relay side does, and how often (``RelaySide.act``).
ACTIONS = ("fence", "member", "pool", "regen", "engine_restart", "relay_restart")
WEIGHTS = (3, 2, 2, 2, 2, 1)


class RelaySide:
    """The relay's own events, at the audits' seeded random points: a pool fenced (a new
    generation), reloads (an engine joins or leaves the first pool, a second pool comes and
    goes, a ``ckf_seed`` change re-materializes a pool), an engine restart (``kvrelay.sim``: a
    new incarnation) and a relay restart on the same port (a new relay identity)."""

    def __init__(self, st: Stack, rnd: random.Random, log: list[str]) -> None:
        self.st = st
        self.rnd = rnd
        self.log = log
        first = st.engines[0]
        self.spare = [SimEngine(SimConfig(name=f"{first.cfg.name}-{x}", seed=first.cfg.seed + i,
                                          dp_size=1, capacity_blocks=64))
                      for i, x in enumerate(("join", "pool2"), 1)]  # fmt: skip
        self.engines = {e.cfg.name: e for e in [*st.engines, *self.spare]}
        self.members: dict[str, list[str]] = {MAIN: [e.cfg.name for e in st.engines]}
        assert st.relay is not None
        self.seeds = {MAIN: st.relay.settings.pools[0].ckf_seed, SECOND: 5}
        self.restarting: set[str] = set()  # engines in a restart: no traffic meanwhile
        self.counts: dict[str, int] = dict.fromkeys(ACTIONS, 0)
        #: the identities (bytes) of the relays stopped by ``restart_relay``, from its start
        self.stopped_relays: set[bytes] = set()

    async def start(self) -> RelaySide:
        for e in self.spare:
            await e.start()
        return self

    async def close(self) -> None:
        for e in self.spare:
            with contextlib.suppress(Exception):
                await e.stop()

    def configured(self) -> list[SimEngine]:
        """The engines of the configured pools, not restarting (what traffic drives)."""
        return [self.engines[n] for names in self.members.values() for n in names
                if n not in self.restarting]  # fmt: skip

    def settings(self) -> RelaySettings:
        relay = self.st.relay
        assert relay is not None
        pools = tuple(
            PoolSpec(
                namespace="ns", component="backend", endpoint=name,
                engines=tuple(EngineSpec(name=n, host="127.0.0.1",
                                         grpc_port=self.engines[n].grpc_port) for n in names),
                expected_blocks=self.st.expected_blocks, ckf_seed=self.seeds[name],
            )
            for name, names in self.members.items()
        )  # fmt: skip
        return dataclasses.replace(relay.settings, pools=pools)

    def sources(self) -> int:
        return sum(self.engines[n].cfg.dp_size for names in self.members.values() for n in names)

    def live(self) -> bool:
        """Every configured source subscribed and live, every pool with a generation."""
        relay = self.st.relay
        if relay is None or len(relay.pools) != len(self.members):
            return False
        subs = [s for p in relay.pools for s in p.subscribers.values()]
        return (len(subs) == self.sources() and all(s.state == "live" for s in subs)
                and all(p.generation is not None for p in relay.pools))  # fmt: skip

    async def _reload(self) -> None:
        relay = self.st.relay
        assert relay is not None
        await relay.reconfigure(self.settings())

    async def act(self, kind: str | None = None) -> str:
        """One relay-side event (``kind`` of ``ACTIONS``, else a seeded random one); returns
        what it did. It does not wait for the fleet to settle: faults may be in place."""
        rnd = self.rnd
        kind = kind or rnd.choices(ACTIONS, weights=WEIGHTS)[0]
        relay = self.st.relay
        assert relay is not None
        what = kind
        if kind == "fence":
            pools = [p for p in relay.pools if p.generation is not None]
            if pools:
                p = rnd.choice(pools)
                gen = p.generation
                assert gen is not None
                # fences that repeat within a minute back off (up to 30 s): that is not what
                # the audit is about, every fence here rebuilds at once
                p._fence_streak = 0
                p.fence(gen, "test: the relay fences the pool")
                what = f"fence {p.name}"
        elif kind == "member":
            joiner = self.spare[0].cfg.name
            names = self.members[MAIN]
            self.members[MAIN] = [n for n in names if n != joiner] if joiner in names else [
                *names, joiner]  # fmt: skip
            what = f"{MAIN} engines {self.members[MAIN]}"
            await self._reload()
        elif kind == "pool":
            if SECOND in self.members:
                del self.members[SECOND]
                what = f"{SECOND} removed"
            else:
                self.members[SECOND] = [self.spare[1].cfg.name]
                what = f"{SECOND} added"
            await self._reload()
        elif kind == "regen":
            name = rnd.choice(sorted(self.members))
            self.seeds[name] = rnd.randint(1, 1 << 30)
            what = f"ckf_seed of {name}"
            await self._reload()
        elif kind == "engine_restart":
            names = [n for ns in self.members.values() for n in ns]
            name = rnd.choice(names)
            self.restarting.add(name)
            try:
                await self.engines[name].restart()
            finally:
                self.restarting.discard(name)
            what = f"engine {name} restarted"
        else:
            await self.restart_relay()
            what = "relay restarted"
        self.counts[kind] += 1
        self.log.append(f"[{what}]")
        return what

    async def restart_relay(self) -> None:
        """A new relay (a new identity) on the same port, with the settings in force."""
        st = self.st
        settings = self.settings()
        assert st.relay is not None
        self.stopped_relays.add(bytes(st.relay.relay_identity))
        await st.stop_relay()
        for attempt in range(100):
            try:
                relay, server = await start_relay(settings, port=st.port)
                break
            except OSError:
                if attempt == 99:
                    raise
                await asyncio.sleep(0.05)
        st.relay, st.server = relay, server

    async def settle(self) -> None:
        await until(self.live, f"the relay side live ({self.log[-3:]})")


def sdk_caught_up(client: RelayClient, st: Stack, history: FilterHistory) -> bool:
    """Every pool of the relay installed by the SDK at the relay's current generation and
    sequence, with the relay's filter; readiness known."""
    relay = st.relay
    if relay is None or not client.connections:
        return False
    conn = client.connections[0]
    if conn.readiness is None or len(conn.slots) != len(relay.pools):
        return False
    if conn.identity_msg is None or bytes(conn.identity_msg) != bytes(relay.relay_identity):
        return False
    current = {}
    for p in relay.pools:
        gen = p.generation
        if gen is None:
            return False
        current[p.spec.endpoint] = gen
    for slot in conn.slots.values():
        gen = current.get(slot.key.endpoint)
        r = slot.installed
        if gen is None or r is None or r.sequence != gen.sequence:
            return False
        producer = bytes(gen.producer)
        if bytes(slot.descriptor.producer) != producer:
            return False
        if history.verdict(producer, r.sequence, r.table) is not True:
            return False
    return True


class Schedule:
    """An audit's seeded run (``Rig.schedule``): engine traffic throughout and, per ``fault``,
    one of ``FAULTS`` or ``STALL_OPEN`` on the proxy, relay-side events while it is in place
    (``P_DURING``) and right after it heals (``P_BETWEEN``), the relay side settled, then every
    reader back at the relay within ``RECOVERY_S``."""

    def __init__(self, rig: Rig, side: RelaySide, seed: int, quiet: float) -> None:
        self.rig = rig
        self.side = side
        self.seed = seed
        self.log = rig.log
        self.rnd = random.Random(seed)
        self.acts: list[asyncio.Task[str]] = []
        self.stop = asyncio.Event()
        self.driver = asyncio.create_task(traffic(side.configured, random.Random(~seed),
                                                  self.stop, quiet))  # fmt: skip

    async def _act_after(self, delay: float) -> str:
        await asyncio.sleep(delay)
        return await self.side.act()

    async def fault(
        self, caught_up: Callable[[], bool], *, silence_s: float = SILENCE_S,
        on_start: Callable[[str, float], None] | None = None,
        on_heal: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        """One seeded fault, through the recovery (``caught_up``). ``on_start(kind, hold)``:
        the fault is in place (before any relay-side event it draws); ``on_heal()``: healed."""
        rnd, log = self.rnd, self.log

        def started(kind: str, hold: float) -> None:
            if on_start is not None:
                on_start(kind, hold)
            if rnd.random() < P_DURING:
                self.acts.append(asyncio.create_task(self._act_after(rnd.uniform(0.0, hold))))

        await apply_fault(self.rig.proxy, rnd.choice(FAULTS + STALL_OPEN), rnd, log, silence_s,
                          started)  # fmt: skip
        if on_heal is not None:
            on_heal()
        if rnd.random() < P_BETWEEN:
            self.acts.append(asyncio.create_task(self.side.act()))
        while self.acts:
            await self.acts.pop(0)
        await self.side.settle()
        t0 = time.monotonic()
        await until(caught_up, f"recovery after {log[-1]} (seed {self.seed}: {log})", RECOVERY_S)
        log.append(f"recovered in {time.monotonic() - t0:.2f}s")

    async def finish(self, caught_up: Callable[[], bool]) -> None:
        """The traffic stops; every reader catches up; the oracle's streams are whole."""
        self.stop.set()
        await self.driver
        await until(caught_up, "final catch-up")
        recorder = self.rig.recorder
        assert not recorder.problems(), (recorder.problems(), self.log)

    async def close(self) -> None:
        self.stop.set()
        self.driver.cancel()
        for task in self.acts:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.driver


class Rig:
    """What ``faulty_relay`` set up. What a test opens on it (``client``, ``audit``,
    ``schedule``, ``channel``, ``exits``) is closed when the test leaves it, last opened first,
    then the proxy, the oracle, and last the relay side's spare engines."""

    def __init__(self, st: Stack, exits: contextlib.AsyncExitStack) -> None:
        self.st = st
        self.exits = exits
        self.history = FilterHistory()
        self.log: list[str] = []  # what the faults and the relay side did
        self.side: RelaySide | None = None
        self._recorder: Recorder | None = None
        self.proxy = FaultyProxy("127.0.0.1", st.port)

    @property
    def relay(self) -> Relay:
        """The relay now (a relay restart replaces it)."""
        assert self.st.relay is not None
        return self.st.relay

    @property
    def engine(self) -> SimEngine:
        return self.st.engines[0]

    @property
    def recorder(self) -> Recorder:
        assert self._recorder is not None, "faulty_relay(record=False)"
        return self._recorder

    def caught_up(self, client: RelayClient) -> bool:
        return sdk_caught_up(client, self.st, self.history)

    def channel(self, port: int) -> Channel:
        ch = Channel("127.0.0.1", port)
        self.exits.callback(ch.close)
        return ch

    async def client(self, address: str | None = None) -> RelayClient:
        """An SDK client (``CONFIG``) of ``address``, else of the relay through the proxy."""
        client = RelayClient([address or self.proxy.address], config=CONFIG)
        await client.start()
        self.exits.push_async_callback(client.close)
        return client

    async def installed(self) -> RelayClient:
        """An SDK client through the proxy, once it holds the relay's pool after a few engine
        steps."""
        client = await self.client()
        await self.engine.step(4)
        await until(lambda: self.caught_up(client), "first install")
        return client

    def audit(self, client: RelayClient) -> Audit:
        audit = Audit(client, self.history)
        self.exits.push_async_callback(audit.close)
        return audit

    async def schedule(self, seed: int, salt: int, quiet: float = 0.0) -> Schedule:
        """The relay side (seeded ``seed * 7919 + salt``) and the seeded run of faults and
        traffic; the run stops first when the test leaves the rig."""
        self.side = await RelaySide(self.st, random.Random(seed * 7919 + salt), self.log).start()
        run = Schedule(self, self.side, seed, quiet)
        self.exits.push_async_callback(run.close)
        return run

    async def _start(self, record: bool) -> None:
        self.exits.push_async_callback(self._close_side)  # closed last, whenever it started
        if record:
            self._recorder = Recorder(self.st, self.history)
            self.exits.push_async_callback(self._recorder.close)
        await self.proxy.start()
        self.exits.push_async_callback(self.proxy.close)

    async def _close_side(self) -> None:
        if self.side is not None:
            await self.side.close()


@contextlib.asynccontextmanager
async def faulty_relay(engine: SimConfig, *, record: bool = True) -> AsyncIterator[Rig]:
    """A relay (``LIMITS``) fed by one simulated engine, once its pool has a generation; a
    ``FaultyProxy`` in front of it; with ``record``, the oracle (``Recorder``) subscribed to it
    directly."""
    async with stack([engine], LIMITS, expected_blocks=1024) as st:
        relay = st.relay
        assert relay is not None
        await until(lambda: relay.pools[0].generation is not None, "generation")
        async with contextlib.AsyncExitStack() as exits:
            rig = Rig(st, exits)
            await rig._start(record)
            yield rig
