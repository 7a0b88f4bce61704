"""Serving-load plane: one complete ``ServingLoadUpdate`` per window (Dynamo 1.7's sixth RPC).

Shaped like the pool load plane (``publication.load``): a provider called once per window, a
window that fails to build is skipped, one bad entry is dropped and counted, entries are sorted
and a duplicate key is kept once. What the relay can vouch for, and nothing else, goes out:

* Coverage is :func:`coverage` of observed against expected sources, the one rule for both views:
  every expected source observed → COMPLETE, some → DEGRADED, none (or none expected) →
  UNAVAILABLE. A partial sum is never COMPLETE.
* Gauges (pool ``active_decode_blocks``) are set only when the view is COMPLETE; a gauge no source
  can provide is never set (unknown is never zero).
* Cumulative counters come from :class:`RunningTotals`: per relay incarnation, each source counts
  from its own running total when first heard; a source's restart (a new process start time, or
  without one a counter going down) continues from where it was; a report missing a counter it
  gave before is incomplete and ignored; departed sources keep what they contributed. So a total
  is monotonic within one incarnation, set whatever the status, and restarts with the relay.

``docs/contract.md`` §10.4 says field by field what kvrelay fills.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.identity_memo import IdentityMemo
from kvrelay.contract.wire import CONTRACT_MARKER, U64_MAX
from kvrelay.logging import get_logger
from kvrelay.publication import window_wire as W
from kvrelay.publication.load import RankLoad, saturating_sum
from kvrelay.publication.window import WindowPlane

__all__ = [
    "COUNTERS",
    "ModelServingInput",
    "PoolServingInput",
    "RunningTotals",
    "ServingLoadInputs",
    "ServingLoadPlane",
    "ServingLoadProvider",
    "coverage",
    "model_entry",
    "pool_entry",
]

_log = get_logger(__name__)
In = TypeVar("In")
_Wire = Callable[[], bytes]  # writes an encoded entry or window when first needed
E = TypeVar("E")

#: The cumulative counters of one model view, by the name :class:`RunningTotals` keeps them under.
COUNTERS = (
    "requests_started_total",
    "requests_completed_total",
    "requests_failed_total",
    "requests_cancelled_total",
    "input_tokens_total",
    "output_tokens_total",
)
#: Counters that a source reports as derived sums of gauges and counters (not a counter of its
#: own): a dip between two reports is a measurement skew, held at the last value, never a reset.
DERIVED = frozenset({"requests_started_total"})
#: Groups (models) remembered once absent, oldest forgotten first (a bound on config churn).
MAX_GROUPS = 4096
#: Departed sources a group remembers one by one, so that one coming back resumes its own count
#: instead of being counted again from its running total. Past it the longest gone is folded
#: into the group's anonymous sum (a bound on engine churn, e.g. DNS-discovered pods).
MAX_DEPARTED_SOURCES = 1024


def coverage(observed: int, expected: int) -> pb.DataStatus:
    """The contract's coverage of one aggregate (a partial sum is never COMPLETE)."""
    if observed <= 0 or expected <= 0:
        return pb.DataStatus.UNAVAILABLE
    if observed < expected:
        return pb.DataStatus.DEGRADED
    return pb.DataStatus.COMPLETE


@dataclass(frozen=True, slots=True)
class PoolServingInput:
    """One active pool generation. ``ranks``: one :class:`RankLoad` per expected rank (a rank is
    observed when its usage is known); ``observed_ms``: wall-clock times of the source reports
    the ranks come from; ``live_workers`` / ``max_concurrency``: None when not known."""

    producer: pb.ProducerIdentity
    ranks: Sequence[RankLoad]
    observed_ms: Sequence[int] = ()
    live_workers: int | None = None
    max_concurrency: int | None = None


@dataclass(frozen=True, slots=True)
class ModelServingInput:
    """One (namespace, canonical model). ``totals``: :data:`COUNTERS` from
    :meth:`RunningTotals.totals` (a token total is absent while no source ever reported it);
    ``observed_ms``: report times of the observed frontends."""

    namespace: str
    canonical_model_id: str
    expected_frontends: int
    observed_frontends: int
    ready_frontends: int
    serving_pools: Sequence[pb.KvPoolId] = ()
    totals: Mapping[str, int] = field(default_factory=dict)
    observed_ms: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class ServingLoadInputs:
    pools: Sequence[PoolServingInput] = ()
    models: Sequence[ModelServingInput] = ()


