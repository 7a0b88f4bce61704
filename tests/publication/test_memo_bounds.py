"""The planes' identity memos hold the identities in use, not every one ever seen.

Every new pool generation brings new identity objects (its producer, its pool id). The memos
kept each one up to their bound of 4,096, so a relay whose pools were rebuilt for months
(engine restarts, reloads, fences) held thousands of dead identities per plane, a few KiB each.
"""

from __future__ import annotations

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.publication.load import LoadPlane, PoolLoadInput, RankLoad
from kvrelay.publication.readiness import EndpointState, ReadinessPlane
from kvrelay.publication.serving_load import (
    ModelServingInput,
    PoolServingInput,
    ServingLoadInputs,
    ServingLoadPlane,
)
from tests.support.identities import RELAY, make_pool_id, make_producer

GENERATIONS = 40


def test_readiness_keeps_only_the_current_pool_ids() -> None:
    plane = ReadinessPlane(RELAY)
    for gen in range(GENERATIONS):
        ep = EndpointState(
            namespace="ns", component="backend", endpoint="generate",
            roles=frozenset({pb.WorkerRole.AGGREGATED}), live=1, probed=True,
            models=frozenset({"m"}), pool_id=make_pool_id(1 + gen % 2),  # a new object each time
        )  # fmt: skip
        plane.set_topology([ep])
        assert len(plane._pool_ids) <= 1, gen


def test_load_keeps_only_the_listed_producers() -> None:
    listed: list[PoolLoadInput] = []
    plane = LoadPlane(RELAY, provider=lambda: listed)
    for gen in range(GENERATIONS):
        listed[:] = [(make_producer(1, gen + 1), [RankLoad(1, 10)]),
                     (make_producer(2, gen + 1), [RankLoad(2, 10)])]  # fmt: skip
        assert plane._build(gen + 1) is not None
        assert len(plane._ids) <= 2, gen
    plane.close()


def test_serving_load_keeps_only_the_listed_identities() -> None:
    inputs = ServingLoadInputs()
    plane = ServingLoadPlane(RELAY, provider=lambda: inputs)
    for gen in range(GENERATIONS):
        producer = make_producer(1, gen + 1)
        inputs = ServingLoadInputs(
            pools=[PoolServingInput(producer, [RankLoad(1, 10)])],
            models=[ModelServingInput("ns", "m", 1, 1, 1, [make_pool_id(1)])],
        )
        assert plane._build(gen + 1) is not None
        assert len(plane._producers) <= 1 and len(plane._pool_ids) <= 1, gen
    plane.close()
