"""SDK against a real kvrelay fed by the simulator (in-process relay, real loopback sockets).

Oracle: ground-truth depths recomputed with the ``xxhash`` package from the blocks the simulator
holds (``client_harness.truth_depth``), independent of kvrelay's numba code and the SDK search.
"""

from __future__ import annotations

import asyncio
import random

import numpy as np

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import ClientConfig, RelayClient
from kvrelay.client.replica import relay_key
from kvrelay.client.views import ModelServingView, PoolKey
from kvrelay.contract.limits import RelayLimits
from kvrelay.service.server import RelayServer
from kvrelay.sim.config import SimConfig
from kvrelay.sim.hashing import dynamo_sequence_hashes
from kvrelay.sim.wire import Era
from tests.support.client_stack import BLOCK, Stack, eventually, query_set, stack, truth_depth
from tests.support.mem_relay import MemRelayView
from tests.support.timing import scaled

FAST = ClientConfig(backoff_initial_s=0.02, backoff_max_s=0.2)
MODEL = "sim-model"


def key_of(address: str) -> PoolKey:
    return PoolKey(address, "ns", "backend", "generate")


def synced(client: RelayClient, st: Stack, key: PoolKey) -> bool:
    """Relay exact state = ground truth, everything published, and the SDK replica holds the
    producer's table at the producer's sequence."""
    slot = client.connections[0].slots.get(key)
    replica = None if slot is None else slot.installed
    table = st.producer_table()
    return (
        replica is not None
        and replica.table is not None
        and st.in_sync()
        and table is not None
        and replica.sequence == st.producer_sequence()
        and bool(np.array_equal(replica.table, table))
    )


async def drive(engines: list, rounds: int, steps: int = 4) -> None:  # type: ignore[type-arg]
    for _ in range(rounds):
        for e in engines:
            await e.step(steps)
        await asyncio.sleep(0.005)


async def test_overlap_never_under_reports_and_over_reports_rarely() -> None:
    configs = [
        SimConfig(name="q0", seed=11, dp_size=2, capacity_blocks=160, era=Era.MAP),
        SimConfig(name="q1", seed=11, dp_size=1, capacity_blocks=160, era=Era.ARRAY),
    ]
    async with stack(configs) as st:
        for e in st.engines:
            e.load_lora("adapter-a")
        async with RelayClient([st.address], config=FAST) as client:
            key = key_of(st.address)
            await eventually(lambda: key in client.pools(), what="pool in catalog")
            rng = random.Random(5)
            over = total = deep = 0
            for _ in range(4):  # query between bursts of traffic (evictions happen meanwhile)
                await drive(st.engines, 6)
                await eventually(lambda: synced(client, st, key), what="replica = producer")
                held = st.truth()
                for tokens, lora in query_set(st.engines, rng, 150):
                    model = lora or rng.choice([MODEL, "sim-model-alias"])
                    got = client.overlap(tokens, model)
                    assert set(got) == {key}, (model, got, client.readiness())
                    want = truth_depth(tokens, lora, held)
                    assert got[key] >= want, f"false negative: {got[key]} < {want}"
                    # the first block the replica's filter lacks, from the oracle's hashes
                    seq = dynamo_sequence_hashes(tokens, BLOCK, lora_name=lora)
                    present = [*client.contains(seq)[key].tolist(), False]
                    assert got[key] == present.index(False), (got[key], present)
                    total += 1
                    over += got[key] > want
                    deep += want > 2
            rate = over / total
            print(f"\nover-report rate {over}/{total} = {rate:.4f} (queries with depth>2: {deep})")
            assert deep > total // 5, "the query set must exercise real cached prefixes"
            assert rate <= 0.01
            # a LoRA request through the base model + explicit adapter hashes like the adapter id
            tokens, lora = next((t, lo) for t, lo in query_set(st.engines, rng, 400) if lo)
            assert client.overlap(tokens, MODEL, lora=lora) == client.overlap(tokens, lora)
            # an unknown model/adapter matches no pool
            assert client.overlap(tokens, "other-model") == {}
            assert client.overlap(tokens, MODEL, lora="not-loaded") == {}
            stats = client.replica_stats()[key]
            assert stats.occupancy == len(held) and stats.drops == {}
            # raw canonical-hash lookups: every held block in, random others (almost all) out
            assert set(client.contains(sorted(held))) == {key}
            assert bool(client.contains(sorted(held))[key].all())
            others = np.random.default_rng(3).integers(0, 2**63, 5_000, dtype=np.uint64)
            assert int(client.contains(others)[key].sum()) <= 5
            assert stats.staleness_s is not None and stats.frames["delta"] > 0


