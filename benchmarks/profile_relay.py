"""Where the relay's CPU goes: one loadgen, one relay, N subscribers on loopback, and, around the
send window, the relay's CPU, context switches (wakeups) and optionally a py-spy profile.

```
python -m benchmarks.profile_relay --rate 10000 --subs 1 --seconds 10 [--pyspy] [--idle 5]
```

Prints one JSON line per point: relay CPU (cores), voluntary/involuntary context switches per
second over all relay threads (each voluntary switch is a wakeup after a sleep), deltas published
per second, relay RSS, and with ``--pyspy`` the path of a py-spy ``--format raw`` profile
(``benchmarks/.work/profile-*.txt``, collapsed stacks, one line per stack with its sample count)
plus its top functions by self samples. A diagnostic, not a result: nothing goes to results/.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import CLK_TCK, PY, ROOT, WORK, tree_sample
from benchmarks._harness import Fleet, FleetConfig, Proc, counters, stop_subscribers


def ctx_switches(pid: int) -> tuple[int, int]:
    """Voluntary and involuntary context switches summed over every thread of ``pid``."""
    vol = inv = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                vol += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                inv += int(line.split()[1])
    return vol, inv


def thread_cpu(pid: int) -> dict[str, tuple[float, float]]:
    """(user, system) CPU seconds per thread of ``pid``, keyed by ``name/tid``."""
    out: dict[str, tuple[float, float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        f = stat[stat.rindex(")") + 2 :].split()
        out[f"{name}/{task.name}"] = (int(f[11]) / CLK_TCK, int(f[12]) / CLK_TCK)
    return out


def rss_by_mapping(pid: int, n: int = 8) -> list[tuple[str, float]]:
    """Resident MiB per mapped file ([heap], [anon] for anonymous memory), largest first."""
    agg: collections.Counter[str] = collections.Counter()
    cur = "[anon]"
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 5 and "-" in parts[0] and not parts[0].endswith(":"):
            cur = parts[5].rsplit("/", 1)[-1] if len(parts) > 5 else "[anon]"
        elif parts and parts[0] == "Rss:":
            agg[cur] += int(parts[1])
    return [(k, round(v / 1024, 1)) for k, v in agg.most_common(n)]


def top_self(raw: Path, n: int = 25) -> list[tuple[str, float]]:
    """Functions by share of samples where they are the innermost frame."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, k = line.rpartition(" ")
        if not stack:
            continue
        c = int(k)
        total += c
        counts[stack.split(";")[-1]] += c
    return [(f, round(c / total, 4)) for f, c in counts.most_common(n)] if total else []


