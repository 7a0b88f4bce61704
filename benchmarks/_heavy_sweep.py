"""The heavy-load sweep: latency vs offered load × subscribers for both relays, then the ingest
ramp (1 subscriber, strict criterion), then results JSON/Markdown/PNG. See ``_heavy``."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, replace
from itertools import product
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS, ROOT, WORK, machine, write_json
from benchmarks._dynamo_env import (
    DPY,
    delete_netns,
    ensure_netns,
    ensure_venv,
    log,
    netns_name,
    sh,
    sigterm_as_exit,
)
from benchmarks._heavy import FULL, Bench, HeavyPlan
from benchmarks._heavy_report import (
    heavy_markdown,
    heavy_plot,
    median_summary,
    repeat_spread,
    representative,
    summary,
)

NS = netns_name("kvrheavy")
SIDES = ("kvrelay", "dynamo")


def _line(name: str, r: dict[str, Any]) -> str:
    d, e = r["delta_latency_ms"], r["e2e_latency_ms"]
    return (f"  {name:8s} achieved {r['achieved_rate']:>9,}/s delta p50/p99 {d['p50']}/{d['p99']}"
            f" ms e2e p99 {e['p99']} ms probes {r['probes_seen']}/{r['probes_sent']} lag "
            f"{r['lag_terminations']} cpu {r['relay_cpu_util']} bridge {r['bridge_cpu_util']} "
            f"{'OK' if r['sustained'] else 'FAIL: ' + '; '.join(r['failures'])}")


def _run_point(bench: Bench, rate: float, n: int, seconds: float, tag: str,
               names: tuple[str, ...], first: int) -> dict[str, Any]:
    """Both relays at one (rate, subscribers): at once (concurrent) or one after the other."""
    if bench.plan.concurrent:
        pt = bench.point([bench.sides[x] for x in names], rate, n, seconds, tag)
        pt["order"] = "concurrent"
        return pt
    order = names if first % 2 == 0 else tuple(reversed(names))
    merged: dict[str, Any] = {"offered_rate": rate, "subscribers": n, "seconds": seconds,
                              "order": list(order), "relays": {}}
    for name in order:
        pt = bench.point([bench.sides[name]], rate, n, seconds, f"{tag}-{name}")
        merged["relays"][name] = pt["relays"][name]
    return merged


def _restart_failed(bench: Bench, pt: dict[str, Any]) -> None:
    """A side whose state could not be shown to hold the working set (neither the probe
    stream's replica nor a fresh snapshot) gets a fresh stack before its next point."""
    bad = tuple(k for k, r in pt["relays"].items() if not r["ingest_kept_up"])
    if not bad:
        return
    if bench.plan.concurrent:
        bad = SIDES
    log(f"  restarting {', '.join(bad)} (its state is no longer known to match the engine)")
    for k in bad:
        bench.restarts[k] += 1
    bench.start(bad)


def latency_sweep(bench: Bench, out: list[dict[str, Any]]) -> None:
    """Appends to ``out`` as it goes, so an interrupted run still reports what it measured."""
    plan = bench.plan
    for i, (rate, n) in enumerate(product(plan.rates, plan.subs)):
        log(f"latency point: {rate:,.0f} block events/s, {n} subscriber(s) per relay")
        pt = _run_point(bench, rate, n, plan.point_s, f"lat-{int(rate)}-{n}", SIDES, i)
        for name in SIDES:
            log(_line(name, pt["relays"][name]))
        out.append(pt)
        _restart_failed(bench, pt)


def ingest_ramp(bench: Bench) -> dict[str, Any]:
    """Fresh stacks; offered load rises. The strict maximum is the highest point that met the
    strict criterion; a relay keeps ramping while its ingest keeps up (state complete, maybe
    with a lagged stream) and stops at the first point where it does not."""
    plan = bench.plan
    log("ingest ramp: fresh stacks")
    bench.start(SIDES)
    active = list(SIDES)
    points = []
    best = dict.fromkeys(SIDES, 0)
    best_ingest = dict.fromkeys(SIDES, 0)
    first_fail: dict[str, Any] = dict.fromkeys(SIDES)
    stop: dict[str, Any] = dict.fromkeys(SIDES)
    for i, rate in enumerate(plan.ramp):
        if not active:
            break
        log(f"ingest ramp: {rate:,.0f} block events/s, 1 subscriber ({', '.join(active)})")
        pt = _run_point(bench, rate, 1, plan.ramp_s, f"ramp-{int(rate)}", tuple(active), i)
        points.append(pt)
        for name, r in pt["relays"].items():
            log(_line(name, r))
            where = {"offered_rate": rate, "achieved_rate": r["achieved_rate"],
                     "failures": r["failures"], "generator_limited": r["generator_limited"]}
            if r["sustained"] and first_fail[name] is None:
                best[name] = max(best[name], r["achieved_rate"])
            elif first_fail[name] is None:
                first_fail[name] = where
            if r["ingest_kept_up"]:
                best_ingest[name] = max(best_ingest[name], r["achieved_rate"])
            else:
                active.remove(name)
                stop[name] = where
    return {"max_sustained": best, "max_ingest": best_ingest, "first_failure": first_fail,
            "stopped_at": stop, "points": points, "first_rate": plan.ramp[0]}


def run(plan: HeavyPlan, repeats: int = 1) -> int:
    """The sweep and the ramp ``repeats`` times (fresh stacks each time); figures are reported
    as the median and range over the repeats (``_heavy_report.repeat_spread``)."""
    sigterm_as_exit()
    WORK.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"benchmark": "side_by_side_heavy", "skipped": False,
                           "machine": machine(), "plan": asdict(plan)}
    reason = ensure_venv() or ensure_netns(NS)
    model = WORK / "fakemodel"
    if reason is None:
        r = sh(DPY, str(ROOT / "benchmarks" / "_fakemodel.py"), str(model))
        reason = None if r.returncode == 0 else f"fake model: {r.stderr.strip()[-300:]}"
    if reason is not None:
        delete_netns(NS)
        print(f"side-by-side --heavy SKIPPED: {reason}", flush=True)
        res.update(skipped=True, reason=reason)  # kept out of results/: never clobber a run
        write_json(WORK / "side_by_side_heavy.json", res)
        (WORK / "side_by_side_heavy.md").write_text(heavy_markdown(res))
        return 0
    bench = Bench(NS, plan, model)
    t0 = time.monotonic()
    try:
        log(f"heavy side by side in netns {NS} "
            f"({'concurrent: one loadgen feeds both' if plan.concurrent else 'sequential'})")
        res["repeats"] = []
        for k in range(repeats):
            log(f"repeat {k + 1} of {repeats}: fresh stacks")
            bench.start(SIDES)
            rep: dict[str, Any] = {"repeat": k, "latency": []}
            res["repeats"].append(rep)
            latency_sweep(bench, rep["latency"])
            rep["ramp"] = ingest_ramp(bench)
    except KeyboardInterrupt:
        res["interrupted"] = True
        log("interrupted: stopping every process and dropping the namespace")
    except Exception as exc:  # report, never leave a half-written result
        res["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        log(f"FAILED: {res['error']}")
    finally:
        bench.stop()
        delete_netns(NS)
    res["restarts"] = bench.restarts
    res["fill_misses"] = bench.fill_misses
    res["wall_s"] = round(time.monotonic() - t0, 1)
    res["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    light_path = RESULTS / "side_by_side.json"
    light = json.loads(light_path.read_text()) if light_path.exists() else None
    done = [r for r in res.get("repeats", []) if r.get("ramp")]
    sums = [summary(r, light) for r in done]
    for r, sm in zip(done, sums, strict=True):
        r["summary"] = sm
    if sums:
        res["summary_repeats"] = repeat_spread(sums)
        res["summary"] = median_summary(sums, res["summary_repeats"])
        res["representative_repeat"] = rep_i = representative(sums)
        res["latency"], res["ramp"] = done[rep_i]["latency"], done[rep_i]["ramp"]
    else:  # nothing complete: what the first repeat measured, for the report
        first = (res.get("repeats") or [{}])[0]
        res["latency"], res["ramp"] = first.get("latency"), first.get("ramp")
        res["summary"] = summary(res, light)
    ok = "error" not in res and not res.get("interrupted")
    # only a complete run of the full plan, repeated at least 3 times, replaces the committed
    # results; failed, interrupted, --short, --smoke, custom and single runs go to .work/
    full = replace(plan, concurrent=False) == FULL and repeats >= 3
    out_dir = RESULTS if ok and full else WORK
    stem = "side_by_side_heavy" + ("-concurrent" if plan.concurrent else "")
    write_json(out_dir / f"{stem}.json", res)
    render(out_dir / f"{stem}.json")
    return 0 if ok else 1


def render(path: Path) -> None:
    """Markdown and PNG next to a result JSON (``--heavy --render`` redoes them from the data)."""
    res = json.loads(path.read_text())
    md = heavy_markdown(res)
    if res.get("latency"):
        try:
            png = heavy_plot(res, path.with_suffix(".png"))
            md += f"\n![{path.stem}]({png.name})\n"
        except ImportError as exc:  # matplotlib: the `bench` extra (make bench installs it)
            log(f"no plot: {exc}")
    path.with_suffix(".md").write_text(md)
    print(md)
    log(f"wrote {path.with_suffix('')}.{{json,md,png}}")

