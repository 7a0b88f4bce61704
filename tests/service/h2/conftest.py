"""The HTTP/2 abuse tests run on asyncio's loop and on uvloop's: uvloop's transports keep a
protocol's ``data_received`` as it was when they were made (a guard installed later is never
called there), and the daemon runs uvloop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.nodeid.split("::")[0].endswith(("test_abuse.py", "test_window_updates.py")) and (
        "busy_subscribers" not in item.nodeid  # (seconds of traffic: the guard is loop-blind)
    ):
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}
