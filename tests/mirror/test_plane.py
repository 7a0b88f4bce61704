"""MirrorPlane: epochs per upstream stream, ends forwarded to the readers of that epoch only."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import errors as E
from kvrelay.client import plane_rules as rules
from kvrelay.client.errors import ConsumerViolation
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
    # other content under the version held (the upstream's rules were reloaded): it replaces
    # the held message as the next local version, and later windows keep their differences
    assert p.offer(104, b"other bytes") and p.current() == (v1 + 1, b"other bytes")
    assert p.replaced == 1
    p.offer(106, b"w106")
    assert p.current() == (v1 + 3, b"w106")


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


def _readiness(revision: int, model: str) -> pb.ServingReadinessUpdate:
    return pb.ServingReadinessUpdate(
        protocol_version=1, relay=pb.RelayIdentity(drt_instance_id=7, relay_incarnation=9),
        revision=revision, contract_marker=0x4B565231,
        entries=[pb.TopologyEntry(namespace="ns", canonical_model_id=model,
                                  state=pb.ServingReadinessState.READY,
                                  present_roles=[pb.WorkerRole.PREFILL, pb.WorkerRole.DECODE])],
    )  # fmt: skip


def _reordered(msg: pb.ServingReadinessUpdate) -> bytes:
    """The same message with its fields in another order (valid protobuf: a parser merges)."""
    tail = pb.ServingReadinessUpdate(revision=msg.revision, protocol_version=1,
                                     contract_marker=msg.contract_marker)  # fmt: skip
    head = pb.ServingReadinessUpdate(relay=msg.relay, entries=msg.entries)
    return bytes(tail) + bytes(head)


async def test_a_resend_encoded_otherwise_is_the_same_message() -> None:
    """Readiness re-sends carry the version already held. Encoded in another field order they
    are still the same message (canonical protobuf equality): counted, nothing published, the
    held bytes stay; a different message at that version replaces it (a rules reload
    upstream)."""
    from kvrelay.mirror.mirror import _same_message

    plane = MirrorPlane("readiness", same=_same_message(pb.ServingReadinessUpdate))
    first = _readiness(4, "m")
    assert plane.offer(4, bytes(first))
    other = _reordered(first)
    assert other != bytes(first)
    assert pb.ServingReadinessUpdate.parse(other) == first  # the oracle: one message
    assert not plane.offer(4, other)
    assert plane.current()[1] == bytes(first) and plane.equivalent_resends == 1
    narrowed = bytes(_readiness(4, "another-model"))
    assert plane.offer(4, narrowed) and plane.current()[1] == narrowed
    assert (plane.equivalent_resends, plane.replaced) == (1, 1)
    strict = MirrorPlane("readiness")  # without ``same``: bytes decide
    strict.offer(4, bytes(first))
    assert strict.offer(4, other) and strict.replaced == 1


async def test_the_mirror_and_the_sdk_refuse_a_version_by_one_rule() -> None:
    """A version below the newest of the stream is refused, an equal one is a re-send: one rule
    (``plane_rules.plane_version``) for the mirror's planes and the SDK's plane streams."""
    p = MirrorPlane("readiness")
    p.offer(6, b"r6")
    with pytest.raises(ConsumerViolation) as sdk:
        rules.plane_version("readiness", 6, 5)
    with pytest.raises(PlaneViolation) as mirror:
        p.offer(5, b"r5")
    assert sdk.value.reason == E.VERSION_BACKWARDS
    assert str(mirror.value) == sdk.value.detail == "readiness version went backwards: 5 < 6"
    assert rules.plane_version("readiness", 6, 6) is False and not p.offer(6, b"r6")
    assert rules.plane_version("readiness", 6, 7) and p.offer(7, b"r7")