async def test_forced_lag_recovers() -> None:
    # A one-frame queue and a full-size 4 MiB lane. The engine is already publishing (one delta
    # every few ms) when the client subscribes, so deltas are produced while the 4 MiB snapshot is
    # still crossing HTTP/2 flow control: they overflow the queue and the relay ends the stream
    # LAGGED. Every resubscription snapshots again under the same traffic, so lag recurs until the
    # engine stops; then the replica must rebuild to exactly the producer's table. (The relay's
    # spacing of deltas while a subscriber catches up is switched off: it would prevent the lag.)
    limits = RelayLimits(
        publication_queue_capacity=1, publish_every_n_events=1, snapshot_publication_delay_s=0.001
    )
    configs = [SimConfig(name="l0", seed=3, dp_size=2, capacity_blocks=96)]
    async with stack(configs, limits, expected_blocks=1_048_576) as st:
        key = key_of(st.address)
        runner = st.engines[0].run(rate=1000)
        try:
            await eventually(lambda: (st.producer_sequence() or 0) > 20, what="traffic flowing")
            async with RelayClient([st.address], config=FAST) as client:
                try:
                    await eventually(lambda: client.drops["subscriber_lagged"] >= 1, 30, "lag")
                finally:
                    await st.engines[0].stop_running()
                await eventually(lambda: synced(client, st, key), what="rebuilt after lag")
                assert runner.done()
                held = st.truth()
                for tokens, lora in query_set(st.engines, random.Random(2), 60):
                    got = client.overlap(tokens, lora or MODEL)[key]
                    assert got >= truth_depth(tokens, lora, held)
        finally:
            await st.engines[0].stop_running()


async def test_relay_restart_rebuilds_replicas_under_new_incarnation() -> None:
    async with stack([SimConfig(name="r0", seed=4, dp_size=1, capacity_blocks=96)]) as st:
        async with RelayClient([st.address], config=FAST) as client:
            key = key_of(st.address)
            await drive(st.engines, 3)
            await eventually(lambda: synced(client, st, key), what="first sync")
            conn = client.connections[0]
            assert conn.identity is not None and conn.identity[1] == st.history[0]
            await st.stop_relay()
            await eventually(lambda: not client.replica_stats().get(key, None)
                             or not client.replica_stats()[key].installed, what="dropped")
            assert client.overlap([1] * 64, MODEL) == {}
            await st.start_relay()
            assert st.history[0] != st.history[1]
            await drive(st.engines, 3)
            await eventually(lambda: synced(client, st, key), what="rebuilt")
            assert conn.identity is not None and conn.identity[1] == st.history[1]
            replica = conn.slots[key].installed
            assert replica is not None and replica.relay is not None
            assert replica.relay[1] == st.history[1]
            assert conn.counters["relay_incarnation_changes"] == 1
            assert client.drops["eof"] >= 1


