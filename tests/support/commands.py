"""Helpers shared by the operations tests (configs written to tmp files, subprocess runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
