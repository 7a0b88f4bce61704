"""``workers = 1`` vs ``workers = 2`` side by side in one run, and the mirror hop.

Two fleets run at once on their own ports (4 loadgen engines each; the idle one costs nothing):
one relay process as today, and the daemon's worker topology (the relay serves a UNIX socket,
one fan-out worker process mirrors it and serves the port, ``kvrelay.ops.front``). Every load
point is measured on one fleet, then the same point on the other, so machine load drifts hit both.
Relay CPU is the process tree (the worker is a child). Measured against issue 16's targets:

* 64 subscribers at 300K block events/s: lag terminations and delta p99 (≤ 20 ms).
* delivered frames/s at delta p99 ≤ 20 ms (no lag): the best grid point of each, ratio ≥ 1.8.
* sustained ingest (the strict ramp criterion of ``_scenarios``) with 64 subscribers attached
  for workers = 2, against the 1-subscriber figure of workers = 1.
* the mirror hop at 100K block events/s: a ``kvrelay mirror`` process in front of the relay; one
  subscriber on each; per delta sequence, mirror receive − direct receive (p50 ≤ 1 ms,
  p99 ≤ 3 ms); both streams must see the same sequences.

``python -m benchmarks.bench_workers [--full]`` writes ``results/workers[-full].{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from typing import Any

import numpy as np

from benchmarks._common import (
    PY,
    RESULTS,
    WORK,
    free_ports,
    machine,
    percentiles,
    results_dir,
    tree_sample,
    write_json,
)
from benchmarks._harness import Fleet, FleetConfig, Proc, load_point
from benchmarks._scenarios import log, sustained

TARGET_RATE, TARGET_SUBS = 300_000, 64
HOP_RATE = 100_000


def _plan(full: bool, smoke: bool = False) -> dict[str, Any]:
    if smoke:  # seconds: every code path once, nothing measured
        return {"point_s": 0.5, "rates": (5_000,), "subs": (2,), "ramp": (10_000,),
                "ramp_s": 0.5, "hop_s": 1.0, "engines": 1, "working_set_chains": 256,
                "target": (5_000, 2), "hop_rate": 5_000}
    if full:
        return {"point_s": 6.0, "rates": (10_000, 30_000, 100_000, 300_000),
                "subs": (16, 64, 128), "ramp": (200_000, 400_000, 800_000, 1_200_000),
                "ramp_s": 5.0, "hop_s": 10.0}  # fmt: skip
    return {"point_s": 4.0, "rates": (30_000, 100_000, 300_000), "subs": (16, 64),
            "ramp": (400_000, 800_000), "ramp_s": 4.0, "hop_s": 6.0}  # fmt: skip


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    keep = ("offered_rate", "achieved_rate", "subscribers", "seconds", "delta_latency_ms",
            "e2e_latency_ms", "relay_counters", "relay_cpu_util", "subscriber_cpu_util",
            "frames_received", "stream_error_count", "stream_errors", "probes_seen",
            "probes_sent", "ingested_block_events", "sent_block_events", "drain_s",
            "loadgen_hwm_drops")  # fmt: skip
    out = {k: r[k] for k in keep if k in r}
    out["frames_per_s"] = round(r["frames_received"] / r["seconds"], 1) if r["seconds"] else 0
    return out


def _ok(r: dict[str, Any], p99_ms: float = 20.0) -> bool:
    p99 = r["delta_latency_ms"]["p99"]
    return (r["relay_counters"]["lag_errors"] == 0 and r["stream_error_count"] == 0
            and p99 is not None and p99 <= p99_ms)  # fmt: skip


def _internal(fleet: Fleet) -> dict[str, Any]:
    """What the worker saw of its upstream (a worker must never lag its ingest process)."""
    s = fleet.stats()
    return {"internal_service_errors": s.get("internal_service_errors", {}),
            "workers": s.get("workers")}  # fmt: skip


def compare(fleets: dict[int, Fleet], plan: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"target": {}, "grid": [], "ramp": {}}
    t_rate, t_subs = plan.get("target", (TARGET_RATE, TARGET_SUBS))
    log(f"target: {t_rate:,} block events/s, {t_subs} subscribers")
    for w, f in fleets.items():
        r = load_point(f, t_rate, t_subs, plan["point_s"], f"w{w}-target")
        out["target"][w] = _brief(r) | _internal(f)
        log(f"  workers={w}: delta p99 {r['delta_latency_ms']['p99']} ms, lagged "
            f"{r['relay_counters']['lag_errors']}, cpu {r['relay_cpu_util']}")
    for rate in plan["rates"]:
        for n in plan["subs"]:
            for w, f in fleets.items():
                r = load_point(f, rate, n, plan["point_s"], f"w{w}-{int(rate)}-{n}")
                b = _brief(r) | {"workers": w, "within_target": _ok(r)}
                out["grid"].append(b)
                log(f"  {rate:>9,} ev/s x{n:<3} workers={w}: {b['frames_per_s']:>9,} frames/s "
                    f"p99 {r['delta_latency_ms']['p99']} ms lagged "
                    f"{r['relay_counters']['lag_errors']} ok={b['within_target']}")
    ramps = {1: (1, "workers=1, 1 subscriber"), 2: (t_subs, f"workers=2, {t_subs} subscribers")}
    for w, (n, name) in ramps.items():
        best, points = 0.0, []
        for rate in plan["ramp"]:
            r = load_point(fleets[w], rate, n, plan["ramp_s"], f"w{w}-ramp-{int(rate)}")
            ok = sustained(r)
            points.append(_brief(r) | {"sustained": ok})
            log(f"  ramp {name}: {rate:,} offered, ingested {r['ingested_block_events']:,}/"
                f"{r['sent_block_events']:,} lagged {r['relay_counters']['lag_errors']} ok={ok}")
            if not ok:
                break
            best = max(best, r["achieved_rate"])
        out["ramp"][w] = {"subscribers": n, "max_sustained": round(best), "points": points}
    return out


def _wait_port(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {port}")


def mirror_hop(fleet: Fleet, seconds: float, rate: float = HOP_RATE) -> dict[str, Any]:
    """A ``kvrelay mirror`` process in front of ``fleet``'s relay: added latency per delta."""
    port, mport = free_ports(2)
    mirror = Proc("hop-mirror", [PY, "-m", "kvrelay", "mirror", "--upstream",
                                 f"127.0.0.1:{fleet.port}", "--bind", f"127.0.0.1:{port}",
                                 "--metrics-bind", f"127.0.0.1:{mport}"])  # fmt: skip
    try:
        _wait_port(port, 60)
        subs = {}
        for name, p in (("direct", fleet.port), ("mirror", port)):
            out = WORK / f"hop-{name}.json"
            subs[name] = (Proc(f"hop-sub-{name}", [
                PY, "-m", "benchmarks._subscriber", "--port", str(p), "--streams", "1",
                "--id", f"hop-{name}", "--out", str(out), "--seq-log"]), out)  # fmt: skip
        for proc, _ in subs.values():
            proc.expect("SNAPSHOTS_DONE", 120)
        time.sleep(0.3)
        c0 = tree_sample(mirror.pid)
        sent = fleet.drive(rate, seconds)
        c1 = tree_sample(mirror.pid)
        time.sleep(0.5)
        seqs: dict[str, dict[int, int]] = {}
        lat: dict[str, Any] = {}
        for name, (proc, out) in subs.items():
            proc.stop(30)
            log_ = np.load(str(out) + ".seq.npy")
            seqs[name] = {int(s): int(t) for s, t in log_}
            lat[name] = percentiles(np.load(str(out) + ".lat.npy"), 1e-3)
        metrics = _scrape(mport)
    finally:
        mirror.stop()
    common = sorted(seqs["direct"].keys() & seqs["mirror"].keys())
    added = [seqs["mirror"][s] - seqs["direct"][s] for s in common]
    ends = {k: v for k, v in metrics.items() if "pool_stream_ends" in k or "lagged" in k}
    return {
        "offered_rate": rate,
        "achieved_rate": round(sum(float(s["achieved_rate"]) for s in sent)),
        "deltas_direct": len(seqs["direct"]),
        "deltas_mirror": len(seqs["mirror"]),
        "same_sequences": seqs["direct"].keys() == seqs["mirror"].keys(),
        "added_latency_ms": percentiles(added, 1e-3),
        "delta_latency_ms": lat,
        "mirror_cpu_util": round((c1.cpu_s - c0.cpu_s) / (c1.wall - c0.wall), 3),
        "mirror_upstream_ends_and_lag": ends,
    }


