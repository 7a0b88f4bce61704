"""What a subscriber feeds: the ``BatchSink`` protocol, source identity and per-source config."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from kvrelay.ingest.kinds import EngineKind
from kvrelay.ingest.options import DecodeOptions
from kvrelay.pool.batch import AnyBatch


class SourceKey(NamedTuple):
    """One pool member: ``(worker_id, dp_rank)``."""

    worker_id: int
    dp_rank: int


class ResetReason(enum.Enum):
    """Why a member's state must be cleared (the sink drops everything it holds for it)."""

    INCARNATION = "incarnation"  # sequence reset/decrease: the engine restarted
    MISSING_HISTORY = "missing_history"  # replay started later than asked
    GAP_UNRECOVERABLE = "gap_unrecoverable"  # live gap that one replay could not fill
    GAP_NO_REPLAY = "gap_no_replay"  # live gap and no replay endpoint
    REORDER_OVERFLOW = "reorder_overflow"  # reorder buffer bound hit while waiting for a replay
    REPLAY_FAILED = "replay_failed"  # replay timed out / broke while a hole was open
    RECONNECT = "reconnect"  # the publisher reconnected and no replay can vouch for its state
    BAD_BATCH = "bad_batch"  # a batch that cannot be decoded or applied, even when re-fetched
    RESTORE_UNVERIFIED = "restore_unverified"  # restored state, and no replay to vouch for it
    VOUCH_TIMEOUT = "vouch_timeout"  # the replay asked to vouch for the state did not answer
    BLOCK_CAP = "block_cap"  # the member holds more blocks than its pool's max_member_blocks


class BatchSink(Protocol):
    def on_batch(self, source: SourceKey, seq: int, batch: AnyBatch) -> None:
        """Apply one decoded batch; raises ``MalformedBatch`` (state untouched) to reject it."""
        ...

    def on_reset(self, source: SourceKey, reason: ResetReason) -> None:
        """Drop everything the member holds."""
        ...

    def on_rebuild(self, source: SourceKey, active: bool) -> None:
        """``active``: the member is reset and is being rebuilt from its engine's replay (one
        transaction for subscribers); False: the replay is applied (or abandoned)."""
        ...

    def on_failed(self, source: SourceKey, error: BaseException) -> None:
        """The subscriber crashed and stopped: its member can no longer be vouched for."""
        ...

    def on_vouched(self, source: SourceKey) -> None:
        """The engine vouched for a member resumed from saved state (``Subscriber(resume=...)``)
        and the replay after the resume point is applied: its state is the stream's, exactly, up
        to where the replay ended (told at the vouch alone, the saved state, up to a checkpoint
        interval behind the engine, was published as current)."""
        ...


class DetachedSink:
    """What a subscriber detached from its pool feeds: nothing (``Subscriber.detach``)."""

    def on_batch(self, source: SourceKey, seq: int, batch: AnyBatch) -> None:
        pass

    def on_reset(self, source: SourceKey, reason: ResetReason) -> None:
        pass

    def on_rebuild(self, source: SourceKey, active: bool) -> None:
        pass

    def on_failed(self, source: SourceKey, error: BaseException) -> None:
        pass

    def on_vouched(self, source: SourceKey) -> None:
        pass


DETACHED = DetachedSink()


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """Everything needed to subscribe one (engine, dp_rank) publisher.

    ``endpoint``/``replay_endpoint`` are connectable addresses (DP offset applied, wildcard hosts
    already substituted by discovery). ``hash_format``: 1 = DYNAMO_STANDARD_V1, 2 = EAGLE_V1.
    ``kind``: the engine family, which picks the event layout and topic rules (§21).
    ``engine`` and ``pool`` are the operator's names, for logs (the key holds hashed ids).
    """

    endpoint: str
    replay_endpoint: str | None
    topic: bytes
    dp_rank: int
    worker_id: int
    kv_block_size: int
    hash_format: int = 1
    options: DecodeOptions = field(default_factory=DecodeOptions)
    kind: EngineKind = EngineKind.VLLM
    engine: str = ""
    pool: str = ""

    @property
    def key(self) -> SourceKey:
        return SourceKey(self.worker_id, self.dp_rank)
