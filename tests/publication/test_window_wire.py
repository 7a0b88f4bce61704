"""Window wire bytes built from cached pieces: byte for byte what betterproto2 serializes, and
protobuf's canonical encoding (official runtime), on random load and serving-load windows; the
identity memo behind them (one encoding per object, bounded, copies never the caller's object).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.identity_memo import IdentityMemo
from kvrelay.contract.wire import U32_MAX, U64_MAX
from kvrelay.publication.load import LoadPlane, RankLoad
from kvrelay.publication.serving_load import (
    COUNTERS,
    ModelServingInput,
    PoolServingInput,
    ServingLoadInputs,
    ServingLoadPlane,
)
from kvrelay.publication.window_wire import uint_field
from kvrelay.service.canonical import _official, canonicalize

MakeProducer = Callable[..., pb.ProducerIdentity]
MakePoolId = Callable[[int], pb.KvPoolId]


def _count(rng: random.Random) -> int | None:
    return rng.choice([None, 0, 1, rng.randrange(1 << 20), rng.randrange(1 << 64), U64_MAX])


def _ranks(rng: random.Random) -> list[RankLoad]:
    return [RankLoad(_count(rng), _count(rng)) for _ in range(rng.randrange(0, 5))]


def _check(plane: LoadPlane | ServingLoadPlane, cls: type) -> None:
    version, message = plane.current()
    wire = plane.wire(version)
    assert wire is not None
    assert wire == bytes(message)  # what betterproto2 writes for the published message
    assert wire == canonicalize(wire, cls)  # and protobuf's canonical encoding of it
    official = _official(cls.__name__)()
    official.ParseFromString(wire)
    assert official.window_sequence == version


@pytest.mark.parametrize("seed", range(6))
def test_load_windows_match_betterproto_and_canonical(
    seed: int, producer: MakeProducer, relay: pb.RelayIdentity
) -> None:
    rng = random.Random(seed)
    producers = [producer(i, rng.randrange(1, 4)) for i in range(rng.randrange(0, 40))]
    state: list[tuple[pb.ProducerIdentity, list[RankLoad]]] = []
    plane = LoadPlane(relay, provider=lambda: state)
    _check(plane, pb.KvPoolLoadUpdate)
    for _ in range(5):
        state[:] = [(p, _ranks(rng)) for p in producers if rng.random() < 0.8]
        if state and rng.random() < 0.3:
            state.append(state[0])  # listed twice: kept once
        assert plane.publish_window()
        _check(plane, pb.KvPoolLoadUpdate)


def _pool_input(rng: random.Random, p: pb.ProducerIdentity) -> PoolServingInput:
    return PoolServingInput(
        producer=p,
        ranks=_ranks(rng),
        observed_ms=[rng.randrange(1 << 41) for _ in range(rng.randrange(3))],
        live_workers=rng.choice([None, 0, 3]),
        max_concurrency=rng.choice([None, 0, 256]),
    )


def _model_input(rng: random.Random, k: int, pools: list[pb.KvPoolId]) -> ModelServingInput:
    expected = rng.randrange(4)
    observed = rng.randrange(expected + 1)
    return ModelServingInput(
        namespace=f"ns{k % 3}",
        canonical_model_id=f"model-{k}",
        expected_frontends=expected,
        observed_frontends=observed,
        ready_frontends=rng.randrange(observed + 1),
        serving_pools=rng.sample(pools, rng.randrange(len(pools) + 1)),
        totals={c: rng.randrange(1 << 40) for c in COUNTERS if rng.random() < 0.6},
        observed_ms=[rng.randrange(1 << 41) for _ in range(rng.randrange(3))],
    )


@pytest.mark.parametrize("seed", range(6))
def test_serving_load_windows_match_betterproto_and_canonical(
    seed: int, producer: MakeProducer, pool_id: MakePoolId, relay: pb.RelayIdentity
) -> None:
    rng = random.Random(100 + seed)
    producers = [producer(i) for i in range(rng.randrange(0, 30))]
    pool_ids = [p.pool_id for p in producers if p.pool_id is not None] + [pool_id(99)]
    inputs = [ServingLoadInputs()]
    plane = ServingLoadPlane(relay, provider=lambda: inputs[0])
    _check(plane, pb.ServingLoadUpdate)
    for _ in range(5):
        inputs[0] = ServingLoadInputs(
            pools=[_pool_input(rng, p) for p in producers if rng.random() < 0.8],
            models=[_model_input(rng, k, pool_ids) for k in range(rng.randrange(6))],
        )
        assert plane.publish_window()
        _check(plane, pb.ServingLoadUpdate)


def test_an_older_window_has_no_cached_wire(
    producer: MakeProducer, relay: pb.RelayIdentity
) -> None:
    plane = LoadPlane(relay, provider=lambda: [(producer(1), [RankLoad(1, 2)])])
    assert plane.publish_window() and plane.publish_window()
    version, _message = plane.current()
    assert plane.wire(version) is not None
    assert plane.wire(version - 1) is None  # the service then serializes the message itself


def test_entries_carry_a_copy_never_the_generation_object(
    producer: MakeProducer, relay: pb.RelayIdentity
) -> None:
    p = producer(3)
    plane = LoadPlane(relay, provider=lambda: [(p, [RankLoad(1, 2)])])
    assert plane.publish_window()
    (entry,) = plane.current()[1].pools
    assert entry.producer == p and entry.producer is not p


def test_uint_fields_leave_zero_out_and_clamp_nothing() -> None:
    assert uint_field(2, 0) == b""
    assert uint_field(4, U32_MAX) == bytes(pb.KvPoolLoadEntry(kv_observed_ranks=U32_MAX))
    assert uint_field(2, U64_MAX) == bytes(pb.KvPoolLoadEntry(kv_used_blocks=U64_MAX))


def test_the_memo_encodes_each_object_once_and_stays_bounded(producer: MakeProducer) -> None:
    memo: IdentityMemo[pb.ProducerIdentity] = IdentityMemo(bound=3)
    a, b = producer(1), producer(1)  # equal, but two objects
    data, copy = memo.encoded(a)
    assert data == bytes(a) and copy == a and copy is not a
    assert memo.encoded(a) == (data, copy) and memo.encoded(a)[1] is copy
    assert (memo.hits, memo.misses) == (2, 1)
    memo.encoded(b)
    assert memo.misses == 2  # identity, not equality: b's own entry
    for n in range(2, 6):
        memo.encoded(producer(n))
    assert len(memo) == 3  # least recently used out first
    memo.encoded(a)
    assert memo.misses == 7  # a was evicted: encoded again, still right
    with pytest.raises(ValueError):
        IdentityMemo(bound=0)


def test_the_memo_gives_bytes_alone_without_a_copy_and_its_own_encoding(
    producer: MakeProducer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``data`` parses nothing; a later ``encoded`` parses the copy once, from the kept bytes.
    A memo given an encoding keeps that instead of ``bytes(message)``."""
    parsed: list[bytes] = []
    real = pb.ProducerIdentity.parse

    def counted(data: bytes) -> pb.ProducerIdentity:
        parsed.append(data)
        return real(data)

    monkeypatch.setattr(pb.ProducerIdentity, "parse", staticmethod(counted))
    memo: IdentityMemo[pb.ProducerIdentity] = IdentityMemo()
    a = producer(1)
    assert memo.data(a) == bytes(a) and parsed == []
    data, copy = memo.encoded(a)
    assert data == bytes(a) and copy == a and copy is not a and parsed == [data]
    assert memo.encoded(a)[1] is copy and len(parsed) == 1
    assert (memo.hits, memo.misses) == (2, 1)
    tagged: IdentityMemo[pb.ProducerIdentity] = IdentityMemo(encode=lambda m: b"k" + bytes(m))
    assert tagged.data(a) == b"k" + bytes(a) and tagged.data(a) is tagged.data(a)
