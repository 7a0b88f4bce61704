"""Hot upgrade (SIGUSR2) of a real ``kvrelay serve`` under vLLM-like traffic: nothing lost.

Simulated engines (this process, real ZMQ and gRPC) publish about 100 steps/s with a 50-step
replay buffer: half a second of history, far less than a process start. A hot upgrade mid-traffic
hands the successor the listeners and a live cut of the exact state; it resumes every member from
its cursor, the replay filling the batches the old process applied after the cut. Afterwards the
filter equals the engines' caches (every held block, one fingerprint per distinct held block: 0
missing, 0 phantom), a client connecting in a loop was never refused, the old process exited 0,
systemd heard ``MAINPID=<successor>``, the pid file names the successor and no hand-over file is
left. A successor that cannot start leaves the old process serving, counted. The stop-and-start
baseline under the same settings is ``benchmarks/bench_upgrade.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from grpclib.client import Channel

from benchmarks._common import free_ports
from benchmarks.bench_upgrade import Dialer
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.commands import REPO, clean_env, start_daemon
from tests.support.fleet import eventually
from tests.support.notify import Notifications
from tests.support.rig import (
    Consumer,
    catalog_producer,
    in_sync,
    make_settings,
    relay_info,
    start_relay,
    wait_live,
)
from tests.support.scrape import scrape, total, value

STEPS_PER_S = 100.0
BUFFER_STEPS = 50
#: A replay answering this late holds a successor's vouch: long enough for the test to act, well
#: within the relay's replay timeout (2 s).
SLOW_REPLAY_S = 0.6


def _config(
    grpc: int, metrics: int, engines: list[SimEngine], loop: str = "asyncio", state: str = "",
    workers: int = 1, runtime: str = "", extra: str = "",
) -> str:
    text = f"""
[relay]
dc_name = "dc-upgrade"
bind = "127.0.0.1:{grpc}"
event_loop = "{loop}"
state_dir = "{state}"
workers = {workers}
{f'runtime_dir = "{runtime}"' if runtime else ""}
discovery_interval_s = 0.2
discovery_timeout_s = 1.0
{extra}

[metrics]
bind = "127.0.0.1:{metrics}"

[logging]
format = "json"

