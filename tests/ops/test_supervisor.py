"""The supervisor with scripted worker processes (real processes, the worker's line protocol):
start waits for READY, exits and hangs are restarted and counted, stop escalates to SIGKILL,
workers never see the systemd variables."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from kvrelay.ops import supervisor
from kvrelay.ops.supervisor import Supervisor, WorkerStartError, shared_listener
from kvrelay.ops.worker import WorkerSpec
from tests.support.timing import scaled

# A stand-in worker: reads its spec line, then follows the script named by KVR_FAKE (per
# incarnation, counted in a file): "serve" reports forever, "exit" dies, "hang" stops reporting,
# "stubborn" ignores SIGTERM, "mute" never says READY.
FAKE = r"""
import json, os, signal, sys, time
spec = json.loads(sys.stdin.readline())
d = os.environ["KVR_DIR"]
n = sum(1 for f in os.listdir(d) if f.startswith(f"{spec['index']}-"))
fd = spec.get("listen_fd")
seen = dict(os.environ, LISTENER=str(os.fstat(fd).st_ino if fd is not None else ""))
open(os.path.join(d, f"{spec['index']}-{n}.json"), "w").write(json.dumps(seen))
plan = os.environ["KVR_FAKE"].split(",")
mode = plan[min(n, len(plan) - 1)]
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode != "mute":
    print("READY 1234", flush=True)
t0 = time.monotonic()
while True:
    if mode == "exit" and time.monotonic() - t0 > 0.3:
        sys.exit(3)
    if mode == "flash" and time.monotonic() - t0 > 0.3:  # its last report, then gone at once
        print("STATS " + json.dumps({"service": {"errors": {"F": 1}}}), flush=True)
        os._exit(3)
    if mode != "hang" or time.monotonic() - t0 < 0.3:
        print("STATS " + json.dumps({"service": {
            "streams": {"pool": [2, 64]}, "errors": {"R": 1},
            "authz": {"denials": {"WatchKvPool": 1}, "revoked": 1},
            "guard": {"h2": {"ping_flood": 1}, "refusals": {"streams/10.0.0.1": 1},
                      "preempted": {"streams/r": 1}, "stalled": {"deltas": 1}}},
            "mirror": {"synced": True, "identity_changes": 1, "pool_totals": {"deltas": 5},
                       "channel_deaf": 1, "channel_left_draining": 3},
            "reports_dropped": 2}), flush=True)
    time.sleep(0.1)
"""


def _supervisor(
    tmp: Path, plan: str, count: int = 1, listen_fd: int | None = None, **kw: object
) -> Supervisor:
    env = dict(os.environ, KVR_DIR=str(tmp), KVR_FAKE=plan, NOTIFY_SOCKET="/x",
               WATCHDOG_USEC="1")  # fmt: skip
    def spec(index: int) -> WorkerSpec:
        return WorkerSpec(index=index, upstream="unix:/nowhere", host="127.0.0.1", port=1,
                          listen_fd=listen_fd)  # fmt: skip

    return Supervisor(spec, count, argv=[sys.executable, "-c", FAKE], env=env,
                      **kw)  # type: ignore[arg-type]  # fmt: skip


async def _eventually(check: object, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():  # type: ignore[operator]
        assert loop.time() < deadline, "condition not met"
        await asyncio.sleep(0.05)


async def test_start_waits_for_ready_and_restarts_an_exited_worker(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path, "exit,serve", count=2)
    await sup.start()
    try:
        assert sup.alive == 2 and len(set(sup.pids)) == 2
        for f in tmp_path.glob("*.json"):
            env = json.loads(f.read_text())
            assert "NOTIFY_SOCKET" not in env and "WATCHDOG_USEC" not in env
        await _eventually(lambda: sup.restarts == 2 and sup.alive == 2)
        await _eventually(lambda: sup.stats()[0].get("pool") == (4, 128))
        # the exited workers' final counts are kept: two exited and two live workers, each of
        # which counted one of everything (the live workers' streams are gauges: not kept)
        _streams, errors = sup.stats()
        assert errors == {"R": 4}
        assert sup.authz_stats() == ({"WatchKvPool": 4}, 4)
        refusals, stalled, h2 = sup.guard_stats()
        assert refusals == {("streams", "10.0.0.1"): 4} and stalled == {"deltas": 4}
        assert h2 == {"ping_flood": 4} and sup.preemption_stats() == {("streams", "r"): 4}
    finally:
        await sup.stop(5.0)
    assert sup.alive == 0


async def test_a_report_written_just_before_the_exit_is_counted_once(tmp_path: Path) -> None:
    """A worker's last report, written just before it dies, is in the counts kept for it."""
    sup = _supervisor(tmp_path, "flash,serve")
    await sup.start()
    try:
        await _eventually(lambda: sup.restarts == 1 and sup.alive == 1)
        await _eventually(lambda: sup.stats()[1].get("R") == 1)
        assert sup.stats()[1].get("F") == 1, sup.stats()
    finally:
        await sup.stop(5.0)


