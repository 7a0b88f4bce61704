"""Connect mode end to end: several sim engines → one bound SUB → relay → consumer replica.

Each engine's PUB connects to the pool's endpoint with topic ``kv@<engine>@<model>``. The filter
must equal the simulator's ground truth for every member (or, where a fault destroyed history
and nothing can be replayed, a subset holding every block stored since), and each fault —
restart, gap, silence, unknown and malformed topics — must show in a metric.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from kvrelay.relay.engines import worker_id_for
from kvrelay.sim.engine import SimEngine
from tests.ingest.test_connect_trust import _PUB_HELLO, unfinished_message
from tests.support.connect import ConnectRig, connect_rig
from tests.support.fleet import ground_truth
from tests.support.rig import catalog_pool_count, eventually, stored_after, subscribe, verify

FLAVORS = ["vllm", "sglang"]
POOL = "ns/backend/generate"


def truth(*engines: SimEngine) -> dict[tuple[str, int], set[int]]:
    return {(e.cfg.name, 0): ground_truth([e])[(e.cfg.name, 0)] for e in engines}


async def started(c: ConnectRig, n: int, seed: int) -> list[SimEngine]:
    engines = [c.engine(f"pod-{i}", seed + i) for i in range(n)]
    for e in engines:
        await c.join(e)
    return engines


@pytest.mark.parametrize("flavor", FLAVORS)
async def test_many_engines_into_one_bound_sub_are_exact(flavor: str) -> None:
    async with connect_rig(flavor) as c, c.rig.channel() as ch:
        r = c.rig
        engines = await started(c, 3, 71)
        assert r.pool.generation is None  # nothing has been published yet
        for e in engines:
            await e.step(1)
        await eventually(lambda: r.pool.generation is not None, what="materialized")
        consumer = await subscribe(r, ch)
        for _ in range(20):
            for e in engines:
                await e.step(1)
        await verify(r, consumer, truth=truth(*engines), probes=2_000)
        members = sorted(n for _k, n, _c in r.pool.connected.source.members())
        assert members == ["pod-0", "pod-1", "pod-2"]
        assert {k.worker_id for k, _n, _c in r.pool.connected.source.members()} == {
            worker_id_for(n) for n in members
        }  # stable per engine name
        assert r.metric("kvrelay_connect_members_added_total", pool=POOL) == 3
        assert r.metric("kvrelay_ingest_batches_total", worker="pod-1", dp_rank="0") > 10
        assert member_resets(r) == 0
        await consumer.stop()


def member_resets(r: object) -> int:
    return sum(r.pool.counters.member_resets.values())  # type: ignore[attr-defined]


@pytest.mark.parametrize("flavor", FLAVORS)
async def test_restart_resets_only_that_member(flavor: str) -> None:
    """A restarted engine reconnects and numbers from 0 again: its member is reset and rebuilt
    from the new incarnation's stream (exact: nothing it held survived the restart)."""
    async with connect_rig(flavor) as c, c.rig.channel() as ch:
        r = c.rig
        a, b = await started(c, 2, 73)
        await a.step(1)
        await eventually(lambda: r.pool.generation is not None, what="materialized")
        consumer = await subscribe(r, ch)
        for _ in range(15):
            await a.step(1)
            await b.step(1)
        await verify(r, consumer, truth=truth(a, b), probes=2_000)
        await a.restart()  # new sockets: reconnects, seq 0, empty cache
        await a.wait_subscribed()
        for _ in range(10):
            await a.step(1)
            await b.step(1)
        await verify(r, consumer, truth=truth(a, b), probes=2_000)
        by = {n: cnt for _k, n, cnt in r.pool.connected.source.members()}
        assert by["pod-0"].resets_by_reason == {"incarnation": 1}
        assert by["pod-1"].resets == 0
        assert consumer.end is None  # the pool stayed up
        await consumer.stop()