def _scrape(port: int) -> dict[str, float]:
    with socket.create_connection(("127.0.0.1", port), 5) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    out = {}
    for line in data.decode().partition("\r\n\r\n")[2].splitlines():
        if line.startswith("kvrelay_mirror_"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def summary(res: dict[str, Any]) -> dict[str, Any]:
    t1, t2 = res["compare"]["target"][1], res["compare"]["target"][2]
    best = {}
    for w in (1, 2):
        pts = [p for p in res["compare"]["grid"] if p["workers"] == w and p["within_target"]]
        top = max(pts, key=lambda p: p["frames_per_s"], default=None)
        best[w] = {"frames_per_s": top["frames_per_s"] if top else 0.0,
                   "at": (top["offered_rate"], top["subscribers"]) if top else None}
    ramp = res["compare"]["ramp"]
    hop = res["hop"]["added_latency_ms"]
    ratio = best[2]["frames_per_s"] / best[1]["frames_per_s"] if best[1]["frames_per_s"] else None
    return {
        "target_lag": {w: t["relay_counters"]["lag_errors"] for w, t in ((1, t1), (2, t2))},
        "target_p99_ms": {1: t1["delta_latency_ms"]["p99"], 2: t2["delta_latency_ms"]["p99"]},
        "best_frames": best,
        "frames_ratio": round(ratio, 2) if ratio else None,
        "ingest": {"workers1_1sub": ramp[1]["max_sustained"],
                   "workers2_64sub": ramp[2]["max_sustained"]},
        "hop_ms": {"p50": hop["p50"], "p99": hop["p99"]},
    }


def _by_workers(d: dict[Any, Any]) -> dict[int, Any]:
    """``{1: …, 2: …}`` whether the keys are ints (this run) or strings (read back from JSON)."""
    return {int(k): v for k, v in d.items()}


def markdown(res: dict[str, Any]) -> str:
    m, s = res["machine"], dict(res["summary"])
    for k in ("target_lag", "target_p99_ms", "best_frames"):
        s[k] = _by_workers(s[k])

    def met(ok: bool) -> str:
        return "yes" if ok else "**no**"

    lines = [
        f"# workers = 1 vs 2 and the mirror hop ({res['mode']})", "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores, kernel {m['kernel']}, Python "
        f"{m['python']}, load average at start {m['loadavg_at_start']} (at end "
        f"{res['loadavg_at_end']}); git {m['git_commit']}; {m['utc']}.", "",
        "Both fleets run at once, each point measured on one then the other. Relay CPU = the "
        "process tree (ingest process + worker). Loadgens and subscribers share the same 2 "
        "cores.", "",
        "| target | workers = 1 | workers = 2 | ratio 2/1 | met |", "|---|---:|---:|---:|:---:|",
    ]
    lag, p99 = s["target_lag"], s["target_p99_ms"]
    lines.append(f"| 64 subscribers at 300K ev/s: lag terminations | {lag[1]} | {lag[2]} | – | "
                 f"{met(lag[2] == 0)} |")
    r99 = p99[2] / p99[1] if p99[1] and p99[2] is not None else None
    lines.append(f"| 64 subscribers at 300K ev/s: delta p99 ms (≤ 20) | {p99[1]} | {p99[2]} | "
                 f"{r99:.2f} | {met(p99[2] is not None and p99[2] <= 20)} |"
                 if r99 is not None else f"| delta p99 | {p99[1]} | {p99[2]} | – | – |")
    b = s["best_frames"]
    lines.append(
        f"| delivered frames/s at delta p99 ≤ 20 ms, no lag (≥ 1.8×) | {b[1]['frames_per_s']:,} "
        f"@{b[1]['at']} | {b[2]['frames_per_s']:,} @{b[2]['at']} | {s['frames_ratio']} | "
        f"{met((s['frames_ratio'] or 0) >= 1.8)} |"
    )
    ing = s["ingest"]
    lines.append(
        f"| sustained ingest ev/s (w=1: 1 sub; w=2: 64 subs) | {ing['workers1_1sub']:,} | "
        f"{ing['workers2_64sub']:,} | "
        f"{ing['workers2_64sub'] / ing['workers1_1sub'] if ing['workers1_1sub'] else 0:.2f} | "
        f"{met(ing['workers2_64sub'] >= ing['workers1_1sub'] > 0)} |"
    )
    h = s["hop_ms"]
    lines.append(f"| mirror hop at 100K ev/s: added p50 / p99 ms (≤ 1 / ≤ 3) | – | "
                 f"{h['p50']} / {h['p99']} | – | "
                 f"{met(h['p50'] is not None and h['p50'] <= 1 and (h['p99'] or 99) <= 3)} |")
    lines += ["", "## Grid (delta latency = subscriber receive − relay `send_ts_us`)", "",
              "| offered ev/s | subs | workers | frames/s | delta p50 / p99 ms | lagged | "
              "relay CPU | CPU µs / frame | ok |", "|---:|---:|---:|---:|---|---:|---:|---:|:---:|"]
    for p in res["compare"]["grid"]:
        d = p["delta_latency_ms"]
        per = p["relay_cpu_util"] / p["frames_per_s"] * 1e6 if p["frames_per_s"] else 0.0
        lines.append(f"| {p['offered_rate']:,} | {p['subscribers']} | {p['workers']} | "
                     f"{p['frames_per_s']:,} | {d['p50']} / {d['p99']} | "
                     f"{p['relay_counters']['lag_errors']} | {p['relay_cpu_util']} | "
                     f"{per:.1f} | {'yes' if p['within_target'] else 'no'} |")
    hop = res["hop"]
    lines += ["", "## Mirror hop", "",
              f"`kvrelay mirror` process in front of the relay at {hop['achieved_rate']:,} "
              f"ev/s: {hop['deltas_direct']} deltas direct, {hop['deltas_mirror']} via the "
              f"mirror, same sequences: {hop['same_sequences']}; added latency per delta "
              f"{hop['added_latency_ms']}; mirror CPU {hop['mirror_cpu_util']} cores; upstream "
              f"stream ends / local lag: {hop['mirror_upstream_ends_and_lag'] or 'none'}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--render", metavar="JSON", help="only re-render the Markdown of a result")
    ap.add_argument("--smoke", action="store_true", help="seconds, tiny sizes, to .work/smoke")
    a = ap.parse_args(argv)
    if a.render:
        path = RESULTS / a.render
        res = json.loads(path.read_text())
        md = markdown(res)
        path.with_suffix(".md").write_text(md)
        print(md)
        return 0
    plan = _plan(a.full, a.smoke)
    res: dict[str, Any] = {"benchmark": "workers",
                           "mode": "smoke" if a.smoke else "full" if a.full else "short",
                           "machine": machine(), "plan": plan}  # fmt: skip
    fleets = {
        w: Fleet(FleetConfig(engines=plan.get("engines", 4),
                             working_set_chains=plan.get("working_set_chains", 16384),
                             workers=w, tag=f"w{w}", base_port=27500 + 40 * w))
        for w in (1, 2)
    }  # fmt: skip
    try:
        for f in fleets.values():
            f.start()
        res["compare"] = compare(fleets, plan)
        hop_rate = plan.get("hop_rate", HOP_RATE)
        log(f"mirror hop at {hop_rate:,} block events/s")
        res["hop"] = mirror_hop(fleets[1], plan["hop_s"], hop_rate)
        log(f"  added latency {res['hop']['added_latency_ms']}")
    finally:
        for f in fleets.values():
            f.stop()
    import os

    res["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    res["summary"] = summary(res)
    name = "workers-full" if a.full else "workers"
    out = results_dir(a.smoke)
    write_json(out / f"{name}.json", res)
    md = markdown(res)
    (out / f"{name}.md").write_text(md)
    print(md)
    print(json.dumps(res["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
