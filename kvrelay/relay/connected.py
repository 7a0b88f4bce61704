"""A pool's connected members (connect mode, §22): the bound SUB's lifecycle and bookkeeping.

``ConnectedMembers`` is the ``ConnectSink`` of one pool's ``ingest.connect.ConnectSource``. It
admits members (``worker_id`` from the topic's engine name, as for a configured engine; a
configured engine's name is refused so two streams never merge), makes sure a generation exists
before a member's first batch is applied (nothing can be replayed later), removes the state of
members that leave, keeps their final counters in one bounded ``(departed)`` entry, and
restarts the socket with jittered backoff when binding or its task fails. The pool stays the
owner of exact state: batches and resets go through the pool's own ``BatchSink``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Coroutine
from dataclasses import fields
from typing import Any, Protocol

from kvrelay.ingest.connect import ConnectCounters, ConnectSource, ConnectSpec
from kvrelay.ingest.counters import SubscriberCounters
from kvrelay.ingest.sink import ResetReason, SourceKey
from kvrelay.ingest.topic_pattern import TopicPattern
from kvrelay.logging import get_logger
from kvrelay.pool.batch import AnyBatch
from kvrelay.publication.load import RankLoad
from kvrelay.relay.engines import worker_id_for
from kvrelay.relay.generation import Generation
from kvrelay.relay.settings import PoolSpec
from kvrelay.relay.stats import SourceStats, merged

_log = get_logger(__name__)

#: Name under which the counters of connected members that left are kept.
DEPARTED = "(departed)"
RESTART_INITIAL_S = 0.2
RESTART_MAX_S = 10.0


class PoolHost(Protocol):
    """What connected members need from their pool."""

    spec: PoolSpec
    generation: Generation | None

    @property
    def name(self) -> str: ...

    def is_configured(self, worker_id: int) -> bool: ...
    def ensure_generation(self) -> None: ...
    def count_reset(self, reason: str) -> None: ...
    def count_source_failure(self) -> None: ...
    def schedule(self, coro: Coroutine[Any, Any, Any]) -> None: ...
    async def reconcile(self) -> None: ...
    def on_batch(self, source: SourceKey, seq: int, batch: AnyBatch) -> None: ...
    def on_reset(self, source: SourceKey, reason: ResetReason) -> None: ...


class ConnectedMembers:
    """Owns the pool's ``ConnectSource`` (None until bound) and its members' bookkeeping."""

    def __init__(self, host: PoolHost, carried: ConnectedMembers | None = None) -> None:
        """``carried``: the members a reload replaced (the section re-bound): their counters go
        on here, so the pool's ``kvrelay_connect_*`` counters never go backwards."""
        self._host = host
        self.source: ConnectSource | None = None
        #: survives socket restarts and re-binds (monotonic)
        self.counters: ConnectCounters = (
            carried.counters if carried is not None else ConnectCounters()
        )
        self._names: dict[int, str] = {}  # worker_id → engine name of present members
        #: the counters of members that left (``DEPARTED``), also carried over a re-bind
        self._departed: SubscriberCounters = (
            carried._departed if carried is not None else SubscriberCounters()
        )
        self._attempt = 0
        self._not_before = 0.0
        self._starting = False
        self._stopped = False

    # ---- ConnectSink ----------------------------------------------------------------------------
    def admit(self, engine: str, dp_rank: int) -> SourceKey | None:
        wid = worker_id_for(engine)
        named = self._names.get(wid)
        if self._host.is_configured(wid) or (named is not None and named != engine):
            return None  # a configured engine's name (or an id collision): never merged
        self._names[wid] = engine
        self._host.ensure_generation()
        return SourceKey(wid, dp_rank)

    def on_batch(self, source: SourceKey, seq: int, batch: AnyBatch) -> None:
        self._host.on_batch(source, seq, batch)

    def on_reset(self, source: SourceKey, reason: ResetReason) -> None:
        self._host.on_reset(source, reason)

    def on_member_gone(self, source: SourceKey, counters: SubscriberCounters) -> None:
        self._departed = merged(self._departed, counters)
        gen = self._host.generation
        if gen is not None:
            gen.remove_member(source)
        self._host.count_reset("member_expired")
        src = self.source
        if src is None or all(k.worker_id != source.worker_id for k, _n, _c in src.members()):
            self._names.pop(source.worker_id, None)
        self._host.schedule(self._host.reconcile())

    def on_connect_failed(self, error: BaseException) -> None:
        src, self.source = self.source, None
        if src is None or self._stopped:
            return
        delay = self._backoff()
        _log.error(
            "connect_failed", pool=self._host.name, error=f"{type(error).__name__}: {error}",
            members=len(src), restart_in_s=round(delay, 3),
        )  # fmt: skip
        self._retire_members(src, "source_failed")
        self._host.schedule(src.stop())
        self._host.schedule(self._host.reconcile())

    def _retire_members(self, src: ConnectSource, reason: str) -> None:
        """Every member ``src`` fed can no longer be vouched for: remove their state."""
        gen = self._host.generation
        for key, _name, counters in list(src.members()):
            self._departed = merged(self._departed, counters)
            if gen is not None:
                gen.remove_member(key)
            self._host.count_reset(reason)
        self._names.clear()

    # ---- lifecycle ------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Bind the socket (first tick, or after a failure once the backoff has passed)."""
        idle = self.source is None and not self._stopped and not self._starting
        if idle and now >= self._not_before:
            self._starting = True
            self._host.schedule(self._start())

    async def _start(self) -> None:
        try:
            if self._stopped or self.source is not None:
                return
            src = ConnectSource(self._spec(), self, self.counters)
            try:
                await src.start()
            except Exception as exc:  # e.g. the address is in use: counted, retried
                delay = self._backoff()
                _log.error(
                    "connect_bind_failed", pool=self._host.name, bind=list(src.spec.bind),
                    error=f"{type(exc).__name__}: {exc}", retry_in_s=round(delay, 3),
                )  # fmt: skip
                return
            self.source = src
            self._attempt = 0
        finally:
            self._starting = False
        await self._host.reconcile()

    def _backoff(self) -> float:
        self._host.count_source_failure()
        delay = min(RESTART_MAX_S, RESTART_INITIAL_S * 2.0 ** min(self._attempt, 16))
        delay *= random.uniform(0.5, 1.0)
        self._attempt += 1
        self._not_before = time.monotonic() + delay
        return delay

    async def stop(self, *, retire: bool = False) -> None:
        """Close the socket; ``retire``: also remove the members' state from the generation (a
        reload replaced the endpoint while the pool goes on)."""
        self._stopped = True
        src, self.source = self.source, None
        if src is not None:
            await src.stop()
            if retire:
                self._retire_members(src, "reconfigured")

    def _spec(self) -> ConnectSpec:
        spec = self._host.spec
        cfg = spec.connect
        assert cfg is not None and spec.kv_block_size is not None
        return ConnectSpec(
            bind=cfg.bind, pattern=TopicPattern(cfg.topic_pattern),
            kv_block_size=spec.kv_block_size, hash_format=int(spec.hash_format),
            options=spec.decode, kind=cfg.kind, model=spec.model,
            max_members=cfg.max_members, member_silence_s=cfg.member_silence_s,
            pool=self._host.name, allow=cfg.allow, addresses=cfg.addresses,
            max_topic_bytes=cfg.max_topic_bytes, max_batch_bytes=cfg.max_batch_bytes,
            max_member_blocks=cfg.max_member_blocks, curve_secret_key=cfg.curve_secret_key,
            curve_client_keys=cfg.curve_client_keys, curve_key_engines=cfg.curve_key_engines,
        )  # fmt: skip

    # ---- what the pool reports ------------------------------------------------------------------
    @property
    def live(self) -> bool:
        """At least one member present: the pool has an active source."""
        return self.source is not None and len(self.source) > 0

    def live_engines(self) -> int:
        src = self.source
        return 0 if src is None else len({k.worker_id for k, _n, _c in src.members()})

    def rank_loads(self) -> list[RankLoad]:
        """One unknown load entry per member (connected engines report no usage)."""
        src = self.source
        return [] if src is None else [RankLoad(None, None) for _ in src.members()]

    def name_of(self, worker_id: int) -> str | None:
        return self._names.get(worker_id)

    def source_stats(self) -> list[SourceStats]:
        out = []
        src = self.source
        if src is not None:
            out = [SourceStats(n, k.dp_rank, src.state, c.frozen()) for k, n, c in src.members()]
        if self._departed.messages:
            out.append(SourceStats(DEPARTED, 0, "stopped", self._departed.frozen()))
        return out


def counter_values(cc: ConnectCounters | None) -> dict[str, int]:
    """The pool-level ``connect_*`` counters (zeros for a pool without connect mode)."""
    cc = cc if cc is not None else ConnectCounters()
    out = {f"connect_{f.name}": getattr(cc, f.name) for f in fields(cc) if f.name != "rejections"}
    out["connect_frames_rejected"] = sum(cc.rejections.values())
    return out
