"""Who may see which pools: ``[[authorization]]`` rules over a client certificate's identity.

Why: routers of many teams share one relay, and a pool's existence (its endpoint, model, load)
is itself information. With mutual TLS each rule names client identities (URI SAN such as a
SPIFFE ID, DNS SAN, subject CN; exact or ``fnmatch`` glob, case-sensitive, ``*`` also matches
``/``) and the pools they see (namespace, pool key ``namespace/component/endpoint`` or model;
globs too). A client sees the union of the rules that name it; once any rule exists, a client
no rule names sees nothing. No rules at all: everyone sees everything (the service then holds no
``Authorization`` and takes no step of this module).

Asking for publication spacing (``service/spacing.py``, what a mirror does while its joiners
catch up) slows a pool's deltas for every other reader of it, so under rules it is a right of
its own: only a client named by a rule with ``spacing = true`` may ask, for the pools it sees.

A pool a client may not see is answered as an absent one (``POOL_NOT_FOUND``, the relay's own
message) and left out of every plane message it gets. Plane messages are re-encoded per set of
matched rules (clients naming the same rules see the same bytes), and each set's newest copy per
plane is kept in a bounded LRU (``PLANE_CACHE_ENTRIES``): N routers with the same rights cost one
encode per version. A filtered copy keeps the plane's revision or window: consumers replace their
state with each message, so a copy re-filtered after a rules reload, under the same revision, is
taken as it is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.contract.errors import RelayError

#: Plane copies kept: (plane kind, matched rules) pairs, newest version each; the least recently
#: used pair is dropped when full (its next reader re-encodes it).
PLANE_CACHE_ENTRIES = 256
#: Visible-pool sets kept, per matched rules, for the newest catalog version each.
VISIBLE_CACHE_ENTRIES = 256
_TYPES: dict[str, Any] = {
    "catalog": pb.KvPoolCatalogUpdate,
    "readiness": pb.ServingReadinessUpdate,
    "load": pb.KvPoolLoadUpdate,
    "serving_load": pb.ServingLoadUpdate,
}
Rights = frozenset[int]


def not_visible() -> RelayError:
    """What a client hears for a pool it may not see: exactly an absent pool's answer."""
    return RelayError.pool_not_found()


def revoked() -> RelayError:
    """What ends a pool stream whose pool a rules reload took away: a withdrawn pool's status."""
    return RelayError.publication_unavailable("producer generation retired")


@dataclass(frozen=True, slots=True)
class ClientIdentity:
    """The names a client certificate carries (empty without one)."""

    uris: tuple[str, ...] = ()
    dns: tuple[str, ...] = ()
    cns: tuple[str, ...] = ()

    @classmethod
    def from_cert(cls, cert: Mapping[str, Any] | None) -> ClientIdentity:
        """From ``ssl.SSLSocket.getpeercert()``'s dict (None: no verified certificate)."""
        if not cert:
            return cls()
        uris: list[str] = []
        dns: list[str] = []
        for kind, value in cert.get("subjectAltName", ()) or ():
            if kind == "URI":
                uris.append(str(value))
            elif kind == "DNS":
                dns.append(str(value))
        cns = [
            str(value)
            for rdn in cert.get("subject", ()) or ()
            for key, value in rdn
            if key == "commonName"
        ]
        return cls(tuple(uris), tuple(dns), tuple(cns))

    def __str__(self) -> str:
        names = [*self.uris, *(f"DNS:{d}" for d in self.dns), *(f"CN={c}" for c in self.cns)]
        return ",".join(names) or "(no certificate)"


def _any(patterns: Iterable[str], values: Iterable[str]) -> bool:
    values = tuple(values)
    return any(fnmatchcase(v, p) for p in patterns for v in values)


