"""What ``kvrelay reload`` and ``kvrelay upgrade`` take for a kvrelay daemon (``ops/target.py``):
every way the daemon is started, and nothing else (a stale pid file names any process)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvrelay.ops.target import NotARelay, alive, kvrelay_args, relay_process
from tests.support.timing import scaled


@pytest.mark.parametrize(
    ("argv", "args"),
    [
        # a console script run through its shebang line, and run directly
        (["/opt/kvrelay/venv/bin/python", "/opt/kvrelay/venv/bin/kvrelay", "serve"], ["serve"]),
        (["/usr/local/bin/kvrelay", "mirror", "--upstream", "x:1"],
         ["mirror", "--upstream", "x:1"]),
        (["python3", "-m", "kvrelay", "serve", "-c", "k.toml"], ["serve", "-c", "k.toml"]),
        (["python3", "-mkvrelay", "serve"], ["serve"]),
        (["python3", "-X", "importtime", "-u", "-m", "kvrelay.cli", "serve"], ["serve"]),
        (["python3", "-W", "ignore", "/venv/bin/kvrelay", "serve"], ["serve"]),
        # not kvrelay's command line
        (["sleep", "300"], None),
        (["python3", "-m", "kvrelay.ops.worker"], None),  # a fan-out worker
        (["python3", "-c", "import kvrelay", "kvrelay"], None),
        (["python3", "/srv/app.py", "kvrelay"], None),
        (["sleep", "kvrelay"], None),
        ([], None),
    ],
)
def test_the_command_lines_of_kvrelay(argv: list[str], args: list[str] | None) -> None:
    assert kvrelay_args(argv) == args


def _exec_done(pid: int) -> None:
    """Wait until ``pid``'s command line reads as its own: a child started with vfork lets its
    parent go on inside execve, before the kernel laid out the new arguments (``/proc/PID/
    cmdline`` reads empty for a moment; one in 6 runs on a busy machine)."""
    deadline = time.monotonic() + scaled(10)
    while not Path(f"/proc/{pid}/cmdline").read_bytes():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_process_is_checked_and_read_from_proc(tmp_path: Path) -> None:
    script = tmp_path / "kvrelay"
    script.write_text("import time\ntime.sleep(60)\n")
    daemon = subprocess.Popen([sys.executable, str(script), "serve", "--config", "k.toml"],
                              cwd=tmp_path, env={**os.environ, "KVRELAY_CONFIG": "x"})  # fmt: skip
    other = subprocess.Popen(["sleep", "60"])
    try:
        for p in (daemon, other):
            _exec_done(p.pid)
        proc = relay_process(daemon.pid)
        assert (proc.command, proc.args) == ("serve", ("serve", "--config", "k.toml"))
        assert proc.cwd == str(tmp_path) and proc.environ is not None
        assert proc.environ["KVRELAY_CONFIG"] == "x"
        assert proc.absolute("k.toml") == str(tmp_path / "k.toml")
        assert os.path.samefile(str(proc.resolve("k.toml")).rpartition("/")[0], tmp_path)
        with pytest.raises(NotARelay, match=f"process {other.pid} is not kvrelay: sleep 60"):
            relay_process(other.pid)
    finally:
        for p in (daemon, other):
            p.kill()
    deadline = time.monotonic() + scaled(30)
    while alive(daemon.pid):  # killed, not reaped yet: a zombie, which does not run
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert Path(f"/proc/{daemon.pid}").exists(), "still in the process table"
    daemon.wait()
    other.wait()
    with pytest.raises(ProcessLookupError):
        relay_process(daemon.pid)
