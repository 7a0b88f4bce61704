"""Heavy-load side by side: kvrelay and Dynamo's relay fed the same paced vLLM ZMQ stream.

Per side, a *stack* lives in the private network namespace: one ``_loadgen`` engine (int block
hashes, every chain stored with ``parent_block_hash = None``, so the lineage is always well formed)
and the relay; for Dynamo also the bridge (``_dynamo_bridge``: Dynamo's worker-side
``KvEventPublisher`` reading the loadgen's ZMQ and republishing on Dynamo's event plane).
kvrelay reads the loadgen directly as a static source.

Sequential (default): each side has its own loadgen with the same seed and receives the same
command sequence, so both relays see byte-identical event streams (only the envelope ``ts``
differs); at each load point one side runs while the other idles, alternating which goes first.
Each relay gets the machine. ``--concurrent``: one loadgen, both relays subscribed to it, both
measured at once (the literal "one stream"; both stacks and both subscriber sets share 2 cores).

Each point is measured from the outside only, with the same subscriber code for both relays:
delta latency, e2e probe latency, stream ends (lag terminations), sequence gaps, probes seen, and
the final-state check (the replica holds every block the engine still holds ≤ 2 s after the end
of sending). Relay, bridge, loadgen and subscriber CPU and RSS come from ``/proc``. A side whose
point did not pass the check is restarted (fresh stack, refilled working set) so the next point
starts from a state that side can vouch for; the ingest ramp starts from fresh stacks.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import (
    CLK_TCK,
    PY,
    ROOT,
    WORK,
    ProcSample,
    percentiles,
    tree_sample,
)
from benchmarks._dynamo_env import DPY, dyn_env, log
from benchmarks._harness import Proc

CHAIN_BLOCKS = 8
PROBE_HZ = 100.0
CHECK_DEADLINE_S = 2.0
STATE_DEADLINE_S = 5.0  # ingest-only diagnostic: a fresh subscriber started after the end
PER_PROC = 32  # subscriber streams per process (stream 0, the probe stream, has its own)
LAG_MARKERS = ("LAGGED", "RESOURCE_EXHAUSTED")
WARN_RE = re.compile(r"\b(WARN|ERROR)\b")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class HeavyPlan:
    rates: tuple[float, ...]
    subs: tuple[int, ...]
    point_s: float
    ramp: tuple[float, ...]
    ramp_s: float
    working_set_chains: int = 16384
    concurrent: bool = False

    def probes(self) -> int:
        """Probe chains one loadgen needs for the whole run (never reused)."""
        s = len(self.rates) * len(self.subs) * self.point_s + len(self.ramp) * self.ramp_s
        return int(s * PROBE_HZ * 1.3) + 1000


FULL = HeavyPlan((10_000, 30_000, 100_000, 300_000, 1_000_000), (1, 16, 64), 8.0,
                 (100_000, 200_000, 300_000, 400_000, 600_000, 800_000, 1_200_000, 1_600_000,
                  2_000_000, 2_400_000, 3_200_000), 6.0)
SHORT = HeavyPlan((10_000, 100_000), (1, 16), 3.0, (200_000, 800_000), 3.0, 8192)
#: ``--smoke``: every code path once (both stacks, a point, a ramp point), seconds; no figures.
SMOKE = HeavyPlan((5_000,), (1,), 1.0, (10_000,), 1.0, 256)


@dataclass
class Side:
    """One relay under test and the processes that feed it."""

    name: str  # "kvrelay" | "dynamo"
    port: int
    relay: Proc
    loadgen: Proc
    probe_file: Path
    state_file: Path
    bridge: Proc | None = None
    next_probe: int = 0
    incarnation: int = 0
    log_offsets: dict[str, int] = field(default_factory=dict)

    def log_procs(self) -> dict[str, Proc]:
        out = {"relay": self.relay}
        if self.bridge is not None:
            out["bridge"] = self.bridge
        return out


class Bench:
    """Starts and restarts the stacks, runs load points, keeps every process it started."""

    def __init__(self, ns: str, plan: HeavyPlan, model_dir: Path) -> None:
        self.ns = ns
        self.nsx = ["ip", "netns", "exec", ns]
        self.plan = plan
        self.model_dir = model_dir
        self.sides: dict[str, Side] = {}
        self.shared_lg: Proc | None = None
        self.generation = 0
        self.restarts: dict[str, int] = {"kvrelay": 0, "dynamo": 0}
        self.fill_misses: list[dict[str, Any]] = []

    # ---- stacks ----------------------------------------------------------------------------

    def _loadgen(self, tag: str, port: int, subscribers: int) -> tuple[Proc, Path, Path]:
        probe_file = WORK / f"heavy-probes-{tag}.json"
        state_file = WORK / f"heavy-state-{tag}.npz"
        state_file.unlink(missing_ok=True)
        lg = Proc(f"heavy-loadgen-{tag}", [
            PY, "-m", "benchmarks._loadgen", "--port", str(port), "--host", "127.0.0.1",
            "--seed", "4242", "--working-set-chains", str(self.plan.working_set_chains),
            "--chain-blocks", str(CHAIN_BLOCKS), "--probes", str(self.plan.probes()),
            "--probe-hz", str(PROBE_HZ), "--probe-file", str(probe_file),
            "--state-file", str(state_file), "--subscribers", str(subscribers)],
            stdin=True, prefix=self.nsx)
        lg.expect("BOUND", 60)
        return lg, probe_file, state_file

    def _kvrelay(self, lg_port: int, tag: str) -> Proc:
        relay = Proc(f"heavy-kvrelay-{tag}", [
            PY, "-m", "benchmarks._relay_proc", "--engine", f"engine-0=tcp://127.0.0.1:{lg_port}",
            "--port", "5562", "--stats", str(WORK / f"heavy-kvrelay-stats-{tag}.json"),
            "--stats-interval", "0"],
            prefix=self.nsx)
        relay.expect("READY", 120)
        return relay

    def _dynamo(self, lg_port: int, tag: str) -> tuple[Proc, Proc]:
        kv_dir = WORK / f"heavy-dynkv-{tag}"
        shutil.rmtree(kv_dir, ignore_errors=True)
        kv_dir.mkdir(parents=True)
        env = dyn_env(kv_dir)
        relay = Proc(f"heavy-dynamo-{tag}", [
            DPY, "-m", "dynamo.kv_dc_relay", "--dc-id", "dc-bench", "--watch-all", "--bind",
            "127.0.0.1:5561"], prefix=self.nsx, env=env | {"DYN_NAMESPACE": "relayns"})
        bridge = Proc(f"heavy-bridge-{tag}", [
            DPY, str(ROOT / "benchmarks" / "_dynamo_bridge.py"), "--zmq",
            f"tcp://127.0.0.1:{lg_port}", "--model-path", str(self.model_dir)],
            prefix=self.nsx, env=env)
        bridge.expect("READY", 120)
        return relay, bridge

    def start(self, which: tuple[str, ...] = ("kvrelay", "dynamo")) -> None:
        """(Re)start the named sides' stacks and fill their working sets."""
        self.generation += 1
        g = self.generation
        for name in which:
            old = self.sides.pop(name, None)
            if old is not None:
                self._stop_side(old)
        if self.plan.concurrent:
            assert set(which) == {"kvrelay", "dynamo"}, "concurrent mode restarts both"
            lg, pf, sf = self._loadgen(f"shared-{g}", 28100, 2)
            self.shared_lg = lg
            kv = self._kvrelay(28100, str(g))
            dy, br = self._dynamo(28100, str(g))
            lg.expect("READY", 60)
            self.sides["kvrelay"] = Side("kvrelay", 5562, kv, lg, pf, sf, incarnation=g)
            self.sides["dynamo"] = Side("dynamo", 5561, dy, lg, pf, sf, bridge=br, incarnation=g)
        else:
            for name in which:
                port = 28100 if name == "kvrelay" else 28101
                lg, pf, sf = self._loadgen(f"{name}-{g}", port, 1)
                if name == "kvrelay":
                    side = Side(name, 5562, self._kvrelay(port, str(g)), lg, pf, sf,
                                incarnation=g)
                else:
                    dy, br = self._dynamo(port, str(g))
                    side = Side(name, 5561, dy, lg, pf, sf, bridge=br, incarnation=g)
                lg.expect("READY", 60)
                self.sides[name] = side
        self.fill(which)

    def fill(self, which: tuple[str, ...]) -> None:
        """Store the whole working set at a moderate rate and check it arrived (1 subscriber):
        this also waits for Dynamo to materialize the pool and warms every code path. A side
        whose replica is not complete in time gets up to two short top-ups at 20K block
        events/s, each checked by a fresh subscriber (snapshot + deltas)."""
        blocks = self.plan.working_set_chains * CHAIN_BLOCKS
        rate = 50_000.0
        seconds = blocks / rate * 1.15 + 0.5
        groups = [tuple(which)] if self.plan.concurrent else [(n,) for n in which]
        for names in groups:
            todo = list(names)
            for attempt in range(3):
                r = self.point([self.sides[n] for n in todo], rate if attempt == 0 else 20_000.0,
                               1, seconds if attempt == 0 else 1.0,
                               f"fill-{self.generation}-{attempt}", probe_hz=0)
                for n in list(todo):
                    c = r["relays"][n]["check"]
                    if c["complete_after_end_s"] is not None:
                        todo.remove(n)
                        log(f"  {n}: working set of {blocks:,} blocks stored and verified"
                            + (f" (after {attempt} top-up(s))" if attempt else ""))
                    else:
                        log(f"  {n}: replica still missing {c.get('missing_hashes')} of "
                            f"{c.get('present_hashes')} held hashes after the fill "
                            f"(attempt {attempt + 1})")
                        self.fill_misses.append({"side": n, "generation": self.generation,
                                                 "attempt": attempt, "check": c,
                                                 "deltas": r["relays"][n]["deltas"]})
                if not todo:
                    break
            if todo:
                raise RuntimeError(f"{', '.join(todo)}: working set never verified")

    def _stop_side(self, side: Side) -> None:
        for p in (side.bridge, side.relay):
            if p is not None:
                p.stop()
        if side.loadgen.p.poll() is None:
            with contextlib.suppress(OSError):
                side.loadgen.send("quit")
        side.loadgen.stop()

    def stop(self) -> None:
        seen: set[int] = set()
        for side in self.sides.values():
            if side.loadgen.pid in seen:
                for p in (side.bridge, side.relay):
                    if p is not None:
                        p.stop()
                continue
            seen.add(side.loadgen.pid)
            self._stop_side(side)
        self.sides.clear()

    # ---- one load point --------------------------------------------------------------------

    def _subscribers(self, side: Side, n: int, tag: str) -> list[tuple[Proc, str]]:
        procs: list[tuple[Proc, str]] = []
        groups = [1] + [min(PER_PROC, n - 1 - k) for k in range(0, n - 1, PER_PROC)]
        for j, streams in enumerate(groups):
            out = str(WORK / f"heavy-sub-{side.name}-{tag}-{j}.json")
            Path(out).unlink(missing_ok=True)
            argv = [PY, "-m", "benchmarks._subscriber", "--port", str(side.port), "--streams",
                    str(streams), "--id", f"heavy-{side.name}-{tag}-{j}", "--out", out,
                    "--channels", str(max(1, streams // 8)), "--timeout", "120"]
            if j == 0:
                argv += ["--probe-file", str(side.probe_file), "--probe-start",
                         str(side.next_probe), "--check-file", str(side.state_file)]
            procs.append((Proc(f"heavy-sub-{side.name}-{tag}-{j}", argv, prefix=self.nsx),
                          out))
        return procs

    def point(self, sides: list[Side], rate: float, n_subs: int, seconds: float, tag: str,
              probe_hz: float = PROBE_HZ) -> dict[str, Any]:
        """Drive one load point against ``sides`` (one, or both on one loadgen)."""
        subs = {s.name: self._subscribers(s, n_subs, tag) for s in sides}
        for procs in subs.values():
            for p, _ in procs:
                p.expect("SNAPSHOTS_DONE", 180)
        time.sleep(0.3)
        for s in sides:
            s.log_offsets = {k: _size(p.log_path) for k, p in s.log_procs().items()}
        lg = sides[0].loadgen
        c0 = {s.name: self._sample(s, subs[s.name]) for s in sides}
        per_batch = max(1, round(rate / (2 * CHAIN_BLOCKS) / 2000))
        lg.send(f"run {rate} {seconds} {per_batch} {probe_hz}")
        sent = json.loads(lg.expect("{", seconds + 120))
        c1 = {s.name: self._sample(s, subs[s.name]) for s in sides}
        for procs in subs.values():
            procs[0][0].p.send_signal(signal.SIGUSR1)
        end_s = sent["end_wall_us"] / 1e6
        deadline = end_s + CHECK_DEADLINE_S + 0.3
        pending = {s.name for s in sides}
        while pending and time.time() < deadline:  # the check must pass ≤ 2 s after the end
            time.sleep(0.05)
            for name in list(pending):
                r = _check_line(subs[name][0][0])
                if r:
                    pending.discard(name)
        time.sleep(0.3)  # the last deltas of the point
        rss = {s.name: tree_sample(s.relay.pid) for s in sides}
        out: dict[str, Any] = {
            "offered_rate": rate, "subscribers": n_subs, "seconds": seconds,
            "achieved_rate": round(float(sent["achieved_rate"])),
            "sent_block_events": int(sent["block_events"]),
            "loadgen_hwm_drops": int(sent["hwm_drops"]),
            "loadgen_fell_behind": int(sent["fell_behind"]),
            "probes_sent": len(sent["probes"]),
            "relays": {},
        }
        out["generator_limited"] = bool(
            out["achieved_rate"] < 0.95 * rate or out["loadgen_hwm_drops"] > 0)
        for s in sides:
            s.next_probe = int(sent["next_probe"])
            r = self._collect(s, subs[s.name], sent, c0[s.name], c1[s.name], rss[s.name])
            r.update({k: v for k, v in out.items() if k != "relays"})  # this side's stream
            r["sustained"] = sustained(r)
            r["failures"] = failure_reasons(r)
            if r["check"]["complete_after_end_s"] is not None and r["check"][
                    "complete_after_end_s"] <= CHECK_DEADLINE_S:
                r["state_check"] = None  # the probe stream's replica already proved it
                r["ingest_kept_up"] = not r["generator_limited"]
            else:
                r["state_check"] = self.verify_state(s, sent["end_wall_us"], tag)
                done = r["state_check"]["complete_after_end_s"]
                r["ingest_kept_up"] = bool(not r["generator_limited"] and done is not None
                                           and done <= STATE_DEADLINE_S)
            out["relays"][s.name] = r
        return out

    def verify_state(self, side: Side, end_wall_us: int, tag: str) -> dict[str, Any]:
        """Ingest-only view, for points whose probe stream failed: a fresh subscriber (new
        snapshot + deltas) must find the engine's whole working set ≤ 5 s after the end."""
        out = WORK / f"heavy-verify-{side.name}-{tag}.json"
        out.unlink(missing_ok=True)
        p = Proc(f"heavy-verify-{side.name}-{tag}", [
            PY, "-m", "benchmarks._subscriber", "--port", str(side.port), "--streams", "1",
            "--id", f"heavy-verify-{side.name}-{tag}", "--out", str(out), "--timeout", "30",
            "--probe-file", str(side.probe_file), "--probe-start", str(side.next_probe),
            "--check-file", str(side.state_file)], prefix=self.nsx)
        deadline = end_wall_us / 1e6 + STATE_DEADLINE_S + 0.3
        try:
            p.expect("SNAPSHOTS_DONE", max(1.0, deadline - time.time()))
            p.p.send_signal(signal.SIGUSR1)
            while time.time() < deadline and not _check_line(p):
                time.sleep(0.05)
        except (TimeoutError, RuntimeError):
            pass
        p.stop(30)
        try:
            r = json.loads(out.read_text())
        except (OSError, ValueError):
            return {"complete_after_end_s": None, "missing_hashes": None,
                    "error": "no snapshot in time"}
        c = dict(r.get("check") or {})
        done = c.get("complete_us")
        c["complete_after_end_s"] = round((done - end_wall_us) / 1e6, 3) if done else None
        c["stream_error"] = r["streams"][0]["error"]
        return c

    def _sample(self, side: Side, subs: list[tuple[Proc, str]]) -> dict[str, ProcSample]:
        out = {"relay": tree_sample(side.relay.pid), "loadgen": tree_sample(side.loadgen.pid)}
        if side.bridge is not None:
            out["bridge"] = tree_sample(side.bridge.pid)
        s = [tree_sample(p.pid) for p, _ in subs]
        out["subscribers"] = ProcSample(s[0].wall, sum(x.cpu_s for x in s),
                                        sum(x.rss_bytes for x in s), 0)
        out["machine"] = ProcSample(time.time(), machine_busy_s(), 0, 0)
        return out

    def _collect(self, side: Side, subs: list[tuple[Proc, str]], sent: dict[str, Any],
                 c0: dict[str, ProcSample], c1: dict[str, ProcSample],
                 rss: ProcSample) -> dict[str, Any]:
        results, lats = [], []
        for p, path in subs:
            p.stop(30)
            results.append(json.loads(Path(path).read_text()))
            lats.append(np.load(path + ".lat.npy"))
        lat = np.concatenate(lats) if lats else np.zeros(0, dtype=np.int64)
        streams = [st for r in results for st in r["streams"]]
        ended = [st for st in streams if st["error"] and not st["error"].startswith("EOF")]
        lagged = [st for st in ended if _is_lag(st)]
        probes = {int(i): int(t) for i, t in sent["probes"]}
        found = {int(i): int(t) for i, t in results[0].get("probe_found", [])}
        e2e = [found[i] - t for i, t in probes.items() if i in found]
        # where the probes never seen were published, in ms before the loadgen's end: a probe
        # lost to the check lies at the end, a probe lost by the relay anywhere
        missed = sorted(round((sent["end_wall_us"] - t) / 1e3, 1)
                        for i, t in probes.items() if i not in found)
        chk = dict(results[0].get("check") or {})
        done = chk.get("complete_us")
        chk["complete_after_end_s"] = (
            round((done - sent["end_wall_us"]) / 1e6, 3) if done is not None else None)
        window = c1["relay"].wall - c0["relay"].wall

        def util(k: str) -> float | None:
            if k not in c0:
                return None
            return round((c1[k].cpu_s - c0[k].cpu_s) / window, 3) if window > 0 else None

        ours = sum(util(k) or 0.0 for k in ("relay", "bridge", "loadgen", "subscribers"))
        busy = util("machine")
        warnings = {k: _warnings(p.log_path, side.log_offsets.get(k, 0))
                    for k, p in side.log_procs().items()}
        return {
            "delta_latency_ms": percentiles(lat, 1e-3),
            "e2e_latency_ms": percentiles(e2e, 1e-3),
            "probes_seen": len(e2e),
            "probes_missed_ms_before_end": missed[:20],
            "deltas": sum(st["deltas"] for st in streams),
            "heartbeats": sum(st["heartbeats"] for st in streams),
            "lag_terminations": len(lagged),
            "other_stream_ends": len(ended) - len(lagged),
            "stream_end_samples": sorted({f"{st['error']} [{st.get('reason')}]"
                                          for st in ended})[:4],
            "seq_gaps": sum(st["seq_errors"] for st in streams),
            "deltas_per_stream_s": round(
                sum(st["deltas"] for st in streams) / len(streams) / window, 1) if window else None,
            "late_snapshot_chunks": sum(st.get("late_snapshot_chunks", 0) for st in streams),
            "check": chk,
            "relay_cpu_util": util("relay"),
            "bridge_cpu_util": util("bridge"),
            "loadgen_cpu_util": util("loadgen"),
            "subscriber_cpu_util": util("subscribers"),
            # whole-machine busy cores during the send window, and what this point's processes
            # do not explain (the idle relay, the orchestrator, other people's jobs)
            "machine_cpu_util": busy,
            "other_cpu_util": round(busy - ours, 3) if busy is not None else None,
            "relay_rss_bytes": rss.rss_bytes,
            "relay_rss_peak_bytes": rss.rss_peak_bytes,
            "bridge_rss_bytes": c1["bridge"].rss_bytes if "bridge" in c1 else None,
            "log_warnings": warnings,
            "incarnation": side.incarnation,
        }


def sustained(r: dict[str, Any]) -> bool:
    """The strict criterion, from the outside, identical for both relays (benchmarks/README)."""
    c = r["check"]
    return bool(
        not r["generator_limited"]
        and r["lag_terminations"] == 0 and r["other_stream_ends"] == 0
        and r["seq_gaps"] == 0 and r["late_snapshot_chunks"] == 0
        and r["probes_seen"] == r["probes_sent"]
        and c.get("complete_after_end_s") is not None
        and c["complete_after_end_s"] <= CHECK_DEADLINE_S
    )


def failure_reasons(r: dict[str, Any]) -> list[str]:
    """Why a point is not sustained, in words for the report."""
    out = []
    if r["generator_limited"]:
        out.append(f"generator limit (achieved {r['achieved_rate']:,}, HWM drops "
                   f"{r['loadgen_hwm_drops']})")
    if r["lag_terminations"]:
        out.append(f"{r['lag_terminations']} lag termination(s)")
    if r["other_stream_ends"]:
        out.append(f"{r['other_stream_ends']} other stream end(s)")
    if r["seq_gaps"] or r["late_snapshot_chunks"]:
        out.append(f"{r['seq_gaps']} sequence gap(s), {r['late_snapshot_chunks']} late "
                   "snapshot chunk(s)")
    if r["probes_seen"] != r["probes_sent"]:
        out.append(f"probes {r['probes_seen']}/{r['probes_sent']}")
    c = r["check"]
    if c.get("complete_after_end_s") is None:
        out.append(f"replica incomplete: {c.get('missing_hashes')} of "
                   f"{c.get('present_hashes')} held hashes missing at the end")
    elif c["complete_after_end_s"] > CHECK_DEADLINE_S:
        out.append(f"replica complete only {c['complete_after_end_s']} s after the end")
    return out


def machine_busy_s() -> float:
    """CPU seconds all processes ran since boot (/proc/stat user + nice + system + steal).
    irq and softirq are left out: loopback TCP is processed there and charged to no process,
    so counting it would make this point's own traffic look like somebody else's load."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[7]) / CLK_TCK  # user nice system idle iowait irq softirq steal


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _check_line(p: Proc) -> bool:
    """True once the probe subscriber printed CHECK_COMPLETE (non-blocking)."""
    try:
        line = p.readline(0.001)
    except TimeoutError:
        return False
    return line.startswith("CHECK_COMPLETE")


def _is_lag(st: dict[str, Any]) -> bool:
    text = f"{st.get('status')} {st.get('reason')} {st.get('error')}"
    return any(m in text for m in LAG_MARKERS)


def _warnings(path: Path, offset: int) -> dict[str, Any]:
    """WARN/ERROR lines a process logged during the point: count and a few distinct texts."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read(8 << 20).decode("utf-8", "replace")
    except OSError:
        return {"count": 0, "samples": []}
    lines = [ANSI_RE.sub("", ln) for ln in text.splitlines() if WARN_RE.search(ln)]
    samples: dict[str, None] = {}
    for ln in lines:
        msg = re.sub(r"^\S+\s+", "", ln)[:160]  # drop the timestamp
        samples.setdefault(msg, None)
        if len(samples) >= 3:
            break
    return {"count": len(lines), "samples": list(samples)}
