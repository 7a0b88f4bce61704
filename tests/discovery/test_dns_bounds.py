"""DNS answers the relay does not take: more engines than ``MAX_ENGINES`` behind one name (each
would get a watcher, a scraper and subscribers) is a ``DnsError`` (the engines known are kept),
for A records and for SRV targets alike, and an answer however large is parsed off the event
loop. A real DNS server on loopback."""

from __future__ import annotations

import asyncio
import time

import dns.message
import dns.rdatatype
import dns.rrset
import pytest

from kvrelay.discovery import dns as kdns
from tests.support.dns_server import DnsServer

NAME = "engines.test"


@pytest.mark.parametrize("srv", [False, True])
async def test_a_name_standing_for_too_many_engines_is_refused(
    srv: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kdns, "MAX_ENGINES", 3)  # (a UDP answer of 1,025 records truncates)
    ips = [f"127.0.1.{i}" for i in range(1, 5)]
    records: dict[tuple[str, str], list[str]] = {}
    if srv:
        records[(NAME, "SRV")] = [f"0 0 {9000 + i} t{i}.{NAME}." for i in range(4)]
        records |= {(f"t{i}.{NAME}", "A"): [ip] for i, ip in enumerate(ips)}
    else:
        records[(NAME, "A")] = ips
    server = DnsServer(records=records)
    address = await server.start()
    try:
        resolver = kdns.make_resolver(address, 2.0)
        with pytest.raises(kdns.DnsError, match="more than 3"):
            await kdns.resolve_engines(resolver, NAME, srv=srv)
        if srv:  # three targets are taken, resolved together
            records[(NAME, "SRV")] = records[(NAME, "SRV")][:3]
            got = await kdns.resolve_engines(resolver, NAME, srv=True)
            assert got == {(ip, 9000 + i) for i, ip in enumerate(ips[:3])}
    finally:
        server.close()


class _Precomputed(DnsServer):
    """Answers every A (AAAA) query for ``NAME`` with 4,000 (2,000) records, its wire bytes
    built once (the server costs this process nothing per query but a copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.wire: dict[int, bytes] = {}
        for rdtype, values in (
            (dns.rdatatype.A, [f"10.0.{i // 256}.{i % 256}" for i in range(4000)]),
            (dns.rdatatype.AAAA, [f"fd00::{i:x}" for i in range(2000)]),
        ):
            query = dns.message.make_query(NAME + ".", rdtype)
            response = dns.message.make_response(query)
            response.answer.append(dns.rrset.from_text_list(NAME + ".", 5, "IN", rdtype, values))
            self.wire[rdtype] = response.to_wire(max_size=65535)

    def reply(self, data: bytes) -> bytes | None:
        self.queries += 1
        rdtype = int.from_bytes(data[-4:-2], "big")  # the question's type (no EDNS record)
        return data[:2] + self.wire[rdtype][2:]


async def test_a_huge_answer_is_taken_apart_off_the_event_loop() -> None:
    """An answer of 4,000 A records took dnspython 112 ms to parse, on the loop that asked: an
    SRV name whose every target answered that held the relay's loop for the whole pass. The pass
    runs on a loop of its own in a thread; this thread's CPU stays a small part of the parse,
    and the answer is still refused (more than ``MAX_ENGINES``)."""
    server = _Precomputed()
    address = await server.start()
    try:
        resolver = kdns.make_resolver(address, 5.0)
        cpu = time.thread_time()
        t0 = time.perf_counter()
        with pytest.raises(kdns.DnsError, match="more than"):
            await kdns.resolve_engines(resolver, NAME)
        took = time.perf_counter() - t0
        on_loop = time.thread_time() - cpu
        assert server.queries == 2
        assert on_loop < 0.05, (on_loop, took)  # was the whole parse, over 0.2 s
    finally:
        server.close()


async def test_a_cancelled_pass_does_not_wait_for_the_server() -> None:
    """The caller's cancellation ends its wait at once; the thread ends by its own deadline."""
    server = DnsServer(records={(NAME, "A"): ["127.0.0.1"]}, mode="silent")
    address = await server.start()
    try:
        task = asyncio.ensure_future(kdns.resolve_engines(kdns.make_resolver(address, 0.5), NAME))
        await asyncio.sleep(0.1)
        task.cancel()
        t0 = time.perf_counter()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.perf_counter() - t0 < 0.2
        with pytest.raises(kdns.DnsError):  # silent: the resolver's timeout, a typed error
            await kdns.resolve_engines(kdns.make_resolver(address, 0.3), NAME)
    finally:
        server.close()