async def test_pool_withdrawal_drops_the_replica() -> None:
    configs = [SimConfig(name="w0", seed=5, dp_size=1, capacity_blocks=64)]
    async with stack(configs) as st:
        async with RelayClient([st.address], config=FAST) as client:
            key = key_of(st.address)
            await drive(st.engines, 2)
            await eventually(lambda: synced(client, st, key), what="sync")
            await st.engines[0].stop()
            await eventually(lambda: key not in client.pools(), what="withdrawn from catalog")
            assert client.drops["withdrawn"] + client.drops["publication_unavailable"] >= 1
            assert key not in client.replica_stats()
            assert client.overlap([5] * 64, MODEL, routable_only=False) == {}
            subs = sum(1 for _ in st.relay.pools[0].subscribers) if st.relay else 0
            assert subs == 0


async def test_generation_change_producer_changed_then_new_generation() -> None:
    async with stack([SimConfig(name="g0", seed=6, dp_size=1, capacity_blocks=64)]) as st:
        async with RelayClient([st.address], config=FAST) as client:
            key = key_of(st.address)
            await drive(st.engines, 2)
            await eventually(lambda: synced(client, st, key), what="sync")
            relay = st.relay
            assert relay is not None
            old = relay.pools[0].generation
            assert old is not None
            # Hold the catalog plane still so the client keeps the old identity and
            # resubscribes with it: the relay must answer PRODUCER_CHANGED.
            real_set_pools = relay.catalog.set_pools
            relay.catalog.set_pools = lambda pools: False  # type: ignore[method-assign]
            relay.pools[0].fence(old, "test: new generation")
            await eventually(lambda: client.drops["producer_changed"] >= 1, what="PRODUCER_CHANGED")
            assert not client.replica_stats()[key].installed
            relay.catalog.set_pools = real_set_pools  # type: ignore[method-assign]
            await eventually(lambda: relay.pools[0].generation is not None, what="rebuilt gen")
            relay.refresh_planes(force=True)  # the stub took the new generation's entry
            new = relay.pools[0].generation
            assert new is not None and new.layout_generation != old.layout_generation
            await eventually(
                lambda: client.replica_stats().get(key) is not None
                and client.replica_stats()[key].installed
                and client.replica_stats()[key].layout_generation == new.layout_generation,
                what="replica of the new generation",
            )
            assert client.drops["catalog_replaced"] + client.drops["producer_changed"] >= 1
            assert relay_key(relay.relay_identity) == client.connections[0].identity


async def test_a_plane_with_long_windows_is_not_silent_between_them() -> None:
    """A window plane's silence follows the period its updates state (``window_ms``) from its
    first update on, on the stream that delivered it: the SDK read a relay whose windows came
    less often than its silence bound as gone after each first window, and dropped what it held
    (not routable) until it had reconnected."""
    view = MemRelayView()
    server = RelayServer(view)
    await server.start("127.0.0.1", 0)
    config = ClientConfig(heartbeat_interval_s=0.2, silence_heartbeats=2,
                          backoff_initial_s=0.02, backoff_max_s=0.2)  # fmt: skip
    try:
        async with RelayClient([f"127.0.0.1:{server.port}"], config=config) as client:
            conn = client.connections[0]
            await eventually(lambda: conn.counters["load_updates"] >= 1, what="first window")
            for window in range(1, 4):  # one each second (window_ms = 1000), silence 0.4 s
                await asyncio.sleep(1.0)
                view.load.publish(view.load_msg(window), window)
            await eventually(lambda: conn.counters["load_updates"] >= 4, what="every window")
            assert conn.counters["load_end_silent"] == 0
            assert conn.load is not None and conn.load.window_sequence == 3
    finally:
        await server.close(grace_s=0.5)


