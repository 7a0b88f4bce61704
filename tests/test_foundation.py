"""Foundation: the contract files are untouched, generated code is fresh, and both protobuf
stacks agree byte for byte."""

from __future__ import annotations

import filecmp
import hashlib
import inspect
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import betterproto2
import pytest

from kvrelay import __version__
from kvrelay._proto import vllm as control
from kvrelay._proto.dynamo.kvrelay import v1 as relay
from kvrelay.contract import proto_fixes
from tools.protogen import generate

REPO = Path(__file__).resolve().parent.parent

# sha256 of the contract texts: relay.proto is Dynamo 1.6.1's plus the Dynamo 1.7 additions
# (SubscribeServingLoad), vLLM's control.proto is unmodified. Changing a proto by accident fails
# here; changing it on purpose means updating this table in the same commit.
CANONICAL = {
    "protos/dynamo/kvrelay/v1/relay.proto": (
        "1c15b4e707c1a382c2d0501431975e48b81d2a6adf68f72ffbd9f0f3bbacf066"
    ),
    "protos/vllm/control.proto": (
        "b6e7e78d15685759b6a828eecaad792eb2e47485dfec6ce620f000b48880d25b"
    ),
}


@pytest.mark.parametrize("path", sorted(CANONICAL))
def test_protos_are_the_canonical_contract(path: str) -> None:
    digest = hashlib.sha256((REPO / path).read_bytes()).hexdigest()
    assert digest == CANONICAL[path]


# Dynamo 1.6.1's relay.proto, byte for byte: what is left of ours once the 1.7 additions (one rpc
# line in the service, and the section from the marker comment to the end) are taken out.
RELAY_1_6_1 = "1b736838cd686f737da9f6b7a76cbf7aebeeb6d9a46f9c01de90b77da4783ef2"
ADDED_RPC = (
    "  rpc SubscribeServingLoad(SubscribeServingLoadRequest) returns (stream ServingLoadUpdate);\n"
)
ADDED_SECTION = (
    "\n\n// Added in Dynamo 1.7 (additive v1 extension): the SubscribeServingLoad plane."
)


