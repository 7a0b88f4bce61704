"""Serving-readiness plane: the §9 topology projection as complete ``ServingReadinessUpdate``s.

How kvrelay maps a vLLM fleet onto the §9 model (the orchestrator builds :class:`EndpointState`):

* One Dynamo serving endpoint triple ``(namespace, component, endpoint)`` = one
  :class:`EndpointState` ("worker set", one base-card shape per endpoint, like Dynamo).
* ``roles`` = the endpoint's configured ``worker_type`` (the role its pools advertise). An engine
  configured without a worker type is a *legacy* card: ``roles`` is empty and it is exported as
  ``[LEGACY]``; kvrelay's configuration default is ``AGGREGATED``, so legacy only appears when an
  operator explicitly asks for it.
* ``needs`` = the DNF of role sets the endpoint requires to serve: in a P/D pair the DECODE
  endpoint has ``needs=({PREFILL},)``; an EPD decode might have ``({PREFILL, ENCODE},)``.
* ``live`` = engines of the endpoint that are live *now*: their vLLM Control probe is reachable,
  they are not sleeping, not paused, and their KV event source is active.
* ``probed`` = the endpoint has delivered its first authoritative availability snapshot (every
  configured engine probed at least once). Until then the entry is ``UNKNOWN``: absence of
  evidence is not evidence of absence. An endpoint absent from the model is a fact, not a doubt.
* ``models`` = base canonical model ids the endpoint registers; ``adapters`` = LoRA canonical id
  → backing base canonical id it advertises; ``live_adapters`` = those its *live* engines carry
  (None: all of them; an endpoint of several engines, a kvrelay pool, may have an adapter only
  on an engine asleep or paused, which cannot serve it); ``pool_id`` = its materialized
  ``KvPoolId`` (stable identity, never the generation) or None.

The computation (:func:`topology_entries`) is pure and deterministic: entries, members and role
lists are sorted, so equal inputs give byte-equal messages and the plane bumps its revision only
when something observable changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.envelope import as_role, copy_relay, text_problem
from kvrelay.contract.identity_memo import IdentityMemo
from kvrelay.contract.wire import CONTRACT_MARKER, PROTOCOL_VERSION
from kvrelay.publication import window_wire
from kvrelay.publication.broadcast import VersionedBroadcast

__all__ = ["EndpointState", "ReadinessPlane", "TopologyError", "topology_entries"]

Role = pb.WorkerRole
State = pb.ServingReadinessState

_DUPLICATE_REPORTED = (Role.PREFILL, Role.DECODE)
# Roles that must carry an adapter for the adapter to be servable (§9). ENCODE never carries one.
_ADAPTER_BEARING = frozenset({Role.PREFILL, Role.DECODE, Role.AGGREGATED})


class TopologyError(ValueError):
    """The topology model is malformed; nothing is published. ``rule`` is a stable tag."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(f"{rule}: {detail}")
        self.rule = rule
        self.detail = detail


@dataclass(frozen=True, eq=False)
class EndpointState:
    """One serving endpoint (worker set) as seen by the relay; see the module docstring."""

    namespace: str
    component: str
    endpoint: str
    roles: frozenset[pb.WorkerRole] = frozenset()
    needs: tuple[frozenset[pb.WorkerRole], ...] = ()
    live: int = 0
    probed: bool = False
    models: frozenset[str] = frozenset()
    adapters: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    pool_id: pb.KvPoolId | None = None
    live_adapters: frozenset[str] | None = None

    def carries(self, adapter: str) -> bool:
        """A live engine of the endpoint carries ``adapter`` (given ``live > 0``)."""
        return self.live_adapters is None or adapter in self.live_adapters

    @property
    def legacy(self) -> bool:
        """A card without ``worker_type``."""
        return not self.roles


_ENDPOINT_FIELDS = tuple(f.name for f in fields(EndpointState))


def validate_endpoint(e: EndpointState) -> None:
    """Raise :class:`TopologyError` if ``e`` could not take part in a topology (bad text,
    UNSPECIFIED/unknown/LEGACY roles, …): callers drop such an endpoint alone."""
    _check(e)