def test_a_last_report_read_after_the_exit_is_kept_on_uvloop(tmp_path: Path) -> None:
    """The supervisor's loop is late (busy, stalled) while a worker writes its last report and
    exits: uvloop then says the process exited before the report is read. Its counts are kept
    once the reader took that report; before, the counts kept were the previous report's, the
    last one landed on top of them until the successor's first report replaced it, and the
    sum fell back (``F`` 1, then 0)."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> list[int]:
        sup = _supervisor(tmp_path, "flash,serve")
        await sup.start()
        try:
            time.sleep(1.0)  # the loop stalls over the worker's last report and its exit
            seen: list[int] = []
            loop = asyncio.get_running_loop()
            deadline = loop.time() + scaled(10)
            while not (sup.restarts == 1 and "mirror" in sup._slots[0].stats):  # successor's
                assert loop.time() < deadline, "the worker was not restarted"
                seen.append(sup.stats()[1].get("F", 0))
                await asyncio.sleep(0.01)
            seen.append(sup.stats()[1].get("F", 0))
            return seen
        finally:
            await sup.stop(5.0)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        seen = runner.run(scenario())
    assert seen[-1] == 1, seen
    assert seen == sorted(seen), f"the kept count went down: {seen}"


async def test_every_worker_and_every_restart_inherits_the_one_listener(tmp_path: Path) -> None:
    sock = shared_listener("127.0.0.1", 0)
    fd = sock.fileno()
    sup = _supervisor(tmp_path, "exit,serve", count=2, listen_fd=fd, pass_fds=(fd,))
    try:
        await sup.start()
        await _eventually(lambda: sup.restarts == 2 and sup.alive == 2)
        await _eventually(lambda: len(list(tmp_path.glob("*.json"))) == 4)
        seen = {json.loads(f.read_text())["LISTENER"] for f in tmp_path.glob("*.json")}
        assert seen == {str(os.fstat(fd).st_ino)}  # the same socket, not a copy of the port
    finally:
        await sup.stop(5.0)
        sock.close()


async def test_a_worker_that_stops_reporting_is_killed_and_restarted(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path, "hang,serve")
    sup.hang_s = 1.0
    await sup.start()
    try:
        await _eventually(lambda: sup.hung == 1 and sup.restarts == 1 and sup.alive == 1)
    finally:
        await sup.stop(5.0)


def test_a_stalled_supervisor_does_not_take_its_workers_for_hung(tmp_path: Path) -> None:
    """The supervisor's own loop stalls (the ingest process frozen, SIGSTOP) for longer than
    ``hang_s`` while its worker goes on reporting into the pipe: the stall is not the worker's
    silence, so nobody is killed. Before, the hang check woke first after the stall and killed
    every healthy worker. Run on uvloop, as the daemon is, whose timers run before its reads."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> tuple[int, int]:
        sup = _supervisor(tmp_path, "serve")
        sup.hang_s = 1.0
        await sup.start()
        try:
            await asyncio.sleep(0.5)  # the hang check runs
            time.sleep(3.0)  # the whole loop stalls (every reader and the hang check with it)
            await asyncio.sleep(scaled(1.0))
            return sup.hung, sup.restarts
        finally:
            await sup.stop(5.0)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(scenario()) == (0, 0)


