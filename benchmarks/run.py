"""Benchmark runner: ``python -m benchmarks.run [--full] [--micro] [--side-by-side]``.

Starts real processes on loopback (relay, loadgen engines, subscribers), measures latency vs
offered load and subscriber count, maximum sustained ingest, snapshot time, CPU per delivered
frame and memory per membership, then writes ``benchmarks/results/relay_e2e[-full].json``, a
Markdown table (printed too) and PNG plots. The short mode (default) takes under 2 minutes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Any

from benchmarks._common import PY, RESULTS, ROOT, machine, write_json
from benchmarks._harness import Fleet, FleetConfig
from benchmarks._report import e2e_markdown, e2e_plots
from benchmarks._scenarios import (
    FULL,
    SHORT,
    fanout_cost,
    fill,
    ingest_ramp,
    latency_sweep,
    log,
    snapshot_suite,
)

MICRO = ["bench_hashing.py", "bench_ingest.py", "bench_pool.py", "bench_fanout.py",
         "bench_sim.py", "bench_planes.py"]


def run_micro() -> dict[str, Any]:
    """The per-component scripts other engineers wrote (each writes its own JSON)."""
    out: dict[str, Any] = {}
    for name in MICRO:
        path = ROOT / "benchmarks" / name
        if not path.exists():
            out[name] = "missing"
            continue
        log(f"micro: {name}")
        t = time.monotonic()
        r = subprocess.run([PY, str(path)], cwd=ROOT, capture_output=True, text=True,
                           timeout=900)
        out[name] = {"rc": r.returncode, "seconds": round(time.monotonic() - t, 1)}
        print(r.stdout[-3000:], end="")
    return out


def run_start(full: bool) -> dict[str, Any]:
    """Daemon start-up (bench_start.py): warm starts only in the short run; cold starts (fresh
    kernel cache) and the per-kernel compile profile in the full one."""
    log("start-up: " + ("cold and warm starts, compile profile" if full else "warm starts"))
    t = time.monotonic()
    r = subprocess.run([PY, "-m", "benchmarks.bench_start", *([] if full else ["--short"])],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    print(r.stdout[-4000:], end="")
    return {"rc": r.returncode, "seconds": round(time.monotonic() - t, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--full", action="store_true", help="the full sweep (tens of minutes)")
    ap.add_argument("--micro", action="store_true", help="also run the bench_*.py scripts")
    ap.add_argument("--side-by-side", action="store_true",
                    help="also run side_by_side.py (with --full: light and --heavy)")
    ap.add_argument("--uvloop", action="store_true", help="uvloop in relay processes")
    ap.add_argument("--queue-capacity", type=int, default=16,
                    help="relay publication_queue_capacity (default: the relay's default, 16)")
    a = ap.parse_args(argv)
    plan = FULL if a.full else SHORT
    t0 = time.monotonic()
    res: dict[str, Any] = {"benchmark": "relay_e2e", "mode": plan.mode, "machine": machine(),
                           "plan": vars(plan), "uvloop": a.uvloop,
                           "queue_capacity": a.queue_capacity}
    probe_s = len(plan.loads) * len(plan.subs) * plan.point_s + len(plan.ramp) * plan.ramp_s
    fleet = Fleet(FleetConfig(engines=plan.engines, working_set_chains=plan.working_set_chains,
                              uvloop=a.uvloop, queue_capacity=a.queue_capacity,
                              probes=int(probe_s * 100 * 1.2) + 500))
    try:
        log(f"starting relay + {plan.engines} loadgen engines")
        fleet.start()
        log("filling the working set")
        res["memory"] = fill(fleet)
        log(f"  {res['memory']['memberships']:,} memberships, "
            f"{res['memory']['exact_state_bytes_per_membership']} B exact state each")
        res["latency"] = latency_sweep(fleet, plan)
        res["fanout"] = fanout_cost(res["latency"])
        res["ingest_ramp"] = ingest_ramp(fleet, plan)
        res["relay_final_stats"] = fleet.stats()
        res["snapshot"], res["snapshot_under_load"] = snapshot_suite(fleet, plan)
    finally:
        fleet.stop()
    if a.micro:
        res["micro"] = run_micro()
    res["start"] = run_start(a.full)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    suffix = ("-full" if a.full else "") + (
        f"-q{a.queue_capacity}" if a.queue_capacity != 16 else "")
    write_json(RESULTS / f"relay_e2e{suffix}.json", res)
    md = e2e_markdown(res)
    plots = e2e_plots(res, RESULTS, suffix)
    md += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n"
    (RESULTS / f"relay_e2e{suffix}.md").write_text(md)
    print(md)
    log(f"wrote {RESULTS}/relay_e2e{suffix}.{{json,md}} and {len(plots)} plots "
        f"in {res['wall_s']} s")
    if a.side_by_side:
        rc = subprocess.call(
            [PY, "-m", "benchmarks.side_by_side", *(["--full"] if a.full else [])], cwd=ROOT
        )
        if a.full:  # the heavy-load side by side (~15 min) only with the full sweep
            rc = subprocess.call([PY, "-m", "benchmarks.side_by_side", "--heavy"], cwd=ROOT) or rc
        return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
