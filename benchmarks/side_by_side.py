"""kvrelay side by side with Dynamo's reference relay (ai-dynamo 1.6.1).

Light load (default): inside a private network namespace (only ``lo``), Dynamo's mocker serves a
weightless tiny Llama and publishes KV events twice — on Dynamo's event plane (read by
``dynamo.kv_dc_relay``) and, with ``--zmq-kv-events-ports``, as vLLM-format ZMQ (read by kvrelay
as a static source): ONE event stream feeds both relays. Requests go through Dynamo's runtime
client (``_dynamo_driver``, in ``.venv-dynamo``); each prompt is 64 blocks of 16 tokens, and the
Dynamo canonical hashes of its first 8 blocks are a probe. One subscriber process per relay runs
the *same* code (``_subscriber``, grpclib + betterproto2 parse + cbi1 decode + replica table) and
reports, per relay: delta latency (receive − that relay's ``send_ts_us``), end-to-end latency
(request submit → all 8 probe hashes in the replica), relay process CPU during the window and
RSS. Ratios are kvrelay / Dynamo from the same run. The mocker's request path limits this mode
to ≤ ~25K stored blocks/s: it is the light-load CPU and RSS comparison.

Heavy load (``--heavy``, see ``_heavy``): a paced vLLM loadgen at 10K–1M block events/s with 1,
16 and 64 subscribers, Dynamo's relay fed through Dynamo's own worker-side ``KvEventPublisher``,
plus an ingest ramp with a strict keeping-up criterion; ``results/side_by_side_heavy.*``.

Dynamo is never a kvrelay dependency: it lives in ``.venv-dynamo`` (installed here on first use,
~226 MB from PyPI). Everything generated goes to ``benchmarks/.work/``. When the install, root or
the namespace is unavailable the script prints why and writes a ``skipped`` result.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import (
    PY,
    RESULTS,
    ROOT,
    WORK,
    machine,
    percentiles,
    results_dir,
    spread,
    tree_sample,
    write_json,
)
from benchmarks._dynamo_env import (
    DPY,
    delete_netns,
    dyn_env,
    ensure_netns,
    ensure_venv,
    log,
    netns_name,
    sh,
    sigterm_as_exit,
)
from benchmarks._harness import Proc

NS = netns_name("kvrbench")
ZMQ_PORT, DYN_PORT, KVR_PORT = 5600, 5561, 5562
PROMPT_BLOCKS, BLOCK = 64, 16
OUT = RESULTS / "side_by_side.json"


def make_prompts(n: int) -> tuple[Path, Path]:
    from kvrelay.sim.hashing import dynamo_sequence_hashes

    rng = np.random.default_rng(11)
    toks = rng.integers(2, 1001, size=(n, PROMPT_BLOCKS * BLOCK)).tolist()
    probes = [dynamo_sequence_hashes(t[: 8 * BLOCK], BLOCK) for t in toks]
    pp, pr = WORK / "sbs-prompts.json", WORK / "sbs-probes.json"
    pp.write_text(json.dumps({"prompts": toks}))
    pr.write_text(json.dumps({"probes": probes}))
    return pp, pr


def skipped(reason: str, out: Path = OUT) -> int:
    print(f"side-by-side SKIPPED: {reason}", flush=True)
    write_json(out, {"benchmark": "side_by_side", "skipped": True, "reason": reason,
                     "machine": machine()})
    from benchmarks._report import sbs_markdown

    out.with_suffix(".md").write_text(sbs_markdown({"skipped": True, "reason": reason}))
    return 0


def point(rate: float, seconds: float, start: int, procs: dict[str, Proc],
          files: dict[str, Path], env: dict[str, str]) -> dict[str, Any]:
    nsx = ["ip", "netns", "exec", NS]
    count = int(rate * seconds)
    subs = {}
    for name, port in (("kvrelay", KVR_PORT), ("dynamo", DYN_PORT)):
        out = WORK / f"sbs-sub-{name}-{int(rate)}.json"
        subs[name] = (Proc(f"sbs-sub-{name}-{int(rate)}", [
            PY, "-m", "benchmarks._subscriber", "--port", str(port), "--streams", "1",
            "--decode", "bp2", "--probe-file", str(files["probes"]), "--probe-start", str(start),
            "--id", f"sbs-{name}", "--out", str(out), "--timeout", "90"], prefix=nsx), out)
    for p, _ in subs.values():
        p.expect("SNAPSHOTS_DONE", 120)
    time.sleep(0.5)
    at0 = {k: _floor_count(procs[k]) for k in FLOORS}
    c0 = {k: tree_sample(procs[k].pid) for k in ("kvrelay", "dynamo", "mocker")}
    drv = Proc(f"sbs-driver-{int(rate)}", [
        DPY, str(ROOT / "benchmarks" / "_dynamo_driver.py"), "--prompts", str(files["prompts"]),
        "--start", str(start), "--count", str(count), "--rate", str(rate)], prefix=nsx, env=env)
    sent_res = json.loads(drv.expect("{", seconds + 120))
    drv.stop()
    c1 = {k: tree_sample(procs[k].pid) for k in ("kvrelay", "dynamo", "mocker")}
    at1 = {k: _floor_count(procs[k]) for k in FLOORS}
    time.sleep(1.0)  # let the last deltas arrive
    sent = {int(i): int(t) for i, t in sent_res["sent"]}
    window = c1["kvrelay"].wall - c0["kvrelay"].wall
    per: dict[str, Any] = {}
    for name, (p, out) in subs.items():
        p.stop(30)
        r = json.loads(out.read_text())
        lat = np.load(str(out) + ".lat.npy")
        found = {int(i): int(t) for i, t in r.get("probe_found", [])}
        e2e = [found[i] - t for i, t in sent.items() if i in found]
        st = r["streams"][0]
        per[name] = {
            "delta_latency_ms": percentiles(lat, 1e-3),
            "e2e_latency_ms": percentiles(e2e, 1e-3),
            "probes_seen": len(e2e),
            "deltas": st["deltas"],
            "delta_bytes": st["bytes"] - st["snapshot_bytes"],
            "snapshot_ms": round(st["snapshot_s"] * 1e3, 2) if st["snapshot_s"] else None,
            "stream_error": st["error"],
            "cpu_s": round(c1[name].cpu_s - c0[name].cpu_s, 5),
            "cpu_util": round((c1[name].cpu_s - c0[name].cpu_s) / window, 5),
            "rss_bytes": c1[name].rss_bytes,
        }
    return {
        "requests_per_s_offered": rate,
        "requests_per_s_achieved": round(sent_res["requests_per_s"], 1),
        "stored_blocks_per_s": round(sent_res["requests_per_s"] * PROMPT_BLOCKS),
        "requests": len(sent),
        "request_errors": sent_res["errors"],
        "seconds": round(window, 2),
        "mocker_cpu_util": round((c1["mocker"].cpu_s - c0["mocker"].cpu_s) / window, 3),
        "relays": per,
        # the same engine messages read by the ingest floors (FLOORS)
        **{k: {"messages": at1[k][0] - at0[k][0],
               "cpu_util": round((at1[k][1] - at0[k][1]) / 1e9 / window, 5)} for k in FLOORS},
    }


#: The ingest floors each light point also measures, and the reader each one runs
#: (``benchmarks/_ingest_floor.py``): the relay's own ZMTP reader, as the relay reads by
#: default, and pyzmq, as it reads with ``zmq_reader = "libzmq"``.
FLOORS = {"floor": "zmtp", "floor_libzmq": "pyzmq"}


def _floor_count(floor: Proc) -> tuple[int, int]:
    """Engine messages the ingest floor has read so far, and its CPU time (ns, every thread)."""
    floor.send("count")
    read, ns = floor.readline(30).split()
    return int(read), int(ns)


def sweep_row(p: dict[str, Any]) -> dict[str, Any]:
    """One rate of one sweep: both relays' CPU and RSS and their ratios; the ingest floors' CPU
    against Dynamo's (the ZMTP reader the relay reads with, and pyzmq), and kvrelay's CPU above
    its own reader's floor against Dynamo's."""
    k, d, f = p["relays"]["kvrelay"], p["relays"]["dynamo"], p["floor"]["cpu_util"]
    dc = d["cpu_util"]
    return {
        "requests_per_s": p["requests_per_s_offered"],
        "kvrelay_cpu": k["cpu_util"], "dynamo_cpu": dc, "floor_cpu": f,
        "messages": p["floor"]["messages"],
        "relay_cpu": k["cpu_util"] / dc if dc else None,
        "relay_rss": k["rss_bytes"] / d["rss_bytes"] if d["rss_bytes"] else None,
        "floor_cpu_ratio": f / dc if dc else None,
        "above_floor_cpu": (k["cpu_util"] - f) / dc if dc else None,
        "libzmq_floor_cpu_ratio": p["floor_libzmq"]["cpu_util"] / dc if dc else None,
    }


def light_spread(sweeps: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per offered rate, the CPU and RSS ratios over every sweep (``sweep_row``s; median, range,
    values)."""
    out: dict[str, Any] = {}
    for i, first in enumerate(sweeps[0]):
        rows = [sweep[i] for sweep in sweeps]
        out[f"{first['requests_per_s']:.0f} req/s"] = {
            key: spread([r[key] for r in rows if r[key] is not None])
            for key in ("relay_cpu", "relay_rss", "floor_cpu_ratio", "above_floor_cpu",
                        "libzmq_floor_cpu_ratio")
            if any(r[key] is not None for r in rows)
        }
    return out


