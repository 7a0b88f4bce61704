"""What one call costs right after the relay slept: warm (back to back) against cold (after a
sleep as long as the gap between engine messages at light load).

At light load the relay sleeps between engine messages, and on a shared machine its caches are
cold when it wakes: the per-message cost then follows how many calls a message takes more than
how fast each is in a loop. This measures both for a few call shapes of the hot path, with thread
CPU time (what the relay pays whatever else runs on its core):

* a numba call with 1 and with 50 array arguments (the apply kernel takes 50);
* ``np.zeros(0)`` and a small pure-Python method call;
* ``Decoder.decode`` and ``Pool.apply`` of one 64-block engine message, as side_by_side's mocker
  sends them: as an ``EventBatch`` of views, and as the ``PackedBatch`` the subscriber hands on.

Then what makes a call cold (``wake`` in the JSON): the packed message's call back to back,
after 1, 5 and 20 ms asleep, and after reading 64 MiB of other memory without a sleep (another
process's use of the caches). Figures compared with each other are measured taking turns, call
by call (``measure_interleaved``): on the 2-core benchmark VM what a sleep costs drifts with
what the host does meanwhile, by a factor of two or more between runs an hour apart.

Usage: ``python -m benchmarks.bench_cold [--gap-ms 20] [--calls 300] [--smoke]``; writes
``results/cold_calls.json``.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
from numba import njit, types

from benchmarks._common import machine, results_dir, write_json
from benchmarks.bench_ingest import B, _remove, _store


def _numba_calls() -> dict[str, Callable[[], Any]]:
    one = njit(types.int64(types.uint64[::1]))(lambda a: a.shape[0])
    names = [f"a{i}" for i in range(50)]
    src = f"def fifty({', '.join(names)}):\n    return a0.shape[0]\n"
    ns: dict[str, Any] = {}
    exec(src, ns)  # a 50-parameter function for the signature below
    fifty = njit(types.int64(*([types.uint64[::1]] * 50)))(ns["fifty"])
    arrs = [np.zeros(4, dtype=np.uint64) for _ in range(50)]
    return {
        "numba call, 1 array argument": lambda: one(arrs[0]),
        "numba call, 50 array arguments": lambda: fifty(*arrs),
    }


class _Small:
    def __init__(self) -> None:
        self.n = 0

    def bump(self, k: int) -> int:
        self.n += k
        return self.n


def _message(rng: random.Random, chains: list[list[int]]) -> bytes:
    """One engine message: a 64-block store with its 1,024 tokens, evicting an older chain's
    second half once the working set is full (what the mocker's steady state looks like)."""
    hashes = [rng.getrandbits(64) for _ in range(64)]
    events: list[Any] = [_store("map", rng, hashes, None)]
    chains.append(hashes)
    if len(chains) > 200:
        events += [_remove("map", h) for h in chains.pop(0)[32:]]
    return msgspec.msgpack.encode([time.time(), events, 0])


_OTHER = np.ones(0, dtype=np.uint8)  # grown to 64 MiB by ``wake``'s flushed row only


def measure(
    fn: Callable[[], Any], calls: int, gap_s: float, other: npt.NDArray[np.uint8] = _OTHER
) -> float:
    """Median thread-CPU µs of ``fn()``, each call after ``gap_s`` asleep (0: back to back)
    and after reading ``other`` (empty: nothing), clock reads included (``rows`` subtract the
    empty call's)."""
    return measure_interleaved([(fn, gap_s, other)], calls)[0]


def measure_interleaved(
    conditions: list[tuple[Callable[[], Any], float, npt.NDArray[np.uint8]]], calls: int
) -> list[float]:
    """``measure`` of several ``(fn, gap_s, other)`` at once, taking turns call by call: the
    cost after a sleep depends on what the host does meanwhile, which drifts over a run, so
    figures compared with each other are measured in the same stretch of it. The order turns
    too (round ``r`` starts at condition ``r``): what a call leaves warm helps the next one,
    so each condition follows every other equally often."""
    for fn, _, _ in conditions:
        fn()
    n = len(conditions)
    out: list[list[float]] = [[] for _ in conditions]
    for r in range(calls):
        for k in range(n):
            j = (k + r) % n
            fn, gap_s, other = conditions[j]
            if other.size:
                other.sum()
            if gap_s:
                time.sleep(gap_s)
            t0 = time.thread_time()
            fn()
            out[j].append(time.thread_time() - t0)
    return [float(np.median(v) * 1e6) for v in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gap-ms", type=float, default=20.0, help="sleep before each cold call")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--smoke", action="store_true", help="a few calls, results to .work/smoke")
    a = ap.parse_args()
    if a.smoke:
        a.calls, a.gap_ms = 5, 2.0
    from kvrelay.ingest.decoder import Decoder
    from kvrelay.pool.pool import Pool

    small = _Small()
    cases: dict[str, Callable[[], Any]] = {
        **_numba_calls(),
        "np.zeros(0)": lambda: np.zeros(0, dtype=np.int64),
        "Python method call": lambda: small.bump(1),
    }
    rng = random.Random(7)
    chains: list[list[int]] = []
    dec = Decoder(kv_block_size=B, dp_rank=0)
    pool = Pool(1 << 19, 0x5DEECE66D1B54A33, B, 1)
    mid = pool.add_member(1, 0)
    for _ in range(250):  # fill the working set; the removes then hit
        pool.apply(mid, dec.decode(_message(rng, chains)).batch)
        pool.take_publication()
    msgs = iter([_message(rng, chains) for _ in range(10 * a.calls + 16)])

    def decode_apply() -> None:
        pool.apply(mid, dec.decode(next(msgs)).batch)
        pool.take_publication()

    def decode_apply_packed() -> None:
        pool.apply(mid, dec.decode(next(msgs), packed=True).batch)
        pool.take_publication()

    cases["decode + Pool.apply + take, one 64-block message"] = decode_apply
    cases["the same, the batch packed (the relay's live path)"] = decode_apply_packed
    gap = a.gap_ms / 1e3
    base_warm = measure(lambda: None, a.calls, 0.0)
    warms = {name: measure(fn, a.calls, 0.0) for name, fn in cases.items()}
    # cold: every case and the empty call in turn, call by call
    base_cold, *colds = measure_interleaved(
        [(lambda: None, gap, _OTHER)] + [(fn, gap, _OTHER) for fn in cases.values()], a.calls
    )
    print(f"{'(empty call and two clock reads)':52s} warm {base_warm:8.2f} µs   "
          f"after {a.gap_ms:g} ms asleep {base_cold:8.2f} µs")
    rows = []
    for (name, w), c in zip(warms.items(), colds, strict=True):
        warm = max(0.0, w - base_warm)
        cold = max(0.0, c - base_cold)
        rows.append({"call": name, "warm_us": round(warm, 2), "cold_us": round(cold, 2),
                     "cold_over_warm": round(cold / warm, 1) if warm else None})
        print(f"{name:52s} warm {warm:8.2f} µs   after {a.gap_ms:g} ms asleep {cold:8.2f} µs")
    wake = []
    flushed = np.ones(64 << 20, dtype=np.uint8)
    back_to_back = measure(decode_apply_packed, a.calls, 0.0)
    print(f"{'packed message back to back':52s} {back_to_back:8.2f} µs")
    wake.append({"when": "back to back", "asleep_ms": 0.0, "other_memory_mib": 0,
                 "us": round(back_to_back, 2)})
    when = [
        ("after 1 ms asleep", 0.001, _OTHER),
        ("after 5 ms asleep", 0.005, _OTHER),
        (f"after {a.gap_ms:g} ms asleep", gap, _OTHER),
        ("back to back after reading 64 MiB of other memory", 0.0, flushed),
    ]
    costs = measure_interleaved([(decode_apply_packed, g, o) for _, g, o in when], a.calls)
    for (label, g, other), us in zip(when, costs, strict=True):
        wake.append({"when": label, "asleep_ms": round(g * 1e3, 3),
                     "other_memory_mib": other.size >> 20, "us": round(us, 2)})
        print(f"{'packed message ' + label:52s} {us:8.2f} µs")
    del flushed
    res = {"benchmark": "cold_calls", "gap_ms": a.gap_ms, "calls": a.calls,
           "note": "median thread CPU per call, less the empty call's (clock reads); cold = "
                   "each call after gap_ms asleep",
           "empty_call_us": {"warm": round(base_warm, 2), "cold": round(base_cold, 2)},
           "rows": rows,
           "wake_note": "the packed message's call (decode + Pool.apply + take, clock reads "
                        "included) by what came before it",
           "wake": wake, "machine": machine()}
    write_json(results_dir(a.smoke) / "cold_calls.json", res)


if __name__ == "__main__":
    main()
