"""Consumer-rule violations injected by a scripted gRPC server: each drops only the replica,
increments the matching counter and the SDK resubscribes to a valid stream."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from grpclib.const import Status

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import ClientConfig
from tests.support.scripted_relay import (
    DC_ID,
    MARKER,
    OTHER_RELAY,
    RELAY,
    Script,
    ScriptedRelay,
    corrupt_checksum,
    delta,
    descriptor,
    frame,
    half_chunk,
    heartbeat,
    installed_at,
    producer,
    scripted,
    snapshot,
)
from tests.support.timing import scaled

CASES = {
    "sequence_gap": [*snapshot(5), delta(6, 7)],
    "wrong_base": [*snapshot(5), delta(5, 6), delta(5, 6)],
    "bad_increment": [*snapshot(5), delta(5, 7)],
    "dc_id_mismatch": [*snapshot(5), delta(5, 6, dc_id=99)],
    "cbi1_checksum_mismatch": [*snapshot(5), corrupt_checksum(delta(5, 6))],
    "cbi1_bad_chunk": [half_chunk(5, 1)],  # 2 chunks of a lane the producer sends in 1
    "delta_before_snapshot": [delta(5, 6)],
    "relay_identity_changed": [*snapshot(5), frame(3, 5, 5, b"", relay=OTHER_RELAY)],
    "heartbeat_before_snapshot": [heartbeat(5)],
    "heartbeat_sequence": [*snapshot(5), heartbeat(4)],
    "epoch_mismatch": [*snapshot(5), delta(5, 6, cbi_base=4)],
    "unexpected_snapshot": [*snapshot(5), *snapshot(5)],
    "unknown_kind": [*snapshot(5), frame(9, 5, 5, b"")],
}


@pytest.mark.parametrize("reason", sorted(CASES))
async def test_violation_drops_counts_and_resubscribes(reason: str) -> None:
    async with scripted(Script(CASES[reason], hold=True)) as (relay, client, key):
        assert await client.wait_for(lambda: installed_at(client, key, 11), scaled(10)), reason
        st = client.replica_stats()[key]
        assert st.drops == {reason: 1}, st.drops
        assert client.drops[reason] == 1
        assert st.subscribes == 2 and relay.subscriptions == 2
        # only the valid default stream's state is installed: 3 words x 2 slots + one 4-slot delta
        assert st.occupancy == 3 * 2 + 4


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (Status.RESOURCE_EXHAUSTED, "SUBSCRIBER_LAGGED"),
        (Status.FAILED_PRECONDITION, "PRODUCER_CHANGED"),
        (Status.NOT_FOUND, "POOL_NOT_FOUND"),
        (Status.UNAVAILABLE, "PUBLICATION_UNAVAILABLE"),
    ],
)
async def test_relay_errors_drop_and_resubscribe(status: Status, reason: str) -> None:
    async with scripted(Script(snapshot(5), end=(status, reason))) as (_relay, client, key):
        assert await client.wait_for(lambda: installed_at(client, key, 11), scaled(10))
        assert client.replica_stats()[key].drops == {reason.lower(): 1}


async def test_clean_eof_is_an_invalidation() -> None:
    async with scripted(Script([*snapshot(5), delta(5, 6)])) as (_relay, client, key):
        assert await client.wait_for(lambda: installed_at(client, key, 11), scaled(10))
        assert client.replica_stats()[key].drops == {"eof": 1}


async def test_silent_stream_is_ended_and_resubscribed() -> None:
    """A relay that sends a snapshot and then nothing (not even heartbeats) for 3 heartbeat
    periods: the SDK ends the stream as ``silent`` and subscribes again."""
    quick = ClientConfig(
        backoff_initial_s=0.01, backoff_max_s=0.05, heartbeat_interval_s=0.1, silence_heartbeats=3
    )
    held = Script(snapshot(5), hold=True)
    async with scripted(held, config=quick) as (relay, client, key):
        assert await client.wait_for(lambda: installed_at(client, key, 5), scaled(10))
        assert await client.wait_for(
            lambda: client.replica_stats()[key].drops.get("silent", 0) >= 1, scaled(10)
        )
        assert await client.wait_for(lambda: installed_at(client, key, 11), scaled(10))
        assert relay.subscriptions >= 2


async def test_heartbeats_keep_a_quiet_stream_alive() -> None:
    # the period stretches on a busy machine, so a late wake-up of this test cannot outlast it
    quick = ClientConfig(
        backoff_initial_s=0.01, backoff_max_s=0.05, heartbeat_interval_s=scaled(0.2),
        silence_heartbeats=3,
    )
    beats = Script([*snapshot(5), *(heartbeat(5) for _ in range(1))], hold=True)
    async with scripted(beats, config=quick) as (relay, client, key):
        assert await client.wait_for(lambda: installed_at(client, key, 5), scaled(10))
        # within 3 periods of the last frame the stream is not ended
        await asyncio.sleep(0.3)
        assert client.replica_stats()[key].drops == {} and relay.subscriptions == 1


async def test_unsupported_feature_quarantines_the_pool() -> None:
    script = Script([], end=(Status.FAILED_PRECONDITION, "UNSUPPORTED_FEATURE"))
    async with scripted(script) as (relay, client, key):
        assert await client.wait_for(
            lambda: client.replica_stats().get(key) is not None
            and client.replica_stats()[key].quarantined, scaled(10)
        )
        st = client.replica_stats()[key]
        assert not st.installed and st.drops == {"unsupported_feature": 1}
        assert relay.subscriptions == 1


async def test_a_relays_unknown_status_is_not_an_end_without_a_status() -> None:
    """A relay's own ``UNKNOWN`` (a reason this SDK does not know) is ``status_unknown``; a
    stream that ended with no status at all is ``no_status`` (``test_hostile_upstream``): the
    two were one label, and a user could not tell a relay's error from a broken stream."""
    script = Script([], end=(Status.UNKNOWN, "FROM_A_NEWER_RELAY"))
    async with scripted(script) as (_relay, client, key):
        assert await client.wait_for(lambda: installed_at(client, key, 11), scaled(10))
        assert client.replica_stats()[key].drops == {"status_unknown": 1}


