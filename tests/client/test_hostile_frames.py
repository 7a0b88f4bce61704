"""A hostile relay's frames against the SDK, beyond ``test_violations``: a lane of two snapshot
chunks (chunks out of order, missing, repeated, another count; a delta, a heartbeat or a clean
end between them), identity and envelope drift after the install, broken CBI1 headers and
bodies, an oversized message. Each drops only that pool's replica at once, counts the reason,
and the SDK resubscribes to a valid stream; queries never see the pending replica."""

from __future__ import annotations

import asyncio
import contextlib
import struct

import numpy as np
import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import RelayClient
from kvrelay.client.views import PoolKey
from kvrelay.publication import cbi1
from tests.support import scripted_relay as S
from tests.support.timing import scaled

BIG = 1 << 20  # two chunks of 524,288 buckets
BIG_PROD = S.producer()
assert BIG_PROD.ckf_format is not None
BIG_PROD.ckf_format.bucket_count = BIG


def big_chunks(seq: int) -> list[pb.FilterUpdate]:
    words = np.zeros(BIG, np.uint64)
    words[:3] = 0x0001_0001
    chunks = cbi1.encode_snapshot_chunks(words, seed=S.SEED, bucket_count=BIG, dc_id=S.DC_ID,
                                         epoch=seq)  # fmt: skip
    return [S.frame(1, seq, seq, c, prod=BIG_PROD) for c in chunks]


def big_delta(base: int, seq: int) -> pb.FilterUpdate:
    payload = cbi1.encode_delta(np.array([5], np.uint64), np.array([0x0009_0008_0007_0006],
                                np.uint64), seed=S.SEED, bucket_count=BIG, dc_id=S.DC_ID,
                                base_epoch=base, epoch=seq)  # fmt: skip
    return S.frame(2, base, seq, payload, prod=BIG_PROD)


def big_relay(*scripts: S.Script) -> contextlib.AbstractAsyncContextManager[
        tuple[S.ScriptedRelay, RelayClient, PoolKey]]:  # fmt: skip
    """The scripted relay serving the big lane (its default: a snapshot at 10, a delta)."""
    relay = S.ScriptedRelay(catalog=[S.descriptor(BIG_PROD)])
    relay.default = lambda: S.Script([*big_chunks(10), big_delta(10, 11)], hold=True)
    return S.scripted(*scripts, relay=relay)


MULTI: dict[str, tuple[list[int | str], str]] = {
    "out_of_order": ([1, 0], "cbi1_sequence_violation"),
    "missing_first": ([1], "cbi1_sequence_violation"),
    "repeated_first": ([0, 0], "snapshot_sequence"),
    "delta_mid_snapshot": ([0, "delta"], "delta_before_snapshot"),
    "heartbeat_mid_snapshot": ([0, "heartbeat"], "heartbeat_before_snapshot"),
    "other_cut": ([0, "other_cut"], "snapshot_sequence"),
}


@pytest.mark.parametrize("case", sorted(MULTI))
async def test_two_chunk_snapshot_violations(case: str) -> None:
    plan, reason = MULTI[case]
    chunks = big_chunks(5)
    frames: list[pb.FilterUpdate] = []
    for p in plan:
        if p == "delta":
            frames.append(big_delta(5, 6))
        elif p == "heartbeat":
            frames.append(S.frame(3, 5, 5, b"", prod=BIG_PROD))
        elif p == "other_cut":
            frames.append(big_chunks(6)[1])
        else:
            frames.append(chunks[int(p)])
    async with big_relay(S.Script(frames, hold=True)) as (relay, client, key):
        assert await client.wait_for(lambda: S.installed_at(client, key, 11), scaled(10)), case
        st = client.replica_stats()[key]
        assert st.drops == {reason: 1}, st.drops
        assert relay.subscriptions == 2


async def test_a_resubscription_never_exposes_a_half_assembled_snapshot() -> None:
    """Installed at 5, then a gap: the replica is gone at once, and while the next stream has
    sent only its first chunk, the pool is absent from every query (unknown, never a guess)."""
    gate = asyncio.Event()
    first = S.Script([*big_chunks(5), big_delta(6, 7)], hold=True)
    half = S.Script(big_chunks(8)[:1], gate=gate, after=big_chunks(8)[1:], hold=True)
    async with big_relay(first, half) as (relay, client, key):
        assert await client.wait_for(lambda: relay.subscriptions == 2, scaled(10))
        assert await client.wait_for(
            lambda: client.connections[0].slots[key].pending is not None
            and client.connections[0].slots[key].frames["snapshot_chunk"] >= 3, scaled(10))
        st = client.replica_stats()[key]
        assert not st.installed and st.drops == {"sequence_gap": 1}
        assert key not in client.contains([1, 2, 3])
        gate.set()
        assert await client.wait_for(lambda: S.installed_at(client, key, 8), scaled(10))
        assert key in client.contains([1, 2, 3])


