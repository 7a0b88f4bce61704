"""Engines from DNS: a name (a Kubernetes headless Service, say) whose records are the engines.

Every A/AAAA record is one engine at that address on the entry's ports; an SRV name gives one
engine per target and port (targets resolved to their A/AAAA records). The answer is a set of
``(address, port | None)``: an empty set means the name exists but names no engine now
(NXDOMAIN / no records: every pod gone). Anything else — a timeout, SERVFAIL, no nameserver — is
a ``DnsError``: the caller keeps the engines it had, because a DNS outage is not a fleet change.
So is an answer of more than ``MAX_ENGINES`` engines (each would get its own watcher, scraper and
subscribers), and an SRV pass that takes longer than ``SRV_PASS_FACTOR`` resolver timeouts (its
targets are resolved ``SRV_CONCURRENCY`` at a time, and a reload waits for the pass).

A pass runs on an event loop of its own in a thread of its own (:func:`resolve_engines`):
dnspython takes each answer apart on the loop that asked, and an answer of 4,000 A records took
112 ms to parse, so an SRV name whose targets each answered that held the relay's loop for most
of the pass's deadline. The thread ends within that deadline (``PASS_FACTOR`` resolver
timeouts) whatever the caller does.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # dnspython is imported when a resolver is made: ~20 ms of every start else
    import dns.asyncresolver

Endpoint = tuple[str, "int | None"]

#: The most engines one DNS name may stand for.
MAX_ENGINES = 1024
#: SRV targets resolved at once, and the whole pass's bound in resolver timeouts.
SRV_CONCURRENCY = 16
SRV_PASS_FACTOR = 3
#: The bound of a whole pass in resolver timeouts: the SRV query, its targets' pass, and slack.
PASS_FACTOR = SRV_PASS_FACTOR + 2


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
    ports apply), ``{(address, port)}`` for SRV names. Raises ``DnsError`` when unresolvable.

    Resolved on a private event loop in a daemon thread, so that parsing what the server sent
    (whatever its size) never runs on the caller's loop; a cancelled caller stops waiting at
    once, and the thread ends by the pass's own deadline."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[set[Endpoint]] = loop.create_future()
    deadline = PASS_FACTOR * float(resolver.lifetime)

    async def bounded_pass() -> set[Endpoint]:
        try:
            async with asyncio.timeout(deadline):
                return await _resolve(resolver, name, srv)
        except TimeoutError:
            raise DnsError(f"{name}: not resolved in {deadline:g} s") from None

    def run() -> None:
        try:
            outcome: set[Endpoint] | BaseException = asyncio.run(bounded_pass())
        except BaseException as exc:  # handed to the caller, whatever it is
            outcome = exc
        with contextlib.suppress(RuntimeError):  # the caller's loop has closed: nobody waits
            loop.call_soon_threadsafe(_settle, done, outcome)

    threading.Thread(target=run, name="kvrelay-dns", daemon=True).start()
    return await done


def _settle(done: asyncio.Future[set[Endpoint]], outcome: set[Endpoint] | BaseException) -> None:
    if done.done():  # the caller was cancelled
        return
    if isinstance(outcome, BaseException):
        done.set_exception(outcome)
    else:
        done.set_result(outcome)


async def _resolve(
    resolver: dns.asyncresolver.Resolver, name: str, srv: bool
) -> set[Endpoint]:
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
