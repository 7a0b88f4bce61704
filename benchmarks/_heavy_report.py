"""Markdown, target summary and plot of the heavy-load side by side (``_heavy_sweep``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks._report import _f, machine_md

NAMES = {"kvrelay": "kvrelay", "dynamo": "Dynamo 1.6.1"}
BUSY_OTHER = 0.3  # cores busy outside a point's own processes: flag the point
MIB = 2**20

CRITERION = (
    "**Strict criterion** (the same for both relays, applied from the outside with the same "
    "subscriber code): during the point the loadgen achieved ≥ 95% of the offered rate with no "
    "PUB high-water-mark drop (otherwise the point is *generator-limited*, not a relay result); "
    "no subscriber stream ended (no lag termination, no other end); no sequence gap visible to "
    "the consumer (every DELTA's `base_sequence` equals the previous frame's `sequence`) and no "
    "snapshot chunk after the first snapshot; every probe chain sent during the point seen in "
    "the replica (all 8 of its hashes); and the replica contains every canonical hash of the "
    "working set the engine still holds (W chains × 8 blocks, from the loadgen's own record) no "
    "later than 2 s after the loadgen handed its last event to ZMQ (the replica is looked at "
    "every 10 ms)."
)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def _metric(r: dict[str, Any], key: str) -> float | None:
    if key == "relay_rss_mib":
        return r["relay_rss_bytes"] / MIB
    if key == "relay_cpu_util":
        return r["relay_cpu_util"]
    group, q = key.rsplit(".", 1)
    v = r[group][q]
    return float(v) if v is not None else None


RATIO_COLS = (("delta p50", "delta_latency_ms.p50"), ("delta p99", "delta_latency_ms.p99"),
              ("delta p99.9", "delta_latency_ms.p999"), ("e2e p50", "e2e_latency_ms.p50"),
              ("e2e p99", "e2e_latency_ms.p99"), ("e2e p99.9", "e2e_latency_ms.p999"),
              ("relay CPU", "relay_cpu_util"), ("relay RSS", "relay_rss_mib"))


def ratio_rows(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for p in points:
        k, d = p["relays"].get("kvrelay"), p["relays"].get("dynamo")
        if k is None or d is None:
            continue
        rows.append({
            "offered_rate": p["offered_rate"], "subscribers": p["subscribers"],
            "kvrelay_sustained": k["sustained"], "dynamo_sustained": d["sustained"],
            "ratios": {label: _ratio(_metric(k, key), _metric(d, key))
                       for label, key in RATIO_COLS},
        })
    return rows


def _light(light: dict[str, Any] | None) -> dict[str, Any]:
    """CPU and RSS ratios of the light-load mode (``side_by_side.json``), if it ran."""
    if not light or light.get("skipped") or not light.get("points"):
        return {"available": False}
    cpu, rss = [], []
    for p in light["points"]:
        k, d = p["relays"]["kvrelay"], p["relays"]["dynamo"]
        cpu.append({"requests_per_s": p["requests_per_s_achieved"], "kvrelay": k["cpu_util"],
                    "dynamo": d["cpu_util"], "ratio": _ratio(k["cpu_util"], d["cpu_util"])})
        rss.append({"requests_per_s": p["requests_per_s_achieved"],
                    "ratio": _ratio(k["rss_bytes"], d["rss_bytes"])})
    cr = [c["ratio"] for c in cpu if c["ratio"] is not None]
    rr = [r["ratio"] for r in rss if r["ratio"] is not None]
    return {"available": True, "utc": light["machine"]["utc"], "cpu": cpu,
            "cpu_ratio_range": [min(cr), max(cr)] if cr else None,
            "rss_ratio_range": [min(rr), max(rr)] if rr else None}


def summary(res: dict[str, Any], light: dict[str, Any] | None) -> dict[str, Any]:
    """Today's values for the targets the lead judges with this instrument."""
    out: dict[str, Any] = {"light": _light(light)}
    kept = [r for r in ratio_rows(res.get("latency") or []) if r["dynamo_sustained"]]
    p99 = [(r["offered_rate"], r["subscribers"], r["ratios"]["delta p99"]) for r in kept]
    out["delta_p99_where_dynamo_keeps_up"] = p99
    vals = [x[2] for x in p99 if x[2] is not None]
    out["delta_p99_ratio_max"] = max(vals) if vals else None
    rss = [r["ratios"]["relay RSS"] for r in ratio_rows(res.get("latency") or [])]
    rss = [x for x in rss if x is not None]
    out["heavy_rss_ratio_range"] = [min(rss), max(rss)] if rss else None
    ramp = res.get("ramp")
    if ramp:
        k, d = ramp["max_sustained"]["kvrelay"], ramp["max_sustained"]["dynamo"]
        out["max_sustained"] = {"kvrelay": k, "dynamo": d, "ratio": _ratio(k, d),
                                "first_rate": ramp["first_rate"]}
        ki, di = ramp["max_ingest"]["kvrelay"], ramp["max_ingest"]["dynamo"]
        out["max_ingest"] = {"kvrelay": ki, "dynamo": di, "ratio": _ratio(ki, di)}
    return out


