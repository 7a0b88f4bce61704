"""``TestPublisher`` whose replay answers each request on a task of its own.

``TestPublisher`` answers one request at a time: a reply paused at ``pause_after`` holds every
later request until ``mid`` is set. An engine that restarts again and again while the relay
rebuilds from its replay needs each new request answered (up to the pause) while the earlier
replies still wait: here each reply is a task, and a paused one holds only itself (its DEALER is
gone by the time ``mid`` is set: ROUTER drops what it cannot route).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from tests.support.vllm_publisher import TestPublisher


class ConcurrentReplayPublisher(TestPublisher):
    __test__ = False

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)  # (its ``_serve`` task runs once the loop does)
        self._replies: set[asyncio.Task[None]] = set()

    async def _answer(self, ident: bytes, start: int, pause: int | None) -> None:
        task = asyncio.create_task(self._reply(ident, start, pause))
        self._replies.add(task)
        task.add_done_callback(self._replies.discard)

    async def close(self) -> None:
        tasks = [self._task] if self._task is not None else []
        self._task = None
        for task in [*tasks, *self._replies]:  # the server first: no reply starts after
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await super().close()
