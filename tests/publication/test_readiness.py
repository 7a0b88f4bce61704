"""Readiness (§9): DNF table tests, UNKNOWN handling, adapters, ordering and revision bumps."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.publication.readiness import (
    EndpointState,
    ReadinessPlane,
    TopologyError,
    topology_entries,
)
from kvrelay.service.canonical import _official, canonicalize
from tests.support.identities import make_pool_id
from tests.support.timing import scaled

Role = pb.WorkerRole
S = pb.ServingReadinessState
P, D, E, A, L = Role.PREFILL, Role.DECODE, Role.ENCODE, Role.AGGREGATED, Role.LEGACY
_LETTER = {"P": P, "D": D, "E": E, "A": A}


def roles(spec: str) -> frozenset[pb.WorkerRole]:
    return frozenset(_LETTER[c] for c in spec)


def ep(
    component: str,
    role: str,
    live: int = 1,
    *,
    needs: tuple[str, ...] = (),
    probed: bool = True,
    models: tuple[str, ...] = ("m",),
    adapters: dict[str, str] | None = None,
    ns: str = "ns",
    pool: pb.KvPoolId | None = None,
) -> EndpointState:
    return EndpointState(
        namespace=ns,
        component=component,
        endpoint="generate",
        roles=roles(role),
        needs=tuple(roles(n) for n in needs),
        live=live,
        probed=probed,
        models=frozenset(models),
        adapters=adapters or {},
        pool_id=pool,
    )


@dataclass
class Want:
    state: pb.ServingReadinessState
    present: str = ""
    missing: str = ""
    dup: str = ""
    legacy: bool = False
    adapters: dict[str, tuple[pb.ServingReadinessState, str]] = field(default_factory=dict)


def _letters(rs: list[pb.WorkerRole]) -> str:
    inv = {v: k for k, v in _LETTER.items()}
    return "".join(inv[r] for r in rs)


CASES: list[tuple[str, list[EndpointState], Want]] = [
    ("aggregated live", [ep("agg", "A")], Want(S.READY, present="A")),
    ("aggregated dead", [ep("agg", "A", 0)], Want(S.UNAVAILABLE, missing="A")),
    (
        "aggregated scale-out, duplicates not reported",
        [ep("agg1", "A"), ep("agg2", "A", 0)],
        Want(S.READY, present="A"),
    ),
    (
        "P/D both up",
        [ep("pre", "P"), ep("dec", "D", needs=("P",))],
        Want(S.READY, present="PD"),
    ),
    (
        "P/D prefill down",
        [ep("pre", "P", 0), ep("dec", "D", needs=("P",))],
        Want(S.UNAVAILABLE, present="D", missing="P"),
    ),
    (
        "P/D decode down: its needs are ignored, its own role is missing",
        [ep("pre", "P"), ep("dec", "D", 0, needs=("P",))],
        Want(S.UNAVAILABLE, present="P", missing="D"),
    ),
    (
        "decode needs prefill that is not deployed at all (absence is a fact)",
        [ep("dec", "D", needs=("P",))],
        Want(S.UNAVAILABLE, present="D", missing="P"),
    ),
    (
        "dead set's needs ignored; live aggregated serves",
        [ep("agg", "A"), ep("dec", "D", 0, needs=("P",))],
        Want(S.UNAVAILABLE, present="A", missing="D"),
    ),
    (
        "DNF: second alternative satisfied",
        [ep("agg", "A"), ep("dec", "D", needs=("P", "A"))],
        Want(S.READY, present="DA"),
    ),
    (
        "DNF: no alternative satisfied adds every role of every alternative",
        [ep("dec", "D", needs=("PE", "A"))],
        Want(S.UNAVAILABLE, present="D", missing="PEA"),
    ),
    (
        "EPD: encode dependency up",
        [ep("enc", "E"), ep("pre", "P"), ep("dec", "D", needs=("PE",))],
        Want(S.READY, present="PDE"),
    ),
    (
        "EPD: encode dependency down",
        [ep("enc", "E", 0), ep("pre", "P"), ep("dec", "D", needs=("PE",))],
        Want(S.UNAVAILABLE, present="PD", missing="E"),
    ),
    (
        "legacy only, live",
        [ep("old", "")],
        Want(S.READY, legacy=True),
    ),
    (
        "legacy only, dead",
        [ep("old", "", 0)],
        Want(S.UNAVAILABLE, legacy=True),
    ),
    (
        "mixed typed/legacy: strict gating skipped, missing stays empty",
        [ep("old", "", 0), ep("dec", "D", needs=("P",))],
        Want(S.READY, present="D", legacy=True),
    ),
    (
        "mixed typed/legacy all dead",
        [ep("old", "", 0), ep("pre", "P", 0)],
        Want(S.UNAVAILABLE, legacy=True),
    ),
    (
        "duplicate PREFILL endpoints reported",
        [ep("pre1", "P"), ep("pre2", "P"), ep("dec", "D", needs=("P",))],
        Want(S.READY, present="PD", dup="P"),
    ),
    (
        "duplicate DECODE reported even when one is dead",
        [ep("pre", "P"), ep("dec1", "D", needs=("P",)), ep("dec2", "D", 0, needs=("P",))],
        Want(S.READY, present="PD", dup="D"),
    ),
    (
        "UNKNOWN until every participant is probed; present/missing cleared",
        [ep("pre", "P", 0, probed=False), ep("dec", "D", needs=("P",))],
        Want(S.UNKNOWN),
    ),
    (
        "UNKNOWN keeps structural facts (duplicates, legacy)",
        [ep("pre1", "P", probed=False), ep("pre2", "P"), ep("old", "")],
        Want(S.UNKNOWN, dup="P", legacy=True),
    ),
    (
        "LoRA ready on every adapter-bearing role",
        [
            ep("pre", "P", adapters={"sql": "m"}),
            ep("dec", "D", needs=("P",), adapters={"sql": "m"}),
        ],
        Want(S.READY, present="PD", adapters={"sql": (S.READY, "")}),
    ),
    (
        "LoRA missing on the prefill role",
        [ep("pre", "P"), ep("dec", "D", needs=("P",), adapters={"sql": "m"})],
        Want(S.READY, present="PD", adapters={"sql": (S.UNAVAILABLE, "P")}),
    ),
    (
        "LoRA: ENCODE never needs the adapter",
        [
            ep("enc", "E"),
            ep("agg", "A", needs=("E",), adapters={"sql": "m"}),
        ],
        Want(S.READY, present="EA", adapters={"sql": (S.READY, "")}),
    ),
    (
        "LoRA with base unavailable",
        [
            ep("pre", "P", 0, adapters={"sql": "m"}),
            ep("dec", "D", needs=("P",), adapters={"sql": "m"}),
        ],
        Want(S.UNAVAILABLE, present="D", missing="P", adapters={"sql": (S.UNAVAILABLE, "")}),
    ),
    (
        "LoRA carried only by a dead replica of a role is missing there",
        [ep("agg1", "A", 0, adapters={"sql": "m"}), ep("agg2", "A")],
        Want(S.READY, present="A", adapters={"sql": (S.UNAVAILABLE, "A")}),
    ),
    (
        "LoRA UNKNOWN while the base is UNKNOWN",
        [ep("agg", "A", probed=False, adapters={"sql": "m"})],
        Want(S.UNKNOWN, adapters={"sql": (S.UNKNOWN, "")}),
    ),
    (
        "LoRA backed by another base is not listed under this one",
        [ep("agg", "A", adapters={"sql": "other"})],
        Want(S.READY, present="A"),
    ),
]


@pytest.mark.parametrize(("name", "endpoints", "want"), CASES, ids=[c[0] for c in CASES])
def test_dnf_table(name: str, endpoints: list[EndpointState], want: Want) -> None:
    (entry,) = topology_entries(endpoints)
    assert (entry.namespace, entry.canonical_model_id) == ("ns", "m")
    assert entry.state == want.state
    assert _letters(entry.present_roles) == _sorted_letters(want.present)
    assert _letters(entry.missing_roles) == _sorted_letters(want.missing)
    assert _letters(entry.duplicate_role_endpoints) == _sorted_letters(want.dup)
    assert entry.legacy_fallback_active is want.legacy
    got = {a.canonical_model_id: (a.state, _letters(a.missing_roles)) for a in entry.adapters}
    want_adapters = {k: (s, _sorted_letters(m)) for k, (s, m) in want.adapters.items()}
    assert got == want_adapters
    # members: every participating endpoint, sorted, with declared roles (legacy -> LEGACY)
    assert [m.endpoint.component for m in entry.members] == sorted(e.component for e in endpoints)
    for m in entry.members:
        src = next(e for e in endpoints if e.component == m.endpoint.component)
        assert m.roles == ([L] if not src.roles else sorted(src.roles))
        assert m.endpoint.namespace == "ns" and m.pool_id is None


def _sorted_letters(spec: str) -> str:
    return _letters(sorted(_LETTER[c] for c in spec))


def test_entries_per_namespace_and_model(pool_id: Callable[[int], pb.KvPoolId]) -> None:
    eps = [
        ep("agg", "A", models=("m", "n"), pool=pool_id(1)),
        ep("agg", "A", 0, ns="other"),
        ep("pre", "P", models=("n",)),
    ]
    entries = topology_entries(eps)
    keys = [(e.namespace, e.canonical_model_id) for e in entries]
    assert keys == [("ns", "m"), ("ns", "n"), ("other", "m")]
    by_key = dict(zip(keys, entries, strict=True))
    assert by_key[("ns", "m")].state == S.READY
    assert by_key[("other", "m")].state == S.UNAVAILABLE  # namespaces never mix
    n_members = by_key[("ns", "n")].members
    assert [m.endpoint.component for m in n_members] == ["agg", "pre"]
    assert n_members[0].pool_id == pool_id(1)
    assert n_members[1].pool_id is None
    # adapters never appear top level
    lora = [ep("agg", "A", adapters={"sql": "m"})]
    assert [e.canonical_model_id for e in topology_entries(lora)] == ["m"]


def test_no_entry_without_registering_endpoint() -> None:
    assert topology_entries([ep("x", "A", models=())]) == []
    assert topology_entries([]) == []


@pytest.mark.parametrize(
    ("bad", "rule"),
    [
        (dict(namespace=""), "endpoint.namespace"),
        (dict(component=" c"), "endpoint.component"),
        (dict(endpoint="e\t"), "endpoint.endpoint"),
        (dict(roles=frozenset({Role.UNSPECIFIED})), "endpoint.role"),
        (dict(roles=frozenset({Role.LEGACY})), "endpoint.role"),
        (dict(roles=frozenset({Role(9)})), "endpoint.role"),
        (dict(needs=(frozenset({Role.UNSPECIFIED}),)), "endpoint.needs"),
        (dict(live=-1), "endpoint.live"),
        (dict(models=frozenset({""})), "endpoint.model"),
        (dict(adapters={"m": "m"}), "endpoint.adapter"),
        (dict(adapters={"sql": " m"}), "endpoint.adapter"),
    ],
)
def test_malformed_model_rejected(bad: dict[str, Any], rule: str) -> None:
    base: dict[str, Any] = dict(
        namespace="ns", component="c", endpoint="e", roles=roles("A"), live=1, models={"m"}
    )
    base.update(bad)
    with pytest.raises(TopologyError) as info:
        topology_entries([EndpointState(**base)])
    assert info.value.rule == rule


def test_duplicate_endpoint_triple_rejected() -> None:
    with pytest.raises(TopologyError) as info:
        topology_entries([ep("agg", "A"), ep("agg", "P")])
    assert info.value.rule == "endpoint.duplicate"


def test_int_roles_are_accepted() -> None:
    two, one = frozenset({2}), (frozenset({1}),)
    raw = EndpointState("ns", "c", "e", two, one, live=1, probed=True, models=frozenset({"m"}))
    (entry,) = topology_entries([raw])
    assert entry.present_roles == [D] and entry.missing_roles == [P]


# ---------------------------------------------------------------------------------- properties

_role_sets = st.frozensets(st.sampled_from([P, D, E, A]), max_size=2)


@st.composite
def _topologies(draw: st.DrawFn) -> list[EndpointState]:
    n = draw(st.integers(1, 6))
    out = []
    for i in range(n):
        out.append(
            EndpointState(
                namespace=draw(st.sampled_from(["a", "b"])),
                component=f"c{i}",
                endpoint="e",
                roles=draw(_role_sets),
                needs=tuple(
                    draw(st.lists(_role_sets.map(lambda r: r or frozenset({P})), max_size=2))
                ),
                live=draw(st.integers(0, 2)),
                probed=draw(st.booleans()),
                models=frozenset(draw(st.sets(st.sampled_from(["m", "n"]), max_size=2))),
                adapters={a: "m" for a in draw(st.sets(st.sampled_from(["x", "y"])))},
            )
        )
    return out


def _reference_state(eps: list[EndpointState]) -> pb.ServingReadinessState:
    """Independent restatement of §9 for one key (string roles, no shared code)."""
    if any(not e.probed for e in eps):
        return S.UNKNOWN
    live = [e for e in eps if e.live > 0]
    if not live:
        return S.UNAVAILABLE
    if any(len(e.roles) == 0 for e in eps):
        return S.READY
    present = {r.name for e in live for r in e.roles}
    declared = {r.name for e in eps for r in e.roles}
    if not declared <= present:
        return S.UNAVAILABLE
    for e in live:
        alts = [{r.name for r in alt} for alt in e.needs]
        if alts and not any(alt <= present for alt in alts):
            return S.UNAVAILABLE
    return S.READY


@settings(max_examples=150, deadline=None)
@given(_topologies(), st.randoms(use_true_random=False))
def test_matches_reference_and_is_order_independent(
    eps: list[EndpointState], rnd: random.Random
) -> None:
    entries = topology_entries(eps)
    for entry in entries:
        group = [
            e
            for e in eps
            if e.namespace == entry.namespace and entry.canonical_model_id in e.models
        ]
        assert entry.state == _reference_state(group)
        assert len(entry.members) == len(group)
    shuffled = list(eps)
    rnd.shuffle(shuffled)
    assert bytes(pb.ServingReadinessUpdate(entries=topology_entries(shuffled))) == bytes(
        pb.ServingReadinessUpdate(entries=entries)
    )


# ---------------------------------------------------------------------------------- plane


async def test_plane_revision_only_on_change(relay: pb.RelayIdentity) -> None:
    plane = ReadinessPlane(relay)
    rev, msg = plane.current()
    assert rev == 0 and msg.entries == [] and msg.contract_marker == 0x4B565231
    assert msg.protocol_version == 1 and msg.relay == relay
    waiter = asyncio.create_task(plane.wait_newer(0))
    assert plane.set_topology([]) is False
    await asyncio.sleep(0.01)
    assert not waiter.done()
    topo = [ep("pre", "P", 0), ep("dec", "D", needs=("P",))]
    assert plane.set_topology(topo) is True
    rev, msg = await asyncio.wait_for(waiter, scaled(1))
    assert rev == msg.revision == 1 and msg.entries[0].state == S.UNAVAILABLE
    assert plane.set_topology(list(reversed(topo))) is False  # same facts, other order
    assert plane.set_topology([ep("pre", "P"), ep("dec", "D", needs=("P",))]) is True
    assert plane.revision == 2 and plane.current()[1].entries[0].state == S.READY
    # bad input: counted, re-raised, nothing published
    with pytest.raises(TopologyError):
        plane.set_topology([ep("x", "A", live=-1)])
    assert plane.rejected == 1 and plane.revision == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(_topologies(), min_size=1, max_size=5), st.randoms(use_true_random=False))
def test_plane_entries_and_wire_match_a_fresh_computation(
    topologies: list[list[EndpointState]], rnd: random.Random
) -> None:
    """However a plane's cached entries came about, each published revision holds exactly the
    entries ``topology_entries`` computes afresh, and its wire bytes are betterproto2's bytes of
    the message and protobuf's canonical encoding (official runtime)."""
    relay = pb.RelayIdentity(drt_instance_id=7, relay_incarnation=1)
    plane = ReadinessPlane(relay)
    ids = [make_pool_id(i) for i in range(6)]
    for topo in topologies:
        # some endpoints name a pool, sometimes a new object with the same content
        topo = [replace(e, pool_id=rnd.choice([None, ids[i], pb.KvPoolId.parse(bytes(ids[i]))]))
                for i, e in enumerate(topo)]  # fmt: skip
        before = plane.revision
        changed = plane.set_topology(topo)
        version, message = plane.current()
        assert version == before + (1 if changed else 0)
        want = bytes(pb.ServingReadinessUpdate(entries=topology_entries(topo)))
        assert bytes(pb.ServingReadinessUpdate(entries=message.entries)) == want
        wire = plane.wire(version)
        if version == 0:
            assert wire is None
            continue
        assert wire is not None and wire == bytes(message)
        assert wire == canonicalize(wire, pb.ServingReadinessUpdate)
        official = _official("ServingReadinessUpdate")()
        official.ParseFromString(wire)
        assert official.revision == version
        assert plane.wire(version - 1) is None