async def test_per_worker_counters_never_go_backwards_over_a_restart(tmp_path: Path) -> None:
    """A restarted worker counts from 0: its ``{worker="i"}`` counters (its mirror's, its dropped
    reports) carry its predecessors' (before, ``kvrelay_mirror_deltas_total{worker="1"}`` fell
    from 23 to 7 after a restart); gauges (``synced``) are the live worker's own."""
    sup = _supervisor(tmp_path, "exit,serve")
    await sup.start()
    try:
        await _eventually(lambda: sup.restarts == 1 and sup.alive == 1)
        await _eventually(lambda: bool(sup._slots[0].stats))
        [stats] = sup.worker_stats()
        assert stats["mirror"]["pool_totals"] == {"deltas": 10}
        assert stats["mirror"]["identity_changes"] == 2 and stats["reports_dropped"] == 4
        assert stats["mirror"]["synced"] is True
        # (channels replaced as deaf were not carried: that count fell back at each restart)
        assert stats["mirror"]["channel_deaf"] == 2
        assert stats["mirror"]["channel_left_draining"] == 6
        from kvrelay.ops.mirror_metrics import WorkersCollector

        families = {m.name: m for m in WorkersCollector(sup).collect()}
        [deltas] = families["kvrelay_mirror_deltas"].samples
        assert deltas.labels == {"worker": "1"} and deltas.value == 10.0
        for name, n in (("deaf", 2.0), ("left_draining", 6.0)):  # before: not exported
            [sample] = families[f"kvrelay_mirror_upstream_channel_{name}"].samples
            assert sample.labels == {"worker": "1"} and sample.value == n, name
    finally:
        await sup.stop(5.0)


async def test_stop_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path, "stubborn")
    await sup.start()
    [pid] = sup.pids
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await sup.stop(0.5)
    assert loop.time() - t0 < scaled(5)
    assert sup.alive == 0 and pid is not None and not Path(f"/proc/{pid}/cmdline").exists()


async def test_a_worker_that_never_serves_fails_the_start(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path, "mute", start_timeout_s=1.0)
    with pytest.raises(WorkerStartError):
        await sup.start()
    assert sup.alive == 0


def test_the_shared_listener_queues_connections_until_a_worker_accepts() -> None:
    """The daemon's own socket: a router that dials while no worker accepts (all starting or
    restarting) waits in the backlog, and any process holding the socket can accept it."""
    import socket

    sock = shared_listener("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), 2.0) as client:
            client.sendall(b"x")
            sock.settimeout(2.0)
            conn, _ = sock.accept()
            with conn:
                assert conn.recv(1) == b"x"
    finally:
        sock.close()


async def test_a_restart_whose_process_cannot_start_is_tried_again(tmp_path: Path) -> None:
    """The restart of a dead worker cannot start a process (exec refused: the interpreter
    replaced by a deploy; fork refused at the pids limit): logged, counted and tried again with
    backoff, and the worker serves once a process can start. Before, the ``OSError`` ended the
    slot's watcher: the worker was never restarted and nothing said so."""
    sup = _supervisor(tmp_path, "serve")
    await sup.start()
    try:
        argv = sup.argv
        sup.argv = [str(tmp_path / "gone" / "python")]
        [pid] = sup.pids
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await _eventually(lambda: sup.spawn_failures >= 1, timeout=scaled(10))
        sup.argv = argv
        await _eventually(lambda: sup.alive == 1 and sup.pids != [pid], timeout=scaled(15))
        assert all(not t.done() for t in sup._watchers), "a watcher ended"
    finally:
        await sup.stop(5.0)


async def test_a_worker_that_exits_before_reading_its_spec_is_restarted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker that dies at once, again and again (a crash loop faster than the spec write):
    each death is an exit like any other, restarted with backoff. Before, writing the spec to
    the closed pipe raised in the slot's watcher (``Connection lost``; on uvloop a
    ``RuntimeError``) and ended it: the slot was never restarted again."""
    monkeypatch.setattr(supervisor, "RESTART_INITIAL_S", 0.01)
    monkeypatch.setattr(supervisor, "RESTART_MAX_S", 0.02)
    sup = _supervisor(tmp_path, "serve")
    await sup.start()
    try:
        argv = sup.argv
        true = shutil.which("true")  # gone before its spec is written, most times
        assert true is not None
        sup.argv = [true]
        [pid] = sup.pids
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await _eventually(lambda: sup._slots[0].exits >= 20, timeout=scaled(30))
        sup.argv = argv
        await _eventually(lambda: sup.alive == 1, timeout=scaled(10))
    finally:
        await sup.stop(5.0)


# Records the authorization rules it holds (its spec's, then each AUTHZ line's) in <pid>.rules.
RULES_FAKE = r"""
import json, os, sys
spec = json.loads(sys.stdin.readline())
path = os.path.join(os.environ["KVR_DIR"], f"{os.getpid()}.rules")
def keep(rules):
    open(path + ".tmp", "w").write(json.dumps(rules))
    os.replace(path + ".tmp", path)