def _normalized(e: EndpointState) -> EndpointState:
    """Validate ``e`` and return a copy with roles coerced to ``WorkerRole`` members.

    Callers may pass plain ints for roles; coercion keeps set algebra and sorting exact.
    """
    _check(e)
    return replace(
        e,
        roles=frozenset(Role(int(r)) for r in e.roles),
        needs=tuple(frozenset(Role(int(r)) for r in alt) for alt in e.needs),
        adapters=MappingProxyType(dict(e.adapters)),
    )


def _check(e: EndpointState) -> None:
    for name in ("namespace", "component", "endpoint"):
        problem = text_problem(getattr(e, name))
        if problem is not None:
            raise TopologyError(f"endpoint.{name}", problem)
    where = f"{e.namespace}/{e.component}/{e.endpoint}"
    for r in e.roles:
        role = as_role(r)
        if role is None or role == Role.LEGACY:
            raise TopologyError("endpoint.role", f"{where}: role {r!r} (legacy = empty roles)")
    for alt in e.needs:
        for r in alt:
            role = as_role(r)
            if role is None or role == Role.LEGACY:
                raise TopologyError("endpoint.needs", f"{where}: needed role {r!r}")
    if isinstance(e.live, bool) or not isinstance(e.live, int) or e.live < 0:
        raise TopologyError("endpoint.live", f"{where}: live={e.live!r}")
    if isinstance(e.models, str) or not isinstance(e.adapters, Mapping):
        raise TopologyError("endpoint.model", f"{where}: models must be a set, adapters a mapping")
    for m in e.models:
        problem = text_problem(m)
        if problem is not None:
            raise TopologyError("endpoint.model", f"{where}: {problem}")
    for adapter, base in e.adapters.items():
        for text in (adapter, base):
            problem = text_problem(text)
            if problem is not None:
                raise TopologyError("endpoint.adapter", f"{where}: {problem}")
        if adapter in e.models:
            raise TopologyError("endpoint.adapter", f"{where}: {adapter!r} is also a base model")


def _sorted_roles(roles: Iterable[pb.WorkerRole]) -> list[pb.WorkerRole]:
    return sorted({Role(int(r)) for r in roles})


def _member(
    e: EndpointState, pool_bytes: Callable[[pb.KvPoolId], bytes] = bytes
) -> pb.TopologyMember:
    m = pb.TopologyMember(
        endpoint=pb.DynamoEndpointId(
            namespace=e.namespace, component=e.component, endpoint=e.endpoint
        ),
        roles=[Role.LEGACY] if e.legacy else _sorted_roles(e.roles),
    )
    if e.pool_id is not None:
        m.pool_id = pb.KvPoolId.parse(pool_bytes(e.pool_id))
    return m


def _adapter_readiness(
    adapter: str,
    base_model: str,
    base_state: pb.ServingReadinessState,
    participants: list[EndpointState],
    present: set[pb.WorkerRole],
) -> pb.AdapterReadiness:
    """§9 adapter rule [INFERRED details documented here].

    Applicable roles = adapter-bearing roles present (live) in the topology; in legacy fallback
    the live legacy endpoints count as one pseudo-role ``LEGACY``. A role has adapter membership
    when some *live* endpoint of that role advertises the adapter backed by this base model (a
    dead carrier cannot serve it). UNKNOWN base ⇒ UNKNOWN adapter with ``missing_roles`` cleared.
    """
    if base_state == State.UNKNOWN:
        return pb.AdapterReadiness(canonical_model_id=adapter, state=State.UNKNOWN)
    applicable = present & _ADAPTER_BEARING
    carrying: set[pb.WorkerRole] = set()
    for e in participants:
        if e.live <= 0:
            continue
        if e.legacy:
            applicable.add(Role.LEGACY)
        if e.adapters.get(adapter) == base_model and e.carries(adapter):
            carrying.update([Role.LEGACY] if e.legacy else e.roles)
    missing = _sorted_roles(applicable - carrying)
    ready = base_state == State.READY and not missing and bool(applicable)
    return pb.AdapterReadiness(
        canonical_model_id=adapter,
        state=State.READY if ready else State.UNAVAILABLE,
        missing_roles=missing,
    )


