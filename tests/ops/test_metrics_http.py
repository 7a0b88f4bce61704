"""The metrics/health endpoint under hostile connections: real TCP clients on loopback.

Attackers connect from other loopback addresses (127.0.0.2 and up, all on Linux's ``lo``), the
probe and the scraper from 127.0.0.1, as kubelet and Prometheus would from their own hosts.
Oracles: the HTTP status a plain client reads, the wall time it took, and prometheus_client's
parser over what the scraper read.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import pytest

from kvrelay.ops.metrics_http import HttpLimits, MetricsServer
from tests.support.scrape import http_request

HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
PROBE_DEADLINE_S = 1.0  # kubelet's default probe timeout is 1 s


async def _eventually(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def _endpoint(
    limits: HttpLimits | None = None, render: Callable[[], bytes] | None = None
) -> AsyncIterator[tuple[MetricsServer, int]]:
    server = MetricsServer(render or (lambda: b"kvrelay_up 1\n"), limits=limits)
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await asyncio.wait_for(server.close(), 10)


async def _idle(port: int, source: str) -> asyncio.StreamWriter:
    _r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    return w


async def _slowloris(port: int, source: str, started: asyncio.Event) -> None:
    """Sends a request head one header line at a time, forever (until the server hangs up)."""
    r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    try:
        w.write(b"GET /metrics HTTP/1.1\r\n")
        started.set()
        while not r.at_eof():
            w.write(b"X-Slow: 1\r\n")
            await w.drain()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(r.read(1), 0.2)
    except ConnectionError:
        pass
    finally:
        w.close()


async def _probe_and_scrape(port: int) -> None:
    t0 = time.monotonic()
    reply = await http_request(port, HEALTHZ)
    took = time.monotonic() - t0
    assert reply.status == 200 and reply.body == b"ok\n"
    assert took < PROBE_DEADLINE_S, f"/healthz took {took:.3f} s"
    scraped = await http_request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert scraped.status == 200 and scraped.body == b"kvrelay_up 1\n"


async def _attack(port: int, sources: list[str], idle: int, slow: int) -> tuple[list[
        asyncio.StreamWriter], list[asyncio.Task[None]]]:
    writers = [await _idle(port, sources[i % len(sources)]) for i in range(idle)]
    tasks = []
    for i in range(slow):
        started = asyncio.Event()
        tasks.append(asyncio.create_task(_slowloris(port, sources[i % len(sources)], started)))
        await asyncio.wait_for(started.wait(), 10)
    return writers, tasks


async def _stop(writers: list[asyncio.StreamWriter], tasks: list[asyncio.Task[None]]) -> None:
    for w in writers:
        w.close()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize("source", ["127.0.0.2", "127.0.0.1"])
async def test_healthz_answers_while_one_peer_holds_64_idle_and_64_slowloris_connections(
    source: str,
) -> None:
    """Past 8 connections an address's oldest unread head is evicted. From the probe's own
    address too (a pod on the node's network, where the kubelet probes from): there the per-peer
    cap answered the probe 503 (19 of 20 probes while one peer kept 8 heads open)."""
    async with _endpoint() as (server, port):
        writers, tasks = await _attack(port, [source], 64, 64)
        try:
            per_peer = server.limits.max_per_peer
            await _eventually(lambda: server.counters.rejections["evicted"] >= 128 - per_peer)
            for _ in range(5):
                await _probe_and_scrape(port)
            assert server.counters.rejections["per_peer"] == 0
        finally:
            await _stop(writers, tasks)


async def test_an_evicted_connection_is_answered_503_not_dropped() -> None:
    """The connection evicted for a new one may hold its whole request already (its task not
    yet run: connections faster than the loop's turns); it was closed with no status, which a
    probe cannot tell from a dead relay. It is answered 503 "too many connections"."""
    async with _endpoint(HttpLimits(max_per_peer=2)) as (server, port):
        first = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.3", 0))
        others = [await _idle(port, "127.0.0.3") for _ in range(2)]
        try:
            await _eventually(lambda: server.counters.rejections["evicted"] == 1)
            assert (await asyncio.wait_for(first[0].readline(), 5)).startswith(b"HTTP/1.1 503")
            assert b"too many connections" in await asyncio.wait_for(first[0].read(), 5)
        finally:
            first[1].close()
            for w in others:
                w.close()


async def test_an_address_whose_connections_all_passed_their_head_is_refused() -> None:
    """Nothing of that address to evict (each is being answered): the new one gets 503."""
    body = b"x" * (48 << 20)  # more than loopback socket buffers hold: responses stay in flight
    limits = HttpLimits(max_per_peer=2, max_scrapes=8)
    async with _endpoint(limits, render=lambda: body) as (server, port):
        held = []
        for _ in range(2):
            r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
            w.write(b"GET /metrics HTTP/1.1\r\n\r\n")
            held.append(w)
        try:
            await _eventually(lambda: sum(not c.reading for c in server._conns.values()) == 2)
            r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
            assert (await asyncio.wait_for(r.readline(), 5)).startswith(b"HTTP/1.1 503")
            w.close()
            assert server.counters.rejections["per_peer"] == 1
            assert server.counters.rejections["evicted"] == 0
        finally:
            for w in held:
                w.close()


async def test_healthz_answers_while_64_peers_fill_the_connection_limit() -> None:
    """Spread over 64 addresses no per-peer cap applies; the oldest unread heads are evicted."""
    sources = [f"127.0.0.{i}" for i in range(2, 66)]
    async with _endpoint() as (server, port):
        writers, tasks = await _attack(port, sources, 64, 64)
        try:
            cap = server.limits.max_connections
            await _eventually(lambda: server.counters.rejections["evicted"] >= 128 - cap)
            await _probe_and_scrape(port)
            assert server.counters.rejections["per_peer"] == 0
        finally:
            await _stop(writers, tasks)


async def test_slowloris_and_idle_clients_are_cut_off_by_the_head_deadline() -> None:
    async with _endpoint(HttpLimits(head_timeout_s=0.5)) as (server, port):
        writers, tasks = await _attack(port, ["127.0.0.2"], 1, 1)
        try:
            # the slowloris client sends a line every 0.2 s and still loses its connection
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
            await _eventually(lambda: server.counters.rejections["head_timeout"] == 2)
        finally:
            await _stop(writers, tasks)


async def test_a_scraper_that_never_reads_is_cut_off_by_the_drain_deadline() -> None:
    body = b"x" * (48 << 20)  # more than loopback socket buffers hold
    async with _endpoint(HttpLimits(drain_timeout_s=0.5), render=lambda: body) as (server, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        try:
            w.write(b"GET /metrics HTTP/1.1\r\n\r\n")
            await _eventually(lambda: server.counters.rejections["drain_timeout"] == 1)
            await _eventually(lambda: not server._conns)
            assert (await http_request(port, HEALTHZ)).status == 200
            received = 0
            with contextlib.suppress(ConnectionError):
                while chunk := await asyncio.wait_for(r.read(1 << 20), 10):
                    received += len(chunk)
            assert received < len(body)  # the server aborted the response, it did not wait
        finally:
            w.close()


async def test_too_many_concurrent_scrapes_answer_503_but_healthz_does_not() -> None:
    body = b"x" * (48 << 20)
    async with _endpoint(HttpLimits(max_scrapes=1), render=lambda: body) as (server, port):
        _r, w = await asyncio.open_connection("127.0.0.1", port)
        try:
            w.write(b"GET /metrics HTTP/1.1\r\n\r\n")
            await _eventually(lambda: server._scrapes == 1)
            busy = await http_request(port, b"GET /metrics HTTP/1.1\r\n\r\n")
            assert busy.status == 503 and server.counters.rejections["busy"] == 1
            assert (await http_request(port, HEALTHZ)).status == 200
        finally:
            w.close()


async def test_a_scrape_is_collected_on_the_loop_and_written_out_off_it() -> None:
    """Collectors read the relay's live state, so they run on the event loop; the text (most of a
    scrape at many pools) is written in the executor. The body is what ``generate_latest`` of the
    same registry writes."""
    import threading

    from prometheus_client import CollectorRegistry, Counter, generate_latest
    from prometheus_client.core import GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector

    from kvrelay.ops.metrics_http import Collected

    loop_thread = threading.get_ident()
    seen: list[int] = []

    class Live(Collector):
        def collect(self) -> list[Metric]:
            seen.append(threading.get_ident())
            g = GaugeMetricFamily("kvrelay_test_pools", "pools", labels=["pool"])
            for i in range(200):
                g.add_metric([f"ns/c{i}/generate"], i)
            return [g]

    registry = CollectorRegistry()
    registry.register(Live())
    Counter("kvrelay_test_scrapes", "scrapes", registry=registry).inc(3)
    written: list[int] = []

    class Tracked(Collected):
        def text(self, openmetrics_format: bool = False) -> bytes:
            written.append(threading.get_ident())
            return super().text(openmetrics_format)

    async with _endpoint(render=lambda: Tracked(registry)) as (_server, port):
        reply = await http_request(port, b"GET /metrics HTTP/1.1\r\n\r\n")
    assert reply.status == 200
    assert reply.body == generate_latest(registry)
    assert seen[0] == loop_thread and written and written[0] != loop_thread


async def test_a_pinned_scrape_builds_its_families_off_the_loop_from_its_own_snapshot() -> None:
    """With ``pins``, nothing is collected when the scrape is taken: its text, families included,
    is written in the executor, where a collector sees the snapshot pinned for its owner (and only
    there: not on the loop, not after the text, not another scrape's)."""
    import threading

    from prometheus_client import CollectorRegistry
    from prometheus_client.core import GaugeMetricFamily, Metric
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.registry import Collector

    from kvrelay.ops.metrics_http import Collected, pinned

    owner = object()
    live = {"value": 1.0}
    seen: list[tuple[int, object]] = []

    class Snapshotting(Collector):
        def collect(self) -> list[Metric]:
            snap = pinned(owner)
            seen.append((threading.get_ident(), snap))
            v = snap if isinstance(snap, float) else live["value"]
            return [GaugeMetricFamily("kvrelay_test_value", "value", value=v)]

    registry = CollectorRegistry()
    registry.register(Snapshotting())
    loop = asyncio.get_running_loop()
    first, second = Collected(registry, pins={owner: 10.0}), Collected(registry, pins={owner: 20.0})
    assert seen == [] and first.families == []  # nothing read when the scrape was taken
    live["value"] = 99.0
    texts = await asyncio.gather(
        loop.run_in_executor(None, first.text), loop.run_in_executor(None, second.text)
    )

    def gauge(body: bytes) -> float:
        fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
        return fams["kvrelay_test_value"].samples[0].value

    assert [gauge(t) for t in texts] == [10.0, 20.0]
    loop_thread = threading.get_ident()
    assert len(seen) == 2 and all(t != loop_thread for t, _ in seen)
    assert pinned(owner) is None  # on the loop: live state
    assert gauge(Collected(registry).text()) == 99.0
    assert await loop.run_in_executor(None, pinned, owner) is None  # the pin ends with the text
