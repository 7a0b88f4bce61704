"""The mirror's wire-level checker and the SDK's replica apply one set of consumer rules
(``client/stream_rules.py``): fed the same frames, they accept the same and refuse the same,
with the same reason. The SDK's replica is the oracle already held to the contract by
``tests/client/test_violations.py``."""

from __future__ import annotations

import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import errors as E
from kvrelay.client.errors import ConsumerViolation
from kvrelay.client.replica import PoolReplica
from kvrelay.contract.producer import producer_key
from kvrelay.mirror.checker import Installed, PoolStreamChecker
from tests.support.scripted_relay import (
    OTHER_RELAY,
    RELAY,
    corrupt_checksum,
    delta,
    frame,
    half_chunk,
    heartbeat,
    producer,
    snapshot,
    table,
)

NO_MARKER = pb.FilterUpdate(
    protocol_version=1, relay=RELAY, producer=producer(), kind=3, contract_marker=0
)
CASES: dict[str, tuple[list[pb.FilterUpdate], str | None]] = {
    "valid": ([*snapshot(3), delta(3, 4), heartbeat(4), delta(4, 5)], None),
    "envelope": ([NO_MARKER], E.ENVELOPE),
    "relay": ([frame(3, 1, 1, b"", relay=OTHER_RELAY)], E.RELAY_IDENTITY_CHANGED),
    "producer": ([frame(3, 1, 1, b"", prod=producer(layout_generation=2))], E.PRODUCER_IDENTITY),
    "unknown kind": ([frame(9, 1, 1, b"")], E.UNKNOWN_KIND),
    "heartbeat first": ([heartbeat(1)], E.HEARTBEAT_BEFORE_SNAPSHOT),
    "heartbeat seq": ([*snapshot(3), heartbeat(5)], E.HEARTBEAT_SEQUENCE),
    "heartbeat payload": ([*snapshot(3), frame(3, 3, 3, b"x")], E.HEARTBEAT_PAYLOAD),
    "delta first": ([delta(0, 1)], E.DELTA_BEFORE_SNAPSHOT),
    "gap": ([*snapshot(3), delta(4, 5)], E.SEQUENCE_GAP),
    "wrong base": ([*snapshot(3), delta(3, 4), delta(3, 4)], E.WRONG_BASE),
    "increment": ([*snapshot(3), frame(2, 3, 5, delta(3, 5).payload)], E.BAD_INCREMENT),
    "delta dc": ([*snapshot(3), delta(3, 4, dc_id=1)], E.DC_ID_MISMATCH),
    "delta epoch": ([*snapshot(3), delta(3, 4, cbi_base=2)], E.EPOCH_MISMATCH),
    "delta kind": ([*snapshot(3), frame(2, 3, 4, snapshot(3)[0].payload)], E.KIND_MISMATCH),
    "chunk after install": ([*snapshot(3), *snapshot(4)], E.UNEXPECTED_SNAPSHOT),
    "chunk base": ([frame(1, 2, 3, snapshot(3)[0].payload)], E.SNAPSHOT_SEQUENCE),
    "chunk kind": ([frame(1, 4, 4, delta(3, 4).payload)], E.KIND_MISMATCH),
    "chunk dc": (snapshot(3, dc_id=1), E.DC_ID_MISMATCH),
    "chunk epoch": ([frame(1, 4, 4, snapshot(3)[0].payload)], E.EPOCH_MISMATCH),
    # (a 1024 lane is one chunk: two are not the producer's split; other cuts: test_units)
    "other cut": ([half_chunk(3, 0), half_chunk(4, 1)], E.CBI1_PREFIX + "bad_chunk"),
    "checksum": ([corrupt_checksum(snapshot(3)[0])], E.CBI1_PREFIX + "checksum_mismatch"),
}


def _replica(frames: list[pb.FilterUpdate]) -> tuple[int, str | None]:
    r = PoolReplica(producer(), RELAY)
    for n, fu in enumerate(frames):
        try:
            r.feed(fu)
        except ConsumerViolation as v:
            return n, v.reason
    return len(frames), None


def _checker(frames: list[pb.FilterUpdate]) -> tuple[int, str | None, object]:
    c = PoolStreamChecker(producer_key(producer()), RELAY)
    last: object = None
    for n, fu in enumerate(frames):
        try:
            _f, out = c.feed(bytes(fu))
        except ConsumerViolation as v:
            return n, v.reason, last
        if isinstance(out, Installed):
            last = out.table
    return len(frames), None, last


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_mirror_and_the_sdk_refuse_the_same_frame_for_the_same_reason(case: str) -> None:
    frames, reason = CASES[case]
    at, got = _replica(frames)
    assert got == reason  # the SDK's verdict is the expected one
    at_m, got_m, _ = _checker(frames)
    assert (at_m, got_m) == (at, got)


def test_the_checker_installs_the_snapshot_the_replica_installs() -> None:
    words = table(7)
    frames = snapshot(3, words)
    r = PoolReplica(producer(), RELAY)
    for fu in frames:
        r.feed(fu)
    _, _, installed = _checker(frames)
    assert r.table is not None and installed is not None
    assert (r.table == words).all() and (installed == words).all()  # type: ignore[attr-defined]
