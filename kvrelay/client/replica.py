"""One pool replica: a consumer-side CKF table built from a SubscribeKvPool stream.

A pure state machine (no I/O) so the SDK and ``kvrelay-client subscribe --verify`` enforce the
same rules. ``feed`` either applies a frame completely or raises :class:`ConsumerViolation` and
leaves the installed table untouched (the caller then drops the whole replica): §4.7 consumer
rules, §5 CBI1 validation and assembly (via ``kvrelay.publication.cbi1``), plus the dc_id check
the decoder leaves to the consumer; every rule is in ``stream_rules.py``, shared with the mirror.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import errors as E
from kvrelay.client import stream_rules as rules
from kvrelay.client.probe import contains
from kvrelay.contract.producer import ProducerKey, producer_key
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
    def _check_envelope(self, fu: pb.FilterUpdate) -> None:
        rules.envelope(fu.contract_marker, fu.protocol_version)
        rk = relay_key(fu.relay)
        if self.relay is not None and rk != self.relay:
            raise E.ConsumerViolation(E.RELAY_IDENTITY_CHANGED, f"{rk} != {self.relay}")
        rules.producer(fu.producer, self.key)

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
            rules.heartbeat(self.sequence, base, seq, len(fu.payload))
            info = FrameInfo("heartbeat", base, seq, 0)
        else:
            rules.unknown_kind(kind)
        c = self.counters
        c.frames[info.kind] += 1
        c.bytes += len(fu.payload)
        c.last_frame = time.monotonic()
        return info

    def _snapshot(self, fu: pb.FilterUpdate, base: int, seq: int) -> FrameInfo:
        rules.chunk_sequence(self.sequence, base, seq)
        decoded = rules.decode(fu.payload, self.seed, self.bucket_count)
        frame = rules.chunk_frame(decoded, self.dc_id, seq, self._assembling_seq)
        done = rules.assemble(self._assembler, frame)
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
        rules.delta_sequence(installed, base, seq)
        assert table is not None  # installed together with the sequence
        decoded = rules.decode(fu.payload, self.seed, self.bucket_count)
        frame = rules.delta_frame(decoded, self.dc_id, base, seq)
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
