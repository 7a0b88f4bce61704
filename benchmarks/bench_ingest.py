"""Decode throughput: raw vLLM payload bytes → EventBatch (kvrelay.ingest.decoder).

Realistic steady-state steps: 8-block stores of 16-token blocks with parents (prefill chunks)
balanced by one-hash removes (evictions), map era (vLLM >= 0.24) with int hashes; plus the
array era, the bytes-hash (slow path) variant and a removes-only step. Prints block events/s and
writes benchmarks/results/ingest.json. Usage: ``python -m benchmarks.bench_ingest [--smoke]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

import msgspec

from benchmarks._common import machine, results_dir
from kvrelay.ingest.decoder import Decoder

B = 16


def _store(era: str, rng: random.Random, hashes: list[Any], parent: Any) -> Any:
    toks = [rng.randrange(0, 150_000) for _ in range(len(hashes) * B)]
    if era == "map":
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": toks,
            "block_size": B,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
    return [
        "BlockStored",
        hashes,
        parent,
        toks,
        B,
        None,
        "GPU",
        None,
        None,
        0,
        "full_attention",
        None,
    ]


def _remove(era: str, h: Any) -> Any:
    if era == "map":
        return {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"}
    return ["BlockRemoved", [h], "GPU", 0]


def payloads(
    era: str, stores: int, removes: int, n_msgs: int, *, as_bytes: bool = False
) -> tuple[list[bytes], int]:
    rng = random.Random(7)

    def h() -> Any:
        v = rng.getrandbits(64)
        return v.to_bytes(32, "big") if as_bytes else v

    out = []
    blocks = 0
    for _ in range(n_msgs):
        evs = [_store(era, rng, [h() for _ in range(8)], h()) for _ in range(stores)]
        evs += [_remove(era, h()) for _ in range(removes)]
        blocks += stores * 8 + removes
        out.append(msgspec.msgpack.encode([time.time(), evs, 0]))
    return out, blocks


def run(name: str, msgs: list[bytes], blocks: int, repeat: int = 9) -> dict[str, Any]:
    dec = Decoder(kv_block_size=B, dp_rank=0)
    for p in msgs[:50]:
        dec.decode(p)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for p in msgs:
            dec.decode(p)
        best = min(best, time.perf_counter() - t0)
    res = {
        "case": name,
        "messages": len(msgs),
        "block_events": blocks,
        "seconds": best,
        "block_events_per_s": blocks / best,
        "messages_per_s": len(msgs) / best,
        "us_per_message": best / len(msgs) * 1e6,
        "payload_bytes_avg": sum(map(len, msgs)) / len(msgs),
    }
    print(
        f"{name:40s} {res['block_events_per_s'] / 1e6:6.2f} M block ev/s  "
        f"{res['messages_per_s'] / 1e3:7.1f} K msg/s  {res['us_per_message']:7.1f} µs/msg  "
        f"({res['payload_bytes_avg']:.0f} B/msg)"
    )
    return res


def e2e(n_msgs: int = 3000, warm_chains: int = 20_000, stores: int = 4) -> dict[str, Any]:
    """Decode + ``Pool.apply`` for one member in steady state: each message stores ``stores``
    8-block chains and evicts as many (``8 * stores`` one-hash removes). Two sizes show the split
    between the per-message fixed cost and the per-event cost."""
    from collections import deque

    from kvrelay.pool.pool import Pool

    rng = random.Random(11)
    chains: deque[list[int]] = deque()

    def message(evict: bool) -> bytes:
        evs: list[Any] = []
        for _ in range(stores):
            parent = chains[-1][-1] if chains and rng.random() < 0.5 else None
            hs = [rng.getrandbits(64) for _ in range(8)]
            evs.append(_store("map", rng, hs, parent))
            chains.append(hs)
        if evict:
            for _ in range(stores):
                for h in reversed(chains.popleft()):
                    evs.append(_remove("map", h))
        return msgspec.msgpack.encode([time.time(), evs, 0])

    dec = Decoder(kv_block_size=B, dp_rank=0)
    pool = Pool(1 << 19, 0x5DEECE66D1B54A33, B, 1)
    mid = pool.add_member(1, 0)
    while len(chains) < warm_chains:
        pool.apply(mid, dec.decode(message(False)).batch)
    pool.take_publication()
    msgs = [message(True) for _ in range(n_msgs)]
    t_dec = t_pool = 0.0
    blocks = rejected = 0
    for i, p in enumerate(msgs):
        t0 = time.perf_counter()
        batch = dec.decode(p).batch
        t1 = time.perf_counter()
        res = pool.apply(mid, batch)
        t2 = time.perf_counter()
        t_dec += t1 - t0
        t_pool += t2 - t1
        blocks += batch.n_blocks
        rejected += res.events_rejected
        if i % 64 == 63:
            pool.take_publication()
    label = f"{stores}x8 + {8 * stores} removes"
    res = {
        "case": f"e2e decode + Pool.apply ({stores}x8-block stores + {8 * stores} removes per msg)",
        "messages": n_msgs,
        "block_events": blocks,
        "rejected_events": rejected,
        "decode_block_events_per_s": blocks / t_dec,
        "pool_block_events_per_s": blocks / t_pool,
        "block_events_per_s": blocks / (t_dec + t_pool),
        "us_per_message": (t_dec + t_pool) / n_msgs * 1e6,
    }
    print(
        f"{'e2e decode+pool (' + label + ')':40s} {res['block_events_per_s'] / 1e6:6.2f} M block"
        f" ev/s  (decode {res['decode_block_events_per_s'] / 1e6:.2f} M/s,"
        f" pool {res['pool_block_events_per_s'] / 1e6:.2f} M/s, rejected {rejected})"
    )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, results to .work/smoke")
    smoke = ap.parse_args().smoke
    k = 50 if smoke else 1  # messages per case divided by this
    cases = [
        ("map: 4x8-block stores + 32 removes", payloads("map", 4, 32, 2000 // k)),
        ("map: 16x8-block stores + 128 removes", payloads("map", 16, 128, 500 // k)),
        ("map: 1x8-block store + 8 removes", payloads("map", 1, 8, 5000 // k)),
        ("array: 4x8-block stores + 32 removes", payloads("array", 4, 32, 2000 // k)),
        ("map: 256 one-hash removes", payloads("map", 0, 256, 500 // k)),
        ("map bytes hashes (slow path): 4x8 + 32",
         payloads("map", 4, 32, 1000 // k, as_bytes=True)),
    ]
    results = [run(name, msgs, blocks, 1 if smoke else 9) for name, (msgs, blocks) in cases]
    results.append(e2e(n_msgs=3000 // k, warm_chains=20_000 // k, stores=4))
    results.append(e2e(n_msgs=1000 // k, warm_chains=5_000 // k, stores=16))
    out = results_dir(smoke) / "ingest.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": "ingest_decode",
        "note": (
            "one core; decode rows: best of 9 passes, payload bytes -> EventBatch; e2e rows: one"
            " pass of decode + Pool.apply per message in steady state"
        ),
        "block_size": B,
        "loadavg_1m": os.getloadavg()[0],
        "results": results,
        "machine": machine(),
    }
    out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
