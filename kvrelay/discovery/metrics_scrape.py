"""Scrape an engine's Prometheus ``/metrics`` page (asyncio streams, no HTTP client dependency)
and extract ``vllm:kv_cache_usage_perc`` per engine core (DP rank)."""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client.parser import text_string_to_metric_families

KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"  # name before vLLM renamed it
MAX_BODY = 8 * 1024 * 1024


class MetricsScrapeError(Exception):
    """Connection failure, timeout, non-200 status, oversized or unparsable page."""


def _dechunk(body: bytes) -> bytes:
    out, pos = bytearray(), 0
    while True:
        eol = body.find(b"\r\n", pos)
        if eol < 0:
            raise MetricsScrapeError("truncated chunked body")
        size = int(body[pos:eol].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += body[eol + 2 : eol + 2 + size]
        pos = eol + 2 + size + 2


async def fetch_metrics_text(
    host: str, port: int, path: str = "/metrics", timeout: float = 2.0, max_bytes: int = MAX_BODY
) -> str:
    """GET ``path`` over HTTP/1.1 with ``Connection: close``; returns the decoded body."""

    async def go() -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: text/plain\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            await writer.drain()
            data = await reader.read(max_bytes + 65536)
            buf = bytearray(data)
            while data and len(buf) <= max_bytes + 65536:
                data = await reader.read(65536)
                buf += data
            return bytes(buf)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    try:
        raw = await asyncio.wait_for(go(), timeout=timeout)
    except (TimeoutError, OSError) as exc:
        raise MetricsScrapeError(f"{host}:{port}{path}: {exc!r}") from exc
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        raise MetricsScrapeError("malformed HTTP response")
    lines = head.split(b"\r\n")
    parts = lines[0].split()
    if len(parts) < 2 or parts[1] != b"200":
        raise MetricsScrapeError(f"HTTP status {lines[0]!r}")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:])}
    if len(body) > max_bytes:
        raise MetricsScrapeError(f"body larger than {max_bytes} bytes")
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        body = _dechunk(body)
    elif b"content-length" in headers:
        body = body[: int(headers[b"content-length"])]
    return body.decode("utf-8", errors="replace")


def parse_kv_usage(text: str, model_name: str | None = None) -> dict[str, float]:
    """``{engine_label: usage_fraction}`` from Prometheus text; optional model filter."""
    found: dict[str, float] = {}
    legacy: dict[str, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            if fam.name not in (KV_USAGE, KV_USAGE_LEGACY):
                continue
            dest = found if fam.name == KV_USAGE else legacy
            for s in fam.samples:
                if model_name is not None and s.labels.get("model_name") != model_name:
                    continue
                dest[s.labels.get("engine", "0")] = float(s.value)
    except ValueError as exc:
        raise MetricsScrapeError(f"unparsable metrics text: {exc}") from exc
    return found or legacy


async def scrape_kv_usage(
    host: str, port: int, model_name: str | None = None, timeout: float = 2.0
) -> dict[str, float]:
    return parse_kv_usage(await fetch_metrics_text(host, port, timeout=timeout), model_name)
