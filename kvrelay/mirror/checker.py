"""Strict consumer rules over one upstream pool stream, on wire bytes (§4.3, §4.7, §5).

The same rules as the SDK's ``PoolReplica`` (and with its reason strings), checked on the raw
frame so the mirror never pays a betterproto2 parse per frame: envelope, relay identity of the
session, the exact producer subscribed to, snapshot assembly in order at one cut, contiguous
deltas whose CBI1 epochs match the envelope, heartbeats only at the installed sequence. A frame
that breaks one raises :class:`Violation` and the mirror drops the stream (and its subscribers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import errors as E
from kvrelay.contract.errors import RelayError
from kvrelay.contract.producer import ProducerKey, producer_key
from kvrelay.contract.wire import CONTRACT_MARKER, PROTOCOL_VERSION
from kvrelay.mirror.wire import Frame, WireError, parse_frame
from kvrelay.publication import cbi1

KIND_SNAPSHOT_CHUNK = int(pb.FilterUpdateKind.SNAPSHOT_CHUNK)
KIND_DELTA = int(pb.FilterUpdateKind.DELTA)
KIND_HEARTBEAT = int(pb.FilterUpdateKind.HEARTBEAT)
WIRE = "wire"  # the frame does not parse as a FilterUpdate (mirror-only reason)


class Violation(Exception):
    """The upstream broke a consumer rule; ``reason`` is the SDK's vocabulary."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True, eq=False)
class Installed:
    """A complete snapshot: the table at ``sequence``, its chunk payloads and the envelope."""

    sequence: int
    table: npt.NDArray[np.uint64]
    chunks: list[bytes]
    prefix: bytes | None  # fields 1–3 as the upstream encodes them (None: not leading)
    relay: pb.RelayIdentity
    producer: pb.ProducerIdentity


def relay_key(raw: bytes) -> tuple[int, int]:
    r = pb.RelayIdentity.parse(raw)
    return int(r.drt_instance_id), int(r.relay_incarnation)