async def test_a_clean_end_mid_snapshot_is_an_invalidation() -> None:
    async with big_relay(S.Script(big_chunks(5)[:1])) as (_relay, client, key):
        assert await client.wait_for(lambda: S.installed_at(client, key, 11), scaled(10))
        assert client.replica_stats()[key].drops == {"eof": 1}


def _bad_header(fu: pb.FilterUpdate, offset: int, fmt: str, value: int) -> pb.FilterUpdate:
    p = bytearray(fu.payload)
    struct.pack_into(fmt, p, offset, value)
    return S.frame(int(fu.kind), int(fu.base_sequence), int(fu.sequence), bytes(p))


def _resealed(fu: pb.FilterUpdate, body: bytes) -> pb.FilterUpdate:
    p = bytearray(fu.payload[: cbi1.HEADER]) + body
    struct.pack_into("<I", p, 44, cbi1.checksum(body))
    return S.frame(int(fu.kind), int(fu.base_sequence), int(fu.sequence), bytes(p))


D = S.delta(5, 6)
CASES = {
    "cbi1_bad_magic": S.frame(2, 5, 6, b"CBJ1" + D.payload[4:]),
    "cbi1_bad_wire_version": _bad_header(D, 4, "<H", 2),
    "cbi1_bad_flags": _bad_header(_resealed(D, D.payload[48:]), 6, "<H", 3),
    "cbi1_format_mismatch": _bad_header(D, 12, "<Q", S.SEED ^ 1),
    "cbi1_bad_body": _resealed(D, D.payload[48:] + b"\0"),
    "cbi1_bucket_out_of_range": S.frame(2, 5, 6, cbi1.encode_delta_validated(
        np.array([S.BUCKETS], np.uint64), np.array([1], np.uint64), seed=S.SEED,
        bucket_count=S.BUCKETS, dc_id=S.DC_ID, base_epoch=5, epoch=6)),
    "cbi1_duplicate_bucket": S.frame(2, 5, 6, cbi1.encode_delta_validated(
        np.array([3, 3], np.uint64), np.array([1, 2], np.uint64), seed=S.SEED,
        bucket_count=S.BUCKETS, dc_id=S.DC_ID, base_epoch=5, epoch=6)),
    "cbi1_too_long": S.frame(2, 5, 6, D.payload + bytes(cbi1.MAX_FRAME)),
    "producer_identity": S.frame(3, 5, 5, b"", prod=S.producer(layout_generation=2)),
    "envelope": pb.FilterUpdate(
        protocol_version=1, relay=S.RELAY, producer=S.producer(), base_sequence=5, sequence=5,
        kind=3, contract_marker=S.MARKER + 1),
    "heartbeat_payload": S.frame(3, 5, 5, b"x"),
    "kind_mismatch": S.frame(2, 5, 6, S.snapshot(6)[0].payload),
    "snapshot_sequence": S.frame(1, 4, 5, S.snapshot(5)[0].payload),
}  # fmt: skip


@pytest.mark.parametrize("reason", sorted(CASES))
async def test_more_violations_after_the_install(reason: str) -> None:
    frames = [*S.snapshot(5), CASES[reason]] if reason != "snapshot_sequence" else [CASES[reason]]
    async with S.scripted(S.Script(frames, hold=True)) as (_relay, client, key):
        assert await client.wait_for(lambda: S.installed_at(client, key, 11), scaled(10)), reason
        assert client.replica_stats()[key].drops == {reason: 1}


async def test_oversized_messages_drop_and_leave_the_connection_usable() -> None:
    huge = S.frame(3, 5, 5, bytes(9 << 20))
    scripts = [S.Script([*S.snapshot(5), huge], hold=True) for _ in range(3)]
    async with S.scripted(*scripts) as (relay, client, key):
        assert await client.wait_for(lambda: S.installed_at(client, key, 11), scaled(10))
        # refused from its length prefix (docs/client.md: ``max_message_bytes``), 3 times
        assert client.replica_stats()[key].drops == {"status_resource_exhausted": 3}
        assert relay.subscriptions == 4
