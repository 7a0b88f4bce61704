"""Block-hash throughput: numba batch kernel vs a per-block ``xxhash`` call loop.

Usage: .venv/bin/python -m benchmarks.bench_hashing [--blocks N] [--smoke]
Prints the rates and writes benchmarks/results/hashing.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

import numpy as np
import xxhash
from numba import njit

from benchmarks._common import machine, results_dir
from kvrelay.hashing.tokens import block_hashes, sequence_hashes
from kvrelay.hashing.xxh3 import xxh3_64_u64

BLOCK = 16
SALT = 1337


@njit(cache=True)  # type: ignore[misc]
def _u64_loop(keys: np.ndarray, seed: np.uint64) -> np.uint64:
    acc = np.uint64(0)
    for i in range(keys.size):
        acc ^= xxh3_64_u64(keys[i], seed)
    return acc


def _best(fn: Any, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, results to .work/smoke")
    args = ap.parse_args()
    if args.smoke:
        args.blocks, args.repeat = 2_000, 1
    n = args.blocks
    tokens = np.random.default_rng(0).integers(0, 2**32, size=n * BLOCK, dtype=np.uint32)

    # Warm up (JIT compile or load from cache) before timing.
    block_hashes(tokens[: BLOCK * 4], BLOCK, SALT)
    sequence_hashes(np.arange(4, dtype=np.uint64))

    t_nb = _best(lambda: block_hashes(tokens, BLOCK, SALT), args.repeat)
    bh = block_hashes(tokens, BLOCK, SALT)
    t_chain = _best(lambda: sequence_hashes(bh), args.repeat)

    raw = tokens.tobytes()
    stride = 4 * BLOCK

    def py_loop() -> list[int]:
        h = xxhash.xxh3_64_intdigest
        return [h(raw[i : i + stride], SALT) for i in range(0, len(raw), stride)]

    t_py = _best(py_loop, args.repeat)
    assert py_loop() == bh.tolist(), "numba and xxhash disagree"

    # Per-key scalar hash from Python (dispatcher overhead dominates; njit callers pay none).
    keys = list(range(20_000))
    t_u64 = _best(lambda: [xxh3_64_u64(k, 0x5DEECE66D1B54A33) for k in keys], args.repeat)

    # The cuckoo filter's per-key hash, called from njit code (no dispatcher in the loop).
    ukeys = np.arange(20_000 if args.smoke else 2_000_000, dtype=np.uint64)
    useed = np.uint64(0x5DEECE66D1B54A33)
    _u64_loop(ukeys[:8], useed)
    t_u64_nb = _best(lambda: _u64_loop(ukeys, useed), args.repeat)

    res = {
        "block_size_tokens": BLOCK,
        "blocks": n,
        "numba_batch_blocks_per_s": n / t_nb,
        "xxhash_loop_blocks_per_s": n / t_py,
        "speedup_numba_vs_xxhash_loop": t_py / t_nb,
        "numba_chain_hashes_per_s": n / t_chain,
        "njit_xxh3_64_u64_keys_per_s": ukeys.size / t_u64_nb,
        "python_call_xxh3_64_u64_per_s": len(keys) / t_u64,
        "python": platform.python_version(),
        "arch": platform.machine(),
    }
    for k, v in res.items():
        print(f"{k:36s} {v:,.0f}" if isinstance(v, float) else f"{k:36s} {v}")
    res["machine"] = machine()
    out = results_dir(args.smoke) / "hashing.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
