"""``kvrelay serve`` as a real subprocess: sd_notify, gRPC streams, SIGTERM, exit codes.

The test owns the NOTIFY_SOCKET (an AF_UNIX datagram socket in tmp) and a simulated vLLM engine
in its own event loop; the relay only sees them through real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
from grpclib.client import Channel

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.cli import _numba_cache_from_systemd
from kvrelay.ops.config import DaemonConfig, load_config
from kvrelay.ops.daemon import Daemon
from kvrelay.ops.sdnotify import Notifier
from kvrelay.ops.warmup import STEPS
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.cache_env import cache_env, child_cache_view
from tests.support.commands import MINIMAL, REPO, clean_env
from tests.support.notify import Notifications
from tests.support.timing import scaled

MARKER = 0x4B565231
SHUTDOWN_BOUND_S = 10.0


def _config(path: Path, grpc_port: int, extra: str = "") -> Path:
    path.write_text(
        f"""
[relay]
dc_name = "dc-ops"
bind = "127.0.0.1:0"
discovery_interval_s = 0.2
discovery_timeout_s = 1.0
shutdown_timeout_s = {SHUTDOWN_BOUND_S}
{extra}
[metrics]
bind = "127.0.0.1:0"

[logging]
format = "json"

[[pools]]
namespace = "ns"
component = "backend"
endpoint = "generate"
expected_blocks = 4096