ServingLoadProvider = Callable[[], ServingLoadInputs]


def _u64(v: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"expected a non-negative int, got {v!r}")
    return min(v, U64_MAX)


def _oldest(times: Sequence[int]) -> int:
    return _u64(min(times)) if times else 0


def pool_entry(inp: PoolServingInput) -> pb.PoolServingLoad:
    """The pool view (pure): no request stats; ``active_decode_blocks`` only when COMPLETE."""
    return _pool_entry(inp, pb.ProducerIdentity.parse(bytes(inp.producer)))


def _pool_entry(inp: PoolServingInput, producer_copy: pb.ProducerIdentity) -> pb.PoolServingLoad:
    """:func:`pool_entry` with the producer's private copy at hand (the plane's memo has it)."""
    used = [r.kv_used_blocks for r in inp.ranks if r.kv_used_blocks is not None]
    status = coverage(len(used), len(inp.ranks))
    tokens = pb.TokenLoadStats()
    if status == pb.DataStatus.COMPLETE:
        tokens.active_decode_blocks = saturating_sum(used)
    deployment = pb.PoolDeploymentStatus()
    if inp.live_workers is not None:
        deployment.live_workers = _u64(inp.live_workers)
    if inp.max_concurrency is not None:
        deployment.max_concurrency = _u64(inp.max_concurrency)
    return pb.PoolServingLoad(
        producer=producer_copy,
        load=pb.LoadView(
            tokens=tokens,
            status=status,
            source_observed_ms=_oldest(inp.observed_ms) if used else 0,
        ),
        deployment=deployment,
    )


def model_entry(inp: ModelServingInput) -> pb.ModelServingLoad:
    """The model view (pure): counters whatever the status; no gauge kvrelay could not vouch
    for (it sets none: see §10.4)."""
    return _model_entry(inp, [pb.KvPoolId.parse(bytes(p)) for p in inp.serving_pools])


def _model_entry(inp: ModelServingInput, serving_pools: list[pb.KvPoolId]) -> pb.ModelServingLoad:
    """:func:`model_entry` with the serving pools' private copies at hand (the plane's memo has
    them), in ``inp.serving_pools``'s order."""
    if not inp.namespace or not inp.canonical_model_id:
        raise ValueError("a model view needs a namespace and a canonical model id")
    if not 0 <= inp.ready_frontends <= inp.observed_frontends <= inp.expected_frontends:
        raise ValueError(
            "frontends must satisfy ready <= observed <= expected, got "
            f"{inp.ready_frontends}/{inp.observed_frontends}/{inp.expected_frontends}"
        )
    t = inp.totals
    requests = pb.RequestLifecycleStats(
        requests_started_total=_u64(t.get("requests_started_total", 0)),
        requests_completed_total=_u64(t.get("requests_completed_total", 0)),
        requests_failed_total=_u64(t.get("requests_failed_total", 0)),
        requests_cancelled_total=_u64(t.get("requests_cancelled_total", 0)),
    )
    tokens = pb.TokenLoadStats()
    if "input_tokens_total" in t:
        tokens.input_tokens_total = _u64(t["input_tokens_total"])
    if "output_tokens_total" in t:
        tokens.output_tokens_total = _u64(t["output_tokens_total"])
    observed = inp.observed_frontends
    return pb.ModelServingLoad(
        namespace=inp.namespace,
        canonical_model_id=inp.canonical_model_id,
        load=pb.LoadView(
            requests=requests,
            tokens=tokens,
            status=coverage(observed, inp.expected_frontends),
            source_observed_ms=_oldest(inp.observed_ms) if observed else 0,
        ),
        deployment=pb.ModelDeploymentStatus(
            expected_frontends=_u64(inp.expected_frontends),
            observed_frontends=_u64(observed),
            ready_frontends=_u64(inp.ready_frontends),
            serving_pools=serving_pools,
        ),
    )


