"""Pure parts of the SDK against independent oracles: the depth search (linear scan), query
planning and hashing (``xxhash`` package), the replica state machine (CBI1 encoder + rules)."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import ClientConfig, ConsumerViolation, PoolReplica, linear_depth, prefix_depth
from kvrelay.client.config import ClientConfigError
from kvrelay.client.errors import reason_from_trailer
from kvrelay.client.query import HashCache, plan_for
from kvrelay.pool.ckf import Lane
from kvrelay.publication import cbi1
from tests.support.scripted_relay import (
    BUCKETS,
    DC_ID,
    RELAY,
    SEED,
    delta,
    descriptor,
    frame,
    heartbeat,
    producer,
    snapshot,
)

# ----------------------------------------------------------------------------- search


@settings(max_examples=200, deadline=None)
@given(
    depth=st.integers(0, 300),
    extra=st.integers(0, 300),
    fps=st.sets(st.integers(0, 600), max_size=30),
    window=st.integers(1, 8),
)
def test_search_never_below_linear_and_exact_without_false_positives(
    depth: int, extra: int, fps: set[int], window: int
) -> None:
    n = depth + extra
    present = set(range(depth))
    calls: list[int] = []

    def exact(i: int) -> bool:
        calls.append(i)
        return i in present

    assert prefix_depth(n, exact, window) == min(depth, n)
    assert len(set(calls)) == len(calls)  # each position probed at most once
    assert linear_depth(n, exact) == min(depth, n)
    noisy = present | fps

    def probe(i: int) -> bool:
        return i in noisy

    got = prefix_depth(n, probe, window)
    assert linear_depth(n, probe) <= got <= n


def test_search_probes_logarithmically_and_window_trims_inflation() -> None:
    seen: list[int] = []

    def probe(i: int) -> bool:
        seen.append(i)
        return i < 700

    assert prefix_depth(1000, probe, 2) == 700
    assert len(seen) <= 2 * 11 + 2
    # true depth 5; block 6 answers present falsely (a false positive), 5 absent:
    # sampling hits 0,1,2,4 then misses 8; binary search probes 6 (false hit) then 7 → boundary
    # 7; the window re-checks 5 and 6, finds 5 absent → 5, not the inflated 7.
    noisy = {0, 1, 2, 3, 4, 6}
    assert prefix_depth(20, lambda i: i in noisy, 2) == 5
    assert prefix_depth(20, lambda i: i in noisy, 1) == 7


def test_backoff_is_bounded_and_jittered() -> None:
    cfg = ClientConfig(backoff_initial_s=0.1, backoff_max_s=2.0, backoff_jitter=0.5)
    rng = random.Random(1)
    delays = [cfg.backoff(a, rng) for a in range(40)]
    assert all(0.05 <= d <= 2.0 for d in delays)
    assert max(delays[:3]) <= 0.4 and min(delays[10:]) >= 1.0
    with pytest.raises(ClientConfigError):
        ClientConfig(verification_window=9)
    with pytest.raises(ClientConfigError):
        ClientConfig(max_message_bytes=4 << 20)


def test_trailer_reason_names() -> None:
    assert reason_from_trailer("RELAY_ERROR_REASON_SUBSCRIBER_LAGGED") == "subscriber_lagged"
    assert reason_from_trailer("RELAY_ERROR_REASON_BOGUS") is None
    assert reason_from_trailer("RELAY_ERROR_REASON_UNSPECIFIED") is None
    assert reason_from_trailer(None) is None


# ----------------------------------------------------------------------------- hashing & plans


def ref_seq(tokens: list[int], bs: int, salt: int, eagle: bool) -> list[int]:
    """Independent §7 pipeline with the xxhash package."""
    window = bs + 1 if eagle else bs
    n = max(0, (len(tokens) - 1) // bs) if eagle else len(tokens) // bs
    out: list[int] = []
    for i in range(n):
        w = tokens[i * bs : i * bs + window]
        h = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(w)}I", *w), seed=salt)
        if out:
            h = xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], h), seed=1337)
        out.append(h)
    return out


def ref_salt(lora: str | None, ns: str | None) -> int:
    s = 1337
    if lora:
        s += xxhash.xxh3_64_intdigest(lora.encode(), seed=0)
    if ns:
        s += xxhash.xxh3_64_intdigest(ns.encode(), seed=1)
    return s & (2**64 - 1)


def lora_descriptor(fmt: int, block: int) -> pb.KvPoolDescriptor:
    d = descriptor()
    d.query_semantics = pb.KvQuerySemantics(kv_block_size=block, hash_format=fmt)
    d.registrations = [
        pb.ModelRegistration(canonical_model_id="base",
                             target=pb.ModelTarget(base=pb.BaseModelTarget(base_model="base")),
                             aliases=["base-alias"]),
        pb.ModelRegistration(canonical_model_id="tuned",
                             target=pb.ModelTarget(lora=pb.LoraModelTarget(base_model="base",
                                                                           adapter="tuned-adp")),
                             aliases=["tuned-alias"]),
    ]  # fmt: skip
    return d


@pytest.mark.parametrize(("fmt", "block"), [(1, 4), (2, 4), (1, 16), (2, 3)])
def test_plans_hash_like_the_reference(fmt: int, block: int) -> None:
    d = lora_descriptor(fmt, block)
    tokens = list(range(100, 100 + 5 * block + 2))
    cache = HashCache(tokens)
    cases = [
        (("base", None), None),
        (("base-alias", None), None),
        (("tuned", None), "tuned-adp"),
        (("tuned-alias", None), "tuned-adp"),
        (("base", "tuned"), "tuned-adp"),
        (("base", "tuned-adp"), "tuned-adp"),
    ]
    for (model, lora), adapter in cases:
        plan = plan_for(d, model, lora)
        assert plan is not None and plan.adapter == adapter and plan.eagle == (fmt == 2)
        for ns in (None, "tenant-a"):
            got = cache.get(plan.block_size, plan.eagle, plan.salt(ns)).tolist()
            assert got == ref_seq(tokens, block, ref_salt(adapter, ns), fmt == 2)
    assert plan_for(d, "unknown") is None
    assert plan_for(d, "base", "missing-adapter") is None
    assert plan_for(d, "tuned", "other") is None


def test_a_target_of_an_unknown_kind_makes_the_pool_unsupported() -> None:
    """A registration whose ``ModelTarget`` carries a oneof variant this SDK does not know (a
    field 3, parsed as an unset target): the pool answers no query, for that registration nor for
    the pool's base model (§3.3: never read as a base-model target)."""
    d = lora_descriptor(1, 4)
    future = pb.ModelRegistration(canonical_model_id="future")
    wire = bytes(future) + b"\x12\x04" + b"\x1a\x02" + b"xy"  # target { 3: "xy" }
    parsed = pb.ModelRegistration.parse(wire)
    assert parsed.target is not None and parsed.target.base is None and parsed.target.lora is None
    assert plan_for(d, "base") is not None
    d.registrations = [*d.registrations, parsed]
    assert [plan_for(d, m) for m in ("future", "base", "tuned")] == [None, None, None]
    d.registrations[-1] = pb.ModelRegistration(canonical_model_id="future")  # no target at all
    assert plan_for(d, "base") is None


