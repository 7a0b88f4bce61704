"""What a periodic checkpoint (``relay/checkpoint.py``) costs a busy relay: delta latency and
memory.

A pool of N memberships (10M by default, ``--smoke``: 100K) is built with the real apply kernel.
An event-loop task then plays ingest: every 5 ms one batch (8 stores of 4 blocks, and the
removal of an earlier batch's) is applied to a live member and its delta taken
(``take_publication``), as a relay does before fanning it out. Its latency is measured from the
moment the batch was due, so anything that holds the loop (the checkpoint's cut, the
copy-before-write captures its writes make, the writer thread's share of the GIL) shows up in
it; the batch's own apply time is reported beside it, which separates what lengthens the apply
(the captures, page faults) from the loop starting late, and so is the number of minor page
faults the loop's thread took in that work. Two phases of the same length: without checkpoints,
then with a checkpoint every second (each one a real cut on the loop, ``Pool.open_image``, and a
real file written, fsynced and renamed by the relay's checkpoint thread, ``relay/checkpoint.py``;
the next starts ``GAP_S`` after the previous one was written). The second phase is reported
whole and for the batches applied while a checkpoint was in flight, the figure the checkpoint's
cost is judged by; the first batch after each cut is also reported alone (it makes the most
captures: every chunk it writes is one). The process runs with the daemon's GIL switch interval
(``ops/event_loop.tune_thread_switching``).

Memory: the machine's anonymous memory (``AnonPages`` in ``/proc/meminfo``), sampled every 2 ms
from a thread, less its value at the start of the phase: the pre-images a checkpoint keeps, its
bookkeeping and its writer's buffer, which is what a checkpoint adds (the file's page cache is
not anonymous memory). Run it on a quiet machine.

Prints and writes ``benchmarks/results/checkpoint.{json,md}`` (``--smoke``: ``.work/smoke``):
delta p50/p99/max and apply p50/p99 per phase and during checkpoints, the cut's time on the
loop, the write time, the file size and the peak memory a checkpoint adds.
Figures from a shared machine are noisy: compare the two phases of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import machine, percentiles, results_dir, spread, write_json
from benchmarks._report import machine_md
from kvrelay._jit import warm
from kvrelay.ops.event_loop import tune_thread_switching
from kvrelay.pool.batch import EventBatch
from kvrelay.pool.pool import Pool
from kvrelay.relay import checkpoint
from kvrelay.relay.engines import PoolIdentity
from kvrelay.relay.handover import MemberResume
from kvrelay.relay.settings import CHECKPOINT_BYTES_PER_SECOND, EngineSpec, PoolSpec

PERIOD_S = 0.005
#: Quiet time between checkpoints (after the previous one is written): the relay's default
#: interval is 30 s; 1 s fits several checkpoints in a phase.
GAP_S = 1.0


def _anon() -> int:
    """The machine's anonymous memory in bytes (``AnonPages``)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("AnonPages:"):
                return int(line.split()[1]) * 1024
    return 0


def _stores(ext: np.ndarray, tok0: int) -> EventBatch:
    """One store event per row of ``ext`` (chains of ``ext.shape[1]`` blocks, B=1)."""
    n, k = ext.shape
    return EventBatch(
        ops=np.zeros(n, np.uint8), parent=np.zeros(n, np.uint64),
        has_parent=np.zeros(n, np.bool_), salt=np.full(n, 1337, np.uint64),
        ns_part=np.zeros(n, np.uint64), ns_inherit=np.zeros(n, np.bool_),
        blk_off=np.arange(0, k * n + 1, k, dtype=np.int64), ext_hashes=ext.ravel(),
        tok_off=np.arange(0, k * n + 1, k, dtype=np.int64),
        tokens=((np.arange(k * n, dtype=np.uint64) + np.uint64(tok0)) % np.uint64(2**31)
                ).astype(np.uint32),
    )  # fmt: skip


def _removal(ext: np.ndarray) -> EventBatch:
    m = ext.size
    return EventBatch(
        ops=np.ones(1, np.uint8), parent=np.zeros(1, np.uint64),
        has_parent=np.zeros(1, np.bool_), salt=np.full(1, 1337, np.uint64),
        ns_part=np.zeros(1, np.uint64), ns_inherit=np.zeros(1, np.bool_),
        blk_off=np.array([0, m], np.int64), ext_hashes=ext.ravel().copy(),
        tok_off=np.zeros(2, np.int64), tokens=np.zeros(0, np.uint32),
    )  # fmt: skip