[[pools]]
namespace = "ns"
component = "backend"
endpoint = "generate"
expected_blocks = 8192
"""
    for e in engines:
        text += f'\n[[pools.engines]]\nname = "{e.cfg.name}"\ngrpc_port = {e.grpc_port}\n'
    return text


def _fingerprints(table: np.ndarray | None) -> int:
    """Occupied slots of a CKF table (four 16-bit fingerprints per bucket, 0 = empty)."""
    return -1 if table is None else int(np.count_nonzero(table.view(np.uint16)))


class Fleet:
    """Engines, their traffic and ground truth."""

    def __init__(self, n: int, seed: int) -> None:
        self.engines = [
            SimEngine(SimConfig(name=f"up{i}", seed=seed + i, dp_size=2, capacity_blocks=2048,
                                buffer_steps=BUFFER_STEPS))
            for i in range(n)
        ]  # fmt: skip
        self.steps = 0
        self._traffic: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for e in self.engines:
            await e.start()

    def truth(self) -> list[int]:
        return sorted({h for e in self.engines for r in range(2) for h in e.ground_truth(r)})

    async def step(self, n: int = 1) -> None:
        for e in self.engines:
            await e.step(n)
        self.steps += n

    def traffic(self) -> None:
        async def run() -> None:
            period = 1.0 / STEPS_PER_S
            nxt = time.monotonic()
            while True:
                await self.step(1)
                nxt = max(nxt + period, time.monotonic())  # at most the rate: no catch-up burst
                await asyncio.sleep(max(0.0, nxt - time.monotonic()))

        self._traffic = asyncio.create_task(run())

    async def quiet(self) -> None:
        if self._traffic is not None:
            self._traffic.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._traffic
            self._traffic = None

    async def stop(self) -> None:
        await self.quiet()
        for e in self.engines:
            await e.stop()


@contextlib.asynccontextmanager
async def _router(grpc: int) -> AsyncIterator[tuple[Consumer, int]]:
    """A fresh router on the port, past its first frame; with the relay incarnation it saw."""
    async with Channel("127.0.0.1", grpc) as ch:
        info = await relay_info(ch)
        assert info.relay is not None
        consumer = Consumer(ch, await catalog_producer(ch), info.relay).start()
        try:
            await asyncio.wait_for(consumer.first.wait(), 20)
            yield consumer, int(info.relay.relay_incarnation)
        finally:
            await consumer.stop()


async def _exact(grpc: int, fleet: Fleet) -> int:
    """A fresh router's replica equals the engines' caches; the relay incarnation it saw."""
    async with _router(grpc) as (consumer, incarnation):
        want = fleet.truth()
        await eventually(
            lambda: bool(consumer.replica.contains(want).all())
            and _fingerprints(consumer.replica.table) == len(want),
            timeout=20, what="a filter equal to the engines' caches (0 missing, 0 phantom)",
        )  # fmt: skip
    return incarnation


def _upgrade_dirs(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("kvrelay-upgrade-"))


@pytest.mark.parametrize(("loop", "workers"), [("uvloop", 1), ("asyncio", 2)])
async def test_hot_upgrade_mid_traffic_loses_nothing_and_never_refuses(
    tmp_path: Path, loop: str, workers: int
) -> None:
    """``kvrelay upgrade --pid-file`` (SIGUSR2) under ~100 steps/s, on either event loop, and
    with ``workers = 2``: the successor's fan-out worker accepts on the same listening socket
    while the old one still serves, and the old one's exit leaves its runtime directory gone."""
    fleet = Fleet(2, seed=510)
    await fleet.start()
    grpc, metrics = free_ports(2)
    cfg = tmp_path / "kvrelay.toml"
    state = tmp_path / "state"
    pid_file = tmp_path / "kvrelay.pid"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    cfg.write_text(_config(grpc, metrics, fleet.engines, loop, str(state), workers, str(tmpdir)))
    # its log: the old process's (and, inherited, the successor's)
    old, env, notes, log = await start_daemon(tmp_path, "serve", "--config", str(cfg),
                                              "--pid-file", str(pid_file))  # fmt: skip
    new_pid: int | None = None
    dialer: Dialer | None = None
    try:
        await notes.wait_for("READY=1")
        await fleet.step(1)
        first = await _exact(grpc, fleet)
        for _ in range(20):  # 400 steps of history: 8x the replay buffer
            await fleet.step(20)
        await _exact(grpc, fleet)
        dialer = Dialer(grpc)
        fleet.traffic()  # ~100 steps/s from here on, through the whole hand-over
        await asyncio.sleep(0.5)
        steps_before = fleet.steps
        assert old.pid is not None
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvrelay", "upgrade", "--pid-file", str(pid_file), env=env,
            cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(cli.communicate(), 150)
        assert cli.returncode == 0, err.decode()
        assert await asyncio.wait_for(old.wait(), 30) == 0
        steps_during = fleet.steps - steps_before
        await asyncio.sleep(0.5)  # traffic goes on after the hand-over, into the successor
        await fleet.quiet()
        assert dialer.connects > 0
        assert dialer.refused == 0, f"{dialer.refused} refused, {dialer.connects} accepted"
        assert steps_during > BUFFER_STEPS, "the hand-over outlasts the replay buffer"
        new_pid = int(pid_file.read_text())
        assert new_pid != old.pid
        assert out.decode().strip() == f"kvrelay upgrade: handed over to pid {new_pid}"
        os.kill(new_pid, 0)  # the successor lives
        own = Path("/proc/self/oom_score_adj").read_text()  # as the old process inherited it
        assert Path(f"/proc/{new_pid}/oom_score_adj").read_text() == own  # its own again
        await notes.wait_for(f"MAINPID={new_pid}")
        second = await _exact(grpc, fleet)
        assert second != first  # a new process: a new relay incarnation
        samples = await scrape(metrics)  # the successor's, on the inherited listener
        assert value(samples, "kvrelay_upgrades_total", result="taken_over") == 1
        # every member resumed from its cursor: none rebuilt, none left unverified
        assert value(samples, "kvrelay_pool_members_resumed_total",
                     pool="ns/backend/generate") == 4  # fmt: skip
        assert total(samples, "kvrelay_pool_member_resets_total") == 0
        assert _upgrade_dirs(tmpdir) == []
        runtime = [p for p in tmpdir.iterdir() if not p.name.startswith("kvrelay-upgrade-")]
        assert len(runtime) == (1 if workers > 1 else 0), runtime  # the successor's alone
        events = [json.loads(ln) for ln in log.read_text().splitlines() if ln.startswith("{")]
        names = [e.get("event") for e in events]
        assert "upgrade_state_cut" in names and "upgrade_handed_over" in names, names
        took = next(e for e in events if e.get("event") == "upgrade_took_over")
        assert (took["members_resumed"], took["members_reset"]) == (4, 0)
        assert "state_saved" not in names and list(state.iterdir()) == []  # nothing behind it
        assert sorted(os.listdir(tmp_path)) == [
            "kvrelay.pid", "kvrelay.toml", "log.jsonl", "notify.sock", "state", "tmp"]
        os.kill(new_pid, signal.SIGTERM)
        await eventually(lambda: not _alive(new_pid), timeout=30, what="the successor stops")
        assert not pid_file.exists()
        assert len(list(state.iterdir())) == 1  # the successor's own clean stop saves
        new_pid = None
    finally:
        await _end(log, dialer, old, new_pid, notes)
        await fleet.stop()


