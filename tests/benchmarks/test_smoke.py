"""Every benchmark script still runs at HEAD: each one's ``--smoke`` mode (seconds, tiny sizes).

A refactor that breaks a benchmark otherwise goes unnoticed until someone regenerates the
results (``mirror_dynamo`` crashed at once for a while). Each script runs as a subprocess the
way ``benchmarks.run --all`` starts it, with ``KVRELAY_BENCH_WORK`` and ``KVRELAY_BENCH_RESULTS``
pointed at a temporary directory: a smoke run writes to ``<work>/smoke``, and nothing may touch
the committed ``benchmarks/results``.

Two tiers (benchmarks/README.md, "Smoke runs"): the renders of the committed results always
run (a second); every script, in-process or starting relays, engines and subscriber processes
(3-6 min together on two busy cores), runs with ``KVRELAY_BENCH_SMOKE=1``
(``make bench-smoke``): ``make test`` is kept under its ten minutes. Those that need Dynamo's
``.venv-dynamo`` or root for a network namespace skip with the reason when it is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks._common import RESULTS, ROOT
from benchmarks._dynamo_env import DPY

PROCESS_TIER = os.environ.get("KVRELAY_BENCH_SMOKE") == "1"
NEEDS_TIER = pytest.mark.skipif(
    not PROCESS_TIER, reason="starts relay processes (3-6 min in all): KVRELAY_BENCH_SMOKE=1 "
    "or make bench-smoke")  # fmt: skip


def _dynamo_missing() -> str | None:
    if not Path(DPY).exists():
        return (".venv-dynamo not installed (python -m benchmarks.side_by_side installs "
                "ai-dynamo 1.6.1 there on first use)")
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2 for a private network namespace"
    return None


NEEDS_DYNAMO = pytest.mark.skipif(_dynamo_missing() is not None,
                                  reason=str(_dynamo_missing()))


def _results_state() -> dict[str, float]:
    return {p.name: p.stat().st_mtime for p in RESULTS.iterdir()} if RESULTS.exists() else {}


def _smoke(tmp_path: Path, *argv: str, timeout: float = 300.0) -> Path:
    """Run ``python -m benchmarks.<argv>`` in smoke mode; the directory it wrote to."""
    before = _results_state()
    env = dict(os.environ, KVRELAY_BENCH_WORK=str(tmp_path / "work"),
               KVRELAY_BENCH_RESULTS=str(tmp_path / "results"), PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(argv)} exited {r.returncode}:\n{r.stdout[-3000:]}\n" \
                              f"{r.stderr[-3000:]}"
    assert _results_state() == before, "a smoke run touched benchmarks/results"
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir()), \
        "a smoke run wrote where the committed results go"
    return tmp_path / "work" / "smoke"


def _json(path: Path) -> dict[str, object]:
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict)
    m = doc["machine"]
    assert isinstance(m, dict) and m["git_commit"] and "quiet" in m and "load_1min" in m
    return doc


# ---- always: in-process micro-benchmarks, start-up, the model, renders -------------------------

MICRO = [("bench_hashing", "hashing.json"), ("bench_ingest", "ingest.json"),
         ("bench_sim", "bench_sim.json"), ("bench_planes", "planes.json"),
         ("bench_client", "bench_client.json"), ("bench_pool", "pool.json"),
         ("bench_fanout", "fanout.json"), ("bench_start", "start-short.json"),
         ("sim_scaling", "scaling_model.json"), ("one_channel", "one_channel.json"),
         ("bench_checkpoint", "checkpoint.json"), ("bench_cold", "cold_calls.json"),
         ("bench_fleet_planes", "fleet_planes.json")]  # fmt: skip


@NEEDS_TIER
@pytest.mark.parametrize(("module", "result"), MICRO, ids=[m for m, _ in MICRO])
def test_micro_benchmark_smoke(tmp_path: Path, module: str, result: str) -> None:
    out = _smoke(tmp_path, f"benchmarks.{module}", "--smoke")
    _json(out / result)


def test_heavy_report_renders_the_committed_result(tmp_path: Path) -> None:
    """The heavy side by side's Markdown (and plot, with matplotlib) from its committed JSON."""
    src = RESULTS / "side_by_side_heavy.json"
    copy = tmp_path / src.name
    shutil.copy(src, copy)
    r = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                        "from benchmarks._heavy_sweep import render; render(Path(sys.argv[1]))",
                        str(copy)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    md = copy.with_suffix(".md").read_text()
    assert "## Maximum sustained ingest" in md and "## Against the targets" in md