def filled(target: int) -> Pool:
    """``target`` memberships over 4 members, chains of 8 unshared blocks."""
    pool = Pool(1 << 23, 7, 1, 1)
    chains = target // (4 * 8)
    for m in range(4):
        mid = pool.add_member(m, 0)
        for c0 in range(0, chains, 2_000):
            c1 = min(chains, c0 + 2_000)
            cid = np.arange(c0, c1, dtype=np.uint64)
            ext = (np.uint64(m + 1) << np.uint64(48)) + cid[:, None] * np.uint64(8) + np.arange(
                8, dtype=np.uint64)[None, :]  # fmt: skip
            pool.apply(mid, _stores(ext, (m << 27) + c0 * 8))
    pool.take_publication()
    return pool


async def _phase(pool: Pool, live: int, seconds: float, ckpt: checkpoint.Checkpointer | None,
                 state_dir: Path, spec: PoolSpec) -> dict[str, Any]:  # fmt: skip
    lat: list[float] = []
    during: list[float] = []  # batches applied while a checkpoint was being cut or written
    cuts: list[float] = []
    writes: list[float] = []
    captured: list[int] = []  # pre-image bytes each checkpoint kept
    work: list[float] = []  # each batch's own apply and take, without the loop's lateness
    work_during: list[float] = []
    faults: list[float] = []  # minor page faults the loop's thread took in each batch's work
    faults_during: list[float] = []
    first_work: list[float] = []  # the first batch after each cut: its apply time and faults
    first_faults: list[float] = []
    first = False
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _anon())
            time.sleep(0.002)

    base = _anon()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    ident = PoolIdentity(model="m", model_source="m", block_size=1)
    members = [MemberResume(m, 0, f"e{m}", "", 1000, 1) for m in range(5)]
    loop = asyncio.get_running_loop()
    start = loop.time()
    due = start
    i = 0
    prev: np.ndarray | None = None
    started_write = 0.0
    ended = start - GAP_S
    in_ckpt = False
    while loop.time() - start < seconds:
        due += PERIOD_S
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        f_apply = _minor_faults()
        t_apply = time.perf_counter()
        ext = (np.uint64(9) << np.uint64(56)) + np.uint64(i * 32) + np.arange(
            32, dtype=np.uint64).reshape(8, 4)  # fmt: skip
        pool.apply(live, _stores(ext, i * 32))
        if prev is not None:
            pool.apply(live, _removal(prev))
        prev = ext
        pool.take_publication()
        work.append(time.perf_counter() - t_apply)
        faults.append(_minor_faults() - f_apply)
        lat.append(loop.time() - due)
        if in_ckpt:
            during.append(lat[-1])
            work_during.append(work[-1])
            faults_during.append(faults[-1])
        if first:
            first_work.append(work[-1])
            first_faults.append(faults[-1])
            first = False
        due = max(due, loop.time() - PERIOD_S)  # a stall delays the next batch, not all of them
        i += 1
        if ckpt is None:
            continue
        if in_ckpt and not ckpt.busy("ns/c/e"):
            in_ckpt = False
            writes.append(loop.time() - started_write)
            captured.append(ckpt.last_captured_bytes)
            ended = loop.time()
        late = loop.time() - start > seconds - 4 * PERIOD_S  # no batch would follow the cut
        if not in_ckpt and not late and loop.time() - ended >= GAP_S:
            t = time.perf_counter()
            ckpt.submit("ns/c/e", state_dir,
                        lambda: checkpoint.Cut(spec, ident, pool, members))  # the cut: an image
            cuts.append(time.perf_counter() - t)
            started_write = loop.time()
            in_ckpt = True
            first = True
            during.append(lat[-1])  # the batch just before the cut waits for it too
            work_during.append(work[-1])
            faults_during.append(faults[-1])
    if ckpt is not None:
        await ckpt.drain()
        if in_ckpt:
            writes.append(loop.time() - started_write)
            captured.append(ckpt.last_captured_bytes)
    stop.set()
    sampler.join()
    out: dict[str, Any] = {"batches": len(lat), "memory_added_peak_mib": (peak[0] - base) / 2**20}
    out |= _stats(lat, work, faults)
    if cuts:
        out |= {"checkpoints": len(cuts), "cut_on_loop_ms_median": float(np.median(cuts) * 1e3),
                "cut_on_loop_ms_first": float(cuts[0] * 1e3),
                "cut_on_loop_ms_max": float(max(cuts) * 1e3),
                "write_s_median": float(np.median(writes)) if writes else None,
                "captured_mib_median": float(np.median(captured)) / 2**20 if captured else None,
                "first_batch_apply_ms_median": float(np.median(first_work) * 1e3),
                "first_batch_faults_median": float(np.median(first_faults)),
                "during_checkpoint": {"batches": len(during)}
                | _stats(during, work_during, faults_during)}  # fmt: skip
    return out


