"""Hot upgrade against stop-and-start, under vLLM-like traffic with half a second of replay.

Simulated engines (this process, real ZMQ and gRPC) publish ``--steps-per-s`` (default 100)
with a ``--buffer-steps`` (default 50) replay buffer, after a history several times longer. A real
``kvrelay serve`` process (with ``[relay] state_dir``) is then either hot-upgraded (SIGUSR2; also
with ``workers = 2``, whose fan-out worker serves the port) or stopped with SIGTERM and started
again, as ``systemctl restart`` does, while the traffic goes on
and a client dials the gRPC port every 5 ms. Afterwards the traffic stops and a fresh SDK client
compares its replica with the engines' caches.

Prints and writes ``benchmarks/results/upgrade.{json,md}``: the time the transition took, the
refused connections during it, and the held blocks missing from the filter (and the fingerprints
beyond the held blocks it does contain: phantoms) once it has settled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import ROOT, free_ports, machine, results_dir, spread, write_json
from benchmarks.bench_restart import Notify, _config
from kvrelay.client import ClientConfig, RelayClient
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine


class Dialer:
    """A new TCP connection to the port every 5 ms; refusals counted."""

    def __init__(self, port: int) -> None:
        self.port, self.connects, self.refused = port, 0, 0
        self._stopping = False
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stopping:  # (3.11's wait_for may swallow a cancel: a flag as well)
            try:
                async with asyncio.timeout(5):
                    _, w = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError as exc:
                self.refused += exc.errno == errno.ECONNREFUSED
            else:
                self.connects += 1
                w.close()
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        self._stopping = True
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


def _read_pid(path: Path, not_this: int, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            pid = int(path.read_text())
            if pid != not_this:
                return pid
        time.sleep(0.01)
    raise TimeoutError("the pid file never named the successor")


async def _run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    engines = [
        SimEngine(SimConfig(name=f"ub{i}", seed=300 + i, dp_size=2,
                            capacity_blocks=args.capacity, buffer_steps=args.buffer_steps))
        for i in range(args.engines)
    ]  # fmt: skip
    for e in engines:
        await e.start()
    work = Path(tempfile.mkdtemp(prefix="kvrelay-upgrade-bench-"))
    grpc, metrics = free_ports(2)
    cfg = work / "kvrelay.toml"
    workers = 2 if mode.endswith("_workers2") else 1
    cfg.write_text(_config(grpc, metrics, engines, str(work / "state"), workers))
    pid_file = work / "kvrelay.pid"
    notify = Notify(work / "notify.sock")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVRELAY_", "NOTIFY_"))}
    env.update(NOTIFY_SOCKET=str(work / "notify.sock"), STATE_DIRECTORY="", TMPDIR=str(work))

    async def serve() -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvrelay", "serve", "--config", str(cfg), "--pid-file",
            str(pid_file), env=env, cwd=ROOT, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip

    def held() -> list[int]:
        return sorted({h for e in engines for r in range(e.cfg.dp_size) for h in e.ground_truth(r)})

    async def traffic() -> None:
        period, nxt = 1.0 / args.steps_per_s, time.monotonic()
        while True:
            for e in engines:
                await e.step(1)
            nxt = max(nxt + period, time.monotonic())  # at most the rate: no catch-up burst
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))

    cfg_client = ClientConfig(backoff_initial_s=0.01, backoff_max_s=0.1)

    async def settled(timeout: float) -> tuple[int, int, int]:
        """(held, missing, phantom) once exact or after ``timeout``."""
        async with RelayClient([f"127.0.0.1:{grpc}"], config=cfg_client) as client:
            deadline = time.monotonic() + timeout
            while True:
                want = held()
                got = client.contains(want)
                present = next(iter(got.values())) if got else np.zeros(len(want), bool)
                fps = sum(r.occupancy for r in client.replica_stats().values() if r.installed)
                missing = len(want) - int(present.sum())
                phantom = max(0, fps - int(present.sum()))
                if (missing == 0 and phantom == 0) or time.monotonic() > deadline:
                    return len(want), missing, phantom
                await asyncio.sleep(0.02)

    procs = [await serve()]
    mover: asyncio.Task[None] | None = None
    dialer: Dialer | None = None
    successor: int | None = None
    try:
        await notify.wait_ready(1)
        for e in engines:
            await e.step(1)
        await settled(60)
        for _ in range(args.history_steps // 10):
            for e in engines:
                await e.step(10)
            await asyncio.sleep(0)
        before = await settled(60)
        assert before[1] == 0 and before[2] == 0, f"the first relay is not exact: {before}"
        dialer = Dialer(grpc)
        mover = asyncio.create_task(traffic())
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        old = procs[0]
        assert old.pid is not None
        if mode.startswith("hot_upgrade"):
            old.send_signal(signal.SIGUSR2)
            rc = await asyncio.wait_for(old.wait(), 300)
            successor = _read_pid(pid_file, old.pid)
        else:
            old.send_signal(signal.SIGTERM)
            rc = await old.wait()
            procs.append(await serve())
            await notify.wait_ready(2)
        transition = time.monotonic() - t0
        await asyncio.sleep(1.0)  # traffic goes on into the new process
        mover.cancel()
        await dialer.stop()
        n, missing, phantom = await settled(args.settle_s)
        return {
            "mode": mode, "old_exit_code": rc, "transition_s": round(transition, 3),
            "dials": dialer.connects + dialer.refused, "refused": dialer.refused,
            "held_blocks": n, "missing": missing, "phantom": phantom,
        }  # fmt: skip
    finally:
        if mover is not None:
            mover.cancel()
        if dialer is not None:
            await dialer.stop()
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
                await p.wait()
        if successor is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(successor, signal.SIGTERM)
            for _ in range(300):
                try:
                    os.kill(successor, 0)
                except ProcessLookupError:
                    break
                await asyncio.sleep(0.1)
        notify.sock.close()
        for e in engines:
            await e.stop()
        shutil.rmtree(work, ignore_errors=True)


def _markdown(doc: dict[str, Any]) -> str:
    m, a = doc["machine"], doc["args"]
    lines = [
        "# Hot upgrade against stop-and-start under traffic",
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores, Python {m['python']}, load average at "
        f"start {m['loadavg_at_start']}; git {m['git_commit']}; {m['utc']}.",
        "",
        f"{a['engines']} simulated engines × 2 DP ranks, {a['history_steps']} steps of history, "
        f"replay buffer {a['buffer_steps']} steps, traffic {a['steps_per_s']} steps/s during the "
        "transition (and 1 s after it); `[relay] state_dir` set in every mode. A client dials the "
        "gRPC port every 5 ms throughout. Missing / phantom: held blocks absent from a fresh "
        f"client's filter, and fingerprints beyond the present ones, after up to {a['settle_s']} s "
        "without traffic.",
        "",
        f"Over {a['repeats']} runs of each mode (interleaved): the transition's median and range, "
        "and the refused dials, missing and phantom blocks summed over the runs.",
        "",
        "| mode | runs | transition s median (min–max) | dials | refused | held blocks "
        "(last run) | missing | phantom |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for mode, s in doc["summary"].items():
        t = s["transition_s"]
        lines.append(
            f"| {mode} | {s['runs']} | {t['median']:.3f} ({t['min']:.3f}–{t['max']:.3f}) | "
            f"{s['dials']} | {s['refused']} | {s['held_blocks']:,} | {s['missing']:,} | "
            f"{s['phantom']:,} |"
        )
    lines += ["", "Every run:", "",
              "| mode | old exit | transition s | dials | refused | held blocks | missing | "
              "phantom |", "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in doc["runs"]:
        lines.append(
            f"| {r['mode']} | {r['old_exit_code']} | {r['transition_s']} | {r['dials']} | "
            f"{r['refused']} | {r['held_blocks']:,} | {r['missing']:,} | {r['phantom']:,} |"
        )
    return "\n".join(lines) + "\n"


def _summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per mode: the transition's spread, and what was refused or lost in all its runs."""
    out: dict[str, dict[str, Any]] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        out[mode] = {
            "runs": len(mine), "transition_s": spread([r["transition_s"] for r in mine]),
            "held_blocks": mine[-1]["held_blocks"],
            **{k: sum(r[k] for r in mine) for k in ("dials", "refused", "missing", "phantom")},
        }  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=4096, help="blocks per DP rank")
    ap.add_argument("--history-steps", type=int, default=400)
    ap.add_argument("--buffer-steps", type=int, default=50)
    ap.add_argument("--steps-per-s", type=float, default=100.0)
    ap.add_argument("--settle-s", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each mode")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--smoke", action="store_true", help="seconds, tiny sizes, to .work/smoke")
    args = ap.parse_args(argv)
    if args.smoke:
        args.engines, args.capacity, args.history_steps, args.settle_s = 1, 512, 60, 2.0
        args.repeats = 1
    modes = ("hot_upgrade", "hot_upgrade_workers2", "stop_start")
    runs = [asyncio.run(_run(mode, args)) for _ in range(args.repeats) for mode in modes]
    doc = {"machine": machine(), "args": vars(args), "runs": runs, "summary": _summary(runs)}
    md = _markdown(doc)
    print(md)
    if not args.no_write:
        out = results_dir(args.smoke)
        write_json(out / "upgrade.json", doc)
        (out / "upgrade.md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