async def test_gap_resets_the_member_and_keeps_what_follows() -> None:
    async with connect_rig() as c, c.rig.channel() as ch:
        r = c.rig
        (a,) = await started(c, 1, 75)
        await a.step(1)
        await eventually(lambda: r.pool.generation is not None, what="materialized")
        consumer = await subscribe(r, ch)
        await a.step(10)
        await verify(r, consumer, truth=truth(a), probes=2_000)
        pub = a.publishers[0]
        lost = pub.stats.lost + 2
        a.drop_next(2, keep_in_replay=False)
        while pub.stats.lost < lost:
            await a.step(1)
        before = set(a.held_blocks(0))
        await a.step(10)
        (cnt,) = [cnt for _k, _n, cnt in r.pool.connected.source.members()]
        await eventually(lambda: cnt.gaps == 1, what="gap seen")
        assert cnt.resets_by_reason == {"gap_no_replay": 1}
        await verify(r, consumer, exact=False, truth=truth(a),
                     must_have=stored_after(a, 0, before), probes=2_000)  # fmt: skip
        assert r.metric("kvrelay_ingest_gaps_total", worker="pod-0", dp_rank="0") == 1
        await consumer.stop()


async def test_unknown_and_malformed_topics_change_nothing() -> None:
    async with connect_rig() as c, c.rig.channel() as ch:
        r = c.rig
        (a,) = await started(c, 1, 77)
        await a.step(1)
        await eventually(lambda: r.pool.generation is not None, what="materialized")
        consumer = await subscribe(r, ch)
        await a.step(5)
        # a stranger on the same endpoint, replaying pod-0's own bytes under bad topics
        zctx = zmq.asyncio.Context()
        rogue = zctx.socket(zmq.XPUB)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(c.bind)
        try:
            assert await rogue.poll(5000)
            await rogue.recv()
            seq, payload = a.publishers[0].buffer[-1]
            for topic in (b"kv@pod-0", b"kv@\xff\xfe@sim-model", b"kv@ pod-0@sim-model",
                          b"kv@pod-0@other-model", b"unrelated"):  # fmt: skip
                await rogue.send_multipart([topic, seq.to_bytes(8, "big"), payload])
            await eventually(
                lambda: r.metric("kvrelay_connect_model_mismatch_total", pool=POOL) == 1,
                what="the rogue messages counted",
            )
        finally:
            rogue.close(linger=0)
            zctx.term()
        assert r.metric("kvrelay_connect_topic_unmatched_total", pool=POOL) == 1
        assert r.metric("kvrelay_connect_topic_malformed_total", pool=POOL) == 2
        await a.step(5)
        await verify(r, consumer, truth=truth(a), probes=2_000)
        assert member_resets(r) == 0 and len(r.pool.connected.source) == 1
        await consumer.stop()


async def test_the_allow_list_admits_engines_and_refuses_a_stranger_at_its_handshake() -> None:
    """``allow``: a network the test does not use plus the engines' address. The engines are
    exact; a stranger on another address whose message never ends (16 frames of 1 MiB, each
    flagged MORE) is refused at its handshake and counted; nothing it sent reaches the pool."""
    async with connect_rig(allow=("10.99.0.0/16", "127.0.0.1")) as c, c.rig.channel() as ch:
        r = c.rig
        a, b = await started(c, 2, 83)
        await a.step(1)
        await b.step(1)
        await eventually(lambda: r.pool.generation is not None, what="materialized")
        consumer = await subscribe(r, ch)
        _sent, stranger = await unfinished_message(c.bind, 16, 1024 * 1024, local="127.0.0.2")
        stranger.close()
        await eventually(
            lambda: r.metric("kvrelay_connect_connections_refused_total", pool=POOL) >= 1,
            what="the stranger refused",
        )
        for _ in range(10):
            await a.step(1)
            await b.step(1)
        await verify(r, consumer, truth=truth(a, b), probes=2_000)
        src = r.pool.connected.source
        assert member_resets(r) == 0 and len(src) == 2 and src.connections == 2
        assert r.metric("kvrelay_connect_peer_refused_total", pool=POOL) == 0
        assert r.metric("kvrelay_connect_connections_over_limit_total", pool=POOL) == 0
        await consumer.stop()