async def test_an_event_at_one_endpoint_rebuilds_its_entries_only(
    relay: pb.RelayIdentity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entries whose endpoints did not change are neither built nor serialized again."""
    import kvrelay.publication.readiness as readiness

    built: list[str] = []
    real = readiness._entry

    def counted(ns: str, model: str, parts: list[EndpointState], *rest: Any) -> pb.TopologyEntry:
        built.append(model)
        return real(ns, model, parts, *rest)

    monkeypatch.setattr(readiness, "_entry", counted)
    plane = ReadinessPlane(relay)
    topo = [ep(f"c{i}", "A", models=(f"m{i}",)) for i in range(10)]
    assert plane.set_topology(topo) is True and len(built) == 10
    topo[4] = ep("c4", "A", live=0, models=("m4",))  # one engine went down
    assert plane.set_topology(topo) is True
    assert built[10:] == ["m4"]
    entries = {e.canonical_model_id: e.state for e in plane.current()[1].entries}
    assert entries["m4"] == S.UNAVAILABLE and entries["m3"] == S.READY
    assert plane.set_topology(list(reversed(topo))) is False and len(built) == 11


def test_every_field_of_an_endpoint_is_part_of_its_entry_key(relay: pb.RelayIdentity) -> None:
    """A change to any field of an endpoint (this list must name each) reaches readiness, so no
    field can be left out of what the plane keeps its entries by."""
    import dataclasses

    base = ep("c", "A", models=("m",))
    other = {
        "namespace": "ns2", "component": "c2", "endpoint": "e2", "roles": roles("D"),
        "needs": (roles("P"),), "live": 3, "probed": False, "models": frozenset({"m", "z"}),
        "adapters": {"x": "m"}, "pool_id": make_pool_id(9), "live_adapters": frozenset(),
    }  # fmt: skip
    assert set(other) == {f.name for f in dataclasses.fields(EndpointState)}
    plane = ReadinessPlane(relay)
    keys = set()
    for name, value in other.items():
        plane.set_topology([base])
        keys.add(plane._signature(base))
        changed = replace(base, **{name: value})
        plane.set_topology([changed])
        keys.add(plane._signature(changed))
        fresh = bytes(pb.ServingReadinessUpdate(entries=topology_entries([changed])))
        assert bytes(pb.ServingReadinessUpdate(entries=plane.current()[1].entries)) == fresh, name
    assert len(keys) == len(other) + 1  # the base, and one key per changed field


def test_an_adapter_no_live_engine_of_its_endpoint_carries_is_not_served() -> None:
    """An endpoint of several engines (a kvrelay pool) lists what its engines carry, but an
    adapter only an engine asleep or paused carries (``live_adapters``) cannot be served there:
    UNAVAILABLE, its role missing, though the endpoint is live."""
    both = ep("c", "A", adapters={"x": "m", "y": "m"})
    (entry,) = topology_entries([replace(both, live_adapters=frozenset({"y"}))])
    assert [(a.canonical_model_id, a.state, list(a.missing_roles)) for a in entry.adapters] == [
        ("x", S.UNAVAILABLE, [pb.WorkerRole.AGGREGATED]), ("y", S.READY, []),
    ]  # fmt: skip
    (entry,) = topology_entries([both])  # None: every adapter listed is carried live
    assert [a.state for a in entry.adapters] == [S.READY, S.READY]