def _minor_faults() -> int:
    """Minor page faults the calling thread has taken (a copy-on-write fault is one)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def _stats(lat: list[float], work: list[float],
           faults: list[float]) -> dict[str, float | int | None]:  # fmt: skip
    """Delta latency and apply time figures of a phase, in ms (the benchmarks' one
    ``percentiles``), and the page faults each batch's work took."""
    p, w, f = percentiles(lat, 1e3), percentiles(work, 1e3), percentiles(faults)
    return {"delta_p50_ms": p["p50"], "delta_p99_ms": p["p99"], "delta_max_ms": p["max"],
            "apply_p50_ms": w["p50"], "apply_p99_ms": w["p99"],
            "faults_p50": f["p50"], "faults_p99": f["p99"]}  # fmt: skip


async def run(target: int, seconds: float, repeats: int = 1,
              rate: int = CHECKPOINT_BYTES_PER_SECOND) -> dict[str, Any]:  # fmt: skip
    # As the daemon does before READY: the checkpoint's reader is not loaded by its first run,
    # in the writer thread, holding the GIL.
    warm("pool")
    t = time.perf_counter()
    pool = filled(target)
    fill_s = time.perf_counter() - t
    live = pool.add_member(99, 0)
    spec = PoolSpec(namespace="ns", component="c", endpoint="e", expected_blocks=1 << 24,
                    engines=(EngineSpec(name="e0", host="127.0.0.1", grpc_port=1),))  # fmt: skip
    _meta, arrays = pool.export_state()
    state_bytes = sum(int(a.nbytes) for a in arrays.values())
    with tempfile.TemporaryDirectory() as d:
        state_dir = Path(d)
        ck = checkpoint.Checkpointer(lambda _r: None, rate=lambda: rate)
        runs = []
        for _ in range(repeats):  # the same pool each time: only the phases are repeated
            without = await _phase(pool, live, seconds, None, state_dir, spec)
            with_ = await _phase(pool, live, seconds, ck, state_dir, spec)
            runs.append({"without_checkpoints": without, "with_checkpoints": with_})
        ck.close()
        size = sum(p.stat().st_size for p in state_dir.iterdir())
    return {
        "memberships": pool.memberships, "state_bytes_exported": state_bytes,
        "file_bytes": size, "fill_s": fill_s, "phase_s": seconds, "runs": runs,
        "checkpoint_bytes_per_second": rate,
        "summary": _summary(runs),
    }  # fmt: skip


#: Headline figures over the repeats: (label, phase, key).
HEADLINE = (
    ("delta p99 without checkpoints (ms)", "without_checkpoints", "delta_p99_ms"),
    ("delta p99 during a checkpoint (ms)", "during_checkpoint", "delta_p99_ms"),
    ("delta p50 without checkpoints (ms)", "without_checkpoints", "delta_p50_ms"),
    ("delta p50 during a checkpoint (ms)", "during_checkpoint", "delta_p50_ms"),
    ("apply p50 without checkpoints (ms)", "without_checkpoints", "apply_p50_ms"),
    ("apply p50 during a checkpoint (ms)", "during_checkpoint", "apply_p50_ms"),
    ("apply p99 without checkpoints (ms)", "without_checkpoints", "apply_p99_ms"),
    ("apply p99 during a checkpoint (ms)", "during_checkpoint", "apply_p99_ms"),
    ("page faults per batch p50 without checkpoints", "without_checkpoints", "faults_p50"),
    ("page faults per batch p50 during a checkpoint", "during_checkpoint", "faults_p50"),
    ("page faults per batch p99 during a checkpoint", "during_checkpoint", "faults_p99"),
    ("apply of the first batch after a cut, median (ms)", "with_checkpoints",
     "first_batch_apply_ms_median"),
    ("page faults of the first batch after a cut, median", "with_checkpoints",
     "first_batch_faults_median"),
    ("memory a checkpoint adds at its peak (MiB)", "with_checkpoints", "memory_added_peak_mib"),
    ("pre-images a checkpoint keeps, median (MiB)", "with_checkpoints", "captured_mib_median"),
    ("cut on the loop, median (ms)", "with_checkpoints", "cut_on_loop_ms_median"),
)
RATIO = "delta p99 ratio during / without"