async def test_silent_members_leave_and_the_last_one_withdraws_the_pool() -> None:
    async with connect_rig(silence_s=1.0) as c, c.rig.channel() as ch:
        r = c.rig
        a, b = await started(c, 2, 79)
        await a.step(1)
        await b.step(1)
        await eventually(lambda: len(r.pool.connected.source) == 2, what="two members")
        consumer = await subscribe(r, ch)
        for _ in range(8):
            await a.step(1)
            await b.step(1)
        await verify(r, consumer, truth=truth(a, b), probes=2_000)
        for _ in range(15):  # pod-1 goes quiet; pod-0 keeps publishing
            await a.step(1)
            await asyncio.sleep(0.1)
        await eventually(lambda: len(r.pool.connected.source) == 1, what="pod-1 removed")
        await verify(r, consumer, truth=truth(a), probes=2_000)  # its state cleared
        assert r.metric("kvrelay_connect_members_expired_total", pool=POOL) == 1
        assert r.pool.counters.member_resets == {"member_expired": 1}
        end = await consumer.wait_end(timeout=10)  # pod-0 goes quiet too: nothing to vouch for
        assert end.reason == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
        assert await catalog_pool_count(ch) == 0
        await a.step(1)  # it speaks again: a fresh generation
        await eventually(lambda: r.pool.generation is not None, what="re-materialized")
        assert await catalog_pool_count(ch) == 1


async def test_mixed_pool_refuses_a_topic_naming_a_configured_engine() -> None:
    """A pool with a configured (static) engine and a connect endpoint: connected members join
    it, but a topic naming the configured engine is refused — its id would merge two streams."""
    from kvrelay.discovery.endpoints import StaticSourceConfig
    from kvrelay.relay.settings import EngineSpec
    from kvrelay.sim.config import SimConfig

    static = SimEngine(SimConfig(name="pod-x", seed=81, grpc_port=None, metrics_port=None,
                                 capacity_blocks=128))  # fmt: skip
    await static.start()
    pub = static.publishers[0]
    spec = EngineSpec(name="pod-x", static=StaticSourceConfig(
        endpoint=pub.endpoint.replace("*", "127.0.0.1"),
        replay_endpoint=pub.replay_endpoint.replace("*", "127.0.0.1")))  # fmt: skip
    async with connect_rig(engines=(spec,)) as c, c.rig.channel() as ch:
        r = c.rig
        r.engines.append(static)
        y = c.engine("pod-y", 82)
        intruder = c.engine("intruder", 83, topic="kv@pod-x@sim-model")
        for e in (y, intruder):
            await c.join(e)
        await eventually(lambda: r.pool.generation is not None, what="materialized")
        consumer = await subscribe(r, ch)
        for _ in range(10):
            for e in (static, y, intruder):
                await e.step(1)
        await verify(r, consumer, truth=truth(static, y), probes=2_000)
        assert r.metric("kvrelay_connect_members_refused_total", pool=POOL) >= 10
        assert [n for _k, n, _c in r.pool.connected.source.members()] == ["pod-y"]
        await consumer.stop()