class _Series:
    """One source's counters: ``base`` carries what it counted before its last restart,
    ``started`` the process start time of the last report taken (None: not known)."""

    __slots__ = ("base", "last", "started")

    def __init__(self) -> None:
        self.base: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.started: float | None = None

    def observe(self, values: Mapping[str, int], started: float | None = None) -> None:
        """Take one report. A restart is a new process start time when both reports carry one
        (then a dip is a skew, held at the last value: a restart that already overtook its old
        counts is still seen), else a true counter going down. A report missing a counter the
        source gave before is cut short: ignored whole unless it is a restart."""
        for name, v in values.items():
            if v < 0:
                raise ValueError(f"counter {name} is negative: {v}")
        if started is not None and self.started is not None:
            restart = started != self.started
        else:
            restart = any(
                name not in DERIVED and v < self.last.get(name, 0) for name, v in values.items()
            )
        if restart:  # what the previous process counted stays counted
            for name, v in self.last.items():
                self.base[name] = self.base.get(name, 0) + v
            self.last = dict(values)
        elif self.last.keys() - values.keys():
            return  # incomplete: the values held are the best known
        else:
            for name, v in values.items():
                self.last[name] = max(v, self.last.get(name, 0))
        self.started = started

    def totals(self) -> dict[str, int]:
        names = self.base.keys() | self.last.keys()
        return {n: self.base.get(n, 0) + self.last.get(n, 0) for n in names}


class RunningTotals:
    """Cumulative counters per group (a model) over every source heard from during this relay
    incarnation. A source absent from a group's :meth:`window` has departed: what it counted
    stays in the group's totals, and when it is present again (an engine back in the config, a
    pool published again) it goes on from its own last values, as if it had been missing a
    while, so nothing is counted twice. Bounded: live sources by the relay's configured engines
    and ranks, departed ones by ``max_departed`` per group (the longest gone is then folded into
    an anonymous sum), groups by :data:`MAX_GROUPS` (the longest-absent one is forgotten)."""

    def __init__(
        self, max_groups: int = MAX_GROUPS, max_departed: int = MAX_DEPARTED_SOURCES
    ) -> None:
        self._max_groups = max_groups
        self._max_departed = max_departed
        self._departed: dict[Hashable, dict[str, int]] = {}  # folded: sources no longer told apart
        self._gone: dict[Hashable, dict[Hashable, _Series]] = {}
        self._live: dict[Hashable, dict[Hashable, _Series]] = {}

    def window(
        self,
        group: Hashable,
        present: Iterable[Hashable],
        reports: Mapping[Hashable, Mapping[str, int]],
        started: Mapping[Hashable, float] | None = None,
    ) -> dict[str, int]:
        """Fold in this window's ``reports`` (a present source that did not report keeps its
        last values) and return the group's totals (a name no source ever reported is absent).
        ``started``: when each reporting source's process started, where its report says (how
        a restart is told apart from a dip, see :meth:`_Series.observe`)."""
        live = self._live.get(group)
        if live is None:
            live = self._live[group] = {}
            self._departed.setdefault(group, {})
            self._gone.setdefault(group, {})
        self._touch(group)
        departed, gone = self._departed[group], self._gone[group]
        keep = set(present)
        for source in [s for s in live if s not in keep]:
            gone[source] = live.pop(source)
            if len(gone) > self._max_departed:
                _add(departed, gone.pop(next(iter(gone))).totals())
        for source, values in reports.items():
            if source not in keep:
                continue
            series = live.get(source)
            if series is None:  # new, or back: then it goes on from its own last values
                series = live[source] = gone.pop(source) if source in gone else _Series()
            series.observe(values, None if started is None else started.get(source))
        out = dict(departed)
        for series in (*gone.values(), *live.values()):
            _add(out, series.totals())
        return out

    def _touch(self, group: Hashable) -> None:
        # dicts keep insertion order: re-inserting marks the group most recently used
        self._departed[group] = self._departed.pop(group)
        self._gone[group] = self._gone.pop(group)
        self._live[group] = self._live.pop(group)
        while len(self._live) > self._max_groups:
            oldest = next(iter(self._live))
            del self._live[oldest], self._departed[oldest], self._gone[oldest]


def _add(into: dict[str, int], values: Mapping[str, int]) -> None:
    for name, v in values.items():
        into[name] = into.get(name, 0) + v