def _figure(run: dict[str, Any], phase: str, key: str) -> float:
    w = run["with_checkpoints"]
    return float((w["during_checkpoint"] if phase == "during_checkpoint" else run[phase])[key])


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and range of each headline figure, and of the p99 ratio during / without."""
    out: dict[str, Any] = {"repeats": len(runs)}
    for label, phase, key in HEADLINE:
        out[label] = spread([_figure(r, phase, key) for r in runs])
    out[RATIO] = spread([_figure(r, "during_checkpoint", "delta_p99_ms")
                         / _figure(r, "without_checkpoints", "delta_p99_ms") for r in runs])
    return out


def _rate_text(rate: int) -> str:
    return "full speed" if rate <= 0 else f"{rate / 2**20:g} MiB/s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="100K memberships, 1 s phases, 1 repeat")
    ap.add_argument("--memberships", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="pairs of phases on the one pool")
    ap.add_argument("--rate", type=int, default=CHECKPOINT_BYTES_PER_SECOND,
                    help="checkpoint_bytes_per_second (0: unpaced)")  # fmt: skip
    args = ap.parse_args()
    target = args.memberships or (100_000 if args.smoke else 10_000_000)
    seconds = 1.0 if args.smoke else 12.0
    tune_thread_switching()  # as the daemon runs
    r = asyncio.run(run(target, seconds, 1 if args.smoke else args.repeats, args.rate))
    r["machine"] = machine()
    out = results_dir(args.smoke)
    write_json(out / "checkpoint.json", r)
    sm = r["summary"]
    lines = [
        f"# Checkpoint cost ({r['memberships']:,} memberships, "
        f"{r['state_bytes_exported'] / 2**20:.0f} MiB exported state, "
        f"{r['file_bytes'] / 2**20:.0f} MiB file)", "", machine_md(r["machine"]),
        f"One batch every {PERIOD_S * 1e3:g} ms (8 stores of 4 blocks and the removal of an "
        "earlier batch's) on a live member, its delta taken; delta latency counts from the "
        "moment the batch was due, apply time is the batch's own work. "
        f"{sm['repeats']} repeats of the two phases on the same pool. Checkpoints read the "
        f"state at {_rate_text(r['checkpoint_bytes_per_second'])} "
        "(`checkpoint_bytes_per_second`).", "",
        "| figure | median | min | max |", "| --- | ---: | ---: | ---: |",
    ]  # fmt: skip
    for label in [h[0] for h in HEADLINE] + [RATIO]:
        f = sm[label]
        lines.append(f"| {label} | {f['median']:.3f} | {f['min']:.3f} | {f['max']:.3f} |")
    lines += ["", "| repeat | phase | batches | delta p50 ms | delta p99 ms | delta max ms | "
              "apply p50 ms | apply p99 ms | memory added MiB |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for k, run_ in enumerate(r["runs"], 1):
        w, c = run_["without_checkpoints"], run_["with_checkpoints"]
        rows = (("without checkpoints", w), ("with checkpoints (whole phase)", c),
                ("with checkpoints: batches during one", c.get("during_checkpoint", {})))
        for label, p in rows:  # fmt: skip
            if not p:
                continue
            lines.append(f"| {k} | {label} | {p['batches']} | {p['delta_p50_ms']:.3f} | "
                         f"{p['delta_p99_ms']:.3f} | {p['delta_max_ms']:.2f} | "
                         f"{p['apply_p50_ms']:.3f} | {p['apply_p99_ms']:.3f} | "
                         f"{p.get('memory_added_peak_mib', c['memory_added_peak_mib']):.0f} |")
        lines.append(f"| {k} | cut and write | {c.get('checkpoints', 0)} checkpoints | cut "
                     f"first {c.get('cut_on_loop_ms_first', 0):.1f} ms | median "
                     f"{c.get('cut_on_loop_ms_median', 0):.1f} ms | max "
                     f"{c.get('cut_on_loop_ms_max', 0):.1f} ms | write median "
                     f"{c.get('write_s_median') or 0:.2f} s | | |")  # fmt: skip
    lines += ["", f"Each checkpoint starts {GAP_S:g} s after the previous one was written."]
    text = "\n".join(lines) + "\n"
    (out / "checkpoint.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