async def _end(
    log: Path,
    dialer: Dialer | None,
    old: asyncio.subprocess.Process,
    new_pid: int | None,
    notes: Notifications,
) -> None:
    """A hot-upgrade test's clean-up: its log shown (pytest prints it when the test fails),
    the dialer stopped, both relay processes gone."""
    print("\n".join(log.read_text().splitlines()[-60:]))
    if dialer is not None:
        await dialer.stop()
    await _kill_all([old], [] if new_pid is None else [new_pid])
    await notes.close()


async def _kill_all(procs: list[asyncio.subprocess.Process], pids: list[int]) -> None:
    """What a test left running: its own child processes (reaped) and other pids (successors)."""
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_a_successor_that_cannot_start_leaves_the_old_process_serving(
    tmp_path: Path,
) -> None:
    """The configuration installed since the start is invalid: the successor exits, the old
    process goes on serving (same incarnation, same pid file), logged and counted."""
    fleet = Fleet(1, seed=530)
    await fleet.start()
    grpc, metrics = free_ports(2)
    cfg = tmp_path / "kvrelay.toml"
    cfg.write_text(_config(grpc, metrics, fleet.engines))
    pid_file = tmp_path / "kvrelay.pid"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = clean_env(NOTIFY_SOCKET=str(tmp_path / "notify.sock"), TMPDIR=str(tmpdir))
    notes = Notifications(tmp_path / "notify.sock")
    old = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrelay", "serve", "--config", str(cfg), "--pid-file",
        str(pid_file), env=env, cwd=REPO, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        await notes.wait_for("READY=1")
        await fleet.step(5)
        first = await _exact(grpc, fleet)
        cfg.write_text(cfg.read_text().replace("expected_blocks = 8192", "expected_blocks = -1"))
        assert old.pid is not None
        os.kill(old.pid, signal.SIGUSR2)

        async def failed() -> bool:
            s = await scrape(metrics)
            return value(s, "kvrelay_upgrades_total", result="successor_exited") == 1

        deadline = time.monotonic() + 60
        while not await failed():
            assert time.monotonic() < deadline, "no counted failure"
            await asyncio.sleep(0.1)
        assert old.returncode is None
        assert int(pid_file.read_text()) == old.pid
        await fleet.step(5)
        assert await _exact(grpc, fleet) == first  # the same process, still exact
        assert _upgrade_dirs(tmpdir) == []
        assert not any(m.startswith("MAINPID=") for m in notes.messages)
        old.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(old.wait(), 30) == 0
    finally:
        if old.returncode is None:
            old.kill()
            await old.wait()
        await notes.close()
        await fleet.stop()


