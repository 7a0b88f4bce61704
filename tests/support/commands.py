"""Helpers shared by the operations tests (configs written to tmp files, subprocess runs)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from tests.support.notify import Notifications
from tests.support.timing import scaled

REPO = Path(__file__).resolve().parents[2]

MINIMAL = """\
[relay]
dc_name = "dc-test"

[[pools]]
namespace = "ns"
component = "backend"
endpoint = "generate"

[[pools.engines]]
name = "e0"
grpc_port = 50051
"""


def clean_env(**extra: str) -> dict[str, str]:
    """The test process environment without KVRELAY_* / systemd variables, plus ``extra``."""
    drop = ("KVRELAY_", "NOTIFY_SOCKET", "WATCHDOG_", "CACHE_DIRECTORY", "STATE_DIRECTORY",
            "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


class Daemon(NamedTuple):
    proc: asyncio.subprocess.Process
    env: dict[str, str]
    notes: Notifications
    log: Path


async def start_daemon(tmp_path: Path, *args: str) -> Daemon:
    """``python -m kvrelay *args`` as systemd runs it: ``NOTIFY_SOCKET`` heard by ``notes``,
    ``TMPDIR`` ``tmp_path / "tmp"`` (made if missing; a hot upgrade's cut goes there), stderr
    into ``log`` (``tmp_path / "log.jsonl"``); ``env`` for the commands run beside it."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir(exist_ok=True)
    env = clean_env(NOTIFY_SOCKET=str(tmp_path / "notify.sock"), TMPDIR=str(tmpdir))
    notes = Notifications(tmp_path / "notify.sock")
    log = tmp_path / "log.jsonl"
    with log.open("wb") as f:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvrelay", *args, env=env, cwd=REPO,
            stdout=asyncio.subprocess.DEVNULL, stderr=f,
        )  # fmt: skip
    return Daemon(proc, env, notes, log)


def sigint_as_at_a_shell() -> None:
    """A ``preexec_fn``: SIGINT delivered and handled by default in the child, as a command
    started from an interactive shell has it. A process inherits an ignored or blocked SIGINT,
    and a test process's may be either after the tests it ran before (a command that ignores
    Ctrl-C because its parent did is right, and not what a Ctrl-C test asks)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def kvrelay(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvrelay", *args],
        capture_output=True,
        text=True,
        env=clean_env() if env is None else env,
        cwd=REPO,
        timeout=scaled(timeout),
    )


def static_config(path: Path, dc_name: str) -> Path:
    """A daemon config at ``path``: one pool of one engine on a static ZMQ endpoint nobody
    serves, metrics off, JSON logs (a start to READY with nothing to ingest)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path.write_text(f"""
[relay]
dc_name = "{dc_name}"
bind = "127.0.0.1:0"
[metrics]
enabled = false
[logging]
format = "json"
[[pools]]
namespace = "ns"
component = "backend"
endpoint = "generate"
model = "m"
kv_block_size = 16
[[pools.engines]]
name = "e0"
host = "127.0.0.1"
[pools.engines.static]
endpoint = "tcp://127.0.0.1:{port}"
""")
    return path
