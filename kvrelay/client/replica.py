"""One pool replica: a consumer-side CKF table built from a SubscribeKvPool stream.

A pure state machine (no I/O) so the SDK and ``kvrelay-client subscribe --verify`` enforce the
same rules. ``feed`` either applies a frame completely or raises :class:`ConsumerViolation` and
leaves the installed table untouched (the caller then drops the whole replica): §4.7 consumer
rules, §5 CBI1 validation and assembly (via ``kvrelay.publication.cbi1``), plus the dc_id check
the decoder leaves to the consumer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import errors as E
from kvrelay.client.probe import contains
from kvrelay.contract.errors import RelayError
from kvrelay.contract.producer import ProducerKey, producer_key
from kvrelay.contract.wire import CONTRACT_MARKER, PROTOCOL_VERSION
from kvrelay.publication import cbi1

U64 = npt.NDArray[np.uint64]
KIND_NAMES = {
    int(pb.FilterUpdateKind.SNAPSHOT_CHUNK): "snapshot_chunk",
    int(pb.FilterUpdateKind.DELTA): "delta",
    int(pb.FilterUpdateKind.HEARTBEAT): "heartbeat",
}


def relay_key(r: pb.RelayIdentity | None) -> tuple[int, int] | None:
    """Comparable relay identity (messages are not hashable)."""
    return None if r is None else (int(r.drt_instance_id), int(r.relay_incarnation))


def occupancy(table: U64) -> int:
    """Non-empty 16-bit fingerprint slots in a bucket table."""
    return int(np.count_nonzero(table.astype("<u8", copy=False).view("<u2")))


@dataclass(slots=True)
class FrameInfo:
    """What the CLI prints about one accepted frame."""

    kind: str
    base_sequence: int
    sequence: int
    payload_bytes: int
    checksum: int | None = None  # CBI1 header body checksum
    chunk: tuple[int, int] | None = None  # (index, count) for snapshot chunks
    images: int | None = None  # bucket images in a delta
    installed: bool = False  # this frame completed the snapshot


@dataclass(slots=True)
class ReplicaCounters:
    frames: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KIND_NAMES.values(), 0))
    bytes: int = 0
    last_frame: float | None = None  # time.monotonic() of the last accepted frame


class PoolReplica:
    """Snapshot assembly + delta application under every consumer rule.

    ``relay`` is the relay identity of the session at subscription time; ``producer`` the exact
    identity from the catalog (its ``ProducerKey`` must already be valid).
    """

    def __init__(self, producer: pb.ProducerIdentity, relay: pb.RelayIdentity | None) -> None:
        self.key: ProducerKey = producer_key(producer)
        self.producer = producer
        self.relay = relay_key(relay)
        self.seed = self.key.seed
        self.bucket_count = self.key.bucket_count
        self.dc_id = self.key.dc_id
        self._assembler = cbi1.SnapshotAssembler()
        self._assembling_seq: int | None = None
        self.table: U64 | None = None
        self.sequence: int | None = None
        self.counters = ReplicaCounters()

    @property
    def installed(self) -> bool:
        return self.table is not None

    # ------------------------------------------------------------------ rules
    def _decode(self, payload: bytes) -> cbi1.SnapshotChunk | cbi1.Delta:
        try:
            return cbi1.decode(
                payload, expected_seed=self.seed, expected_bucket_count=self.bucket_count
            )
        except cbi1.Cbi1Error as exc:
            raise E.ConsumerViolation(E.CBI1_PREFIX + exc.reason, str(exc)) from None

    def _check_envelope(self, fu: pb.FilterUpdate) -> None:
        if fu.contract_marker != CONTRACT_MARKER or fu.protocol_version != PROTOCOL_VERSION:
            raise E.ConsumerViolation(
                E.ENVELOPE, f"marker {fu.contract_marker:#x} version {fu.protocol_version}"
            )
        rk = relay_key(fu.relay)
        if self.relay is not None and rk != self.relay:
            raise E.ConsumerViolation(E.RELAY_IDENTITY_CHANGED, f"{rk} != {self.relay}")
        try:
            pk = producer_key(fu.producer)
        except RelayError as exc:
            raise E.ConsumerViolation(E.PRODUCER_IDENTITY, exc.message) from None
        if pk != self.key:
            raise E.ConsumerViolation(E.PRODUCER_IDENTITY, "frame producer != subscribed one")

    def feed(self, fu: pb.FilterUpdate) -> FrameInfo:
        """Validate and apply one frame; raises ConsumerViolation (state then undefined: drop)."""
        self._check_envelope(fu)
        kind = int(fu.kind)
        base, seq = int(fu.base_sequence), int(fu.sequence)
        if kind == pb.FilterUpdateKind.SNAPSHOT_CHUNK:
            info = self._snapshot(fu, base, seq)
        elif kind == pb.FilterUpdateKind.DELTA:
            info = self._delta(fu, base, seq)
        elif kind == pb.FilterUpdateKind.HEARTBEAT:
            if self.table is None:
                raise E.ConsumerViolation(E.HEARTBEAT_BEFORE_SNAPSHOT)
            if base != seq or seq != self.sequence:
                raise E.ConsumerViolation(
                    E.HEARTBEAT_SEQUENCE, f"{base}->{seq}, installed {self.sequence}"
                )
            if fu.payload:
                raise E.ConsumerViolation(E.HEARTBEAT_PAYLOAD, f"{len(fu.payload)} bytes")
            info = FrameInfo("heartbeat", base, seq, 0)
        else:
            raise E.ConsumerViolation(E.UNKNOWN_KIND, str(kind))
        c = self.counters
        c.frames[info.kind] += 1
        c.bytes += len(fu.payload)
        c.last_frame = time.monotonic()
        return info

    def _snapshot(self, fu: pb.FilterUpdate, base: int, seq: int) -> FrameInfo:
        if self.table is not None:
            raise E.ConsumerViolation(E.UNEXPECTED_SNAPSHOT, f"chunk at {seq} after install")
        if base != seq:
            raise E.ConsumerViolation(E.SNAPSHOT_SEQUENCE, f"base {base} != sequence {seq}")
        frame = self._decode(fu.payload)
        if not isinstance(frame, cbi1.SnapshotChunk):
            raise E.ConsumerViolation(E.KIND_MISMATCH, "SNAPSHOT_CHUNK frame carries a delta")
        if frame.dc_id != self.dc_id:
            raise E.ConsumerViolation(E.DC_ID_MISMATCH, f"{frame.dc_id} != {self.dc_id}")
        if frame.epoch != seq:
            raise E.ConsumerViolation(E.EPOCH_MISMATCH, f"epoch {frame.epoch} != sequence {seq}")
        if frame.chunk_index > 0 and self._assembling_seq not in (None, seq):
            raise E.ConsumerViolation(E.SNAPSHOT_SEQUENCE, "chunk from another snapshot cut")
        try:
            done = self._assembler.feed(frame)
        except cbi1.Cbi1Error as exc:
            raise E.ConsumerViolation(E.CBI1_PREFIX + exc.reason, str(exc)) from None
        self._assembling_seq = seq
        info = FrameInfo(
            "snapshot_chunk", base, seq, len(fu.payload), _header_checksum(fu.payload),
            chunk=(frame.chunk_index, frame.chunk_count),
        )  # fmt: skip
        if done is not None:
            self.table = np.array(done.words, dtype=np.uint64, copy=True)
            self.sequence = done.epoch
            self._assembling_seq = None
            info.installed = True
        return info

    def _delta(self, fu: pb.FilterUpdate, base: int, seq: int) -> FrameInfo:
        table, installed = self.table, self.sequence
        if table is None or installed is None:
            raise E.ConsumerViolation(E.DELTA_BEFORE_SNAPSHOT)
        if base > installed:
            raise E.ConsumerViolation(E.SEQUENCE_GAP, f"base {base} > installed {installed}")
        if base < installed:
            raise E.ConsumerViolation(E.WRONG_BASE, f"base {base} < installed {installed}")
        if seq != base + 1:
            raise E.ConsumerViolation(E.BAD_INCREMENT, f"{base} -> {seq}")
        frame = self._decode(fu.payload)
        if not isinstance(frame, cbi1.Delta):
            raise E.ConsumerViolation(E.KIND_MISMATCH, "DELTA frame carries a snapshot chunk")
        if frame.dc_id != self.dc_id:
            raise E.ConsumerViolation(E.DC_ID_MISMATCH, f"{frame.dc_id} != {self.dc_id}")
        if frame.base_epoch != base or frame.epoch != seq:
            raise E.ConsumerViolation(
                E.EPOCH_MISMATCH, f"CBI1 {frame.base_epoch}->{frame.epoch} vs {base}->{seq}"
            )
        table[frame.buckets.astype(np.intp)] = frame.words
        self.sequence = seq
        return FrameInfo(
            "delta", base, seq, len(fu.payload), _header_checksum(fu.payload),
            images=int(frame.buckets.size),
        )  # fmt: skip

    # ------------------------------------------------------------------ reads
    def contains(self, hashes: npt.ArrayLike) -> npt.NDArray[np.bool_]:
        if self.table is None:
            raise RuntimeError("replica not installed")
        return contains(self.table, self.seed, hashes)

    def occupancy(self) -> int:
        return 0 if self.table is None else occupancy(self.table)


def _header_checksum(payload: bytes) -> int | None:
    if len(payload) < cbi1.HEADER:
        return None
    return int.from_bytes(payload[44:48], "little")