@dataclass(frozen=True, slots=True)
class AuthorizationRule:
    """One ``[[authorization]]`` table: who (any of uri/dns/cn) sees what (any selector)."""

    uri: tuple[str, ...] = ()
    dns: tuple[str, ...] = ()
    cn: tuple[str, ...] = ()
    namespaces: tuple[str, ...] = ()
    pools: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    #: its clients may ask for publication spacing (mirrors), for the pools it shows them
    spacing: bool = False

    def names(self, who: ClientIdentity) -> bool:
        return _any(self.uri, who.uris) or _any(self.dns, who.dns) or _any(self.cn, who.cns)

    def sees(self, namespace: str, pool_key: str | None, models: Iterable[str]) -> bool:
        if _any(self.namespaces, (namespace,)):
            return True
        if pool_key is not None and _any(self.pools, (pool_key,)):
            return True
        return _any(self.models, models)


def _endpoint_key(ep: pb.DynamoEndpointId | None) -> tuple[str, str | None]:
    if ep is None:
        return "", None
    return ep.namespace, f"{ep.namespace}/{ep.component}/{ep.endpoint}"


def _descriptor_models(desc: pb.KvPoolDescriptor) -> list[str]:
    return [m for r in desc.registrations for m in (r.canonical_model_id, *r.aliases)]


def _pool_bytes(producer: pb.ProducerIdentity | None) -> bytes:
    return b"" if producer is None or producer.pool_id is None else bytes(producer.pool_id)