def _entry(
    namespace: str,
    model: str,
    participants: list[EndpointState],
    pool_bytes: Callable[[pb.KvPoolId], bytes] = bytes,
) -> pb.TopologyEntry:
    present = {r for e in participants if e.live > 0 for r in e.roles}
    any_live = any(e.live > 0 for e in participants)
    legacy = any(e.legacy for e in participants)
    missing: set[pb.WorkerRole] = set()
    if not legacy:
        for e in participants:
            missing.update(r for r in e.roles if r not in present)
            if e.live > 0 and e.needs and not any(alt <= present for alt in e.needs):
                missing.update(r for alt in e.needs for r in alt if r not in present)
    ready = any_live and not missing
    unknown = not all(e.probed for e in participants)
    state = State.UNKNOWN if unknown else (State.READY if ready else State.UNAVAILABLE)

    duplicates = [
        role for role in _DUPLICATE_REPORTED if sum(role in e.roles for e in participants) > 1
    ]
    adapter_ids = sorted({a for e in participants for a, b in e.adapters.items() if b == model})
    return pb.TopologyEntry(
        namespace=namespace,
        canonical_model_id=model,
        state=state,
        present_roles=[] if unknown else _sorted_roles(present),
        missing_roles=[] if unknown else _sorted_roles(missing),
        members=[
            _member(e, pool_bytes)
            for e in sorted(participants, key=lambda e: (e.component, e.endpoint))
        ],
        duplicate_role_endpoints=duplicates,
        legacy_fallback_active=legacy,
        adapters=[_adapter_readiness(a, model, state, participants, present) for a in adapter_ids],
    )


def _grouped(
    endpoints: Iterable[EndpointState],
) -> list[tuple[str, str, list[EndpointState]]]:
    """``(namespace, base model, its normalized endpoints by (component, endpoint))``, sorted
    by ``(namespace, model)``; raises :class:`TopologyError` as :func:`topology_entries`."""
    by_key: dict[tuple[str, str], list[EndpointState]] = {}
    seen: set[tuple[str, str, str]] = set()
    for raw in endpoints:
        e = _normalized(raw)
        triple = (e.namespace, e.component, e.endpoint)
        if triple in seen:
            raise TopologyError("endpoint.duplicate", "/".join(triple))
        seen.add(triple)
        for model in e.models:
            by_key.setdefault((e.namespace, model), []).append(e)
    return [
        (ns, model, sorted(by_key[(ns, model)], key=lambda e: (e.component, e.endpoint)))
        for ns, model in sorted(by_key)
    ]


def topology_entries(endpoints: Iterable[EndpointState]) -> list[pb.TopologyEntry]:
    """Compute the §9 entries, sorted by ``(namespace, canonical_model_id)``.

    One entry per (namespace, base canonical model id) registered by at least one endpoint;
    LoRA ids only appear under their base's ``adapters``. Raises :class:`TopologyError` for a
    malformed model (bad text, UNSPECIFIED/unknown/LEGACY roles, duplicate endpoint triples).
    """
    return [_entry(ns, model, parts) for ns, model, parts in _grouped(endpoints)]