async def test_reload_keeps_members_unless_the_connect_endpoint_changes() -> None:
    """A reload that leaves ``[pools.connect]`` alone keeps its members and the stream; one that
    re-binds it drops them (their history cannot be replayed) and withdraws a pool that had
    nothing else, until an engine speaks on the new endpoint."""
    import dataclasses

    from kvrelay._proto.dynamo.kvrelay import v1 as pb
    from kvrelay.sim.ports import free_port_block

    async with connect_rig() as c, c.rig.channel() as ch:
        r = c.rig
        (a,) = await started(c, 1, 85)
        await a.step(1)
        await eventually(lambda: r.pool.generation is not None, what="materialized")
        consumer = await subscribe(r, ch)
        await a.step(5)
        await verify(r, consumer, truth=truth(a), probes=2_000)
        (spec,) = r.settings.pools
        readiness_only = dataclasses.replace(spec, role=pb.WorkerRole.DECODE)
        await r.relay.reconfigure(dataclasses.replace(r.settings, pools=(readiness_only,)))
        await a.step(5)
        await verify(r, consumer, truth=truth(a), probes=2_000)
        assert consumer.end is None and member_resets(r) == 0
        assert spec.connect is not None
        moved = f"tcp://127.0.0.1:{free_port_block(1, host='127.0.0.1')}"
        rebound = dataclasses.replace(
            readiness_only, connect=dataclasses.replace(spec.connect, bind=(moved,))
        )
        await r.relay.reconfigure(dataclasses.replace(r.settings, pools=(rebound,)))
        end = await consumer.wait_end()
        assert end.reason == "RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE"
        assert r.pool.counters.member_resets == {"reconfigured": 1}
        c.bind = moved
        b = c.engine("pod-b", 86)
        await eventually(lambda: r.pool.connected.source is not None, what="re-bound")
        await c.join(b)
        await b.step(1)
        await eventually(lambda: r.pool.generation is not None, what="re-materialized")
        again = await subscribe(r, ch)
        await b.step(5)
        await a.step(3)  # still publishing to the old address: nobody listens there
        await verify(r, again, truth=truth(b), probes=2_000)
        await again.stop()


async def test_a_reload_that_rebinds_the_section_keeps_its_counters() -> None:
    """Prometheus counters never go backwards within a process. A reload that narrows ``allow``
    re-binds the section (a new ``ConnectSource``): the pool's ``kvrelay_connect_*`` counters
    went back to 0 then. They go on from where they were, and grow with the new socket's work
    (its member added again, a stranger refused again)."""
    import dataclasses

    names = (
        "kvrelay_connect_messages_total", "kvrelay_connect_members_added_total",
        "kvrelay_connect_connections_refused_total",
    )  # fmt: skip
    async with connect_rig(allow=("10.99.0.0/16", "127.0.0.1")) as c:
        r = c.rig

        def counts() -> dict[str, float]:
            return {n: r.metric(n, pool=POOL) for n in names}

        async def refuse_a_stranger(more_than: float) -> None:
            # its greeting and READY only, and it waits: one that hangs up, or sends a frame,
            # before the handler answers ends as a failed handshake instead
            host, port = c.bind.removeprefix("tcp://").rsplit(":", 1)
            _r, stranger = await asyncio.open_connection(
                host, int(port), local_addr=("127.0.0.2", 0)
            )
            stranger.write(_PUB_HELLO)
            try:
                await eventually(lambda: counts()[names[2]] > more_than, what="stranger refused")
            finally:
                stranger.close()

        (a,) = await started(c, 1, 89)
        for _ in range(8):
            await a.step(1)
        await eventually(lambda: counts()[names[0]] >= 3, what="messages counted")
        await refuse_a_stranger(0)
        before = counts()
        assert before[names[1]] == 1
        old = r.pool.connected.source
        (spec,) = r.settings.pools
        assert spec.connect is not None
        narrowed = dataclasses.replace(
            spec, connect=dataclasses.replace(spec.connect, allow=("127.0.0.1",))
        )
        await r.relay.reconfigure(dataclasses.replace(r.settings, pools=(narrowed,)))
        assert counts() == before  # the socket is gone; what it counted is not
        await eventually(
            lambda: r.pool.connected.source not in (None, old), what="re-bound"
        )
        for _ in range(200):  # the engine's PUB connects again, to the new socket
            await a.step(1)
            if counts()[names[1]] > before[names[1]]:
                break  # its member is added again
            await asyncio.sleep(0.05)
        assert counts()[names[1]] == before[names[1]] + 1
        await refuse_a_stranger(before[names[2]])
        after = counts()
        assert all(after[n] >= before[n] for n in names), (before, after)
        assert after[names[0]] > before[names[0]]
