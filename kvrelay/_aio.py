"""Small asyncio helpers shared by every component that owns background tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

_RECANCEL_S = 0.5


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait until it has finished.

    The task's own ``CancelledError`` is expected and absorbed, but if the *caller* is being
    cancelled while it waits, the cancellation propagates: the usual
    ``with suppress(CancelledError): await task`` would swallow it and leave the caller running
    (a watcher loop that never stops). A failure of the task other than cancellation is raised.
    """
    if task is None:
        return
    task.cancel()
    # ``asyncio.wait`` never raises the task's outcome, only the caller's own cancellation.
    # Python 3.11's ``wait_for`` can swallow a cancellation that races with its inner future,
    # leaving the task running: ask again until it is really done.
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=_RECANCEL_S)
        if not done:
            task.cancel()
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


async def cancel_all(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel every task, then wait for each (see ``cancel_and_wait``)."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    for t in tasks:
        await cancel_and_wait(t)
