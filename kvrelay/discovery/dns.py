"""Engines from DNS: a name (a Kubernetes headless Service, say) whose records are the engines.

Every A/AAAA record is one engine at that address on the entry's ports; an SRV name gives one
engine per target and port (targets resolved to their A/AAAA records). The answer is a set of
``(address, port | None)``: an empty set means the name exists but names no engine now
(NXDOMAIN / no records: every pod gone). Anything else — a timeout, SERVFAIL, no nameserver — is
a ``DnsError``: the caller keeps the engines it had, because a DNS outage is not a fleet change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # dnspython is imported when a resolver is made: ~20 ms of every start else
    import dns.asyncresolver

Endpoint = tuple[str, "int | None"]


class DnsError(Exception):
    """The name could not be resolved now (transient): keep the previous answer."""


def make_resolver(server: str | None, timeout: float) -> dns.asyncresolver.Resolver:
    """The system resolver, or one asking only ``server`` (``host:port``; tests, custom DNS)."""
    import dns.asyncresolver

    if server is None:
        resolver = dns.asyncresolver.Resolver()
    else:
        host, _, port = server.rpartition(":")
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [host.strip("[]")]
        resolver.port = int(port)
    resolver.lifetime = timeout
    resolver.timeout = timeout
    return resolver


async def _addresses(resolver: dns.asyncresolver.Resolver, name: str) -> set[str]:
    import dns.exception
    import dns.rdatatype
    import dns.resolver

    out: set[str] = set()
    missing = 0
    for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
        try:
            answer = await resolver.resolve(name, rdtype, search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            missing += 1
            continue
        except (dns.exception.DNSException, OSError) as exc:
            raise DnsError(f"{name} {dns.rdatatype.to_text(rdtype)}: {exc}") from exc
        out |= {r.to_text() for r in answer}
    return out


async def resolve_engines(
    resolver: dns.asyncresolver.Resolver, name: str, *, srv: bool = False
) -> set[Endpoint]:
    """The engines ``name`` stands for now: ``{(address, None)}`` for A/AAAA names (the entry's
    ports apply), ``{(address, port)}`` for SRV names. Raises ``DnsError`` when unresolvable."""
    import dns.exception
    import dns.rdatatype
    import dns.resolver

    if not srv:
        return {(a, None) for a in await _addresses(resolver, name)}
    try:
        answer = await resolver.resolve(name, dns.rdatatype.SRV, search=False)
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return set()
    except (dns.exception.DNSException, OSError) as exc:
        raise DnsError(f"{name} SRV: {exc}") from exc
    out: set[Endpoint] = set()
    for rr in answer:
        target = rr.target.to_text(omit_final_dot=True)
        for address in await _addresses(resolver, target):
            out.add((address, int(rr.port)))
    return out
