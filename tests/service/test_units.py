"""Pure units: reason→status map, limits, subscriber_id vs unicodedata, descriptor freshness."""

from __future__ import annotations

import unicodedata
from pathlib import Path
from types import ModuleType

import pytest
from grpclib.const import Status
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.errors import RelayError, reason_name
from kvrelay.contract.limits import LimitsError, PermitCounter, RelayLimits
from kvrelay.contract.producer import producer_key
from kvrelay.contract.wire import TRAILER_KEY
from kvrelay.service.status import STATUS_FOR_REASON, status_of, trailers_of
from kvrelay.service.validation import check_subscriber_id

EXPECTED = {  # contract §3.2
    "CONTRACT_MISMATCH": Status.FAILED_PRECONDITION,
    "INVALID_REQUEST": Status.INVALID_ARGUMENT,
    "UNSUPPORTED_FEATURE": Status.FAILED_PRECONDITION,
    "POOL_NOT_FOUND": Status.NOT_FOUND,
    "PRODUCER_CHANGED": Status.FAILED_PRECONDITION,
    "RESOURCE_LIMIT": Status.RESOURCE_EXHAUSTED,
    "SUBSCRIBER_LAGGED": Status.RESOURCE_EXHAUSTED,
    "SNAPSHOT_PROGRESS_TIMEOUT": Status.RESOURCE_EXHAUSTED,
    "PUBLICATION_UNAVAILABLE": Status.UNAVAILABLE,
    "INVALID_PUBLICATION": Status.FAILED_PRECONDITION,
    "INTERNAL": Status.INTERNAL,
}


def test_reason_status_and_trailer_names(official_pb2: dict[str, ModuleType]) -> None:
    enum = official_pb2["relay"].RelayErrorReason
    assert TRAILER_KEY == "kv-relay-error-reason"
    for short, status in EXPECTED.items():
        reason = pb.RelayErrorReason[short]
        assert STATUS_FOR_REASON[reason] == status
        assert reason_name(reason) == enum.Name(int(reason)) == "RELAY_ERROR_REASON_" + short
        err = RelayError(reason, "m")
        assert status_of(err) == status
        assert trailers_of(err) == {TRAILER_KEY: enum.Name(int(reason))}
    ctor = {
        "contract_mismatch": "CONTRACT_MISMATCH",
        "invalid_request": "INVALID_REQUEST",
        "unsupported_feature": "UNSUPPORTED_FEATURE",
        "resource_limit": "RESOURCE_LIMIT",
        "invalid_publication": "INVALID_PUBLICATION",
    }
    for name, short in ctor.items():
        assert getattr(RelayError, name)("x").reason == pb.RelayErrorReason[short]
    for name in (
        "pool_not_found",
        "producer_changed",
        "subscriber_lagged",
        "snapshot_progress_timeout",
        "publication_unavailable",
        "internal",
    ):
        assert getattr(RelayError, name)().trailer_value.endswith(name.upper())


def test_limits_defaults_and_validation() -> None:
    d = RelayLimits()
    assert (d.max_message_bytes, d.publication_queue_capacity, d.publication_queue_bytes) == (
        8 * 1024 * 1024,
        16,
        16 * 1024 * 1024,
    )
    assert (d.keepalive_interval_s, d.keepalive_timeout_s, d.pool_heartbeat_s) == (20.0, 10.0, 10.0)
    assert (d.readiness_heartbeat_s, d.snapshot_progress_timeout_s, d.load_window_s) == (10, 60, 1)
    assert (
        d.max_pool_streams_total == d.max_subscribers_per_pool == d.max_initialized_pool_hubs == 64
    )
    assert d.max_catalog_subscribers == d.max_readiness_subscribers == d.max_load_subscribers == 64
    assert (d.load_fanout_capacity, d.publish_every_n_events, d.publication_delay_s) == (
        16,
        16,
        0.001,
    )
    assert RelayLimits(publication_delay_s=0).publication_delay_s == 0  # never waits
    for bad in (
        {"pool_heartbeat_s": 0},
        {"publication_delay_s": -0.001},
        {"pool_heartbeat_s": -1.0},
        {"load_window_s": 366 * 86400.0},
        {"max_message_bytes": 4_194_368},
        {"publication_queue_bytes": 4_194_368},
        {"publication_queue_capacity": 0},
        {"load_fanout_capacity": 65_537},
        {"max_pool_streams_total": True},
        {"max_catalog_subscribers": 1.5},
    ):
        with pytest.raises(LimitsError):
            RelayLimits(**bad)  # type: ignore[arg-type]
    RelayLimits(max_message_bytes=4_194_368 + 65_536, publication_queue_bytes=4_194_624)


