"""The workers scale-out grid on a machine with cores to spare, one fleet at a time.

``[relay] workers`` 1, 2, 4, 8 × 64, 256, 1,024 subscribers × 100K, 300K, 1M block events/s,
each point measured by ``bench_workers``'s machinery (``Fleet``, ``FleetConfig``, ``load_point``,
its ``within_target`` criterion), for a 16-core machine where the loadgens, the subscribers and
the relay's processes do not compete for two cores. Against three targets:

* **T1**: 64 subscribers at 300K block events/s: delta p99 ≤ 20 ms and no lag termination (met
  when some ``workers`` value meets it; each is reported);
* **T2**: 1,024 subscribers at 100K block events/s served by one relay with ``workers = 8``
  (delta p99 ≤ 20 ms, no lag termination, no stream error);
* **T3**: delivered frames/s (the best point with delta p99 ≤ 20 ms and no lag) at
  ``workers = 4`` ≥ 3× ``workers = 1``.

Each point is set beside ``sim_scaling.predict`` (the scaling model of docs/scaling.md) at the
deltas/s that point published: the busiest fan-out worker's share of a core, measured and
modelled, and whether the model calls the point comfortable against whether it met the 20 ms
criterion.

The run keeps within ``--budget-s`` (default 9 minutes, what one device command leaves): points
run one fleet (one ``workers`` value) at a time, the target points of each fleet first, and a
point runs only when what is left also covers the target points of the fleets still to come
(times learnt as the run goes). What does not fit is recorded as skipped, with the reason; a
point that fails (or outlives its time) is recorded with its error and its fleet restarted.
``results/device_grid.{json,md}`` are rewritten after every point, so a run cut short still
leaves what it measured.

``python -m benchmarks.device_grid [--budget-s S] [--workers 1,2] [--subs 4] [--rates 5000]
[--point-s 2] [--out DIR] [--smoke] [--render JSON]``; on a device machine through
``benchmarks/device_run.sh`` (benchmarks/README.md, "On a 16-core machine").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import sim_scaling
from benchmarks._common import RESULTS, machine, results_dir, write_json
from benchmarks._harness import Fleet, FleetConfig, load_point
from benchmarks._load import tree_pids, warn_if_loaded
from benchmarks._scenarios import ingest_only, log
from benchmarks.bench_workers import _internal, _ok

WORKERS = (1, 2, 4, 8)
SUBS = (64, 256, 1024)
RATES = (100_000, 300_000, 1_000_000)
BUDGET_S = 540.0  # 9 minutes: what one 10-minute device command leaves after its set-up
POINT_S = 4.0
P99_MS = 20.0
#: the issue's targets: T1 (rate, subscribers) at any workers; T2 (workers, rate, subscribers);
#: T3 frames/s at workers ``hi`` over workers ``lo`` at least ``ratio``
TARGETS: dict[str, dict[str, Any]] = {
    "t1": {"rate": 300_000, "subs": 64},
    "t2": {"workers": 8, "rate": 100_000, "subs": 1024},
    "t3": {"hi": 4, "lo": 1, "ratio": 3.0},
}
SMOKE_TARGETS: dict[str, dict[str, Any]] = {
    "t1": {"rate": 5_000, "subs": 2},
    "t2": {"workers": 2, "rate": 5_000, "subs": 2},
    "t3": {"hi": 2, "lo": 1, "ratio": 3.0},
}

#: first guesses of the time a fleet takes to start and to stop, and a point beyond its
#: ``point_s`` (subscriber start-up and snapshots, drain, stop): replaced by what the run sees
START_GUESS_S = 25.0
STOP_GUESS_S = 8.0


def overhead_guess(subs: int) -> float:
    return 4.0 + 0.015 * subs


# ---- the plan ------------------------------------------------------------------------------------


def make_points(workers: tuple[int, ...], subs: tuple[int, ...], rates: tuple[float, ...],
                targets: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every grid point with the targets it serves and its tier: 0 for T1 and T2, 1 for the
    two fleets T3 compares, 2 for the rest (a lower tier runs first and is reserved for)."""
    t1, t2, t3 = targets["t1"], targets["t2"], targets["t3"]
    points = []
    for w in workers:
        for rate in rates:
            for n in subs:
                names = []
                if (rate, n) == (t1["rate"], t1["subs"]):
                    names.append("t1")
                if (w, rate, n) == (t2["workers"], t2["rate"], t2["subs"]):
                    names.append("t2")
                if w in (t3["hi"], t3["lo"]):
                    names.append("t3")
                tier = 0 if {"t1", "t2"} & set(names) else 1 if names else 2
                points.append({"workers": w, "subscribers": n, "offered_rate": rate,
                               "targets": names, "tier": tier, "status": "pending"})
    return points