class PoolStreamChecker:
    """Checks the frames of one upstream ``SubscribeKvPool`` stream, in order."""

    def __init__(self, key: ProducerKey, relay: pb.RelayIdentity) -> None:
        self.key = key
        self.relay = relay
        self._relay = bytes(relay)
        self._relay_key = (int(relay.drt_instance_id), int(relay.relay_incarnation))
        self._producer: bytes | None = None
        self._assembler = cbi1.SnapshotAssembler()
        self._assembling: int | None = None
        self._chunks: list[bytes] = []
        self._prefix: bytes | None = None
        self.sequence: int | None = None  # installed sequence

    def feed(self, data: bytes) -> tuple[Frame, Installed | cbi1.Delta | None]:
        """Check one frame. Returns it with: the complete snapshot (the last chunk), the decoded
        delta (a DELTA), or None (an earlier chunk, a heartbeat). Raises Violation."""
        try:
            f = parse_frame(data)
        except WireError as exc:
            raise Violation(WIRE, str(exc)) from None
        self._envelope(f, data)
        kind = f.kind
        if kind == KIND_DELTA:
            return f, self._delta(f)
        if kind == KIND_HEARTBEAT:
            if self.sequence is None:
                raise Violation(E.HEARTBEAT_BEFORE_SNAPSHOT)
            if f.base_sequence != f.sequence or f.sequence != self.sequence:
                raise Violation(
                    E.HEARTBEAT_SEQUENCE,
                    f"{f.base_sequence}->{f.sequence}, installed {self.sequence}",
                )
            if f.payload:
                raise Violation(E.HEARTBEAT_PAYLOAD, f"{len(f.payload)} bytes")
            return f, None
        if kind == KIND_SNAPSHOT_CHUNK:
            return f, self._chunk(f)
        raise Violation(E.UNKNOWN_KIND, str(kind))

    def _envelope(self, f: Frame, data: bytes) -> None:
        if f.marker != CONTRACT_MARKER or f.protocol_version != PROTOCOL_VERSION:
            raise Violation(E.ENVELOPE, f"marker {f.marker} version {f.protocol_version}")
        if f.relay != self._relay:
            try:
                same = f.relay is not None and relay_key(f.relay) == self._relay_key
            except Exception:  # betterproto2 raises several types on bad bytes
                same = False
            if not same:
                raise Violation(E.RELAY_IDENTITY_CHANGED, "frame relay != session relay")
        if f.producer != self._producer:
            if f.producer is None:
                raise Violation(E.PRODUCER_IDENTITY, "frame without a producer")
            try:
                pk = producer_key(pb.ProducerIdentity.parse(f.producer))
            except RelayError as exc:
                raise Violation(E.PRODUCER_IDENTITY, exc.message) from None
            except Exception as exc:
                raise Violation(E.PRODUCER_IDENTITY, f"undecodable producer: {exc}") from None
            if pk != self.key:
                raise Violation(E.PRODUCER_IDENTITY, "frame producer != subscribed one")
            if self._producer is None:
                self._producer = f.producer
                if f.prefix:
                    self._prefix = data[: f.prefix]

    def _chunk(self, f: Frame) -> Installed | None:
        seq = f.sequence
        if self.sequence is not None:
            raise Violation(E.UNEXPECTED_SNAPSHOT, f"chunk at {seq} after install")
        if f.base_sequence != seq:
            raise Violation(E.SNAPSHOT_SEQUENCE, f"base {f.base_sequence} != sequence {seq}")
        frame = self._decode(f.payload)
        if not isinstance(frame, cbi1.SnapshotChunk):
            raise Violation(E.KIND_MISMATCH, "SNAPSHOT_CHUNK frame carries a delta")
        if frame.dc_id != self.key.dc_id:
            raise Violation(E.DC_ID_MISMATCH, f"{frame.dc_id} != {self.key.dc_id}")
        if frame.epoch != seq:
            raise Violation(E.EPOCH_MISMATCH, f"epoch {frame.epoch} != sequence {seq}")
        if frame.chunk_index > 0 and self._assembling not in (None, seq):
            raise Violation(E.SNAPSHOT_SEQUENCE, "chunk from another snapshot cut")
        if frame.chunk_index == 0:
            self._chunks = []
        try:
            done = self._assembler.feed(frame)
        except cbi1.Cbi1Error as exc:
            raise Violation(E.CBI1_PREFIX + exc.reason, str(exc)) from None
        self._assembling = seq
        self._chunks.append(f.payload)
        if done is None:
            return None
        self.sequence = done.epoch
        self._assembling = None
        chunks, self._chunks = self._chunks, []
        producer = pb.ProducerIdentity.parse(self._producer or b"")
        return Installed(done.epoch, done.words, chunks, self._prefix, self.relay, producer)

    def _delta(self, f: Frame) -> cbi1.Delta:
        installed = self.sequence
        base, seq = f.base_sequence, f.sequence
        if installed is None:
            raise Violation(E.DELTA_BEFORE_SNAPSHOT)
        if base > installed:
            raise Violation(E.SEQUENCE_GAP, f"base {base} > installed {installed}")
        if base < installed:
            raise Violation(E.WRONG_BASE, f"base {base} < installed {installed}")
        if seq != base + 1:
            raise Violation(E.BAD_INCREMENT, f"{base} -> {seq}")
        d = self._decode(f.payload)
        if not isinstance(d, cbi1.Delta):
            raise Violation(E.KIND_MISMATCH, "DELTA frame carries a snapshot chunk")
        if d.dc_id != self.key.dc_id:
            raise Violation(E.DC_ID_MISMATCH, f"{d.dc_id} != {self.key.dc_id}")
        if d.base_epoch != base or d.epoch != seq:
            raise Violation(
                E.EPOCH_MISMATCH, f"CBI1 {d.base_epoch}->{d.epoch} vs {base}->{seq}"
            )
        self.sequence = seq
        return d

    def _decode(self, payload: bytes) -> cbi1.SnapshotChunk | cbi1.Delta:
        try:
            return cbi1.decode(
                payload, expected_seed=self.key.seed, expected_bucket_count=self.key.bucket_count
            )
        except cbi1.Cbi1Error as exc:
            raise Violation(E.CBI1_PREFIX + exc.reason, str(exc)) from None
