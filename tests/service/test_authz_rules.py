"""``service/authz.py`` rules on their own: identity from a certificate dict, glob matching,
union and deny-by-default, and the bounded per-rights plane cache."""

from __future__ import annotations

from kvrelay._proto.dynamo.kvrelay import v1 as pb
from kvrelay.service import authz
from kvrelay.service.authz import Authorization, AuthorizationRule, ClientIdentity

# the shape ssl.SSLSocket.getpeercert() returns for a verified client certificate
CERT = {
    "subject": ((("organizationName", "acme"),), (("commonName", "router-a"),)),
    "subjectAltName": (("URI", "spiffe://cluster.local/ns/team-a/sa/router"),
                       ("DNS", "router.team-a.svc"), ("IP Address", "10.0.0.1")),
}  # fmt: skip


def test_identity_takes_uri_and_dns_sans_and_the_cn() -> None:
    who = ClientIdentity.from_cert(CERT)
    assert who.uris == ("spiffe://cluster.local/ns/team-a/sa/router",)
    assert who.dns == ("router.team-a.svc",)
    assert who.cns == ("router-a",)
    assert ClientIdentity.from_cert(None) == ClientIdentity() == ClientIdentity.from_cert({})


def test_rules_match_exactly_or_by_glob_case_sensitively() -> None:
    who = ClientIdentity.from_cert(CERT)
    assert AuthorizationRule(uri=("spiffe://cluster.local/ns/team-a/*",)).names(who)
    assert AuthorizationRule(uri=("spiffe://cluster.local/*/router",)).names(who)  # * spans /
    assert AuthorizationRule(dns=("router.team-a.svc",)).names(who)
    assert AuthorizationRule(cn=("router-?",)).names(who)
    assert not AuthorizationRule(cn=("ROUTER-A",)).names(who)
    assert not AuthorizationRule(dns=("spiffe://cluster.local/ns/team-a/*",)).names(who)  # typed
    assert not AuthorizationRule(cn=("acme",)).names(who)  # only the CN, not other RDNs


def test_union_of_rules_and_nothing_for_a_client_no_rule_names() -> None:
    auth = Authorization((
        AuthorizationRule(cn=("router-a",), namespaces=("team-a",)),
        AuthorizationRule(uri=("spiffe://*",), models=("llama-*",)),
        AuthorizationRule(cn=("other",), namespaces=("*",)),
    ))  # fmt: skip
    rights = auth.rights(ClientIdentity.from_cert(CERT))
    assert rights == {0, 1}
    assert auth._sees(rights, "team-a", "team-a/x/y", ())
    assert auth._sees(rights, "team-b", "team-b/x/y", ("llama-3",))
    assert not auth._sees(rights, "team-b", "team-b/x/y", ("mistral",))
    assert auth.rights(ClientIdentity()) == frozenset()
    assert not auth._sees(frozenset(), "team-a", None, ())


def test_the_plane_cache_is_bounded() -> None:
    n = authz.PLANE_CACHE_ENTRIES + 10  # more distinct rights than the cache holds
    auth = Authorization([AuthorizationRule(cn=(f"c{i}",), namespaces=("ns",)) for i in range(n)])
    pools = [pb.KvPoolDescriptor(serving_endpoint=pb.DynamoEndpointId("ns", "c", "e"))]
    msg = pb.KvPoolCatalogUpdate(revision=1, snapshot=pb.KvPoolCatalogSnapshot(pools=pools))
    for i in range(n):
        out = pb.KvPoolCatalogUpdate.parse(auth.filtered("catalog", 1, msg, frozenset({i}), None))
        assert out.snapshot is not None and len(out.snapshot.pools) == 1
    assert len(auth._planes) == authz.PLANE_CACHE_ENTRIES and auth.encodes == n
    auth.filtered("catalog", 1, msg, frozenset({0}), None)  # the oldest was dropped: re-encoded
    assert auth.encodes == n + 1
