"""Is the machine quiet enough for comparable figures? The load at a benchmark's start.

Every figure here is taken on a small machine where the relay, its engines and its subscribers
already share the cores: a neighbour's test suite or build takes cores they would have used, and
the figures then measure the neighbour (the short ``make bench`` sustained 150K instead of 400K
block events/s with a test suite running beside it). Each result records the load it started
under, and is flagged ``quiet: false`` when the figures will not be comparable with quiet runs.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

#: Busy cores outside this benchmark's own processes above which a run is not "quiet".
QUIET_SHARE = 0.5


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (Dynamo's mocker spawns helpers)."""
    out = [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for k in kids:
        out.extend(tree_pids(int(k)))
    return out


def _own_running() -> int:
    """Processes of this benchmark's tree (this process and its descendants) that are running
    or runnable now: the load average counts them, and they are not somebody else's load."""
    n = 0
    for pid in tree_pids(os.getpid()):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2 :].split()[0] == "R":
            n += 1
    return n


def _busy_s() -> float:
    """CPU seconds every process ran since boot (user + nice + system + steal)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[7]) / os.sysconf("SC_CLK_TCK")


def _self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def busy_other_cores(seconds: float) -> float | None:
    """Cores busy outside this process (and its reaped children) over ``seconds`` of sampling:
    the load average reacts within a minute, this within the sample."""
    try:
        b0, s0, t0 = _busy_s(), _self_cpu_s(), time.monotonic()
        time.sleep(seconds)
        b1, s1, t1 = _busy_s(), _self_cpu_s(), time.monotonic()
    except OSError:
        return None
    return round(max(0.0, (b1 - b0) - (s1 - s0)) / (t1 - t0), 3)


def assess(load_1min: float, own: int, cores: int, busy_other: float | None) -> dict[str, Any]:
    """``quiet`` and, when not, why: the 1-min load average less this benchmark's own running
    processes, and (when sampled) the cores busy outside it, each against half the cores."""
    limit = QUIET_SHARE * cores
    excess = round(max(0.0, load_1min - own), 2)
    why = []
    if excess > limit:
        why.append(f"1-min load average {load_1min} ({excess} beyond this benchmark's own "
                   f"{own} running process(es)) > {limit:g} ({QUIET_SHARE:g} x {cores} cores)")
    if busy_other is not None and busy_other > limit:
        why.append(f"{busy_other} cores busy outside this benchmark > {limit:g}")
    return {"load_1min_excess": excess, "busy_other_cores": busy_other, "quiet": not why,
            "not_quiet_because": "; ".join(why) or None}


def load_at_start(sample_s: float = 0.0) -> dict[str, Any]:
    """The machine block's load fields: load averages, the 1-min figure alone, ``quiet``."""
    try:
        load = os.getloadavg()
    except OSError:
        load = (0.0, 0.0, 0.0)
    cores = os.cpu_count() or 1
    busy = busy_other_cores(sample_s) if sample_s > 0 else None
    return {"loadavg_at_start": [round(x, 2) for x in load], "load_1min": round(load[0], 2),
            **assess(round(load[0], 2), _own_running(), cores, busy)}


def warn_if_loaded(block: dict[str, Any], what: str) -> str | None:
    """Print a warning to stderr when ``block`` (a machine block) is not quiet; the warning
    text (also for the result file), or None."""
    if block.get("quiet", True):
        return None
    text = (f"WARNING: {what}: the machine is not quiet ({block['not_quiet_because']}); "
            "figures from this run are not comparable with quiet runs (benchmarks/README.md, "
            "'On a loaded machine')")
    print(text, file=sys.stderr, flush=True)
    return text
