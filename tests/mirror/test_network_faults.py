"""Seeded random audit of a mirror whose upstream link goes through a faulty network.

A real relay fed by simulated engines is mirrored through a TCP proxy
(``tests/support/faulty_proxy.py``) that, at seeded random points, delays bytes, splits writes
into single bytes, stalls one direction past the mirror's silence limit (TCP stays up), cuts
connections (RST or FIN), half-closes one direction and black-holes new connections. At seeded
random points, during a fault and right after it heals, the relay side acts too
(``netfaults.RelaySide``: a fence, reloads, an engine restart, a relay restart). Downstream,
on a direct channel to the mirror, a strict raw subscriber (resubscribing whenever its stream
ends, to the first pool's generation at that time) and an SDK client read the mirror.
Throughout:

* every frame a downstream subscriber accepts leaves its replica equal, word for word, to the
  upstream relay's own filter for that producer at that sequence (direct subscribers of every
  generation of the relay record it);
* a heartbeat or snapshot says "nothing changed up to now": the mirror sends none while it
  cannot vouch for its state (upstream silent past 1.5 of its heartbeat periods + 0.25 s, or
  no upstream stream), and none at a sequence the relay left well before it was sent;
* streams end with a status (PUBLICATION_UNAVAILABLE; POOL_NOT_FOUND or PRODUCER_CHANGED for a
  generation the mirror has not heard of yet or has left), never a cut or a clean EOF, and a
  stream open when the upstream went silent is ended, not left hanging;
* after each fault heals, the mirror, the raw subscriber and the SDK are back at the relay's
  current generations and sequences within a few heartbeat periods and backoffs, and the
  catalog and readiness planes read through the mirror equal the relay's.

Long run: ``KVRELAY_MIRROR_NETFAULT_SEEDS=100:140 [KVRELAY_MIRROR_NETFAULT_STEPS=10]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from grpclib.client import Channel
from grpclib.const import Status

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import RelayClient
from kvrelay.sim.config import SimConfig
from tests.support.client_stack import Stack
from tests.support.faulty_proxy import DOWN, UP, FilterHistory
from tests.support.mirror_rig import Mirrored, start_mirror
from tests.support.netfaults import (
    HEARTBEAT_S,
    LIMITS,
    RECOVERY_S,
    Recorder,
    Rig,
    Verifier,
    faulty_relay,
    sdk_caught_up,
    seeds,
    until,
)
from tests.support.rig import MARKER, Consumer, StreamEnd, first_matching

MIRROR: dict[str, Any] = {
    "upstream_heartbeat_s": HEARTBEAT_S, "upstream_readiness_s": HEARTBEAT_S,
    "backoff_initial_s": 0.02, "backoff_max_s": 0.3, "sync_wait_s": 1.0,
}  # fmt: skip
#: How long the mirror vouches after an upstream frame (its silence limit for an upstream
#: stream is ``netfaults.SILENCE_S``).
VOUCH_S = 1.5 * HEARTBEAT_S + 0.25
#: Scheduling slack on the vouching checks (everything shares one loop on a 2-core machine).
SLACK_S = 0.6
#: Extra slack while bytes are delayed or trickle (the mirror vouches for what it received).
SLOW_LINK_S = 1.5
ALLOWED_ENDS = {
    (Status.UNAVAILABLE, "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"),
    (Status.NOT_FOUND, "RELAY_ERROR_REASON_POOL_NOT_FOUND"),
    (Status.FAILED_PRECONDITION, "RELAY_ERROR_REASON_PRODUCER_CHANGED"),
}
STEPS = int(os.environ.get("KVRELAY_MIRROR_NETFAULT_STEPS", "3"))


async def mirror_of(rig: Rig) -> Mirrored:
    """A mirror of the relay through the faulty proxy, closed with the rig."""
    m = await start_mirror(rig.proxy.port, limits=LIMITS, **MIRROR)
    rig.exits.push_async_callback(m.close)
    return m


@dataclass
class Faults:
    """When the upstream link could carry nothing to the mirror, and when it was slow."""

    blocked_from: float | None = None  # wall clock: a stall towards the mirror / a black hole
    healed_at: float | None = None
    slow_until: float = 0.0  # wall clock: delays or 1-byte writes (plus their backlog)
    log: list[str] = field(default_factory=list)

    def started(self, kind: str, hold: float) -> None:
        now = time.time()
        self.blocked_from = now if kind in ("stall_down", "blackhole") else None
        self.healed_at = None
        if kind in ("delay", "split"):
            self.slow_until = now + hold + SLOW_LINK_S

    def healed(self) -> None:
        self.healed_at = time.time()


class Watcher(Verifier):
    """A strict raw subscriber of the mirror's pool, subscribing again whenever its stream
    ends; checks every frame it accepts against the relay's history."""

    def __init__(
        self, channel: Channel, st: Stack, recorder: Recorder, history: FilterHistory,
        faults: Faults,
    ) -> None:  # fmt: skip
        super().__init__(history)
        self.channel = channel
        self.st = st
        self.recorder = recorder
        self.faults = faults
        self.consumer: Consumer | None = None
        self.producer = b""  # of the stream open now
        #: the relays that a restart stopped (``RelaySide.stopped_relays``): a stream of one
        #: may end with a clean EOF, as every stream of a relay that shuts down
        self.stopped_relays: set[bytes] = set()
        self.ends: list[tuple[float, StreamEnd, bytes]] = []
        self.frames = 0
        self.streams = 0
        self.vouching = 0  # heartbeats and snapshots checked for freshness
        self.vouching_blocked = 0  # of those, sent while the upstream link was blocked
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            relay = self.st.relay
            gen = None if relay is None else relay.pools[0].generation
            if relay is None or gen is None or gen.retired:
                await asyncio.sleep(0.01)
                continue
            # the relay's first pool as it is now (it follows fences, reloads, restarts)
            c = Consumer(self.channel, gen.producer, relay.relay_identity, "watcher")
            self.producer = bytes(gen.producer)
            self._wrap(c, self.producer)
            self.consumer = c
            self.streams += 1
            c.start()
            assert c.task is not None
            try:
                await c.task
            except Exception as exc:  # a frame the strict replica refused
                self.wrong.append(f"stream {self.streams}: {exc!r}")
                c.end = StreamEnd(Status.UNKNOWN, repr(exc))
            assert c.end is not None
            self.ends.append((time.time(), c.end, bytes(relay.relay_identity)))
            await asyncio.sleep(0.05)

    def _wrap(self, c: Consumer, producer: bytes) -> None:
        replica = c.replica
        feed = replica.feed

        def checked(fu: pb.FilterUpdate) -> None:
            feed(fu)
            if replica.table is None or replica.sequence is None:
                return  # a snapshot still being assembled
            self.frames += 1
            seq = replica.sequence
            self.verify(producer, seq, replica.table)
            if fu.kind != pb.FilterUpdateKind.DELTA:
                self._vouched(fu, producer, seq)

        replica.feed = checked  # type: ignore[method-assign]

    def _vouched(self, fu: pb.FilterUpdate, producer: bytes, seq: int) -> None:
        """A heartbeat or snapshot (stamped by the mirror when sent) claims the state at
        ``seq`` is current: not while the link was blocked past the vouching window, and not
        long after the relay published the next sequence."""
        sent = fu.send_ts_us / 1e6
        kind = pb.FilterUpdateKind(fu.kind).name
        f = self.faults
        self.vouching += 1
        if f.blocked_from is not None and sent > f.blocked_from and f.healed_at is None:
            self.vouching_blocked += 1
        if (f.blocked_from is not None and sent > f.blocked_from + VOUCH_S + SLACK_S
                and (f.healed_at is None or sent < f.healed_at)):  # fmt: skip
            self.wrong.append(f"{kind} at {seq} sent {sent - f.blocked_from:.2f}s into a blocked "
                              f"upstream link ({f.log[-1:]})")  # fmt: skip
        nxt = self.recorder.superseded_at(producer, seq)
        allowed = VOUCH_S + SLACK_S + (SLOW_LINK_S if sent < f.slow_until else 0.0)
        if nxt is not None and sent - nxt > allowed:
            self.wrong.append(f"{kind} at {seq} sent {sent - nxt:.2f}s after the relay published "
                              f"{seq + 1} ({f.log[-1:]})")  # fmt: skip

    def bad_ends(self) -> list[str]:
        """Ends that are not a status: a cut stream, a clean EOF (no upstream shut down here),
        or a status other than PUBLICATION_UNAVAILABLE (a mirror without the upstream's pool)
        or, the relay side having moved on, POOL_NOT_FOUND / PRODUCER_CHANGED (a generation
        the mirror has not heard of yet, or left already); a clean EOF only for a stream of a
        relay that a restart stopped."""
        return [
            str(end) for _, end, relay in self.ends
            if (end.status, end.reason) not in ALLOWED_ENDS
            and not (end.status is None and relay in self.stopped_relays)
        ]  # fmt: skip

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        if self.consumer is not None:
            await self.consumer.stop()
        self.check_pending()


