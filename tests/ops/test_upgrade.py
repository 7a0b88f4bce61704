"""The hot upgrade's process hand-over (``ops/upgrade.py``) with real child processes.

The successor here is a small Python child speaking the control protocol (or failing to): it
inherits the listener and the channel by descriptor, as ``kvrelay serve`` does; the full daemon
hand-over under traffic is ``tests/chaos/test_upgrade.py``. Every failure kills the child, leaves
no directory behind and names its counted result.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path

import pytest
import uvloop

from kvrelay.ops.config import parse_config
from kvrelay.ops.daemon import Daemon
from kvrelay.ops.sdnotify import Notifier
from kvrelay.ops.upgrade import ENV, ENV_PREDECESSOR, Handoff, UpgradeFailed, Upgrader
from tests.support.notify import Notifications

#: A successor: reads KVRELAY_TAKEOVER, then does what argv[1] says.
CHILD = r"""
import json, os, socket, sys
fds = dict(p.split("=") for p in os.environ["KVRELAY_TAKEOVER"].split(","))
chan = socket.socket(fileno=int(fds["chan"]))
mode = sys.argv[1]
if mode == "garbage":
    chan.sendall(b"not json\n")
elif mode == "fail":
    chan.sendall(b'{"msg":"failed","why":"cannot use the cut"}\n')
elif mode == "exit":
    sys.exit(3)
elif mode == "warm_then_die":  # killed while the predecessor cuts the state
    chan.sendall(b'{"msg":"warm"}\n')
    os._exit(9)
elif mode == "serve":
    chan.sendall(b'{"msg":"warm"}\n')
    f = chan.makefile("rb")
    state = json.loads(f.readline())
    listener = socket.socket(fileno=int(fds["grpc"]))
    names = sorted(os.listdir(state["dir"]))
    chan.sendall(b'{"msg":"serving"}\n')
    conn, _ = listener.accept()  # the predecessor has closed its copy by now
    conn.sendall(json.dumps(names).encode())
    conn.close()
"""


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("kvrelay-upgrade-"))


@pytest.fixture
def runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    ("mode", "result", "why"),
    [
        ("sleep", "timeout", "no 'warm'"),
        ("garbage", "successor_failed", "malformed"),
        ("fail", "successor_failed", "cannot use the cut"),
        ("exit", "successor_exited", "status 3"),
    ],
)
async def test_a_successor_that_does_not_take_over_is_killed_and_named(
    runtime: Path, mode: str, result: str, why: str
) -> None:
    lst = _listener()
    argv = [sys.executable, "-c", "import time; time.sleep(60)"] if mode == "sleep" else [
        sys.executable, "-c", CHILD, mode]  # fmt: skip
    up = Upgrader({"grpc": lst}, argv=argv, warm_timeout_s=1.0)
    cuts: list[Path] = []

    async def cut(d: Path) -> dict[str, object]:
        cuts.append(d)
        return {}

    try:
        with pytest.raises(UpgradeFailed) as info:
            await up.run(cut, lambda pid: None)
        assert info.value.result == result and why in str(info.value)
        assert up.proc is not None and up.proc.poll() is not None  # killed or exited, reaped
        assert cuts == [] and _dirs(runtime) == []
        lst.getsockname()  # the predecessor's listener is untouched
    finally:
        lst.close()


async def test_a_successor_that_dies_during_the_cut_is_a_counted_failure(runtime: Path) -> None:
    """The successor says warm and is killed while the state is cut: writing the cut's
    directory to it (or reading its answer) failed with a connection error, which ended the
    upgrade task unlogged and uncounted ("Task exception was never retrieved"). It is the
    successor's exit, named and counted like any other."""
    lst = _listener()
    up = Upgrader({"grpc": lst}, argv=[sys.executable, "-c", CHILD, "warm_then_die"])

    async def cut(d: Path) -> dict[str, object]:
        assert up.proc is not None
        await asyncio.to_thread(up.proc.wait)  # it is gone by the time the cut is written
        return {}

    try:
        with pytest.raises(UpgradeFailed) as info:
            await up.run(cut, lambda pid: None)
        assert info.value.result == "successor_exited", info.value
        assert _dirs(runtime) == []
    finally:
        lst.close()


