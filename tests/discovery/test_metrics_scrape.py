"""/metrics scraping against the simulator's page and a chunked-encoding server."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kvrelay.discovery.metrics_scrape import (
    MetricsScrapeError,
    fetch_metrics_text,
    parse_kv_usage,
    scrape_kv_usage,
)
from kvrelay.sim import SimConfig, SimEngine


async def test_scrape_matches_engine_usage() -> None:
    eng = SimEngine(SimConfig(dp_size=3, capacity_blocks=64, served_model_name="m"))
    await eng.start()
    try:
        await eng.step(5)
        usage = await scrape_kv_usage("127.0.0.1", eng.metrics_port or 0)
        assert usage == {str(r): eng.kv_usage(r) for r in range(3)}
        assert any(v > 0 for v in usage.values())
        assert await scrape_kv_usage("127.0.0.1", eng.metrics_port or 0, model_name="other") == {}
        with pytest.raises(MetricsScrapeError):
            await fetch_metrics_text("127.0.0.1", eng.metrics_port or 0, path="/missing")
    finally:
        await eng.stop()


async def test_chunked_response_and_legacy_name() -> None:
    text = (
        b"# TYPE vllm:gpu_cache_usage_perc gauge\n"
        b'vllm:gpu_cache_usage_perc{engine="0",model_name="x"} 0.5\n'
    )
    half = len(text) // 2
    body = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, text[:half], len(text) - half, text[half:])

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
        await w.drain()
        w.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        usage = await scrape_kv_usage("127.0.0.1", srv.sockets[0].getsockname()[1])
        assert usage == {"0": 0.5}
    finally:
        srv.close()
        await srv.wait_closed()


async def test_errors_are_typed() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(MetricsScrapeError):
        await fetch_metrics_text("127.0.0.1", port, timeout=0.5)
    with pytest.raises(MetricsScrapeError):
        parse_kv_usage('vllm:kv_cache_usage_perc{engine="0" 1\n')
