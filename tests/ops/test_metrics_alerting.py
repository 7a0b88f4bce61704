"""What the alerting rules need from ``/metrics``, scraped over real HTTP from a real relay and a
real mirror: every known reason of a by-reason counter from the start (at 0), and a mirror's
upstream session and channel resets.

Oracles: the lower layers' own lists of reasons (``ResetReason``, the pool's and the decoder's
error classes, the contract's ``RelayErrorReason``), the mirror's ``in_session``, and what the
test does to the upstream (closed under the mirror).
"""

from __future__ import annotations

import re
from pathlib import Path

from grpclib.client import Channel
from prometheus_client import CollectorRegistry

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.client import errors as E
from kvrelay.contract.errors import reason_name
from kvrelay.ingest.decoder import _TIERS
from kvrelay.ingest.errors import DecodeError
from kvrelay.ingest.fastwalk import DROP_REASONS
from kvrelay.ingest.sink import ResetReason
from kvrelay.mirror.settings import UpstreamAddress
from kvrelay.ops import metrics as relay_metrics
from kvrelay.ops.metrics import RelayMetrics
from kvrelay.ops.mirror_metrics import MirrorMetrics
from kvrelay.pool.errors import PoolError
from kvrelay.service.server import RelayServer
from kvrelay.sim.config import SimConfig
from tests.support.mem_relay import MemRelayView, sub_request
from tests.support.mirror_rig import QUIET_WINDOW_MS, UPSTREAM_LIMITS, mirrored
from tests.support.rig import collect_end
from tests.support.scrape import (
    POOL,
    Samples,
    eventually,
    fleet_and_relay,
    scrape,
    value,
    wait_subscribed,
)

REPO = Path(__file__).resolve().parents[2]


def _raised_kinds(base: type) -> set[str]:
    """The ``kind`` of every class that derives from ``base`` and has no subclass of its own."""
    out: set[str] = set()
    todo: list[type] = list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        subs: list[type] = cls.__subclasses__()
        todo += subs
        if not subs:
            out.add(cls.kind)  # type: ignore[attr-defined]
    return out


REASONS = {reason_name(r) for r in pb.RelayErrorReason if r != pb.RelayErrorReason.UNSPECIFIED}


async def test_reason_counters_are_exported_at_zero_before_their_first_count() -> None:
    """Before, each by-reason series appeared at its first count, so ``increase()`` missed that
    count and a single lagging router or member reset never raised its alert."""
    async with fleet_and_relay([SimConfig(name="z0", seed=4, dp_size=1)]) as (
        _engines, relay, server,
    ):  # fmt: skip
        metrics = RelayMetrics(relay, CollectorRegistry())
        metrics.attach_service(server.service)
        port = await metrics.start_http("127.0.0.1", 0)
        try:
            await wait_subscribed(relay, 1)
            s = await scrape(port)
            member = {"pool": POOL, "worker": "z0", "dp_rank": "0"}
            for reason in {r.value for r in ResetReason}:
                assert value(s, "kvrelay_pool_member_resets_total", pool=POOL, reason=reason) == 0
            for kind in _raised_kinds(PoolError):
                assert value(s, "kvrelay_pool_errors_total", pool=POOL, kind=kind) == 0
            for kind in _raised_kinds(DecodeError):
                assert value(s, "kvrelay_ingest_decode_rejections_total", **member, kind=kind) == 0
            for reason in REASONS:
                assert value(s, "kvrelay_stream_errors_total", reason=reason) == 0
            _ingest_and_plane_counters_at_zero(s, member)
            # the first error of a reason moves its series from 0 to 1
            async with Channel("127.0.0.1", server.port) as ch:
                _m, end = await collect_end(
                    ch, "SubscribeKvPool", sub_request(None, marker=1), pb.FilterUpdate
                )
            first = end.trailers.get("kv-relay-error-reason")
            assert first in REASONS, end
            s2 = await scrape(port)
            assert value(s2, "kvrelay_stream_errors_total", reason=str(first)) == 1
        finally:
            await metrics.close()


def _ingest_and_plane_counters_at_zero(s: Samples, member: dict[str, str]) -> None:
    """ZMTP transport errors, dropped events and ingest member resets per source, metadata
    rejections and window errors: each appeared only at its first count."""
    for kind in ZMTP_KINDS:
        assert value(s, "kvrelay_ingest_decode_rejections_total", **member,
                     kind=f"zmtp_{kind}") == 0  # fmt: skip
    for reason in {*DROP_REASONS, *(f"medium_{t}" for t in _TIERS.values()), "unknown_tag"}:
        assert value(s, "kvrelay_ingest_dropped_events_total", **member, reason=reason) == 0
    for reason in {r.value for r in ResetReason}:
        assert value(s, "kvrelay_ingest_member_resets_total", **member, reason=reason) == 0
    for plane, rules in _metadata_rules().items():
        for rule in rules:
            assert value(s, "kvrelay_metadata_rejections_total", plane=plane, rule=rule) == 0
    for plane in ("load", "serving_load"):
        for kind in ("window", "entry"):
            assert value(s, "kvrelay_window_errors_total", plane=plane, kind=kind) == 0
    for result in relay_metrics.STATE_RESTORE_RESULTS:
        assert value(s, "kvrelay_state_restores_total", result=result) == 0
    for result in relay_metrics.STATE_SAVE_RESULTS:
        assert value(s, "kvrelay_state_saves_total", result=result) == 0


