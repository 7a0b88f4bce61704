"""A minimal consumer replica for end-to-end tests: enforces the §4.7 consumer rules.

It is deliberately strict (assertions, not recovery): any rule a real router would enforce that the
relay breaks fails the test.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.pool.ckf import contains
from kvrelay.publication import cbi1


class Replica:
    def __init__(self, producer: pb.ProducerIdentity, relay: pb.RelayIdentity) -> None:
        assert producer.ckf_format is not None and producer.pool_id is not None
        self.producer_bytes = bytes(producer)
        self.relay_bytes = bytes(relay)
        self.seed = int(producer.ckf_format.seed)
        self.bucket_count = int(producer.ckf_format.bucket_count)
        self.dc_id = int(producer.pool_id.dc_id)
        self.assembler = cbi1.SnapshotAssembler()
        self.table: npt.NDArray[np.uint64] | None = None
        self.sequence: int | None = None
        self.kinds: dict[str, int] = {"snapshot": 0, "delta": 0, "heartbeat": 0}

    def feed(self, fu: pb.FilterUpdate) -> None:
        assert fu.contract_marker == 0x4B565231 and fu.protocol_version == 1
        assert fu.producer is not None and bytes(fu.producer) == self.producer_bytes
        assert fu.relay is not None and bytes(fu.relay) == self.relay_bytes
        if fu.kind == pb.FilterUpdateKind.SNAPSHOT_CHUNK:
            assert fu.base_sequence == fu.sequence
            chunk = cbi1.decode(
                fu.payload, expected_seed=self.seed, expected_bucket_count=self.bucket_count
            )
            assert isinstance(chunk, cbi1.SnapshotChunk)
            assert chunk.dc_id == self.dc_id and chunk.epoch == fu.sequence
            done = self.assembler.feed(chunk)
            self.kinds["snapshot"] += 1
            if done is not None:
                self.table = np.array(done.words, dtype=np.uint64, copy=True)
                self.sequence = done.epoch
        elif fu.kind == pb.FilterUpdateKind.DELTA:
            assert self.table is not None and self.sequence is not None, "delta before snapshot"
            assert fu.base_sequence == self.sequence and fu.sequence == self.sequence + 1
            delta = cbi1.decode(
                fu.payload, expected_seed=self.seed, expected_bucket_count=self.bucket_count
            )
            assert isinstance(delta, cbi1.Delta)
            assert delta.dc_id == self.dc_id
            assert delta.base_epoch == fu.base_sequence and delta.epoch == fu.sequence
            assert len(delta.buckets) > 0, "empty delta"
            self.table[delta.buckets.astype(np.int64)] = delta.words
            self.sequence = fu.sequence
            self.kinds["delta"] += 1
        elif fu.kind == pb.FilterUpdateKind.HEARTBEAT:
            assert self.table is not None, "heartbeat before the snapshot completed"
            assert fu.base_sequence == fu.sequence == self.sequence and fu.payload == b""
            self.kinds["heartbeat"] += 1
        else:  # pragma: no cover - a failing relay
            raise AssertionError(f"unknown kind {fu.kind}")

    def contains(self, hashes: list[int]) -> npt.NDArray[np.bool_]:
        assert self.table is not None
        return contains(self.table, self.seed, np.asarray(hashes, dtype=np.uint64))
