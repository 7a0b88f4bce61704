"""``kvrelay reload`` and ``kvrelay upgrade`` against a real ``kvrelay serve``: what they signal,
and what they say came of it.

The stand-in relays of ``tests/test_cli.py`` cover the refusals one by one; here the audit's
cases run against the daemon itself: a reload of another file than the relay reads (the relay
re-read its own and the tool said "applied"), a reload of a stopped relay (its metrics endpoint
takes the connection and never answers: the tool said the outcome was in the log and exited 0),
and a hot upgrade whose old process is killed before any successor took over (the tool said
"handed over to pid <the dead pid>" and exited 0 while nothing served).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

from benchmarks._common import free_port
from kvrelay.ops.reload import reload_report
from kvrelay.ops.target import alive
from tests.support.commands import REPO, start_daemon, static_config
from tests.support.notify import Notifications
from tests.support.timing import scaled


async def _cli(*args: str, env: dict[str, str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrelay", *args, env=env, cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), scaled(120))
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def _events(log: Path, name: str) -> list[dict[str, object]]:
    found = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if event.get("event") == name:
                found.append(event)
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: an orphaned successor's zombie (no init to reap it) does not."""
    return alive(pid)


async def _end(
    old: asyncio.subprocess.Process, successor: int | None, notes: Notifications
) -> None:
    """The relay killed if it runs, ``successor`` too; ``notes`` closed."""
    if old.returncode is None:
        old.kill()
        await old.wait()
    if successor is not None and _alive(successor):
        os.kill(successor, signal.SIGKILL)
    await notes.close()


async def test_reload_and_upgrade_report_only_what_the_relay_did(tmp_path: Path) -> None:
    metrics = free_port()
    cfg = static_config(tmp_path / "kvrelay.toml", "dc-signals")
    cfg.write_text(cfg.read_text().replace("enabled = false", f'bind = "127.0.0.1:{metrics}"'))
    other = tmp_path / "other.toml"  # valid, and not the relay's
    other.write_text(cfg.read_text().replace('"dc-signals"', '"dc-other"'))
    pid_file = tmp_path / "kvrelay.pid"
    old, env, notes, log = await start_daemon(tmp_path, "serve", "--config", str(cfg),
                                              "--pid-file", str(pid_file))  # fmt: skip
    assert old.pid is not None
    successor: int | None = None
    stopped = False
    try:
        await notes.wait_for("READY=1", timeout=120)
        before = reload_report("127.0.0.1", metrics)
        assert before is not None and before.counts == {"applied": 0, "rejected": 0, "failed": 0}

        # another file than the relay's: nothing signalled, exit 2
        rc, out = await _cli("reload", "--config", str(other), "--pid-file", str(pid_file),
                             env=env)  # fmt: skip
        assert rc == 2, out
        assert f"{other} is not the file process {old.pid} reads ({cfg})" in out, out

        # a stopped relay: its endpoint accepts and never answers; exit 1, nothing signalled
        os.kill(old.pid, signal.SIGSTOP)
        stopped = True
        rc, out = await _cli("reload", "--config", str(cfg), "--pid-file", str(pid_file),
                             "--timeout", "2", env=env)  # fmt: skip
        os.kill(old.pid, signal.SIGCONT)
        stopped = False
        assert rc == 1, out
        assert f"metrics endpoint (127.0.0.1:{metrics}) accepted the connection but did not " \
               "answer within 2 s" in out, out
        await asyncio.sleep(0.5)
        assert reload_report("127.0.0.1", metrics) == before, "a SIGHUP reached the relay"
        assert _events(log, "config_reloaded") == []

        # the relay's own file, as it is: applied
        rc, out = await _cli("reload", "--config", str(cfg), "--pid-file", str(pid_file),
                             env=env)  # fmt: skip
        assert (rc, out.strip()) == (0, "kvrelay reload: applied"), out

        # a hot upgrade whose old process is killed before its successor took over
        upgrade = asyncio.ensure_future(_cli("upgrade", "--pid-file", str(pid_file),
                                             "--timeout", "60", env=env))  # fmt: skip
        deadline = asyncio.get_running_loop().time() + scaled(60)
        while not (started := _events(log, "upgrade_started")):
            assert asyncio.get_running_loop().time() < deadline, "no upgrade_started"
            await asyncio.sleep(0.02)
        successor = int(str(started[0]["successor_pid"]))
        old.kill()
        await old.wait()
        rc, out = await upgrade
        assert rc == 1, out
        assert "handed over" not in out, out
        assert (f"the relay exited without a hand-over: process {old.pid} is gone and its pid "
                f"file {pid_file} names the old process still") in out, out  # fmt: skip
        assert int(pid_file.read_text()) == old.pid  # no successor took it over
    finally:
        if stopped:
            os.kill(old.pid, signal.SIGCONT)
        await _end(old, successor, notes)


