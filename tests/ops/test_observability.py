"""The documented metric table, the alerting rules and the dashboard agree with the collector.

The table in docs/operations.md is generated from the collector (tools/metrics_table.py); every
``kvrelay_*`` series that an alert queries must be served together by one daemon setup (a relay,
a ``workers = 2`` relay, a ``kvrelay mirror``: their collectors wired as the daemon wires them),
and every series a dashboard panel queries by one of them. With ``promtool`` on the machine
(Debian package ``prometheus``) the rules are checked and their unit tests
(deploy/prometheus/alerts.test.yml) run; without it a structural check runs.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from kvrelay.contract.limits import RelayLimits
from kvrelay.mirror.mirror import Mirror
from kvrelay.mirror.settings import MirrorSettings, UpstreamAddress
from kvrelay.ops.metrics import RelayMetrics
from kvrelay.ops.mirror_metrics import MirrorMetrics, WorkersCollector
from kvrelay.ops.reload import ReloadStats
from kvrelay.ops.upgrade import UpgradeStats
from tools import metrics_table

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = REPO / "deploy" / "prometheus" / "alerts.test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "kvrelay.json"
SERIES = re.compile(r"\bkvrelay_[a-z0-9_]+")
STANDARD = {"process_cpu_seconds_total", "process_resident_memory_bytes"}


def served() -> set[str]:
    """Every series name a scrape can contain (histograms with their three suffixes)."""
    names: set[str] = set()
    for f in metrics_table.families():
        names.add(f.series)
        if f.kind == "histogram":
            names |= {f.series + s for s in ("_bucket", "_sum", "_count")}
    return names


def _names(registry: CollectorRegistry) -> set[str]:
    """The series names of a registry's ``kvrelay_*`` families (as ``served`` names them)."""
    out: set[str] = set()
    for fam in registry.collect():
        if not fam.name.startswith("kvrelay_"):
            continue
        base = fam.name + {"counter": "_total", "info": "_info"}.get(fam.type, "")
        out.add(base)
        if fam.type == "histogram":
            out |= {base + s for s in ("_bucket", "_sum", "_count")}
    return out


@functools.cache
def _mirror_stats() -> dict[str, object]:
    """A real mirror's statistics (not started: every key its collector reads is there)."""

    async def build() -> dict[str, object]:  # its channel wants a running loop
        upstream = UpstreamAddress.parse("127.0.0.1:1")
        mirror = Mirror(MirrorSettings(upstream=upstream, limits=RelayLimits()))
        mirror.upstream.channel.close()
        return mirror.stats()

    return asyncio.run(build())


class _Supervisor:
    """What ``WorkersCollector`` reads of the supervisor: one worker that reported."""

    count, alive, restarts = 1, 1, 0

    def worker_stats(self) -> list[dict[str, object]]:
        return [{"mirror": _mirror_stats(), "reports_dropped": 0}]


def setups() -> dict[str, set[str]]:
    """The series each daemon setup serves: a relay; ``workers = 2`` (the relay's collector and
    the supervisor's, with its worker's mirror); a mirror (``MirrorMetrics``)."""
    relay = served()
    workers = RelayMetrics(
        metrics_table._Relay(), CollectorRegistry(), service=metrics_table._Service()
    )
    workers.registry.register(WorkersCollector(_Supervisor()))
    mirror = MirrorMetrics(type("M", (), {"stats": staticmethod(_mirror_stats)})(),
                           CollectorRegistry())  # fmt: skip
    for m in (workers, mirror):
        m.attach_reloads(ReloadStats())
        m.attach_upgrades(UpgradeStats())
        m.attach_service(metrics_table._Service())
    return {"relay": relay, "workers": relay | _names(workers.registry),
            "mirror": _names(mirror.registry)}  # fmt: skip


def test_docs_metric_table_is_generated_from_the_collector() -> None:
    doc = metrics_table.DOC.read_text()
    assert metrics_table.current(doc) == metrics_table.block(), (
        "docs/operations.md's metric table is stale: run `python -m tools.metrics_table --write`"
    )
    assert "kvrelay_ingest_engine_lag_seconds" in doc
    assert "kvrelay_ingest_last_message_timestamp_seconds" in doc


def _rules() -> list[dict[str, object]]:
    data = yaml.safe_load(ALERTS.read_text())
    (group,) = data["groups"]
    rules: list[dict[str, object]] = group["rules"]
    return rules


