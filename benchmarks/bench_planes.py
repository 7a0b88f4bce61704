"""Plane update costs at fleet scale: catalog/readiness recompute, load and serving-load window
builds and their wire bytes, fan-out.

The windows list the same generations' identity objects every second, as the relay's pools hand
them over (a generation keeps its ``ProducerIdentity``). ``*_window_serialize_ms`` is what
betterproto2 takes to serialize the same window from scratch: what every window cost a relay with
a subscriber before the planes wrote their wire bytes from cached pieces (``*_build_and_wire_ms``
is the new window with its bytes). ``load_window_build_fresh_identities_ms`` builds windows from
new identity objects each time, as this script did before: every identity is serialized and
parsed again, as the planes did for every pool before they cached them.

Usage: .venv/bin/python -m benchmarks.bench_planes [--pools N] [--repeats 3] [--smoke]
Prints per-operation times (the median of the repeats, with the range) and writes
benchmarks/results/planes.json (each range under ``spread``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from collections.abc import Callable
from typing import Any

from benchmarks._common import machine, over_repeats, print_over_repeats, results_dir
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.publication.broadcast import VersionedBroadcast
from kvrelay.publication.catalog import CatalogPlane, LoraSpec, descriptor
from kvrelay.publication.load import LoadPlane, RankLoad
from kvrelay.publication.readiness import EndpointState, ReadinessPlane
from kvrelay.publication.serving_load import (
    COUNTERS,
    ModelServingInput,
    PoolServingInput,
    ServingLoadInputs,
    ServingLoadPlane,
)

RELAY = pb.RelayIdentity(drt_instance_id=1, relay_incarnation=2)
Role = pb.WorkerRole


def _producer(n: int) -> pb.ProducerIdentity:
    d = pb.DigestIdentity(digest=n.to_bytes(16, "little"), source=pb.IdentitySource.DEFAULT_DERIVED)
    return pb.ProducerIdentity(
        pool_id=pb.KvPoolId(
            identity_version=1,
            indexer_domain=pb.IndexerDomainId(cache_semantics=d, routing_scope=d),
            dc_id=7,
        ),
        producer_incarnation=2,
        layout_generation=n + 1,
        ckf_format=pb.CkfFormat(
            format_version=1, seed=5, bucket_count=524_288, fingerprint_bits=16, slots_per_bucket=4
        ),
    )


def _time(fn: Callable[[], object], reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


async def _fanout(waiters: int, rounds: int) -> float:
    bc: VersionedBroadcast[int] = VersionedBroadcast(0, 0)
    t0 = time.perf_counter()
    for v in range(1, rounds + 1):
        tasks = [asyncio.create_task(bc.wait_newer(v - 1)) for _ in range(waiters)]
        await asyncio.sleep(0)
        bc.publish(v, v)
        await asyncio.gather(*tasks)
    return (time.perf_counter() - t0) / rounds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pools", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="whole measurements (median, range)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, results to .work/smoke")
    args = ap.parse_args()
    rounds = 2 if args.smoke else 50
    if args.smoke:
        args.pools = 4
    n = args.pools
    descs = [
        descriptor(
            producer=_producer(i),
            namespace="prod",
            component=f"vllm-{i}",
            endpoint="generate",
            base_model=f"model-{i % 8}",
            base_aliases=["alias-a", "alias-b"],
            loras=[LoraSpec(f"lora-{i % 8}-{k}") for k in range(4)],
            kv_block_size=16,
            hash_format=pb.KvQueryHashFormat.DYNAMO_STANDARD_V1,
            roles=[Role.PREFILL if i % 2 else Role.DECODE],
        )
        for i in range(n)
    ]
    catalog = CatalogPlane(RELAY)
    catalog.set_pools(descs)
    eps = [
        EndpointState(
            "prod",
            f"vllm-{i}",
            "generate",
            frozenset({Role.PREFILL if i % 2 else Role.DECODE}),
            needs=() if i % 2 else (frozenset({Role.PREFILL}),),
            live=2,
            probed=True,
            models=frozenset({f"model-{i % 8}"}),
            adapters={f"lora-{i % 8}-{k}": f"model-{i % 8}" for k in range(4)},
            pool_id=_producer(i).pool_id,
        )
        for i in range(n)
    ]
    readiness = ReadinessPlane(RELAY)
    readiness.set_topology(eps)
    ranks = [RankLoad(100, 1000)] * 8
    producers = [_producer(i) for i in range(n)]  # one object per generation, as in the relay
    load = LoadPlane(RELAY, provider=lambda: [(p, ranks) for p in producers])
    fresh = LoadPlane(RELAY, provider=lambda: [(_producer(i), ranks) for i in range(n)])
    serving_inputs = ServingLoadInputs(
        pools=[PoolServingInput(p, ranks, [1_700_000_000_000], 2, 256) for p in producers],
        models=[
            ModelServingInput(
                "prod", f"model-{m}", 4, 4, 4,
                [p.pool_id for i, p in enumerate(producers) if i % 8 == m and p.pool_id],
                totals={c: 1_000 + m for c in COUNTERS}, observed_ms=[1_700_000_000_000],
            )
            for m in range(min(8, n))
        ],
    )  # fmt: skip
    serving = ServingLoadPlane(RELAY, provider=lambda: serving_inputs)

    def wire(plane: LoadPlane | ServingLoadPlane) -> Callable[[], object]:
        def go() -> object:
            plane.publish_window()  # a new window: its wire is written afresh
            return plane.wire(plane.current()[0])

        return go

    def measure() -> dict[str, Any]:
        return {
            "pools": n,
            "catalog_set_pools_unchanged_ms": _time(lambda: catalog.set_pools(descs), rounds) * 1e3,
            "readiness_set_topology_unchanged_ms": _time(
                lambda: readiness.set_topology(eps), rounds) * 1e3,
            "load_window_build_ms": _time(load.publish_window, rounds) * 1e3,
            # this script's method before identities were cached: new objects every window, so
            # every identity is serialized and parsed again (what the planes did for every pool)
            "load_window_build_fresh_identities_ms": _time(fresh.publish_window, rounds) * 1e3,
            "load_window_build_and_wire_ms": _time(wire(load), rounds) * 1e3,
            "load_window_serialize_ms": _time(lambda: bytes(load.current()[1]), rounds) * 1e3,
            "serving_load_window_build_ms": _time(serving.publish_window, rounds) * 1e3,
            "serving_load_window_build_and_wire_ms": _time(wire(serving), rounds) * 1e3,
            "serving_load_window_serialize_ms": _time(
                lambda: bytes(serving.current()[1]), rounds) * 1e3,
            "identity_serialize_us": _time(lambda: bytes(producers[0]), 20 * rounds) * 1e6,
            "identity_parse_us": _time(
                lambda: pb.ProducerIdentity.parse(bytes(producers[0])), 20 * rounds
            ) * 1e6 - _time(lambda: bytes(producers[0]), 20 * rounds) * 1e6,
            "catalog_snapshot_bytes": len(bytes(catalog.current()[1])),
            "readiness_snapshot_bytes": len(bytes(readiness.current()[1])),
            "load_window_bytes": len(bytes(load.current()[1])),
            "serving_load_window_bytes": len(bytes(serving.current()[1])),
            "fanout_publish_wake_64_waiters_us": asyncio.run(
                _fanout(64, 4 if args.smoke else 200)) * 1e6,
            "python": platform.python_version(),
            "arch": platform.machine(),
        }

    results = over_repeats([measure() for _ in range(1 if args.smoke else args.repeats)])
    print_over_repeats(results)
    results["machine"] = machine()
    out = results_dir(args.smoke) / "planes.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
