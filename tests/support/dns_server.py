"""A real DNS server on loopback UDP for the membership tests (answers from a mutable table).

Built on dnspython's wire format; it answers A, AAAA and SRV queries for the names in
``records`` authoritatively, NXDOMAIN for others, and can be told to stop answering (a DNS
outage: the client times out) or to answer SERVFAIL.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset


@dataclass
class DnsServer:
    #: (name, "A" | "AAAA" | "SRV") → values: addresses, or "priority weight port target" for SRV
    records: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    mode: str = "answer"  # answer | silent | servfail
    queries: int = 0
    port: int = 0
    _transport: asyncio.DatagramTransport | None = None

    async def start(self) -> str:
        loop = asyncio.get_running_loop()
        transport, _proto = await loop.create_datagram_endpoint(
            lambda: _Protocol(self), local_addr=("127.0.0.1", 0)
        )
        self._transport = transport  # type: ignore[assignment]
        self.port = int(transport.get_extra_info("sockname")[1])
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def reply(self, data: bytes) -> bytes | None:
        self.queries += 1
        query = dns.message.from_wire(data)
        if self.mode == "silent":
            return None
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        if self.mode == "servfail":
            response.set_rcode(dns.rcode.SERVFAIL)
            return response.to_wire()
        q = query.question[0]
        name = q.name.to_text(omit_final_dot=True)
        kind = dns.rdatatype.to_text(q.rdtype)
        known = {n for n, _k in self.records}
        if name not in known:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response.to_wire()
        values = self.records.get((name, kind), [])
        if values:
            response.answer.append(
                dns.rrset.from_text_list(q.name, 5, dns.rdataclass.IN, q.rdtype, values)
            )
        return response.to_wire()


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, server: DnsServer) -> None:
        self.server = server
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        out = self.server.reply(data)
        if out is not None and self.transport is not None:
            self.transport.sendto(out, addr)