def test_alerts_cover_the_first_hour_list_and_query_served_series() -> None:
    rules = _rules()
    names = {str(r["alert"]) for r in rules}
    wanted = {"KvrelayFilterNearlyFull", "KvrelayMemberResets", "KvrelaySubscribersLagging",
              "KvrelayEngineUnreachable", "KvrelaySourceStale", "KvrelayEventLoopLag",
              "KvrelayDown", "KvrelayConfigReloadFailed", "KvrelayRoutersLagging",
              "KvrelayMirrorOutOfSync", "KvrelayMirrorUpstreamResets"}  # fmt: skip
    assert wanted <= names, wanted - names
    each = setups()
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r
        labels, notes = r["labels"], r["annotations"]
        assert isinstance(labels, dict) and labels.get("severity") in ("warning", "critical")
        assert isinstance(notes, dict) and notes.get("summary") and notes.get("description")
        used = set(SERIES.findall(str(r["expr"])))
        # every rule reads kvrelay's series, but the one for a relay that cannot be scraped
        scrape = re.search(r"\bup\{job=", str(r["expr"])) is not None
        assert used or scrape, r["alert"]
        where = [name for name, series in each.items() if used <= series]
        assert where, (r["alert"], {name: used - series for name, series in each.items()})
        if "for" in r:
            assert re.fullmatch(r"\d+[smh]", str(r["for"])), r["for"]
    by_name = {str(r["alert"]): r for r in rules}
    full = str(by_name["KvrelayFilterNearlyFull"]["annotations"]["description"])  # type: ignore[index]
    assert "reload" in full and "restart the relay" not in full  # a reload applies it
    alerts_in_tests = set(re.findall(r"alertname: (\w+)", ALERT_TESTS.read_text()))
    assert alerts_in_tests <= names and len(alerts_in_tests) >= 4
    # routers ended lagged behind a mirror or a worker, a mirror without its upstream, and its
    # channel resetting: each rule has a unit test that makes it fire
    assert {"KvrelayRoutersLagging", "KvrelayMirrorOutOfSync", "KvrelayMirrorUpstreamResets",
            "KvrelayMemberResets", "KvrelaySubscribersLagging"} <= alerts_in_tests  # fmt: skip


def test_every_setup_serves_what_its_alerts_need() -> None:
    """Mirror and fan-out worker alerts read series a relay alone does not serve."""
    each = setups()
    mirrored = {"kvrelay_mirror_synced", "kvrelay_mirror_upstream_session",
                "kvrelay_mirror_upstream_channel_resets_total",
                "kvrelay_mirror_subscribers_lagged_total"}  # fmt: skip
    assert mirrored <= each["mirror"] and mirrored <= each["workers"]
    assert not mirrored & each["relay"]
    assert "kvrelay_pool_lag_terminations_total" in each["workers"] - each["mirror"]
    assert "kvrelay_stream_errors_total" in each["relay"] & each["mirror"]


def test_structural_check_is_not_vacuous() -> None:
    assert "kvrelay_no_such_series" not in served()
    assert "kvrelay_event_loop_lag_seconds_bucket" in served()


def test_rules_check_with_promtool_when_installed(tmp_path: Path) -> None:
    """promtool (Debian package prometheus) where present; the YAML must parse either way."""
    assert yaml.safe_load(ALERT_TESTS.read_text())["rule_files"] == ["alerts.yml"]
    if shutil.which("promtool") is None:
        return  # the structural checks above stand in for it
    check = subprocess.run(["promtool", "check", "rules", str(ALERTS)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in check.stdout
    tests = subprocess.run(
        ["promtool", "test", "rules", str(ALERT_TESTS)],
        capture_output=True, text=True, timeout=120, cwd=ALERTS.parent,
    )  # fmt: skip
    assert tests.returncode == 0, tests.stdout + tests.stderr
    # and promtool is a real judge: a rule with a syntax error fails
    bad = tmp_path / "bad.yml"
    bad.write_text(ALERTS.read_text().replace("> 0.9", "> > 0.9", 1))
    res = subprocess.run(["promtool", "check", "rules", str(bad)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode != 0


def test_dashboard_panels_query_served_series() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "kvrelay" and dash["panels"]
    known = set().union(*setups().values()) | STANDARD
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}"
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        assert p["targets"], p["title"]
        for t in p["targets"]:
            used = set(re.findall(r"\b(?:kvrelay|process)_[a-z0-9_]+", t["expr"]))
            assert used and used <= known, (p["title"], used - known)
    # routers on pool streams: under workers = N kvrelay_pool_subscribers counts the workers' own
    # streams to the ingest process, kvrelay_stream_subscribers{kind="pool"} the routers
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert not [e for e in exprs if "kvrelay_pool_subscribers" in e], "counts workers, not routers"
    assert any(re.search(r'kvrelay_stream_subscribers\{[^}]*kind="pool"', e) for e in exprs)
    assert any("kvrelay_mirror_subscribers_lagged_total" in e for e in exprs)
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert variables == {"datasource", "instance"}
    # a per-source (†) family's ``(departed)`` series jumps by a leaving source's whole count,
    # which ``rate`` then shows as traffic: a panel rating one leaves that series out
    table = (REPO / "docs" / "operations.md").read_text()
    row = r"^\| `(kvrelay_[a-z0-9_]+)` \| counter \| [^|]*\(†\)"
    per_source = set(re.findall(row, table, re.M))
    assert "kvrelay_ingest_blocks_total" in per_source
    for e in exprs:
        for fam in re.findall(r"(?:rate|increase)\((kvrelay_[a-z0-9_]+?)(?:_bucket)?\{", e):
            if fam in per_source:
                assert 'worker!="(departed)"' in e, e
