"""cancel_and_wait: absorbs the target's cancellation, never the caller's."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay._aio import bounded, cancel_all, cancel_and_wait, server_closed, stop_all


async def _slow_to_cancel(started: asyncio.Event) -> None:
    started.set()
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        await asyncio.sleep(0.05)  # cleanup takes a while, as socket closes do
        raise


async def test_target_cancellation_is_absorbed() -> None:
    started = asyncio.Event()
    inner = asyncio.create_task(_slow_to_cancel(started))
    await started.wait()
    await cancel_and_wait(inner)
    assert inner.cancelled()
    await cancel_and_wait(None)  # nothing to do


async def test_caller_cancelled_while_waiting_stays_cancelled() -> None:
    continued: list[bool] = []
    started = asyncio.Event()

    async def owner() -> None:
        inner = asyncio.create_task(_slow_to_cancel(started))
        await started.wait()
        await cancel_and_wait(inner)  # the owner is cancelled while waiting here
        continued.append(True)
        await asyncio.sleep(60)

    task = asyncio.create_task(owner())
    await started.wait()
    await asyncio.sleep(0.01)
    loop_task = task
    # cancel the owner in the middle of its cancel_and_wait
    asyncio.get_running_loop().call_later(0.02, loop_task.cancel)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)
    assert continued == [], "the owner swallowed its own cancellation"


async def test_cancel_all_waits_for_every_task() -> None:
    events = [asyncio.Event() for _ in range(3)]
    tasks = [asyncio.create_task(_slow_to_cancel(e)) for e in events]
    for e in events:
        await e.wait()
    await cancel_all(tasks)
    assert all(t.done() and t.cancelled() for t in tasks)


async def _stubborn(swallowed: list[bool]) -> None:
    """A task whose first cancellation is lost, as Python 3.11's wait_for can lose one."""
    while True:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            if not swallowed:
                swallowed.append(True)
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                continue  # as if the cancellation never arrived
            raise


async def test_a_swallowed_cancellation_is_asked_again() -> None:
    """Python 3.11's wait_for can eat a cancel; the task must still end."""
    swallowed: list[bool] = []

    task = asyncio.create_task(_stubborn(swallowed))
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task), 5)
    assert swallowed == [True] and task.cancelled()


async def test_stop_all_ends_tasks_that_swallow_a_cancellation_and_raises_nothing() -> None:
    """The stops of the mirror, the SDK, the relay and the metrics server cancelled each task
    once and awaited it: one whose cancellation Python 3.11's wait_for swallowed kept the stop
    (and a test) waiting for ever. Errors the tasks end with are read, not raised."""
    swallowed: list[bool] = []

    async def broken() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            raise RuntimeError("boom")

    tasks = [asyncio.create_task(_stubborn(swallowed)), asyncio.create_task(broken())]
    await asyncio.sleep(0)
    await asyncio.wait_for(stop_all(tasks), 5)
    assert swallowed == [True] and all(t.done() for t in tasks)


async def test_a_task_failure_is_raised() -> None:
    async def broken() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("boom")

    task = asyncio.create_task(broken())
    await asyncio.sleep(0.01)
    with pytest.raises(RuntimeError, match="boom"):
        await cancel_and_wait(task)


async def _ends_with_its_own_error(started: asyncio.Event) -> None:
    """A call that turns its cancellation into an error of its own, as grpclib's deadline turns
    it into ``TimeoutError`` and a closing socket raises ``OSError``."""
    started.set()
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        await asyncio.sleep(0)
        raise OSError("connection closed while cancelled") from None


async def _cancelled_owner(wait: object) -> list[dict[str, object]]:
    """Cancel a task waiting in ``wait(call, 10)``; what the loop reported as unhandled."""
    import gc

    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    try:
        started = asyncio.Event()
        owner = asyncio.create_task(wait(_ends_with_its_own_error(started), 10))  # type: ignore[operator]
        await started.wait()
        owner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await owner  # the owner stays cancelled either way
        del owner
        for _ in range(3):
            await asyncio.sleep(0)
            gc.collect()
    finally:
        loop.set_exception_handler(old)
    return reported


async def test_bounded_reads_the_outcome_a_cancelled_caller_never_sees() -> None:
    import sys

    from kvrelay._aio import bounded

    assert await _cancelled_owner(bounded) == []
    if sys.version_info < (3, 12):  # the oracle: 3.11's wait_for drops the inner error
        reported = await _cancelled_owner(asyncio.wait_for)
        assert any("never retrieved" in str(c.get("message")) for c in reported), reported


async def test_bounded_gives_what_wait_for_gives() -> None:
    from kvrelay._aio import bounded

    async def value() -> int:
        await asyncio.sleep(0)
        return 7

    async def fails() -> None:
        await asyncio.sleep(0)
        raise OSError("refused")

    assert await bounded(value(), 1) == 7
    with pytest.raises(OSError, match="refused"):
        await bounded(fails(), 1)
    with pytest.raises(TimeoutError):
        await bounded(asyncio.sleep(5), 0.01)


async def test_bounded_keeps_a_cancellation_that_came_with_the_result() -> None:
    """The inner call ends and the caller is cancelled in the same loop turn: 3.11's
    ``wait_for`` returned the result and dropped the cancellation; ``bounded`` raises it."""
    inner: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    caller = asyncio.create_task(bounded(inner, 5.0))
    await asyncio.sleep(0)  # the caller waits in ``wait_for``
    inner.set_result(1)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    failed: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    caller = asyncio.create_task(bounded(failed, 5.0))
    await asyncio.sleep(0)
    failed.set_exception(OSError("closed"))
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller


async def test_server_closed_does_not_wait_for_a_connection_a_peer_keeps() -> None:
    """A real server with no connection: closed at once. One whose ``wait_closed`` waits for a
    connection that never goes (Python 3.12's asyncio, a peer keeping its connection): given up
    after the bound, the wait cancelled, not left running."""
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    server.close()
    assert await server_closed(server, 5.0)

    class Held:
        waiting: asyncio.Future[None] | None = None

        async def wait_closed(self) -> None:
            self.waiting = asyncio.get_running_loop().create_future()
            await self.waiting  # a connection that never goes

    held = Held()
    assert not await server_closed(held, 0.05)
    assert held.waiting is not None and held.waiting.cancelled()