def all_caught_up(
    st: Stack, m: Mirrored, watcher: Watcher, client: RelayClient, recorder: Recorder,
    history: FilterHistory,
) -> bool:  # fmt: skip
    """Every pool of the relay: the oracle, the mirror's hub at the relay's current generation
    and sequence; the raw subscriber on the first pool there too, with the relay's filter; the
    SDK likewise for every pool."""
    relay = st.relay
    if relay is None:
        return False
    for i, p in enumerate(relay.pools):
        gen = p.generation
        feed = recorder.current(i)
        if gen is None or feed is None or feed.sequence != gen.sequence:
            return False
        hub = m.mirror.hub_for(gen.producer)
        if hub is None or hub.sequence != gen.sequence:
            return False
        if i == 0:
            c = watcher.consumer
            if c is None or watcher.producer != feed.producer or c.end is not None:
                return False
            if c.replica.sequence != gen.sequence or history.verdict(
                    feed.producer, gen.sequence, c.replica.table) is not True:  # fmt: skip
                return False
    return sdk_caught_up(client, st, history)


async def first_message(channel: Channel, method: str, request: Any, reply: type) -> Any:
    return await first_matching(channel, method, request, reply, lambda _m: True, timeout=5)


async def planes_equal(relay_ch: Channel, mirror_ch: Channel) -> str | None:
    """None when the catalog and readiness read through the mirror are the relay's (their
    first message on a new stream, as parsed); else what differs."""
    for method, request, reply in (
        ("WatchKvPoolCatalog",
         pb.WatchKvPoolCatalogRequest(subscriber_id="cmp", contract_marker=MARKER),
         pb.KvPoolCatalogUpdate),
        ("SubscribeServingReadiness",
         pb.SubscribeServingReadinessRequest(subscriber_id="cmp", contract_marker=MARKER),
         pb.ServingReadinessUpdate),
    ):  # fmt: skip
        try:
            want = await first_message(relay_ch, method, request, reply)
            got = await first_message(mirror_ch, method, request, reply)
        except Exception as exc:  # the mirror may still refuse while its session comes back
            return f"{method}: {exc!r}"
        if bytes(want) != bytes(got):
            return f"{method}: {want} != {got}"
    return None


