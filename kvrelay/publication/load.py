"""Pool load plane: one complete ``KvPoolLoadUpdate`` per window (§4.5, §10.1).

A window is a full picture (every active pool generation, possibly none), so a subscriber that
misses windows loses nothing but freshness; the broadcast keeps only the newest one. Windows are
numbered from 0 (the window available at construction) and the timer builds the next one every
``window_ms``; a late tick is delayed, never bursted, so the sequence advances by exactly 1 per
published window and ``observed_ms`` says when it was built.

Unknown is never zero: a rank whose usage has not been reported adds 0 to ``kv_used_blocks`` but
is *not* counted in ``kv_observed_ranks`` (so observed < expected tells the consumer the sum is
partial), and any rank with unknown capacity makes ``total_kv_blocks`` 0 (no authoritative
capacity). Consumers must not read either as "idle".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.identity_memo import IdentityMemo
from kvrelay.contract.wire import CONTRACT_MARKER, U32_MAX, U64_MAX
from kvrelay.logging import get_logger
from kvrelay.publication import window_wire as W
from kvrelay.publication.window import MAX_WINDOW_MS, WindowPlane

__all__ = [
    "MAX_WINDOW_MS",
    "LoadPlane",
    "LoadProvider",
    "PoolLoadInput",
    "RankLoad",
    "load_entry",
    "saturating_sum",
]

_log = get_logger(__name__)

@dataclass(frozen=True, slots=True)
class RankLoad:
    """Latest observation of one expected rank; None = not known (never "zero")."""

    kv_used_blocks: int | None = None
    total_kv_blocks: int | None = None

    def __post_init__(self) -> None:
        for name in ("kv_used_blocks", "total_kv_blocks"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"RankLoad.{name} must be a non-negative int or None, got {v!r}")


PoolLoadInput = tuple[pb.ProducerIdentity, Sequence[RankLoad]]
"""One active pool generation and one :class:`RankLoad` per *declared* (expected) rank."""

LoadProvider = Callable[[], Iterable[PoolLoadInput]]


def saturating_sum(values: Iterable[int]) -> int:
    """Sum clamped to u64::MAX (values above it count as u64::MAX), as Dynamo forwards it."""
    total = 0
    for v in values:
        total += min(v, U64_MAX)
        if total >= U64_MAX:
            return U64_MAX
    return total


def load_entry(producer: pb.ProducerIdentity, ranks: Sequence[RankLoad]) -> pb.KvPoolLoadEntry:
    """§10.1 entry for one pool generation from its per-rank observations (pure).

    ``kv_expected_ranks`` = ``len(ranks)``; ``kv_observed_ranks`` = ranks with known usage (both
    clamped to u32). ``kv_used_blocks`` = saturating sum of known usage (unknown contributes 0,
    visible as observed < expected). ``total_kv_blocks`` = saturating sum of capacities, or 0
    if any rank's capacity is unknown or there are no ranks (0 means "no authoritative
    capacity", never "full").
    """
    return _entry(pb.ProducerIdentity.parse(bytes(producer)), ranks)


def _entry(producer_copy: pb.ProducerIdentity, ranks: Sequence[RankLoad]) -> pb.KvPoolLoadEntry:
    """:func:`load_entry` with the producer's private copy at hand (the plane's memo has it)."""
    used = [r.kv_used_blocks for r in ranks if r.kv_used_blocks is not None]
    caps = [r.total_kv_blocks for r in ranks]
    known_caps = [c for c in caps if c is not None]
    total = saturating_sum(known_caps) if ranks and len(known_caps) == len(caps) else 0
    return pb.KvPoolLoadEntry(
        producer=producer_copy,
        kv_used_blocks=saturating_sum(used),
        total_kv_blocks=total,
        kv_observed_ranks=min(len(used), U32_MAX),
        kv_expected_ranks=min(len(ranks), U32_MAX),
    )


class LoadPlane(WindowPlane[pb.KvPoolLoadUpdate]):
    """The ``SubscribeKvPoolLoad`` plane (a ``Plane[pb.KvPoolLoadUpdate]``); version =
    ``window_sequence``.

    ``provider`` is called once per window on the event loop and must be cheap and non-blocking.
    If it raises, that window is skipped (counted in ``provider_errors``, logged) rather than
    published as an empty window, which would falsely withdraw every pool's load.
    """

    def __init__(
        self,
        relay_identity: pb.RelayIdentity,
        window_ms: int = 1000,
        provider: LoadProvider | None = None,
    ) -> None:
        super().__init__(relay_identity, window_ms, "kvrelay-load-windows")
        self._provider = provider
        self.entry_errors = 0
        self._ids: IdentityMemo[pb.ProducerIdentity] = IdentityMemo()
        self._init_windows()

    def set_provider(self, provider: LoadProvider | None) -> None:
        self._provider = provider

    def _initial(self) -> tuple[pb.KvPoolLoadUpdate, Callable[[], bytes]]:
        pools = self._entries()
        return self._message(0, [] if pools is None else pools)

    def _build(self, seq: int) -> tuple[pb.KvPoolLoadUpdate, Callable[[], bytes]] | None:
        pools = self._entries()
        return None if pools is None else self._message(seq, pools)

    def _entries(self) -> list[tuple[pb.KvPoolLoadEntry, bytes]] | None:
        """Each listed generation's entry and its wire bytes, sorted by producer."""
        if self._provider is None:
            return []
        try:
            inputs = list(self._provider())
        except Exception:
            self.provider_errors += 1
            _log.exception("load_provider_failed", errors=self.provider_errors)
            return None
        keyed: list[tuple[bytes, pb.KvPoolLoadEntry, bytes]] = []
        for producer, ranks in inputs:
            try:
                key, copy = self._ids.encoded(producer)
                entry = _entry(copy, ranks)
                wire = W.message_field(1, key) + b"".join((
                    W.uint_field(2, entry.kv_used_blocks),
                    W.uint_field(3, entry.total_kv_blocks),
                    W.uint_field(4, entry.kv_observed_ranks),
                    W.uint_field(5, entry.kv_expected_ranks),
                ))  # fmt: skip
            except Exception:
                # One bad pool must not hide the others' load: drop it and count it.
                self.entry_errors += 1
                _log.exception("load_entry_invalid", errors=self.entry_errors)
                continue
            keyed.append((key, entry, wire))
        # this window's identities only: a retired generation's stayed up to the memo's bound
        self._ids.retain(producer for producer, _ranks in inputs)
        keyed.sort(key=lambda kv: kv[0])
        out: list[tuple[pb.KvPoolLoadEntry, bytes]] = []
        for i, (key, entry, wire) in enumerate(keyed):
            if i and keyed[i - 1][0] == key:
                # A generation listed twice would give consumers two competing loads: keep one.
                self.entry_errors += 1
                continue
            out.append((entry, wire))
        return out

    def _message(
        self, seq: int, pools: list[tuple[pb.KvPoolLoadEntry, bytes]]
    ) -> tuple[pb.KvPoolLoadUpdate, Callable[[], bytes]]:
        fields = self._header(seq)
        head = pb.KvPoolLoadUpdate(**fields)  # what the wire's entries follow
        message = pb.KvPoolLoadUpdate(
            **fields, pools=[e for e, _w in pools], contract_marker=CONTRACT_MARKER
        )
        wires = [w for _e, w in pools]
        return message, lambda: W.window(head, [(6, wires)], CONTRACT_MARKER)
