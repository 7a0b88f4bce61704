"""MirrorPlane: epochs per upstream stream, ends forwarded to the readers of that epoch only."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.contract.errors import Reason, RelayError
from kvrelay.mirror.plane import MirrorPlane, PlaneViolation
from kvrelay.publication.plane import PlaneEnded


async def test_down_until_an_upstream_stream_delivers() -> None:
    p = MirrorPlane("catalog")
    with pytest.raises(RelayError) as ei:
        p.current()
    assert ei.value.reason == Reason.PUBLICATION_UNAVAILABLE
    assert p.offer(5, b"rev5")
    assert p.current() == (0, b"rev5") and p.upstream_version == 5


async def test_versions_keep_upstream_differences_and_skip_resends() -> None:
    p = MirrorPlane("load")
    p.offer(100, b"w100")
    v0, _ = p.current()
    assert not p.offer(100, b"w100")  # a re-send changes nothing
    p.offer(104, b"w104")
    v1, data = p.current()
    assert v1 - v0 == 4 and data == b"w104"  # load lag is computed on these differences
    with pytest.raises(PlaneViolation):
        p.offer(103, b"w103")
    with pytest.raises(PlaneViolation):
        p.offer(104, b"other bytes")


async def test_readers_of_an_ended_epoch_end_with_its_status() -> None:
    p = MirrorPlane("catalog")
    p.offer(1, b"a")
    v, _ = p.current()
    waiter = asyncio.ensure_future(p.wait_newer(v))
    await asyncio.sleep(0)
    p.offer(2, b"b")
    assert await waiter == (v + 1, b"b")
    waiter = asyncio.ensure_future(p.wait_newer(v + 1))
    await asyncio.sleep(0)
    lagged = RelayError.publication_unavailable("the mirror fell behind its upstream")
    p.end(lagged)
    with pytest.raises(RelayError) as ei:
        await waiter
    assert ei.value.message == lagged.message
    with pytest.raises(RelayError):
        p.current()  # new readers are refused while no upstream stream delivers
    # next stream: a new epoch above every old version; old readers still get their end
    p.offer(2, b"b")
    nv, _ = p.current()
    assert nv > v + 1
    with pytest.raises(RelayError):
        await p.wait_newer(v + 1)
    p.end(None, "the upstream restarted")
    with pytest.raises(PlaneEnded):
        await p.wait_newer(nv)
