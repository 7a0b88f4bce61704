"""Every committed result from one commit: ``python -m benchmarks.run --all`` (``make bench
FULL=1``), about two hours on two cores.

Before each step it waits for the 1-min load average to fall back under the quiet limit
(``settle``), so that a step is not judged by the load of the one before it.

Each step is a benchmark script run as a subprocess, in an order where a result that reads
another one runs after it (the scaling model reads ``workers-full``, the heavy side by side the
light one). Afterwards every result's machine block must name this commit with no local
changes (the results the run itself rewrites do not count), ``results/INDEX.md`` is rewritten,
and results measured on a machine that was not quiet are listed: those are not comparable with
quiet runs (benchmarks/README.md, "On a loaded machine"). A tree with modified tracked files
is refused unless ``--allow-dirty``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import PY, RESULTS, ROOT, machine
from benchmarks._load import QUIET_SHARE, load_at_start, warn_if_loaded

#: The longest wait between two steps for the load average to settle (``settle``): from the
#: 2.5–3 a heavy step leaves on two cores it falls under 1 in about a minute.
SETTLE_MAX_S = 150.0

#: (what, argv after ``python -m``, the result stems it writes)
STEPS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("micro: hashing", ("benchmarks.bench_hashing",), ("hashing",)),
    ("micro: ingest decode", ("benchmarks.bench_ingest",), ("ingest",)),
    ("micro: pool", ("benchmarks.bench_pool",), ("pool",)),
    ("micro: fan-out", ("benchmarks.bench_fanout",), ("fanout",)),
    ("micro: simulator", ("benchmarks.bench_sim",), ("bench_sim",)),
    ("micro: planes", ("benchmarks.bench_planes",), ("planes",)),
    ("micro: client SDK", ("benchmarks.bench_client",), ("bench_client",)),
    ("micro: calls after a sleep", ("benchmarks.bench_cold",), ("cold_calls",)),
    ("micro: planes of a running relay, 64 pools", ("benchmarks.bench_fleet_planes",),
     ("fleet_planes",)),
    ("loopback, short (and start-up, short)", ("benchmarks.run",), ("relay_e2e", "start-short")),
    ("loopback, full (and start-up, full)", ("benchmarks.run", "--full"),
     ("relay_e2e-full", "start")),
    ("snapshots", ("benchmarks.snapshots",), ("snapshots",)),
    ("snapshots through workers = 2 (the 64 MiB lane)",
     ("benchmarks.snapshots", "--workers", "2", "--skip-4", "--repeats", "6"),
     ("snapshots_workers2",)),
    ("snapshots through a kvrelay mirror (the 64 MiB lane)",
     ("benchmarks.snapshots", "--mirror", "--skip-4", "--repeats", "6"),
     ("snapshots_mirror",)),
    ("many lanes on one connection", ("benchmarks.one_channel",), ("one_channel",)),
    ("restart", ("benchmarks.bench_restart",), ("restart",)),
    ("hot upgrade vs stop-and-start", ("benchmarks.bench_upgrade",), ("upgrade",)),
    ("checkpoint cost", ("benchmarks.bench_checkpoint",), ("checkpoint",)),
    ("workers = 1 vs 2, mirror hop", ("benchmarks.bench_workers", "--full"), ("workers-full",)),
    ("scaling model", ("benchmarks.sim_scaling",), ("scaling_model",)),
    ("soak, 600 s", ("tests.reliability.soak", "--seconds", "600"), ("soak",)),
    ("side by side, light", ("benchmarks.side_by_side", "--full"), ("side_by_side",)),
    ("side by side, heavy, 3 repeats", ("benchmarks.side_by_side", "--heavy", "--repeats", "3"),
     ("side_by_side_heavy",)),
    ("mirror in front of Dynamo", ("benchmarks.mirror_dynamo",), ("mirror_dynamo",)),
)

#: Committed results that no step regenerates: measured on another kind of machine (stem, how).
#: ``--all`` leaves them as they are and does not hold their commit against its own.
ELSEWHERE: tuple[tuple[str, str], ...] = (
    ("device_grid", "bash benchmarks/device_run.sh on a 16-core device machine "
                    "(benchmarks/README.md, 'On a 16-core machine')"),
)


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] all: {msg}", flush=True)


def settle(max_wait_s: float = SETTLE_MAX_S, poll_s: float = 5.0) -> float:
    """Wait until the 1-min load average is back within the quiet limit (or ``max_wait_s``); the
    seconds waited. Each result judges the machine by that average at its start, and the
    average still carries the step before for a minute after it ended: without the wait, every
    step after a heavy one would be flagged as measured on a loaded machine although nothing
    else ran. It only waits; it never hides load: a step started past ``max_wait_s`` is judged
    like any other."""
    limit = QUIET_SHARE * (os.cpu_count() or 1)
    t0 = time.monotonic()
    while os.getloadavg()[0] > limit and time.monotonic() - t0 < max_wait_s:
        time.sleep(poll_s)
    return time.monotonic() - t0


def provenance_problems(commit: str, results: Path = RESULTS) -> tuple[list[str], list[str]]:
    """(results not from ``commit`` with a clean tree, results from a machine not quiet)."""
    stale, loaded = [], []
    elsewhere = {stem for stem, _ in ELSEWHERE}
    for path in sorted(results.glob("*.json")):
        if path.stem in elsewhere:
            continue
        doc = json.loads(path.read_text())
        m = doc.get("machine") if isinstance(doc, dict) else None
        m = m if isinstance(m, dict) else {}
        if m.get("git_commit") != commit or m.get("git_dirty"):
            dirty = " + local changes" if m.get("git_dirty") else ""
            stale.append(f"{path.name}: commit {m.get('git_commit')}{dirty}")
        elif m.get("quiet") is False:
            loaded.append(f"{path.name}: {m.get('not_quiet_because')}")
    return stale, loaded


def regenerate(allow_dirty: bool = False) -> int:
    m = machine()
    if m["git_dirty"] and not allow_dirty:
        print("benchmarks.run --all: tracked files are modified; commit first (or --allow-dirty:"
              " every result then says so)", file=sys.stderr)
        return 2
    warn_if_loaded(m | load_at_start(sample_s=1.0), "benchmarks.run --all")
    t0 = time.monotonic()
    failed = []
    for what, argv, _ in STEPS:
        waited = settle()
        if waited >= 1.0:
            _log(f"waited {waited:.0f} s for the previous step's load to leave the 1-min average")
        _log(f"{what}: python -m {' '.join(argv)}")
        t = time.monotonic()
        rc = subprocess.call([PY, "-m", *argv], cwd=ROOT)
        _log(f"  {what}: rc {rc} in {time.monotonic() - t:.0f} s")
        if rc != 0:
            failed.append(f"{what} (rc {rc})")
    subprocess.call([PY, "-m", "tools.bench_figures", "--index"], cwd=ROOT)
    stale, loaded = provenance_problems(m["git_commit"])
    _log(f"done in {(time.monotonic() - t0) / 60:.0f} min; failed steps: {failed or 'none'}")
    for line in stale:
        _log(f"  not from {m['git_commit']}: {line}")
    for line in loaded:
        _log(f"  measured on a machine that was not quiet: {line}")
    return 1 if failed or stale else 0
