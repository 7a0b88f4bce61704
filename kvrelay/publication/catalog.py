"""Pool catalog plane: complete ``KvPoolCatalogUpdate`` snapshots, revision bumped on change only.

§4.2: a watcher gets the current complete catalog at once, then a new complete snapshot after each
change; absence from a snapshot is the withdrawal (no tombstones). Revisions start at 0 with an
empty catalog so the first subscriber always has something to receive. "Change" is decided on the
canonical bytes of a deterministically ordered snapshot, so republishing the same pools in another
order (or a re-scan that finds nothing new) does not wake every consumer.

Descriptors are validated against §3.3 before anything is published: a bad descriptor raises
:class:`CatalogError` and leaves the current snapshot untouched (no half-applied catalogs).

A pool hands out the same descriptor object until something it is made of changes, so each
descriptor's canonical bytes and its private parsed copy are kept per object
(``contract/identity_memo.py``), and the snapshot's wire bytes are laid out from those bytes
(``window_wire``). A catalog of 64 pools in which one pool changed then costs one pool's
serialization and parse, not 64 of each (``benchmarks/results/fleet_planes.json``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.envelope import as_role, copy_relay, text_problem
from kvrelay.contract.errors import RelayError
from kvrelay.contract.identity_memo import IdentityMemo
from kvrelay.contract.producer import producer_key
from kvrelay.contract.wire import CONTRACT_MARKER, PROTOCOL_VERSION, U32_MAX
from kvrelay.publication import window_wire
from kvrelay.publication.broadcast import VersionedBroadcast

__all__ = [
    "CatalogError",
    "CatalogPlane",
    "LoraSpec",
    "descriptor",
    "validate_descriptor",
    "validate_producer",
]

_HASH_FORMATS = frozenset(
    {pb.KvQueryHashFormat.DYNAMO_STANDARD_V1, pb.KvQueryHashFormat.DYNAMO_EAGLE_V1}
)


class CatalogError(ValueError):
    """A descriptor (or catalog) breaks a §3.3 rule. ``rule`` is a stable short tag for counting."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(f"{rule}: {detail}")
        self.rule = rule
        self.detail = detail


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """A LoRA registration backed by the descriptor's base model.

    ``adapter`` defaults to ``canonical_model_id`` (vLLM serves a LoRA under its adapter name).
    """

    canonical_model_id: str
    adapter: str | None = None
    aliases: Sequence[str] = ()


# --------------------------------------------------------------------------------------------
# validation (§3.3)


def _text(rule: str, value: object) -> None:
    problem = text_problem(value)
    if problem is not None:
        raise CatalogError(rule, problem)


def validate_producer(p: pb.ProducerIdentity | None) -> None:
    """``ProducerKey`` validity (§3.3), shared with request validation; raises CatalogError.

    We publish only identities a consumer would accept as a subscription key, otherwise the pool
    would be advertised but unsubscribable.
    """
    try:
        producer_key(p)
    except RelayError as exc:
        raise CatalogError("producer.invalid", exc.message) from exc


def _roles(roles: Iterable[object]) -> list[pb.WorkerRole]:
    out: list[pb.WorkerRole] = []
    for r in roles:
        role = as_role(r)
        if role is None:
            raise CatalogError("roles.invalid", f"{r!r} is UNSPECIFIED or unknown")
        if role in out:
            raise CatalogError("roles.duplicate", f"{role.name} listed twice")
        out.append(role)
    if not out:
        raise CatalogError("roles.empty", "pool_roles must be non-empty")
    return sorted(out)


def _registration(reg: pb.ModelRegistration) -> None:
    _text("registration.canonical_model_id", reg.canonical_model_id)
    seen: set[str] = set()
    for alias in reg.aliases:
        _text("registration.alias", alias)
        if alias in seen:
            raise CatalogError("registration.alias_duplicate", f"alias {alias!r} repeated")
        if alias == reg.canonical_model_id:
            raise CatalogError("registration.alias_is_canonical", f"alias {alias!r}")
        seen.add(alias)
    t = reg.target
    base = None if t is None else t.base
    lora = None if t is None else t.lora
    if base is None and lora is None:
        raise CatalogError("registration.target_unset", f"{reg.canonical_model_id!r}")
    if base is not None and lora is not None:
        raise CatalogError("registration.target_ambiguous", "both base and lora are set")
    if base is not None:
        _text("registration.base_model", base.base_model)
    if lora is not None:
        _text("registration.base_model", lora.base_model)
        _text("registration.adapter", lora.adapter)