@pytest.mark.parametrize("seed", seeds("KVRELAY_MIRROR_NETFAULT_SEEDS"))
async def test_a_mirror_never_serves_a_wrong_or_unvouched_filter_through_a_faulty_network(
    seed: int,
) -> None:
    async with faulty_relay(SimConfig(name="m0", seed=seed, dp_size=2, capacity_blocks=96)) as rig:
        st, history, recorder, log = rig.st, rig.history, rig.recorder, rig.log
        m = await mirror_of(rig)
        faults = Faults(log=log)
        mirror_ch = rig.channel(m.port)
        relay_ch = rig.channel(st.port)
        watcher = Watcher(mirror_ch, st, recorder, history, faults)
        client = await rig.client(f"127.0.0.1:{m.port}")
        rig.exits.push_async_callback(watcher.close)  # closed after the audit, before the client
        audit = rig.audit(client)
        run = await rig.schedule(seed, salt=2, quiet=0.08)
        watcher.stopped_relays = run.side.stopped_relays

        def caught_up() -> bool:
            watcher.check_pending()
            return all_caught_up(st, m, watcher, client, recorder, history)

        #: the watcher's stream that was open when the link towards the mirror stalled
        open_at_block: list[Consumer] = []

        def started(kind: str, hold: float) -> None:
            faults.started(kind, hold)
            c = watcher.consumer
            if kind == "stall_down" and c is not None and c.first.is_set():
                open_at_block.append(c)

        await until(caught_up, "first install")
        for _ in range(STEPS):
            open_at_block.clear()
            await run.fault(caught_up, on_start=started, on_heal=faults.healed)
            if open_at_block:
                log[-1] += ", open stream ended"
                # the upstream went silent past the silence limit: the local stream that was
                # open then was ended with a status, not left hanging for the heal
                assert open_at_block[0].end is not None, ("a stream open through a silent "
                                                          f"upstream was not ended: {log}")
            await until(watcher.check_pending, "verdicts")
            why: str | None = "not compared"
            for _attempt in range(20):
                why = await planes_equal(relay_ch, mirror_ch)
                if why is None:
                    break
                await asyncio.sleep(0.1)
            assert why is None, (why, log)
            assert not watcher.wrong, (watcher.wrong, log)
            assert not audit.wrong, (audit.wrong, log)
            assert not watcher.bad_ends(), (watcher.bad_ends(), log)
            assert not recorder.problems(), (recorder.problems(), log)
        await run.finish(caught_up)
    assert not watcher.wrong, (watcher.wrong, log)
    assert not audit.wrong, (audit.wrong, log)
    assert not watcher.bad_ends(), (watcher.bad_ends(), log)
    assert watcher.frames > STEPS and audit.checked > STEPS, (watcher.frames, audit.checked)
    print(f"seed {seed}: {log}; relay side {run.side.counts}; {watcher.streams} streams, "
          f"{watcher.frames} frames, {watcher.vouching} vouching ({watcher.vouching_blocked} "
          f"in a blocked link), {watcher.before_oracle}+{audit.before_oracle} before the "
          f"oracle, relay sequences {sum(len(f.seen_at) for f in recorder.feeds.values())}")
    if os.environ.get("KVRELAY_MIRROR_NETFAULT_ENDS"):
        for t, end, _ in watcher.ends:
            print(f"  {t % 100:.2f} {end.message}")


