"""VersionedBroadcast: latest-value semantics, many waiters, monotonic versions, close."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvrelay.publication.broadcast import NonMonotonicVersionError, VersionedBroadcast
from kvrelay.publication.plane import Plane, PlaneClosed
from tests.support.timing import scaled


async def test_current_is_available_immediately() -> None:
    bc: VersionedBroadcast[str] = VersionedBroadcast(0, "initial")
    assert bc.current() == (0, "initial")
    # Already newer than what the caller has: returns without waiting.
    assert await asyncio.wait_for(bc.wait_newer(-1), scaled(1)) == (0, "initial")


async def test_satisfies_the_service_plane_protocol() -> None:
    bc: VersionedBroadcast[str] = VersionedBroadcast(3, "x")
    plane: Plane[str] = bc  # static check (mypy) that the shape matches view.Plane
    assert plane.current() == (3, "x")


async def test_many_waiters_all_wake_with_latest() -> None:
    bc: VersionedBroadcast[int] = VersionedBroadcast(0, 0)
    waiters = [asyncio.create_task(bc.wait_newer(0)) for _ in range(200)]
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)  # nobody returns early
    bc.publish(1, 10)
    bc.publish(5, 50)  # coalesced: waiters see only the newest message
    results = await asyncio.wait_for(asyncio.gather(*waiters), scaled(1))
    assert results == [(5, 50)] * 200


async def test_waiter_waits_past_versions_it_has_seen() -> None:
    bc: VersionedBroadcast[str] = VersionedBroadcast(0, "a")
    bc.publish(1, "b")
    w = asyncio.create_task(bc.wait_newer(1))
    await asyncio.sleep(0.01)
    assert not w.done()
    bc.publish(2, "c")
    assert await asyncio.wait_for(w, scaled(1)) == (2, "c")
    assert await bc.wait_newer(0) == (2, "c")  # a stale reader jumps to the newest version


async def test_waiting_does_not_spin() -> None:
    """Idle waiters burn no CPU: a polling loop would use the whole core for the wall time."""
    bc: VersionedBroadcast[int] = VersionedBroadcast(0, 0)
    waiters = [asyncio.create_task(bc.wait_newer(0)) for _ in range(100)]
    await asyncio.sleep(0)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.sleep(0.2)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    assert cpu < 0.25 * wall, (cpu, wall)
    assert not any(w.done() for w in waiters)
    bc.publish(1, 1)
    assert await asyncio.wait_for(asyncio.gather(*waiters), scaled(1)) == [(1, 1)] * 100


@pytest.mark.parametrize("bad", [3, 2, -1])
async def test_publish_refuses_non_increasing_versions(bad: int) -> None:
    bc: VersionedBroadcast[str] = VersionedBroadcast(0, "a")
    bc.publish(3, "b")
    with pytest.raises(NonMonotonicVersionError) as info:
        bc.publish(bad, "evil")
    assert (info.value.current, info.value.offered) == (3, bad)
    assert bc.current() == (3, "b")  # held state untouched


async def test_close_wakes_waiters_with_plane_closed() -> None:
    bc: VersionedBroadcast[str] = VersionedBroadcast(0, "a")
    waiters = [asyncio.create_task(bc.wait_newer(0)) for _ in range(20)]
    await asyncio.sleep(0)
    bc.close()
    results = await asyncio.wait_for(asyncio.gather(*waiters, return_exceptions=True), scaled(1))
    assert all(isinstance(r, PlaneClosed) for r in results)
    with pytest.raises(PlaneClosed):
        await bc.wait_newer(-1)  # closed wins even when a newer message exists
    with pytest.raises(PlaneClosed):
        bc.publish(1, "b")
    assert bc.current() == (0, "a")
    bc.close()  # idempotent
    assert bc.closed


async def test_cancelled_waiter_does_not_disturb_others() -> None:
    bc: VersionedBroadcast[str] = VersionedBroadcast(0, "a")
    a = asyncio.create_task(bc.wait_newer(0))
    b = asyncio.create_task(bc.wait_newer(0))
    await asyncio.sleep(0)
    a.cancel()
    await asyncio.sleep(0)
    bc.publish(1, "b")
    assert await asyncio.wait_for(b, scaled(1)) == (1, "b")
    assert a.cancelled()


async def test_memory_holds_only_latest() -> None:
    import gc
    import weakref

    class Msg:
        pass

    first = Msg()
    ref = weakref.ref(first)
    bc: VersionedBroadcast[Msg] = VersionedBroadcast(0, first)
    del first
    for v in range(1, 1000):
        bc.publish(v, Msg())
    gc.collect()
    assert ref() is None
    assert bc.current()[0] == 999