# The oracles read the literals where the lower layers raise them (the collector keeps a list).
ZMTP_KINDS = set(re.findall(r'(?:ZmtpError|_count)\(\s*"(\w+)"',
                            (REPO / "kvrelay" / "ingest" / "zmtp.py").read_text()))  # fmt: skip


def _metadata_rules() -> dict[str, set[str]]:
    """The rules ``CatalogError`` and ``TopologyError`` are raised with (``endpoint.{name}``:
    the three names the readiness check loops over)."""
    pub = REPO / "kvrelay" / "publication"
    catalog = re.findall(r'(?:CatalogError|_text)\(\s*"([\w.]+)"', (pub / "catalog.py").read_text())
    readiness = re.findall(r'TopologyError\(\s*f?"([\w.{}]+)"', (pub / "readiness.py").read_text())
    named = {f"endpoint.{n}" for n in ("namespace", "component", "endpoint")}
    return {"catalog": set(catalog),
            "readiness": {*(r for r in readiness if "{" not in r), *named}}  # fmt: skip


def _state_results() -> set[str]:
    """Every outcome the relay counts for its state files: the literals it counts and refuses
    with, the kinds of the file errors, the checkpoint writer's results."""
    relay = REPO / "kvrelay" / "relay"
    found = set(re.findall(r'_count\(self\.state_\w+, "(\w+)"\)', (relay / "relay.py").read_text()))
    found |= set(re.findall(r'Refused\(\s*"(\w+)"', (relay / "handover.py").read_text()))
    for name in ("state_file.py", "safe_files.py"):
        found |= set(re.findall(r'^\s+kind = "(\w+)"', (relay / name).read_text(), re.M))
    found |= set(re.findall(r'^[A-Z]+ = "(\w+)"', (relay / "checkpoint.py").read_text(), re.M))
    return found


def test_every_state_file_outcome_is_exported_at_zero() -> None:
    found = _state_results()
    assert {"restored", "stale", "corrupt", "unsafe_dir", "checkpoint_failed"} <= found  # found
    known = {*relay_metrics.STATE_RESTORE_RESULTS, *relay_metrics.STATE_SAVE_RESULTS}
    assert found <= known, found - known


def test_the_scanned_oracles_are_not_vacuous() -> None:
    assert {"bad_greeting", "handshake_timeout", "connect_error", "write_backlog"} <= ZMTP_KINDS
    rules = _metadata_rules()
    assert {"producer.invalid", "registration.alias", "catalog.duplicate_pool"} <= rules["catalog"]
    assert {"endpoint.duplicate", "endpoint.namespace", "endpoint.live"} <= rules["readiness"]


def test_every_pool_reset_reason_the_relay_counts_is_exported_at_zero() -> None:
    """The pool's own reasons are string literals in relay/: each must be in the collector's list
    (one missing would appear only at its first count again)."""
    found: set[str] = set()
    call = re.compile(
        r"(?:\.reset|count_reset|_retire_members|_reset_engine)\((?:\w+, )*\"(\w+)\"\)"
    )
    for path in (REPO / "kvrelay" / "relay").glob("*.py"):
        found |= set(call.findall(path.read_text()))
    assert {"source_failed", "engine_down", "incarnation"} <= found  # the scan finds them
    assert found <= set(relay_metrics.POOL_RESET_REASONS), found - set(
        relay_metrics.POOL_RESET_REASONS
    )
    assert {r.value for r in ResetReason} <= set(relay_metrics.POOL_RESET_REASONS)