class Authorization:
    """One loaded rule set, with its caches (a reload builds a new one)."""

    def __init__(self, rules: Sequence[AuthorizationRule]) -> None:
        self.rules = tuple(rules)
        self._planes: OrderedDict[tuple[str, Rights], tuple[tuple[int, int, int], bytes]] = (
            OrderedDict()
        )
        self._visible: OrderedDict[Rights, tuple[int, frozenset[bytes]]] = OrderedDict()
        self._all: tuple[int, frozenset[bytes]] | None = None
        self.encodes = 0  # filtered copies encoded (a test's view of the cache)

    def rights(self, who: ClientIdentity) -> Rights:
        """The indices of the rules naming ``who`` (empty: sees nothing)."""
        return frozenset(i for i, rule in enumerate(self.rules) if rule.names(who))

    def may_space(self, rights: Rights) -> bool:
        """Whether a rule naming the client grants it publication spacing requests."""
        return any(self.rules[i].spacing for i in rights)

    def _sees(self, rights: Rights, ns: str, key: str | None, models: Iterable[str]) -> bool:
        models = tuple(models)
        return any(self.rules[i].sees(ns, key, models) for i in rights)

    def visible_pools(self, rights: Rights, catalog: tuple[int, Any] | None) -> frozenset[bytes]:
        """``KvPoolId`` bytes of the catalog's pools ``rights`` may see (``catalog``: the catalog
        plane's (version, message); None when it has none to vouch for)."""
        if catalog is None or not rights:
            return frozenset()
        version, message = catalog
        hit = self._visible.get(rights)
        if hit is not None and hit[0] == version:
            self._visible.move_to_end(rights)
            return hit[1]
        update = _parse("catalog", message)
        pools = update.snapshot.pools if update.snapshot is not None else []
        seen = frozenset(
            _pool_bytes(d.producer)
            for d in pools
            if self._sees(rights, *_endpoint_key(d.serving_endpoint), _descriptor_models(d))
        )
        self._visible[rights] = (version, seen)
        self._visible.move_to_end(rights)
        while len(self._visible) > VISIBLE_CACHE_ENTRIES:
            self._visible.popitem(last=False)
        return seen

    def may_see(
        self, rights: Rights, producer: pb.ProducerIdentity, catalog: tuple[int, Any] | None
    ) -> bool:
        return _pool_bytes(producer) in self.visible_pools(rights, catalog)

    def hides(self, producer: pb.ProducerIdentity, catalog: tuple[int, Any] | None) -> bool:
        """Whether ``producer``'s pool is in the catalog at all (a refusal worth counting: the
        client is answered as for an absent pool either way)."""
        if catalog is None:
            return False
        if self._all is None or self._all[0] != catalog[0]:
            update = _parse("catalog", catalog[1])
            pools = update.snapshot.pools if update.snapshot is not None else []
            self._all = (catalog[0], frozenset(_pool_bytes(d.producer) for d in pools))
        return _pool_bytes(producer) in self._all[1]

    def filtered(
        self,
        kind: str,
        version: int,
        message: Any,
        rights: Rights,
        catalog: tuple[int, Any] | None,
        topology: tuple[int, Any] | None = None,
    ) -> bytes:
        """The wire bytes of plane ``kind``'s ``message`` as ``rights`` may see it.
        ``topology``: the readiness plane's (version, message), which a serving-load model view
        is checked against (every configured pool of the model, published or not)."""
        stamp = (
            version,
            catalog[0] if catalog is not None and kind != "catalog" else -1,
            topology[0] if topology is not None and kind == "serving_load" else -1,
        )
        key = (kind, rights)
        hit = self._planes.get(key)
        if hit is not None and hit[0] == stamp:
            self._planes.move_to_end(key)
            return hit[1]
        data = bytes(self._filter(kind, _parse(kind, message), rights, catalog, topology))
        self.encodes += 1
        self._planes[key] = (stamp, data)
        self._planes.move_to_end(key)
        while len(self._planes) > PLANE_CACHE_ENTRIES:
            self._planes.popitem(last=False)
        return data

    def _filter(
        self,
        kind: str,
        m: Any,
        rights: Rights,
        catalog: tuple[int, Any] | None,
        topology: tuple[int, Any] | None = None,
    ) -> Any:
        if kind == "catalog":
            if m.snapshot is not None:
                m.snapshot.pools = [
                    d for d in m.snapshot.pools
                    if self._sees(rights, *_endpoint_key(d.serving_endpoint),
                                  _descriptor_models(d))
                ]  # fmt: skip
            return m
        if kind == "readiness":
            m.entries = [e for e in m.entries if self._topology_visible(rights, e)]
            return m
        visible = self.visible_pools(rights, catalog)
        m.pools = [p for p in m.pools if _pool_bytes(p.producer) in visible]
        if kind == "serving_load":
            entries = _topology_entries(topology)
            m.models = [x for x in m.models if self._model_visible(rights, x, visible, entries)]
        return m

    def _topology_visible(self, rights: Rights, entry: pb.TopologyEntry) -> bool:
        """A topology's state sums all its members, so it is shown only to a client that may
        see every member."""
        model = (entry.canonical_model_id,)
        if not entry.members:
            return self._sees(rights, entry.namespace, None, model)
        return all(
            self._sees(rights, *_endpoint_key(member.endpoint), model) for member in entry.members
        )

    def _model_visible(
        self,
        rights: Rights,
        entry: pb.ModelServingLoad,
        visible: frozenset[bytes],
        topology: Mapping[tuple[str, str], pb.TopologyEntry],
    ) -> bool:
        """A model's load sums the frontends of every configured pool of the model, published
        or withdrawn, while ``serving_pools`` lists only the published ones: it is shown to a
        client that sees every serving pool and, beyond them, either the model as a whole (its
        namespace or its canonical id) or every member of the model's readiness topology (which
        lists withdrawn pools too)."""
        pools = entry.deployment.serving_pools if entry.deployment is not None else []
        if not all(bytes(p) in visible for p in pools):
            return False
        model = entry.canonical_model_id
        if self._sees(rights, entry.namespace, None, (model,)):
            return True
        members = topology.get((entry.namespace, model))
        return members is not None and self._topology_visible(rights, members)


def authorization_of(rules: Sequence[AuthorizationRule] | None) -> Authorization | None:
    """The service's rule set for a configuration's rules (None: no ``[[authorization]]``)."""
    return None if rules is None else Authorization(rules)


def _topology_entries(
    topology: tuple[int, Any] | None,
) -> dict[tuple[str, str], pb.TopologyEntry]:
    """The readiness plane's topology entries by (namespace, canonical model)."""
    if topology is None:
        return {}
    entries = _parse("readiness", topology[1]).entries
    return {(e.namespace, e.canonical_model_id): e for e in entries}


def _parse(kind: str, message: Any) -> Any:
    """A private copy of ``message`` to filter (a plane may hold bytes or a message)."""
    data = message if isinstance(message, bytes) else bytes(message)
    return _TYPES[kind].parse(data)
