"""What the serving-load plane is fed: the relay's pools and its engines' Prometheus pages.

vLLM's OpenAI server is the frontend of its engine, so each configured engine is one frontend
and each of its DP ranks one source of counters. The scrape loop (``Relay._scrape_loop``) stores
each engine's latest page here, or forgets it when a scrape fails; a window reads only what is
stored now, so a page is never older than one scrape interval plus its timeout.

Every page stored is folded into the running totals before it goes, whether or not anyone reads
the windows (built only when read): when a page the totals have not seen yet is replaced by the
engine's next page, or dropped, every stored page is folded in first. Folded on a timer instead,
a page could be replaced unseen by the first page of a restart, and what the engine had counted
since the totals last looked was lost. A fold (or a window) takes in every page stored, and an
engine's next page comes a scrape interval after its last, so there is at most one fold per
scrape interval (a reload's removals aside), however many engines.

A source's running total is keyed by the frontend's address (host, metrics port, DP rank), not by
the names the configuration gives it: an engine renamed in a reload, or moved to another pool of
the same model, is the same process with the same counters, and goes on from its own values.

Judgment calls (``docs/contract.md`` §10.4 has the field-by-field table):

* Frontends of a model are the engines of its AGGREGATED, DECODE and LEGACY pools. A PREFILL (or
  ENCODE) engine's requests are the prefill legs of requests a decode engine also counts, so
  counting both would count every disaggregated request twice.
* Every such engine serves the model, so a page that does not list it (vLLM run with
  ``--disable-log-stats``, a name the relay did not filter by) is not a report of zero: that
  frontend is not observed, and the model's view is not COMPLETE.
* ``requests_started_total`` of a rank is every request it finished plus those running and
  waiting: vLLM has no counter of admitted requests. Requests refused before the engine queued
  them (a frontend 400) are not counted anywhere.
* LoRA adapters are not listed as models: vLLM's pages do not split counters by adapter, and an
  adapter's view filled with its base model's figures would be wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Hashable, Iterable
from dataclasses import dataclass

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.identity_memo import IdentityMemo
from kvrelay.discovery.metrics_scrape import EnginePage, RankServing
from kvrelay.publication.load import RankLoad
from kvrelay.publication.serving_load import (
    ModelServingInput,
    PoolServingInput,
    RunningTotals,
    ServingLoadInputs,
)
from kvrelay.relay.engines import EngineState
from kvrelay.relay.pool_runtime import PoolRuntime
from kvrelay.relay.pool_view import base_model

#: Pool roles whose engines are a model's frontends (see the module docstring).
FRONTEND_ROLES = frozenset(
    {pb.WorkerRole.AGGREGATED, pb.WorkerRole.DECODE, pb.WorkerRole.LEGACY}
)
_COMPLETED = ("stop", "length")
#: Finish reasons every vLLM lists from its start (``error`` only recent ones).
_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True, slots=True)
class Page:
    """One successful scrape: when (unix ms) and what it said."""

    observed_ms: int
    page: EnginePage


@dataclass(frozen=True, slots=True)
class _Frontends:
    """A model's frontends as their stored pages show them now."""

    expected: int
    observed: int
    ready: int
    times: list[int]  # scrape time (unix ms) of each observed frontend's page
    present: list[Hashable]  # the sources (see :func:`source_key`) configured now
    reports: dict[Hashable, dict[str, int]]  # what each source's page reported
    started: dict[Hashable, float]  # when each reporting source's process started, if known


def source_key(pool: str, engine: EngineState, rank: int) -> Hashable:
    """What a source's running total is kept under: the frontend's address and DP rank, so a
    rename or a move to another pool of the model does not count it again (an engine without a
    ``metrics_port`` never reports: its configured names do)."""
    spec = engine.spec
    if spec.metrics_port is None:
        return (pool, spec.name, rank)
    return (spec.host, spec.metrics_port, rank)


