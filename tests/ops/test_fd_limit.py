"""The open-file soft limit, raised at start (``kvrelay/ops/fd_limit.py``).

Container runtimes start processes with a soft ``RLIMIT_NOFILE`` of 1024; the relay's
``max_connections`` (4096) needs more. Each case runs in a child process whose limits are set
before it starts, as a runtime sets them, so this test process's own are never touched.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.commands import REPO, clean_env, static_config
from tests.support.timing import scaled

PROBE = """
import json, resource
from kvrelay.ops.fd_limit import raise_soft_limit
got = raise_soft_limit({max_connections})
print(json.dumps([got.before, got.after, got.hard, got.wanted, got.short,
                  resource.getrlimit(resource.RLIMIT_NOFILE)[0]]))
"""


def _limited(soft: int, hard: int):  # type: ignore[no-untyped-def]
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _probe(max_connections: int, soft: int, hard: int) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(max_connections=max_connections)], cwd=REPO,
        env=clean_env(), capture_output=True, text=True, timeout=60,
        preexec_fn=_limited(soft, hard),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout))


def _hard() -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"this machine's hard open-file limit is {hard}")
    return 2048 if hard == resource.RLIM_INFINITY else min(hard, 1 << 16)


def test_the_soft_limit_is_raised_to_what_the_connections_need_within_the_hard_one() -> None:
    hard = _hard()
    before, after, got_hard, wanted, short, now = _probe(4096, 256, hard)
    assert (before, got_hard, wanted) == (256, hard, 4096 + 4096)
    assert after == now == min(wanted, hard)
    assert short is (hard < wanted)
    # never lowered: a soft limit already above what is wanted stays
    assert _probe(16, hard, hard)[1] == hard


def test_a_hard_limit_below_the_need_is_reported_short() -> None:
    _hard()
    before, after, hard, wanted, short, now = _probe(4096, 512, 1024)
    assert (before, after, hard, now) == (512, 1024, 1024, 1024) and wanted == 8192 and short


def test_the_daemon_starts_with_the_raised_limit_and_says_so(tmp_path: Path) -> None:
    hard = _hard()
    cfg = static_config(tmp_path / "kvrelay.toml", "dc-fd")
    log = tmp_path / "log.jsonl"
    with log.open("wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvrelay", "serve", "--config", str(cfg)], cwd=REPO,
            env=clean_env(), stdout=subprocess.DEVNULL, stderr=f, preexec_fn=_limited(256, hard),
        )  # fmt: skip
    try:
        deadline = time.monotonic() + scaled(60)
        events: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            events = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
            if any(e.get("event") == "relay_started" or e.get("event") == "fd_limit_raised"
                   for e in events):  # fmt: skip
                break
            time.sleep(0.05)
        limits = Path(f"/proc/{proc.pid}/limits").read_text()
        (line,) = [x for x in limits.splitlines() if x.startswith("Max open files")]
        assert int(line.split()[3]) == min(8192, hard), line
        raised = next(e for e in events if e.get("event") == "fd_limit_raised")
        assert (raised["before"], raised["soft"]) == (256, min(8192, hard))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(scaled(30))
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
