"""A crash (SIGKILL) of a real ``kvrelay serve`` mid-traffic loses nothing: with periodic
checkpoints, the restarted process resumes every member from its checkpointed cursor (the
engines' replay buffers bring it to now) and its filter equals the engines' caches.

The history (240 steps) is several times longer than the replay buffers (40 steps), which cover
one checkpoint interval plus the restart; a start from replay alone would miss most blocks. The
simulator's ground truth is the oracle."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
import urllib.request
from pathlib import Path

from grpclib.client import Channel

from benchmarks._common import free_ports
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.ops.test_reload import _config, _fingerprints
from tests.support.commands import REPO, clean_env
from tests.support.fleet import eventually
from tests.support.notify import Notifications
from tests.support.rig import Consumer, catalog_producer, relay_info

BUFFER_STEPS = 40


def _running_with(arg: str) -> list[int]:
    """Processes whose command line holds ``arg`` (the relay and any fork of it)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if arg.encode() in cmd.split(b"\0"):
                out.append(int(d.name))
    return out


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def _sample(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_sigkill_mid_traffic_resumes_every_member_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    engines = [SimEngine(SimConfig(name=f"cr{i}", seed=401 + i, dp_size=2, capacity_blocks=4096,
                                   buffer_steps=BUFFER_STEPS)) for i in range(2)]  # fmt: skip
    for e in engines:
        await e.start()
    grpc, metrics = free_ports(2)
    cfg = tmp_path / "kvrelay.toml"
    state = tmp_path / "state"
    extra = f'state_dir = "{state}"\ncheckpoint_interval_s = 0.5'
    cfg.write_text(_config(grpc, metrics, engines, extra=extra))
    env = clean_env(NOTIFY_SOCKET=str(tmp_path / "notify.sock"))

    async def serve() -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvrelay", "serve", "--config", str(cfg), env=env, cwd=REPO,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip

    def truth() -> list[int]:
        return sorted(h for e in engines for r in range(2) for h in e.ground_truth(r))

    saves = 'kvrelay_state_saves_total{result="checkpointed"}'
    notes = Notifications(tmp_path / "notify.sock")
    traffic: asyncio.Task[None] | None = None
    procs: list[asyncio.subprocess.Process] = []
    try:
        procs.append(await serve())
        await notes.wait_for("READY=1")
        async with Channel("127.0.0.1", grpc) as ch:
            info = await relay_info(ch)
            assert info.relay is not None
            consumer = Consumer(ch, await catalog_producer(ch), info.relay).start()
            await asyncio.wait_for(consumer.first.wait(), 15)
            for _ in range(30):  # 240 steps of history
                for e in engines:
                    await e.step(8)
            want = truth()
            await eventually(lambda: bool(consumer.replica.contains(want).all()), what="full")
            await consumer.stop()
        seen = _sample(_metrics(metrics), saves)
        await eventually(lambda: _sample(_metrics(metrics), saves) >= seen + 2, timeout=20,
                         what="checkpoints of the full history")  # fmt: skip

        stepped = asyncio.Event()

        async def steady() -> None:
            # 20 steps in about 2 s: fewer than the replay buffer holds, however late the last
            # checkpoint before the kill was and however slow the restart is
            for i in range(20):
                for e in engines:
                    await e.step(1)
                if i == 5:
                    stepped.set()
                await asyncio.sleep(0.1)

        traffic = asyncio.create_task(steady())
        await stepped.wait()
        procs[0].send_signal(signal.SIGKILL)  # mid-traffic, maybe mid-checkpoint
        assert await asyncio.wait_for(procs[0].wait(), 20) == -signal.SIGKILL
        # a checkpoint writer (a fork of the relay) dies with it: nothing left behind
        await eventually(lambda: not _running_with(str(cfg)), what="no writer left")
        procs.append(await serve())
        await notes.wait_for("READY=1", count=2)
        ready = time.monotonic()
        async with Channel("127.0.0.1", grpc) as ch:
            info = await relay_info(ch)
            assert info.relay is not None
            consumer = Consumer(ch, await catalog_producer(ch), info.relay).start()
            await asyncio.wait_for(consumer.first.wait(), 15)
            await asyncio.wait_for(traffic, 30)  # the traffic ends; then the filter must match

            def equal() -> bool:
                want = truth()
                return bool(consumer.replica.contains(want).all()) and (
                    _fingerprints(consumer.replica.table) == len(set(want)))

            await eventually(equal, timeout=20, what="a filter equal to the engines' caches")
            took = time.monotonic() - ready
            await consumer.stop()
        text = _metrics(metrics)
        assert _sample(text, 'kvrelay_state_restores_total{result="restored"}') == 1
        vouched = 'kvrelay_pool_members_vouched_total{pool="ns/backend/generate"}'
        assert _sample(text, vouched) == 4, [
            ln for ln in text.splitlines() if "resum" in ln or "member_resets" in ln]
        resets = [ln for ln in text.splitlines()
                  if ln.startswith("kvrelay_pool_member_resets_total{")]  # fmt: skip
        assert resets and all(ln.endswith(" 0.0") for ln in resets), resets  # none rebuilt
        print(f"filter equal {took:.2f} s after READY (traffic included)")
    finally:
        if traffic is not None:
            traffic.cancel()
        for p in procs:
            if p.returncode is None:
                p.send_signal(signal.SIGTERM)
                await asyncio.wait_for(p.wait(), 20)
        await notes.close()
        for e in engines:
            await e.stop()
