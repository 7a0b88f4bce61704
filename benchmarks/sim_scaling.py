"""Scaling model: what a ``workers = N`` relay carries on 16 cores and 1,000 routers, on paper.

A 2-core machine cannot show 16 cores, so this is a model with measured inputs, not a
measurement. Inputs (µs of one core), from ``results/workers-full.json`` (or ``workers.json``)
when it exists (the ``bench_workers`` run on this machine), else the defaults below taken from
``results/relay_e2e-full.md``:

* ``frame_us``: a fan-out worker's CPU per delivered frame (gRPC framing + HTTP/2 write), from
  the worker's tree CPU over frames delivered at the best grid point of workers = 2;
* ``mirror_delta_us``: a worker's CPU per upstream delta (parse, strict checks, CBI1 decode, apply
  to its table), from the mirror hop run;
* ``ingest_events_per_core``: sustained ingest of one process (the strict ramp criterion).

Router connections are taken as assigned to workers uniformly at random (what a port hash gives,
and the case of the shared accept socket when no worker is busier than another); the busiest
worker gets more than its share. That imbalance is simulated (Monte Carlo) rather than assumed.
A worker is "comfortable" below ``UTIL_OK`` of a core: above that its queueing delay, not its
throughput, breaks a 20 ms p99 (at 0.6 the 64-subscriber points of ``relay_e2e`` still met it).

Prints the table and writes ``results/scaling_model.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from benchmarks._common import RESULTS, machine, results_dir, write_json
from benchmarks._report import machine_md

UTIL_OK = 0.6
DEFAULTS = {"frame_us": 28.0, "mirror_delta_us": 60.0, "ingest_events_per_core": 800_000.0}
CORES = (2, 4, 8, 16)
ROUTERS = (64, 256, 1000)
#: per pool (relay_e2e-full: about 200-1,150/s with one subscriber at 10K-300K ev/s)
DELTAS_PER_S = (200, 600, 1000)


def measured() -> dict[str, Any]:
    """Inputs from the bench_workers results of this repository, when present."""
    out = dict(DEFAULTS)
    src = "defaults (relay_e2e-full.md)"
    path = RESULTS / "workers-full.json"
    if not path.exists():
        path = RESULTS / "workers.json"
    if path.exists():
        res = json.loads(path.read_text())
        grid = [p for p in res["compare"]["grid"] if p["workers"] == 2 and p["within_target"]]
        if grid:
            top = max(grid, key=lambda p: p["frames_per_s"])
            cpu = top["relay_cpu_util"]  # ingest + worker: the worker's share is the rest
            out["frame_us_upper_bound"] = round(cpu / top["frames_per_s"] * 1e6, 2)
        hop = res.get("hop", {})
        if hop.get("deltas_mirror"):
            d_per_s = hop["deltas_mirror"] / res["plan"]["hop_s"]
            out["mirror_delta_us"] = round(hop["mirror_cpu_util"] / d_per_s * 1e6, 1)
        src = f"results/{path.name} ({res['machine']['utc']}) and defaults"
    out["source"] = src
    return out


#: Monte Carlo trials per imbalance estimate (``--smoke``: a few, the figures mean nothing)
TRIALS = 2000


def imbalance(connections: int, workers: int, trials: int = 0, seed: int = 1) -> float:
    """E[max load / mean load] when ``connections`` hash uniformly onto ``workers``
    (``trials`` 0: ``TRIALS``)."""
    if workers == 1:
        return 1.0
    trials = trials or TRIALS
    rng = np.random.default_rng(seed)
    loads = np.zeros((trials, workers))
    picks = rng.integers(0, workers, size=(trials, connections))
    for w in range(workers):
        loads[:, w] = (picks == w).sum(axis=1)
    return float(np.mean(loads.max(axis=1) / (connections / workers)))


def _busiest(inputs: dict[str, Any], workers: int, routers: int, deltas_per_s: float,
             trials: int) -> tuple[float, float]:
    """(the busiest worker's share of a core, the imbalance of connections)."""
    imb = imbalance(routers, workers, trials=trials or TRIALS)
    per_worker = deltas_per_s * routers / workers * imb  # one pool stream per router
    util = (per_worker * inputs["frame_us"] + deltas_per_s * inputs["mirror_delta_us"]) * 1e-6
    return util, imb


def predict(inputs: dict[str, Any], workers: int, routers: int, deltas_per_s: float,
            trials: int = 0) -> dict[str, Any]:
    """The model at one point: ``workers`` fan-out processes (``[relay] workers`` less the
    ingest process) serving ``routers`` pool streams of a pool publishing ``deltas_per_s``.
    ``trials`` for the imbalance (0: ``TRIALS``). ``benchmarks.device_grid`` sets it beside what
    a 16-core machine measured at each of its points."""
    util, imb = _busiest(inputs, workers, routers, deltas_per_s, trials)
    frames = deltas_per_s * routers  # one pool stream per router
    # the ingest process sends every delta to every worker (one stream each)
    ingest_fanout = workers * deltas_per_s * inputs["frame_us"] * 1e-6
    return {
        "workers": workers, "routers": routers, "deltas_per_s": deltas_per_s,
        "frames_per_s": frames, "imbalance": round(imb, 3),
        "busiest_worker_util": round(util, 3), "ingest_fanout_util": round(ingest_fanout, 3),
        "comfortable": util <= UTIL_OK and ingest_fanout <= 0.2,
    }  # fmt: skip


def model(inputs: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for cores in CORES:
        workers = cores - 1  # one core for ingest, the rest fan out
        for routers in ROUTERS:
            for d in DELTAS_PER_S:
                rows.append({"cores": cores} | predict(inputs, workers, routers, d))
    return rows


def max_routers(inputs: dict[str, Any], cores: int, d: int) -> int:
    """Most routers one machine serves comfortably at ``d`` deltas/s (one pool each)."""
    workers = cores - 1
    lo, hi = 1, 100_000
    while lo < hi:
        mid = (lo + hi + 1) // 2
        util, _ = _busiest(inputs, workers, mid, d, trials=max(1, TRIALS * 3 // 20))
        lo, hi = (mid, hi) if util <= UTIL_OK else (lo, mid - 1)
    return lo


def markdown(res: dict[str, Any]) -> str:
    i = res["inputs"]
    lines = [
        "# Scaling model (on paper)", "", machine_md(res["machine"]),
        f"Inputs ({i['source']}): {i['frame_us']} µs per delivered frame, "
        f"{i['mirror_delta_us']} µs per upstream delta in a worker, "
        f"{i['ingest_events_per_core']:,.0f} block events/s per ingest process; "
        f"a worker is comfortable below {UTIL_OK} of a core. One pool stream per router.", "",
        "| cores | workers | routers | deltas/s | frames/s | connections max/mean | busiest "
        "worker (cores) | ingest → workers (cores) | comfortable |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['cores']} | {r['workers']} | {r['routers']} | {r['deltas_per_s']} | "
            f"{r['frames_per_s']:,} | {r['imbalance']} | {r['busiest_worker_util']} | "
            f"{r['ingest_fanout_util']} | {'yes' if r['comfortable'] else 'no'} |"
        )
    lines += ["", "Most routers per machine, comfortably:", "",
              "| cores | 200 deltas/s | 600 deltas/s | 1000 deltas/s |", "|---:|---:|---:|---:|"]
    for cores, by_d in res["max_routers"].items():
        lines.append(f"| {cores} | " + " | ".join(f"{by_d[str(d)]:,}" for d in DELTAS_PER_S)
                     + " |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="write to .work/smoke (same model)")
    smoke = ap.parse_args(argv).smoke
    global TRIALS
    if smoke:
        TRIALS = 20
    inputs = measured()
    res = {
        "benchmark": "scaling_model", "machine": machine(), "inputs": inputs,
        "util_ok": UTIL_OK, "rows": model(inputs),
        "max_routers": {str(c): {str(d): max_routers(inputs, c, d) for d in DELTAS_PER_S}
                        for c in CORES},
    }  # fmt: skip
    out = results_dir(smoke)
    write_json(out / "scaling_model.json", res)
    md = markdown(res)
    (out / "scaling_model.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
