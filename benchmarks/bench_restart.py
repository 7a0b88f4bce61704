"""Restart under traffic: how complete is the filter right after ``READY``?

Simulated vLLM engines (this process, real ZMQ and gRPC) publish continuously with a replay
buffer far shorter than their history (``buffer_steps``). A real ``kvrelay serve`` process is
stopped with SIGTERM and started again, as ``systemctl restart`` does, once with
``[relay] state_dir`` and once without. A fresh SDK client subscribes as soon as the new process
says ``READY=1`` and checks, every 10 ms, which blocks the engines held at ``READY`` (and still
hold) its replica contains.

Prints and writes ``benchmarks/results/restart.{json,md}``: time from SIGTERM to ``READY``, time
from ``READY`` to a complete filter, and the share of held blocks present 1 s after ``READY``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import ROOT, free_ports, machine, results_dir, write_json
from kvrelay.client import ClientConfig, RelayClient
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine

POLL_S = 0.01


def _config(
    grpc: int, metrics: int, engines: list[SimEngine], state_dir: str, workers: int = 1
) -> str:
    text = f"""
[relay]
dc_name = "dc-restart-bench"
bind = "127.0.0.1:{grpc}"
discovery_interval_s = 1.0
state_dir = "{state_dir}"
workers = {workers}

[metrics]
bind = "127.0.0.1:{metrics}"

[logging]
level = "warning"

[[pools]]
namespace = "ns"
component = "backend"
endpoint = "generate"
expected_blocks = 262144
"""
    for e in engines:
        text += f'\n[[pools.engines]]\nname = "{e.cfg.name}"\ngrpc_port = {e.grpc_port}\n'
    return text


class Notify:
    """A NOTIFY_SOCKET of our own: READY=1 datagrams with their arrival times."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.ready_at: list[float] = []

    async def wait_ready(self, count: int, timeout: float = 120.0) -> float:
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout
        while len(self.ready_at) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no READY=1")
            try:
                data = await asyncio.wait_for(loop.sock_recv(self.sock, 4096), remaining)
            except TimeoutError:
                continue
            if data.startswith(b"READY=1"):
                self.ready_at.append(time.monotonic())
        return self.ready_at[count - 1]