async def test_a_connection_dead_towards_the_upstream_is_left_when_a_new_stream_goes_unheard(
) -> None:
    """Named case (``stall_open_up``, then the upstream ends the pool's stream): the mirror's
    connection carries nothing towards the upstream for good while TCP stays up, and the
    upstream's streams still flow down. The upstream fences its pool (a new generation): the
    mirror's request for it never arrives, and the stream went silent before its first message
    over and over on the same connection, which other streams kept looking alive, until
    grpclib's keepalive closed it: 29.7 s without the pool, 7 silent attempts. One unanswered
    round trip now replaces the connection: back within a few silence limits."""
    async with faulty_relay(SimConfig(name="up0", seed=5, dp_size=1, capacity_blocks=64),
                            record=False) as rig:  # fmt: skip
        relay = rig.relay
        m = await mirror_of(rig)
        await rig.engine.step(4)
        rig.proxy.stall_open(UP)  # for good: only a new connection carries requests
        await asyncio.sleep(0.2)
        first = relay.pools[0].generation
        assert first is not None
        old = bytes(first.producer)

        def renewed() -> bool:
            g = relay.pools[0].generation
            return g is not None and bytes(g.producer) != old

        relay.pools[0].fence(first, "test: the upstream ends the pool's streams")
        await rig.engine.step(3)
        await until(renewed, "a new generation")
        gen = relay.pools[0].generation
        assert gen is not None

        def served() -> bool:
            hub = m.mirror.hub_for(gen.producer)
            return hub is not None and hub.sequence == gen.hub().sequence

        await until(served, "the mirror serves the new generation", RECOVERY_S)
        stats = m.mirror.stats()
        assert stats["channel_deaf"] >= 1, stats
        assert stats["pool_totals"].get("end_silent", 0) <= 2, stats


def test_the_blocked_window_is_what_the_faults_say() -> None:
    f = Faults()
    f.started("stall_down", 1.0)
    assert f.blocked_from is not None and f.slow_until == 0.0
    f.started("delay", 0.5)
    assert f.blocked_from is None and f.slow_until > time.time()
    assert DOWN == "s2c"
