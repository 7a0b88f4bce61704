"""The measured scenarios: latency vs offered load and subscribers, ingest ramp, snapshot time,
memory per membership. Each returns plain dicts (written to JSON by ``run``)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from benchmarks._common import percentiles, proc_sample
from benchmarks._harness import (
    Fleet,
    FleetConfig,
    counters,
    load_point,
    start_subscribers,
    stop_subscribers,
)


@dataclass(frozen=True)
class Plan:
    mode: str
    engines: int
    working_set_chains: int
    loads: tuple[float, ...]
    subs: tuple[int, ...]
    point_s: float
    ramp: tuple[float, ...]
    ramp_s: float
    snapshot_repeats: int
    big_lane: bool = True  # the 64 MiB lane (a second relay) in the snapshot suite


#: ``--smoke``: every scenario once with tiny sizes (seconds); figures mean nothing.
SMOKE = Plan("smoke", 1, 256, (5_000,), (1, 2), 0.5, (10_000,), 0.5, 1, big_lane=False)
SHORT = Plan("short", 2, 8192, (20_000, 100_000), (1, 16), 3.0,
             (50_000, 150_000, 400_000), 3.0, 2)
FULL = Plan("full", 4, 16384, (10_000, 30_000, 100_000, 300_000, 1_000_000), (1, 16, 64), 8.0,
            (50_000, 100_000, 200_000, 400_000, 800_000, 1_600_000), 6.0, 5)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fill(fleet: Fleet, rate: float = 50_000) -> dict[str, Any]:
    """Store the whole working set (no subscribers) and report memory per membership.

    The rate stays well below the ingest limit: a backlog in the relay's ZMQ receive queue
    would raise the RSS high-water mark (never returned to the OS) and inflate the per-membership
    figure (150 K/s with 4 engines gave 413 B/membership, 50 K/s gives ~48 B)."""
    c = fleet.cfg
    blocks = c.engines * c.working_set_chains * c.chain_blocks
    assert fleet.relay is not None
    # warm-up: every kernel and buffer on the ingest path used once, so the RSS baseline below
    # excludes one-time costs (numba cache loads, allocator arenas)
    fleet.drive(20_000, 0.5, probe_hz=0)
    time.sleep(0.6)
    s0 = fleet.fresh_stats()["pools"][0]
    rss0 = proc_sample(fleet.relay.pid).rss_bytes
    fleet.drive(rate, blocks / rate * 1.1 + 0.5, probe_hz=0)
    deadline = time.monotonic() + 20
    s = fleet.fresh_stats()
    while time.monotonic() < deadline and s["pools"][0]["memberships"] < blocks:
        time.sleep(0.3)
        s = fleet.fresh_stats()
    p = s["pools"][0]
    rss = proc_sample(fleet.relay.pid).rss_bytes
    m = max(1, int(p["memberships"]))
    dm = max(1, int(p["memberships"]) - int(s0["memberships"]))
    return {
        "engines": c.engines,
        "memberships": p["memberships"],
        "distinct_canonical": p["distinct_canonical"],
        "exact_state_bytes": p["exact_state_bytes"],
        "exact_state_bytes_per_membership": round(p["exact_state_bytes"] / m, 2),
        "ckf_table_bytes": p["table_bytes"],
        "ckf_load_factor": round(p["occupancy"] / (4 * p["bucket_count"]), 4),
        "relay_rss_empty_bytes": fleet.rss_empty,
        "relay_rss_warm_bytes": rss0,
        "warm_memberships": s0["memberships"],
        "relay_rss_filled_bytes": rss,
        "rss_delta_bytes_per_membership": round((rss - rss0) / dm, 2),
    }


def latency_sweep(fleet: Fleet, plan: Plan) -> list[dict[str, Any]]:
    out = []
    for rate in plan.loads:
        for n in plan.subs:
            log(f"latency point: offered {rate:,.0f} block events/s, {n} subscriber(s)")
            r = load_point(fleet, rate, n, plan.point_s, f"lat-{int(rate)}-{n}")
            log(
                f"  achieved {r['achieved_rate']:,.0f}/s  delta p50/p99 "
                f"{r['delta_latency_ms']['p50']}/{r['delta_latency_ms']['p99']} ms  e2e p50/p99 "
                f"{r['e2e_latency_ms']['p50']}/{r['e2e_latency_ms']['p99']} ms  "
                f"lagged {r['relay_counters']['lag_errors']}  cpu {r['relay_cpu_util']}"
            )
            out.append(r)
    return out


def sustained(r: dict[str, Any]) -> bool:
    """No gap, reset, rejection or subscriber lag; everything sent ingested within 2 s of the
    end; at least 95% of the offered rate achieved by the generators."""
    c = r["relay_counters"]
    return bool(
        c["ingest_gaps"] == 0 and c["ingest_resets"] == 0 and c["member_resets"] == 0
        and c["lag_errors"] == 0 and c["events_rejected"] == 0 and r["stream_error_count"] == 0
        and r["loadgen_hwm_drops"] == 0
        and r["ingested_block_events"] >= r["sent_block_events"] and r["drain_s"] <= 2.0
        and r["achieved_rate"] >= 0.95 * r["offered_rate"]
    )


def ingest_only(r: dict[str, Any]) -> bool:
    """The ingest side alone kept up: no gap/reset/rejection, all sent events applied ≤ 2 s
    after the end (subscriber lag ignored)."""
    c = r["relay_counters"]
    return bool(
        c["ingest_gaps"] == 0 and c["ingest_resets"] == 0 and c["member_resets"] == 0
        and c["events_rejected"] == 0 and r["loadgen_hwm_drops"] == 0
        and r["ingested_block_events"] >= r["sent_block_events"] and r["drain_s"] <= 2.0
        and r["achieved_rate"] >= 0.95 * r["offered_rate"]
    )


def ingest_ramp(fleet: Fleet, plan: Plan) -> dict[str, Any]:
    """Offered load doubles until the ingest side fails; the strict maximum also needs zero
    subscriber lag."""
    points = []
    best = best_ingest = 0.0
    for rate in plan.ramp:
        log(f"ingest ramp: offered {rate:,.0f} block events/s (1 subscriber)")
        r = load_point(fleet, rate, 1, plan.ramp_s, f"ramp-{int(rate)}")
        r["sustained"] = ok = sustained(r)
        r["ingest_kept_up"] = ok_ingest = ingest_only(r)
        points.append(r)
        log(f"  achieved {r['achieved_rate']:,.0f}/s ingested {r['ingested_block_events']:,} of "
            f"{r['sent_block_events']:,} drain {r['drain_s']} s lag errors "
            f"{r['relay_counters']['lag_errors']}  sustained={ok} ingest_kept_up={ok_ingest}")
        if ok:
            best = max(best, r["achieved_rate"])
        if ok_ingest:
            best_ingest = max(best_ingest, r["achieved_rate"])
        else:
            break
    return {"max_sustained_block_events_per_s": round(best),
            "max_ingest_block_events_per_s": round(best_ingest), "points": points}


def snapshot_times(fleet: Fleet, repeats: int, streams: int = 1) -> dict[str, Any]:
    """Idle relay: subscribe → snapshot complete, ``repeats`` times with ``streams`` at once
    (the subscriber processes connect first, then all subscribe together)."""
    assert fleet.relay is not None
    relay_pid = fleet.relay.pid
    times: list[float] = []
    sizes = set()
    cpu_s = 0.0
    for k in range(repeats):
        start: list[float] = []

        def mark(start: list[float] = start) -> None:
            start.append(proc_sample(relay_pid).cpu_s)

        procs = start_subscribers(fleet, streams, f"snap-{fleet.cfg.tag}-{streams}-{k}",
                                  probe=False, barrier=True, before_go=mark)
        cpu_s += proc_sample(relay_pid).cpu_s - start[0]  # until every snapshot is complete
        res, _ = stop_subscribers(procs)
        for r in res:
            for st in r["streams"]:
                if st["snapshot_s"] is not None:
                    times.append(st["snapshot_s"])
                    sizes.add(st["snapshot_bytes"])
    p = fleet.stats()["pools"][0]
    return {
        "bucket_count": p["bucket_count"],
        "table_bytes": p["table_bytes"],
        "wire_bytes": sorted(sizes),
        "concurrent_streams": streams,
        "subscribe_to_complete_ms": percentiles(times, 1e3),
        # relay process CPU from the joint start to the last complete snapshot, per snapshot
        # (a sum over the repeats, then divided)
        "relay_cpu_ms_per_snapshot": round(cpu_s * 1e3 / max(1, len(times)), 2),
    }


def snapshot_under_load(fleet: Fleet, rate: float, repeats: int, *,
                        read_mbps: float = 0.0) -> dict[str, Any]:
    """One subscriber at a time joins while the fleet offers ``rate`` block events/s: does its
    snapshot complete (or is it ended as lagged, and after how many chunks), how long it takes,
    and what the deltas that follow look like. ``read_mbps`` > 0 throttles the reader.

    A *bystander*, subscribed and caught up before the joins, shows what they cost the
    subscribers already there: the end-to-end latency of the probe chains (engine publish → all
    8 hashes in its replica) published while a joiner was catching up (its request until 0.3 s
    after its snapshot completed) against those published outside these windows. The publication
    spacing a joiner causes shows there, not in the delta latency (stamped at publication)."""
    assert fleet.relay is not None
    bystander = start_subscribers(fleet, 1, f"bystander-{fleet.cfg.tag}-{int(read_mbps)}")
    chunk_wire = 4_194_368 + 150  # one full chunk on the wire: CBI1 frame + FilterUpdate envelope
    per = rate / len(fleet.loadgens)
    s = max(1, round(per / (2 * fleet.cfg.chain_blocks) / 2000))
    seconds = 1.0 + repeats * 3.0
    before = counters(fleet.fresh_stats())
    for i, lg in enumerate(fleet.loadgens):
        lg.send(f"run {per} {seconds} {s} {fleet.cfg.probe_hz if i == 0 else 0}")
    t_end = time.monotonic() + seconds
    time.sleep(0.8)  # steady state before the first join
    runs = []
    windows: list[tuple[float, float]] = []  # wall time a joiner was catching up
    for k in range(repeats):
        if time.monotonic() > t_end - 1.5:
            break
        tag = f"snapload-{fleet.cfg.tag}-{int(read_mbps)}-{k}"
        procs = start_subscribers(fleet, 1, tag, probe=False, read_mbps=read_mbps)
        time.sleep(max(0.0, min(1.0, t_end - time.monotonic() - 0.3)))
        res, lat = stop_subscribers(procs)
        st = res[0]["streams"][0]
        windows.append((st["t_request"], st["t_request"] + (st["snapshot_s"] or 1.0) + 0.3))
        runs.append({
            "completed": st["snapshot_s"] is not None,
            "snapshot_ms": None if st["snapshot_s"] is None else round(st["snapshot_s"] * 1e3, 1),
            "chunks_received": round(st["snapshot_bytes"] / chunk_wire),  # whole chunks only
            "snapshot_bytes": st["snapshot_bytes"],
            "deltas_after": st["deltas"],
            "seq_errors": st["seq_errors"],
            "error": None if (st["error"] or "").startswith("EOF") else st["error"],
            "delta_latency_ms": percentiles(lat, 1e-3),
        })
    sent = [json.loads(lg.expect("{", seconds + 60)) for lg in fleet.loadgens]
    fleet.next_probe = int(sent[0]["next_probe"])
    by_res, by_lat = stop_subscribers(bystander)
    by = by_res[0]["streams"][0]
    found = {int(i): int(t) for i, t in by_res[0].get("probe_found", [])}
    during, outside = [], []
    for i, t_us in sent[0]["probes"]:
        if int(i) in found:
            e2e = found[int(i)] - int(t_us)
            t = int(t_us) / 1e6
            (during if any(a <= t <= b for a, b in windows) else outside).append(e2e)
    after = counters(fleet.fresh_stats())
    p = fleet.stats()["pools"][0]
    done = [r for r in runs if r["completed"] and not r["error"]]
    chunks = -(-int(p["bucket_count"]) // 524_288)
    return {
        "bucket_count": p["bucket_count"],
        "table_bytes": p["table_bytes"],
        "chunk_count": chunks,
        "offered_rate": rate,
        "achieved_rate": round(sum(float(x["achieved_rate"]) for x in sent)),
        "read_mbps_limit": read_mbps or None,
        "runs": runs,
        "completed": len(done),
        "joins": len(runs),
        "lag_errors": after["lag_errors"] - before["lag_errors"],
        "publications": after["sequence"] - before["sequence"],
        "ingest_gaps": after["ingest_gaps"] - before["ingest_gaps"],
        "snapshot_ms": percentiles([r["snapshot_ms"] for r in done]),
        "bystander": {
            "deltas": by["deltas"],
            "seq_errors": by["seq_errors"],
            "error": None if (by["error"] or "").startswith("EOF") else by["error"],
            "delta_latency_ms": percentiles(by_lat, 1e-3),
            "probes_sent": len(sent[0]["probes"]),
            "e2e_while_joining_ms": percentiles(during, 1e-3),
            "e2e_otherwise_ms": percentiles(outside, 1e-3),
        },
    }


def big_lane_fleet(workers: int = 1, mirror: bool = False) -> Fleet:
    """A separate relay with a 64 MiB lane (``expected_blocks`` 16,777,216) and one engine;
    ``workers`` ≥ 2: served through its N−1 fan-out workers (mirrors of it); ``mirror``:
    through a ``kvrelay mirror`` process over loopback TCP."""
    return Fleet(FleetConfig(engines=1, base_port=27190, working_set_chains=4096, probes=4000,
                             expected_blocks=16_777_216, tag="snap64", workers=workers,
                             mirror=mirror))  # fmt: skip


def snapshot_load_suite(big: Fleet, rate: float, repeats: int) -> list[dict[str, Any]]:
    """The 64 MiB lane joined while the pool publishes ``rate``: full speed, then 80 MB/s."""
    out = []
    for mbps in (0.0, 80.0):
        log(f"snapshot under load: 64 MiB lane, {rate:,.0f} block events/s, reader "
            + (f"{mbps:.0f} MB/s" if mbps else "at full speed"))
        r = snapshot_under_load(big, rate, repeats, read_mbps=mbps)
        log(f"  {r['completed']}/{r['joins']} completed, p50 {r['snapshot_ms']['p50']} ms, "
            f"lag errors {r['lag_errors']}, chunks "
            + ", ".join(f"{x['chunks_received']}/{r['chunk_count']}" for x in r["runs"]))
        out.append(r)
    return out


def snapshot_suite(main: Fleet, plan: Plan) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Idle snapshot times (4 and 64 MiB lanes), then the 64 MiB lane under 100 K events/s."""
    log("snapshot: 4 MiB lane (524,288 buckets)")
    out = [snapshot_times(main, plan.snapshot_repeats, 1),
           snapshot_times(main, plan.snapshot_repeats, 8)]
    if not plan.big_lane:
        return out, []
    log("snapshot: 64 MiB lane (8,388,608 buckets; separate relay, expected_blocks 16,777,216)")
    big = big_lane_fleet()
    try:
        big.start()
        fill(big)
        out.append(snapshot_times(big, plan.snapshot_repeats, 1))
        out.append(snapshot_times(big, max(1, plan.snapshot_repeats // 2), 4))
        assert big.relay is not None
        out[-1]["relay_rss_bytes"] = proc_sample(big.relay.pid).rss_bytes
        for s in out:
            log(f"  {s['table_bytes'] / 2**20:.0f} MiB x{s['concurrent_streams']}: "
                f"p50 {s['subscribe_to_complete_ms']['p50']} ms max "
                f"{s['subscribe_to_complete_ms']['max']} ms")
        # joins per reader: 1 in the short run (it must stay under 2 minutes), 2 in the full one
        loaded = snapshot_load_suite(big, 100_000, max(1, plan.snapshot_repeats // 2))
    finally:
        big.stop()
    return out, loaded


def fanout_cost(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Marginal relay CPU per extra delivered frame: same offered load, N vs 1 subscriber."""
    out = []
    by = {(p["offered_rate"], p["subscribers"]): p for p in points}
    for (rate, n), p in sorted(by.items()):
        base = by.get((rate, 1))
        if n == 1 or base is None:
            continue
        extra_frames = p["frames_received"] - base["frames_received"]
        cpu_rate = p["relay_cpu_s"] / p["seconds"] - base["relay_cpu_s"] / base["seconds"]
        frames_rate = (
            p["frames_received"] / p["seconds"] - base["frames_received"] / base["seconds"]
        )
        out.append({
            "offered_rate": rate,
            "subscribers": n,
            "extra_frames": extra_frames,
            # only meaningful while the relay is far from one core: a busy relay coalesces more
            # events per delta, so the per-frame base cost changes between the two points
            "valid": p["stream_error_count"] == 0 and base["stream_error_count"] == 0
            and frames_rate > 0 and max(p["relay_cpu_util"], base["relay_cpu_util"]) < 0.6,
            "marginal_cpu_us_per_frame": round(cpu_rate / frames_rate * 1e6, 2)
            if frames_rate > 0 else None,
        })
    return out
