"""``benchmarks.device_grid`` plans and reports its grid as documented, without processes: a
fake fleet and load point on a fake clock stand in for ``_harness`` (the real thing runs in
``test_smoke.py``'s process tier and on a 16-core device machine, benchmarks/README.md).

The order (the targets first), the budget (what does not fit is skipped, with the reason, and
the target points of later fleets are kept time for), a failing point (recorded, its fleet
restarted), and the report (a table per workers value, the three targets, the scaling model
beside every point it covers)."""

from __future__ import annotations

import argparse
import time
from typing import Any

import pytest

from benchmarks import device_grid as dg
from benchmarks import sim_scaling


class FakeTime:
    """What device_grid reads of ``time``, on a clock that only the fakes advance."""

    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s

    def strftime(self, *a: Any) -> str:
        return time.strftime(*a)


START_S, STOP_S = 20.0, 5.0


def overhead(subs: int) -> float:
    """A point's time beyond its load: under device_grid's first guess, as a real one should."""
    return 2.0 + 0.01 * subs


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    clock = FakeTime()
    state: dict[str, Any] = {"clock": clock, "starts": [], "fail": set(), "ran": []}

    class Fleet:
        def __init__(self, cfg: Any) -> None:
            self.cfg, self.loadgens, self.relay, self.port = cfg, [], None, 1

        def start(self) -> None:
            clock.t += START_S
            state["starts"].append(self.cfg.workers)

        def stop(self) -> None:
            clock.t += STOP_S

        def stats(self) -> dict[str, Any]:
            return {"internal_service_errors": {}, "workers": {"alive": 1}}

    def load_point(fleet: Any, rate: float, n: int, seconds: float, tag: str) -> dict[str, Any]:
        clock.t += seconds + overhead(n)
        w = fleet.cfg.workers
        state["ran"].append((w, rate, n))
        if (w, rate, n) in state["fail"]:
            raise RuntimeError("sub-x exited (1)")
        deltas = 400.0
        p99 = 5.0 * n / 64 / w  # more workers, lower tail: T1 met from some workers value
        return {
            "offered_rate": rate, "achieved_rate": rate, "subscribers": n, "seconds": seconds,
            "sent_block_events": rate * seconds, "ingested_block_events": rate * seconds,
            "drain_s": 0.1, "loadgen_hwm_drops": 0, "stream_error_count": 0,
            "relay_counters": {"lag_errors": 0, "ingest_gaps": 0, "ingest_resets": 0,
                               "member_resets": 0, "events_rejected": 0},
            "delta_latency_ms": {"p50": 1.0, "p99": p99},
            "frames_received": deltas * n * seconds * min(w, 3),
            "publications": deltas * seconds, "relay_cpu_util": 1.0,
            "relay_process_cpu_util": {"ingest": 0.5, "workers": [0.3] * (w - 1)},
        }  # fmt: skip

    monkeypatch.setattr(dg, "time", clock)
    monkeypatch.setattr(dg, "Fleet", Fleet)
    monkeypatch.setattr(dg, "load_point", load_point)
    monkeypatch.setattr(dg, "_orphans", lambda fleet: None)
    monkeypatch.setattr(sim_scaling, "TRIALS", 50)
    return state


def _args(budget_s: float, **kw: Any) -> argparse.Namespace:
    base = {"workers": dg.WORKERS, "subs": dg.SUBS, "rates": dg.RATES, "point_s": 4.0,
            "budget_s": budget_s, "engines": 4, "working_set": 16384, "smoke": False}
    return argparse.Namespace(**(base | kw))


MACHINE = {"cpu_model": "test", "cores": 16, "mem_total_bytes": 2**37, "kernel": "k",
           "python": "3.12", "loadavg_at_start": [0.1, 0.1, 0.1], "utc": "now",
           "git_commit": "abc1234", "git_dirty": False, "quiet": True}


def _run(a: argparse.Namespace) -> dict[str, Any]:
    inputs = dict(sim_scaling.DEFAULTS, source="defaults")
    res = dg.new_result(a, dg.TARGETS, MACHINE, inputs)
    dg.run_grid(a, res, lambda: None)
    res["summary"] = dg.summary(res)
    return res


def _status(res: dict[str, Any]) -> dict[tuple[int, int, int], str]:
    return {(p["workers"], p["offered_rate"], p["subscribers"]): p["status"]
            for p in res["points"]}


