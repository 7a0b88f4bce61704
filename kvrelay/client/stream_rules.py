"""The consumer rules of one SubscribeKvPool stream, written once (§4.7 and §5).

The SDK's ``PoolReplica`` (on parsed messages) and the mirror's ``PoolStreamChecker`` (on wire
bytes) both check every frame with these functions, so the two can never disagree on what a
relay may send: the envelope, snapshot chunks at one cut before install, contiguous deltas whose
CBI1 epochs match the envelope, heartbeats only at the installed sequence, the CBI1 payload
itself. A broken rule raises :class:`ConsumerViolation` with the reason from ``errors.py``.
"""

from __future__ import annotations

from typing import NoReturn

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import errors as E
from kvrelay.client.errors import ConsumerViolation
from kvrelay.contract.errors import RelayError
from kvrelay.contract.producer import ProducerKey, producer_key
from kvrelay.contract.wire import CONTRACT_MARKER, PROTOCOL_VERSION
from kvrelay.publication import cbi1

__all__ = [
    "assemble",
    "chunk_frame",
    "chunk_sequence",
    "decode",
    "delta_frame",
    "delta_sequence",
    "envelope",
    "heartbeat",
    "producer",
    "unknown_kind",
]


def envelope(marker: int | None, version: int) -> None:
    if marker != CONTRACT_MARKER or version != PROTOCOL_VERSION:
        shown = "none" if marker is None else f"{marker:#x}"
        raise ConsumerViolation(E.ENVELOPE, f"marker {shown} version {version}")


def producer(identity: pb.ProducerIdentity | None, subscribed: ProducerKey) -> ProducerKey:
    """The frame's producer must be exactly the subscribed one; returns its key."""
    try:
        pk = producer_key(identity)
    except RelayError as exc:
        raise ConsumerViolation(E.PRODUCER_IDENTITY, exc.message) from None
    if pk != subscribed:
        raise ConsumerViolation(E.PRODUCER_IDENTITY, "frame producer != subscribed one")
    return pk


def heartbeat(installed: int | None, base: int, seq: int, payload_bytes: int) -> None:
    if installed is None:
        raise ConsumerViolation(E.HEARTBEAT_BEFORE_SNAPSHOT)
    if base != seq or seq != installed:
        raise ConsumerViolation(E.HEARTBEAT_SEQUENCE, f"{base}->{seq}, installed {installed}")
    if payload_bytes:
        raise ConsumerViolation(E.HEARTBEAT_PAYLOAD, f"{payload_bytes} bytes")


def unknown_kind(kind: int) -> NoReturn:
    raise ConsumerViolation(E.UNKNOWN_KIND, str(kind))


def decode(payload: bytes, seed: int, bucket_count: int) -> cbi1.SnapshotChunk | cbi1.Delta:
    """The frame's CBI1 payload, checked against the subscribed filter's seed and size."""
    try:
        return cbi1.decode(payload, expected_seed=seed, expected_bucket_count=bucket_count)
    except cbi1.Cbi1Error as exc:
        raise ConsumerViolation(E.CBI1_PREFIX + exc.reason, str(exc)) from None


def chunk_sequence(installed: int | None, base: int, seq: int) -> None:
    """A snapshot chunk's envelope, before its payload is decoded."""
    if installed is not None:
        raise ConsumerViolation(E.UNEXPECTED_SNAPSHOT, f"chunk at {seq} after install")
    if base != seq:
        raise ConsumerViolation(E.SNAPSHOT_SEQUENCE, f"base {base} != sequence {seq}")


def chunk_frame(
    frame: cbi1.SnapshotChunk | cbi1.Delta, dc_id: int, seq: int, assembling: int | None
) -> cbi1.SnapshotChunk:
    """A decoded snapshot chunk: a chunk, of this data centre, at the envelope's sequence, of
    the cut being assembled (``assembling``: its sequence, None before the first chunk)."""
    if not isinstance(frame, cbi1.SnapshotChunk):
        raise ConsumerViolation(E.KIND_MISMATCH, "SNAPSHOT_CHUNK frame carries a delta")
    if frame.dc_id != dc_id:
        raise ConsumerViolation(E.DC_ID_MISMATCH, f"{frame.dc_id} != {dc_id}")
    if frame.epoch != seq:
        raise ConsumerViolation(E.EPOCH_MISMATCH, f"epoch {frame.epoch} != sequence {seq}")
    if frame.chunk_index > 0 and assembling not in (None, seq):
        raise ConsumerViolation(E.SNAPSHOT_SEQUENCE, "chunk from another snapshot cut")
    # The producer's split is fixed (consecutive 524,288-bucket slices, the last one shorter):
    # anything else could never complete, and a stream of empty chunks that claims 2^32 of them
    # would be assembled for ever.
    step = cbi1.SNAPSHOT_CHUNK_BUCKETS
    want = min(step, frame.bucket_count - frame.chunk_index * step)
    if (
        frame.chunk_count != cbi1.chunk_count_for(frame.bucket_count)
        or frame.bucket_offset != frame.chunk_index * step
        or len(frame.words) != want
    ):
        raise ConsumerViolation(
            E.CBI1_PREFIX + cbi1.BadChunk.reason,
            f"chunk {frame.chunk_index}/{frame.chunk_count} at {frame.bucket_offset} with "
            f"{len(frame.words)} words is not the producer's split of {frame.bucket_count}",
        )
    # A relay sends one snapshot per stream, chunk 0 once: a chunk 0 while a cut is being
    # assembled would start it over, and a stream that keeps starting over (each chunk resets
    # the silence clock) would keep its replica unsynchronized for ever, never called silent.
    if frame.chunk_index == 0 and assembling is not None:
        raise ConsumerViolation(E.SNAPSHOT_SEQUENCE, f"snapshot started again at {seq}")
    return frame


def assemble(
    assembler: cbi1.SnapshotAssembler, frame: cbi1.SnapshotChunk
) -> cbi1.AssembledSnapshot | None:
    """Feed a checked chunk; the complete snapshot after its last chunk."""
    try:
        return assembler.feed(frame)
    except cbi1.Cbi1Error as exc:
        raise ConsumerViolation(E.CBI1_PREFIX + exc.reason, str(exc)) from None


def delta_sequence(installed: int | None, base: int, seq: int) -> None:
    """A delta's envelope, before its payload is decoded: it follows the installed sequence."""
    if installed is None:
        raise ConsumerViolation(E.DELTA_BEFORE_SNAPSHOT)
    if base > installed:
        raise ConsumerViolation(E.SEQUENCE_GAP, f"base {base} > installed {installed}")
    if base < installed:
        raise ConsumerViolation(E.WRONG_BASE, f"base {base} < installed {installed}")
    if seq != base + 1:
        raise ConsumerViolation(E.BAD_INCREMENT, f"{base} -> {seq}")


def delta_frame(
    frame: cbi1.SnapshotChunk | cbi1.Delta, dc_id: int, base: int, seq: int
) -> cbi1.Delta:
    """A decoded delta: a delta, of this data centre, with the envelope's epochs."""
    if not isinstance(frame, cbi1.Delta):
        raise ConsumerViolation(E.KIND_MISMATCH, "DELTA frame carries a snapshot chunk")
    if frame.dc_id != dc_id:
        raise ConsumerViolation(E.DC_ID_MISMATCH, f"{frame.dc_id} != {dc_id}")
    if frame.base_epoch != base or frame.epoch != seq:
        raise ConsumerViolation(
            E.EPOCH_MISMATCH, f"CBI1 {frame.base_epoch}->{frame.epoch} vs {base}->{seq}"
        )
    return frame
