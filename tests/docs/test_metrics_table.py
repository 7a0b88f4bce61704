"""The metric table of docs/operations.md says which labels each family carries, and the table is
generated from the collector over synthetic statistics (tools/metrics_table.py). A family those
statistics leave without a sample is written with no labels ("—"): the checkpoint and scrub
gauges were documented unlabelled while the relay exports them per `pool`."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvrelay.ops.metrics import POOL_RESET_REASONS, RelayMetrics
from kvrelay.ops.reload import ReloadStats
from kvrelay.ops.tls import LoadedCertificate
from kvrelay.ops.upgrade import UpgradeStats
from tools import metrics_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def test_every_documented_family_has_a_sample_in_the_generator() -> None:
    """Without a sample the generator cannot see a family's labels, so its row would be wrong."""
    metrics = RelayMetrics(
        metrics_table._Relay(), CollectorRegistry(), service=metrics_table._Service()
    )
    metrics.attach_reloads(ReloadStats(restart_pending=("relay.bind",)))
    metrics.attach_upgrades(UpgradeStats())
    metrics.attach_tls(lambda: [LoadedCertificate("server", "relay", 1.0)])
    metrics.observe_loop_lag(0.001)
    metrics.delta_published("ns/backend/generate", 0.001)
    empty = sorted(
        fam.name for fam in metrics.registry.collect()
        if fam.name.startswith("kvrelay_") and not fam.samples
    )  # fmt: skip
    assert not empty, f"tools/metrics_table.py gives these families no sample: {empty}"


def test_per_pool_checkpoint_and_scrub_gauges_are_documented_with_their_label() -> None:
    table = DOC.read_text().split(metrics_table.BEGIN, 1)[1].split(metrics_table.END, 1)[0]
    for series in (
        "kvrelay_state_checkpoint_timestamp_seconds",
        "kvrelay_pool_scrub_last_pass_age_seconds",
        "kvrelay_pool_scrub_last_pass_ok",
    ):
        row = next(line for line in table.splitlines() if line.startswith(f"| `{series}` |"))
        assert row.split(" | ")[2] == "pool", row


def test_the_contract_names_every_member_reset_reason() -> None:
    """docs/contract.md lists the reasons of ``kvrelay_pool_member_resets_total`` in prose: it
    named 11 of the 17 the relay exports (an audit read ``vouch_timeout`` and ``block_cap`` off
    ``/metrics`` that the contract never mentioned)."""
    contract = (DOC.parent / "contract.md").read_text()
    prose = contract.split("Reset reasons are exported as", 1)[1].split("\n\n", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", prose)) - {"max_member_blocks"}
    assert named == set(POOL_RESET_REASONS), sorted(named ^ set(POOL_RESET_REASONS))
