"""Pool benchmarks: CKF kernel rates, apply rate for a realistic event mix, exact-state memory
(at fixed sizes, and swept over a size range since tables grow in steps).

Run: ``.venv/bin/python -m benchmarks.bench_pool [--quick | --smoke]``. Prints numbers and
writes ``benchmarks/results/pool.json`` (``--quick``, ``--smoke``: ``.work/smoke/pool.json``).
Timings exclude numba compilation (a warm-up call runs first).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections import deque
from typing import Any

import numpy as np

from benchmarks._common import machine, results_dir
from kvrelay.pool import ckf
from kvrelay.pool.batch import OP_REMOVE, OP_STORE, EventBatch
from kvrelay.pool.pool import Pool

SEED = 0x5DEECE66D1B54A33


def bench_kernels(buckets: int) -> dict[str, float]:
    lane = ckf.Lane(buckets, SEED)
    warm = ckf.Lane(16, SEED)
    warm.insert(np.arange(4, dtype=np.uint64))
    warm.remove(np.arange(4, dtype=np.uint64))
    warm.contains(np.arange(4, dtype=np.uint64))
    n = int(buckets * 4 * 0.75)  # fill to 75% of slots (the sizing rule targets ~80%)
    keys = np.random.default_rng(1).integers(0, 2**63, size=n, dtype=np.uint64)
    absent = np.random.default_rng(2).integers(0, 2**63, size=n, dtype=np.uint64)
    t = time.perf_counter()
    ok = lane.insert(keys)
    t_ins = time.perf_counter() - t
    lane.take_publication()
    t = time.perf_counter()
    hit = lane.contains(keys)
    t_hit = time.perf_counter() - t
    t = time.perf_counter()
    fpr = lane.contains(absent)
    t_miss = time.perf_counter() - t
    t = time.perf_counter()
    lane.remove(keys[ok])
    t_rem = time.perf_counter() - t
    assert hit[ok].all() and not lane.table.any()
    return {
        "buckets": buckets,
        "table_mib": buckets * 8 / 2**20,
        "keys": n,
        "insert_keys_per_s": n / t_ins,
        "insert_failures": int((~ok).sum()),
        "contains_hit_keys_per_s": n / t_hit,
        "contains_miss_keys_per_s": n / t_miss,
        "false_positive_rate": float(fpr.mean()),
        "remove_keys_per_s": int(ok.sum()) / t_rem,
    }


class Workload:
    """Pre-generated event mix: 8-block stores (shared root prefixes or member-unique
    continuations under a live parent) and one-hash removes of the member's oldest blocks, at the
    same block rate, so the state stays at a steady size."""

    def __init__(self, members: int, bs: int, prefixes: int, live_target: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.bs = bs
        self.members = members
        self.prefixes = prefixes
        self.prefix_tokens = self.rng.integers(0, 50000, size=(prefixes, 8 * bs), dtype=np.uint32)
        self.live_target = live_target
        self.held: list[set[int]] = [set() for _ in range(members)]
        self.fifo: list[deque[tuple[int, int]]] = [deque() for _ in range(members)]
        self.live: list[set[int]] = [set() for _ in range(members)]
        self.tails: list[list[int]] = [[] for _ in range(members)]
        self.block_owner: list[dict[int, int]] = [{} for _ in range(members)]
        self.next_ext = 1 << 40

    def _prefix_ext(self, p: int, j: int) -> int:
        return (p << 8) | j | (1 << 32)

    def batch(self, m: int, stores: int) -> tuple[EventBatch, int]:
        """``stores`` store events, each followed by removes of 8 old blocks once warm."""
        ops: list[int] = []
        parent: list[int] = []
        has_parent: list[bool] = []
        blk_off = [0]
        ext: list[int] = []
        tok_off = [0]
        toks: list[np.ndarray] = []
        blocks = 0
        bs = self.bs
        for _ in range(stores):
            hashes: list[int]
            if self.rng.random() < 0.5 or not self.tails[m]:
                p = int(self.rng.integers(0, self.prefixes))
                if p in self.held[m]:
                    continue
                self.held[m].add(p)
                hashes = [self._prefix_ext(p, j) for j in range(8)]
                ops.append(OP_STORE)
                parent.append(0)
                has_parent.append(False)
                toks.append(self.prefix_tokens[p])
                tag = p
            else:
                i = int(self.rng.integers(0, len(self.tails[m])))
                par = self.tails[m][i]
                self.tails[m][i] = self.tails[m][-1]
                self.tails[m].pop()
                if par not in self.live[m]:
                    continue
                hashes = list(range(self.next_ext, self.next_ext + 8))
                self.next_ext += 8
                ops.append(OP_STORE)
                parent.append(par)
                has_parent.append(True)
                toks.append(self.rng.integers(0, 50000, size=8 * bs, dtype=np.uint32))
                tag = -1
            ext.extend(hashes)
            blk_off.append(len(ext))
            tok_off.append(tok_off[-1] + 8 * bs)
            blocks += 8
            for h in hashes:
                self.live[m].add(h)
                self.fifo[m].append((h, tag))
            self.tails[m].append(hashes[-1])
            if len(self.live[m]) > self.live_target:
                for _ in range(8):
                    h, tg = self.fifo[m].popleft()
                    self.live[m].discard(h)
                    if tg >= 0:
                        self.held[m].discard(tg)
                    ops.append(OP_REMOVE)
                    parent.append(0)
                    has_parent.append(False)
                    ext.append(h)
                    blk_off.append(len(ext))
                    tok_off.append(tok_off[-1])
                    blocks += 1
        n = len(ops)
        b = EventBatch(
            ops=np.asarray(ops, np.uint8),
            parent=np.asarray(parent, np.uint64),
            has_parent=np.asarray(has_parent, np.bool_),
            salt=np.full(n, 1337, np.uint64),
            ns_part=np.zeros(n, np.uint64),
            ns_inherit=np.zeros(n, np.bool_),
            blk_off=np.asarray(blk_off, np.int64),
            ext_hashes=np.asarray(ext, np.uint64),
            tok_off=np.asarray(tok_off, np.int64),
            tokens=np.concatenate(toks) if toks else np.zeros(0, np.uint32),
        )
        return b, blocks


def bench_apply(quick: bool, smoke: bool = False) -> dict[str, Any]:
    members, bs = 4, 16
    pool = Pool(524_288, SEED, bs, 1)
    mids = [pool.add_member(10 + i, 0) for i in range(members)]
    live_target = 4_000 if smoke else 40_000 if quick else 120_000
    wl = Workload(members, bs, prefixes=20_000, live_target=live_target, seed=3)
    # warm-up to steady state (compiles the kernel on the first call)
    while min(len(s) for s in wl.live) < live_target:
        for i, mid in enumerate(mids):
            b, _ = wl.batch(i, 2000)
            res = pool.apply(mid, b)
            assert res.events_rejected == 0, res.errors[:3]
    pool.take_publication()
    rounds = 1 if smoke else 3 if quick else 8
    big = [[wl.batch(i, 4000) for i in range(members)] for _ in range(rounds)]
    t_total = 0.0
    c_total = 0.0
    blocks = 0
    for per_member in big:
        for i, (b, nb) in enumerate(per_member):
            t = time.perf_counter()
            c = time.process_time()
            res = pool.apply(mids[i], b)
            t_total += time.perf_counter() - t
            c_total += time.process_time() - c
            blocks += nb
            assert res.events_rejected == 0
        pool.take_publication()
    big_rate = blocks / t_total
    big_cpu_rate = blocks / c_total
    # vLLM-sized batches: ~2 stores (+16 removes) per engine message, through Pool.apply
    small = [wl.batch(i % members, 2) for i in range(400 if smoke else 4000 if quick else 20000)]
    t = time.perf_counter()
    c = time.process_time()
    sb = 0
    for k, (b, nb) in enumerate(small):
        pool.apply(mids[k % members], b)
        sb += nb
    t_small = time.perf_counter() - t
    c_small = time.process_time() - c
    t = time.perf_counter()
    pubs = 0
    for _ in range(100):
        pubs += pool.take_publication() is not None
    return {
        "members": members,
        "block_size": bs,
        "buckets": 524_288,
        "steady_memberships": pool.memberships,
        "steady_distinct_canonical": pool.distinct_canonical,
        "occupancy": pool.occupancy,
        "capacity_omissions": pool.capacity_omissions,
        "block_events_per_s_large_batches": big_rate,
        "block_events_per_cpu_s_large_batches": big_cpu_rate,
        "block_events_per_cpu_s_small_batches": sb / c_small,
        "block_events_large_batches": blocks,
        "block_events_per_s_small_batches": sb / t_small,
        "small_batch_blocks_avg": sb / len(small),
        "apply_call_us_small_batch": t_small / len(small) * 1e6,
    }


def bench_memory(target: int, shared: bool, restore: bool = False) -> dict[str, Any]:
    """Build ``target`` memberships over 4 members (B=1: memory does not depend on B); with
    ``restore``, also time ``Pool.from_state`` of the result.

    shared: each member's chains start with a 4-block prefix common to all members, then 4
    member-unique blocks (distinct canonical ≈ 0.625 × memberships). unshared: nothing shared."""
    members = 4
    pool = Pool(1 << 22, SEED, 1, 1, max_kicks=0)
    mids = [pool.add_member(i, 0) for i in range(members)]
    chains = target // (members * 8)
    step = 1_000  # engine-sized batches: capacity is reserved per batch
    t_apply = 0.0
    c_apply = 0.0
    for m, mid in enumerate(mids):
        for c0 in range(0, chains, step):
            c1 = min(chains, c0 + step)
            n = c1 - c0
            cid = np.arange(c0, c1, dtype=np.uint64)
            j = np.arange(8, dtype=np.uint64)
            uniq = np.uint64(m + 1) << np.uint64(28)  # token ids stay < 2^31
            tok = (cid[:, None] * np.uint64(8) + j[None, :]).astype(np.uint64)
            if shared:
                tok[:, 4:] += uniq
            else:
                tok += uniq
            toks = (tok % np.uint64(2**32)).astype(np.uint32).ravel()
            ext = (
                (np.uint64(m + 1) << np.uint64(48)) + cid[:, None] * np.uint64(8) + j[None, :]
            ).ravel()
            b = EventBatch(
                ops=np.zeros(n, np.uint8),
                parent=np.zeros(n, np.uint64),
                has_parent=np.zeros(n, np.bool_),
                salt=np.full(n, 1337, np.uint64),
                ns_part=np.zeros(n, np.uint64),
                ns_inherit=np.zeros(n, np.bool_),
                blk_off=np.arange(0, 8 * n + 1, 8, dtype=np.int64),
                ext_hashes=ext,
                tok_off=np.arange(0, 8 * n + 1, 8, dtype=np.int64),
                tokens=toks,
            )
            t = time.perf_counter()
            c = time.process_time()
            res = pool.apply(mid, b)
            t_apply += time.perf_counter() - t
            c_apply += time.process_time() - c
            assert res.events_rejected == 0 and pool.invariant_violations == 0
    ms = pool.memberships
    assert ms == chains * members * 8
    out: dict[str, Any] = {
        "memberships": ms,
        "distinct_canonical": pool.distinct_canonical,
        "exact_state_bytes": pool.memory_bytes(),
        "bytes_per_membership": pool.memory_bytes() / ms,
        "breakdown_bytes": pool.memory_breakdown(),
        # building the state from empty: apply calls only (growth included), B=1 blocks
        "fill_memberships_per_s": ms / t_apply,
        "fill_memberships_per_cpu_s": ms / c_apply,
    }
    if restore:  # a restart with state handover: every check of a state file's arrays
        meta, arrays = pool.export_state()
        t = time.perf_counter()
        back = Pool.from_state(
            meta, arrays, bucket_count=1 << 22, seed=SEED, block_size=1, hash_format=1,
            max_kicks=0,
        )  # fmt: skip
        out["from_state_s"] = time.perf_counter() - t
        assert back.memberships == ms and back.memory_bytes() == pool.memory_bytes()
    return out


def bench_memory_sweep(lo: int, hi: int, points: int) -> dict[str, Any]:
    """Bytes per membership over sizes between two growth steps apart: tables grow in steps,
    so one size shows one point of a sawtooth; min / mean / max say where it can land."""
    out: dict[str, Any] = {"sizes": [lo + (hi - lo) * i // (points - 1) for i in range(points)]}
    for shared in (False, True):
        vals = [bench_memory(n, shared)["bytes_per_membership"] for n in out["sizes"]]
        out["shared" if shared else "unshared"] = {
            "bytes_per_membership": vals,
            "min": min(vals),
            "mean": sum(vals) / len(vals),
            "max": max(vals),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    args = ap.parse_args()
    args.quick = args.quick or args.smoke
    out: dict[str, Any] = {"python": platform.python_version(), "arch": platform.machine(),
                           "machine": machine()}
    out["kernels"] = [bench_kernels(b) for b in (
        (16_384,) if args.smoke else (524_288, 4_194_304))]
    for k in out["kernels"]:
        print(
            f"CKF {k['table_mib']:.0f} MiB: insert {k['insert_keys_per_s'] / 1e6:.1f} M/s, "
            f"contains hit {k['contains_hit_keys_per_s'] / 1e6:.1f} M/s, miss "
            f"{k['contains_miss_keys_per_s'] / 1e6:.1f} M/s, remove "
            f"{k['remove_keys_per_s'] / 1e6:.1f} M/s (fpr {k['false_positive_rate']:.5f})"
        )
    out["apply"] = bench_apply(args.quick, args.smoke)
    a = out["apply"]
    print(
        f"apply: {a['block_events_per_s_large_batches'] / 1e6:.2f} M block events/s wall, "
        f"{a['block_events_per_cpu_s_large_batches'] / 1e6:.2f} M per CPU-s (large "
        f"batches), {a['block_events_per_s_small_batches'] / 1e6:.3f} M/s in ~"
        f"{a['small_batch_blocks_avg']:.0f}-block batches ({a['apply_call_us_small_batch']:.1f} "
        f"us/call); steady memberships {a['steady_memberships']}"
    )
    sizes = (50_000,) if args.smoke else (1_000_000,) if args.quick else (1_000_000, 10_000_000)
    out["memory"] = []
    for size in sizes:
        for shared in (True, False):
            r = bench_memory(size, shared, restore=True) | {"shared_prefixes": shared}
            out["memory"].append(r)
            print(
                f"memory {r['memberships']:>10} memberships "
                f"({'shared' if shared else 'unshared'}, {r['distinct_canonical']} distinct): "
                f"{r['bytes_per_membership']:.2f} B/membership {r['breakdown_bytes']}; filled at "
                f"{r['fill_memberships_per_s'] / 1e6:.2f} M/s; from_state {r['from_state_s']:.2f} s"
            )
    points = 2 if args.smoke else 4 if args.quick else 11
    lo = 50_000 if args.smoke else 1_000_000
    out["memory_sweep"] = bench_memory_sweep(lo, 2 * lo, points)
    for kind in ("unshared", "shared"):
        sw = out["memory_sweep"][kind]
        print(
            f"memory sweep {lo:,}..{2 * lo:,} ({points} sizes, {kind}): min {sw['min']:.2f}, mean "
            f"{sw['mean']:.2f}, max {sw['max']:.2f} B/membership"
        )
    path = results_dir(args.quick) / "pool.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