def page_model(pool: PoolRuntime, st: EngineState) -> str | None:
    """The ``model_name`` label to read an engine's page by: vLLM labels its samples with the
    name it serves under, which Control tells (kept through a Control outage), not the canonical
    id the pool may be configured with; for a static engine, the pool's model."""
    snap = st.last_good
    if snap is not None and snap.served_model_name:
        return snap.served_model_name
    return pool.base_model()


def rank_counters(r: RankServing) -> dict[str, int]:
    """The serving-load counters one rank's page figures give (absent figures give none).

    The request counters need the finish reasons ``stop``, ``length`` and ``abort`` of
    ``vllm:request_success_total`` on the page for the rank (``requests_failed_total`` needs
    ``error``): vLLM lists every reason it has from its start, zeros included, so a page without
    one is cut short or not vLLM's. Read as zeros, it looked like the rank had restarted, and
    every counter it had reported was counted a second time once a whole page came back."""
    out: dict[str, int] = {}
    f = r.finished
    if all(k in f for k in _REASONS):
        out["requests_completed_total"] = sum(f[k] for k in _COMPLETED)
        out["requests_cancelled_total"] = f["abort"]
        if "error" in f:  # absent: unknown (an older vLLM has no such reason), never zero
            out["requests_failed_total"] = f["error"]
        if r.running is not None and r.waiting is not None:
            out["requests_started_total"] = sum(f.values()) + r.running + r.waiting
    if r.prompt_tokens_total is not None:
        out["input_tokens_total"] = r.prompt_tokens_total
    if r.generation_tokens_total is not None:
        out["output_tokens_total"] = r.generation_tokens_total
    return out