def fleet_points(points: list[dict[str, Any]], w: int) -> list[dict[str, Any]]:
    """One fleet's points in the order they run: tier, then offered load, then subscribers."""
    return sorted((p for p in points if p["workers"] == w),
                  key=lambda p: (p["tier"], p["offered_rate"], p["subscribers"]))


class Clock:
    """The budget and what the run has learnt about how long things take."""

    def __init__(self, budget_s: float, point_s: float) -> None:
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.point_s = point_s
        self.start_s: list[float] = []
        self.stop_s: list[float] = []
        self.overhead: dict[int, float] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def est_start(self) -> float:
        return max(self.start_s, default=START_GUESS_S)

    def est_stop(self) -> float:
        return max(self.stop_s, default=STOP_GUESS_S)

    def est_point(self, p: dict[str, Any]) -> float:
        n = p["subscribers"]
        return self.point_s + self.overhead.get(n, overhead_guess(n))

    def saw_point(self, p: dict[str, Any], seconds: float) -> None:
        n = p["subscribers"]
        seen = 1.1 * (seconds - self.point_s)  # a little margin: later points vary
        self.overhead[n] = max(seen, self.overhead.get(n, 0.0))

    def reserve(self, later: list[dict[str, Any]], tier: int) -> float:
        """Seconds the pending points of a lower tier than ``tier`` in later fleets need, their
        fleets' start and stop included."""
        keep = [q for q in later if q["status"] == "pending" and q["tier"] < tier]
        fleets = {q["workers"] for q in keep}
        return (sum(self.est_point(q) for q in keep)
                + len(fleets) * (self.est_start() + self.est_stop()))  # fmt: skip


# ---- running -------------------------------------------------------------------------------------


class PointTimeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise PointTimeout("the point outlived its time limit")


def _orphans(fleet: Fleet | None) -> None:
    """End this run's processes a failed point left behind (its subscribers), not the fleet's."""
    keep = set()
    if fleet is not None:
        keep = {lg.pid for lg in fleet.loadgens}
        if fleet.relay is not None:
            keep |= set(tree_pids(fleet.relay.pid))
    me = os.getpid()
    strays = [p for p in tree_pids(me) if p != me and p not in keep]
    for pid in strays:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for pid in strays:
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:  # not our child (a grandchild) or already reaped
                break
            time.sleep(0.05)
        else:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def fleet_config(w: int, a: argparse.Namespace, attempt: int) -> FleetConfig:
    return FleetConfig(engines=a.engines, working_set_chains=a.working_set, workers=w,
                       tag=f"grid-w{w}", base_port=28100 + 20 * w + 200 * attempt,
                       max_streams=max(a.subs) + 64)  # fmt: skip


def _start(w: int, a: argparse.Namespace, clock: Clock, res: dict[str, Any]) -> Fleet | None:
    info = res["fleets"].setdefault(str(w), {"starts": []})
    attempt = len(info["starts"])
    fleet = Fleet(fleet_config(w, a, attempt))
    t = time.monotonic()
    try:
        fleet.start()
    except Exception as exc:  # recorded; the fleet's points are then marked failed
        _stop(fleet, clock)
        _orphans(None)
        info["starts"].append({"seconds": round(time.monotonic() - t, 1),
                               "error": f"{type(exc).__name__}: {exc}"[-2000:]})
        log(f"workers={w}: fleet failed to start: {type(exc).__name__}: {str(exc)[:300]}")
        return None
    clock.start_s.append(time.monotonic() - t)
    info["starts"].append({"seconds": round(time.monotonic() - t, 1), "port": fleet.port})
    log(f"workers={w}: fleet up in {time.monotonic() - t:.1f} s (port {fleet.port})")
    return fleet


