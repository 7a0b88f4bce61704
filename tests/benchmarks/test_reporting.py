"""The benchmarks' own bookkeeping: heavy figures over repeats (median, range, which repeat the
tables show) and the quiet-machine verdict every result carries."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from benchmarks._all import ELSEWHERE, STEPS, provenance_problems
from benchmarks._common import RESULTS, tracked_changes
from benchmarks._heavy_report import (
    heavy_markdown,
    median,
    median_summary,
    repeat_spread,
    representative,
)
from benchmarks._load import assess, load_at_start, warn_if_loaded


def _summary(k: float, d: float, p99: float) -> dict[str, object]:
    return {"light": {"available": False}, "delta_p99_where_dynamo_keeps_up": [[1e4, 1, p99]],
            "delta_p99_ratio_max": p99, "heavy_rss_ratio_range": [0.2, 1.0],
            "max_sustained": {"kvrelay": k, "dynamo": d, "ratio": k / d, "first_rate": 1e5},
            "max_ingest": {"kvrelay": 2 * k, "dynamo": 2 * d, "ratio": k / d}}


def test_median() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 2.0, 3.0]) == 2.5


def test_repeats_give_median_and_range_and_the_median_run_is_shown() -> None:
    # the two machines of the issue: one lucky run (1.6M) among two ordinary ones
    sums = [_summary(1_600_523, 300_400, 0.26), _summary(200_400, 100_400, 0.5),
            _summary(400_000, 200_000, 0.3)]
    spread = repeat_spread(sums)
    k = spread["max sustained ingest, kvrelay (block events/s)"]
    assert (k["median"], k["min"], k["max"]) == (400_000, 200_400, 1_600_523)
    assert k["values"] == [1_600_523, 200_400, 400_000]
    ratio = spread["max sustained ratio kvrelay / Dynamo"]
    assert ratio["median"] == pytest.approx(2.0)  # the median of the ratios, not of the maxima
    med = median_summary(sums, spread)
    assert med["max_sustained"]["kvrelay"] == 400_000  # type: ignore[index]
    assert med["delta_p99_ratio_max"] == 0.3
    assert med["heavy_rss_ratio_range"] == [0.2, 1.0]
    assert sums[0]["max_sustained"]["kvrelay"] == 1_600_523  # type: ignore[index]
    assert representative(sums) == 2  # its tables are those shown


def test_a_repeat_without_a_figure_is_left_out_of_the_median() -> None:
    a, b = _summary(100.0, 50.0, 0.2), _summary(300.0, 50.0, 0.4)
    b["delta_p99_ratio_max"] = None
    spread = repeat_spread([a, b])
    assert spread["worst delta p99 ratio where Dynamo keeps up"]["median"] == 0.2
    assert spread["worst delta p99 ratio where Dynamo keeps up"]["values"] == [0.2, None]


def test_heavy_markdown_says_it_shows_medians() -> None:
    res = json.loads((RESULTS / "side_by_side_heavy.json").read_text())
    for key in ("summary_repeats", "representative_repeat", "repeats"):  # a single run
        res.pop(key, None)
    one = heavy_markdown(res)
    assert "one run" in one and "## Over" not in one
    sums = [copy.deepcopy(res["summary"]) for _ in range(3)]
    for s, k in zip(sums, (1_000_000, 1_600_523, 1_200_000), strict=True):
        s["max_sustained"]["kvrelay"] = k
    res["summary_repeats"] = repeat_spread(sums)
    res["summary"] = median_summary(sums, res["summary_repeats"])
    res["representative_repeat"] = representative(sums)
    md = heavy_markdown(res)
    assert "median of 3 runs" in md and "## Over 3 repeats (median, range)" in md
    assert "| max sustained ingest, kvrelay (block events/s) | 1,200,000 | 1,000,000–1,600,523 |" \
        in md
    assert "kvrelay 1,200,000" in md  # the targets table quotes the median


def test_quiet_verdict() -> None:
    assert assess(0.9, 1, 2, None)["quiet"]  # the benchmark itself and a little more
    loaded = assess(3.5, 1, 2, None)
    assert not loaded["quiet"] and "3.5" in loaded["not_quiet_because"]
    assert loaded["load_1min_excess"] == 2.5
    busy = assess(0.2, 0, 2, 1.4)  # the load average lags: the sample says busy
    assert not busy["quiet"] and "1.4 cores busy" in busy["not_quiet_because"]
    assert assess(1.0, 0, 2, 1.0)["quiet"]  # half the cores is still quiet


def test_a_loaded_machine_is_warned_about(capsys: pytest.CaptureFixture[str]) -> None:
    block = load_at_start()
    assert set(block) >= {"loadavg_at_start", "load_1min", "quiet", "not_quiet_because"}
    block |= assess(9.0, 1, 2, None)
    text = warn_if_loaded(block, "bench")
    assert text is not None and "not quiet" in text and text in capsys.readouterr().err
    assert warn_if_loaded(assess(0.0, 0, 2, None), "bench") is None


def test_regeneration_covers_every_committed_result() -> None:
    written = {stem for _, _, stems in STEPS for stem in stems}
    elsewhere = {stem for stem, _ in ELSEWHERE}  # measured on another machine (device_grid)
    assert not written & elsewhere
    assert written == {p.stem for p in RESULTS.glob("*.json")} - elsewhere


def test_provenance_problems(tmp_path: Path) -> None:
    def result(name: str, **machine: object) -> None:
        (tmp_path / f"{name}.json").write_text(json.dumps({"machine": machine}))

    result("ok", git_commit="abc1234", git_dirty=False, quiet=True)
    result("loaded", git_commit="abc1234", git_dirty=False, quiet=False,
           not_quiet_because="1-min load average 7.7")
    result("old", git_commit="0000000", git_dirty=False, quiet=True)
    result("dirty", git_commit="abc1234", git_dirty=True, quiet=True)
    (tmp_path / "none.json").write_text(json.dumps([1, 2]))  # no machine block at all
    stale, loaded = provenance_problems("abc1234", tmp_path)
    assert stale == ["dirty.json: commit abc1234 + local changes", "none.json: commit None",
                     "old.json: commit 0000000"]
    assert loaded == ["loaded.json: 1-min load average 7.7"]


def test_a_result_rewritten_by_the_run_is_not_a_local_change(tmp_path: Path) -> None:
    """``benchmarks.run --all`` rewrites results one after another: those must not make every
    later step's code "dirty", while an edited source file must."""
    import subprocess

    def git(*argv: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *argv], check=True, capture_output=True)

    git("init", "-q")
    git("config", "user.email", "t@example.invalid")
    git("config", "user.name", "t")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "pool.json").write_text("{}")
    (tmp_path / "kvrelay.py").write_text("x = 1\n")
    git("add", "-A")
    git("commit", "-qm", "base")
    assert tracked_changes(tmp_path) == []
    (tmp_path / "benchmarks" / "results" / "pool.json").write_text('{"new": 1}')
    assert tracked_changes(tmp_path) == []
    (tmp_path / "kvrelay.py").write_text("x = 2\n")
    assert tracked_changes(tmp_path) == ["kvrelay.py"]