async def _run(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    engines = [
        SimEngine(SimConfig(name=f"rb{i}", seed=200 + i, dp_size=2,
                            capacity_blocks=args.capacity, buffer_steps=args.buffer_steps))
        for i in range(args.engines)
    ]  # fmt: skip
    for e in engines:
        await e.start()
    work = Path(tempfile.mkdtemp(prefix="kvrelay-restart-"))
    state_dir = str(work / "state") if mode == "state_dir" else ""
    grpc, metrics = free_ports(2)
    cfg = work / "kvrelay.toml"
    cfg.write_text(_config(grpc, metrics, engines, state_dir))
    notify = Notify(work / "notify.sock")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVRELAY_", "NOTIFY_"))}
    env.update(NOTIFY_SOCKET=str(work / "notify.sock"), STATE_DIRECTORY="")

    async def serve() -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvrelay", "serve", "--config", str(cfg), env=env, cwd=ROOT,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip

    def held() -> set[int]:
        return {h for e in engines for r in range(e.cfg.dp_size) for h in e.ground_truth(r)}

    async def traffic() -> None:
        period = 1.0 / args.steps_per_s
        while True:
            for e in engines:
                await e.step(1)
            await asyncio.sleep(period)

    procs = [await serve()]
    mover: asyncio.Task[None] | None = None
    cfg_client = ClientConfig(backoff_initial_s=0.01, backoff_max_s=0.1)
    async def complete(client: RelayClient, timeout: float = 60.0) -> None:
        """Until the relay's filter holds every block the engines hold."""
        deadline = time.monotonic() + timeout
        while True:
            want = sorted(held())
            got = client.contains(want)
            if want and got and bool(next(iter(got.values())).all()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the first relay never held every block")
            await asyncio.sleep(POLL_S)

    try:
        await notify.wait_ready(1)
        async with RelayClient([f"127.0.0.1:{grpc}"], config=cfg_client) as client:
            # READY=1 means serving, not that every engine stream is live: history published
            # before a stream is live would outrun the replay buffer and the first run would
            # start as a subset (it then stays one, correctly, with or without a state file)
            for e in engines:
                await e.step(1)
            await complete(client)
            for _ in range(args.history_steps // 10):
                for e in engines:
                    await e.step(10)
                await asyncio.sleep(0)
            await complete(client)
        mover = asyncio.create_task(traffic())
        await asyncio.sleep(1.0)
        t_term = time.monotonic()
        procs[0].send_signal(signal.SIGTERM)
        await procs[0].wait()
        t_exit = time.monotonic()
        procs.append(await serve())
        t_ready = await notify.wait_ready(2)
        at_ready = held()
        complete_at: float | None = None
        share_1s: float | None = None
        async with RelayClient([f"127.0.0.1:{grpc}"], config=cfg_client) as client:
            while True:
                now = time.monotonic()
                still = sorted(at_ready & held())
                got = client.contains(still)
                share = float(next(iter(got.values())).mean()) if got and still else 0.0
                if share_1s is None and now - t_ready >= 1.0:
                    share_1s = share
                if share == 1.0 and complete_at is None:
                    complete_at = now
                if (complete_at is not None and share_1s is not None) or now - t_ready > 30:
                    break
                await asyncio.sleep(POLL_S)
        return {
            "mode": mode,
            "held_blocks_at_ready": len(at_ready),
            "stop_s": round(t_exit - t_term, 3),
            "sigterm_to_ready_s": round(t_ready - t_term, 3),
            "ready_to_complete_s": None if complete_at is None else round(complete_at - t_ready, 3),
            "share_present_1s_after_ready": None if share_1s is None else round(share_1s, 5),
        }
    finally:
        if mover is not None:
            mover.cancel()
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
                await p.wait()
        notify.sock.close()
        for e in engines:
            await e.stop()
        shutil.rmtree(work, ignore_errors=True)


def _markdown(doc: dict[str, Any]) -> str:
    m = doc["machine"]
    a = doc["args"]
    lines = [
        "# Restart under traffic: filter completeness after READY",
        "",
        f"Machine: {m['cpu_model']}, {m['cores']} cores, Python {m['python']}, load average at "
        f"start {m['loadavg_at_start']}; git {m['git_commit']}; {m['utc']}.",
        "",
        f"{a['engines']} simulated engines × 2 DP ranks, {a['history_steps']} steps of history, "
        f"replay buffer {a['buffer_steps']} steps, traffic {a['steps_per_s']} steps/s during the "
        "restart. `kvrelay serve` stopped with SIGTERM and started again (same config).",
        "",
        "| mode | held blocks | stop s | SIGTERM→READY s | READY→complete s "
        "| present 1 s after READY |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in doc["runs"]:
        done = "never (30 s)" if r["ready_to_complete_s"] is None else r["ready_to_complete_s"]
        lines.append(
            f"| {r['mode']} | {r['held_blocks_at_ready']:,} | {r['stop_s']} | "
            f"{r['sigterm_to_ready_s']} | {done} | {r['share_present_1s_after_ready']:.2%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=8192, help="blocks per DP rank")
    ap.add_argument("--history-steps", type=int, default=400)
    ap.add_argument("--buffer-steps", type=int, default=32)
    ap.add_argument("--steps-per-s", type=float, default=20.0)
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--smoke", action="store_true", help="seconds, tiny sizes, to .work/smoke")
    args = ap.parse_args(argv)
    if args.smoke:
        args.engines, args.capacity, args.history_steps, args.buffer_steps = 1, 512, 20, 64
    runs = [asyncio.run(_run(mode, args)) for mode in ("state_dir", "replay_only")]
    doc = {"machine": machine(), "args": vars(args), "runs": runs}
    md = _markdown(doc)
    print(md)
    if not args.no_write:
        out = results_dir(args.smoke)
        write_json(out / "restart.json", doc)
        (out / "restart.md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