def _stop(fleet: Fleet, clock: Clock) -> None:
    t = time.monotonic()
    try:
        fleet.stop()
    except Exception as exc:
        log(f"  fleet stop: {type(exc).__name__}: {exc}")
    clock.stop_s.append(time.monotonic() - t)


def _record(p: dict[str, Any], r: dict[str, Any], fleet: Fleet,
            inputs: dict[str, Any]) -> None:
    """The measurement of a point, its flags, and the model at the deltas/s it published."""
    r = dict(r)
    r["frames_per_s"] = round(r["frames_received"] / r["seconds"], 1) if r["seconds"] else 0.0
    r["deltas_per_s"] = round(r["publications"] / r["seconds"], 1) if r["seconds"] else 0.0
    r["within_target"] = _ok(r, P99_MS)
    r["ingest_kept_up"] = ingest_only(r)
    r["generator_limited"] = (r["loadgen_hwm_drops"] > 0
                              or r["achieved_rate"] < 0.95 * r["offered_rate"])  # fmt: skip
    if p["workers"] > 1:
        r |= _internal(fleet)
    p["result"] = r
    p["model"] = None
    if p["workers"] > 1 and r["deltas_per_s"] > 0:
        p["model"] = sim_scaling.predict(inputs, p["workers"] - 1, p["subscribers"],
                                         r["deltas_per_s"])  # fmt: skip


def run_grid(a: argparse.Namespace, res: dict[str, Any], save: Any) -> None:
    points: list[dict[str, Any]] = res["points"]
    inputs = res["model_inputs"]
    clock = Clock(a.budget_s, a.point_s)
    order = list(a.workers)
    signal.signal(signal.SIGALRM, _alarm)
    for i, w in enumerate(order):
        mine = fleet_points(points, w)
        later = [q for q in points if q["workers"] in order[i + 1:]]
        base = clock.est_start() + clock.est_stop()
        if not any(base + clock.est_point(p) + clock.reserve(later, p["tier"]) <= clock.left()
                   for p in mine):
            for p in mine:
                _skip(p, f"budget: starting workers={w} and this point need "
                         f"~{base + clock.est_point(p):.0f} s, {clock.left():.0f} s left, "
                         f"{clock.reserve(later, p['tier']):.0f} s of it reserved for lower "
                         "tiers of later fleets")  # fmt: skip
            save()
            continue
        fleet = _start(w, a, clock, res)
        for p in mine:
            if p["status"] != "pending":  # skipped: no time to restart the fleet
                continue
            if fleet is None:
                p["status"], p["error"] = "failed", "the fleet did not start (see fleets)"
                continue
            reserve = clock.reserve(later, p["tier"])
            est = clock.est_point(p)
            left = clock.left()
            if est + clock.est_stop() + reserve > left:
                _skip(p, f"budget: ~{est:.0f} s needed, {left:.0f} s left, {reserve:.0f} s "
                         "reserved for lower tiers of later fleets")  # fmt: skip
                continue
            limit = max(1.0, min(2 * est + 30, left - clock.est_stop()))
            tag = f"w{w}-{int(p['offered_rate'])}-{p['subscribers']}"
            log(f"workers={w} {p['offered_rate']:>9,.0f} ev/s x{p['subscribers']:<5} "
                f"tier {p['tier']} {','.join(p['targets']) or '-'}: ~{est:.0f} s "
                f"(limit {limit:.0f} s), {left:.0f} s left")
            t = time.monotonic()
            p["started_s"] = round(clock.elapsed(), 1)
            try:
                signal.setitimer(signal.ITIMER_REAL, limit)
                r = load_point(fleet, p["offered_rate"], p["subscribers"], a.point_s, tag)
                signal.setitimer(signal.ITIMER_REAL, 0)
                _record(p, r, fleet, inputs)
                p["status"] = "ok"
                clock.saw_point(p, time.monotonic() - t)
                rr, m = p["result"], p["model"]
                log(f"  {rr['frames_per_s']:>11,.1f} frames/s, {rr['deltas_per_s']:,.0f} deltas/s"
                    f", delta p99 {rr['delta_latency_ms']['p99']} ms, lagged "
                    f"{rr['relay_counters']['lag_errors']}, errors {rr['stream_error_count']}, "
                    f"ok={rr['within_target']}"
                    + (f"; model: busiest worker {m['busiest_worker_util']} core (measured "
                       f"{_busiest(rr)}), comfortable={m['comfortable']}" if m else ""))
            except Exception as exc:
                signal.setitimer(signal.ITIMER_REAL, 0)
                p["status"] = "failed"
                p["error"] = f"{type(exc).__name__}: {exc}"[-2000:]
                p["seconds"] = round(time.monotonic() - t, 1)
                log(f"  FAILED after {p['seconds']:.0f} s: {p['error'][:300]}")
                _orphans(fleet)
                _stop(fleet, clock)
                fleet = None
                pending = [q for q in mine if q["status"] == "pending"]
                cheapest = min((clock.est_point(q) for q in pending), default=0.0)
                if pending and (clock.est_start() + cheapest + clock.est_stop()
                                + clock.reserve(later, min(q["tier"] for q in pending))
                                > clock.left()):  # fmt: skip
                    for q in pending:
                        _skip(q, "budget: no time to restart the fleet after a failed point")
                elif pending:
                    fleet = _start(w, a, clock, res)
            p.setdefault("seconds", round(time.monotonic() - t, 1))
            save()
        if fleet is not None:
            _stop(fleet, clock)
        save()
    signal.signal(signal.SIGALRM, signal.SIG_DFL)


