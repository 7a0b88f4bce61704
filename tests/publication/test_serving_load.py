"""Serving-load plane: the coverage rule, what each view sets (and leaves unset), and the
running totals against a brute-force oracle of the incarnation rules."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.publication.load import RankLoad
from kvrelay.publication.serving_load import (
    ModelServingInput,
    PoolServingInput,
    RunningTotals,
    ServingLoadInputs,
    ServingLoadPlane,
    coverage,
    model_entry,
    pool_entry,
)

S = pb.DataStatus
MakeProducer = Callable[..., pb.ProducerIdentity]


def test_coverage_is_never_complete_when_partial() -> None:
    assert coverage(0, 0) == S.UNAVAILABLE  # nothing expected: nothing to vouch for
    assert coverage(0, 3) == S.UNAVAILABLE
    assert coverage(1, 3) == S.DEGRADED
    assert coverage(2, 3) == S.DEGRADED
    assert coverage(3, 3) == S.COMPLETE


def test_pool_gauge_only_when_every_rank_reported(producer: MakeProducer) -> None:
    full = pool_entry(
        PoolServingInput(producer(1), [RankLoad(3, 10), RankLoad(0, 10)], [500, 400], 2, 64)
    )
    assert full.load.status == S.COMPLETE
    assert full.load.tokens.active_decode_blocks == 3
    assert full.load.tokens.active_prefill_tokens is None  # no source: never set
    assert full.load.requests is None  # pools carry no request stats
    assert full.load.source_observed_ms == 400  # the oldest contributing report
    assert (full.deployment.live_workers, full.deployment.max_concurrency) == (2, 64)
    idle = pool_entry(PoolServingInput(producer(1), [RankLoad(0, 10)], [7]))
    assert idle.load.status == S.COMPLETE and idle.load.tokens.active_decode_blocks == 0
    assert bytes(idle.load.tokens) != b""  # a set zero is on the wire, unlike unset
    partial = pool_entry(PoolServingInput(producer(1), [RankLoad(3, 10), RankLoad(None, 10)]))
    assert partial.load.status == S.DEGRADED
    assert partial.load.tokens.active_decode_blocks is None  # a partial sum would read low
    none = pool_entry(PoolServingInput(producer(1), [RankLoad(None, 10)], [5], None, None))
    assert none.load.status == S.UNAVAILABLE and none.load.source_observed_ms == 0
    assert none.deployment.live_workers is None and none.deployment.max_concurrency is None


def test_model_counters_whatever_the_status(pool_id: Callable[..., pb.KvPoolId]) -> None:
    m = model_entry(
        ModelServingInput(
            "ns", "llama", 3, 1, 1, [pool_id(2), pool_id(1)],
            {"requests_started_total": 9, "requests_completed_total": 7, "output_tokens_total": 0},
            [900],
        )
    )  # fmt: skip
    assert m.load.status == S.DEGRADED
    r = m.load.requests
    assert (r.requests_started_total, r.requests_completed_total) == (9, 7)
    assert r.requests_awaiting_first_token is None and r.requests_generating is None
    assert m.load.tokens.output_tokens_total == 0  # reported (zero) ...
    assert m.load.tokens.input_tokens_total is None  # ... vs never reported: unset
    assert m.load.tokens.inflight_input_tokens is None
    d = m.deployment
    assert (d.expected_frontends, d.observed_frontends, d.ready_frontends) == (3, 1, 1)
    assert len(d.serving_pools) == 2 and m.load.source_observed_ms == 900
    with pytest.raises(ValueError):
        model_entry(ModelServingInput("ns", "llama", 1, 2, 0))  # observed > expected
    with pytest.raises(ValueError):
        model_entry(ModelServingInput("", "llama", 1, 1, 1))


def _oracle(history: list[dict[str, dict[str, int] | None]]) -> dict[str, int]:
    """Brute force: per source, the sum over its runs (a run ends where a true counter drops)
    of the last value each counter reached in the run (the derived one: its running max)."""
    out: dict[str, int] = {}
    sources = {s for w in history for s in w}
    for src in sources:
        runs: list[dict[str, int]] = [{}]
        for w in history:
            values = w.get(src)
            if values is None:
                continue
            last = runs[-1]
            if any(k != "requests_started_total" and v < last.get(k, 0) for k, v in values.items()):
                runs.append({})
                last = runs[-1]
            for k, v in values.items():
                last[k] = v if k not in last else max(v, last[k])
        for run in runs:
            for k, v in run.items():
                out[k] = out.get(k, 0) + v
    return out


def test_running_totals_match_the_oracle_through_restarts_and_departures() -> None:
    rng = random.Random(5)
    totals = RunningTotals()
    history: list[dict[str, dict[str, int] | None]] = []
    state = {s: {"requests_completed_total": rng.randrange(100)} for s in "abc"}
    present = set("abc")
    for _ in range(300):
        window: dict[str, dict[str, int] | None] = {}
        for s in sorted(present):
            c = state[s]
            roll = rng.random()
            if roll < 0.05:  # the frontend restarted: its counters start over
                c["requests_completed_total"] = rng.randrange(3)
            elif roll < 0.15:  # its page is missing this window: keeps its last values
                continue
            else:
                c["requests_completed_total"] += rng.randrange(4)
            started = c["requests_completed_total"] + rng.randrange(3)  # + in flight
            window[s] = {**c, "requests_started_total": started}
        if rng.random() < 0.03 and len(present) > 1:
            gone = rng.choice(sorted(present))  # removed from the config: its report unread
            present.discard(gone)
            window.pop(gone, None)
        elif rng.random() < 0.05 and len(present) < 3:
            present.add(rng.choice(sorted(set("abc") - present)))  # back: counted once, on
        history.append(window)
        got = totals.window("m", present, {k: v for k, v in window.items() if v is not None})
        assert got == _oracle(history)
    # A new relay incarnation (a fresh RunningTotals) starts from each running total.
    fresh = RunningTotals().window("m", ["a"], {"a": {"requests_completed_total": 41}})
    assert fresh == {"requests_completed_total": 41}


def test_running_totals_are_monotonic_and_bounded() -> None:
    t = RunningTotals(max_groups=2)
    assert t.window("m", ["x"], {"x": {"requests_completed_total": 10}})[
        "requests_completed_total"
    ] == 10
    assert t.window("m", ["x"], {"x": {"requests_completed_total": 2}})[
        "requests_completed_total"
    ] == 12  # restarted at 0 and counted 2 more
    assert t.window("m", [], {}) == {"requests_completed_total": 12}  # departed: kept
    t.window("g2", [], {})
    t.window("g3", [], {})  # over the bound: the longest-unused group ("m") is forgotten
    assert t.window("m", [], {}) == {}
    # departed sources past the bound are folded: their totals stay, told apart no more
    few = RunningTotals(max_departed=1)
    few.window("m", ["a", "b"], {"a": {"n": 5}, "b": {"n": 7}})
    assert few.window("m", [], {}) == {"n": 12}
    assert few.window("m", ["b"], {"b": {"n": 8}}) == {"n": 13}  # "b" went on from 7
    assert few.window("m", ["a", "b"], {"a": {"n": 6}}) == {"n": 19}  # "a" was folded


def test_a_new_process_start_time_is_a_restart_and_the_same_one_is_not() -> None:
    """With the source's process start time on both reports, it alone tells a restart: a
    restarted engine that overtook its old counts before the next scrape still keeps them, and a
    dip of the same process is held (a skew), not counted again. A report missing a counter it
    gave before is cut short: ignored whole, unless it comes from a new process."""
    t = RunningTotals()
    done, out = "requests_completed_total", "output_tokens_total"
    assert t.window("m", ["a"], {"a": {done: 10, out: 100}}, {"a": 1.0}) == {done: 10, out: 100}
    # restarted and already past its old counts: only the start time says so
    assert t.window("m", ["a"], {"a": {done: 12, out: 150}}, {"a": 2.0}) == {done: 22, out: 250}
    # the same process, a counter lower (a skew): held, not a restart
    assert t.window("m", ["a"], {"a": {done: 11, out: 150}}, {"a": 2.0}) == {done: 22, out: 250}
    # the same process, a report missing a counter: ignored whole (its higher figure too)
    assert t.window("m", ["a"], {"a": {out: 170}}, {"a": 2.0}) == {done: 22, out: 250}
    # a new process whose first page lacks a counter: a restart all the same
    assert t.window("m", ["a"], {"a": {out: 5}}, {"a": 3.0}) == {done: 22, out: 255}
    assert t.window("m", ["a"], {"a": {done: 1, out: 6}}, {"a": 3.0}) == {done: 23, out: 256}
    # without a start time on both reports, a true counter going down is the restart
    assert t.window("m", ["a"], {"a": {done: 0, out: 7}}) == {done: 23, out: 263}
    assert t.window("m", ["a"], {"a": {done: 2, out: 9}}) == {done: 25, out: 265}
    # ... and a report missing a counter, no counter down, is ignored whole as well
    assert t.window("m", ["a"], {"a": {out: 30}}) == {done: 25, out: 265}


def test_plane_sorts_drops_bad_entries_and_skips_failed_windows(
    relay: pb.RelayIdentity, producer: MakeProducer
) -> None:
    good = ModelServingInput("ns", "b", 1, 1, 1)
    inputs = ServingLoadInputs(
        pools=[PoolServingInput(producer(2), []), PoolServingInput(producer(1), [])],
        models=[good, ModelServingInput("ns", "a", 0, 1, 0), good],  # one bad, one twice
    )
    fail = False

    def provide() -> ServingLoadInputs:
        if fail:
            raise RuntimeError("boom")
        return inputs

    plane = ServingLoadPlane(relay, window_ms=500, provider=provide)
    seq, w = plane.current()
    assert seq == 0 and w.window_ms == 500 and w.contract_marker == 0x4B565231
    assert [bytes(p.producer) for p in w.pools] == sorted(bytes(producer(i)) for i in (1, 2))
    assert [m.canonical_model_id for m in w.models] == ["b"]
    assert plane.entry_errors == 2
    fail = True
    assert not plane.publish_window() and plane.provider_errors == 1
    assert plane.current()[0] == 0  # skipped, not published empty
    assert plane.provider_errors == 2  # still due: a read tried it again
    fail = False
    # The next window is numbered past the skipped one (as if each had been built on time):
    # reusing its number told a subscriber that one window had passed where two had.
    assert plane.publish_window() and plane.current()[0] == 2