#: The headline figures aggregated over repeats: (label, path in a summary).
REPEATED = (
    ("max sustained ingest, kvrelay (block events/s)", ("max_sustained", "kvrelay")),
    ("max sustained ingest, Dynamo (block events/s)", ("max_sustained", "dynamo")),
    ("max sustained ratio kvrelay / Dynamo", ("max_sustained", "ratio")),
    ("max ingest (ingest only), kvrelay", ("max_ingest", "kvrelay")),
    ("max ingest (ingest only), Dynamo", ("max_ingest", "dynamo")),
    ("max ingest ratio kvrelay / Dynamo", ("max_ingest", "ratio")),
    ("worst delta p99 ratio where Dynamo keeps up", ("delta_p99_ratio_max",)),
    ("heavy RSS ratio, lowest", ("heavy_rss_ratio_range", 0)),
    ("heavy RSS ratio, highest", ("heavy_rss_ratio_range", 1)),
)


def _get(s: Any, path: tuple[Any, ...]) -> float | None:
    for k in path:
        if s is None:
            return None
        s = s[k] if isinstance(k, int) else s.get(k)
    return s if isinstance(s, int | float) else None


def median(values: list[float]) -> float:
    """The middle value (the mean of the two middle ones for an even count)."""
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def repeat_spread(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Each headline figure over the repeats: median, min, max and every value (a repeat that
    did not produce a figure gives None there and is left out of the median)."""
    out: dict[str, Any] = {"repeats": len(summaries)}
    for label, path in REPEATED:
        vals = [_get(s, path) for s in summaries]
        have = [v for v in vals if v is not None]
        out[label] = {"median": median(have) if have else None,
                      "min": min(have) if have else None, "max": max(have) if have else None,
                      "values": vals, "path": list(path)}
    return out


def median_summary(summaries: list[dict[str, Any]], spread: dict[str, Any]) -> dict[str, Any]:
    """``summaries[0]`` with every repeated figure replaced by its median over the repeats: what
    the targets table and the README quote. Per-point lists stay those of the representative
    repeat."""
    import copy

    out = copy.deepcopy(summaries[0])
    for label, path in REPEATED:
        m = spread[label]["median"]
        node = out
        for k in path[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
            if node is None:
                break
        if node is not None and m is not None:
            node[path[-1]] = m
    return out


def representative(summaries: list[dict[str, Any]]) -> int:
    """The repeat whose kvrelay strict maximum is the median (its tables are the ones shown)."""
    vals = [(_get(s, ("max_sustained", "kvrelay")) or 0.0, i) for i, s in enumerate(summaries)]
    return sorted(vals)[len(vals) // 2][1] if vals else 0


def _repeats_md(res: dict[str, Any]) -> list[str]:
    sp = res.get("summary_repeats")
    if not sp or sp.get("repeats", 1) < 2:
        return []
    lines = [f"## Over {sp['repeats']} repeats (median, range)", "",
             "Each repeat is the whole sweep and ramp from fresh stacks. The targets table above "
             "and the README quote the median; the tables below are those of repeat "
             f"{res.get('representative_repeat', 0) + 1} (the median kvrelay strict maximum).", "",
             "| figure | median | range | each repeat |", "|---|---:|---:|---|"]
    for label, _ in REPEATED:
        f = sp.get(label) or {}
        if f.get("median") is None:
            continue
        nd = 2 if abs(f["median"]) < 100 else 0
        each = ", ".join(_f(v, nd) for v in f["values"])
        lines.append(f"| {label} | {_f(f['median'], nd)} | {_f(f['min'], nd)}–"
                     f"{_f(f['max'], nd)} | {each} |")
    return [*lines, ""]


def _ms(x: dict[str, Any]) -> str:
    return f"{_f(x['p50'], 2)} / {_f(x['p99'], 2)} / {_f(x['p999'], 2)}"


def _targets_md(s: dict[str, Any]) -> list[str]:
    lines = ["## Against the targets (today's values)", "",
             "| target | today | met |", "|---|---|:---:|"]
    m = s.get("delta_p99_ratio_max")
    pts = ", ".join(f"{r:,.0f}×{n}: {_f(v, 2)}" for r, n, v in
                    s["delta_p99_where_dynamo_keeps_up"])
    lines.append(f"| delta p99 ≤ 0.5× Dynamo where Dynamo keeps up | worst {_f(m, 2)} "
                 f"({pts or 'no point where Dynamo kept up'}) | "
                 f"{'–' if m is None else 'yes' if m <= 0.5 else 'no'} |")
    ms = s.get("max_sustained")
    if ms:
        lines.append(f"| max sustained ingest (1 sub, strict) ≥ 1.5M block events/s | kvrelay "
                     f"{_f(ms['kvrelay'])} | {'yes' if ms['kvrelay'] >= 1_500_000 else 'no'} |")
        if ms["dynamo"]:
            lines.append(f"| … and ≥ 2× Dynamo | Dynamo {_f(ms['dynamo'])}, ratio "
                         f"{_f(ms['ratio'], 2)} | "
                         f"{'yes' if ms['ratio'] is not None and ms['ratio'] >= 2 else 'no'} |")
        else:  # Dynamo failed the first ramp point: only a lower bound on the ratio
            lo = ms["kvrelay"] / ms["first_rate"]
            lines.append(f"| … and ≥ 2× Dynamo | Dynamo below {_f(ms['first_rate'], 0)} (failed "
                         f"the first ramp point), ratio > {_f(lo, 1)} | "
                         f"{'yes' if lo >= 2 else 'undecided'} |")
        mi = s.get("max_ingest")
        if mi:
            lines.append(f"| (diagnostic) max ingest, subscriber lag ignored | kvrelay "
                         f"{_f(mi['kvrelay'])}, Dynamo {_f(mi['dynamo'])}, ratio "
                         f"{_f(mi['ratio'], 2)} | – |")
    lt = s["light"]
    if lt["available"]:
        c, r = lt["cpu_ratio_range"], lt["rss_ratio_range"]
        lines.append(f"| relay CPU at light load (25–400 req/s) ≤ 1.0× Dynamo | "
                     f"{_f(c[0], 2)}–{_f(c[1], 2)}× (light mode, {lt['utc']}) | "
                     f"{'yes' if c[1] <= 1.0 else 'no'} |")
        lines.append(f"| RSS ≤ 1.2× Dynamo | light {_f(r[0], 2)}–{_f(r[1], 2)}×; heavy "
                     f"{_fr(s['heavy_rss_ratio_range'])} | "
                     f"{'yes' if r[1] <= 1.2 else 'no'} |")
    else:
        lines.append("| relay CPU at light load ≤ 1.0× Dynamo | light mode not run | – |")
        lines.append(f"| RSS ≤ 1.2× Dynamo | heavy {_fr(s['heavy_rss_ratio_range'])} | – |")
    return [*lines, ""]


def _fr(r: list[float] | None) -> str:
    return f"{_f(r[0], 2)}–{_f(r[1], 2)}×" if r else "–"


def _values_table(points: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| offered ev/s | subs | relay | achieved ev/s | delta p50 / p99 / p99.9 ms | e2e p50 / "
        "p99 / p99.9 ms | probes | lag ends | gaps | deltas/s per stream | replica complete "
        "after end s | relay CPU | bridge CPU | loadgen CPU | subscr. CPU | other CPU | relay "
        "RSS MiB | warnings relay/bridge | strict | ingest |",
        "|---:|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        "---:|:---:|:---:|",
    ]
    for p in points:
        for name, r in p["relays"].items():
            c = r["check"]
            done = c.get("complete_after_end_s")
            chk = _f(done, 2) if done is not None else (
                f"never ({_f(c.get('missing_hashes'))} missing)")
            v = r.get("state_check")
            if v is not None:
                vd = v.get("complete_after_end_s")
                chk += (f"; fresh snapshot {_f(vd, 2)}" if vd is not None else
                        f"; fresh snapshot never ({_f(v.get('missing_hashes'))} missing)")
            w = r["log_warnings"]
            warn = f"{w['relay']['count']}/{w['bridge']['count'] if 'bridge' in w else '–'}"
            lines.append(
                f"| {_f(int(p['offered_rate']))} | {p['subscribers']} | {NAMES[name]} | "
                f"{_f(r['achieved_rate'])} | {_ms(r['delta_latency_ms'])} | "
                f"{_ms(r['e2e_latency_ms'])} | {r['probes_seen']}/{r['probes_sent']} | "
                f"{r['lag_terminations']} | {r['seq_gaps']} | "
                f"{_f(r.get('deltas_per_stream_s'), 0)} | {chk} | "
                f"{_f(r['relay_cpu_util'], 2)} | {_f(r['bridge_cpu_util'], 2)} | "
                f"{_f(r['loadgen_cpu_util'], 2)} | {_f(r['subscriber_cpu_util'], 2)} | "
                f"{_f(r.get('other_cpu_util'), 2)} | "
                f"{_f(r['relay_rss_bytes'] / MIB, 0)} | {warn} | "
                f"{'yes' if r['sustained'] else 'NO'} | "
                f"{'yes' if r.get('ingest_kept_up') else 'NO'} |")
    return lines


def _notes(res: dict[str, Any]) -> list[str]:
    """Where the bridge or the generator, not the relay, may be the limit."""
    out = []
    for sec, pts in (("latency", res.get("latency") or []),
                     ("ramp", (res.get("ramp") or {}).get("points", []))):
        for p in pts:
            tag = f"{sec} {p['offered_rate']:,.0f}×{p['subscribers']}"
            for name, r in p["relays"].items():
                if r["generator_limited"]:
                    out.append(f"- {tag} {NAMES[name]}: generator-limited (achieved "
                               f"{r['achieved_rate']:,}, HWM drops {r['loadgen_hwm_drops']}, "
                               f"loadgen CPU {r['loadgen_cpu_util']}).")
                b = r.get("bridge_cpu_util")
                bw = r["log_warnings"].get("bridge", {"count": 0, "samples": []})
                o = r.get("other_cpu_util")
                if o is not None and o >= BUSY_OTHER:
                    out.append(f"- {tag} {NAMES[name]}: {o} core busy outside this point's "
                               "processes (a busy machine): treat this point with care.")
                if b is not None and b >= 0.85:
                    out.append(f"- {tag}: the bridge used {b} core — it may be the limit there.")
                if bw["count"]:
                    out.append(f"- {tag}: the bridge logged {bw['count']} warning(s), e.g. "
                               f"`{bw['samples'][0]}`.")
                rw = r["log_warnings"]["relay"]
                if rw["count"] and name == "dynamo":
                    out.append(f"- {tag}: Dynamo's relay logged {rw['count']} warning(s), e.g. "
                               f"`{rw['samples'][0]}`.")
    return out[:40]


def heavy_markdown(res: dict[str, Any]) -> str:
    n = (res.get("summary_repeats") or {}).get("repeats", 1)
    runs = "one run" if n == 1 else f"median of {n} runs"
    lines = [f"# kvrelay vs Dynamo's relay under heavy load (one vLLM event stream, {runs})", ""]
    if res.get("skipped"):
        return "\n".join([*lines, f"Skipped: {res['reason']}", ""])
    plan = res["plan"]
    lines += [machine_md(res["machine"]).rstrip(),
              f"Load average at the end {res.get('loadavg_at_end')}; wall {res.get('wall_s')} s.",
              ""]
    other = sorted(r["other_cpu_util"] for sec in (res.get("latency") or [],
                                                  (res.get("ramp") or {}).get("points", []))
                   for p in sec for r in p["relays"].values()
                   if r.get("other_cpu_util") is not None)
    if other:
        med = other[len(other) // 2]
        busy = sum(o >= BUSY_OTHER for o in other)
        lines += [f"**Machine load during the points**: CPU busy outside each point's own "
                  f"processes median {med:.2f}, max {other[-1]:.2f} cores; {busy} of "
                  f"{len(other)} relay-points ≥ {BUSY_OTHER} core"
                  + (" — a **busy** machine: other people's jobs shared the 2 cores; compare "
                     "the two relays point by point (they alternate) rather than with other "
                     "runs." if med >= BUSY_OTHER else " (a quiet machine)."), ""]
    if res.get("error") or res.get("interrupted"):
        lines += [f"**Incomplete run**: {res.get('error') or 'interrupted'}.", ""]
    mode = (
        "**Concurrent**: one loadgen's PUB socket feeds kvrelay (static ZMQ source) and the "
        "bridge at the same time; both relays and both subscriber sets share the machine."
        if plan["concurrent"] else
        "**Sequential, identical seeded stream**: each relay has its own loadgen with the same "
        "seed and the same command sequence, so both read byte-identical event streams (only "
        "the envelope `ts` differs); at each load point one relay is driven while the other "
        "idles (the order alternates), so each gets the machine."
    )
    lines += [
        "## Setup", "",
        mode, "",
        f"- Engine: one `_loadgen` process, vLLM map-era batches, int block hashes, working set "
        f"{plan['working_set_chains']:,} chains × 8 blocks (each chain one `BlockStored` with no "
        "parent: the lineage is always well formed); every batch stores chains and removes the "
        "oldest; probe chains at 100/s whose canonical hashes the loadgen computes with `xxhash`."
        " Load = block events/s (hashes in BlockStored + BlockRemoved).",
        "- kvrelay reads the loadgen as a static source. Dynamo's relay reads it through the "
        "bridge: Dynamo's worker-side `KvEventPublisher` in its own process (its CPU is shown "
        "apart and never counted as relay CPU), republishing on Dynamo's ZMQ event plane.",
        "- Both relays run with their default limits and coalescing, in a network namespace with "
        "only `lo`.",
        f"- Subscribers: the same `_subscriber` code for both relays (grpclib, small wire "
        "reader, CBI1 replica on stream 0; 32 streams per extra process). "
        f"{plan['point_s']:.0f} s per latency point, {plan['ramp_s']:.0f} s per ramp point.",
        "- Each relay's working set is filled (50K block events/s) and verified before its first "
        "point. A relay whose point fails the replica check is restarted with a fresh stack and "
        "refilled before its next point (restarts: "
        f"{res.get('restarts')}); the ramp starts from fresh stacks.",
        "- delta latency = subscriber receive − that relay's `send_ts_us` (every DELTA of every "
        "stream); e2e = all 8 probe hashes visible in the replica − engine publish time (`ts`). "
        "CPU = process-tree utime+stime / send window (1.0 = one core); *other CPU* = CPU all "
        "processes used (`/proc/stat` user + nice + system + steal; irq/softirq, where loopback "
        "TCP is processed, left out) minus this point's relay, bridge, loadgen and subscribers: "
        "the idle relay, the orchestrator, anyone else's jobs; RSS = relay process "
        "tree VmRSS after the point. Dynamo's e2e includes the bridge hop (as a Dynamo "
        "deployment's does); its RSS grows with the subscribers it has served and keeps it, so "
        "points after a 64-subscriber point carry that history (the ramp starts fresh).", "",
        CRITERION, "",
    ]
    s = res.get("summary")
    if s:
        lines += _targets_md(s)
    lines += _repeats_md(res)
    pts = res.get("latency") or []
    if pts:
        lines += ["## Ratios kvrelay / Dynamo per load point", "",
                  "Values < 1 favour kvrelay. `kept up` = the strict criterion held for that "
                  "relay at that point.", "",
                  "| offered ev/s | subs | kept up (kvrelay / Dynamo) | "
                  + " | ".join(c for c, _ in RATIO_COLS) + " |",
                  "|---:|---:|:---:|" + "---:|" * len(RATIO_COLS)]
        for r in ratio_rows(pts):
            cells = " | ".join(_f(r["ratios"][c], 2) for c, _ in RATIO_COLS)
            ku = (f"{'yes' if r['kvrelay_sustained'] else 'no'} / "
                  f"{'yes' if r['dynamo_sustained'] else 'no'}")
            lines.append(f"| {_f(int(r['offered_rate']))} | {r['subscribers']} | {ku} | "
                         f"{cells} |")
        lines += ["", "## Values per load point", "", *_values_table(pts), ""]
        fails = [f"- {p['offered_rate']:,.0f}×{p['subscribers']} {NAMES[n]}: "
                 + "; ".join(r["failures"])
                 for p in pts for n, r in p["relays"].items() if r["failures"]]
        if fails:
            lines += ["Points that failed the strict criterion:", "", *fails, ""]
    ramp = res.get("ramp")
    if ramp:
        ms, mi = ramp["max_sustained"], ramp["max_ingest"]
        lines += ["## Maximum sustained ingest (1 subscriber)", "",
                  "Offered load rises; *strict* = the criterion above; *ingest only* = the "
                  "relay's state held the whole working set (seen by the probe stream, or, when "
                  "that stream had ended, by a fresh subscriber's snapshot + deltas ≤ 5 s after "
                  "the end) whatever happened to the subscriber stream. A relay keeps ramping "
                  "while its ingest keeps up.", ""]
        for name in ("kvrelay", "dynamo"):
            ff, st = ramp["first_failure"][name], ramp["stopped_at"][name]
            strict = (f"{_f(ms[name])} block events/s" if ms[name] else
                      f"below {ramp['first_rate']:,.0f} (the first ramp point failed)")
            where = ("met it at every ramp point (the top is a lower bound)" if ff is None else
                     f"first failed at {ff['offered_rate']:,.0f} offered: "
                     + "; ".join(ff["failures"]))
            ing = ("ingest kept up to the top of the ramp" if st is None else
                   f"ingest stopped keeping up at {st['offered_rate']:,.0f}")
            lines.append(f"- **{NAMES[name]}: strict {strict}**; {where}. Ingest only: "
                         f"{_f(mi[name])} block events/s ({ing}).")
        lines += ["", *_values_table(ramp["points"]), ""]
    notes = _notes(res)
    if notes:
        lines += ["## Bridge, generator and relay logs", "", *notes, ""]
    return "\n".join(lines) + "\n"


def heavy_plot(res: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = res.get("latency") or []
    subs = sorted({p["subscribers"] for p in pts})
    colors = dict(zip(subs, ("tab:blue", "tab:orange", "tab:green", "tab:red"), strict=False))
    styles = {"kvrelay": "-o", "dynamo": "--s"}
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    for ax, key, title in ((axes[0][0], "delta_latency_ms", "delta latency p99 "
                            "(relay send_ts → subscriber receive)"),
                           (axes[0][1], "e2e_latency_ms", "e2e probe latency p99 (engine "
                            "publish → 8 hashes in replica)")):
        for name in ("kvrelay", "dynamo"):
            for n in subs:
                rows = [p for p in pts if p["subscribers"] == n and name in p["relays"]
                        and p["relays"][name][key]["p99"] is not None]
                ax.plot([p["offered_rate"] for p in rows],
                        [p["relays"][name][key]["p99"] for p in rows], styles[name],
                        color=colors[n], label=f"{NAMES[name]} {n} sub")
                bad = [p for p in rows if not p["relays"][name]["sustained"]]
                ax.plot([p["offered_rate"] for p in bad],
                        [p["relays"][name][key]["p99"] for p in bad], "x", color="k", ms=9)
        ax.set_title(title + "; × = strict criterion failed", fontsize=9)
        ax.set_ylabel("ms")
    ax = axes[1][0]
    for name in ("kvrelay", "dynamo"):
        for n in subs:
            rows = [p for p in pts if p["subscribers"] == n and name in p["relays"]]
            ax.plot([p["offered_rate"] for p in rows],
                    [p["relays"][name]["relay_cpu_util"] for p in rows], styles[name],
                    color=colors[n], label=f"{NAMES[name]} {n} sub")
        rows = [p for p in pts if p["subscribers"] == subs[0] and name == "dynamo"]
        if rows:
            ax.plot([p["offered_rate"] for p in rows],
                    [p["relays"]["dynamo"]["bridge_cpu_util"] for p in rows], ":^",
                    color="gray", label=f"bridge ({subs[0]} sub)")
    ax.set_title("relay process CPU (bridge apart)", fontsize=9)
    ax.set_ylabel("cores")
    ax = axes[1][1]
    ramp_pts = (res.get("ramp") or {}).get("points", [])
    for name, color in (("kvrelay", "tab:blue"), ("dynamo", "tab:orange")):
        rows = [p for p in ramp_pts if name in p["relays"]]
        xs = [p["offered_rate"] for p in rows]
        ys = [p["relays"][name]["relay_cpu_util"] for p in rows]
        ax.plot(xs, ys, styles[name], color=color, mfc="none", label=f"{NAMES[name]} CPU")
        for x, y, p in zip(xs, ys, rows, strict=True):
            r = p["relays"][name]
            if r["sustained"]:
                ax.plot([x], [y], "o", color=color, ms=8)
            elif not r["ingest_kept_up"]:
                ax.plot([x], [y], "x", color="red", ms=12)
        best = res["ramp"]["max_sustained"].get(name) if res.get("ramp") else None
        if best:
            ax.axvline(best, color=color, alpha=0.4, ls=":")
        if name == "dynamo":
            ax.plot(xs, [p["relays"][name]["bridge_cpu_util"] for p in rows], ":^",
                    color="gray", label="bridge CPU")
    ax.set_title("ingest ramp, 1 subscriber: ● strict ok, ○ ingest only, red × ingest failed; "
                 "dotted line = max sustained", fontsize=8)
    ax.set_ylabel("cores")
    for row in axes:
        for a in row:
            a.set_xscale("log")
            a.set_xlabel("offered block events / s")
            a.grid(True, which="both", alpha=0.3)
            a.legend(fontsize=7)
    for a in (axes[0][0], axes[0][1]):
        a.set_yscale("log")
    mode = "concurrent" if res["plan"]["concurrent"] else "sequential, identical seeded stream"
    fig.suptitle(f"kvrelay vs Dynamo 1.6.1 relay, heavy load ({mode}; "
                 f"{res['machine']['cores']} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