# ----------------------------------------------------------------------------- replica


def installed() -> PoolReplica:
    r = PoolReplica(producer(), RELAY)
    for fu in snapshot(5):
        r.feed(fu)
    assert r.installed and r.sequence == 5
    return r


def test_replica_applies_deltas_and_heartbeats() -> None:
    r = installed()
    info = r.feed(delta(5, 6, buckets=(1, 7), words=(0, 0x0001_0000_0000_0002)))
    assert info.kind == "delta" and info.images == 2 and r.sequence == 6
    assert r.table is not None and int(r.table[1]) == 0 and int(r.table[7]) == 0x0001_0000_0000_0002
    assert r.occupancy() == 2 * 2 + 2  # words 0 and 2 keep 2 slots each, bucket 7 has 2
    r.feed(heartbeat(6))
    assert r.counters.frames == {"snapshot_chunk": 1, "delta": 1, "heartbeat": 1}


def test_replica_membership_matches_a_producer_lane() -> None:
    lane = Lane(BUCKETS, SEED)
    rng = np.random.default_rng(4)
    keys = rng.integers(0, 2**63, size=600, dtype=np.uint64)
    assert bool(np.all(lane.insert(keys)))
    r = PoolReplica(producer(), RELAY)
    for payload in cbi1.encode_snapshot_chunks(lane.table, seed=SEED, bucket_count=BUCKETS,
                                               dc_id=DC_ID, epoch=3):  # fmt: skip
        r.feed(frame(1, 3, 3, payload))
    assert bool(np.all(r.contains(keys)))


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([delta(5, 6, dc_id=1)], "dc_id_mismatch"),
        ([frame(3, 5, 5, b"x")], "heartbeat_payload"),
        ([frame(2, 5, 6, cbi1.encode_snapshot_chunks(
            np.zeros(BUCKETS, np.uint64), seed=SEED, bucket_count=BUCKETS, dc_id=DC_ID,
            epoch=6)[0])], "kind_mismatch"),
        ([frame(2, 5, 6, b"CBI1" + b"\0" * 10)], "cbi1_too_short"),
        ([frame(3, 5, 5, b"", prod=producer(layout_generation=2))], "producer_identity"),
    ],
)
def test_replica_rejects(frames: list[pb.FilterUpdate], reason: str) -> None:
    r = installed()
    before = None if r.table is None else r.table.copy()
    with pytest.raises(ConsumerViolation) as exc:
        for fu in frames:
            r.feed(fu)
    assert exc.value.reason == reason
    assert r.sequence == 5 and before is not None and np.array_equal(r.table, before)


