"""Client tests: a watchdog turns a hung test into a dump of every asyncio task's stack."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import threading
from collections.abc import AsyncIterator

import pytest

WATCHDOG_S = 30.0
WATCHDOG_FILE = os.path.join(tempfile.gettempdir(), f"kvrelay-client-watchdog-{os.getpid()}.txt")


def _dump(loop: asyncio.AbstractEventLoop, path: str) -> None:
    # a file, not stderr: pytest captures fd 2 and a killed run would lose the dump
    with open(path, "a") as out:
        print(f"\n=== watchdog: test still running after {WATCHDOG_S}s ===", file=out)
        for task in asyncio.all_tasks(loop):
            task.print_stack(file=out)


@pytest.fixture(autouse=True)
async def _asyncio_watchdog() -> AsyncIterator[None]:
    """A thread (not a loop timer) so it fires even if the loop has nothing else scheduled."""
    loop = asyncio.get_running_loop()
    done = threading.Event()

    def watch() -> None:
        if not done.wait(WATCHDOG_S):
            loop.call_soon_threadsafe(_dump, loop, WATCHDOG_FILE)
            print(f"asyncio watchdog fired; task stacks in {WATCHDOG_FILE}", file=sys.stderr)

    threading.Thread(target=watch, daemon=True).start()
    try:
        yield
    finally:
        done.set()
