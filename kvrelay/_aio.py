"""Small asyncio helpers shared by every component that owns background tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")

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


async def bounded(aw: Awaitable[T], timeout: float) -> T:
    """``asyncio.wait_for(aw, timeout)``, except that the inner call's outcome is always read.

    When the caller is cancelled while the inner call is ending with an error of its own (grpclib
    turns its deadline's cancellation into ``TimeoutError``; a socket close raises ``OSError``),
    Python 3.11's ``wait_for`` re-raises the caller's cancellation and drops that error: the loop
    then logs "Task exception was never retrieved", with a traceback, for something already
    handled. Here the inner task reads its own outcome when it ends. The caller sees exactly
    what ``wait_for`` gives it: the result, the error, ``TimeoutError`` or its own cancellation.
    """
    task = asyncio.ensure_future(aw)
    task.add_done_callback(_read_outcome)
    return await asyncio.wait_for(task, timeout)


def _read_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