def _skip(p: dict[str, Any], why: str) -> None:
    if p["status"] == "pending":
        p["status"], p["skipped_because"] = "skipped", why
        log(f"workers={p['workers']} {p['offered_rate']:,.0f} ev/s x{p['subscribers']}: "
            f"skipped ({why})")


def _busiest(r: dict[str, Any]) -> float | None:
    w = (r.get("relay_process_cpu_util") or {}).get("workers") or []
    return w[0] if w else None


# ---- the summary ---------------------------------------------------------------------------------


def _done(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in points if p["status"] == "ok"]


def _target_point(p: dict[str, Any]) -> dict[str, Any]:
    r = p["result"]
    return {"workers": p["workers"], "delta_p99_ms": r["delta_latency_ms"]["p99"],
            "lag_terminations": r["relay_counters"]["lag_errors"],
            "stream_errors": r["stream_error_count"], "frames_per_s": r["frames_per_s"],
            "met": r["within_target"]}  # fmt: skip


def summary(res: dict[str, Any]) -> dict[str, Any]:
    t = res["plan"]["targets"]
    points = res["points"]
    done = _done(points)
    t1 = [_target_point(p) for p in done
          if (p["offered_rate"], p["subscribers"]) == (t["t1"]["rate"], t["t1"]["subs"])]
    t2p = [p for p in done if (p["workers"], p["offered_rate"], p["subscribers"])
           == (t["t2"]["workers"], t["t2"]["rate"], t["t2"]["subs"])]  # fmt: skip
    best: dict[str, Any] = {}
    for w in (t["t3"]["lo"], t["t3"]["hi"]):
        mine = [p for p in points if p["workers"] == w]
        ok = [p for p in _done(mine) if p["result"]["within_target"]]
        top = max(ok, key=lambda p: p["result"]["frames_per_s"], default=None)
        best[str(w)] = {
            "frames_per_s": top["result"]["frames_per_s"] if top else 0.0,
            "at": [top["offered_rate"], top["subscribers"]] if top else None,
            "points_measured": len(_done(mine)), "points_in_grid": len(mine),
        }  # fmt: skip
    lo, hi = best[str(t["t3"]["lo"])], best[str(t["t3"]["hi"])]
    measured_t3 = lo["points_measured"] > 0 and hi["points_measured"] > 0
    ratio = hi["frames_per_s"] / lo["frames_per_s"] if measured_t3 and lo["frames_per_s"] else None
    modelled = [p for p in done if p.get("model")]
    agree = [p for p in modelled
             if p["model"]["comfortable"] == p["result"]["within_target"]]  # fmt: skip
    return {
        "t1": {"per_workers": t1, "met": any(x["met"] for x in t1) if t1 else None,
               "met_by_workers": [x["workers"] for x in t1 if x["met"]]},
        "t2": {"point": _target_point(t2p[0]) if t2p else None,
               "met": t2p[0]["result"]["within_target"] if t2p else None},
        "t3": {"best": best, "ratio": round(ratio, 2) if ratio is not None else None,
               "met": (ratio is not None and ratio >= t["t3"]["ratio"]) if measured_t3 else None},
        "points": {s: sum(1 for p in points if p["status"] == s)
                   for s in ("ok", "failed", "skipped", "pending")},
        "model_agrees": {"points": len(modelled), "agree": len(agree),
                         "disagree": [[p["workers"], p["offered_rate"], p["subscribers"]]
                                      for p in modelled if p not in agree]},
    }  # fmt: skip