class ReadinessPlane:
    """The ``SubscribeServingReadiness`` plane (a ``Plane[pb.ServingReadinessUpdate]``).

    Revision 0 is an empty topology available at construction; each ``set_topology`` whose
    result differs byte-wise from the current entries publishes revision + 1. The 10 s re-send of
    an unchanged snapshot is the stream's job (it re-sends ``current()``).
    """

    def __init__(self, relay_identity: pb.RelayIdentity) -> None:
        self._relay = copy_relay(relay_identity)
        self._canonical = b""
        self.rejected = 0
        # An entry's bytes and the entry by what it is computed from: its namespace, model
        # and every field of its endpoints (a pool id by its bytes). Only the current
        # topology's entries and pool ids are kept, so the memos are as large as the topology.
        self._pool_ids: IdentityMemo[pb.KvPoolId] = IdentityMemo()
        self._entries: dict[tuple[object, ...], tuple[bytes, pb.TopologyEntry]] = {}
        self._ordered: list[bytes] = []
        self._wire = window_wire.NewestWire()
        self._bc: VersionedBroadcast[pb.ServingReadinessUpdate] = VersionedBroadcast(
            0, self._message(0, [])
        )

    @property
    def broadcast(self) -> VersionedBroadcast[pb.ServingReadinessUpdate]:
        return self._bc

    @property
    def revision(self) -> int:
        return self._bc.version

    def current(self) -> tuple[int, pb.ServingReadinessUpdate]:
        return self._bc.current()

    async def wait_newer(self, version: int) -> tuple[int, pb.ServingReadinessUpdate]:
        return await self._bc.wait_newer(version)

    def close(self) -> None:
        self._bc.close()

    def set_topology(self, endpoints: Iterable[EndpointState]) -> bool:
        """Recompute; publish and return True iff the entries changed.

        A :class:`TopologyError` is counted in ``rejected`` and re-raised; the current snapshot
        stays as it was. An entry none of whose inputs changed is not built or serialized again:
        an event at one endpoint costs its entries, not the whole topology's.
        """
        try:
            groups = _grouped(endpoints)
        except TopologyError:
            self.rejected += 1
            raise
        memo: dict[tuple[object, ...], tuple[bytes, pb.TopologyEntry]] = {}
        built: list[tuple[bytes, pb.TopologyEntry]] = []
        for ns, model, parts in groups:
            key = (ns, model, *(self._signature(e) for e in parts))
            hit = memo.get(key) or self._entries.get(key)
            if hit is None:  # built here from normalized copies: already the plane's own
                entry = _entry(ns, model, parts, self._pool_ids.data)
                hit = (bytes(entry), entry)
            memo[key] = hit
            built.append(hit)
        self._entries = memo
        # the current endpoints' pool ids only: each new generation brings a new id object,
        # and dead ones were kept up to the memo's bound (4,096)
        self._pool_ids.retain(e.pool_id for _ns, _m, parts in groups for e in parts
                              if e.pool_id is not None)  # fmt: skip
        canonical = b"".join(len(d).to_bytes(4, "little") + d for d, _ in built)
        if canonical == self._canonical:
            return False
        revision = self._bc.version + 1
        self._bc.publish(revision, self._message(revision, [copy for _, copy in built]))
        self._canonical = canonical
        self._ordered = [d for d, _ in built]
        self._wire.published(revision)
        return True

    def wire(self, version: int) -> bytes | None:
        """The wire bytes of revision ``version`` while it is the newest (else None), laid out
        from each entry's cached bytes; written when first asked for."""
        return self._wire.get(version, self._build_wire)

    def _build_wire(self, revision: int) -> bytes:
        header = pb.ServingReadinessUpdate(
            protocol_version=PROTOCOL_VERSION, relay=self._relay, revision=revision
        )
        return window_wire.window(header, [(4, self._ordered)], CONTRACT_MARKER)

    def _signature(self, e: EndpointState) -> tuple[object, ...]:
        """Every field of a normalized endpoint, hashable; equal signatures give equal entries.
        Read from the dataclass's fields, so a field added later is part of it (one whose type
        cannot be hashed fails loudly here rather than being left out)."""
        return tuple(self._hashable(getattr(e, name)) for name in _ENDPOINT_FIELDS)

    def _hashable(self, value: object) -> object:
        if isinstance(value, pb.KvPoolId):
            return self._pool_ids.data(value)
        if isinstance(value, Mapping):
            return tuple(sorted(value.items()))
        if isinstance(value, set | list):  # a set-valued field given as a set or list
            return frozenset(value)
        return value

    def _message(self, revision: int, entries: list[pb.TopologyEntry]) -> pb.ServingReadinessUpdate:
        return pb.ServingReadinessUpdate(
            protocol_version=PROTOCOL_VERSION,
            relay=self._relay,
            revision=revision,
            entries=entries,
            contract_marker=CONTRACT_MARKER,
        )
