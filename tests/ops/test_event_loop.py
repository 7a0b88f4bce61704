"""relay.event_loop: ``auto`` runs uvloop where it is installed and the standard loop where it
is not; ``uvloop`` without the package is a start-up error, not a silent fallback."""

from __future__ import annotations

import asyncio
import sys

import pytest

from kvrelay.ops.event_loop import loop_factory, loop_name


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
