"""Helpers for ops tests: the shared in-process fleet harness, and a raw HTTP scraper."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# one in-process fleet harness for every end-to-end style test (tests/ is on sys.path)
from tests.support.fleet import eventually, fleet_and_relay, in_sync, wait_subscribed
from tests.support.timing import scaled

POOL = "ns/backend/generate"

__all__ = ["POOL", "eventually", "fleet_and_relay", "in_sync", "wait_subscribed"]


@dataclass
class HttpReply:
    status: int
    headers: dict[str, str]
    body: bytes


async def http_request(port: int, raw: bytes) -> HttpReply:
    """Send ``raw`` and read the whole reply (the server closes after one response)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(raw)
        await w.drain()
        data = await asyncio.wait_for(r.read(), scaled(10))
    finally:
        w.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
    return HttpReply(status, headers, body)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(port: int) -> Samples:
    reply = await http_request(
        port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n"
    )
    assert reply.status == 200, reply
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert int(reply.headers["content-length"]) == len(reply.body)
    out: Samples = {}
    for fam in text_string_to_metric_families(reply.body.decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    if key not in samples:
        raise KeyError(f"no sample {name}{labels}")
    return samples[key]


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of every sample of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)
