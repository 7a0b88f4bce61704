"""Consumer SDK costs: depth query per pool and replica frame application (no network).

Usage: .venv/bin/python -m benchmarks.bench_client [--smoke]
Prints numbers and writes ``benchmarks/results/bench_client.json``. A default-size lane
(524,288 buckets) is filled to ~75% with random keys; queries use 1024- and 8192-token prompts
whose first half is cached.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from benchmarks._common import machine, results_dir
from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client.query import HashCache
from kvrelay.client.replica import PoolReplica
from kvrelay.client.search import first_miss, prefix_depth
from kvrelay.hashing.tokens import block_hashes, sequence_hashes
from kvrelay.pool.ckf import Lane, contains
from kvrelay.publication import cbi1

SEED = 0x5DEECE66D1B54A33
BUCKETS = 524_288
DC = 7


def producer() -> pb.ProducerIdentity:
    return pb.ProducerIdentity(
        pool_id=pb.KvPoolId(
            identity_version=1,
            indexer_domain=pb.IndexerDomainId(
                cache_semantics=pb.DigestIdentity(digest=b"c" * 16, source=1),
                routing_scope=pb.DigestIdentity(digest=b"r" * 16, source=1),
            ),
            dc_id=DC,
        ),
        producer_incarnation=1,
        layout_generation=1,
        ckf_format=pb.CkfFormat(format_version=1, seed=SEED, bucket_count=BUCKETS,
                                fingerprint_bits=16, slots_per_bucket=4),
    )  # fmt: skip


def fu(kind: int, base: int, seq: int, payload: bytes) -> pb.FilterUpdate:
    return pb.FilterUpdate(protocol_version=1, relay=pb.RelayIdentity(1, 2), producer=producer(),
                           base_sequence=base, sequence=seq, kind=kind, payload=payload,
                           contract_marker=0x4B565231)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, results to .work/smoke")
    smoke = ap.parse_args().smoke
    n_prompts, n_deltas = (4, 20) if smoke else (200, 2000)
    rng = np.random.default_rng(1)
    lane = Lane(BUCKETS, SEED)
    lane.insert(rng.integers(0, 2**63, size=int(BUCKETS * 4 * 0.70), dtype=np.uint64))
    prompts = {
        n: [rng.integers(1, 150_000, size=n, dtype=np.uint32) for _ in range(n_prompts)]
        for n in (1024, 8192)
    }
    for group in prompts.values():  # the first half of every prompt is cached
        for p in group:
            h = sequence_hashes(block_hashes(p, 16, 1337))
            lane.insert(h[: h.size // 2])
    results: dict[str, float] = {}

    replica = PoolReplica(producer(), pb.RelayIdentity(1, 2))
    (chunk,) = cbi1.encode_snapshot_chunks(lane.table, seed=SEED, bucket_count=BUCKETS,
                                           dc_id=DC, epoch=0)  # fmt: skip
    frame = fu(1, 0, 0, chunk)
    t = time.perf_counter()
    replica.feed(frame)
    results["snapshot_install_ms"] = (time.perf_counter() - t) * 1e3

    deltas = []
    for i in range(n_deltas):
        b = np.unique(rng.integers(0, BUCKETS, size=64)).astype(np.uint64)
        w = lane.table[b.astype(np.intp)]  # same words: queries below see the lane intact
        deltas.append(fu(2, i, i + 1, cbi1.encode_delta(b, w, seed=SEED, bucket_count=BUCKETS,
                                                        dc_id=DC, base_epoch=i, epoch=i + 1)))
    t = time.perf_counter()
    for d in deltas:
        replica.feed(d)
    results["delta_apply_us_per_frame_64_images"] = (time.perf_counter() - t) / len(deltas) * 1e6

    assert replica.table is not None
    table = replica.table
    for n_tokens, group in prompts.items():
        depths = []
        t = time.perf_counter()
        for p in group:
            seq = HashCache(p).get(16, False, 1337)
            depths.append(prefix_depth(
                int(seq.size), lambda i, s=seq: bool(contains(table, SEED, s[i : i + 1])[0])
            ))  # fmt: skip
        results[f"query_us_{n_tokens}_tokens_search_probe_per_position"] = (
            (time.perf_counter() - t) / len(group) * 1e6
        )
        t = time.perf_counter()
        for p in group:  # what RelayClient.overlap does per pool
            seq = HashCache(p).get(16, False, 1337)
            first_miss(contains(table, SEED, seq))
        results[f"query_us_{n_tokens}_tokens_overlap_path"] = (
            (time.perf_counter() - t) / len(group) * 1e6)
        results[f"mean_depth_{n_tokens}_tokens"] = float(np.mean(depths))
        t = time.perf_counter()
        for p in group:
            seq = HashCache(p).get(16, False, 1337)
            contains(table, SEED, seq)
        results[f"query_us_{n_tokens}_tokens_hash_plus_full_probe"] = (
            (time.perf_counter() - t) / len(group) * 1e6
        )
    for k, v in results.items():
        print(f"{k:48s} {v:10.2f}")
    doc: dict[str, Any] = {**results, "machine": machine()}
    out = results_dir(smoke) / "bench_client.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