def validate_descriptor(d: pb.KvPoolDescriptor) -> None:
    """Every §3.3 catalog rule plus the §4.2 registration shape; raises :class:`CatalogError`."""
    validate_producer(d.producer)
    ep = d.serving_endpoint
    if ep is None:
        raise CatalogError("endpoint.missing", "serving_endpoint is missing")
    _text("endpoint.namespace", ep.namespace)
    _text("endpoint.component", ep.component)
    _text("endpoint.endpoint", ep.endpoint)
    if not d.registrations:
        raise CatalogError("registration.empty", "at least one registration is required")
    ids: set[str] = set()
    bases: list[str] = []
    for reg in d.registrations:
        _registration(reg)
        if reg.canonical_model_id in ids:
            raise CatalogError("registration.duplicate", repr(reg.canonical_model_id))
        ids.add(reg.canonical_model_id)
        if reg.target is not None and reg.target.base is not None:
            bases.append(reg.target.base.base_model)
    if len(bases) != 1:
        raise CatalogError("registration.base_count", f"expected one base, found {bases}")
    base = bases[0]
    for reg in d.registrations:
        lora = None if reg.target is None else reg.target.lora
        if lora is not None and lora.base_model != base:
            raise CatalogError("registration.lora_base", f"{reg.canonical_model_id!r} vs {base!r}")
    q = d.query_semantics
    if q is None:
        raise CatalogError("query.missing", "query_semantics is missing")
    if not 0 < q.kv_block_size <= U32_MAX:
        raise CatalogError("query.block_size", f"kv_block_size {q.kv_block_size}")
    if q.hash_format not in _HASH_FORMATS:
        raise CatalogError("query.hash_format", f"hash_format {q.hash_format!r}")
    _roles(d.pool_roles)


# --------------------------------------------------------------------------------------------
# builder


def _aliases(canonical: str, aliases: Iterable[str]) -> list[str]:
    """§4.2 normalization: sorted, deduplicated, the canonical id itself removed."""
    return sorted({a for a in aliases if a != canonical})


def descriptor(
    *,
    producer: pb.ProducerIdentity,
    namespace: str,
    component: str,
    endpoint: str,
    base_model: str,
    kv_block_size: int,
    hash_format: pb.KvQueryHashFormat,
    roles: Iterable[pb.WorkerRole],
    base_aliases: Iterable[str] = (),
    loras: Iterable[LoraSpec] = (),
) -> pb.KvPoolDescriptor:
    """Build and validate a ``KvPoolDescriptor`` (one base registration + its LoRAs, §4.2).

    ``base_model`` is the canonical (served) id of the base model; it is also the backing
    ``base_model`` of every LoRA target. Roles are emitted sorted, aliases normalized. Each
    ``ModelTarget`` is constructed fresh with exactly one oneof member, because betterproto2 does
    not clear the sibling member when one is assigned after construction.
    """
    regs = [
        pb.ModelRegistration(
            canonical_model_id=base_model,
            target=pb.ModelTarget(base=pb.BaseModelTarget(base_model=base_model)),
            aliases=_aliases(base_model, base_aliases),
        )
    ]
    for lora in sorted(loras, key=lambda s: s.canonical_model_id):
        adapter = lora.canonical_model_id if lora.adapter is None else lora.adapter
        regs.append(
            pb.ModelRegistration(
                canonical_model_id=lora.canonical_model_id,
                target=pb.ModelTarget(
                    lora=pb.LoraModelTarget(base_model=base_model, adapter=adapter)
                ),
                aliases=_aliases(lora.canonical_model_id, lora.aliases),
            )
        )
    d = pb.KvPoolDescriptor(
        producer=producer,
        serving_endpoint=pb.DynamoEndpointId(
            namespace=namespace, component=component, endpoint=endpoint
        ),
        registrations=regs,
        query_semantics=pb.KvQuerySemantics(kv_block_size=kv_block_size, hash_format=hash_format),
        pool_roles=list(roles),
    )
    validate_descriptor(d)
    d.pool_roles = _roles(d.pool_roles)
    return pb.KvPoolDescriptor.parse(bytes(d))


# --------------------------------------------------------------------------------------------
# plane


def _canonical_bytes(d: pb.KvPoolDescriptor) -> bytes:
    """Bytes of a normalized copy: roles and aliases sorted, base registration first, LoRAs by id.

    Set-like fields carry no order in the contract, so order must not cause a new revision.
    """
    # A shallow normalized view sharing d's sub-messages: serialized once, never stored/mutated.
    regs = sorted(
        (
            pb.ModelRegistration(
                canonical_model_id=r.canonical_model_id, target=r.target, aliases=sorted(r.aliases)
            )
            for r in d.registrations
        ),
        key=lambda r: (r.target is None or r.target.base is None, r.canonical_model_id),
    )
    return bytes(
        pb.KvPoolDescriptor(
            producer=d.producer,
            serving_endpoint=d.serving_endpoint,
            registrations=regs,
            query_semantics=d.query_semantics,
            pool_roles=sorted(d.pool_roles),
        )
    )