async def test_the_successor_inherits_the_listener_and_the_cut(runtime: Path) -> None:
    """The child gets the cut directory with what the predecessor wrote, says serving, and
    accepts on the inherited listener after the predecessor closed its own copy."""
    lst = _listener()
    port = lst.getsockname()[1]
    handed: list[int] = []

    async def cut(d: Path) -> dict[str, object]:
        assert d.parent == runtime and (d.stat().st_mode & 0o777) == 0o700
        (d / "pool-x.kvstate").write_bytes(b"state")
        return {"pools": ["x"]}

    up = Upgrader({"grpc": lst}, argv=[sys.executable, "-c", CHILD, "serve"])
    pid = await up.run(cut, handed.append)
    assert handed == [pid] and _dirs(runtime) == []
    lst.close()  # the old process stops accepting: the socket stays open in the successor
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    listed = json.loads(await asyncio.wait_for(reader.read(), 20))
    assert listed == ["pid", "pool-x.kvstate"]  # and the pid file of the directory's owner
    writer.close()
    assert up.proc is not None
    await asyncio.wait_for(asyncio.to_thread(up.proc.wait), 20)


async def test_a_stop_during_the_upgrade_kills_the_successor(runtime: Path) -> None:
    """SIGTERM while the successor warms up: the upgrade is cancelled, nothing outlives it."""
    lst = _listener()
    up = Upgrader({"grpc": lst}, argv=[sys.executable, "-c", "import time; time.sleep(60)"])
    async def cut(d: Path) -> dict[str, object]:
        return {}

    task = asyncio.create_task(up.run(cut, lambda pid: None))
    try:
        while up.proc is None:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert up.proc.poll() is not None and _dirs(runtime) == []
    finally:
        lst.close()


#: A successor that fails its takeover with its own directory (argv[1]) made: on SIGTERM it
#: removes it and exits 0, or (argv[2] == "stubborn") it ignores SIGTERM.
STOPPING_CHILD = r"""
import os, signal, socket, sys, time
fds = dict(p.split("=") for p in os.environ["KVRELAY_TAKEOVER"].split(","))
def stop(*_):
    os.rmdir(sys.argv[1])
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[2] == "stubborn" else stop)
os.mkdir(sys.argv[1])
socket.socket(fileno=int(fds["chan"])).sendall(b'{"msg":"failed","why":"given up"}\n')
time.sleep(60)
"""


@pytest.mark.parametrize(("mode", "rc"), [("clean", 0), ("stubborn", -9)])
async def test_a_successor_given_up_on_is_stopped_before_it_is_killed(
    runtime: Path, mode: str, rc: int
) -> None:
    """SIGTERM first, so the successor removes what it made (its runtime directory, its
    workers); SIGKILL only past the grace, waited for without blocking the loop."""
    lst = _listener()
    made = runtime / "successor-dir"
    up = Upgrader({"grpc": lst}, argv=[sys.executable, "-c", STOPPING_CHILD, str(made), mode],
                  kill_grace_s=1.0)  # fmt: skip

    async def cut(d: Path) -> dict[str, object]:
        return {}

    gaps: list[float] = []

    async def ticks() -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(0.01)
            gaps.append(loop.time() - t0)

    ticker = asyncio.create_task(ticks())
    try:
        with pytest.raises(UpgradeFailed) as info:
            await up.run(cut, lambda pid: None)
        assert (info.value.result, str(info.value)) == ("successor_failed", "given up")
        assert up.proc is not None and up.proc.returncode == rc
        assert made.exists() == (mode == "stubborn") and _dirs(runtime) == []
        assert max(gaps) < 0.5, "the grace is waited for on the loop, not in a blocking wait"
    finally:
        ticker.cancel()
        lst.close()
        if made.exists():
            made.rmdir()


def test_the_takeover_variable_is_parsed_strictly_and_not_inherited() -> None:
    env = {ENV: "chan=7,grpc=8,metrics=9", "OTHER": "x"}
    h = Handoff.from_env(env)
    assert h is not None and ENV not in env  # nothing this process starts inherits it
    assert Handoff.from_env({}) is None
    for bad in ("chan=7", "grpc=8", "chan=x,grpc=8", "chan=7,grpc=8,shell=9"):
        with pytest.raises(ValueError):
            Handoff.from_env({ENV: bad})
    with pytest.raises(ValueError):
        Handoff.from_env({ENV: "chan=7,grpc=8", ENV_PREDECESSOR: "x"})


def test_a_predecessor_dead_before_the_successor_looked_is_not_taken_for_alive() -> None:
    """The successor read its parent's pid when it set the hand-over up: a predecessor killed
    before that left it to init, which then counted as the predecessor, alive ("the predecessor
    serves on" while no relay ran). The predecessor's own pid, passed beside the descriptors,
    is compared with the parent instead."""
    env = {ENV: "chan=7,grpc=8", ENV_PREDECESSOR: str(os.getppid())}
    h = Handoff.from_env(env)
    assert h is not None and ENV_PREDECESSOR not in env and h.predecessor_lives()
    gone = Handoff.from_env({ENV: "chan=7,grpc=8", ENV_PREDECESSOR: str(2**22 + 1)})
    assert gone is not None and not gone.predecessor_lives()  # (its parent is another)