def test_workers_report_renders_the_committed_result(tmp_path: Path) -> None:
    (tmp_path / "results").mkdir()
    shutil.copy(RESULTS / "workers-full.json", tmp_path / "results" / "workers-full.json")
    env = dict(os.environ, KVRELAY_BENCH_RESULTS=str(tmp_path / "results"))
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench_workers", "--render",
                        "workers-full.json"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "results" / "workers-full.md").read_text().startswith("#")


# ---- KVRELAY_BENCH_SMOKE=1: scripts that start relay, engine and subscriber processes -----------


@NEEDS_TIER
def test_run_smoke(tmp_path: Path) -> None:
    doc = _json(_smoke(tmp_path, "benchmarks.run", "--smoke") / "relay_e2e.json")
    assert doc["mode"] == "smoke" and doc["ingest_ramp"]["points"]  # type: ignore[index]


@NEEDS_TIER
def test_snapshots_smoke(tmp_path: Path) -> None:
    _json(_smoke(tmp_path, "benchmarks.snapshots", "--smoke") / "snapshots.json")


@NEEDS_TIER
def test_snapshots_through_a_mirror_smoke(tmp_path: Path) -> None:
    doc = _json(_smoke(tmp_path, "benchmarks.snapshots", "--smoke", "--mirror")
                / "snapshots_mirror.json")  # fmt: skip
    assert doc["mirror"] is True and doc["snapshot"]


@NEEDS_TIER
def test_restart_smoke(tmp_path: Path) -> None:
    _json(_smoke(tmp_path, "benchmarks.bench_restart", "--smoke") / "restart.json")


@NEEDS_TIER
def test_upgrade_smoke(tmp_path: Path) -> None:
    _json(_smoke(tmp_path, "benchmarks.bench_upgrade", "--smoke") / "upgrade.json")


@NEEDS_TIER
def test_workers_smoke(tmp_path: Path) -> None:
    _json(_smoke(tmp_path, "benchmarks.bench_workers", "--smoke") / "workers.json")


@NEEDS_TIER
def test_device_grid_smoke(tmp_path: Path) -> None:
    out = _smoke(tmp_path, "benchmarks.device_grid", "--smoke")
    doc = _json(out / "device_grid.json")
    assert doc["summary"]["points"]["ok"] == 2  # type: ignore[index]
    assert "### workers = 2" in (out / "device_grid.md").read_text()


@NEEDS_TIER
def test_profile_relay_smoke(tmp_path: Path) -> None:
    _smoke(tmp_path, "benchmarks.profile_relay", "--smoke")  # prints only


@NEEDS_TIER
@NEEDS_DYNAMO
def test_side_by_side_light_smoke(tmp_path: Path) -> None:
    doc = _json(_smoke(tmp_path, "benchmarks.side_by_side", "--smoke") / "side_by_side.json")
    assert not doc["skipped"]


@NEEDS_TIER
@NEEDS_DYNAMO
def test_side_by_side_heavy_smoke(tmp_path: Path) -> None:
    _smoke(tmp_path, "benchmarks.side_by_side", "--heavy", "--smoke", timeout=600)
    doc = _json(tmp_path / "work" / "side_by_side_heavy.json")  # non-committed runs go to work
    assert not doc["skipped"] and doc["summary_repeats"]["repeats"] == 1  # type: ignore[index]


@NEEDS_TIER
@NEEDS_DYNAMO
def test_mirror_dynamo_smoke(tmp_path: Path) -> None:
    doc = _json(_smoke(tmp_path, "benchmarks.mirror_dynamo", "--smoke") / "mirror_dynamo.json")
    assert not doc["skipped"] and doc["check"]["tables_equal"]  # type: ignore[index]
