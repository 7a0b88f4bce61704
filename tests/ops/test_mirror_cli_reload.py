"""``kvrelay mirror --config FILE`` with flags reloads its file, the flags kept on top.

Its flags override the file, so it was given no configuration path and every SIGHUP logged
``config_reload_unavailable``: a certificate rotation, a rules edit or a log level needed a
restart, which ends every router's stream. Now a reload reads the file again and applies the same
flags over it (``ops/config.mirror_config``, also what it started from); a mirror started from
flags alone still has no file to read. Real processes, a real upstream over loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from grpclib.client import Channel

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.wire import CONTRACT_MARKER
from kvrelay.service.server import RelayServer
from tests.support.commands import REPO, clean_env
from tests.support.mem_relay import MemRelayView
from tests.support.mirror_rig import QUIET_WINDOW_MS, UPSTREAM_LIMITS
from tests.support.notify import Notifications
from tests.support.timing import scaled


class MirrorProcess:
    """``kvrelay mirror`` under a test-owned NOTIFY_SOCKET, its log read as it comes."""

    def __init__(self, proc: asyncio.subprocess.Process, notes: Notifications) -> None:
        self.proc = proc
        self.notes = notes
        self.log: list[str] = []
        self.port = 0
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        async for line in self.proc.stderr:
            self.log.append(line.decode(errors="replace"))

    def text(self) -> str:
        return "".join(self.log)

    async def until(self, done: str, *, unless: str, timeout: float = 30) -> str:
        """The latest notification starting with ``done``; fails at once when the log says
        ``unless`` (or the process ended)."""
        deadline = time.monotonic() + scaled(timeout)
        while True:
            hits = [m for m in self.notes.messages if m.startswith(done)]
            if hits:
                return hits[-1]
            assert unless not in self.text(), self.text()[-3000:]
            assert self.proc.returncode is None, self.text()[-3000:]
            assert time.monotonic() < deadline, (self.notes.messages, self.text()[-3000:])
            await asyncio.sleep(0.02)

    async def logged(self, needle: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + scaled(timeout)
        while needle not in self.text():
            assert self.proc.returncode is None, self.text()[-3000:]
            assert time.monotonic() < deadline, self.text()[-3000:]
            await asyncio.sleep(0.02)

    async def stop(self) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), scaled(20))
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._reader, scaled(5))
        await self.notes.close()
        return int(self.proc.returncode or 0)


@contextlib.asynccontextmanager
async def _mirror(tmp_path: Path, *args: str) -> AsyncIterator[MirrorProcess]:
    """``kvrelay mirror *args`` of a fresh in-memory upstream (``--upstream`` is appended), once
    READY; stopped (SIGTERM) on the way out, where it must exit 0."""
    view = MemRelayView(UPSTREAM_LIMITS, window_ms=QUIET_WINDOW_MS)
    upstream = RelayServer(view, UPSTREAM_LIMITS)
    await upstream.start("127.0.0.1", 0)
    notes = Notifications(tmp_path / "notify.sock")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrelay", "mirror", *args, "--upstream",
        f"127.0.0.1:{upstream.port}", "--bind", "127.0.0.1:0", "--metrics-bind", "off",
        env=clean_env(NOTIFY_SOCKET=str(tmp_path / "notify.sock")), cwd=REPO,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    m = MirrorProcess(proc, notes)
    try:
        ready = await m.until("READY=1", unless="start_failed", timeout=60)
        found = re.search(r"serving gRPC on 127\.0\.0\.1:(\d+)", ready)
        assert found, ready
        m.port = int(found.group(1))
        notes.messages.clear()
        yield m
    finally:
        rc = await m.stop()
        with contextlib.suppress(Exception):
            await upstream.close(grace_s=0.5)
    assert rc == 0, m.text()[-3000:]


async def test_a_mirror_started_with_flags_reloads_its_file_and_keeps_the_flags(
    tmp_path: Path,
) -> None:
    """The file names no reachable upstream and no bind: the flags do. A reload after the
    log level went from ``warning`` to ``info`` is applied (its own ``config_reloaded`` line is
    then written), names no restart-only change (the flags still win over the file), and the
    mirror goes on serving its flag's upstream."""
    conf = tmp_path / "mirror.toml"
    body = '[mirror]\nupstream = "127.0.0.1:1"\n[logging]\nformat = "json"\nlevel = "{}"\n'
    conf.write_text(body.format("warning"))
    async with _mirror(tmp_path, "--config", str(conf)) as m:
        conf.write_text(body.format("info"))
        m.proc.send_signal(signal.SIGHUP)
        done = await m.until("READY=1", unless="config_reload_unavailable")
        assert "reload applied" in done, done
        async with Channel("127.0.0.1", m.port) as ch:  # it still mirrors the flag's upstream
            info = await asyncio.wait_for(pb.KvEventRelayStub(ch).get_relay_info(
                pb.RelayInfoRequest(contract_marker=CONTRACT_MARKER)), scaled(10))  # fmt: skip
            assert info.relay is not None
    log = m.text()
    assert '"config_reloaded"' in log, log[-3000:]  # written at the level the reload set
    assert "config_reload_restart_required" not in log, log[-3000:]


async def test_a_mirror_started_from_flags_alone_has_no_file_to_reload(tmp_path: Path) -> None:
    async with _mirror(tmp_path) as m:
        m.proc.send_signal(signal.SIGHUP)
        await m.logged("config_reload_unavailable")
        assert "started without a config file" in m.text()