async def test_a_successor_killed_or_given_up_on_leaves_no_directory_behind(
    tmp_path: Path,
) -> None:
    """``workers = 2``. What processes killed outright left (a runtime directory with its
    socket, an emptied cut directory) is swept at start. A successor killed outright once it
    made its runtime directory cannot remove it: the old process, which serves on, sweeps it
    once it counted the failure. A stop of the old process during the next upgrade gives up on
    that successor with SIGTERM first, so it stops as any stop does and removes its own:
    nothing is left in the runtime directory. (They used to pile up, one per incident.) That
    successor, given up on after it restored the cut, saves no state: its predecessor, alive,
    serves on and saves its own (the successor's file used to overwrite a newer checkpoint)."""
    fleet = Fleet(1, seed=560)
    await fleet.start()
    grpc, metrics = free_ports(2)
    cfg = tmp_path / "kvrelay.toml"
    state = tmp_path / "state"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    gone = await asyncio.create_subprocess_exec(sys.executable, "-c", "")
    await gone.wait()
    for name in ("kvrelay-abcdefgh", "kvrelay-upgrade-abcdefgh"):  # as a SIGKILL leaves them
        (tmpdir / name).mkdir(mode=0o700)
        (tmpdir / name / "pid").write_text(f"{gone.pid}\n")
    (tmpdir / "kvrelay-abcdefgh" / "ingest.sock").write_bytes(b"")
    cfg.write_text(_config(grpc, metrics, fleet.engines, workers=2, runtime=str(tmpdir),
                           state=str(state), extra="checkpoint_interval_s = 0"))  # fmt: skip
    old, _, notes, log = await start_daemon(tmp_path, "serve", "--config", str(cfg))

    def events() -> list[dict[str, object]]:
        return [json.loads(ln) for ln in log.read_text().splitlines() if ln.startswith("{")]

    assert old.pid is not None
    successors: list[int] = []

    def dirs(pid: int) -> list[str]:
        """The runtime directories of process ``pid`` (their pid file names it)."""
        return [p.name for p in tmpdir.iterdir()
                if not p.name.startswith("kvrelay-upgrade-") and _pid_file(p) == pid]  # fmt: skip

    async def successor_with_its_directory(count: int) -> int:
        os.kill(old.pid, signal.SIGUSR2)

        def started() -> bool:
            events = [json.loads(ln) for ln in log.read_text().splitlines() if ln.startswith("{")]
            pids = [e["successor_pid"] for e in events if e.get("event") == "upgrade_started"]
            successors[:] = pids
            return len(pids) == count and bool(dirs(pids[-1]))

        await eventually(started, timeout=60, what="a successor with its runtime directory")
        return successors[-1]

    try:
        await notes.wait_for("READY=1")
        await fleet.step(5)
        first = await _exact(grpc, fleet)
        own = dirs(old.pid)
        assert len(own) == 1 and sorted(p.name for p in tmpdir.iterdir()) == own  # swept
        killed = await successor_with_its_directory(1)
        os.kill(killed, signal.SIGKILL)
        await eventually(
            lambda: _failures(log) == ["successor_exited"], timeout=30, what="a counted failure"
        )  # fmt: skip
        await eventually(  # the old process's alone: swept just after the failure's log line
            lambda: sorted(p.name for p in tmpdir.iterdir()) == own, timeout=10,
            what="the killed successor's directory swept",
        )  # fmt: skip
        await fleet.step(5)
        assert await _exact(grpc, fleet) == first  # the same process serves on, exact
        for e in fleet.engines:  # the successor's vouch waits: it is on the cut, not serving
            e.delay_replay(SLOW_REPLAY_S)
        mark = len(events())
        given_up = await successor_with_its_directory(2)
        await eventually(
            lambda: any(e.get("event") == "pool_materialized" and e.get("restored")
                        for e in events()[mark:]),
            timeout=60, what="the successor on the cut",
        )  # fmt: skip
        # until it takes over, the kernel's OOM killer takes it before the serving process
        own = int(Path("/proc/self/oom_score_adj").read_text())
        assert int(Path(f"/proc/{given_up}/oom_score_adj").read_text()) == max(500, own)
        old.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(old.wait(), 30) == 0
        await eventually(lambda: not _alive(given_up), timeout=10, what="the successor gone")
        assert list(tmpdir.iterdir()) == []
        names = [e.get("event") for e in events()]
        assert names.count("relay_stopping") == 2, "the successor stopped as any stop, not killed"
        assert names.count("state_saved") == 1  # the old process's own, at its stop
        assert names.count("state_not_saved") == 1
        assert len(list(state.iterdir())) == 1
    finally:
        await _kill_all([old], successors)
        print("\n".join(log.read_text().splitlines()[-40:]))
        await notes.close()
        await fleet.stop()