def top_inclusive(raw: Path, n: int = 40) -> list[tuple[str, float]]:
    """Functions by share of samples they appear in (anywhere on the stack)."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, k = line.rpartition(" ")
        if not stack:
            continue
        c = int(k)
        total += c
        for f in set(stack.split(";")):
            counts[f] += c
    return [(f, round(c / total, 4)) for f, c in counts.most_common(n)] if total else []


def start_subs(fleet: Fleet, n: int, tag: str, per_proc: int = 32) -> list[tuple[Proc, str]]:
    """As ``_harness.start_subscribers`` (same grouping and channels), with ``--detail``."""
    procs: list[tuple[Proc, str]] = []
    groups = [1] + [min(per_proc, n - 1 - k) for k in range(0, n - 1, per_proc)]
    for j, streams in enumerate(groups):
        out = str(WORK / f"sub-{tag}-{j}.json")
        argv = [PY, "-m", "benchmarks._subscriber", "--port", str(fleet.port), "--streams",
                str(streams), "--id", f"{tag}-{j}", "--out", out, "--detail",
                "--channels", str(max(1, streams // 8))]
        if j == 0:
            argv += ["--probe-file", str(fleet.probe_file), "--probe-start", str(fleet.next_probe)]
        procs.append((Proc(f"sub-{tag}-{j}", argv), out))
    for p, _ in procs:
        p.expect("SNAPSHOTS_DONE", 120)
    return procs


def latency_by_connection(outs: list[str], t0_us: int, t1_us: int) -> list[dict[str, Any]]:
    """Delta latency p50/p99/max (ms) per subscriber process and HTTP/2 connection, counting only
    deltas received in [t0, t1]."""
    rows = []
    for j, out in enumerate(outs):
        res = json.loads(Path(out).read_text())
        det = np.load(out + ".detail.npz")
        by_ch: dict[int, list[np.ndarray]] = collections.defaultdict(list)
        for st in res["streams"]:
            a = det[f"s{st['idx']}"]
            keep = (a[0] >= t0_us) & (a[0] <= t1_us)
            by_ch[int(st["channel"])].append(a[1][keep])
        for ch, parts in sorted(by_ch.items()):
            lat = np.concatenate(parts) / 1e3
            if lat.size:
                rows.append({"proc": j, "channel": ch, "streams": len(parts), "n": int(lat.size),
                             "p50": round(float(np.percentile(lat, 50)), 2),
                             "p99": round(float(np.percentile(lat, 99)), 2),
                             "max": round(float(lat.max()), 2)})
    return rows


def measure(fleet: Fleet, seconds: float, rate: float, pyspy: str | None,
            tag: str, cprofile: bool = False, subs: list[int] | None = None) -> dict[str, Any]:
    assert fleet.relay is not None
    pid = fleet.relay.pid
    sub_pids = subs or []
    s_before = fleet.fresh_stats()
    before = counters(s_before)
    sc0 = [tree_sample(p) for p in sub_pids]
    c0, s0, t0 = tree_sample(pid), ctx_switches(pid), thread_cpu(pid)
    spy = None
    raw = WORK / f"profile-{tag}.txt"
    if pyspy:
        spy = subprocess.Popen(
            [pyspy, "record", "--pid", str(pid), "--format", "raw", "--rate", "250",
             "--duration", str(int(seconds)), "--nonblocking", "--output", str(raw)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if cprofile:
        os.kill(pid, signal.SIGUSR2)
    if rate > 0:
        fleet.drive(rate, seconds)
    else:
        time.sleep(seconds)
    if cprofile:
        os.kill(pid, signal.SIGUSR2)
    c1, s1, t1 = tree_sample(pid), ctx_switches(pid), thread_cpu(pid)
    sc1 = [tree_sample(p) for p in sub_pids]
    s_after = fleet.fresh_stats()
    after = counters(s_after)
    wall = c1.wall - c0.wall
    out: dict[str, Any] = {
        "rate": rate, "seconds": round(wall, 2),
        "relay_cpu": round((c1.cpu_s - c0.cpu_s) / wall, 4),
        "voluntary_switches_per_s": round((s1[0] - s0[0]) / wall),
        "involuntary_switches_per_s": round((s1[1] - s0[1]) / wall),
        "deltas_per_s": round((after["sequence"] - before["sequence"]) / wall, 1),
        "frames_written_by_publisher_per_s": round(
            (s_after["pools"][0].get("hub_direct_frames", 0)
             - s_before["pools"][0].get("hub_direct_frames", 0)) / wall),
        "subscriber_cpu_per_process": [
            round((b.cpu_s - a.cpu_s) / wall, 3) for a, b in zip(sc0, sc1, strict=True)],
        "rss_mib": round(c1.rss_bytes / 2**20, 1),
        "rss_top": rss_by_mapping(pid),
        "threads_user_sys": {
            k: [round((u - t0.get(k, (0.0, 0.0))[0]) / wall, 4),
                round((y - t0.get(k, (0.0, 0.0))[1]) / wall, 4)]
            for k, (u, y) in t1.items()
            if u + y - sum(t0.get(k, (0.0, 0.0))) > 0.0
        },
    }
    if spy is not None:
        spy.wait(seconds + 30)
        if raw.exists():
            out["profile"] = str(raw.relative_to(ROOT))
            out["top_self"] = top_self(raw)
            out["top_inclusive"] = top_inclusive(raw)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rate", default="10000", help="comma-separated block events/s")
    ap.add_argument("--subs", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--idle", type=float, default=0.0, help="also measure this long idle")
    ap.add_argument("--pyspy", action="store_true")
    ap.add_argument("--cprofile", action="store_true",
                    help="cProfile the relay during each window: benchmarks/.work/cprofile.N")
    ap.add_argument("--working-set", type=int, default=8192)
    ap.add_argument("--smoke", action="store_true", help="seconds: tiny sizes, one short point")
    a = ap.parse_args()
    if a.smoke:
        a.rate, a.subs, a.seconds, a.idle, a.working_set = "5000", 1, 0.5, 0.3, 256
    pyspy = shutil.which("py-spy") or str(ROOT / ".venv" / "bin" / "py-spy")
    if a.pyspy and not Path(pyspy).exists():
        raise SystemExit("py-spy not found: pip install py-spy into .venv")
    if a.cprofile:
        os.environ["KVR_BENCH_CPROFILE"] = str(WORK / "cprofile")
    fleet = Fleet(FleetConfig(working_set_chains=a.working_set, base_port=28710, tag="prof",
                                stats_interval=0.0))
    subs = []
    try:
        fleet.start()
        fleet.drive(50_000, max(1.0, a.working_set * 8 / 50_000))  # fill the working set
        subs = start_subs(fleet, a.subs, "prof")
        time.sleep(1.0)
        t_start = int(time.time() * 1e6)
        if a.idle:
            print(json.dumps({"idle": measure(fleet, a.idle, 0, pyspy if a.pyspy else None,
                                              f"idle-{a.subs}", a.cprofile,
                                              [p.pid for p, _ in subs])}), flush=True)
        for r in (float(x) for x in a.rate.split(",") if x):
            print(json.dumps(measure(fleet, a.seconds, r, pyspy if a.pyspy else None,
                                     f"{int(r)}-{a.subs}", a.cprofile,
                                     [p.pid for p, _ in subs])), flush=True)
        t_end = int(time.time() * 1e6)
    finally:
        if subs:
            stop_subscribers(subs)
        fleet.stop()
    if subs:
        for row in latency_by_connection([o for _, o in subs], t_start, t_end):
            print(json.dumps(row))


if __name__ == "__main__":
    main()
