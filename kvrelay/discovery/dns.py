"""Engines from DNS: a name (a Kubernetes headless Service, say) whose records are the engines.

Every A/AAAA record is one engine at that address on the entry's ports; an SRV name gives one
engine per target and port (targets resolved to their A/AAAA records). The answer is a set of
``(address, port | None)``: an empty set means the name exists but names no engine now
(NXDOMAIN / no records: every pod gone). Anything else — a timeout, SERVFAIL, no nameserver — is
a ``DnsError``: the caller keeps the engines it had, because a DNS outage is not a fleet change.
So is an answer of more than ``MAX_ENGINES`` engines (each would get its own watcher, scraper and
subscribers), and an SRV pass that takes longer than ``SRV_PASS_FACTOR`` resolver timeouts (its
targets are resolved ``SRV_CONCURRENCY`` at a time, and a reload waits for the pass).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # dnspython is imported when a resolver is made: ~20 ms of every start else
    import dns.asyncresolver

Endpoint = tuple[str, "int | None"]

#: The most engines one DNS name may stand for.
MAX_ENGINES = 1024
#: SRV targets resolved at once, and the whole pass's bound in resolver timeouts.
SRV_CONCURRENCY = 16
SRV_PASS_FACTOR = 3


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
        return _bounded(name, {(a, None) for a in await _addresses(resolver, name)})
    try:
        answer = await resolver.resolve(name, dns.rdatatype.SRV, search=False)
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return set()
    except (dns.exception.DNSException, OSError) as exc:
        raise DnsError(f"{name} SRV: {exc}") from exc
    records = [(rr.target.to_text(omit_final_dot=True), int(rr.port)) for rr in answer]
    _bounded(name, set(records))
    targets = sorted({t for t, _ in records})
    gate = asyncio.Semaphore(SRV_CONCURRENCY)

    async def one(target: str) -> set[str]:
        async with gate:
            return await _addresses(resolver, target)

    try:
        async with asyncio.timeout(SRV_PASS_FACTOR * float(resolver.lifetime)):
            found = await asyncio.gather(*(one(t) for t in targets))
    except TimeoutError:
        raise DnsError(f"{name} SRV: {len(targets)} targets not resolved in time") from None
    addresses = dict(zip(targets, found, strict=True))
    return _bounded(name, {(a, port) for t, port in records for a in addresses[t]})


def _bounded(name: str, engines: set[Endpoint]) -> set[Endpoint]:
    if len(engines) > MAX_ENGINES:
        raise DnsError(f"{name}: {len(engines)} engines, more than {MAX_ENGINES}")
    return engines