def test_settle_waits_only_while_the_load_average_is_over_the_limit() -> None:
    import os

    from benchmarks._all import settle
    from benchmarks._load import QUIET_SHARE

    over = os.getloadavg()[0] > QUIET_SHARE * (os.cpu_count() or 1)
    waited = settle(max_wait_s=0.2, poll_s=0.05)
    assert waited < 1.0  # bounded by max_wait_s
    if not over and os.getloadavg()[0] <= QUIET_SHARE * (os.cpu_count() or 1):
        assert waited < 0.05  # a quiet machine: no wait at all


def test_light_side_by_side_splits_kvrelay_cpu_at_the_ingest_floor() -> None:
    """Per rate, over the sweeps: the floor against Dynamo's relay CPU and kvrelay's CPU above
    it, (kvrelay - floor) / Dynamo, as medians; the headline quotes their spans."""
    from benchmarks._report import _sbs_headline
    from benchmarks.side_by_side import light_spread, sweep_row

    def point(rate: float, k: float, d: float, f: float) -> dict[str, object]:
        relay = {"cpu_util": 0.0, "rss_bytes": 100}
        return {"requests_per_s_offered": rate, "floor": {"messages": 10, "cpu_util": f},
                "floor_libzmq": {"messages": 10, "cpu_util": f * 2},
                "relays": {"kvrelay": dict(relay, cpu_util=k), "dynamo": dict(relay, cpu_util=d)}}

    sweeps = [[sweep_row(point(25, k, 0.010, f)), sweep_row(point(100, 2 * k, 0.040, 2 * f))]
              for k, f in ((0.014, 0.004), (0.012, 0.003), (0.016, 0.005))]
    spread = light_spread(sweeps)
    assert spread["25 req/s"]["floor_cpu_ratio"]["median"] == pytest.approx(0.4)
    assert spread["25 req/s"]["above_floor_cpu"]["median"] == pytest.approx(1.0)
    assert spread["100 req/s"]["floor_cpu_ratio"]["median"] == pytest.approx(0.2)
    assert spread["100 req/s"]["above_floor_cpu"]["median"] == pytest.approx(0.5)
    md = "\n".join(_sbs_headline({"sweeps": sweeps, "light_load_spread": spread}))
    assert "**ingest floor: 0.20–0.40× Dynamo's relay CPU; kvrelay above the floor: " \
           "0.50–1.00×**" in md
    assert spread["25 req/s"]["libzmq_floor_cpu_ratio"]["median"] == pytest.approx(0.8)
    assert "**The same messages read with pyzmq: 0.40–0.80× Dynamo's relay CPU**" in md


def test_light_side_by_side_refuses_render() -> None:
    """``--render`` redoes the heavy result; a light run would overwrite the light one."""
    from benchmarks.side_by_side import main

    with pytest.raises(SystemExit) as exc:
        main(["--render"])
    assert exc.value.code == 2


def test_process_cpu_is_the_kernels_total_in_ns_exited_threads_included() -> None:
    """The benchmarks' CPU reading of another process agrees with /proc's clock ticks (the
    independent total) and keeps the CPU of a thread that has exited."""
    import subprocess
    import sys

    from benchmarks._common import CLK_TCK, process_cpu_s, process_ticks_s

    spin = (
        "import threading, time, sys\n"
        "def burn():\n"
        "    t = time.thread_time()\n"
        "    while time.thread_time() - t < 0.3: pass\n"
        "th = threading.Thread(target=burn); th.start(); th.join()\n"
        "print('done', flush=True); sys.stdin.readline()\n"
    )
    with subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as p:
        assert p.stdout is not None and p.stdin is not None
        try:
            assert p.stdout.readline().strip() == "done"
            cpu = process_cpu_s(p.pid)
            ticks = process_ticks_s(p.pid)
            assert cpu >= 0.3  # the exited thread's 0.3 s is in it
            assert abs(cpu - ticks) <= 2.5 / CLK_TCK  # one total, read to the tick
            assert cpu * CLK_TCK != round(cpu * CLK_TCK)  # read in ns, not in ticks
        finally:
            p.stdin.close()
            p.wait(10)
