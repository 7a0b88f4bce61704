"""``relay/forked.py``: the child sees memory as it was at the fork, its result or error comes back
on the event loop, and a killed or finished child leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

from kvrelay.relay.forked import Child


async def test_the_child_sees_the_memory_of_the_fork_and_reports_back() -> None:
    a = np.arange(1000, dtype=np.uint64)
    child = Child(lambda: str(int(a.sum())))
    a[:] = 0  # the parent goes on changing it: the child's image does not
    ok, text = await asyncio.wait_for(child.done, 30)
    assert ok and text == str(sum(range(1000)))
    assert not os.path.exists(f"/proc/{child.pid}")


async def test_an_error_in_the_child_comes_back_as_text() -> None:
    def boom() -> str:
        raise ValueError("no room on the disk")

    ok, text = await asyncio.wait_for(Child(boom).done, 30)
    assert not ok and text == "ValueError: no room on the disk"


async def test_a_killed_child_is_reaped() -> None:
    def slow() -> str:
        time.sleep(60)
        return "late"

    child = Child(slow)
    child.kill()
    ok, text = await asyncio.wait_for(child.done, 30)
    assert not ok and "exited with" in text
    assert not os.path.exists(f"/proc/{child.pid}")


async def test_without_pidfd_a_thread_waits_for_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pidfd(_pid: int) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    ok, text = await asyncio.wait_for(Child(lambda: "done").done, 30)
    assert ok and text == "done"
