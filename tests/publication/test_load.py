"""Load plane (§10.1): entry arithmetic against a big-int oracle, and the window cadence."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.publication.load import LoadPlane, PoolLoadInput, RankLoad, load_entry
from kvrelay.publication.plane import PlaneClosed
from tests.support.timing import scaled

U64 = (1 << 64) - 1
MakeProducer = Callable[..., pb.ProducerIdentity]


def test_sums_and_counts(producer: MakeProducer) -> None:
    e = load_entry(producer(1), [RankLoad(10, 100), RankLoad(5, 200)])
    assert (e.kv_used_blocks, e.total_kv_blocks) == (15, 300)
    assert (e.kv_observed_ranks, e.kv_expected_ranks) == (2, 2)
    assert e.producer == producer(1)


def test_saturates_at_u64_max(producer: MakeProducer) -> None:
    e = load_entry(producer(1), [RankLoad(U64, U64), RankLoad(1, 1), RankLoad(1 << 70, 5)])
    assert e.kv_used_blocks == U64 and e.total_kv_blocks == U64
    e = load_entry(producer(1), [RankLoad(U64 - 1, 1), RankLoad(1, 1)])
    assert e.kv_used_blocks == U64  # exactly reaching the max
    assert bytes(e)  # and it still encodes as a u64


def test_unknown_capacity_encodes_zero(producer: MakeProducer) -> None:
    e = load_entry(producer(1), [RankLoad(3, 100), RankLoad(4, None)])
    assert e.total_kv_blocks == 0  # no authoritative capacity, never "full"
    assert e.kv_used_blocks == 7 and e.kv_observed_ranks == 2


def test_partial_observation_is_visible(producer: MakeProducer) -> None:
    e = load_entry(producer(1), [RankLoad(None, 100), RankLoad(4, 100), RankLoad(None, 100)])
    assert e.kv_used_blocks == 4  # unknown usage contributes 0 ...
    assert (e.kv_observed_ranks, e.kv_expected_ranks) == (1, 3)  # ... and shows as partial
    assert e.total_kv_blocks == 300


def test_no_ranks(producer: MakeProducer) -> None:
    e = load_entry(producer(1), [])
    assert (e.kv_used_blocks, e.total_kv_blocks, e.kv_observed_ranks, e.kv_expected_ranks) == (
        0,
        0,
        0,
        0,
    )


def test_rank_counts_clamp_to_u32(producer: MakeProducer) -> None:
    class Many(Sequence[RankLoad]):
        """A huge rank list without allocating it: every rank reported (7, None)."""

        n = (1 << 32) + 5

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter([RankLoad(7, None)] * 3)  # iteration is what the sum sees

    e = load_entry(producer(1), Many())
    assert e.kv_expected_ranks == (1 << 32) - 1


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_rank_load_rejects_bad_values(bad: object) -> None:
    with pytest.raises(ValueError):
        RankLoad(bad, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RankLoad(None, bad)  # type: ignore[arg-type]


_val = st.one_of(st.none(), st.integers(0, 1 << 66))


def _oracle(ranks: list[tuple[int | None, int | None]]) -> tuple[int, int, int, int]:
    """Big-int restatement of §10.1: exact sums then clamp; capacity needs every rank known."""
    used = sum(u for u, _ in ranks if u is not None)
    caps = [c for _, c in ranks]
    total = sum(c for c in caps if c is not None) if ranks and None not in caps else 0
    observed = sum(1 for u, _ in ranks if u is not None)
    return min(used, U64), min(total, U64), observed, len(ranks)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_val, _val), max_size=12))
def test_entry_matches_bigint_oracle(ranks: list[tuple[int | None, int | None]]) -> None:
    prod = pb.ProducerIdentity(layout_generation=3)
    e = load_entry(prod, [RankLoad(u, c) for u, c in ranks])
    got = (e.kv_used_blocks, e.total_kv_blocks, e.kv_observed_ranks, e.kv_expected_ranks)
    assert got == _oracle(ranks)
    assert pb.KvPoolLoadEntry.parse(bytes(e)) == e


# ---------------------------------------------------------------------------------- plane


class Fleet:
    """A provider backed by mutable per-pool rank observations."""

    def __init__(self) -> None:
        self.pools: dict[int, list[RankLoad]] = {}
        self.calls = 0
        self.fail = False
        self.make: MakeProducer | None = None

    def __call__(self) -> Iterable[PoolLoadInput]:
        self.calls += 1
        if self.fail:
            raise RuntimeError("registry unavailable")
        assert self.make is not None
        return [(self.make(n), ranks) for n, ranks in self.pools.items()]


async def test_initial_window_and_envelope(relay: pb.RelayIdentity, producer: MakeProducer) -> None:
    fleet = Fleet()
    fleet.make = producer
    fleet.pools = {2: [RankLoad(1, 10)], 1: [RankLoad(None, 10)]}
    before = time.time_ns() // 1_000_000
    plane = LoadPlane(relay, window_ms=250, provider=fleet)
    seq, msg = plane.current()
    assert seq == 0 == msg.window_sequence
    assert (msg.protocol_version, msg.contract_marker, msg.window_ms) == (1, 0x4B565231, 250)
    assert msg.relay == relay
    assert before <= msg.observed_ms <= time.time_ns() // 1_000_000
    # one entry per active pool generation, ordered by producer identity bytes
    keys = [bytes(p.producer) for p in msg.pools]
    assert keys == sorted(keys) and len(keys) == 2
    plane.close()


async def test_idle_window_is_empty(relay: pb.RelayIdentity) -> None:
    plane = LoadPlane(relay)
    assert plane.current()[1].pools == []
    assert plane.publish_window() is True
    assert plane.current()[0] == 1 and plane.current()[1].pools == []


async def test_window_cadence(relay: pb.RelayIdentity, producer: MakeProducer) -> None:
    fleet = Fleet()
    fleet.make = producer
    fleet.pools = {1: [RankLoad(1, 8)]}
    window_ms = 40
    plane = LoadPlane(relay, window_ms=window_ms, provider=fleet)
    start_ms = time.time_ns() // 1_000_000
    plane.start()
    plane.start()  # idempotent: still one timer
    seen: list[pb.KvPoolLoadUpdate] = []
    t0 = time.monotonic()
    version = 0
    while len(seen) < 6:
        version, msg = await asyncio.wait_for(plane.wait_newer(version), scaled(2))
        seen.append(msg)
        fleet.pools[1] = [RankLoad(len(seen), 8)]
    elapsed = time.monotonic() - t0
    seqs = [m.window_sequence for m in seen]
    assert seqs == list(range(1, 7))  # +1 per window, no gaps, no bursts
    assert elapsed >= 5 * window_ms / 1000  # six windows need at least five periods after the 1st
    assert all(m.window_ms == window_ms for m in seen)
    # paced by the timer: window n no earlier than n periods after the start (a busy loop only
    # makes windows later; 1 ms for observed_ms's granularity), however late the one before was
    late = [m.observed_ms - start_ms - m.window_sequence * window_ms for m in seen]
    assert min(late) >= -1, late
    # each window re-reads the provider (usage follows the fleet)
    assert [m.pools[0].kv_used_blocks for m in seen[1:]] == list(range(1, 6))
    plane.close()
    await plane.wait_closed()
    with pytest.raises(PlaneClosed):
        await plane.wait_newer(version)
    calls = fleet.calls
    await asyncio.sleep(3 * window_ms / 1000)
    assert fleet.calls == calls  # the timer really stopped


async def test_windows_nobody_waits_for_are_built_when_read(
    relay: pb.RelayIdentity, producer: MakeProducer
) -> None:
    """With no stream waiting, the timer only counts due windows: no provider call, no message.
    The first read builds the newest one, numbered as if each had been built on time, from the
    state at that read (observed_ms then); while a stream waits, each is built when due."""
    fleet = Fleet()
    fleet.make = producer
    fleet.pools = {1: [RankLoad(1, 8)]}
    window_ms = 30
    plane = LoadPlane(relay, window_ms=window_ms, provider=fleet)
    assert fleet.calls == 1  # window 0, at construction
    t0 = time.monotonic()
    plane.start()
    await asyncio.sleep(6 * window_ms / 1000)
    assert fleet.calls == 1  # six periods, nobody waiting: nothing built
    ticks = int((time.monotonic() - t0) * 1000 // window_ms)
    assert plane.version >= 1
    fleet.pools[1] = [RankLoad(7, 8)]
    before = time.time_ns() // 1_000_000
    seq, msg = plane.current()
    assert fleet.calls == 2 and seq == msg.window_sequence == plane.version
    assert 1 <= seq <= ticks + 1  # the timer's count, not 1 (and no more windows than periods)
    assert msg.observed_ms >= before and msg.pools[0].kv_used_blocks == 7  # fresh at the read
    assert plane.current()[0] == seq and fleet.calls == 2  # built once
    # a waiting stream: each window built when due, +1 each
    got = [seq]
    for _ in range(3):
        seq, msg = await asyncio.wait_for(plane.wait_newer(seq), scaled(2))
        got.append(seq)
    assert got == list(range(got[0], got[0] + 4))
    assert fleet.calls == 5
    plane.close()
    await plane.wait_closed()


async def test_close_wakes_subscribers(relay: pb.RelayIdentity) -> None:
    plane = LoadPlane(relay, window_ms=10_000)
    plane.start()
    waiter = asyncio.create_task(plane.wait_newer(0))
    await asyncio.sleep(0)
    plane.close()
    with pytest.raises(PlaneClosed):
        await asyncio.wait_for(waiter, scaled(1))
    await plane.wait_closed()
    with pytest.raises(RuntimeError):
        plane.start()


async def test_provider_failure_skips_window(
    relay: pb.RelayIdentity, producer: MakeProducer
) -> None:
    fleet = Fleet()
    fleet.make = producer
    fleet.pools = {1: [RankLoad(1, 8)]}
    plane = LoadPlane(relay, window_ms=1000, provider=fleet)
    fleet.fail = True
    assert plane.publish_window() is False
    assert plane.provider_errors == 1
    seq, msg = plane.current()
    assert seq == 0 and len(msg.pools) == 1  # last good window kept, not replaced by "no pools"
    fleet.fail = False
    # the failed window's number is not reused: the next one is numbered as if built on time
    assert plane.publish_window() is True and plane.current()[0] == 2
    # windows due while nobody waited, built when read: a failure there keeps the last good
    # window too, and the due ones stay due (numbered on, never reused)
    plane._tick()
    plane._tick()
    assert plane.version == 4 and fleet.calls == 4  # nothing built for them yet
    fleet.fail = True
    seq, msg = plane.current()
    assert seq == 2 and len(msg.pools) == 1 and plane.provider_errors == 3
    assert plane.version == 4  # still due
    fleet.fail = False
    assert plane.current()[0] == 4 and fleet.calls == 6  # the next read built the newest
    plane._tick()
    assert plane.current()[0] == 5


async def test_bad_pool_input_drops_only_that_entry(
    relay: pb.RelayIdentity, producer: MakeProducer
) -> None:
    def provider() -> list[PoolLoadInput]:
        return [(producer(1), [RankLoad(1, 2)]), (producer(2), [None])]  # type: ignore[list-item]

    plane = LoadPlane(relay, provider=provider)
    msg = plane.current()[1]
    assert [p.producer for p in msg.pools] == [producer(1)]
    assert plane.entry_errors == 1


async def test_duplicate_generation_listed_once(
    relay: pb.RelayIdentity, producer: MakeProducer
) -> None:
    def provider() -> list[PoolLoadInput]:
        return [(producer(1), [RankLoad(1, 2)]), (producer(1), [RankLoad(9, 9)])]

    plane = LoadPlane(relay, provider=provider)
    (entry,) = plane.current()[1].pools
    assert entry.kv_used_blocks == 1 and plane.entry_errors == 1


@pytest.mark.parametrize("bad", [0, -5, 366 * 24 * 3600 * 1000])
def test_window_ms_bounds(relay: pb.RelayIdentity, bad: int) -> None:
    with pytest.raises(ValueError):
        LoadPlane(relay, window_ms=bad)