[[pools.engines]]
name = "e0"
grpc_port = {grpc_port}
"""
    )
    return path


async def _drain(stream: object, seen: list[object]) -> str:
    """Iterate a server stream to its end; 'clean' only if it ended with status OK."""
    async for msg in stream:  # type: ignore[attr-defined]
        seen.append(msg)
    return "clean"


async def test_serve_notifies_streams_and_shuts_down_cleanly_on_sigterm(tmp_path: Path) -> None:
    engine = SimEngine(SimConfig(name="e0", seed=5, dp_size=1, capacity_blocks=64))
    await engine.start()
    assert engine.grpc_port is not None
    notes = Notifications(tmp_path / "notify.sock")
    cfg = _config(tmp_path / "kvrelay.toml", engine.grpc_port)
    env = clean_env(NOTIFY_SOCKET=str(tmp_path / "notify.sock"), WATCHDOG_USEC="400000")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrelay", "serve", "--config", str(cfg),
        env=env, cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    tasks: list[asyncio.Task[str]] = []
    try:
        ready = await notes.wait_for("READY=1")
        match = re.search(r"STATUS=serving gRPC on 127\.0\.0\.1:(\d+)", ready)
        assert match, ready
        port = int(match.group(1))
        await notes.wait_for("WATCHDOG=1", count=2)  # pings at half of 0.4 s

        async with Channel("127.0.0.1", port) as channel:
            stub = pb.KvEventRelayStub(channel)
            info = await stub.get_relay_info(pb.RelayInfoRequest(contract_marker=MARKER))
            assert info.relay is not None and info.relay.relay_incarnation != 0

            # The pool appears once discovery has materialized it.
            descriptor = None
            async for upd in stub.watch_kv_pool_catalog(
                pb.WatchKvPoolCatalogRequest(subscriber_id="ops", contract_marker=MARKER)
            ):
                if upd.snapshot is not None and upd.snapshot.pools:
                    descriptor = upd.snapshot.pools[0]
                    break
            assert descriptor is not None and descriptor.producer is not None

            catalog_seen: list[object] = []
            pool_seen: list[pb.FilterUpdate] = []
            tasks.append(asyncio.create_task(_drain(stub.watch_kv_pool_catalog(
                pb.WatchKvPoolCatalogRequest(subscriber_id="ops-2", contract_marker=MARKER)
            ), catalog_seen)))
            tasks.append(asyncio.create_task(_drain(stub.subscribe_kv_pool(
                pb.SubscribeKvPoolRequest(
                    subscriber_id="ops", expected_producer=descriptor.producer,
                    contract_marker=MARKER,
                )
            ), pool_seen)))  # type: ignore[arg-type]
            deadline = time.monotonic() + scaled(20)
            while not any(f.kind == pb.FilterUpdateKind.DELTA for f in pool_seen):
                assert time.monotonic() < deadline, "no delta reached the subscriber"
                await engine.step(2)
                await asyncio.sleep(0.05)
            assert pool_seen[0].kind == pb.FilterUpdateKind.SNAPSHOT_CHUNK

            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.wait_for(proc.wait(), scaled(SHUTDOWN_BOUND_S + 5))
            elapsed = time.monotonic() - t0
            logs = (await proc.stderr.read()).decode()  # type: ignore[union-attr]
            logs += (await proc.stdout.read()).decode()  # type: ignore[union-attr]
            assert rc == 0, logs
            assert elapsed < scaled(SHUTDOWN_BOUND_S)
            # The objects alive after the warm-up (modules, kernels) were frozen out of the
            # collector's walks before any pool existed (ops/gc_freeze.py).
            [warm] = [line for line in logs.splitlines() if "kernels_warm" in line]
            frozen = re.search(r"gc_frozen_objects\W+(\d+)", warm)
            assert frozen and int(frozen.group(1)) > 10_000, warm
            # Both open streams saw a clean end (status OK), not a reset or an error.
            results = await asyncio.wait_for(asyncio.gather(*tasks), scaled(5))
            assert results == ["clean", "clean"]
            assert catalog_seen, "the catalog stream delivered its first snapshot"

        await notes.wait_for("STOPPING=1")
        kinds = [m.split("=", 1)[0] for m in notes.messages]
        ready_at = kinds.index("READY")
        # Before READY only the kernel warm-up speaks: one STATUS per step (and, on a slow
        # first start, EXTEND_TIMEOUT_USEC and WATCHDOG ticks).
        assert set(kinds[:ready_at]) <= {"STATUS", "EXTEND_TIMEOUT_USEC", "WATCHDOG"}, kinds
        warming = [m for m in notes.messages[:ready_at] if m.startswith("STATUS=")]
        assert warming[0].startswith("STATUS=warming up numba kernels (0 s): importing")
        for step in ("hashing", "ingest", "pool"):
            assert any(f"; {step}: " in m or f"): {step}: " in m for m in warming), warming
        assert kinds.count("STOPPING") == 1 and kinds.count("READY") == 1
        stop_at = kinds.index("STOPPING")
        assert "WATCHDOG" in kinds[1:stop_at], kinds
    finally:
        for t in tasks:
            t.cancel()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await notes.close()
        await engine.stop()


async def test_serve_exits_1_when_the_port_is_taken(tmp_path: Path) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        cfg = _config(tmp_path / "k.toml", 50051).read_text()
        cfg = cfg.replace(
            'bind = "127.0.0.1:0"\ndiscovery', f'bind = "127.0.0.1:{port}"\ndiscovery'
        )
        (tmp_path / "k.toml").write_text(cfg)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvrelay", "serve", "--config", str(tmp_path / "k.toml"),
            env=clean_env(), cwd=REPO, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), scaled(40))
        assert proc.returncode == 1
        assert b"start_failed" in out + err
    finally:
        holder.close()


async def _http_get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), scaled(5))
    writer.close()
    head, _, body = data.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


async def _minimal(tmp_path: Path) -> tuple[SimEngine, DaemonConfig]:
    """A started engine and the minimal file's configuration for it (ports moved off the
    defaults via env)."""
    engine = SimEngine(SimConfig(name="e0", seed=9, dp_size=1, capacity_blocks=32))
    await engine.start()
    f = tmp_path / "k.toml"
    f.write_text(MINIMAL.replace("50051", str(engine.grpc_port)))
    cfg = load_config(
        f, env={"KVRELAY_RELAY_BIND": "127.0.0.1:0", "KVRELAY_METRICS_BIND": "127.0.0.1:0"}
    )
    return engine, cfg


async def test_defaults_that_run(tmp_path: Path) -> None:
    """A file with just dc_name and one pool runs (ports moved off the defaults via env)."""
    engine, cfg = await _minimal(tmp_path)
    assert cfg.metrics.enabled and cfg.relay.limits.max_message_bytes == 8 * 1024 * 1024
    daemon = Daemon(cfg, Notifier({}))
    try:
        await daemon.start()
        assert daemon.grpc_port and daemon.metrics_port
        async with Channel("127.0.0.1", daemon.grpc_port) as channel:
            info = await pb.KvEventRelayStub(channel).get_relay_info(
                pb.RelayInfoRequest(contract_marker=MARKER)
            )
            assert info.relay is not None
            assert info.relay.relay_incarnation == daemon.relay.relay_incarnation
        deadline = time.monotonic() + scaled(10)
        while True:  # until at least two loop-lag samples were taken
            status, body = await _http_get(daemon.metrics_port, "/metrics")
            assert status == 200 and "kvrelay_event_loop_lag_seconds_count" in body
            count = re.search(r"^kvrelay_event_loop_lag_seconds_count (\S+)$", body, re.M)
            assert count is not None
            if float(count.group(1)) >= 2:
                break
            assert time.monotonic() < deadline, f"{count.group(1)} loop-lag samples"
            await asyncio.sleep(0.1)
    finally:
        await daemon.stop()
        await engine.stop()
    # stopped means closed: nothing listens on either port any more
    for port in (daemon.grpc_port, daemon.metrics_port):
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            raise AssertionError(f"port {port} still accepts connections")


def test_numba_cache_follows_systemd_cache_directory() -> None:
    # patch.dict restores the whole environment, including the NUMBA_CACHE_DIR the CLI itself
    # sets (monkeypatch would restore the value it first saw set, and later daemons inherit it)
    with patch.dict(os.environ):
        os.environ.pop("NUMBA_CACHE_DIR", None)
        os.environ["CACHE_DIRECTORY"] = "/var/cache/kvrelay:/other"
        _numba_cache_from_systemd()
        assert os.environ["NUMBA_CACHE_DIR"] == "/var/cache/kvrelay/numba"
        os.environ["NUMBA_CACHE_DIR"] = "/explicit"
        _numba_cache_from_systemd()
        assert os.environ["NUMBA_CACHE_DIR"] == "/explicit"


def test_a_daemon_started_after_the_cache_dir_test_loads_every_kernel() -> None:
    """The test above, then what a ``kvrelay serve`` a later test starts sees: the session's
    cache, every declared kernel in it (a leaked NUMBA_CACHE_DIR once sent the reload test's
    daemon to an empty cache, to compile for a minute past its READY deadline)."""
    session = cache_env()
    test_numba_cache_follows_systemd_cache_directory()
    assert cache_env() == session
    view = child_cache_view()
    assert view["dir"] == session.get("NUMBA_CACHE_DIR"), view
    assert view["missing"] == {g: [] for g in STEPS}, view


async def test_health_and_healthz_turn_not_serving_as_the_drain_starts(tmp_path: Path) -> None:
    """SERVING / 200 while serving; from the first moment of a drain NOT_SERVING on an open
    connection and 503 on /healthz (which stays up until the end). A client that opened a
    stream without sending its request holds the drain open for the grace period, so the
    window is seen deterministically. A health ``Watch`` is sent NOT_SERVING and ends with
    status OK at once, not cut without a status when the grace is over."""
    from grpclib.const import Cardinality
    from grpclib.health.v1.health_grpc import HealthStub
    from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

    engine = SimEngine(SimConfig(name="e0", seed=3, dp_size=1, capacity_blocks=32))
    await engine.start()
    f = tmp_path / "k.toml"
    f.write_text(MINIMAL.replace("50051", str(engine.grpc_port)).replace(
        'dc_name = "dc-test"', 'dc_name = "dc-test"\nshutdown_timeout_s = 4.0'
    ))
    cfg = load_config(
        f, env={"KVRELAY_RELAY_BIND": "127.0.0.1:0", "KVRELAY_METRICS_BIND": "127.0.0.1:0"}
    )
    daemon = Daemon(cfg, Notifier({}))
    service = "dynamo.kvrelay.v1.KvEventRelay"
    stopping: asyncio.Task[None] | None = None
    try:
        await daemon.start()
        assert daemon.grpc_port and daemon.metrics_port
        async with Channel("127.0.0.1", daemon.grpc_port) as channel:
            health = HealthStub(channel)
            for name in (service, ""):
                reply = await health.Check(HealthCheckRequest(service=name))
                assert reply.status == HealthCheckResponse.SERVING, name
            assert (await _http_get(daemon.metrics_port, "/healthz")) == (200, "ok\n")

            async with channel.request(
                f"/{service}/WatchKvPoolCatalog", Cardinality.UNARY_STREAM,
                pb.WatchKvPoolCatalogRequest, pb.KvPoolCatalogUpdate,
            ) as held, channel.request(
                "/grpc.health.v1.Health/Watch", Cardinality.UNARY_STREAM,
                HealthCheckRequest, HealthCheckResponse,
            ) as watch:  # fmt: skip
                await watch.send_message(HealthCheckRequest(service=""), end=True)
                first = await watch.recv_message()
                assert first is not None and first.status == HealthCheckResponse.SERVING
                await held.send_request()  # headers only: the handler waits for the message
                for _ in range(500):  # until the server runs that handler
                    if daemon.server.service._active:
                        break
                    await asyncio.sleep(0.01)
                stopping = asyncio.create_task(daemon.stop())
                await asyncio.sleep(0.2)
                assert not stopping.done(), "the held stream keeps the drain open"
                for name in (service, ""):
                    reply = await health.Check(HealthCheckRequest(service=name))
                    assert reply.status == HealthCheckResponse.NOT_SERVING, name
                assert (await _http_get(daemon.metrics_port, "/healthz")) == (
                    503, "not serving\n"
                )
                last = await asyncio.wait_for(watch.recv_message(), scaled(5))
                assert last is not None and last.status == HealthCheckResponse.NOT_SERVING
                assert await asyncio.wait_for(watch.recv_message(), scaled(5)) is None
                await watch.recv_trailing_metadata()  # raises on anything but OK
                assert not stopping.done(), "the Watch ended before the drain's grace"
                await asyncio.wait_for(stopping, scaled(10))
    finally:
        if stopping is None:
            await daemon.stop()
        await engine.stop()


@pytest.mark.parametrize("setting", ["relay.bind", "metrics.bind"])
def test_a_port_in_use_fails_before_the_warm_up_naming_the_setting(
    setting: str, tmp_path: Path
) -> None:
    """Both listeners are probed before the kernels warm up: a held port ends the start at once
    (exit 1), and the error names the setting and its variable, not only the address."""
    from tests.support.commands import kvrelay

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        cfg = tmp_path / "kvrelay.toml"
        section = "[relay]" if setting == "relay.bind" else "[metrics]"
        text = MINIMAL + "\n[metrics]\nbind = \"127.0.0.1:0\"\n"
        text = text.replace(f"{section}\n", f"{section}\nbind = \"127.0.0.1:{port}\"\n", 1)
        if setting == "metrics.bind":
            text = text.replace('bind = "127.0.0.1:0"\n', "", 1)
            text = text.replace("[relay]\n", '[relay]\nbind = "127.0.0.1:0"\n', 1)
        cfg.write_text(text)
        # the pid file of the relay that holds the port (here: this process) stays as it is;
        # written before the ports were tried, the failed start replaced it, then removed it
        pid_file = tmp_path / "kvrelay.pid"
        pid_file.write_text(f"{os.getpid()}\n")
        run = kvrelay("serve", "--config", str(cfg), "--pid-file", str(pid_file),
                      env=clean_env(), timeout=120)  # fmt: skip
    assert run.returncode == 1, run.stderr[-3000:]
    assert pid_file.read_text() == f"{os.getpid()}\n"
    env = "KVRELAY_RELAY_BIND" if setting == "relay.bind" else "KVRELAY_METRICS_BIND"
    assert f"{setting} = '127.0.0.1:{port}'" in run.stderr and env in run.stderr, run.stderr
    assert '"start_failed"' in run.stderr or "start_failed" in run.stderr
    assert "kernels_progress" not in run.stderr and "kernels_warm" not in run.stderr


async def _reading_its_config(fifo: Path, proc: asyncio.subprocess.Process) -> int:
    """Once ``kvrelay serve`` has the FIFO given as ``--config`` open for reading (its command
    runs, its event loop does not exist yet): the FIFO's write end."""
    deadline = time.monotonic() + scaled(30)
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:  # ENXIO: no reader yet
            assert exc.errno == errno.ENXIO, exc
        assert proc.returncode is None, f"exited {proc.returncode} before reading its config"
        assert time.monotonic() < deadline, "never opened its config"
        await asyncio.sleep(0.01)