async def test_upgrade_without_a_pid_file_confirms_the_take_over_on_the_metrics_page(
    tmp_path: Path,
) -> None:
    """A relay started without ``--pid-file``, upgraded by ``--pid``: nothing names the new
    process, so its metrics page (on the inherited listener) must say it took over, and the
    child of the old process that lives on is named."""
    metrics = free_port()
    cfg = static_config(tmp_path / "kvrelay.toml", "dc-upgrade")
    cfg.write_text(cfg.read_text().replace("enabled = false", f'bind = "127.0.0.1:{metrics}"'))
    old, env, notes, log = await start_daemon(tmp_path, "serve", "--config", str(cfg))
    assert old.pid is not None
    successor: int | None = None
    try:
        await notes.wait_for("READY=1", timeout=120)
        rc, out = await _cli("upgrade", "--pid", str(old.pid), "--timeout", "120", env=env)
        [started] = _events(log, "upgrade_started")
        successor = int(str(started["successor_pid"]))
        assert (rc, out.strip()) == (0, f"kvrelay upgrade: handed over to pid {successor}"), out
        assert await asyncio.wait_for(old.wait(), scaled(30)) == 0
        assert _alive(successor)
        os.kill(successor, signal.SIGTERM)
        deadline = asyncio.get_running_loop().time() + scaled(30)
        while _alive(successor):
            assert asyncio.get_running_loop().time() < deadline, "the successor did not stop"
            await asyncio.sleep(0.05)
        successor = None
    finally:
        await _end(old, successor, notes)


async def test_an_upgrade_the_relay_does_not_take_on_is_reported_without_the_whole_wait(
    tmp_path: Path,
) -> None:
    """A relay that takes no upgrade on (here stopped; a relay still starting refuses one) starts
    no successor: ``kvrelay upgrade`` waited out its whole ``--timeout`` (120 s by default) and
    then pointed at ``upgrade_failed``, which such a relay never logs. It now says so once no
    successor came within half the timeout (at most 10 s)."""
    cfg = static_config(tmp_path / "kvrelay.toml", "dc-refused")
    pid_file = tmp_path / "kvrelay.pid"
    old, env, notes, _log = await start_daemon(tmp_path, "serve", "--config", str(cfg),
                                               "--pid-file", str(pid_file))  # fmt: skip
    assert old.pid is not None
    try:
        await notes.wait_for("READY=1", timeout=120)
        os.kill(old.pid, signal.SIGSTOP)
        t0 = asyncio.get_running_loop().time()
        rc, out = await _cli("upgrade", "--pid-file", str(pid_file), "--timeout", "60", env=env)
        took = asyncio.get_running_loop().time() - t0
        assert rc == 1, out
        assert f"process {old.pid} started no successor within 10 s" in out, out
        assert "upgrade_refused" in out and took < 50, (took, out)
    finally:
        old.kill()  # (stopped, with a SIGUSR2 pending: never let it run on)
        await old.wait()
        await notes.close()
