"""Markdown tables and PNG plots from the result JSON (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _f(v: Any, nd: int = 1) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.{nd}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def machine_md(m: dict[str, Any]) -> str:
    pk = ", ".join(f"{k} {v}" for k, v in m["packages"].items() if v)
    return (
        f"Machine: {m['cpu_model']}, {m['cores']} cores, kernel {m['kernel']}, Python "
        f"{m['python']}, load average at start {m['loadavg_at_start']}; {pk}; "
        f"git {m['git_commit']}{' (modified tree)' if m.get('git_dirty') else ''}; {m['utc']}."
        + ("" if m.get("quiet", True) else f" **Not a quiet machine** ({m['not_quiet_because']}): "
           "these figures are not comparable with quiet runs.") + "\n"
    )


def e2e_markdown(res: dict[str, Any]) -> str:
    plan = res["plan"]
    lines = [
        f"# kvrelay loopback benchmark ({res['mode']})", "", machine_md(res["machine"]), "",
        f"Setup: {plan['engines']} loadgen engines (own processes), working set "
        f"{plan['working_set_chains']:,} chains × 8 blocks per engine, {plan['point_s']} s per "
        "load point; relay limits publish_every_n_events 16, publication_delay "
        f"{res.get('publication_delay', '1 ms')}, "
        f"publication_queue_capacity {res.get('queue_capacity', 16)} (relay defaults unless "
        "stated).", "",
    ]
    lines += [
        "## Latency vs offered load and subscribers",
        "",
        "delta = subscriber receive wall − relay `send_ts_us` (every DELTA of every stream); "
        "e2e = subscriber sees all 8 hashes of a probe chain in its replica − engine publish "
        "wall (`ts` in the ZMQ envelope).",
        "",
        "| offered ev/s | achieved ev/s | subs | delta p50 / p99 / p99.9 ms | e2e p50 / p99 / "
        "p99.9 ms | probes seen | lag errors | gaps/resets | relay CPU | relay µs/frame |",
        "|---:|---:|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for p in res["latency"]:
        d, e, c = p["delta_latency_ms"], p["e2e_latency_ms"], p["relay_counters"]
        lines.append(
            f"| {_f(int(p['offered_rate']))} | {_f(round(p['achieved_rate']))} | "
            f"{p['subscribers']} | {_f(d['p50'], 2)} / {_f(d['p99'], 2)} / {_f(d['p999'], 2)} | "
            f"{_f(e['p50'], 2)} / {_f(e['p99'], 2)} / {_f(e['p999'], 2)} | "
            f"{p['probes_seen']}/{p['probes_sent']} | {c['lag_errors']} | "
            f"{c['ingest_gaps']}/{c['member_resets']} | {_f(p['relay_cpu_util'], 2)} | "
            f"{_f(p['relay_cpu_us_per_frame'], 1) if not p['stream_error_count'] else '– (lag)'} |"
        )
    r = res["ingest_ramp"]
    lines += [
        "",
        "## Maximum sustained ingest (1 subscriber)",
        "",
        f"**{_f(r['max_sustained_block_events_per_s'])} block events/s** sustained with the "
        "strict criterion (no gap, reset, rejection or subscriber lag; all sent events ingested "
        "≤ 2 s after the end; ≥ 95% of offered achieved); "
        f"**{_f(r.get('max_ingest_block_events_per_s'))} block events/s** when subscriber lag "
        "is ignored (ingest side only).",
        "",
        "| offered | achieved | ingested / sent | drain s | lag errors | e2e p99 ms | relay CPU "
        "| strict | ingest only |",
        "|---:|---:|---:|---:|---:|---:|---:|:---:|:---:|",
    ]
    for p in r["points"]:
        lines.append(
            f"| {_f(int(p['offered_rate']))} | {_f(round(p['achieved_rate']))} | "
            f"{_f(p['ingested_block_events'])} / {_f(p['sent_block_events'])} | "
            f"{p['drain_s']} | {p['relay_counters']['lag_errors']} | "
            f"{_f(p['e2e_latency_ms']['p99'], 2)} | {_f(p['relay_cpu_util'], 2)} | "
            f"{'yes' if p['sustained'] else 'NO'} | {'yes' if p.get('ingest_kept_up') else 'NO'} |"
        )
    lines += snapshot_lines(res)
    m = res["memory"]
    lines += [
        "", "## Memory", "",
        f"- memberships tracked: {_f(m['memberships'])} ({m['engines']} engines, "
        f"{_f(m['distinct_canonical'])} distinct hashes, CKF load factor {m['ckf_load_factor']})",
        f"- exact state: {_f(m['exact_state_bytes'])} B = **{m['exact_state_bytes_per_membership']}"
        " B per membership** (lineage + owners; CKF table not included: "
        f"{_f(m['ckf_table_bytes'])} B)",
        f"- relay RSS: {m['relay_rss_empty_bytes'] / 2**20:.1f} MiB idle, "
        f"{m['relay_rss_warm_bytes'] / 2**20:.1f} MiB after warm-up "
        f"({_f(m['warm_memberships'])} memberships), "
        f"{m['relay_rss_filled_bytes'] / 2**20:.1f} MiB filled → "
        f"**{m['rss_delta_bytes_per_membership']} B RSS per added membership**",
        "", "## Fan-out cost", "",
        "| offered | subs | marginal relay CPU µs per extra delivered frame | valid (no lag, "
        "relay < 0.6 core) |",
        "|---:|---:|---:|:---:|",
    ]
    for f in res["fanout"]:
        lines.append(
            f"| {_f(int(f['offered_rate']))} | {f['subscribers']} | "
            f"{_f(f['marginal_cpu_us_per_frame'], 1)} | {'yes' if f['valid'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def e2e_plots(res: dict[str, Any], out_dir: Path, suffix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    subs = sorted({p["subscribers"] for p in res["latency"]})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in (
        (axes[0], "delta_latency_ms", "relay send → subscriber receive (per DELTA)"),
        (axes[1], "e2e_latency_ms", "engine publish → hash visible in subscriber replica"),
    ):
        for n in subs:
            pts = [p for p in res["latency"] if p["subscribers"] == n and p[key]["n"]]
            xs = [p["achieved_rate"] for p in pts]
            for q, style in (("p50", "-o"), ("p99", "--s"), ("p999", ":^")):
                ax.plot(xs, [p[key][q] for p in pts], style, label=f"{n} sub {q}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("achieved block events / s")
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"kvrelay latency vs load ({res['machine']['cores']} cores, {res['mode']})")
    fig.tight_layout()
    p = out_dir / f"latency_vs_load{suffix}.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(6, 4))
    pts = res["ingest_ramp"]["points"]
    ax.plot([p["offered_rate"] for p in pts], [p["achieved_rate"] for p in pts], "-o",
            label="generated")
    ax.plot([p["offered_rate"] for p in pts],
            [p["ingested_block_events"] / p["seconds"] for p in pts], "-s",
            label="ingested by relay (within window + drain)")
    for p in pts:
        if not p.get("ingest_kept_up"):
            ax.axvline(p["offered_rate"], color="red", alpha=0.3)
        elif not p["sustained"]:
            ax.axvline(p["offered_rate"], color="orange", alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot([p["offered_rate"] for p in pts], [p["relay_cpu_util"] for p in pts], ":^",
             color="gray", label="relay CPU (cores)")
    ax2.set_ylabel("relay CPU (cores)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered block events / s")
    ax.set_ylabel("block events / s")
    ax.set_title("ingest ramp (orange: subscriber lagged; red: ingest fell behind)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    p = out_dir / f"ingest_ramp{suffix}.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


def sbs_markdown(res: dict[str, Any]) -> str:
    lines = ["# kvrelay vs Dynamo reference relay (same event stream, same run)", ""]
    if res.get("skipped"):
        return "\n".join([*lines, f"Skipped: {res['reason']}", ""])
    lines += [machine_md(res["machine"]), "", res.get("setup", ""), ""]
    lines += [*_sbs_headline(res), ""]
    lines += _sbs_stages(res)
    lines += ["| metric | kvrelay | Dynamo 1.6.1 | kvrelay / Dynamo |", "|---|---:|---:|---:|"]
    for row in res["rows"]:
        nd = 3 if "CPU" in row["metric"] else 2
        lines.append(
            f"| {row['metric']} | {_f(row['kvrelay'], nd)} | {_f(row['dynamo'], nd)} | "
            f"{_f(row['ratio'], 2)} |"
        )
    return "\n".join(lines) + "\n"


def snapshot_lines(res: dict[str, Any]) -> list[str]:
    """Idle snapshot times, then the 64 MiB lane joined under load (when measured)."""
    lines = [
        "", "## Subscribe → snapshot complete (idle relay)", "",
        "Subscriber processes connect first, then all subscribe at once. Relay CPU = relay "
        "process CPU from that start until every snapshot is complete, per snapshot sent.", "",
        "| lane | buckets | concurrent streams | p50 ms | max ms | relay CPU ms / snapshot |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for s in res["snapshot"]:
        t = s["subscribe_to_complete_ms"]
        lines.append(
            f"| {s['table_bytes'] / 2**20:.0f} MiB | {_f(s['bucket_count'])} | "
            f"{s['concurrent_streams']} | {_f(t['p50'], 1)} | {_f(t['max'], 1)} | "
            f"{_f(s.get('relay_cpu_ms_per_snapshot'), 2)} |"
        )
    loaded = res.get("snapshot_under_load") or []
    if loaded:
        lines += [
            "", "## Snapshot while the pool publishes (one subscriber joins at a time)", "",
            "Each join: subscribe → last chunk while the loadgen offers the stated rate; a join "
            "that is ended (lagged) reports how many chunks it had received. Deltas after = "
            "those the joiner received after its snapshot, until it is stopped ~1 s later. The "
            "bystander subscribed before the joins and read at full speed throughout: the "
            "end-to-end latency of the probe chains (engine publish → all 8 hashes in its "
            "replica) published while a joiner was catching up, against the others, is what the "
            "joins cost the subscribers already there.", "",
            "| lane | offered ev/s | reader | completed | chunks per join | snapshot p50 / max ms "
            "| lag errors | deltas after (first join) | bystander e2e p50 / p99 ms while joining "
            "| otherwise |",
            "|---|---:|---|---:|---|---|---:|---:|---|---|",
        ]
        for r in loaded:
            t = r["snapshot_ms"]
            first = r["runs"][0] if r["runs"] else {}
            by = r.get("bystander", {})
            dj, do = by.get("e2e_while_joining_ms", {}), by.get("e2e_otherwise_ms", {})
            reader = f"{r['read_mbps_limit']:.0f} MB/s" if r["read_mbps_limit"] else "full speed"
            lines.append(
                f"| {r['table_bytes'] / 2**20:.0f} MiB | {_f(r['achieved_rate'])} | {reader} | "
                f"{r['completed']}/{r['joins']} | "
                + ", ".join(f"{x['chunks_received']}/{r['chunk_count']}" for x in r["runs"])
                + f" | {_f(t['p50'], 1)} / {_f(t['max'], 1)} | {r['lag_errors']} | "
                f"{_f(first.get('deltas_after'))} | {_f(dj.get('p50'), 1)} / "
                f"{_f(dj.get('p99'), 1)} | {_f(do.get('p50'), 1)} / {_f(do.get('p99'), 1)} |"
            )
    return lines


def snapshot_markdown(res: dict[str, Any]) -> str:
    """``benchmarks.snapshots``: the snapshot tables alone."""
    lines = ["# kvrelay snapshots (loopback)", "", machine_md(res["machine"])]
    return "\n".join([*lines, *snapshot_lines(res)]) + "\n"


def _sbs_stages(res: dict[str, Any]) -> list[str]:
    """kvrelay's thread CPU per call of each stage, from one extra point with the timers on."""
    st = res.get("stage_cpu") or {}
    stages = (st.get("timers") or {}).get("stages") or {}
    if not stages:
        return []
    names = {
        "message": "engine message (frame checks, decode, apply)",
        "decode": "decode (msgpack walk)", "apply": "apply (exact state + filter)",
        "cut": "publication cut (all of the publication below)",
        "take": "take the net-changed buckets", "publish": "check, encode, fan out",
        "send": "frame it for one stream (HTTP/2 buffer)",
        "write": "socket write of a connection's frames (end of the loop iteration)",
    }
    lines = [
        f"### Where kvrelay's CPU goes at {st['requests_per_s']:.0f} requests/s", "",
        "Thread CPU time per call of each stage, in the running relay, from one extra point "
        "after the sweeps with stage timers on (`benchmarks/_stages.py`; its relay CPU, "
        f"{_f(st.get('kvrelay_cpu_with_timers'), 3)} cores, counts in no figure above).", "",
        "| stage | calls | µs per call |", "|---|---:|---:|",
    ]
    for key, v in stages.items():
        lines.append(f"| {names.get(key, key)} | {_f(v['calls'])} | {_f(v['us_per_call'], 1)} |")
    return [*lines, ""]