def _blocked(pid: int, tid: int) -> int:
    """The signal mask of thread ``tid`` of process ``pid`` (``SigBlk`` in its status)."""
    return _status_mask(pid, tid, "SigBlk")


async def _serve_on_a_fifo(tmp_path: Path) -> tuple[Path, asyncio.subprocess.Process]:
    """``kvrelay serve`` whose ``--config`` is a FIFO nobody writes yet (it waits there)."""
    fifo = tmp_path / "kvrelay.toml"
    os.mkfifo(fifo)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrelay", "serve", "--config", str(fifo), env=clean_env(),
        cwd=REPO, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    return fifo, proc


def _status_mask(pid: int, tid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no {field}")


@pytest.mark.parametrize("after_s", [0.0, 0.01, 0.03, 0.06, 0.1])
async def test_a_sigterm_from_the_first_line_of_serve_exits_0(
    tmp_path: Path, after_s: float
) -> None:
    """SIGTERM ``after_s`` after ``serve`` caught it (its first line), while it unblocks the
    signals numpy's import held, imports, parses, opens its (FIFO) config. It raised
    ``KeyboardInterrupt``: one raised outside any ``try`` killed the process by SIGINT with a
    traceback (status 130), and one an extension's code saw marked the exit as an unhandled
    interrupt, so the process killed itself with SIGINT after ``main`` had returned 0."""
    _, proc = await _serve_on_a_fifo(tmp_path)
    deadline = time.monotonic() + scaled(30)
    while not _status_mask(proc.pid, proc.pid, "SigCgt") >> (signal.SIGTERM - 1) & 1:
        assert proc.returncode is None and time.monotonic() < deadline, "never caught SIGTERM"
        await asyncio.sleep(0.001)
    await asyncio.sleep(after_s)
    proc.send_signal(signal.SIGTERM)
    _, err = await asyncio.wait_for(proc.communicate(), scaled(30))
    assert proc.returncode == 0 and b"Traceback" not in err, (proc.returncode, err[-600:])


async def test_only_the_main_thread_takes_a_stop_while_it_reads_its_config(tmp_path: Path) -> None:
    """numpy's import starts OpenBLAS's threads, which blocked no signal: a SIGTERM the kernel
    gave to one of them left the main thread in its read of a FIFO ``--config`` (the stop came
    once the read ended; a run of the test below waited 133 s). They now start with the
    daemon's signals blocked, and the main thread alone takes them."""
    fifo, proc = await _serve_on_a_fifo(tmp_path)
    fd = await _reading_its_config(fifo, proc)
    try:
        others = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
        assert others, "no other thread: the test proves nothing"
        held = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2]
        for tid in others:
            mask = _blocked(proc.pid, tid)
            assert all(mask >> (sig - 1) & 1 for sig in held), (tid, hex(mask))
        # the main thread blocks them only while it starts the reader thread, which may open
        # the FIFO (what ``_reading_its_config`` waits for) before the main thread unblocks
        deadline = time.monotonic() + scaled(10)
        while _blocked(proc.pid, proc.pid) >> (signal.SIGTERM - 1) & 1:
            assert time.monotonic() < deadline, "the main thread keeps SIGTERM blocked"
            await asyncio.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), scaled(30)) == 0
    finally:
        os.close(fd)
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_signals_before_the_event_loop_handles_them(tmp_path: Path) -> None:
    """Signals in the first second of ``serve``, while it imports and validates (here held
    there: its ``--config`` is a FIFO the test writes late), before the loop has its handlers.
    Their default actions killed it: a SIGHUP (``kvrelay reload``, a config tool) or SIGUSR2
    by that signal, and SIGTERM without the exit 0 a stop during start-up promises. Now SIGTERM
    stops it with 0, and SIGHUP is kept and applied once it serves; SIGUSR1, which the daemon
    never acted on and whose default action killed it even while serving (``systemctl kill -s
    USR1`` reaches the unit), is logged and ignored."""
    from tests.support.commands import static_config

    text = static_config(tmp_path / "real.toml", "dc-early").read_text()
    fifo = tmp_path / "kvrelay.toml"
    os.mkfifo(fifo)
    sock = tmp_path / "notify.sock"
    cmd = (sys.executable, "-m", "kvrelay", "serve", "--config", str(fifo))

    # ---- SIGTERM while it reads its config: exit 0
    proc = await asyncio.create_subprocess_exec(
        *cmd, env=clean_env(), cwd=REPO, stderr=asyncio.subprocess.PIPE
    )
    fd = await _reading_its_config(fifo, proc)
    try:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), scaled(30)) == 0
    finally:
        os.close(fd)

    # ---- SIGHUP, SIGUSR1 and SIGUSR2 then: kept; the reload applied once it serves
    notes = Notifications(sock)
    proc = await asyncio.create_subprocess_exec(
        *cmd, env=clean_env(NOTIFY_SOCKET=str(sock)), cwd=REPO, stderr=asyncio.subprocess.PIPE
    )
    try:
        fd = await _reading_its_config(fifo, proc)
        try:
            for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
                proc.send_signal(sig)
            await asyncio.sleep(0.2)
            assert proc.returncode is None, f"killed by {proc.returncode}"
            os.set_blocking(fd, True)
            os.write(fd, text.encode())
        finally:
            os.close(fd)
        (tmp_path / "real.toml").replace(fifo)  # the reload reads a plain file
        await notes.wait_for("READY=1")
        await notes.wait_for("RELOADING=1")
        assert (await notes.wait_for("READY=1", count=2)).endswith("reload applied")
        proc.send_signal(signal.SIGUSR1)  # while serving
        await asyncio.sleep(0.3)
        assert proc.returncode is None, f"killed by {proc.returncode}"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), scaled(30)) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await notes.close()
    assert proc.stderr is not None
    events = [json.loads(ln) for ln in (await proc.stderr.read()).decode().splitlines()
              if ln.startswith("{")]  # fmt: skip
    names = [ev["event"] for ev in events]
    assert names.count("config_reloaded") == 1 and names.count("upgrade_refused") == 1, names
    assert [ev["signal"] for ev in events if ev["event"] == "signal_ignored"] == ["SIGUSR1"] * 2