class ServingLoadPlane(WindowPlane[pb.ServingLoadUpdate]):
    """The ``SubscribeServingLoad`` plane (a ``Plane[pb.ServingLoadUpdate]``); version =
    ``window_sequence``. ``provider`` is called once per window on the event loop."""

    _plane_name = "serving_load"

    def __init__(
        self,
        relay_identity: pb.RelayIdentity,
        window_ms: int = 1000,
        provider: ServingLoadProvider | None = None,
    ) -> None:
        super().__init__(relay_identity, window_ms, "kvrelay-serving-load-windows")
        self._provider = provider
        self.entry_errors = 0
        self._producers: IdentityMemo[pb.ProducerIdentity] = IdentityMemo()
        self._pool_ids: IdentityMemo[pb.KvPoolId] = IdentityMemo()
        self._init_windows()

    def set_provider(self, provider: ServingLoadProvider | None) -> None:
        self._provider = provider

    def _initial(self) -> tuple[pb.ServingLoadUpdate, _Wire]:
        return self._build(0) or self._message(0, [], [])

    def _build(self, seq: int) -> tuple[pb.ServingLoadUpdate, _Wire] | None:
        if self._provider is None:
            return self._message(seq, [], [])
        try:
            inputs = self._provider()
        except Exception:
            self.provider_errors += 1
            _log.exception("serving_load_provider_failed", errors=self.provider_errors)
            return None
        pools = self._entries(inputs.pools, self._pool)
        models = self._entries(inputs.models, self._model)
        # this window's identities only: a retired generation's stayed up to the memos' bound
        self._producers.retain(p.producer for p in inputs.pools)
        self._pool_ids.retain(i for m in inputs.models for i in m.serving_pools)
        return self._message(seq, pools, models)

    def _pool(self, inp: PoolServingInput) -> tuple[bytes, tuple[pb.PoolServingLoad, _Wire]]:
        key, copy = self._producers.encoded(inp.producer)
        entry = _pool_entry(inp, copy)
        rest = pb.PoolServingLoad(load=entry.load, deployment=entry.deployment)
        return key, (entry, lambda: W.leading_field(1, key, rest))

    def _model(
        self, inp: ModelServingInput
    ) -> tuple[tuple[str, str], tuple[pb.ModelServingLoad, _Wire]]:
        ids = [self._pool_ids.encoded(p) for p in inp.serving_pools]
        entry = _model_entry(inp, [copy for _b, copy in ids])
        dep = entry.deployment or pb.ModelDeploymentStatus()  # _model_entry always sets it
        dep_rest = pb.ModelDeploymentStatus(
            expected_frontends=dep.expected_frontends,
            observed_frontends=dep.observed_frontends,
            ready_frontends=dep.ready_frontends,
        )  # serving_pools (field 4) is its last field: appended as encoded
        rest = pb.ModelServingLoad(
            namespace=entry.namespace, canonical_model_id=entry.canonical_model_id, load=entry.load
        )  # deployment (field 4) is its last field

        def wire() -> bytes:
            dep_wire = bytes(dep_rest) + b"".join(W.message_field(4, b) for b, _copy in ids)
            return bytes(rest) + W.message_field(4, dep_wire)

        return (inp.namespace, inp.canonical_model_id), (entry, wire)

    def _entries(self, inputs: Iterable[In], build: Callable[[In], tuple[Any, E]]) -> list[E]:
        keyed: list[tuple[Any, E]] = []
        for inp in inputs:
            try:
                keyed.append(build(inp))
            except Exception:
                # One bad entry must not hide the others: drop it and count it.
                self.entry_errors += 1
                _log.exception("serving_load_entry_invalid", errors=self.entry_errors)
        keyed.sort(key=lambda kv: kv[0])
        out: list[E] = []
        for i, (k, entry) in enumerate(keyed):
            if i and keyed[i - 1][0] == k:
                self.entry_errors += 1  # one key listed twice: keep one
                continue
            out.append(entry)
        return out

    def _message(
        self,
        seq: int,
        pools: list[tuple[pb.PoolServingLoad, _Wire]],
        models: list[tuple[pb.ModelServingLoad, _Wire]],
    ) -> tuple[pb.ServingLoadUpdate, _Wire]:
        fields = self._header(seq)
        head = pb.ServingLoadUpdate(**fields)  # what the wire's entries follow
        message = pb.ServingLoadUpdate(
            **fields,
            pools=[e for e, _w in pools],
            models=[e for e, _w in models],
            contract_marker=CONTRACT_MARKER,
        )
        pool_wires, model_wires = [w for _e, w in pools], [w for _e, w in models]

        def wire() -> bytes:
            return W.window(
                head,
                [(6, [w() for w in pool_wires]), (7, [w() for w in model_wires])],
                CONTRACT_MARKER,
            )

        return message, wire
