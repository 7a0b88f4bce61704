"""A mirror cannot space the sequences it forwards, so while its own joiners catch up it asks its
upstream to (``/kvrelay.v1.Spacing/HoldPublication``), and ends the request when they are done.

Real relay (simulated engine, real ZMQ and gRPC), real mirror; the oracle for "the upstream
spaces" is the upstream hub's own ``publication_hold``, which its generation consults before
every cut (``tests/relay/test_snapshot_cadence.py`` covers that cut-side rule).
"""

from __future__ import annotations

import asyncio
from typing import Any

from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.limits import RelayLimits
from kvrelay.service.spacing import HOLD_HEADER, HOLD_METHOD
from kvrelay.sim.config import SimConfig
from tests.support import scripted_relay as S
from tests.support.mem_relay import sub_request
from tests.support.mirror_rig import mirrored
from tests.support.rig import catalog_producer, eventually, rig, wait_live

K = "kv-relay-error-reason"


async def test_a_mirror_asks_its_upstream_to_space_while_its_joiners_catch_up() -> None:
    cfg = SimConfig(name="sp0", seed=91, capacity_blocks=256)
    async with rig([cfg]) as r:
        await wait_live(r.relay, 1)
        await r.engines[0].step(4)
        async with mirrored(r.port, limits=RelayLimits()) as m:
            async with r.channel() as ch:
                producer = await catalog_producer(ch)
            gen = r.pool.generation
            assert gen is not None
            await eventually(lambda: m.mirror.hub_for(producer) is not None, what="mirrored")
            local = m.mirror.hub_for(producer)
            upstream = gen._hub
            assert local is not None and upstream is not None
            assert upstream.publication_hold() == 0.0
            joiner = await local.subscribe()  # admitted, never catches up (nobody pumps it)

            async def traffic_until(pred: Any, what: str) -> None:
                for _ in range(400):
                    if pred():
                        return
                    await r.engines[0].step(1)
                    await asyncio.sleep(0.01)
                raise AssertionError(what)

            await traffic_until(lambda: upstream.publication_hold() > 0.0,
                                what="the upstream spaces for the mirror's joiner")  # fmt: skip
            assert upstream.holds_requested >= 1 and local.joiners == 1
            joiner.close()  # the joiner is gone: the mirror ends its request
            await traffic_until(lambda: upstream.publication_hold() == 0.0,
                                what="the request ended")  # fmt: skip
            [pool] = [p for p in m.mirror._pools.values() if p.hub is local]
            await eventually(lambda: pool.holds_sent >= 2, what="both requests answered")


async def test_the_spacing_request_is_checked_like_a_subscription() -> None:
    cfg = SimConfig(name="sp1", seed=92, capacity_blocks=64)
    async with rig([cfg]) as r:
        await wait_live(r.relay, 1)
        async with r.channel() as ch:
            producer = await catalog_producer(ch)

            reasons: list[str | None] = []

            async def hold(prod: pb.ProducerIdentity, ms: str) -> GRPCError | None:
                async with ch.request(HOLD_METHOD, Cardinality.UNARY_UNARY,
                                      pb.SubscribeKvPoolRequest, pb.RelayInfo,
                                      metadata={HOLD_HEADER: ms}) as st:  # fmt: skip
                    try:
                        await st.send_message(sub_request(prod, "probe"), end=True)
                        info = await st.recv_message()
                        await st.recv_trailing_metadata()
                    except GRPCError as err:
                        reasons.append(dict(st.trailing_metadata or {}).get(K))
                        return err
                assert info is not None and info.relay is not None
                return None

            gen = r.pool.generation
            assert gen is not None
            gen.hub()  # a hub exists (a subscriber would create it)
            assert await hold(producer, "100") is None
            assert gen._hub is not None and gen._hub.publication_hold() > 0.0
            assert await hold(producer, "0") is None
            assert gen._hub.publication_hold() == 0.0
            bad = await hold(producer, "-5")
            assert bad is not None and bad.status == Status.INVALID_ARGUMENT
            # digits past what int() converts (4,300) are refused the same way, not INTERNAL
            huge = await hold(producer, "1" * 5000)
            assert huge is not None and huge.status == Status.INVALID_ARGUMENT, huge
            gone = await hold(S.producer(), "10")
            assert gone is not None and gone.status == Status.NOT_FOUND
            # with the reason trailer, as the relay's own calls
            assert reasons == ["RELAY_ERROR_REASON_INVALID_REQUEST",
                               "RELAY_ERROR_REASON_INVALID_REQUEST",
                               "RELAY_ERROR_REASON_POOL_NOT_FOUND"]  # fmt: skip
            # capped at the relay's own bound, whatever is asked
            assert await hold(producer, "60000") is None
            limit = r.settings.limits.snapshot_publication_delay_s
            assert gen._hub.publication_hold() == limit


async def test_an_upstream_without_spacing_is_asked_once() -> None:
    """Dynamo's relay has no spacing service (UNIMPLEMENTED): the mirror stops asking and
    serves on, exactly as before."""
    gate = asyncio.Event()
    relay = S.ScriptedRelay()
    burst = [S.delta(10 + i, 11 + i, buckets=(i % 64,), words=(i + 1,)) for i in range(4)]
    relay.scripts.append(S.Script(S.snapshot(10), gate=gate, after=burst, hold=True))
    server = await S.serve(relay)
    try:
        async with mirrored(S.port_of(server), sync=False) as m:
            await eventually(lambda: m.mirror.hub_for(S.producer()) is not None, what="live")
            local = m.mirror.hub_for(S.producer())
            assert local is not None
            joiner = await local.subscribe()
            gate.set()
            await eventually(lambda: not m.mirror.upstream.spacing, what="asked, refused")
            await eventually(lambda: local.sequence == 14, what="deltas still applied")
            joiner.close()
            ch = Channel("127.0.0.1", m.port)
            try:
                async with ch.request("/dynamo.kvrelay.v1.KvEventRelay/SubscribeKvPool",
                                      Cardinality.UNARY_STREAM, pb.SubscribeKvPoolRequest,
                                      pb.FilterUpdate) as st:  # fmt: skip
                    await st.send_message(sub_request(S.producer(), "after"), end=True)
                    first = await asyncio.wait_for(st.recv_message(), 10)
                    assert first is not None and first.sequence == 14
                    await st.cancel()
            finally:
                ch.close()
    finally:
        server.close()


def test_each_mirror_asks_for_spacing_under_its_own_name() -> None:
    """The upstream keeps one hold per requester: two mirrors with the default subscriber id
    must not end or renew each other's hold, so each asks under the id made its own."""
    from kvrelay.mirror.upstream import hold_requester

    a, b = hold_requester("kvrelay-mirror"), hold_requester("kvrelay-mirror")
    assert a != b and a.startswith("kvrelay-mirror#") and b.startswith("kvrelay-mirror#")
    long = hold_requester("é" * 64)  # 128 bytes: the suffix still fits the id's bound
    assert len(long.encode()) <= 128 and long.startswith("é" * 55)