def test_relay_proto_is_dynamo_1_6_1_plus_the_1_7_additions() -> None:
    text = (REPO / "protos/dynamo/kvrelay/v1/relay.proto").read_text()
    assert text.count(ADDED_RPC) == 1 and text.count(ADDED_SECTION) == 1
    base = text.replace(ADDED_RPC, "")
    base, added = base[: base.index(ADDED_SECTION)], base[base.index(ADDED_SECTION) :]
    assert hashlib.sha256(base.encode()).hexdigest() == RELAY_1_6_1
    # The addition is additive only: one enum and new messages, no other rpc, no reused name.
    defined = {w.split()[1] for w in added.splitlines() if w.startswith(("message ", "enum "))}
    assert defined == {
        "DataStatus", "SubscribeServingLoadRequest", "RequestLifecycleStats", "TokenLoadStats",
        "LoadView", "PoolDeploymentStatus", "PoolServingLoad", "ModelDeploymentStatus",
        "ModelServingLoad", "ServingLoadUpdate",
    }  # fmt: skip
    assert not any(f"message {name}" in base or f"enum {name}" in base for name in defined)


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    generate(tmp_path)
    committed = REPO / "kvrelay" / "_proto"
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    current = sorted(
        p.relative_to(committed)
        for p in committed.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert fresh == current, "generated file set differs: run `make proto`"
    for rel in fresh:
        assert filecmp.cmp(tmp_path / rel, committed / rel, shallow=False), (
            f"{rel} is stale: run `make proto`"
        )


def _message_classes(module: ModuleType) -> list[type[betterproto2.Message]]:
    return [
        obj
        for _, obj in inspect.getmembers(module, inspect.isclass)
        if issubclass(obj, betterproto2.Message) and obj is not betterproto2.Message
    ]


def test_every_generated_message_imports_and_encodes() -> None:
    classes = _message_classes(relay) + _message_classes(control)
    assert len(classes) >= 60
    for cls in classes:
        msg = cls()
        assert cls.parse(bytes(msg)) == msg


def _filter_update() -> relay.FilterUpdate:
    fmt = relay.CkfFormat(
        format_version=1,
        seed=0x5DEECE66D1B54A33,
        bucket_count=1 << 24,
        fingerprint_bits=16,
        slots_per_bucket=4,
    )
    pool = relay.KvPoolId(
        identity_version=1,
        indexer_domain=relay.IndexerDomainId(
            cache_semantics=relay.DigestIdentity(
                digest=bytes(range(16)), source=relay.IdentitySource.DEFAULT_DERIVED
            ),
            routing_scope=relay.DigestIdentity(
                digest=bytes(range(16, 32)), source=relay.IdentitySource.EXPLICIT
            ),
        ),
        dc_id=(1 << 64) - 1,
    )
    return relay.FilterUpdate(
        protocol_version=1,
        relay=relay.RelayIdentity(drt_instance_id=(1 << 64) - 1, relay_incarnation=(1 << 63) - 1),
        producer=relay.ProducerIdentity(
            pool_id=pool,
            producer_incarnation=12345,
            layout_generation=(1 << 64) - 1,
            ckf_format=fmt,
        ),
        base_sequence=(1 << 64) - 2,
        sequence=(1 << 64) - 1,
        send_ts_us=1_764_460_800_000_000,
        kind=relay.FilterUpdateKind.DELTA,
        payload=b"CBI1" + bytes(range(256)) * 3,
        contract_marker=0x4B565231,
    )


def _catalog_update() -> relay.KvPoolCatalogUpdate:
    fu = _filter_update()
    assert fu.producer is not None
    desc = relay.KvPoolDescriptor(
        producer=fu.producer,
        serving_endpoint=relay.DynamoEndpointId(
            namespace="prod", component="backend", endpoint="generate"
        ),
        registrations=[
            relay.ModelRegistration(
                canonical_model_id="meta/llama",
                target=relay.ModelTarget(base=relay.BaseModelTarget(base_model="meta/llama")),
                aliases=["a", "llama"],
            ),
            relay.ModelRegistration(
                canonical_model_id="sql-lora",
                target=relay.ModelTarget(
                    lora=relay.LoraModelTarget(base_model="meta/llama", adapter="sql-lora")
                ),
            ),
        ],
        query_semantics=relay.KvQuerySemantics(
            kv_block_size=16, hash_format=relay.KvQueryHashFormat.DYNAMO_EAGLE_V1
        ),
        pool_roles=[relay.WorkerRole.PREFILL, relay.WorkerRole.DECODE],
    )
    return relay.KvPoolCatalogUpdate(
        protocol_version=1,
        relay=fu.relay,
        revision=7,
        snapshot=relay.KvPoolCatalogSnapshot(pools=[desc, desc]),
        contract_marker=0x4B565231,
    )


def _serving_load_update() -> relay.ServingLoadUpdate:
    fu = _filter_update()
    assert fu.producer is not None and fu.producer.pool_id is not None
    U64 = (1 << 64) - 1
    return relay.ServingLoadUpdate(
        protocol_version=1,
        relay=fu.relay,
        window_sequence=U64,
        observed_ms=1_764_460_800_000,
        window_ms=1000,
        pools=[
            relay.PoolServingLoad(
                producer=fu.producer,
                load=relay.LoadView(
                    tokens=relay.TokenLoadStats(active_decode_blocks=0),  # set zero is not unset
                    status=relay.DataStatus.COMPLETE,
                    source_observed_ms=1_764_460_799_500,
                ),
                deployment=relay.PoolDeploymentStatus(live_workers=2, max_concurrency=U64),
            )
        ],
        models=[
            relay.ModelServingLoad(
                namespace="prod",
                canonical_model_id="meta/llama",
                load=relay.LoadView(
                    requests=relay.RequestLifecycleStats(
                        requests_started_total=U64, requests_cancelled_total=3
                    ),
                    tokens=relay.TokenLoadStats(input_tokens_total=5, output_tokens_total=0),
                    status=relay.DataStatus.DEGRADED,
                ),
                deployment=relay.ModelDeploymentStatus(
                    expected_frontends=3,
                    observed_frontends=2,
                    ready_frontends=1,
                    serving_pools=[fu.producer.pool_id, fu.producer.pool_id],
                ),
            )
        ],
        contract_marker=0x4B565231,
    )


def test_shadowed_load_field_needs_the_fix() -> None:
    """betterproto2's ``parse`` is ``cls().load(stream)``; a field named ``load`` hides it."""
    for cls in proto_fixes.SHADOWED:
        assert cls().load is None  # the field, not the method: what the fix works around
        assert "parse" in cls.__dict__  # installed by importing kvrelay.contract
        msg = cls(load=relay.LoadView(status=relay.DataStatus.UNAVAILABLE))
        assert cls.parse(bytes(msg)) == msg


@pytest.mark.parametrize(
    ("factory", "official_name"),
    [
        (_filter_update, "FilterUpdate"),
        (_catalog_update, "KvPoolCatalogUpdate"),
        (_serving_load_update, "ServingLoadUpdate"),
    ],
)
def test_round_trip_byte_identical_with_official_protobuf(
    factory: object, official_name: str, official_pb2: dict[str, ModuleType]
) -> None:
    assert callable(factory)
    ours = factory()
    wire = bytes(ours)
    official_cls = getattr(official_pb2["relay"], official_name)
    theirs = official_cls.FromString(wire)
    assert theirs.contract_marker == 0x4B565231
    # official -> bytes must be the same bytes, and betterproto2 must parse them back equal
    again = theirs.SerializeToString(deterministic=True)
    assert again == wire
    assert type(ours).parse(again) == ours


def test_version_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvrelay", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.startswith(f"kvrelay {__version__}")
    assert __version__ != "0.0.0+unknown"


def test_only_ascii_digits_are_decimal() -> None:
    """``str.isdigit`` is true for digits ``int`` refuses (superscripts): every parser of
    untrusted text checks with ``is_decimal`` before ``int``."""
    from kvrelay._text import is_decimal

    assert is_decimal("0123") and not is_decimal("") and not is_decimal("-1")
    assert "²".isdigit() and not is_decimal("²") and not is_decimal("1²")
    assert not is_decimal("١٢")  # Arabic-Indic digits: int() takes them, the relay does not
    # CPython's int() refuses more than 4,300 digits: a hostile port, label or header that long
    # must not reach it (an untyped ValueError); every unsigned 128-bit number still passes
    with pytest.raises(ValueError):
        int("1" * 4301)
    assert not is_decimal("1" * 4301) and not is_decimal("1" * 41)
    assert is_decimal(str(2**128 - 1))