@pytest.mark.parametrize(
    "extra", [{}, {"workers": 2}, {"mirror": {"upstream": "127.0.0.1:1"}}]
)
async def test_sigusr2_is_refused_until_the_daemon_serves(extra: dict[str, object]) -> None:
    """Before it serves there is nothing to hand over (a relay, ``workers = N`` or a mirror
    alike), also once its source and its server or front exist while its workers or metrics
    page start: refused and counted, no successor started."""
    raw: dict[str, object] = {"relay": {"bind": "127.0.0.1:0", "dc_name": "dc"}}
    if "workers" in extra:
        raw["relay"] = {**raw["relay"], "workers": extra["workers"]}  # type: ignore[dict-item]
    elif "mirror" in extra:
        raw["mirror"] = extra["mirror"]
    if "mirror" not in raw:
        raw["pools"] = [{"namespace": "ns", "component": "c", "endpoint": "e",
                         "engines": [{"name": "e0", "grpc_port": 1}]}]  # fmt: skip
    cfg, problems = parse_config(raw, env={})
    assert cfg is not None, problems
    daemon = Daemon(cfg, Notifier({}))
    daemon.request_upgrade()
    assert daemon.upgrades.results["refused"] == 1
    # half-way through its start: the source up, the server or the workers' front made, the
    # workers or the metrics page not yet up (an upgrade then handed over no metrics listener
    # and the successor died binding the port)
    daemon.relay, daemon.mirror = object(), None
    daemon.server = daemon.front = object()
    daemon.request_upgrade()
    assert daemon.upgrades.results["refused"] == 2
    assert daemon._upgrade_task is None
    assert os.environ.get(ENV) is None
    daemon.relay = daemon.server = daemon.front = None


async def test_a_successor_says_stopping_only_once_it_took_over(tmp_path: Path) -> None:
    """Until a successor serves, the unit is its predecessor's: one stopped before (the SIGTERM
    of a predecessor that gave up on it) must not send ``STOPPING=1``, which systemd takes from
    any process of the unit (``NotifyAccess=all``) and would stop the unit the predecessor
    still serves. Once it took over, it is the unit's main process and says it."""
    raw: dict[str, object] = {
        "relay": {"bind": "127.0.0.1:0", "dc_name": "dc"},
        "pools": [{"namespace": "ns", "component": "c", "endpoint": "e",
                   "engines": [{"name": "e0", "grpc_port": 1}]}],
    }  # fmt: skip
    cfg, problems = parse_config(raw, env={})
    assert cfg is not None, problems
    notes = Notifications(tmp_path / "notify.sock")
    try:
        for took_over in (False, True):
            notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
            daemon = Daemon(cfg, notifier, handoff=Handoff({}))
            daemon.took_over = took_over
            await daemon.stop()
        await notes.wait_for("STOPPING=1")
        await asyncio.sleep(0.1)
        [stopping] = notes.messages  # the second daemon's alone, with its stop's bound
        bound_us = int((cfg.shutdown_timeout_s + 5) * 10**6)
        assert stopping == f"STOPPING=1\nEXTEND_TIMEOUT_USEC={bound_us}", stopping
    finally:
        await notes.close()


def test_the_listeners_handed_over_are_not_inherited_by_this_process_s_children() -> None:
    """The predecessor's listeners reach a successor inheritable (they survived its exec), and
    uvloop's subprocesses keep every inheritable descriptor (``close_fds`` is not honoured):
    each fan-out worker a successor started held its metrics listener. The hand-over marks
    them close-on-exec as it reads them; a child started then holds none of them."""
    socks = [socket.socket() for _ in range(3)]
    try:
        for s in socks:
            s.set_inheritable(True)
        fds = dict(zip(("chan", "grpc", "metrics"), (s.fileno() for s in socks), strict=True))
        h = Handoff.from_env({ENV: ",".join(f"{k}={v}" for k, v in fds.items())})
        assert h is not None and h.has("metrics")
        assert not any(os.get_inheritable(fd) for fd in fds.values())
        probe = ("import os, sys; print([f for f in map(int, sys.argv[1:]) "
                 "if os.path.exists(f'/proc/self/fd/{f}')])")

        async def child() -> str:
            p = await asyncio.create_subprocess_exec(
                sys.executable, "-c", probe, *map(str, fds.values()),
                stdout=asyncio.subprocess.PIPE)  # fmt: skip
            return (await p.communicate())[0].decode().strip()

        assert uvloop.run(child()) == "[]"
    finally:
        for s in socks:
            s.close()