# ---- Markdown ------------------------------------------------------------------------------------


def _met(v: bool | None) -> str:
    return "not measured" if v is None else "yes" if v else "**no**"


def _f(v: Any, fmt: str = "") -> str:
    return "–" if v is None else format(v, fmt)


def markdown(res: dict[str, Any]) -> str:
    m, plan, s = res["machine"], res["plan"], res["summary"]
    t = plan["targets"]
    mem = m.get("mem_total_bytes", 0) / 2**30
    commit = (m.get("git_commit") or "not recorded") + (" + local changes" if m.get("git_dirty")
                                                        else "")  # fmt: skip
    lines = [
        f"# workers scale-out grid ({res['mode']})", "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores, {mem:.0f} GiB, kernel {m['kernel']}, "
        f"Python {m['python']}, load average at start {m['loadavg_at_start']} (at end "
        f"{res.get('loadavg_at_end')}); git {commit}; {m['utc']}.", "",
    ]
    if not m.get("quiet", True):
        lines += [f"**Not a quiet machine**: {m.get('not_quiet_because')}.", ""]
    pts = s["points"]
    lines += [
        f"One fleet at a time ({plan['engines']} loadgen engines, working set "
        f"{plan['working_set_chains']:,} chains each; relay CPU = the process tree: the ingest "
        f"process and its fan-out workers), {plan['point_s']:g} s per point, budget "
        f"{plan['budget_s']:.0f} s, {res.get('elapsed_s', 0):.0f} s used: {pts['ok']} points "
        f"measured, {pts['failed']} failed, {pts['skipped']} skipped"
        + (f", {pts['pending']} not reached" if pts["pending"] else "") + ".", "",
        "## Targets", "",
        "| target | measured | ratio | met |", "|---|---|---:|:---:|",
    ]
    t1 = s["t1"]
    per = "; ".join(f"workers = {x['workers']}: p99 {_f(x['delta_p99_ms'])} ms, lagged "
                    f"{x['lag_terminations']}" for x in t1["per_workers"]) or "–"
    met_by = f" (workers = {', '.join(map(str, t1['met_by_workers']))})" if t1["met"] else ""
    lines.append(f"| T1: {t['t1']['subs']} subscribers at {t['t1']['rate']:,} ev/s: delta p99 "
                 f"≤ {P99_MS:g} ms, no lag termination | {per} | – | {_met(t1['met'])}{met_by} |")
    t2 = s["t2"]["point"]
    t2_text = (f"p99 {_f(t2['delta_p99_ms'])} ms, lagged {t2['lag_terminations']}, stream errors "
               f"{t2['stream_errors']}, {t2['frames_per_s']:,} frames/s") if t2 else "–"
    lines.append(f"| T2: {t['t2']['subs']:,} subscribers at {t['t2']['rate']:,} ev/s on one relay"
                 f", workers = {t['t2']['workers']} | {t2_text} | – | {_met(s['t2']['met'])} |")
    b = s["t3"]["best"]

    def best(w: int) -> str:
        x = b[str(w)]
        at = (f"{x['frames_per_s']:,} frames/s at {x['at'][0]:,} ev/s × {x['at'][1]:,}"
              if x["at"] else "no point within the criterion")  # fmt: skip
        return (f"workers = {w}: {at} ({x['points_measured']} of {x['points_in_grid']} points "
                "measured)")

    ratio = "–" if s["t3"]["ratio"] is None else f"{s['t3']['ratio']}×"
    lines.append(
        f"| T3: delivered frames/s at delta p99 ≤ {P99_MS:g} ms, no lag: workers = "
        f"{t['t3']['hi']} ≥ {t['t3']['ratio']:g}× workers = {t['t3']['lo']} | "
        f"{best(t['t3']['hi'])}; {best(t['t3']['lo'])} | {ratio} | {_met(s['t3']['met'])} |")
    ma = s["model_agrees"]
    i = res["model_inputs"]
    lines += [
        "", "## Per point, beside the scaling model", "",
        f"Model: `benchmarks/sim_scaling.py` (`predict`) with its inputs ({i['source']}): "
        f"{i['frame_us']} µs per delivered frame, {i['mirror_delta_us']} µs per upstream delta "
        f"in a worker, {sim_scaling.UTIL_OK} of a core comfortable; workers − 1 fan-out "
        "processes, one stream per subscriber, at the deltas/s the point published. It has no "
        "single-process case (workers = 1). "
        f"Model comfortable = measured ok at {ma['agree']} of {ma['points']} modelled points"
        + (f" (not at {', '.join(f'{w}/{r:,}/{n}' for w, r, n in ma['disagree'])}: "
           "workers/ev/s/subscribers)" if ma["disagree"] else "") + ".", "",
        "Delta latency = subscriber receive − relay `send_ts_us`; *ok* = delta p99 ≤ "
        f"{P99_MS:g} ms, no lag termination, no stream error; *gen.* = the generators "
        "reached < 95% of the offered load or dropped at their HWM (not a relay result).",
    ]
    for w in plan["workers"]:
        lines += ["", f"### workers = {w}", "",
                  "| offered ev/s | subs | achieved ev/s | deltas/s | frames/s (model) | "
                  "delta p50 / p99 ms | lagged | stream errors | relay CPU | ingest CPU | "
                  "busiest worker CPU (model) | ok (model) | notes |",
                  "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|:---:|---|"]
        for p in sorted((p for p in res["points"] if p["workers"] == w),
                        key=lambda p: (p["offered_rate"], p["subscribers"])):
            head = f"| {p['offered_rate']:,} | {p['subscribers']:,} |"
            if p["status"] != "ok":
                why = p.get("skipped_because") or p.get("error") or "not reached"
                why = why.replace("|", "/").replace("\n", " ")[:200]
                lines.append(head + " – |" * 10 + f" {p['status']}: {why} |")
                continue
            r, mo = p["result"], p.get("model")
            d = r["delta_latency_ms"]
            pc = r.get("relay_process_cpu_util") or {}
            notes = [n for n, on in (("gen.", r["generator_limited"]),
                                     ("ingest behind", not r["ingest_kept_up"])) if on]
            if any(r.get("internal_service_errors", {}).values()):
                notes.append(f"internal errors {r['internal_service_errors']}")
            lines.append(
                head + f" {r['achieved_rate']:,.0f} | {r['deltas_per_s']:,.0f} | "
                f"{r['frames_per_s']:,.0f} ({_f(mo and mo['frames_per_s'], ',.0f')}) | "
                f"{_f(d['p50'])} / {_f(d['p99'])} | {r['relay_counters']['lag_errors']} | "
                f"{r['stream_error_count']} | {_f(r['relay_cpu_util'])} | {_f(pc.get('ingest'))} "
                f"| {_f(_busiest(r))} ({_f(mo and mo['busiest_worker_util'])}) | "
                f"{'yes' if r['within_target'] else 'no'} "
                f"({'–' if not mo else 'yes' if mo['comfortable'] else 'no'}) | "
                f"{', '.join(notes)} |")
    fails = [(w, f) for w, info in res["fleets"].items() for f in info["starts"] if "error" in f]
    if fails:
        lines += ["", "## Fleet start failures", ""]
        lines += [f"- workers = {w}: {f['error'][:300]}" for w, f in fails]
    return "\n".join(lines) + "\n"


