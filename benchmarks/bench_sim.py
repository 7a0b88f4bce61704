"""Simulator throughput: scheduler steps, events and wire bytes per second (one DP rank).

Tells us how hard the simulator can drive an ingest pipeline from one Python process.
Usage: .venv/bin/python -m benchmarks.bench_sim [--steps N] [--smoke]
Writes ``benchmarks/results/bench_sim.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import msgspec

from benchmarks._common import machine, results_dir
from kvrelay.sim import Era, HashMode, SimConfig, SimEngine, TrafficConfig


async def run(era: Era, mode: HashMode, steps: int) -> dict[str, float | str]:
    cfg = SimConfig(
        era=era,
        hash_mode=mode,
        capacity_blocks=4096,
        max_running=64,
        grpc_port=None,
        metrics_port=None,
        buffer_steps=steps + 1,
        traffic=TrafficConfig(arrivals_per_step=4.0, lora_fraction=0.1, salt_fraction=0.1),
    )
    eng = SimEngine(cfg)
    await eng.start()
    eng.load_lora("bench-lora")
    t0 = time.perf_counter()
    batches = await eng.step(steps)
    dt = time.perf_counter() - t0
    payloads = [p for _, p in eng.publishers[0].buffer]
    events = sum(len(msgspec.msgpack.decode(p)[1]) for p in payloads)
    nbytes = sum(len(p) for p in payloads)
    await eng.stop()
    return {
        "era": era.value,
        "hash": mode.value,
        "steps": steps,
        "batches": batches,
        "seconds": round(dt, 3),
        "steps_per_s": round(steps / dt, 1),
        "events_per_s": round(events / dt, 1),
        "bytes_per_s": round(nbytes / dt, 1),
        "held_blocks": len(eng.held_blocks(0)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, results to .work/smoke")
    args = ap.parse_args()
    if args.smoke:
        args.steps = 20
    results = [
        asyncio.run(run(era, mode, args.steps))
        for era, mode in [
            (Era.MAP, HashMode.U64),
            (Era.ARRAY, HashMode.U64),
            (Era.MAP, HashMode.BYTES),
        ]
    ]
    for r in results:
        print(json.dumps(r))
    out = results_dir(args.smoke) / "bench_sim.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": "bench_sim", "machine": machine(), "results": results}
    out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
