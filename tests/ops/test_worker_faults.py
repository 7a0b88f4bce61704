"""A fan-out worker process (``python -m kvrelay.ops.worker``) in front of a relay, under the
faults a ``workers = N`` daemon meets: signals meant for the daemon, an upstream that goes away,
the daemon itself killed outright.

Oracles: the worker process itself (alive, its exit code) and what a client on its port reads
(``GetRelayInfo``, ``grpc.health.v1``), against a relay run in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from grpclib.client import Channel

from kvrelay.ops.worker import WorkerSpec
from kvrelay.relay.relay import Relay
from kvrelay.service.server import RelayServer
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.commands import REPO, clean_env
from tests.support.health import health, health_becomes
from tests.support.rig import make_settings, relay_info, start_relay, stop_relay, wait_live
from tests.support.timing import scaled


@contextlib.asynccontextmanager
async def _worker(upstream_port: int) -> AsyncIterator[tuple[asyncio.subprocess.Process, int]]:
    """A worker mirroring ``127.0.0.1:upstream_port``, serving its own port; (process, port)
    once it said READY."""
    spec = WorkerSpec(index=1, upstream=f"127.0.0.1:{upstream_port}", host="127.0.0.1", port=0,
                      log_json=True, shutdown_timeout_s=2.0)  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrelay.ops.worker", cwd=REPO, env=clean_env(),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(spec.to_json().encode() + b"\n")
    await proc.stdin.drain()
    try:
        while True:
            line = await asyncio.wait_for(proc.stdout.readline(), scaled(60))
            assert line, "the worker exited before READY"
            if line.startswith(b"READY "):
                break
        yield proc, int(line.split()[1])
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _started() -> tuple[SimEngine, Relay, RelayServer]:
    engine = SimEngine(SimConfig(name="wf0", seed=41, capacity_blocks=64))
    await engine.start()
    relay, server = await start_relay(make_settings([engine]))
    await wait_live(relay, 1)
    return engine, relay, server


async def test_a_worker_ignores_the_signals_meant_for_its_daemon() -> None:
    """SIGHUP (reload), SIGUSR1 and SIGUSR2 (upgrade) reach the workers too when sent to the
    unit or the process group (``systemctl kill -s HUP``, a terminal's hangup). A worker ignores
    them and goes on serving; before, their default action killed it at once and its routers'
    streams ended without a status. SIGTERM still drains it (exit 0)."""
    engine, relay, server = await _started()
    try:
        async with _worker(server.port) as (proc, port):
            for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
                proc.send_signal(sig)
            await asyncio.sleep(scaled(1.0))
            assert proc.returncode is None, f"the worker died of a signal: {proc.returncode}"
            async with Channel("127.0.0.1", port) as ch:
                await relay_info(ch)
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), scaled(20)) == 0
    finally:
        await server.close(grace_s=1.0)
        await stop_relay(relay)
        await engine.stop()


async def test_a_workers_health_follows_its_upstream_session() -> None:
    """A worker (a mirror) without its upstream refuses every RPC: its ``grpc.health.v1`` says
    NOT_SERVING meanwhile, so a readiness probe takes it out of rotation, and SERVING again once
    it has its upstream back. Before, it said SERVING all along (observed: 60 s of a frozen
    ingest process, every RPC refused, health SERVING)."""
    engine, relay, server = await _started()
    port_up = server.port
    again: RelayServer | None = None
    try:
        async with _worker(port_up) as (proc, port):
            assert await health(port) == "SERVING"
            await server.close(grace_s=1.0)  # the upstream goes away
            await health_becomes(port, "NOT_SERVING", timeout=30.0, every=0.1)
            again = RelayServer(relay, relay.settings.limits)
            await again.start("127.0.0.1", port_up)
            await health_becomes(port, "SERVING", timeout=30.0, every=0.1)
            async with Channel("127.0.0.1", port) as ch:
                await relay_info(ch)
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), scaled(20)) == 0
    finally:
        if again is not None:
            await again.close(grace_s=1.0)
        await server.close(grace_s=1.0)
        await stop_relay(relay)
        await engine.stop()


def _runs(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


async def test_workers_of_a_daemon_killed_outright_end_their_streams_and_exit(
    tmp_path: Path,
) -> None:
    """The daemon (the supervisor, holding the exact state) is killed with SIGKILL while routers
    are subscribed through both of its workers: every router stream ends with a status, never a
    clean end of a state nobody vouches for any more, and every worker exits (stdin closed, no
    upstream), so no orphan keeps the port: it refuses new connections."""
    from tests.ops.test_daemon import _config
    from tests.ops.test_workers import _consumer, _grpc_port, _serve_notified, _workers

    engine = SimEngine(SimConfig(name="wf1", seed=43, capacity_blocks=64))
    await engine.start()
    assert engine.grpc_port is not None
    cfg = _config(tmp_path / "kvrelay.toml", engine.grpc_port, extra="workers = 3\n")
    proc, notes, _runtime = await _serve_notified(tmp_path, cfg)
    channels: list[Channel] = []
    try:
        port = _grpc_port(await notes.wait_for("READY=1", timeout=120))
        workers = _workers(proc.pid)
        assert len(workers) == 2
        channels = [Channel("127.0.0.1", port) for _ in range(4)]
        consumers = [await _consumer(ch) for ch in channels]
        await engine.step(4)
        proc.kill()
        await proc.wait()
        for c in consumers:
            end = await c.wait_end(timeout=30)
            assert end.status is not None, "a stream ended OK with nobody vouching for it"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + scaled(20)
        while any(_runs(w) for w in workers):
            assert loop.time() < deadline, "a worker outlived its supervisor"
            await asyncio.sleep(0.1)
        try:
            _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except ConnectionRefusedError:
            pass
        else:
            writer.close()
            raise AssertionError("the port still accepts with every process gone")
    finally:
        for ch in channels:
            ch.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await notes.close()
        await engine.stop()
