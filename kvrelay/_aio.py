"""Small asyncio helpers shared by every component that owns background tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
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


async def stop_all(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel every task and wait until each has finished, asking again every
    ``_RECANCEL_S`` while one still runs; what a task ended with (its cancellation, an error)
    is read, not raised: a stop must finish.

    Why not ``cancel()`` then ``with suppress(CancelledError, Exception): await t``: a
    cancellation Python 3.11's ``wait_for`` swallowed left the task running and that ``await``
    waiting for ever (a mirror's stop, so a test, hung), and the ``suppress`` also swallowed the
    caller's own cancellation. Here the caller's cancellation propagates (``asyncio.wait``)."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    for t in tasks:
        while not t.done():
            done, _ = await asyncio.wait({t}, timeout=_RECANCEL_S)
            if not done:
                t.cancel()
        _read_outcome(t)


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

    And the other way round: when the inner call ends and the caller is cancelled in the same
    loop turn, 3.11's ``wait_for`` returns the result (or the error) and drops the
    cancellation (a client that sends its request and resets the stream in one write: the
    handler went on to a stream already gone, and grpclib logged "Failed to handle
    cancellation" at ERROR). The cancellation is still counted on the caller's task
    (``cancelling``), so it is raised here.
    """
    caller = asyncio.current_task()
    asked = 0 if caller is None else caller.cancelling()
    task = asyncio.ensure_future(aw)
    task.add_done_callback(_read_outcome)
    try:
        result = await asyncio.wait_for(task, timeout)
    except Exception:
        if caller is not None and caller.cancelling() > asked:
            raise asyncio.CancelledError from None
        raise
    if caller is not None and caller.cancelling() > asked:
        raise asyncio.CancelledError
    return result


def _read_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def drop(waiting: asyncio.Future[Any]) -> None:
    """Give up a wait: cancelled if still pending, and its outcome read whenever it ends (an
    error it ended with, a plane's end say, is never "never retrieved")."""
    waiting.cancel()
    waiting.add_done_callback(_read_outcome)


class GiveUpUnwritten:
    """One task's sends on a stream, each of which may be given up while it has written nothing
    of its message: HTTP/2 flow control holds DATA, never HEADERS, so a stream that ends while
    its send waits for a window its client may never open can send its status at once, provided
    no byte of the message is on the wire (trailers after part of a message would read as its
    rest). ``written`` counts the DATA bytes the stream has written (None: sends are awaited
    whole). The pool streams' pump and the plane streams' sends share this one rule."""

    __slots__ = ("_given_up", "_mark", "_task", "_written")

    def __init__(self, written: Callable[[], int] | None) -> None:
        self._written = written
        self._task: asyncio.Task[Any] | None = None
        self._mark: int | None = None  # ``written()`` when the send in flight started
        self._given_up = False

    async def send(self, sending: Awaitable[None]) -> bool:
        """Await ``sending`` in the calling task; False when ``give_up`` gave it up."""
        written, task = self._written, asyncio.current_task()
        if written is None or task is None:
            await sending
            return True
        self._task, self._mark = task, written()
        try:
            await sending
        except asyncio.CancelledError:
            if not self._given_up or task.uncancel() > 0:
                raise  # cancelled from elsewhere too (a reset, the server's close)
            return False
        finally:
            self._mark = None
            self._given_up = False
        return True

    def give_up(self) -> None:
        """Give the send in flight up if it has written nothing of its message (from outside
        the sending task: inside it, nothing is suspended in the send, and the task checks the
        end itself once the send returns). One in the middle of its message is left to finish."""
        mark, written, task = self._mark, self._written, self._task
        if mark is None or written is None or task is None or self._given_up or task.done():
            return
        if task is asyncio.current_task() or written() != mark:
            return
        self._given_up = True
        task.cancel()


#: How long a simulated engine's stop waits for its servers' connections to go.
SERVER_CLOSE_WAIT_S = 1.0


async def server_closed(server: Any, within_s: float = SERVER_CLOSE_WAIT_S) -> bool:
    """``await server.wait_closed()`` (after its ``close()``), for at most ``within_s``: whether it
    returned. Why bounded: from Python 3.12 asyncio's ``Server.wait_closed`` (which grpclib's
    awaits) waits for every connection the server accepted, and a peer may keep one open (a
    relay's Control channel to an engine that stops); on 3.11 it returns at once."""
    waiting = asyncio.ensure_future(server.wait_closed())
    done, _ = await asyncio.wait({waiting}, timeout=within_s)
    if not done:
        await cancel_and_wait(waiting)
        return False
    waiting.result()
    return True


class NextTime:
    """A future for the next time something happens: waiters take ``next()`` (one shared
    future until then), the event calls ``fire()``, which resolves it and starts a new one at
    the next ``next()``. Waiters use ``asyncio.wait`` on it, so the shared future is never
    cancelled with one of them."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next: asyncio.Future[None] | None = None

    def next(self) -> asyncio.Future[None]:
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        return self._next

    def fire(self) -> None:
        fired, self._next = self._next, None
        if fired is not None and not fired.done():
            fired.set_result(None)