async def test_a_mirror_that_loses_its_upstream_says_so_on_its_page() -> None:
    """``kvrelay_mirror_synced`` stays 1 once a mirror synchronized; nothing said that it lost
    its upstream since, nor how often its upstream channel was reset."""
    from kvrelay.ops.mirror_metrics import in_session  # (what a worker's report holds too)

    view = MemRelayView(UPSTREAM_LIMITS, window_ms=QUIET_WINDOW_MS)
    upstream = RelayServer(view, UPSTREAM_LIMITS)
    await upstream.start("127.0.0.1", 0)
    closed = False
    try:
        async with mirrored(UpstreamAddress(host="127.0.0.1", port=upstream.port)) as m:
            metrics = MirrorMetrics(m.mirror, CollectorRegistry())
            metrics.attach_service(m.server.service)
            port = await metrics.start_http("127.0.0.1", 0)
            try:
                s = await scrape(port)
                assert m.mirror.in_session and in_session(m.mirror.stats())
                assert value(s, "kvrelay_mirror_upstream_session", worker="") == 1
                assert value(s, "kvrelay_mirror_upstream_channel_resets_total", worker="") == 0
                for reason in REASONS:
                    assert value(s, "kvrelay_stream_errors_total", reason=reason) == 0
                _mirror_counters_at_zero(s, planes=set(m.mirror.stats()["planes"]))
                await upstream.close(grace_s=0.5)
                closed = True
                await eventually(lambda: not m.mirror.in_session, what="session lost")
                await eventually(lambda: m.mirror.upstream.resets > 0, what="channel reset")
                assert not in_session(m.mirror.stats())
                s = await scrape(port)
                assert value(s, "kvrelay_mirror_synced", worker="") == 1  # as before
                assert value(s, "kvrelay_mirror_upstream_session", worker="") == 0
                assert value(s, "kvrelay_mirror_upstream_channel_resets_total", worker="") >= 1
            finally:
                await metrics.close()
    finally:
        if not closed:
            await upstream.close(grace_s=0.5)


def _violation_reasons() -> set[str]:
    """Every reason the mirror's checker raises a violation with, read where it is raised: the
    ``E.*`` constants (and ``wire``) of ``stream_rules.py`` and ``checker.py``, and ``cbi1_`` with
    the reason of each CBI1 error the decoder and the snapshot assembler raise (the encoders,
    above ``decode``, raise on their callers' arguments, never on a received frame)."""
    from kvrelay.mirror import checker
    from kvrelay.publication import cbi1

    found: set[str] = set()
    for path in (REPO / "kvrelay" / "client" / "stream_rules.py",
                 REPO / "kvrelay" / "mirror" / "checker.py"):  # fmt: skip
        text = path.read_text()
        for name in re.findall(r"Violation\(\s*E\.(\w+)[,)]", text):
            found.add(getattr(E, name))
        if re.search(r"Violation\(\s*WIRE,", text):
            found.add(checker.WIRE)
        for name in re.findall(r"E\.CBI1_PREFIX \+ cbi1\.(\w+)\.reason", text):
            found.add(E.CBI1_PREFIX + getattr(cbi1, name).reason)
    source = (REPO / "kvrelay" / "publication" / "cbi1.py").read_text()
    decoding = source[source.index("\ndef decode("):]
    for name in re.findall(r"raise (?:self\._fail\()?(\w+)\(", decoding):
        found.add(E.CBI1_PREFIX + getattr(cbi1, name).reason)
    return found


def test_the_violation_oracle_is_not_vacuous() -> None:
    found = _violation_reasons()
    assert {"wire", "sequence_gap", "heartbeat_payload", "cbi1_checksum_mismatch",
            "cbi1_bad_chunk", "cbi1_incomplete_coverage"} <= found, found  # fmt: skip
    assert "cbi1_invalid_argument" not in found  # (an encoder's: not a frame's)


def _mirror_counters_at_zero(s: Samples, planes: set[str]) -> None:
    """A mirror's upstream stream ends appeared only at their first count; its plane violations,
    invalid catalog descriptors and spacing requests were in its statistics only; so were its
    channels replaced as deaf and its connections left as draining, and every rule of
    ``kvrelay_mirror_violations_total`` appeared at its first refused frame."""
    ends = {E.EOF, E.CONNECTION, E.SILENT, E.ENVELOPE, E.COMPRESSED,
            *(str(E.reason_from_trailer(r)) for r in REASONS)}  # fmt: skip
    for reason in {*ends, "violation", "internal", "withdrawn"}:
        assert value(s, "kvrelay_mirror_pool_stream_ends_total", worker="", reason=reason) == 0
    assert planes == {"catalog", "readiness", "load", "serving-load"}
    for plane in planes:
        for reason in {*ends, "unimplemented", "superseded", "internal"}:
            assert value(s, "kvrelay_mirror_plane_stream_ends_total", worker="", plane=plane,
                         reason=reason) == 0  # fmt: skip
        assert value(s, "kvrelay_mirror_plane_violations_total", worker="", plane=plane) == 0
    assert value(s, "kvrelay_mirror_catalog_invalid_total", worker="") == 0
    for result in ("granted", "denied", "failed"):
        assert value(s, "kvrelay_mirror_spacing_requests_total", worker="", result=result) == 0
    assert value(s, "kvrelay_mirror_upstream_spacing", worker="") == 1
    for reason in _violation_reasons():
        assert value(s, "kvrelay_mirror_violations_total", worker="", reason=reason) == 0, reason
    for name in ("deaf", "left_draining"):
        assert value(s, f"kvrelay_mirror_upstream_channel_{name}_total", worker="") == 0, name