class ServingInputs:
    """Builds one window's ``ServingLoadInputs``; keeps the pages and the running totals.
    ``pools``: the relay's configured pools now."""

    def __init__(self, pools: Callable[[], Iterable[PoolRuntime]]) -> None:
        self._pools = pools
        self.pages: dict[tuple[str, str], Page] = {}  # (pool, engine) → latest good scrape
        self._unfolded: set[tuple[str, str]] = set()  # pages stored since the last fold
        self.totals = RunningTotals()
        self._pool_ids: IdentityMemo[pb.KvPoolId] = IdentityMemo()  # sort keys, once per pool

    def store(self, pool: str, engine: str, page: Page | None) -> None:
        """Keep an engine's latest page (None: not known now), the one it replaces folded into
        the totals first if they have not seen it (see the module docstring)."""
        key = (pool, engine)
        if key in self._unfolded:
            self._fold()
        if page is None:
            self.pages.pop(key, None)
        else:
            self.pages[key] = page
            self._unfolded.add(key)

    def forget(self, pool: str, engine: str) -> None:
        self.store(pool, engine, None)

    def build(self) -> ServingLoadInputs:
        """Pools: the published ones. Models: every configured pool whose model is known, so a
        model whose pools are all withdrawn (its engines down) stays, UNAVAILABLE, with its
        totals, until its pools leave the configuration."""
        pools = list(self._pools())
        pool_inputs: list[PoolServingInput] = []
        published: set[str] = set()
        for p in pools:
            item = p.load_input()
            if item is not None:
                producer, ranks = item
                pool_inputs.append(self._pool(p, producer, ranks))
                if producer.pool_id is not None:
                    published.add(p.name)
        groups = _groups(pools, published)
        models = [self._model(ns, model, ps) for (ns, model), ps in groups.items()]
        self._unfolded.clear()  # each model's totals have seen its pages
        # the pool ids listed now only: every rebuilt generation brings a new one, and the memo
        # kept the dead ones (a fence, a reload, a model change each) up to its bound of 4,096
        self._pool_ids.retain(pid for m in models for pid in m.serving_pools)
        return ServingLoadInputs(pools=pool_inputs, models=models)

    def _fold(self) -> None:
        """Fold the pages stored now into the running totals without building a window."""
        self._unfolded.clear()  # first: a fold that raised is not tried again at every store
        for group, ps in _groups(self._pools(), frozenset()).items():
            f = self._frontends(ps)
            self.totals.window(group, f.present, f.reports, f.started)

    def _pool(
        self, p: PoolRuntime, producer: pb.ProducerIdentity, ranks: list[RankLoad]
    ) -> PoolServingInput:
        engines = list(p.engines.values())
        live = [st for st in engines if st.serving]
        connected = p.connected.live_engines() if p.connected is not None else 0
        times = [pg.observed_ms for st in engines if (pg := self.pages.get((p.name, st.spec.name)))]
        return PoolServingInput(
            producer=producer,
            ranks=ranks,
            observed_ms=times,
            live_workers=len(live) + connected,
            max_concurrency=None if connected else _max_concurrency(live),
        )

    def _model(
        self, namespace: str, model: str, pools: list[tuple[PoolRuntime, bool]]
    ) -> ModelServingInput:
        f = self._frontends(pools)
        serving_pools = sorted(
            (pid for p, published in pools if published and (pid := _pool_id(p)) is not None),
            key=lambda pid: self._pool_ids.data(pid),
        )
        return ModelServingInput(
            namespace=namespace,
            canonical_model_id=model,
            expected_frontends=f.expected,
            observed_frontends=f.observed,
            ready_frontends=f.ready,
            serving_pools=serving_pools,
            totals=self.totals.window((namespace, model), f.present, f.reports, f.started),
            observed_ms=f.times,
        )

    def _frontends(self, pools: list[tuple[PoolRuntime, bool]]) -> _Frontends:
        """A frontend is observed when its page is there and gives the model's request figures
        for every rank it declares. Each engine of the model's pools serves the model, so a page
        without them (stats disabled, another engine's format, a rank's label missing, the model
        not listed) is not a report of zero. An engine declared down has departed: not
        expected (what its page still reports counts in the totals)."""
        expected = observed = ready = 0
        times: list[int] = []
        present: list[Hashable] = []
        reports: dict[Hashable, dict[str, int]] = {}
        started: dict[Hashable, float] = {}
        for p, _ in pools:
            if p.spec.role not in FRONTEND_ROLES:
                continue
            for st in p.engines.values():
                departed = st.down
                expected += not departed
                ranks = st.declared_ranks()
                keys = [source_key(p.name, st, r) for r in ranks]
                present += keys
                pg = self.pages.get((p.name, st.spec.name))
                if pg is None:
                    continue
                whole = True
                for r, key in zip(ranks, keys, strict=True):
                    figures = pg.page.serving.get(str(r))
                    counters = rank_counters(figures) if figures is not None else {}
                    if counters:
                        reports[key] = counters
                        if pg.page.started is not None:
                            started[key] = pg.page.started
                    whole = whole and "requests_started_total" in counters
                if not whole or departed:
                    continue
                observed += 1
                if st.serving:
                    ready += 1
                times.append(pg.observed_ms)
        return _Frontends(expected, observed, ready, times, present, reports, started)


def _groups(
    pools: Iterable[PoolRuntime], published: Container[str]
) -> dict[tuple[str, str], list[tuple[PoolRuntime, bool]]]:
    """Configured pools by (namespace, model), each with whether it is published now."""
    groups: dict[tuple[str, str], list[tuple[PoolRuntime, bool]]] = {}
    for p in pools:
        model = base_model(p.spec, p.engines.values(), p.identity)
        if model is not None:
            groups.setdefault((p.spec.namespace, model), []).append((p, p.name in published))
    return groups


def _pool_id(p: PoolRuntime) -> pb.KvPoolId | None:
    return None if p.generation is None else p.generation.producer.pool_id


def _max_concurrency(live: list[EngineState]) -> int | None:
    """Sum of max running sequences × local DP size, only while every live engine declares it."""
    total = 0
    for st in live:
        snap = st.snapshot
        if snap is None or snap.max_running_requests <= 0:
            return None
        total += snap.max_running_requests * max(1, snap.data_parallel_size_local)
    return total