keep(spec["authorization"])
print("READY 1234", flush=True)
for line in sys.stdin:
    if line.startswith("AUTHZ "):
        keep(json.loads(line[len("AUTHZ "):]))
"""


async def test_a_reload_while_a_worker_restarts_reaches_the_new_worker(tmp_path: Path) -> None:
    """A reload (new ``[[authorization]]`` rules) lands while a dead worker's successor is being
    started: the successor holds the new rules, from its spec or from the line sent to every
    running worker. Before, the spec was built before the process was started and the reload
    skipped the slot, whose process was still the dead one: the new worker served with the
    rules the reload had replaced, until the next reload."""
    rules: list[list[dict[str, list[str]]] | None] = [None]
    new = [{"subjects": ["router-b"]}]
    built = 0

    def reload() -> None:
        rules[0] = new
        sup.broadcast("AUTHZ " + json.dumps(new))

    def spec(index: int) -> WorkerSpec:
        nonlocal built
        built += 1
        if built == 2:  # the restart's: the reload comes while its process starts
            asyncio.get_running_loop().call_soon(reload)
        return WorkerSpec(index=index, upstream="unix:/nowhere", host="127.0.0.1", port=1,
                          authorization=rules[0])  # fmt: skip

    env = dict(os.environ, KVR_DIR=str(tmp_path))
    sup = Supervisor(spec, 1, argv=[sys.executable, "-c", RULES_FAKE], env=env)
    await sup.start()
    try:
        [first] = sup.pids
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await _eventually(lambda: sup.restarts == 1 and sup.alive == 1, timeout=scaled(10))
        [pid] = sup.pids
        held = tmp_path / f"{pid}.rules"

        def current() -> object:
            return json.loads(held.read_text()) if held.exists() else "none yet"

        loop = asyncio.get_running_loop()
        deadline = loop.time() + scaled(5)
        while current() != new and loop.time() < deadline:
            await asyncio.sleep(0.05)
        assert current() == new, f"the restarted worker holds {current()}"
    finally:
        await sup.stop(5.0)


# Says READY, then writes a report over STATS_LINE_MAX every 0.25 s.
OVERSIZED_FAKE = r"""
import sys, time
sys.stdin.readline()
print("READY 1234", flush=True)
line = "STATS {\"pad\": \"" + "x" * (9 << 19) + "\"}\n"
while True:
    sys.stdout.write(line)
    sys.stdout.flush()
    time.sleep(0.25)
"""


async def test_a_worker_whose_reports_outgrow_the_line_bound_is_not_taken_for_hung(
    tmp_path: Path,
) -> None:
    """Every report is over ``STATS_LINE_MAX`` (a worker mirroring tens of thousands of pools):
    each is dropped, but the worker wrote it, so it is not silent. Before, it was killed as hung
    every ``hang_s`` (a crash loop of a healthy worker, its routers' streams cut each time)."""
    def spec(index: int) -> WorkerSpec:
        return WorkerSpec(index=index, upstream="unix:/nowhere", host="127.0.0.1", port=1)

    sup = Supervisor(spec, 1, argv=[sys.executable, "-c", OVERSIZED_FAKE])
    sup.hang_s = 1.5
    await sup.start()
    try:
        await asyncio.sleep(2.5)
        assert (sup.hung, sup.restarts) == (0, 0)
    finally:
        await sup.stop(5.0)
