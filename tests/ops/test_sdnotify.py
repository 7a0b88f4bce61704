"""sd_notify over a real AF_UNIX datagram socket owned by the test (path and abstract names)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from pathlib import Path

from kvrelay.ops.sdnotify import Notifier
from tests.support.timing import scaled


def _listener(address: str | bytes) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(address)
    s.settimeout(2.0)
    return s


def test_path_socket_receives_states(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with _listener(path) as sock:
        n = Notifier({"NOTIFY_SOCKET": path})
        assert n.enabled
        assert n.ready("serving")
        assert n.stopping()
        assert n.stopping(12.5)
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving"
        assert sock.recv(4096) == b"STOPPING=1"
        assert sock.recv(4096) == b"STOPPING=1\nEXTEND_TIMEOUT_USEC=12500000"
        assert n.sent == 3 and n.failures == 0
        n.close()


def test_abstract_namespace_socket() -> None:
    name = f"kvrelay-test-{os.getpid()}"
    with _listener(b"\0" + name.encode()) as sock:
        n = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert n.notify("WATCHDOG=1")
        assert sock.recv(4096) == b"WATCHDOG=1"
        n.close()


def test_outside_systemd_everything_is_a_noop() -> None:
    n = Notifier({})
    assert not n.enabled and n.watchdog_s is None
    assert not n.ready() and not n.stopping() and n.sent == 0


def test_send_failure_is_counted_not_raised(tmp_path: Path) -> None:
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")})
    assert not n.ready() and not n.ready()
    assert n.failures == 2 and n.sent == 0


def test_watchdog_interval_and_pid() -> None:
    assert Notifier({"WATCHDOG_USEC": "3000000"}).watchdog_s == 3.0
    mine = {"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier(mine).watchdog_s == 3.0
    assert Notifier({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}).watchdog_s is None
    assert Notifier({"WATCHDOG_USEC": "0"}).watchdog_s is None
    assert Notifier({"WATCHDOG_USEC": "soon"}).watchdog_s is None


async def test_watchdog_pings_at_half_the_interval(tmp_path: Path) -> None:
    path = str(tmp_path / "wd.sock")
    with _listener(path) as sock:
        sock.setblocking(False)
        n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000"})  # 0.1 s → ping / 0.05 s
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        task = asyncio.create_task(n.watchdog_loop())
        pings, deadline = 0, t0 + scaled(5.0)
        while pings < 6:
            try:
                assert sock.recv(64) == b"WATCHDOG=1"
                pings += 1
            except BlockingIOError:
                assert loop.time() < deadline, f"{pings} pings in {loop.time() - t0:.2f} s"
                await asyncio.sleep(0.005)
        elapsed = loop.time() - t0
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        # six pings, the first at once: five half-intervals at least (never faster), and about
        # that on a quiet machine (a busy one stretches it)
        assert 5 * 0.05 * 0.9 <= elapsed <= scaled(0.5), elapsed
        n.close()