def test_bad_envelope() -> None:
    r = PoolReplica(producer(), RELAY)
    fu = snapshot(5)[0]
    fu.contract_marker = 1
    with pytest.raises(ConsumerViolation, match="envelope"):
        r.feed(fu)


def test_chunk_rules_hold_the_producer_split_and_one_cut() -> None:
    """A 2-chunk lane (2^20 buckets): chunk 1 of another cut than the one assembled is a
    ``snapshot_sequence`` violation; a chunk that is not the producer's slice (another count,
    offset or size, such as the endless stream of empty chunks claiming 2^32 of them) is
    ``cbi1_bad_chunk``."""
    import numpy as np
    import pytest

    from kvrelay.client import errors as E
    from kvrelay.client import stream_rules as rules
    from kvrelay.client.errors import ConsumerViolation
    from kvrelay.publication import cbi1

    bc, step = 1 << 20, cbi1.SNAPSHOT_CHUNK_BUCKETS

    def chunk(epoch: int, index: int, count: int = 2, offset: int | None = None,
              n: int = step) -> cbi1.SnapshotChunk:  # fmt: skip
        off = index * step if offset is None else offset
        return cbi1.SnapshotChunk(7, bc, 1, epoch, index, count, off, np.zeros(n, np.uint64))

    assert rules.chunk_frame(chunk(5, 0), 1, 5, None).chunk_index == 0
    assert rules.chunk_frame(chunk(5, 1), 1, 5, 5).chunk_index == 1
    with pytest.raises(ConsumerViolation) as other:
        rules.chunk_frame(chunk(6, 1), 1, 6, 5)
    assert other.value.reason == E.SNAPSHOT_SEQUENCE
    for bad in (chunk(5, 0, count=2**32 - 1), chunk(5, 0, n=0), chunk(5, 1, offset=step - 1),
                chunk(5, 1, n=step - 1)):  # fmt: skip
        with pytest.raises(ConsumerViolation) as split:
            rules.chunk_frame(bad, 1, 5, 5)
        assert split.value.reason == E.CBI1_PREFIX + "bad_chunk"
