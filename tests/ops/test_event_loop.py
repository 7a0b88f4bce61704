"""relay.event_loop: ``auto`` runs uvloop where it is installed and the standard loop where it
is not; ``uvloop`` without the package is a start-up error, not a silent fallback."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.ops.event_loop import GIL_SWITCH_INTERVAL_S, loop_factory, loop_name


def _run_named(name: str) -> str:
    async def which() -> str:
        return loop_name(asyncio.get_running_loop())

    with asyncio.Runner(loop_factory=loop_factory(name)) as runner:
        return runner.run(which())


def test_auto_runs_uvloop_where_installed() -> None:
    pytest.importorskip("uvloop")
    assert _run_named("auto") == "uvloop"
    assert _run_named("uvloop") == "uvloop"
    assert _run_named("asyncio") == "asyncio"


def test_auto_falls_back_without_uvloop_and_uvloop_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # ``import uvloop`` now raises ImportError
    assert loop_factory("auto") is None
    assert _run_named("auto") == "asyncio"
    with pytest.raises(ImportError):
        loop_factory("uvloop")


def test_the_daemon_runs_with_a_1ms_gil_switch_interval(tmp_path: Path) -> None:
    """``daemon.run`` sets the interval before its loop starts (CPython's default is 5 ms): the
    value its ``main`` sees, in a fresh interpreter (5 ms before it), is 1 ms."""
    from tests.support.commands import MINIMAL

    f = tmp_path / "k.toml"
    f.write_text(MINIMAL)
    probe = (
        "import sys\n"
        "from kvrelay.ops.config import load_config\n"
        "from kvrelay.ops.daemon import run\n"
        "async def main(cfg):\n"
        "    print('interval', sys.getswitchinterval())\n"
        "    return 0\n"
        f"sys.exit(run(load_config({str(f)!r}), main))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert f"interval {GIL_SWITCH_INTERVAL_S}" in out.stdout.splitlines()
    assert GIL_SWITCH_INTERVAL_S == 0.001