# ---- main ----------------------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(float(x)) for x in text.split(",") if x.strip())


def machine_block() -> dict[str, Any]:
    """``machine()``, with the commit given in ``KVRELAY_BENCH_COMMIT`` (and
    ``KVRELAY_BENCH_DIRTY=1``) where the copy measured has no git history (a device machine)."""
    m = machine()
    commit = os.environ.get("KVRELAY_BENCH_COMMIT", "").strip()
    if commit and not m["git_commit"]:
        m["git_commit"] = commit
        m["git_dirty"] = os.environ.get("KVRELAY_BENCH_DIRTY") == "1"
        m["git_commit_from"] = "KVRELAY_BENCH_COMMIT (the measured copy had no git history)"
    return m


def new_result(a: argparse.Namespace, targets: dict[str, dict[str, Any]], m: dict[str, Any],
               model_inputs: dict[str, Any]) -> dict[str, Any]:
    default = (a.workers, a.subs, a.rates) == (WORKERS, SUBS, RATES)
    return {
        "benchmark": "device_grid",
        "mode": "smoke" if a.smoke else "full grid" if default else "custom grid",
        "machine": m,
        "plan": {"workers": list(a.workers), "subs": list(a.subs), "rates": list(a.rates),
                 "point_s": a.point_s, "budget_s": a.budget_s, "engines": a.engines,
                 "working_set_chains": a.working_set, "max_streams": max(a.subs) + 64,
                 "p99_ms": P99_MS, "targets": targets},
        "model_inputs": model_inputs,
        "fleets": {},
        "points": make_points(a.workers, a.subs, a.rates, targets),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=_ints, default=WORKERS, help="e.g. 1,2,4,8")
    ap.add_argument("--subs", type=_ints, default=SUBS, help="e.g. 64,256,1024")
    ap.add_argument("--rates", type=_ints, default=RATES, help="block events/s, e.g. 100000")
    ap.add_argument("--point-s", type=float, default=POINT_S, help="seconds of load per point")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help="wall-clock budget of the whole grid (default: 9 minutes)")
    ap.add_argument("--engines", type=int, default=4, help="loadgen engines per fleet")
    ap.add_argument("--working-set", type=int, default=16384, help="chains per engine")
    ap.add_argument("--out", type=Path, default=None,
                    help="directory for device_grid.{json,md} (default: results/)")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds: workers 1,2 x 2 subscribers x 5,000 ev/s, to .work/smoke")
    ap.add_argument("--render", metavar="JSON",
                    help="only redo the summary and Markdown of a result (a path or a name in "
                         "results/)")
    a = ap.parse_args(argv)
    if a.render:
        path = Path(a.render) if Path(a.render).exists() else RESULTS / a.render
        res = json.loads(path.read_text())
        res["summary"] = summary(res)  # derived from the points: what this code makes of them
        write_json(path, res)
        md = markdown(res)
        path.with_suffix(".md").write_text(md)
        print(md)
        return 0
    targets = TARGETS
    if a.smoke:
        a.workers, a.subs, a.rates, a.point_s = (1, 2), (2,), (5_000,), 0.5
        a.engines, a.working_set, a.budget_s = 1, 256, min(a.budget_s, 120.0)
        targets = SMOKE_TARGETS
        sim_scaling.TRIALS = 20
    out = a.out or results_dir(a.smoke)
    m = machine_block()
    res = new_result(a, targets, m, sim_scaling.measured())
    warning = warn_if_loaded(m, "device_grid")
    if warning:
        res["load_warning"] = warning
    t0 = time.monotonic()

    def save() -> None:
        res["elapsed_s"] = round(time.monotonic() - t0, 1)
        res["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        res["summary"] = summary(res)
        write_json(out / "device_grid.json", res)
        (out / "device_grid.md").write_text(markdown(res))

    n = len(res["points"])
    log(f"device_grid: {n} points, workers {list(a.workers)}, subscribers {list(a.subs)}, "
        f"rates {list(a.rates)}, {a.point_s:g} s each, budget {a.budget_s:.0f} s, "
        f"{m['cores']} cores; results to {out}")
    try:
        run_grid(a, res, save)
    finally:
        for p in res["points"]:
            if p["status"] == "pending":
                p["status"], p["skipped_because"] = "skipped", "not reached"
        save()
    md = (out / "device_grid.md").read_text()
    print(md)
    print(json.dumps(res["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