def _sbs_headline(res: dict[str, Any]) -> list[str]:
    """The two light-load targets in one place: relay CPU and RSS, kvrelay / Dynamo, per rate
    (with several sweeps: the median and range over them)."""
    spread = res.get("light_load_spread") or {}
    sweeps = len(res.get("sweeps") or [])
    lines = ["## Light load: relay CPU and RSS, kvrelay / Dynamo", ""]
    for key, what, target in (("relay_cpu", "relay CPU", "1.0"), ("relay_rss", "relay RSS", "1.2")):
        vals = [(t, v[key]) for t, v in spread.items() if key in v]
        if not vals:
            return []
        meds = [v["median"] for _, v in vals]
        if sweeps > 1:
            detail = f"median of {sweeps} sweeps per rate, range in brackets: " + ", ".join(
                f"{t}: {v['median']:.2f}× ({v['min']:.2f}–{v['max']:.2f})" for t, v in vals)
        else:
            detail = ", ".join(f"{t}: {v['median']:.2f}×" for t, v in vals)
        lines.append(f"- **{what}: {_span(meds)}× Dynamo** ({detail}; "
                     f"target ≤ {target}×).")
    floor = [(t, v["floor_cpu_ratio"], v.get("above_floor_cpu")) for t, v in spread.items()
             if "floor_cpu_ratio" in v]
    if floor:
        lines.append(
            "- **ingest floor: " + _span([f["median"] for _, f, _ in floor]) + "× Dynamo's relay "
            "CPU; kvrelay above the floor: " + _span([a["median"] for _, _, a in floor if a])
            + "×** (" + ", ".join(f"{t}: {f['median']:.2f}× and {a['median']:.2f}×"
                                  for t, f, a in floor if a)
            + "; medians). The floor (`benchmarks/_ingest_floor.py`) reads the same engine "
            "messages as kvrelay, with the relay's own ZMTP reader on a uvloop loop as the relay "
            "does, and does nothing else: what the relay pays before its own work. kvrelay "
            "above the floor = (kvrelay CPU − floor CPU) / Dynamo's.")
    libzmq = [v["libzmq_floor_cpu_ratio"]["median"] for v in spread.values()
              if "libzmq_floor_cpu_ratio" in v]
    if libzmq:
        lines.append(
            f"- **The same messages read with pyzmq: {_span(libzmq)}× Dynamo's relay CPU** "
            "(a SUB socket read from a uvloop reader callback, libzmq's I/O thread included; "
            "medians per rate): the floor with `zmq_reader = \"libzmq\"`.")
    lines.append(
        "- CPU = process-tree CPU time (utime + stime, read in ns from each process's CPU clock) "
        "over the driver window / wall; RSS = process-tree "
        "VmRSS at the end of each rate." + (" The table below is the first sweep." if sweeps > 1
                                            else ""))
    return lines


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}" if values else "–"
