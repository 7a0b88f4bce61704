"""Benchmark runner: ``python -m benchmarks.run [--full] [--micro] [--side-by-side] [--smoke]``.

Starts real processes on loopback (relay, loadgen engines, subscribers), measures latency vs
offered load and subscriber count, maximum sustained ingest, snapshot time, CPU per delivered
frame and memory per membership, then writes ``benchmarks/results/relay_e2e[-full].json``, a
Markdown table (printed too) and PNG plots. The short mode (default) takes under 2 minutes;
``--smoke`` runs every scenario once with tiny sizes (seconds) into ``.work/smoke``.

``--all`` regenerates every committed result from one commit (``benchmarks._all``).

At the start it looks at the machine's load (1-min load average less its own processes, and
the cores busy outside it over one second): a machine more than half busy gives figures that
are not comparable with quiet runs, so it warns on stderr and records the warning.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Any

from benchmarks._common import PY, ROOT, machine, results_dir, write_json
from benchmarks._harness import Fleet, FleetConfig
from benchmarks._load import load_at_start, warn_if_loaded
from benchmarks._report import e2e_markdown, e2e_plots
from benchmarks._scenarios import (
    FULL,
    SHORT,
    SMOKE,
    fanout_cost,
    fill,
    ingest_ramp,
    latency_sweep,
    log,
    snapshot_suite,
)

MICRO = ["bench_hashing", "bench_ingest", "bench_pool", "bench_fanout", "bench_sim",
         "bench_planes", "bench_client", "bench_cold", "bench_fleet_planes"]


def _delay_text() -> str:
    """The relay's default ``publication_delay_s``, as the report states it."""
    from kvrelay.contract.limits import RelayLimits

    d = RelayLimits().publication_delay_s
    return "0 (end of the loop iteration)" if d == 0 else f"{d * 1e3:g} ms"


def run_micro() -> dict[str, Any]:
    """The per-component scripts other engineers wrote (each writes its own JSON)."""
    out: dict[str, Any] = {}
    for name in MICRO:
        log(f"micro: {name}")
        t = time.monotonic()
        r = subprocess.run([PY, "-m", f"benchmarks.{name}"], cwd=ROOT, capture_output=True,
                           text=True, timeout=900)
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
    ap.add_argument("--smoke", action="store_true",
                    help="every scenario once, tiny sizes (seconds), results to .work/smoke")
    ap.add_argument("--all", action="store_true",
                    help="regenerate every committed result from this commit (hours)")
    ap.add_argument("--allow-dirty", action="store_true",
                    help="--all: run even with modified tracked files (results say so)")
    a = ap.parse_args(argv)
    if a.all:
        from benchmarks._all import regenerate

        return regenerate(allow_dirty=a.allow_dirty)
    plan = SMOKE if a.smoke else FULL if a.full else SHORT
    t0 = time.monotonic()
    mach = machine() | ({} if a.smoke else load_at_start(sample_s=1.0))
    res: dict[str, Any] = {"benchmark": "relay_e2e", "mode": plan.mode, "machine": mach,
                           "plan": vars(plan), "uvloop": a.uvloop,
                           "queue_capacity": a.queue_capacity,
                           "publication_delay": _delay_text(),
                           "load_warning": warn_if_loaded(mach, "benchmarks.run")}
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
    res["start"] = "skipped (smoke)" if a.smoke else run_start(a.full)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    suffix = ("-full" if a.full else "") + (
        f"-q{a.queue_capacity}" if a.queue_capacity != 16 else "")
    out = results_dir(a.smoke)
    write_json(out / f"relay_e2e{suffix}.json", res)
    md = e2e_markdown(res)
    try:
        plots = e2e_plots(res, out, suffix)
    except ImportError as exc:  # matplotlib is the `bench` extra (make bench installs it)
        log(f"no plots: {exc}")
        plots = []
    md += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n"
    (out / f"relay_e2e{suffix}.md").write_text(md)
    print(md)
    log(f"wrote {out}/relay_e2e{suffix}.{{json,md}} and {len(plots)} plots "
        f"in {res['wall_s']} s")
    if res["load_warning"]:
        print(res["load_warning"], file=sys.stderr)
    if a.side_by_side:
        rc = subprocess.call(
            [PY, "-m", "benchmarks.side_by_side", *(["--full"] if a.full else [])], cwd=ROOT
        )
        if a.full:  # the heavy-load side by side (~15 min) only with the full sweep
            rc = subprocess.call([PY, "-m", "benchmarks.side_by_side", "--heavy", "--repeats",
                                  "3"], cwd=ROOT) or rc
        return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