class CatalogPlane:
    """The ``WatchKvPoolCatalog`` plane (a ``Plane[pb.KvPoolCatalogUpdate]``).

    ``set_pools`` takes the complete list of live pools; the caller (pool registry) owns fencing,
    so two descriptors for one ``KvPoolId`` are rejected rather than silently merged (§1).
    """

    def __init__(self, relay_identity: pb.RelayIdentity) -> None:
        self._relay = copy_relay(relay_identity)
        self._canonical = b""
        self.rejected = 0
        # Per descriptor object: its canonical bytes and the private copy streams carry; per
        # pool id object (inside a descriptor, so as stable): the bytes the snapshot sorts by.
        self._descriptors: IdentityMemo[pb.KvPoolDescriptor] = IdentityMemo(
            encode=_canonical_bytes
        )
        self._pool_ids: IdentityMemo[pb.KvPoolId] = IdentityMemo()
        self._ordered: list[bytes] = []
        self._wire = window_wire.NewestWire()
        self._bc: VersionedBroadcast[pb.KvPoolCatalogUpdate] = VersionedBroadcast(
            0, self._message(0, [])
        )

    @property
    def broadcast(self) -> VersionedBroadcast[pb.KvPoolCatalogUpdate]:
        return self._bc

    @property
    def revision(self) -> int:
        return self._bc.version

    def current(self) -> tuple[int, pb.KvPoolCatalogUpdate]:
        return self._bc.current()

    async def wait_newer(self, version: int) -> tuple[int, pb.KvPoolCatalogUpdate]:
        return await self._bc.wait_newer(version)

    def close(self) -> None:
        self._bc.close()

    def set_pools(self, descriptors: Iterable[pb.KvPoolDescriptor]) -> bool:
        """Replace the catalog; returns True iff a new revision was published.

        Raises :class:`CatalogError` (and counts it in ``rejected``) without changing anything if
        any descriptor is invalid or two share a ``KvPoolId``. A descriptor must not be changed
        once handed here: the plane keeps what it made of each object (build a new one instead).
        """
        descriptors = list(descriptors)
        try:
            keyed: dict[bytes, tuple[bytes, pb.KvPoolDescriptor]] = {}
            for d in descriptors:
                validate_descriptor(d)
                assert d.producer is not None and d.producer.pool_id is not None  # validated
                key = self._pool_ids.data(d.producer.pool_id)
                if key in keyed:
                    raise CatalogError("catalog.duplicate_pool", "two descriptors share a KvPoolId")
                keyed[key] = self._descriptors.encoded(d)
        except CatalogError:
            self.rejected += 1
            raise
        # Only the live pools' descriptors stay memoized: a replaced one is never asked for again.
        self._descriptors.retain(descriptors)
        self._pool_ids.retain(d.producer.pool_id for d in descriptors if d.producer is not None)
        entries = [keyed[k] for k in sorted(keyed)]
        ordered = [canon for canon, _ in entries]
        canonical = b"".join(len(b).to_bytes(4, "little") + b for b in ordered)
        if canonical == self._canonical:
            return False
        # Private parsed copies: later mutation of the caller's objects cannot leak into streams.
        pools = [copy for _, copy in entries]
        revision = self._bc.version + 1
        self._bc.publish(revision, self._message(revision, pools))
        self._canonical = canonical
        self._ordered = ordered
        self._wire.published(revision)
        return True

    def wire(self, version: int) -> bytes | None:
        """The wire bytes of revision ``version`` while it is the newest (else None), laid out
        from each descriptor's cached bytes; written when first asked for."""
        return self._wire.get(version, self._build_wire)

    def _build_wire(self, revision: int) -> bytes:
        header = pb.KvPoolCatalogUpdate(
            protocol_version=PROTOCOL_VERSION, relay=self._relay, revision=revision
        )
        snapshot = b"".join(window_wire.message_field(1, c) for c in self._ordered)
        return window_wire.window(header, [(4, [snapshot])], CONTRACT_MARKER)

    def _message(self, revision: int, pools: list[pb.KvPoolDescriptor]) -> pb.KvPoolCatalogUpdate:
        return pb.KvPoolCatalogUpdate(
            protocol_version=PROTOCOL_VERSION,
            relay=self._relay,
            revision=revision,
            snapshot=pb.KvPoolCatalogSnapshot(pools=pools),
            contract_marker=CONTRACT_MARKER,
        )
