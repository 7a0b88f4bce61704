"""Valid identities the service validator accepts, and fixtures handing out their builders."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb

RELAY = pb.RelayIdentity(drt_instance_id=0xDEADBEEF12345678, relay_incarnation=0x1234_5678_9ABC)


def make_pool_id(n: int) -> pb.KvPoolId:
    return pb.KvPoolId(
        identity_version=1,
        indexer_domain=pb.IndexerDomainId(
            cache_semantics=pb.DigestIdentity(
                digest=bytes([n % 256]) * 16, source=pb.IdentitySource.DEFAULT_DERIVED
            ),
            routing_scope=pb.DigestIdentity(
                digest=bytes([(n * 7 + 1) % 256]) * 16, source=pb.IdentitySource.EXPLICIT
            ),
        ),
        dc_id=0x4F0A_1234_5678_9ABC,
    )


def make_producer(n: int, generation: int = 1) -> pb.ProducerIdentity:
    return pb.ProducerIdentity(
        pool_id=make_pool_id(n),
        producer_incarnation=RELAY.relay_incarnation,
        layout_generation=generation,
        ckf_format=pb.CkfFormat(
            format_version=1,
            seed=0x5DEECE66D1B54A33,
            bucket_count=524_288,
            fingerprint_bits=16,
            slots_per_bucket=4,
        ),
    )


@pytest.fixture
def relay() -> pb.RelayIdentity:
    return pb.RelayIdentity(
        drt_instance_id=RELAY.drt_instance_id, relay_incarnation=RELAY.relay_incarnation
    )


@pytest.fixture
def producer() -> Callable[..., pb.ProducerIdentity]:
    return make_producer


@pytest.fixture
def pool_id() -> Callable[[int], pb.KvPoolId]:
    return make_pool_id