async def test_the_serving_load_view_has_every_token_figure_the_contract_defines() -> None:
    """``TokenLoadStats`` fields 3 and 4 (a Dynamo 1.7 relay may set them) reach the SDK's
    model view as sent, and unset ones as None, never zero. A gauge is read from a COMPLETE
    view only: one a relay set in a DEGRADED view is a partial sum, None here like an unset one,
    and a model view without its request counters is left out rather than read as zeros."""
    view = MemRelayView()
    view.add_pool("pool-a", 1024)
    gauges = pb.TokenLoadStats(awaiting_first_token_input_tokens=7, inflight_input_tokens=9)
    msg = view.serving_load_msg(1)
    msg.models[0].load.status = pb.DataStatus.COMPLETE
    msg.models[0].load.tokens = gauges
    msg.models[0].load.requests.requests_generating = 3
    view.serving_load.publish(msg, 1)
    server = RelayServer(view)
    await server.start("127.0.0.1", 0)
    try:
        async with RelayClient([f"127.0.0.1:{server.port}"], config=FAST) as client:
            def model(window: int) -> ModelServingView | None:
                views = client.serving_load().models
                return views[0] if views and views[0].window_sequence == window else None

            await eventually(lambda: model(1) is not None, what="window 1")
            m = model(1)
            assert m is not None
            assert (m.awaiting_first_token_input_tokens, m.inflight_input_tokens) == (7, 9)
            assert m.requests_generating == 3
            assert (m.input_tokens_total, m.output_tokens_total) == (None, None)
            await eventually(lambda: len(client.serving_load().pools) == 1, what="the pool")
            (pool,) = client.serving_load().pools.values()
            assert pool.active_decode_blocks == 7  # COMPLETE

            partial = view.serving_load_msg(2, started=4)  # the model DEGRADED
            partial.models[0].load.tokens = gauges
            partial.models[0].load.requests.requests_generating = 3
            partial.pools[0].load.status = pb.DataStatus.DEGRADED  # still with its gauge
            no_counters = view.serving_load_msg(2).models[0]
            no_counters.canonical_model_id, no_counters.load.requests = "m2", None
            partial.models.append(no_counters)
            view.serving_load.publish(partial, 2)
            await eventually(lambda: model(2) is not None, what="window 2")
            m = model(2)
            assert m is not None and m.status == "DEGRADED"
            assert (m.awaiting_first_token_input_tokens, m.inflight_input_tokens) == (None, None)
            assert m.requests_generating is None
            assert m.requests_started_total == 4  # counters whatever the status
            assert [v.model for v in client.serving_load().models] == ["m"]
            (pool,) = client.serving_load().pools.values()
            assert pool.status == "DEGRADED" and pool.active_decode_blocks is None
            # one bad entry in one window, however often the window is read
            (conn,) = client.connections
            assert conn.counters["serving_load_entry_invalid"] == 1
            assert pool.live_workers == 1  # deployment is not a gauge of the view
    finally:
        await server.close(grace_s=0.5)


async def test_a_catalog_refresh_as_the_channel_is_replaced_leaves_one_catalog_loop() -> None:
    """A pool's catalog refresh cancels the catalog loop; a channel replaced in the same turn
    (another stream's end) closed the connection under it, and grpclib's transport error took
    the cancellation's place (``rpc.run_stream``): the old loop read a lost connection and went
    on beside the new one (two watches, the channel reset again) until the client closed. The
    old loop ends, and the client's close leaves no task behind."""
    view = MemRelayView()
    view.add_pool("pool-a", 1024)
    server = RelayServer(view)
    await server.start("127.0.0.1", 0)
    before = asyncio.all_tasks()
    try:
        async with RelayClient([f"127.0.0.1:{server.port}"], config=FAST) as client:
            conn = client.connections[0]
            await eventually(lambda: any(s.installed for s in conn.slots.values()),
                             what="the pool installed")  # fmt: skip
            old = conn._catalog_task
            assert old is not None
            conn.refresh_catalog()
            conn._reset_channel(conn.channel)  # (the same turn)
            await asyncio.wait({old}, timeout=scaled(2.0))
            assert old.cancelled()
            await eventually(lambda: conn.counters["catalog_updates"] >= 2, what="a new watch")
            assert conn.counters["channel_resets"] == 1, conn.counters
        # the client's tasks (``running at`` a file of the SDK), not the relay's
        left = [t for t in asyncio.all_tasks() - before if "kvrelay/client/" in repr(t)]
        assert not left, left
    finally:
        await server.close(grace_s=0.5)