def test_the_target_points_have_the_first_tier_and_run_first() -> None:
    points = dg.make_points(dg.WORKERS, dg.SUBS, dg.RATES, dg.TARGETS)
    assert len(points) == 36
    tier0 = {(p["workers"], p["offered_rate"], p["subscribers"]) for p in points
             if p["tier"] == 0}  # fmt: skip
    assert tier0 == {(w, 300_000, 64) for w in dg.WORKERS} | {(8, 100_000, 1024)}
    assert {p["workers"] for p in points if p["tier"] == 1} == {1, 4}  # T3 compares them
    assert {p["workers"] for p in points if p["tier"] == 2} == {2, 8}
    order = dg.fleet_points(points, 8)
    assert [p["tier"] for p in order[:2]] == [0, 0] and order[0]["targets"] == ["t2"]


def test_a_grid_that_fits_runs_every_point(fake: dict[str, Any]) -> None:
    res = _run(_args(3600))
    assert set(_status(res).values()) == {"ok"}
    assert fake["starts"] == [1, 2, 4, 8]  # one fleet at a time, each started once
    s = res["summary"]
    assert s["t1"]["met"] and s["t1"]["met_by_workers"] == [1, 2, 4, 8]
    assert s["t2"]["met"] and s["t2"]["point"]["delta_p99_ms"] == 10.0  # 5 * 1024 / 64 / 8
    # the best point within the criterion: workers = 1 at 256 subscribers (p99 20 ms; 80 at
    # 1,024), workers = 4 at 1,024 (20 ms), three times the frames per stream: 4 x 3 = 12
    assert s["t3"]["best"]["1"]["at"] == [100_000, 256]
    assert s["t3"]["best"]["4"]["at"] == [100_000, 1024]
    assert s["t3"]["ratio"] == 12.0 and s["t3"]["met"]


def test_a_short_budget_keeps_the_target_points_and_records_what_it_skipped(
    fake: dict[str, Any],
) -> None:
    budget = 200.0
    res = _run(_args(budget))
    status = _status(res)
    tier0 = [k for k, p in zip(status, res["points"], strict=True) if p["tier"] == 0]
    assert all(status[k] == "ok" for k in tier0)
    skipped = [p for p in res["points"] if p["status"] == "skipped"]
    assert skipped and all(p["skipped_because"].startswith("budget") for p in skipped)
    assert "pending" not in status.values()
    assert fake["clock"].t - 1000.0 <= budget  # the last fleet's stop included
    assert res["summary"]["points"]["skipped"] == len(skipped)


def test_a_failing_point_is_recorded_and_its_fleet_restarted(fake: dict[str, Any]) -> None:
    fake["fail"].add((2, 100_000, 256))
    res = _run(_args(3600, workers=(1, 2)))
    bad = next(p for p in res["points"] if (p["workers"], p["offered_rate"], p["subscribers"])
               == (2, 100_000, 256))  # fmt: skip
    assert bad["status"] == "failed" and "sub-x exited" in bad["error"]
    assert fake["starts"] == [1, 2, 2]
    assert [p["status"] for p in res["points"]].count("ok") == len(res["points"]) - 1
    assert len(res["fleets"]["2"]["starts"]) == 2


def test_the_report_has_a_table_per_workers_value_the_targets_and_the_model(
    fake: dict[str, Any],
) -> None:
    res = _run(_args(250))
    md = dg.markdown(res)
    for w in dg.WORKERS:
        assert f"### workers = {w}" in md
    assert "| T1: 64 subscribers at 300,000 ev/s" in md and "| T2: 1,024 subscribers" in md
    assert "| T3: delivered frames/s" in md
    assert "skipped: budget" in md
    # the model beside the points of workers >= 2, none for the single process
    modelled = [p for p in res["points"] if p.get("model")]
    assert modelled and all(p["workers"] > 1 for p in modelled)
    p = modelled[0]
    assert p["model"]["workers"] == p["workers"] - 1
    assert p["model"]["routers"] == p["subscribers"]
    assert p["model"]["deltas_per_s"] == 400.0
    assert f"({p['model']['busiest_worker_util']})" in md


def test_no_restart_when_the_budget_cannot_carry_one(fake: dict[str, Any]) -> None:
    fake["fail"].add((1, 300_000, 64))  # the fleet's first point (tier 0)
    res = _run(_args(60, workers=(1,)))
    assert fake["starts"] == [1]
    first, *rest = dg.fleet_points(res["points"], 1)
    assert first["status"] == "failed"
    assert rest and all(p["skipped_because"].startswith("budget: no time to restart")
                        for p in rest)  # fmt: skip
