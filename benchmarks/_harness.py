"""Process orchestration for the loopback benchmarks: a relay process, loadgen processes (one
engine each) and subscriber processes, plus the measurements taken around each load point."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from benchmarks._common import (
    PY,
    ROOT,
    WORK,
    percentiles,
    proc_sample,
    process_cpu_s,
    tree_sample,
)
from benchmarks._load import tree_pids


class Proc:
    """A child process with line-oriented stdout, stderr captured to a log file."""

    def __init__(self, name: str, argv: list[str], *, stdin: bool = False,
                 prefix: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        WORK.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.log_path = WORK / f"{name}.log"
        self._log: IO[bytes] = open(self.log_path, "wb")  # noqa: SIM115
        full_env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **(env or {}))
        self.p = subprocess.Popen(
            [*(prefix or []), *argv], cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
            stderr=self._log, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        )
        self._buf = b""

    @property
    def pid(self) -> int:
        return self.p.pid

    def readline(self, timeout: float) -> str:
        assert self.p.stdout is not None
        fd = self.p.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{self.name}: no output in {timeout:.0f}s (see {self.log_path})"
                )
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(
                        f"{self.name} exited ({self.p.poll()}); see {self.log_path}:\n"
                        + self.log_path.read_text()[-2000:]
                    )
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    def expect(self, prefix: str, timeout: float) -> str:
        while True:
            line = self.readline(timeout)
            if line.startswith(prefix):
                return line

    def send(self, line: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write((line + "\n").encode())
        self.p.stdin.flush()

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self._log.close()
        return self.p.returncode


def engine_host(i: int) -> str:
    """Each loadgen engine on its own loopback address: the relay keys static engines by host."""
    return f"127.0.0.{i + 1}"


@dataclass
class FleetConfig:
    engines: int = 1
    base_port: int = 27100
    working_set_chains: int = 8192
    chain_blocks: int = 8
    probes: int = 6000
    probe_hz: float = 100.0
    expected_blocks: int = 1_048_576
    uvloop: bool = False
    zmq_reader: str = "zmtp"  # relay.zmq_reader
    queue_capacity: int = 16  # RelayLimits.publication_queue_capacity (frames per subscriber)
    tag: str = "main"
    workers: int = 1  # [relay] workers: N-1 fan-out worker processes when >= 2
    mirror: bool = False  # subscribers read a `kvrelay mirror` process in front of the relay
    stats_interval: float = 0.5  # relay counter dumps; 0 = on demand (SIGUSR1), none while idle
    max_streams: int = 128  # pool streams the relay (each worker, with workers >= 2) admits


@dataclass
class Fleet:
    """Loadgens + one relay, kept alive across load points (no restarts inside a sweep)."""

    cfg: FleetConfig
    loadgens: list[Proc] = field(default_factory=list)
    relay: Proc | None = None
    port: int = 0
    probe_file: Path = WORK / "probes.json"
    stats_file: Path = WORK / "relay-stats.json"
    next_probe: int = 0
    rss_empty: int = 0

    def start(self) -> None:
        c = self.cfg
        self.probe_file = WORK / f"probes-{c.tag}.json"
        self.stats_file = WORK / f"relay-stats-{c.tag}.json"
        self.stats_file.unlink(missing_ok=True)
        for i in range(c.engines):
            argv = [PY, "-m", "benchmarks._loadgen", "--port", str(c.base_port + i),
                    "--host", engine_host(i),
                    "--seed", str(1000 + i), "--working-set-chains", str(c.working_set_chains),
                    "--chain-blocks", str(c.chain_blocks),
                    "--probes", str(c.probes if i == 0 else 0), "--probe-hz", str(c.probe_hz)]
            if i == 0:
                argv += ["--probe-file", str(self.probe_file)]
            self.loadgens.append(Proc(f"loadgen-{c.tag}-{i}", argv, stdin=True))
        for lg in self.loadgens:
            lg.expect("BOUND", 30)
        argv = [PY, "-m", "benchmarks._relay_proc", "--stats", str(self.stats_file),
                "--expected-blocks", str(c.expected_blocks),
                "--queue-capacity", str(c.queue_capacity),
                "--stats-interval", str(c.stats_interval)]
        for i in range(c.engines):
            argv += ["--engine", f"engine-{i}=tcp://{engine_host(i)}:{c.base_port + i}"]
        if c.uvloop:
            argv.append("--uvloop")
        if c.zmq_reader != "zmtp":
            argv += ["--zmq-reader", c.zmq_reader]
        if c.workers > 1:
            argv += ["--workers", str(c.workers)]
        if c.mirror:
            argv.append("--mirror")
        if c.max_streams != 128:
            argv += ["--max-streams", str(c.max_streams)]
        self.relay = Proc(f"relay-{c.tag}", argv)
        self.port = int(self.relay.expect("READY", 60).split()[1])
        for lg in self.loadgens:
            lg.expect("READY", 60)
        self.wait_stats(lambda s: "sequence" in s["pools"][0], 30)
        time.sleep(0.5)
        self.rss_empty = proc_sample(self.relay.pid).rss_bytes

    def stats(self) -> dict[str, Any]:
        for _ in range(50):
            try:
                return dict(json.loads(self.stats_file.read_text()))
            except (OSError, ValueError):
                time.sleep(0.05)
        raise RuntimeError("relay stats unavailable")

    def fresh_stats(self) -> dict[str, Any]:
        """Stats dumped after now (the relay writes every 0.5 s)."""
        t = time.time()
        deadline = t + 5
        if self.cfg.stats_interval <= 0 and self.relay is not None:
            os.kill(self.relay.pid, signal.SIGUSR1)
        while time.time() < deadline:
            s = self.stats()
            if s["wall"] > t:
                return s
            time.sleep(0.1)
        return self.stats()

    def wait_stats(self, pred: Any, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.cfg.stats_interval <= 0 and self.relay is not None:
                os.kill(self.relay.pid, signal.SIGUSR1)
            if self.stats_file.exists():
                s = self.stats()
                if pred(s):
                    return s
            time.sleep(0.1)
        raise TimeoutError(f"relay condition not met; see {WORK}")

    def drive(
        self, rate: float, seconds: float, probe_hz: float | None = None
    ) -> list[dict[str, Any]]:
        """Offer ``rate`` block events/s in total (split evenly over the loadgens)."""
        per = rate / len(self.loadgens)
        s = max(1, round(per / (2 * self.cfg.chain_blocks) / 2000))
        hz = self.cfg.probe_hz if probe_hz is None else probe_hz
        for i, lg in enumerate(self.loadgens):
            lg.send(f"run {per} {seconds} {s} {hz if i == 0 else 0}")
        out = [json.loads(lg.expect("{", seconds + 60)) for lg in self.loadgens]
        self.next_probe = int(out[0]["next_probe"])
        return out

    def stop(self) -> None:
        if self.relay is not None:
            self.relay.stop()
        for lg in self.loadgens:
            if lg.p.poll() is None:
                lg.send("quit")
            lg.stop()


def start_subscribers(fleet: Fleet, n: int, tag: str, per_proc: int = 32,
                      probe: bool = True, read_mbps: float = 0.0,
                      barrier: bool = False,
                      before_go: Callable[[], None] | None = None) -> list[tuple[Proc, str]]:
    """Stream 0 (probe + replica) in its own process; the others ``per_proc`` to a process.
    ``barrier``: every process connects first, then all open their streams at once (right
    after ``before_go`` is called)."""
    procs: list[tuple[Proc, str]] = []
    groups = [1] + [min(per_proc, n - 1 - k) for k in range(0, n - 1, per_proc)]
    for j, streams in enumerate(groups):
        out = str(WORK / f"sub-{tag}-{j}.json")
        argv = [PY, "-m", "benchmarks._subscriber", "--port", str(fleet.port), "--streams",
                str(streams), "--id", f"{tag}-{j}", "--out", out,
                "--channels", str(max(1, streams // 8))]
        if j == 0 and probe:
            argv += ["--probe-file", str(fleet.probe_file), "--probe-start", str(fleet.next_probe)]
        if read_mbps > 0:
            argv += ["--read-mbps", str(read_mbps)]
        if barrier:
            argv.append("--barrier")
        procs.append((Proc(f"sub-{tag}-{j}", argv, stdin=barrier), out))
    if barrier:
        for p, _ in procs:
            p.expect("CONNECTED", 120)
        if before_go is not None:
            before_go()
        for p, _ in procs:
            p.send("go")
    for p, _ in procs:
        p.expect("SNAPSHOTS_DONE", 120)
    return procs


def stop_subscribers(procs: list[tuple[Proc, str]]) -> tuple[list[dict[str, Any]], np.ndarray]:
    results = []
    lats = []
    for p, out in procs:
        p.stop(30)
        results.append(json.loads(Path(out).read_text()))
        lats.append(np.load(out + ".lat.npy"))
    return results, (np.concatenate(lats) if lats else np.zeros(0, dtype=np.int64))


def counters(stats: dict[str, Any]) -> dict[str, Any]:
    p = stats["pools"][0]
    return {
        "ingest_blocks": p["ingest_blocks"],
        "ingest_gaps": p["ingest_gaps"],
        "ingest_resets": p["ingest_resets"],
        "member_resets": sum(p["member_resets"].values()),
        "hub_lagged": p.get("hub_lagged", 0),
        "events_rejected": p["events_rejected"],
        "sequence": p.get("sequence", 0),
        "lag_errors": sum(v for k, v in stats["service_errors"].items() if "LAGGED" in k),
    }


def diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: b[k] - a[k] for k in a}


def cpu_by_process(pid: int) -> dict[int, float]:
    """CPU seconds of each process of a tree (the relay and, with workers >= 2, its workers)."""
    out = {}
    for p in tree_pids(pid):
        try:
            out[p] = process_cpu_s(p)
        except OSError:
            continue
    return out


def split_cpu(pid: int, c0: dict[int, float], c1: dict[int, float],
              window: float) -> dict[str, Any]:
    """Cores used over ``window`` by the tree's root (the ingest process) and by each other
    process of it (the fan-out workers), busiest first."""
    util = {p: round((c1[p] - c0.get(p, 0.0)) / window, 3) for p in c1} if window else {}
    return {"ingest": util.get(pid), "workers": sorted((u for p, u in util.items() if p != pid),
                                                       reverse=True)}


def load_point(fleet: Fleet, rate: float, n_subs: int, seconds: float, tag: str) -> dict[str, Any]:
    """One (offered load, subscriber count) measurement."""
    assert fleet.relay is not None
    subs = start_subscribers(fleet, n_subs, tag)
    time.sleep(0.3)
    before = counters(fleet.fresh_stats())
    by_proc0 = cpu_by_process(fleet.relay.pid)
    cpu0 = tree_sample(fleet.relay.pid)
    sub_cpu0 = sum(tree_sample(p.pid).cpu_s for p, _ in subs)
    sent = fleet.drive(rate, seconds)
    cpu1 = tree_sample(fleet.relay.pid)
    by_proc1 = cpu_by_process(fleet.relay.pid)
    sub_cpu1 = sum(tree_sample(p.pid).cpu_s for p, _ in subs)
    window = cpu1.wall - cpu0.wall
    # drain: ingest must reach what was sent (bounded wait; a lagging relay shows up here)
    sent_blocks = sum(int(s["block_events"]) for s in sent)
    t_drain = time.monotonic()
    after = counters(fleet.fresh_stats())
    while after["ingest_blocks"] - before["ingest_blocks"] < sent_blocks:
        if time.monotonic() - t_drain > 5:
            break
        time.sleep(0.2)
        after = counters(fleet.fresh_stats())
    drain_s = time.monotonic() - t_drain
    time.sleep(0.3)
    sub_res, lat = stop_subscribers(subs)
    d = diff(before, after)
    streams = [st for r in sub_res for st in r["streams"]]
    deltas = sum(st["deltas"] for st in streams)
    frames = deltas + sum(st["heartbeats"] for st in streams)  # snapshot chunks excluded
    delivered = frames
    probes_sent = dict((int(i), int(t)) for i, t in sent[0]["probes"])
    found = {int(i): int(t) for i, t in sub_res[0].get("probe_found", [])}
    e2e = [found[i] - t for i, t in probes_sent.items() if i in found]
    errors = [st["error"] for st in streams if st["error"] and not st["error"].startswith("EOF")]
    relay_cpu = cpu1.cpu_s - cpu0.cpu_s
    achieved = sum(float(s["achieved_rate"]) for s in sent)
    return {
        "offered_rate": rate,
        "achieved_rate": achieved,
        "subscribers": n_subs,
        "seconds": window,
        "sent_block_events": sent_blocks,
        "ingested_block_events": d["ingest_blocks"],
        "drain_s": round(drain_s, 3),
        "relay_counters": d,
        "loadgen_hwm_drops": sum(int(s["hwm_drops"]) for s in sent),
        "loadgen_fell_behind": sum(int(s["fell_behind"]) for s in sent),
        "delta_latency_ms": percentiles(lat, 1e-3),
        "e2e_latency_ms": percentiles(e2e, 1e-3),
        "probes_sent": len(probes_sent),
        "probes_seen": len(e2e),
        "deltas_received": deltas,
        "frames_received": frames,
        "publications": d["sequence"],
        "stream_errors": errors[:5],
        "stream_error_count": len(errors),
        "seq_errors": sum(st["seq_errors"] for st in streams),
        "snapshot_s": percentiles([st["snapshot_s"] for st in streams if st["snapshot_s"]]),
        "relay_cpu_s": round(relay_cpu, 3),
        "relay_cpu_util": round(relay_cpu / window, 3) if window else None,
        "relay_process_cpu_util": split_cpu(fleet.relay.pid, by_proc0, by_proc1, window),
        "relay_cpu_us_per_frame": round(relay_cpu / max(1, delivered) * 1e6, 2),
        "relay_rss_bytes": cpu1.rss_bytes,
        "subscriber_cpu_util": round((sub_cpu1 - sub_cpu0) / window, 3) if window else None,
    }
