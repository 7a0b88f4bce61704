"""Shared helpers of the process-level benchmarks: /proc sampling, percentiles, machine facts.

Subscriber processes read FilterUpdates with the lenient mode of the SDK's wire reader
(``kvrelay.client.wire.parse_filter_update``), never with betterproto2 per frame.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._load import load_at_start, tree_pids
from kvrelay.sim.ports import free_port_block

ROOT = Path(__file__).resolve().parent.parent
# KVRELAY_BENCH_RESULTS / KVRELAY_BENCH_WORK: a smoke run (tests/benchmarks) writes elsewhere,
# never over the committed results.
RESULTS = Path(os.environ.get("KVRELAY_BENCH_RESULTS") or ROOT / "benchmarks" / "results")
WORK = Path(os.environ.get("KVRELAY_BENCH_WORK") or ROOT / "benchmarks" / ".work")
PY = str(ROOT / ".venv" / "bin" / "python")


def results_dir(smoke: bool = False) -> Path:
    """Where a run writes its results: ``--smoke`` runs never go to the committed ones."""
    return WORK / "smoke" if smoke else RESULTS

MARKER = 0x4B565231
SUBSCRIBE_PATH = "/dynamo.kvrelay.v1.KvEventRelay/SubscribeKvPool"
CATALOG_PATH = "/dynamo.kvrelay.v1.KvEventRelay/WatchKvPoolCatalog"
CLK_TCK = os.sysconf("SC_CLK_TCK")

KIND_SNAPSHOT, KIND_DELTA, KIND_HEARTBEAT = 1, 2, 3


# ---- /proc ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcSample:
    wall: float
    cpu_s: float  # CPU time of the process, every thread (exited ones too), in seconds
    rss_bytes: int
    rss_peak_bytes: int


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, below the kernel's ephemeral range
    (``kvrelay.sim.ports.free_port_block``: a later bind may still race with another pick)."""
    return free_port_block(1, host=host)


def free_ports(n: int, host: str = "127.0.0.1") -> tuple[int, ...]:
    """``n`` distinct free ports (a block of them): two ``free_port()`` calls may pick the same
    port, and a relay given one port for gRPC and metrics fails to start."""
    base = free_port_block(n, host=host)
    return tuple(range(base, base + n))


def process_cpu_clock(pid: int) -> int:
    """The clock id of another process's CPU time (what ``clock_getcpuclockid(3)`` returns on
    Linux: ``CPUCLOCK_SCHED`` of the whole thread group, ``(~pid << 3) | 2``).

    It reads the scheduler's runtime in ns, exited threads included. ``utime + stime`` in
    ``/proc/<pid>/stat`` is the same total (the kernel scales its tick samples to it) but in
    clock ticks of 10 ms: about five ticks over a light-load point of a relay using 0.006 core.
    """
    return (~pid << 3) | 2


def process_cpu_s(pid: int) -> float:
    """CPU seconds of one process, every thread: its CPU clock, else ``/proc`` clock ticks."""
    try:
        return time.clock_gettime_ns(process_cpu_clock(pid)) / 1e9
    except OSError:
        return process_ticks_s(pid)


def process_ticks_s(pid: int) -> float:
    """``utime + stime`` of one process from ``/proc/<pid>/stat``, in whole clock ticks."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime (fields 14, 15)


def proc_sample(pid: int) -> ProcSample:
    """CPU seconds and RSS of one process (its CPU clock and /proc; no psutil needed)."""
    cpu = process_cpu_s(pid)
    rss = peak = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return ProcSample(time.time(), cpu, rss, peak)


def tree_sample(pid: int) -> ProcSample:
    """Sum of CPU and RSS over a process tree."""
    samples = []
    for p in tree_pids(pid):
        try:
            samples.append(proc_sample(p))
        except OSError:
            continue
    return ProcSample(
        time.time(),
        sum(s.cpu_s for s in samples),
        sum(s.rss_bytes for s in samples),
        sum(s.rss_peak_bytes for s in samples),
    )


# ---- stats ---------------------------------------------------------------------------------------


def percentiles(values: Any, scale: float = 1.0) -> dict[str, float | int | None]:
    """p50/p90/p99/p99.9/max of a sample (``scale`` converts units); ``None`` when empty."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "p999": None, "max": None}
    q = np.percentile(a, [50, 90, 99, 99.9]) * scale
    return {
        "n": int(a.size),
        "p50": round(float(q[0]), 3),
        "p90": round(float(q[1]), 3),
        "p99": round(float(q[2]), 3),
        "p999": round(float(q[3]), 3),
        "max": round(float(a.max() * scale), 3),
    }


# ---- machine -------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, Any]:
    """A figure over repeated runs: median, min, max and every value."""
    a = [float(v) for v in values]
    return {"median": float(np.median(a)), "min": min(a), "max": max(a), "values": a}


def over_repeats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeated runs of one measurement as one result: each timing (a float) is its median, with
    its ``spread`` under ``"spread"``; every other field is the first run's."""
    out: dict[str, Any] = dict(runs[0])
    spreads: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, float):
            spreads[key] = spread([r[key] for r in runs])
            out[key] = spreads[key]["median"]
    out["repeats"] = len(runs)
    out["spread"] = spreads
    return out


def print_over_repeats(results: dict[str, Any], width: int = 40) -> None:
    """One line per figure of an :func:`over_repeats` result: the median and its range."""
    for k, v in results.items():
        if k == "spread":
            continue
        s = results["spread"].get(k)
        rng = f"  ({s['min']:.3f}–{s['max']:.3f})" if s else ""
        print(f"{k:{width}s} {v:.3f}{rng}" if isinstance(v, float) else f"{k:{width}s} {v}")


def tracked_changes(root: Path) -> list[str]:
    """Tracked files edited since HEAD, outside ``benchmarks/results/``: a result rewritten by
    the run itself (``benchmarks.run --all`` writes them one after another) does not make the
    measured code dirty."""
    out = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", ".",
         ":(exclude)benchmarks/results"],
        capture_output=True, text=True, timeout=5, check=True,
    ).stdout  # fmt: skip
    return [line[3:] for line in out.splitlines() if line.strip()]


def machine() -> dict[str, Any]:
    """CPU model, cores, kernel, Python and the versions of the packages on the measured path."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    pkgs: dict[str, str | None] = {}
    for name in (
        "kvrelay", "grpclib", "betterproto2", "numpy", "numba", "pyzmq", "msgspec", "uvloop",
        "xxhash", "h2", "matplotlib",
    ):
        try:
            pkgs[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pkgs[name] = None
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, timeout=5,
        ).stdout.strip()
        dirty = bool(tracked_changes(ROOT))
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "mem_total_bytes": mem,
        "kernel": platform.release(),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "packages": pkgs,
        **load_at_start(),
        "git_commit": commit,
        "git_dirty": dirty,
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=_jsonable))
    tmp.replace(path)


def _jsonable(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o))
