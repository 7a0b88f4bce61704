"""Strict consumer rules over one upstream pool stream, on wire bytes (§4.3, §4.7, §5).

The SDK's rules (``client/stream_rules.py``, which ``PoolReplica`` checks too), on the raw frame
so the mirror never pays a betterproto2 parse per frame: envelope, relay identity of the
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
from kvrelay.client import stream_rules as rules
from kvrelay.client.errors import ConsumerViolation
from kvrelay.client.wire import Frame, WireError, parse_frame
from kvrelay.contract.producer import ProducerKey
from kvrelay.publication import cbi1

KIND_SNAPSHOT_CHUNK = int(pb.FilterUpdateKind.SNAPSHOT_CHUNK)
KIND_DELTA = int(pb.FilterUpdateKind.DELTA)
KIND_HEARTBEAT = int(pb.FilterUpdateKind.HEARTBEAT)
WIRE = "wire"  # the frame does not parse as a FilterUpdate (mirror-only reason)


#: The upstream broke a consumer rule; ``reason`` is the SDK's vocabulary.
Violation = ConsumerViolation

#: The CBI1 errors only an encoder raises (a caller's bad argument): never a received frame's.
_ENCODER_ONLY: tuple[type[cbi1.Cbi1Error], ...] = (cbi1.InvalidArgument,)


def _cbi1_reasons() -> set[str]:
    """The reason of every CBI1 error a payload or a snapshot's assembly can raise (the most
    derived classes: the base class is never raised itself)."""
    out: set[str] = set()
    todo: list[type[cbi1.Cbi1Error]] = list(cbi1.Cbi1Error.__subclasses__())
    while todo:
        cls = todo.pop()
        subs = cls.__subclasses__()
        todo += subs
        if not subs and cls not in _ENCODER_ONLY:
            out.add(E.CBI1_PREFIX + cls.reason)
    return out


#: Every reason a :class:`Violation` of the checker carries: a closed set (the consumer rules,
#: the CBI1 errors, ``wire``), so ``kvrelay_mirror_violations_total`` has each from the start.
VIOLATION_REASONS: tuple[str, ...] = tuple(sorted({
    WIRE, E.ENVELOPE, E.RELAY_IDENTITY_CHANGED, E.PRODUCER_IDENTITY, E.UNKNOWN_KIND,
    E.KIND_MISMATCH, E.SNAPSHOT_SEQUENCE, E.UNEXPECTED_SNAPSHOT, E.EPOCH_MISMATCH,
    E.DC_ID_MISMATCH, E.DELTA_BEFORE_SNAPSHOT, E.SEQUENCE_GAP, E.WRONG_BASE, E.BAD_INCREMENT,
    E.HEARTBEAT_BEFORE_SNAPSHOT, E.HEARTBEAT_SEQUENCE, E.HEARTBEAT_PAYLOAD, *_cbi1_reasons(),
}))  # fmt: skip


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
            rules.heartbeat(self.sequence, f.base_sequence, f.sequence, len(f.payload))
            return f, None
        if kind == KIND_SNAPSHOT_CHUNK:
            return f, self._chunk(f)
        rules.unknown_kind(kind)

    def _envelope(self, f: Frame, data: bytes) -> None:
        rules.envelope(f.marker, f.protocol_version)
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
                identity = pb.ProducerIdentity.parse(f.producer)
            except Exception as exc:  # betterproto2 raises several types on bad bytes
                raise Violation(E.PRODUCER_IDENTITY, f"undecodable producer: {exc}") from None
            rules.producer(identity, self.key)
            if self._producer is None:
                self._producer = f.producer
                if f.prefix:
                    self._prefix = data[: f.prefix]

    def _chunk(self, f: Frame) -> Installed | None:
        seq = f.sequence
        rules.chunk_sequence(self.sequence, f.base_sequence, seq)
        key = self.key
        decoded = rules.decode(f.payload, key.seed, key.bucket_count)
        frame = rules.chunk_frame(decoded, key.dc_id, seq, self._assembling)
        if frame.chunk_index == 0:
            self._chunks = []
        done = rules.assemble(self._assembler, frame)
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
        rules.delta_sequence(installed, base, seq)
        key = self.key
        decoded = rules.decode(f.payload, key.seed, key.bucket_count)
        d = rules.delta_frame(decoded, key.dc_id, base, seq)
        self.sequence = seq
        return d