def test_permit_counter_is_non_blocking() -> None:
    p = PermitCounter("x", 2)
    assert p.try_acquire() and p.try_acquire() and not p.try_acquire()
    p.release()
    assert p.in_use == 1 and p.try_acquire()
    p.release()
    p.release()
    with pytest.raises(RuntimeError):
        p.release()


def _oracle_ok(s: str) -> bool:
    return 0 < len(s.encode("utf-8", "surrogatepass")) <= 128 and not any(
        unicodedata.category(c) == "Cc" for c in s
    )


def test_control_characters_match_unicode_cc() -> None:
    for cp in range(0x300):
        c = chr(cp)
        ok = True
        try:
            check_subscriber_id("a" + c)
        except RelayError as exc:
            assert exc.reason == pb.RelayErrorReason.INVALID_REQUEST
            ok = False
        assert ok == (unicodedata.category(c) != "Cc"), hex(cp)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=140))
def test_subscriber_id_matches_oracle(s: str) -> None:
    try:
        check_subscriber_id(s)
        ok = True
    except RelayError:
        ok = False
    assert ok == _oracle_ok(s)


def test_unknown_enum_from_wire_is_unsupported(official_pb2: dict[str, ModuleType]) -> None:
    """An unknown IdentitySource number arrives as a plain int in betterproto2."""
    m = official_pb2["relay"]
    p = m.ProducerIdentity()
    p.pool_id.identity_version = 1
    p.pool_id.indexer_domain.cache_semantics.digest = b"a" * 16
    p.pool_id.indexer_domain.cache_semantics.source = 1
    p.pool_id.indexer_domain.routing_scope.digest = b"b" * 16
    p.pool_id.indexer_domain.routing_scope.source = 1
    p.layout_generation = 1
    p.ckf_format.format_version = 1
    p.ckf_format.bucket_count = 1024
    p.ckf_format.fingerprint_bits = 16
    p.ckf_format.slots_per_bucket = 4
    ok = pb.ProducerIdentity.parse(p.SerializeToString())
    assert producer_key(ok).bucket_count == 1024
    raw = bytearray(p.SerializeToString())
    p.pool_id.indexer_domain.routing_scope.source = 0
    unknown = p.SerializeToString() + b""  # rebuild with an unknown number below
    bad = pb.ProducerIdentity.parse(bytes(raw))
    bad.pool_id.indexer_domain.routing_scope.source = 99  # type: ignore[union-attr,assignment]
    reparsed = pb.ProducerIdentity.parse(bytes(bad))
    with pytest.raises(RelayError) as ei:
        producer_key(reparsed)
    assert ei.value.reason == pb.RelayErrorReason.UNSUPPORTED_FEATURE
    with pytest.raises(RelayError) as ei:
        producer_key(pb.ProducerIdentity.parse(unknown))
    assert ei.value.reason == pb.RelayErrorReason.INVALID_REQUEST  # source 0 = UNSPECIFIED


def test_equality_key_covers_every_identity_field() -> None:
    from tests.support.mem_relay import make_producer

    base = make_producer("p", bucket_count=1024)
    k = producer_key(base)
    assert len(set(k._fields)) == 13
    variants = [
        make_producer("q", bucket_count=1024),
        make_producer("p", bucket_count=2048),
        make_producer("p", bucket_count=1024, layout_generation=2),
        make_producer("p", bucket_count=1024, seed=3),
        make_producer("p", bucket_count=1024, incarnation=4),
    ]
    for v in variants:
        assert producer_key(v) != k
    other_src = make_producer("p", bucket_count=1024)
    other_src.pool_id.indexer_domain.cache_semantics.source = 2  # type: ignore[union-attr]
    other_dc = make_producer("p", bucket_count=1024)
    other_dc.pool_id.dc_id = 1  # type: ignore[union-attr]
    assert producer_key(other_src) != k and producer_key(other_dc) != k
    assert producer_key(make_producer("p", bucket_count=1024)) == k


def test_descriptor_module_matches_protos(tmp_path: Path) -> None:
    from grpc_tools import protoc

    from kvrelay.service.descriptor import RELAY_FILE_DESCRIPTOR_SET

    protos = Path(__file__).resolve().parents[2] / "protos"
    out = tmp_path / "fds.bin"
    rc = protoc.main(
        [
            "protoc",
            f"-I{protos}",
            "--include_imports",
            f"--descriptor_set_out={out}",
            str(protos / "dynamo/kvrelay/v1/relay.proto"),
        ]
    )
    assert rc == 0
    assert out.read_bytes() == RELAY_FILE_DESCRIPTOR_SET
