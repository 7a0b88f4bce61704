"""Scrape an engine's Prometheus ``/metrics`` page (asyncio streams, no HTTP client dependency)
and extract ``vllm:kv_cache_usage_perc`` per engine core (DP rank), with the serving figures the
serving-load plane uses (running and waiting requests, token counters, finished requests by
reason), and when the page's process started (``process_start_time_seconds``).

Any malformed page — bad status line, chunk sizes or lengths that are not numbers, a body cut
short, unparsable metric text, non-finite or out-of-range values, a series listed twice — is a
``MetricsScrapeError``, never another exception: the load plane then reports that engine's usage
as unknown. A page cut short or doubled must not be read, as its counters would look like a
restart and be counted again. Only the lines of the samples read are parsed
(:func:`parse_engine_page`), in a worker thread. A page larger than ``MAX_BODY``, in more than
``MAX_CHUNKS`` chunks or with more than ``MAX_WANTED_LINES`` lines of the samples read is refused
as ``oversized`` before it is parsed; one with a ``Content-Encoding`` (none is asked for) as
``malformed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvrelay._aio import bounded

KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"  # name before vLLM renamed it
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PROMPT_TOKENS = "vllm:prompt_tokens_total"  # counters: sample names
GENERATION_TOKENS = "vllm:generation_tokens_total"
REQUEST_SUCCESS = "vllm:request_success_total"  # finished requests, label finished_reason
#: prometheus_client's process collector (no model label): a new value is a new process.
PROCESS_START = "process_start_time_seconds"
#: The largest count accepted: a counter at or past 2**63 is no engine's count.
MAX_COUNT = 2**63 - 1
MAX_BODY = 8 * 1024 * 1024
#: Chunks a chunked page may come in (a page of one-byte chunks cost half a second to join).
MAX_CHUNKS = 65536
#: Lines of the samples read (:data:`WANTED`) one page may hold. prometheus_client parses one in
#: about 18 µs, so an 8 MiB page made only of them (137,000 lines) cost 2.5 s of CPU per scrape.
#: A vLLM page has about 10 per DP rank among some 16 KB of lines the relay does not read, so a
#: page within ``MAX_BODY`` holds fewer than 5,300 of them. A page at this cap parses in 0.13 s.
MAX_WANTED_LINES = 8192


class MetricsScrapeError(Exception):
    """Connection failure, timeout, non-200 status, oversized or unparsable page. ``reason``:
    ``unreachable`` (no connection, or no whole answer in time), ``status`` (not 200),
    ``oversized`` (past ``MAX_BODY``, ``MAX_CHUNKS`` or ``MAX_WANTED_LINES``), else ``malformed``
    (what a page must not be)."""

    def __init__(self, message: str, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


def _dechunk(body: bytes) -> bytes:
    out, pos = bytearray(), 0
    for _ in range(MAX_CHUNKS + 1):
        eol = body.find(b"\r\n", pos)
        if eol < 0:
            raise MetricsScrapeError("truncated chunked body")
        try:
            size = int(body[pos:eol].split(b";")[0].strip(), 16)
        except ValueError:
            raise MetricsScrapeError(f"bad chunk size {body[pos:eol][:32]!r}") from None
        if size < 0:
            raise MetricsScrapeError("negative chunk size")
        if size == 0:
            return bytes(out)
        if eol + 2 + size > len(body):
            raise MetricsScrapeError("truncated chunk")
        out += body[eol + 2 : eol + 2 + size]
        pos = eol + 2 + size + 2
    raise MetricsScrapeError(f"more than {MAX_CHUNKS} chunks", "oversized")


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
        raw = await bounded(go(), timeout)
    except (TimeoutError, OSError) as exc:
        raise MetricsScrapeError(f"{host}:{port}{path}: {exc!r}", "unreachable") from exc
    return await asyncio.to_thread(_http_body, raw, max_bytes)  # (megabytes: not on the loop)


def _http_body(raw: bytes, max_bytes: int) -> str:
    """The body of one HTTP/1.1 response; ``MetricsScrapeError`` for anything malformed."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        raise MetricsScrapeError("malformed HTTP response")
    lines = head.split(b"\r\n")
    parts = lines[0].split()
    if len(parts) < 2 or parts[1] != b"200":
        raise MetricsScrapeError(f"HTTP status {lines[0][:64]!r}", "status")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:])}
    if len(body) > max_bytes:
        raise MetricsScrapeError(f"body larger than {max_bytes} bytes", "oversized")
    encoding = headers.get(b"content-encoding", b"identity").lower()
    if encoding != b"identity":  # none was asked for: its bytes would read as no samples at all
        raise MetricsScrapeError(f"Content-Encoding {encoding[:32]!r}")
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        body = _dechunk(body)
    elif b"content-length" in headers:
        try:
            length = int(headers[b"content-length"])
        except ValueError:
            raise MetricsScrapeError("bad content-length") from None
        if length < 0 or length > len(body):
            raise MetricsScrapeError("content-length does not match the body")
        body = body[:length]
    elif body and not body.endswith(b"\n"):
        # Delimited by the connection's close only: a body cut mid-line would read as a smaller
        # number (a counter dip, taken for a restart). The text format ends every line in "\n".
        raise MetricsScrapeError("body cut short (close-delimited, no final newline)")
    return body.decode("utf-8", errors="replace")