async def test_a_reload_whose_file_never_ends_holds_neither_clients_nor_the_stop(
    tmp_path: Path,
) -> None:
    """A reload reads its file off the event loop: a FIFO (or a hung network mount) in its
    place held the loop in the read, so /healthz, gRPC, the ingest and a SIGTERM all waited
    until something was written. Now the daemon answers meanwhile, and its stop ends the
    reload that waits."""
    engine, cfg = await _minimal(tmp_path)
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    daemon = Daemon(cfg, Notifier({}))
    reload: asyncio.Task[Any] | None = None
    try:
        await daemon.start()
        reload = asyncio.create_task(daemon.reload(fifo))
        await asyncio.sleep(0.3)  # in the read, which never ends
        assert not reload.done()
        status, _ = await asyncio.wait_for(_http_get(daemon.metrics_port, "/healthz"), 5)
        assert status == 200
        async with Channel("127.0.0.1", daemon.grpc_port) as channel:
            await asyncio.wait_for(pb.KvEventRelayStub(channel).get_relay_info(
                pb.RelayInfoRequest(contract_marker=MARKER)), 5)  # fmt: skip
        t0 = time.monotonic()
        reload.cancel()  # what the stop does to a reload under way
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(reload, 5)
        assert time.monotonic() - t0 < 2.0
    finally:
        await asyncio.wait_for(daemon.stop(), scaled(30))
        await engine.stop()
        with contextlib.suppress(OSError):  # let the reader's open and read end
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