async def test_withdrawal_drops_and_stops_resubscribing() -> None:
    async with scripted() as (relay, client, key):
        assert await client.wait_for(lambda: installed_at(client, key, 11), scaled(10))
        relay.set_catalog([])
        assert await client.wait_for(lambda: key not in client.replica_stats(), scaled(10))
        assert client.drops["withdrawn"] == 1
        assert client.overlap([1, 2, 3, 4], "m") == {}
        n = relay.subscriptions
        assert not await client.wait_for(lambda: relay.subscriptions > n, 0.3)


async def test_one_pool_listed_under_two_endpoints_is_fenced_not_merged() -> None:
    """A catalog listing one ``KvPoolId`` under two endpoints (no relay lists one so): the SDK
    made a replica for each, both routable, and ``load()`` could not tell them apart. The
    contract fences such a pool, never merges it: both entries are dropped and counted, and
    the pool is served again once the catalog lists it once."""
    async with scripted() as (relay, client, key):
        assert await client.wait_for(lambda: installed_at(client, key, 11), scaled(10))
        twin = descriptor()
        assert twin.serving_endpoint is not None
        twin.serving_endpoint.endpoint = "gen2"
        relay.set_catalog([descriptor(), twin])
        assert await client.wait_for(lambda: client.replica_stats() == {}, scaled(10))
        assert client.counters()[key.relay]["catalog_duplicate_pool"] == 2
        assert client.drops["withdrawn"] == 1 and client.overlap([1, 2, 3, 4], "m") == {}
        relay.set_catalog([twin])  # listed once: served, under the endpoint that lists it
        twin_key = dataclasses.replace(key, endpoint="gen2")
        assert await client.wait_for(lambda: installed_at(client, twin_key, 11), scaled(10))


async def test_readiness_and_load_views() -> None:
    async with scripted() as (_relay, client, key):
        assert await client.wait_for(
            lambda: installed_at(client, key, 11) and client.load(), scaled(10)
        )
        (entry,) = client.readiness()
        assert entry.routable and entry.state == "READY" and entry.members == ("ns/be/gen",)
        lv = client.load()[key]
        assert lv.authoritative and lv.utilization == pytest.approx(0.25)
        conn = client.connections[0]
        assert conn.identity == (RELAY.drt_instance_id, RELAY.relay_incarnation)


class _MemberAtTheEndpoint(ScriptedRelay):
    """Its READY readiness entry has one member, at the pool's endpoint, naming ``pool_id``
    (None: naming no pool)."""

    def __init__(self, pool_id: pb.KvPoolId | None) -> None:
        super().__init__()
        self.member_pool_id = pool_id

    async def _readiness(self, stream: Any) -> None:
        await stream.recv_message()
        member = pb.TopologyMember(
            endpoint=descriptor().serving_endpoint, roles=[pb.WorkerRole.AGGREGATED],
            pool_id=self.member_pool_id,
        )
        await stream.send_message(pb.ServingReadinessUpdate(
            protocol_version=1, relay=RELAY, revision=1, contract_marker=MARKER,
            entries=[pb.TopologyEntry(namespace="ns", canonical_model_id="m", state=2,
                                      present_roles=[pb.WorkerRole.AGGREGATED],
                                      members=[member])]))  # fmt: skip
        await asyncio.Event().wait()


@pytest.mark.parametrize(
    ("member", "routable"),
    [("this pool", True), ("no pool", True), ("another pool", False)],
)
async def test_a_member_is_this_pool_by_its_pool_id_else_by_its_endpoint(
    member: str, routable: bool
) -> None:
    """A READY member at the pool's endpoint that names another pool (``pool_id``) is that pool,
    not this one: the pool is not routable. The endpoint decides only for a member naming no
    pool. It counted as routable on the endpoint alone."""
    pool_id = {"this pool": producer().pool_id, "no pool": None,
               "another pool": producer(dc_id=DC_ID + 1).pool_id}[member]  # fmt: skip
    relay = _MemberAtTheEndpoint(pool_id)
    async with scripted(relay=relay) as (_relay, client, key):
        assert await client.wait_for(
            lambda: installed_at(client, key, 11) and bool(client.readiness()), scaled(10)
        )
        assert client.overlap([1, 2, 3, 4], "m", routable_only=False) == {key: 0}
        assert client.overlap([1, 2, 3, 4], "m") == ({key: 0} if routable else {})