async def test_the_old_process_killed_after_the_cut_leaves_the_successors_state(
    tmp_path: Path,
) -> None:
    """The old process dies (SIGKILL, the OOM killer) once its successor has read the cut. The
    successor cannot take a dead process's place (under systemd the unit's main process is
    gone and the unit restarts; in a container the namespace ends), so it gives up, but as any
    stop does: it saves the state it restored and had vouched for into ``state_dir`` and exits
    1. The next start resumes every member from that file: exact, though the history is three
    replay buffers long and no periodic checkpoint was written."""
    fleet = Fleet(1, seed=580)
    await fleet.start()
    grpc, metrics = free_ports(2)
    cfg = tmp_path / "kvrelay.toml"
    state, tmpdir = tmp_path / "state", tmp_path / "tmp"
    tmpdir.mkdir()
    cfg.write_text(_config(grpc, metrics, fleet.engines, state=str(state), runtime=str(tmpdir),
                           extra="checkpoint_interval_s = 0"))  # fmt: skip
    env = clean_env(NOTIFY_SOCKET=str(tmp_path / "notify.sock"), TMPDIR=str(tmpdir))
    notes = Notifications(tmp_path / "notify.sock")
    log = tmp_path / "log.jsonl"
    procs: list[asyncio.subprocess.Process] = []
    successors: list[int] = []

    def events() -> list[dict[str, object]]:
        return [json.loads(ln) for ln in log.read_text().splitlines() if ln.startswith("{")]

    async def serve() -> asyncio.subprocess.Process:
        with log.open("ab") as f:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kvrelay", "serve", "--config", str(cfg), env=env,
                cwd=REPO, stdout=asyncio.subprocess.DEVNULL, stderr=f,
            )  # fmt: skip
        procs.append(proc)
        return proc

    try:
        old = await serve()
        await notes.wait_for("READY=1")
        await fleet.step(5)
        await _exact(grpc, fleet)  # every member live
        for _ in range(3 * BUFFER_STEPS // 10):
            await fleet.step(10)
            await asyncio.sleep(0.02)
        await _exact(grpc, fleet)
        for e in fleet.engines:  # the successor's vouch waits: it cannot take over meanwhile
            e.delay_replay(SLOW_REPLAY_S)
        os.kill(old.pid, signal.SIGUSR2)

        def successor_read_the_cut() -> bool:
            ev = events()
            successors[:] = [int(e["successor_pid"]) for e in ev  # type: ignore[call-overload]
                             if e.get("event") == "upgrade_started"]  # fmt: skip
            return any(e.get("event") == "pool_materialized" and e.get("restored") for e in ev)

        await eventually(successor_read_the_cut, timeout=60, what="the successor on the cut")
        old.kill()
        assert await old.wait() == -signal.SIGKILL
        for e in fleet.engines:
            e.delay_replay(0)
        await eventually(lambda: [e.get("exit_code") for e in events()
                                  if e.get("event") == "relay_stopped"] == [1],
                         timeout=30, what="the successor given up")  # fmt: skip
        assert [e["event"] for e in events() if e.get("event") in ("state_saved", "start_failed")
                ] == ["start_failed", "state_saved"]  # fmt: skip
        await eventually(lambda: _exited(successors[0]), what="the successor gone")
        await fleet.step(BUFFER_STEPS // 2)  # within the replay buffer
        ready = sum(m.startswith("READY=1") for m in notes.messages)  # the successor's too
        await serve()
        await notes.wait_for("READY=1", count=ready + 1)
        await _exact(grpc, fleet)
        text = await scrape(metrics)
        assert value(text, "kvrelay_state_restores_total", result="restored") == 1
        assert total(text, "kvrelay_pool_member_resets_total") == 0, "every member resumed"
    finally:
        await _kill_all(procs, successors)
        await notes.close()
        await fleet.stop()


async def test_a_reload_applied_during_the_upgrade_reaches_the_successor(
    tmp_path: Path,
) -> None:
    """An engine is removed from the file and the old process reloads while its successor, which
    read the file when it started, waits on its vouch. The reload was applied (and ``reload``
    said so), then lost at the hand-over: the successor went on serving the removed engine's
    blocks, its reload counters at 0. The old process now sends its successor SIGHUP as it
    hands over: the successor applies the file and serves only the engine left."""
    fleet = Fleet(2, seed=590)
    await fleet.start()
    grpc, metrics = free_ports(2)
    cfg = tmp_path / "kvrelay.toml"
    pid_file = tmp_path / "kvrelay.pid"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    cfg.write_text(_config(grpc, metrics, fleet.engines, runtime=str(tmpdir)))
    old, _env, notes, log = await start_daemon(tmp_path, "serve", "--config", str(cfg),
                                               "--pid-file", str(pid_file))  # fmt: skip
    new_pid: int | None = None
    everyone = list(fleet.engines)

    def events() -> list[dict[str, object]]:
        return [json.loads(ln) for ln in log.read_text().splitlines() if ln.startswith("{")]

    try:
        await notes.wait_for("READY=1")
        await fleet.step(5)
        await _exact(grpc, fleet)
        for e in fleet.engines:  # the successor's vouch waits: it cannot take over meanwhile
            e.delay_replay(SLOW_REPLAY_S)
        assert old.pid is not None
        os.kill(old.pid, signal.SIGUSR2)
        await eventually(
            lambda: any(e.get("event") == "pool_materialized" and e.get("restored")
                        for e in events()),
            timeout=60, what="the successor on the cut",
        )  # fmt: skip
        fleet.engines.pop()  # the operator removes it, and reloads the old process
        cfg.write_text(_config(grpc, metrics, fleet.engines, runtime=str(tmpdir)))
        os.kill(old.pid, signal.SIGHUP)
        assert await asyncio.wait_for(old.wait(), 60) == 0  # handed over
        for e in everyone:
            e.delay_replay(0)
        new_pid = int(pid_file.read_text())
        async def successor_reloaded() -> bool:
            s = await scrape(metrics)
            return value(s, "kvrelay_config_reloads_total", result="applied") >= 1

        deadline = time.monotonic() + 30
        while not await successor_reloaded():
            assert time.monotonic() < deadline, "the successor never applied the reload"
            await asyncio.sleep(0.1)
        await fleet.step(3)
        await _exact(grpc, fleet)  # the engine left, and only it (0 missing, 0 phantom)
        names = [e.get("event") for e in events()]
        assert names.count("config_reloaded") == 2 and "upgrade_reload_forwarded" in names, names
    finally:
        await _end(log, None, old, new_pid, notes)
        fleet.engines = everyone
        await fleet.stop()


def _exited(pid: int) -> bool:
    """Gone, or a zombie: an orphan is reaped by whatever the machine's first process is, which
    need not reap at all (a container's)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _pid_file(directory: Path) -> int | None:
    try:
        return int((directory / "pid").read_text())
    except (OSError, ValueError):
        return None


def _failures(log: Path) -> list[str]:
    events = [json.loads(ln) for ln in log.read_text().splitlines() if ln.startswith("{")]
    return [e["result"] for e in events if e.get("event") == "upgrade_failed"]


async def test_a_mirror_with_a_worker_hot_upgrades_and_never_refuses(tmp_path: Path) -> None:
    """``kvrelay mirror --workers 2`` in front of a relay, SIGUSR2 while the engine publishes:
    the successor synchronizes from upstream before it says it is warm, its worker accepts on
    the same listening socket, the old process exits 0 and a router through the successor gets
    a table identical to the relay's."""
    engine = SimEngine(SimConfig(name="mu0", seed=540, capacity_blocks=512))
    await engine.start()
    relay, upstream = await start_relay(make_settings([engine]))
    grpc, metrics = free_ports(2)
    tmpdir = tmp_path / "tmp"
    old, _, notes, log = await start_daemon(
        tmp_path, "mirror", "--upstream", f"127.0.0.1:{upstream.port}", "--bind",
        f"127.0.0.1:{grpc}", "--metrics-bind", f"127.0.0.1:{metrics}", "--workers", "2",
    )  # fmt: skip
    dialer: Dialer | None = None
    traffic: asyncio.Task[None] | None = None
    new_pid: int | None = None
    try:
        await notes.wait_for("READY=1", timeout=60)
        await wait_live(relay, 1)
        await engine.step(5)
        dialer = Dialer(grpc)

        async def publish() -> None:
            while True:
                await engine.step(1)
                await asyncio.sleep(0.01)

        traffic = asyncio.create_task(publish())
        assert old.pid is not None
        os.kill(old.pid, signal.SIGUSR2)
        assert await asyncio.wait_for(old.wait(), 150) == 0
        main = await notes.wait_for("MAINPID=")
        new_pid = int(main.split("MAINPID=")[1].split()[0])
        assert new_pid != old.pid
        await asyncio.sleep(0.3)
        traffic.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await traffic
        traffic = None
        assert dialer.connects > 0
        assert dialer.refused == 0, f"{dialer.refused} refused, {dialer.connects} accepted"
        samples = await scrape(metrics)  # the successor's, on the inherited listener
        assert value(samples, "kvrelay_upgrades_total", result="taken_over") == 1
        await eventually(lambda: in_sync([engine], relay), what="relay = ground truth")
        gen = relay.pools[0].generation
        assert gen is not None
        gen.flush()
        async with _router(grpc) as (consumer, _incarnation):
            await eventually(lambda: consumer.replica.sequence == gen.sequence,
                             what="replica at the relay's sequence")  # fmt: skip
            assert np.array_equal(consumer.replica.table, gen.pool.table)
        assert _upgrade_dirs(tmpdir) == []
        os.kill(new_pid, signal.SIGTERM)
        await eventually(lambda: not _alive(new_pid), timeout=30, what="the successor stops")
        new_pid = None
        assert list(tmpdir.iterdir()) == []  # both runtime directories are gone
    finally:
        if traffic is not None:
            traffic.cancel()
        await _end(log, dialer, old, new_pid, notes)
        await upstream.close(grace_s=1.0)
        await relay.stop()
        await engine.stop()
