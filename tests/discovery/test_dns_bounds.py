"""DNS answers the relay does not take: more engines than ``MAX_ENGINES`` behind one name (each
would get a watcher, a scraper and subscribers) is a ``DnsError`` (the engines known are kept),
for A records and for SRV targets alike. A real DNS server on loopback."""

from __future__ import annotations

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