def final_stats(relay: Proc, path: Path) -> dict[str, Any]:
    """Ask the relay for a counter dump (SIGUSR1) and read it once written."""
    t = time.time()
    os.kill(relay.pid, signal.SIGUSR1)
    deadline = t + 10
    while time.time() < deadline:
        with contextlib.suppress(OSError, ValueError):
            s = dict(json.loads(path.read_text()))
            if s["wall"] >= t:
                return s
        time.sleep(0.05)
    return dict(json.loads(path.read_text()))


def ratios(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for p in points:
        k, d = p["relays"]["kvrelay"], p["relays"]["dynamo"]
        tag = f"@{p['requests_per_s_achieved']:.0f} req/s ({p['stored_blocks_per_s']:,} blk/s)"

        def row(metric: str, a: float | None, b: float | None, tag: str = tag) -> None:
            rows.append({"metric": f"{metric} {tag}", "kvrelay": a, "dynamo": b,
                         "ratio": (a / b) if a is not None and b else None})

        row("delta latency p50 ms", k["delta_latency_ms"]["p50"], d["delta_latency_ms"]["p50"])
        row("delta latency p99 ms", k["delta_latency_ms"]["p99"], d["delta_latency_ms"]["p99"])
        row("e2e latency p50 ms", k["e2e_latency_ms"]["p50"], d["e2e_latency_ms"]["p50"])
        row("e2e latency p99 ms", k["e2e_latency_ms"]["p99"], d["e2e_latency_ms"]["p99"])
        row("relay CPU (cores)", k["cpu_util"], d["cpu_util"])
        row("relay RSS MiB", k["rss_bytes"] / 2**20, d["rss_bytes"] / 2**20)
        row("deltas received", k["deltas"], d["deltas"])
        row("probes seen", k["probes_seen"], d["probes_seen"])
    return rows


def _per_rate(rows: list[dict[str, Any]]) -> list[dict[str, float | None]]:
    """Ratio rows grouped per rate (``ratios`` emits 8 rows per point, in order)."""
    out: list[dict[str, float | None]] = []
    for i in range(0, len(rows) - len(rows) % 8, 8):
        out.append({r["metric"].split(" @")[0]: r["ratio"] for r in rows[i:i + 8]})
    return out


def plot(res: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = res["points"]
    x = [p["stored_blocks_per_s"] for p in pts]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for name, style in (("kvrelay", "-o"), ("dynamo", "--s")):
        for q in ("p50", "p99"):
            axes[0].plot(x, [p["relays"][name]["e2e_latency_ms"][q] for p in pts], style,
                         label=f"{name} {q}")
            axes[1].plot(x, [p["relays"][name]["delta_latency_ms"][q] for p in pts], style,
                         label=f"{name} {q}")
        axes[2].plot(x, [p["relays"][name]["cpu_util"] for p in pts], style, label=name)
    for ax, t, y in ((axes[0], "request submit → probe visible", "ms"),
                     (axes[1], "relay send_ts → subscriber receive", "ms"),
                     (axes[2], "relay process CPU", "cores")):
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("stored blocks / s (mocker)")
        ax.set_ylabel(y)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("kvrelay vs Dynamo 1.6.1 relay, one mocker event stream")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--full", action="store_true", help="light mode: all five request rates")
    ap.add_argument("--rates", default="",
                    help="comma-separated requests/s (light) or block events/s (--heavy)")
    ap.add_argument("--seconds", type=float, default=0.0, help="per load point")
    ap.add_argument("--heavy", action="store_true",
                    help="heavy load: paced vLLM stream, Dynamo fed through its KvEventPublisher")
    ap.add_argument("--short", action="store_true", help="--heavy: a ~3 minute short version")
    ap.add_argument("--smoke", action="store_true",
                    help="seconds, tiny sizes, results to .work/ (light and --heavy)")
    ap.add_argument("--repeats", type=int, default=0,
                    help="--heavy: whole sweeps from fresh stacks; light: sweeps of every rate "
                         "in one stack; each reported as median and range (default 3 for "
                         "--full and for the heavy full plan, else 1)")
    ap.add_argument("--concurrent", action="store_true",
                    help="--heavy: one loadgen feeds both relays at once (default: sequential)")
    ap.add_argument("--subs", default="", help="--heavy: comma-separated subscriber counts")
    ap.add_argument("--ramp", default="", help="--heavy: comma-separated ramp rates")
    ap.add_argument("--ramp-seconds", type=float, default=0.0)
    ap.add_argument("--working-set", type=int, default=0, help="--heavy: chains per engine")
    ap.add_argument("--render", action="store_true",
                    help="--heavy: redo results/side_by_side_heavy.{md,png} from its JSON")
    a = ap.parse_args(argv)
    if a.render and not a.heavy:  # a light run would overwrite results/side_by_side.*
        ap.error("--render redoes the heavy result: use it with --heavy")
    if a.heavy:
        return heavy(a)
    sigterm_as_exit()
    rates = [float(r) for r in a.rates.split(",")] if a.rates else (
        [10] if a.smoke else [25, 50, 100, 200, 400] if a.full else [25, 100])
    seconds = a.seconds or (1.0 if a.smoke else 8.0 if a.full else 4.0)
    sweeps = a.repeats or (3 if a.full else 1)
    out_json = results_dir(a.smoke) / "side_by_side.json"
    WORK.mkdir(parents=True, exist_ok=True)
    reason = ensure_venv()
    if reason:
        return skipped(reason, out_json)
    reason = ensure_netns(NS)
    if reason:
        return skipped(reason, out_json)
    model = WORK / "fakemodel"
    r = sh(DPY, str(ROOT / "benchmarks" / "_fakemodel.py"), str(model))
    if r.returncode != 0:
        delete_netns(NS)
        return skipped(f"fake model: {r.stderr.strip()[-300:]}", out_json)
    kv_dir = WORK / "dynkv"
    shutil.rmtree(kv_dir, ignore_errors=True)
    kv_dir.mkdir(parents=True)
    env = dyn_env(kv_dir)
    nsx = ["ip", "netns", "exec", NS]
    warm = 40
    total = int(sum(rates) * seconds) * sweeps + int(rates[0] * seconds) + warm + 10
    prompts, probes = make_prompts(total)
    files = {"prompts": prompts, "probes": probes}
    procs: dict[str, Proc] = {}
    res: dict[str, Any] = {"benchmark": "side_by_side", "skipped": False, "machine": machine()}
    try:
        log("starting mocker, Dynamo relay and kvrelay in netns " + NS)
        procs["mocker"] = Proc("sbs-mocker", [
            DPY, "-m", "dynamo.mocker", "--model-path", str(model), "--model-name", "fake",
            "--block-size", str(BLOCK), "--num-gpu-blocks-override", "65536",
            "--speedup-ratio", "100", "--kv-events", "--endpoint", "dyn://testns.mocker.generate",
            "--zmq-kv-events-ports", str(ZMQ_PORT)], prefix=nsx, env=env)
        procs["dynamo"] = Proc("sbs-dynamo-relay", [
            DPY, "-m", "dynamo.kv_dc_relay", "--dc-id", "dc-a", "--watch-all", "--bind",
            f"127.0.0.1:{DYN_PORT}"], prefix=nsx, env=env | {"DYN_NAMESPACE": "relayns"})
        procs["kvrelay"] = Proc("sbs-kvrelay", [
            PY, "-m", "benchmarks._relay_proc", "--engine", f"mocker=tcp://127.0.0.1:{ZMQ_PORT}",
            "--model", "fake", "--block-size", str(BLOCK), "--port", str(KVR_PORT),
            "--stats", str(WORK / "sbs-kvrelay-stats.json"), "--stats-interval", "0"],
            prefix=nsx, env={"KVR_BENCH_STAGES": "1"})  # counters dumped on demand: the dumps
        # are not the relay's CPU; stage timers (benchmarks._stages) stay off until the last point
        procs["kvrelay"].expect("READY", 120)
        for key, reader in FLOORS.items():
            procs[key] = Proc(f"sbs-{key}", [  # read the same messages, do nothing else
                PY, "-m", "benchmarks._ingest_floor", "--endpoint",
                f"tcp://127.0.0.1:{ZMQ_PORT}", "--reader", reader], prefix=nsx, stdin=True)
            procs[key].expect("READY", 60)
        log("warm-up (kernels, caches, connections), then 3 s idle CPU")
        drv = Proc("sbs-driver-warmup", [
            DPY, str(ROOT / "benchmarks" / "_dynamo_driver.py"), "--prompts", str(prompts),
            "--start", "0", "--count", str(warm), "--rate", "20"], prefix=nsx, env=env)
        drv.expect("{", 180)
        drv.stop()
        time.sleep(1.0)
        i0 = {k: tree_sample(procs[k].pid) for k in ("kvrelay", "dynamo")}
        time.sleep(3.0)
        i1 = {k: tree_sample(procs[k].pid) for k in ("kvrelay", "dynamo")}
        res["idle_cpu_util"] = {
            k: round((i1[k].cpu_s - i0[k].cpu_s) / (i1[k].wall - i0[k].wall), 4) for k in i0
        }
        runs: list[list[dict[str, Any]]] = []
        start = warm
        for sweep in range(sweeps):
            points = []
            for rate in rates:
                log(f"sweep {sweep + 1}/{sweeps}: {rate:.0f} requests/s for {seconds:.0f} s "
                    f"({rate * PROMPT_BLOCKS:,.0f} stored blocks/s offered)")
                p = point(rate, seconds, start, procs, files, env)
                start += int(rate * seconds)
                k, d = p["relays"]["kvrelay"], p["relays"]["dynamo"]
                log(f"  e2e p50 kvrelay {k['e2e_latency_ms']['p50']} ms / Dynamo "
                    f"{d['e2e_latency_ms']['p50']} ms; CPU {k['cpu_util']} / {d['cpu_util']} "
                    f"cores; probes {k['probes_seen']}/{d['probes_seen']} of {p['requests']}")
                points.append(p)
            runs.append(points)
        points = runs[0]
        res["points"] = points
        res["sweeps"] = [[sweep_row(p) for p in pts] for pts in runs]
        res["light_load_spread"] = light_spread(res["sweeps"])
        if not a.smoke:  # where kvrelay's CPU goes, at the lowest rate, timers on (not counted)
            rate = rates[0]
            log(f"stage timers on: {rate:.0f} requests/s for {seconds:.0f} s")
            os.kill(procs["kvrelay"].pid, signal.SIGUSR2)
            staged = point(rate, seconds, start, procs, files, env)
            start += int(rate * seconds)
            os.kill(procs["kvrelay"].pid, signal.SIGUSR2)
            res["stage_cpu"] = {
                "requests_per_s": rate,
                "timers": final_stats(procs["kvrelay"], WORK / "sbs-kvrelay-stats.json")
                .get("stage_cpu", {}),
                "kvrelay_cpu_with_timers": staged["relays"]["kvrelay"]["cpu_util"],
            }
        res["rows"] = ratios(points)
        idle = res["idle_cpu_util"]
        res["rows"].append({"metric": "relay CPU idle (cores)", "kvrelay": idle["kvrelay"],
                            "dynamo": idle["dynamo"],
                            "ratio": idle["kvrelay"] / idle["dynamo"] if idle["dynamo"] else None})
        res["light_load_ratios"] = {  # the two light-load targets, kvrelay / Dynamo per rate
            f"{p['requests_per_s_achieved']:.0f} req/s": {
                "relay_cpu": r["relay CPU (cores)"], "relay_rss": r["relay RSS MiB"]}
            for p, r in zip(points, _per_rate(res["rows"]), strict=True)}
        res["kvrelay_stats"] = final_stats(procs["kvrelay"], WORK / "sbs-kvrelay-stats.json")
        res["setup"] = (
            f"One Dynamo mocker (block 16, 65,536 GPU blocks, speedup 100) in netns `{NS}`; "
            f"prompts of {PROMPT_BLOCKS} blocks, max_tokens 1; {seconds:.0f} s per rate; "
            "same subscriber code for both relays (grpclib + betterproto2 + cbi1 replica)."
        )
    except (Exception, KeyboardInterrupt) as exc:  # report, never leave a half-written result
        res = {"benchmark": "side_by_side", "skipped": True,
               "reason": f"run failed: {type(exc).__name__}: {exc}"[:2000],
               "machine": machine()}
        print(f"side-by-side FAILED: {res['reason']}", flush=True)
    finally:
        for proc in procs.values():
            proc.stop()
        delete_netns(NS)
    from benchmarks._report import sbs_markdown

    write_json(out_json, res)
    md = sbs_markdown(res)
    if not res.get("skipped"):
        try:
            md += f"\n![side_by_side]({plot(res, out_json.with_suffix('.png')).name})\n"
        except ImportError as exc:  # matplotlib: the `bench` extra (make bench installs it)
            log(f"no plot: {exc}")
    out_json.with_suffix(".md").write_text(md)
    print(md)
    return 1 if res.get("skipped") else 0


def heavy(a: argparse.Namespace) -> int:
    """``--heavy``: the full sweep unless ``--short`` or explicit lists say otherwise."""
    from dataclasses import replace

    from benchmarks._heavy import FULL, SHORT, SMOKE
    from benchmarks._heavy_sweep import render, run

    if a.render:
        render(RESULTS / f"side_by_side_heavy{'-concurrent' if a.concurrent else ''}.json")
        return 0

    def floats(text: str) -> tuple[float, ...]:
        return tuple(float(x) for x in text.split(",") if x)

    plan = SMOKE if a.smoke else SHORT if a.short else FULL
    plan = replace(
        plan, concurrent=a.concurrent,
        rates=floats(a.rates) or plan.rates,
        subs=tuple(int(x) for x in floats(a.subs)) or plan.subs,
        point_s=a.seconds or plan.point_s,
        ramp=floats(a.ramp) or plan.ramp,
        ramp_s=a.ramp_seconds or plan.ramp_s,
        working_set_chains=a.working_set or plan.working_set_chains,
    )
    repeats = a.repeats or (3 if replace(plan, concurrent=False) == FULL else 1)
    return run(plan, repeats)


if __name__ == "__main__":
    sys.exit(main())