@dataclass(frozen=True, slots=True)
class RankServing:
    """One DP rank's serving counters and gauges as its page reports them (None: not on the page).

    ``finished`` is ``vllm:request_success_total`` by its ``finished_reason`` label."""

    running: int | None = None
    waiting: int | None = None
    prompt_tokens_total: int | None = None
    generation_tokens_total: int | None = None
    finished: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EnginePage:
    """What one scrape of an engine's page says: KV usage and serving figures per DP rank
    (the ``engine`` label), and the unix time its process started
    (``process_start_time_seconds``; None when the page does not say)."""

    kv_usage: dict[str, float]
    serving: dict[str, RankServing]
    started: float | None = None


_FIGURES = {
    RUNNING: "running",
    WAITING: "waiting",
    PROMPT_TOKENS: "prompt_tokens_total",
    GENERATION_TOKENS: "generation_tokens_total",
}


def _count(name: str, value: float) -> int:
    if not math.isfinite(value) or not 0 <= value <= MAX_COUNT:
        raise MetricsScrapeError(f"{name} value {value!r} is not a count")
    return int(value)


#: The sample names read: only their lines are parsed (see :func:`parse_engine_page`).
WANTED = frozenset({KV_USAGE, KV_USAGE_LEGACY, REQUEST_SUCCESS, PROCESS_START, *_FIGURES})
_WANTED_STARTS = tuple(n + end for n in sorted(WANTED) for end in ("{", " ", "\t"))


def parse_engine_page(text: str, model_name: str | None = None) -> EnginePage:
    """Parse one page (optional model filter); ``MetricsScrapeError`` for anything malformed in
    what is read.

    Only the lines of the :data:`WANTED` samples are handed to the parser (without their
    ``# TYPE`` lines: samples are read by name, and pages differ in how they type counters), at
    most :data:`MAX_WANTED_LINES` of them (more is ``oversized``, refused unparsed). A
    vLLM page is tens of KB of histograms the relay never reads: parsing all of it took ~6 ms a
    page, for every engine every ``metrics_scrape_interval_s``, on a thread that holds the GIL
    the event loop needs. A malformed line of a family the relay does not read no longer blanks
    the engine's load.

    A series read twice (same name, same labels) is an error: a page doubled or spliced has no
    one value to believe, and summing the finished counters counted requests twice."""
    found: dict[str, float] = {}
    legacy: dict[str, float] = {}
    figures: dict[str, dict[str, Any]] = {}
    started: float | None = None
    seen: set[tuple[str, frozenset[tuple[str, str]]]] = set()
    lines = [ln for ln in text.split("\n") if ln.startswith(_WANTED_STARTS)]
    if len(lines) > MAX_WANTED_LINES:
        raise MetricsScrapeError(
            f"{len(lines)} lines of the samples read (at most {MAX_WANTED_LINES})", "oversized"
        )
    wanted = "\n".join(lines)
    try:
        for fam in text_string_to_metric_families(wanted + "\n"):
            for s in fam.samples:
                name = s.name  # by sample name: pages differ in how they type counters
                value = float(s.value)
                if name == PROCESS_START:  # the process's, not a model's: never filtered
                    if started is not None:
                        raise MetricsScrapeError(f"{name} listed twice")
                    if not math.isfinite(value) or value < 0:
                        raise MetricsScrapeError(f"{name} value {value!r} is not a time")
                    started = value
                    continue
                if model_name is not None and s.labels.get("model_name") != model_name:
                    continue
                series = (name, frozenset(s.labels.items()))
                if series in seen:
                    raise MetricsScrapeError(f"{name} listed twice with the same labels")
                seen.add(series)
                rank = s.labels.get("engine", "0")
                if name in (KV_USAGE, KV_USAGE_LEGACY):
                    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
                        raise MetricsScrapeError(f"{name} value {value!r} is not a fraction")
                    (found if name == KV_USAGE else legacy)[rank] = value
                elif name in _FIGURES:
                    figures.setdefault(rank, {})[_FIGURES[name]] = _count(name, value)
                elif name == REQUEST_SUCCESS:
                    reason = s.labels.get("finished_reason", "")
                    done = figures.setdefault(rank, {}).setdefault("finished", {})
                    done[reason] = done.get(reason, 0) + _count(name, value)
    except MetricsScrapeError:
        raise
    except Exception as exc:  # the parser raises ValueError, TypeError, IndexError, …
        raise MetricsScrapeError(f"unparsable metrics text: {exc!r}") from exc
    serving = {rank: RankServing(**f) for rank, f in figures.items()}
    return EnginePage(found or legacy, serving, started)


def parse_kv_usage(text: str, model_name: str | None = None) -> dict[str, float]:
    """``{engine_label: usage_fraction}`` from Prometheus text; optional model filter."""
    return parse_engine_page(text, model_name).kv_usage


async def scrape_engine_page(
    host: str, port: int, model_name: str | None = None, timeout: float = 2.0
) -> EnginePage:
    text = await fetch_metrics_text(host, port, timeout=timeout)
    return await asyncio.to_thread(parse_engine_page, text, model_name)


async def scrape_kv_usage(
    host: str, port: int, model_name: str | None = None, timeout: float = 2.0
) -> dict[str, float]:
    text = await fetch_metrics_text(host, port, timeout=timeout)
    return await asyncio.to_thread(parse_kv_usage, text, model_name)
