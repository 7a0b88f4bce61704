"""/metrics scraping against the simulator's page and a chunked-encoding server, and reading only
the lines the relay needs against prometheus_client's parse of the whole page (the oracle). A
page cut short, doubled or out of range is a ``MetricsScrapeError``: read, it looked like an
engine restart and its counters were counted twice."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import socket
import time
from typing import Any

import pytest

from kvrelay.discovery.metrics_scrape import (
    MAX_BODY,
    MAX_CHUNKS,
    MAX_WANTED_LINES,
    MetricsScrapeError,
    fetch_metrics_text,
    parse_engine_page,
    parse_kv_usage,
    scrape_engine_page,
    scrape_kv_usage,
)
from kvrelay.sim import SimConfig, SimEngine
from kvrelay.sim.metrics_http import render_metrics


async def test_a_page_in_too_many_chunks_is_refused_off_the_loop() -> None:
    """A page of 100,000 one-byte chunks: refused (``MetricsScrapeError``), and the event loop
    keeps turning meanwhile (the body is taken apart in a thread)."""
    body = b"1\r\na\r\n" * (MAX_CHUNKS + 10) + b"0\r\n\r\n"

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
        await w.drain()
        w.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    ticker = asyncio.ensure_future(tick())
    try:
        with pytest.raises(MetricsScrapeError, match="chunks"):
            await fetch_metrics_text("127.0.0.1", srv.sockets[0].getsockname()[1], timeout=10)
        assert ticks > 1
    finally:
        ticker.cancel()
        srv.close()
        await srv.wait_closed()


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


def _oracle(
    text: str, model: str | None
) -> tuple[dict[str, float], dict[str, Any], float | None]:
    """The whole page through prometheus_client's parser, as the scrape read it before it kept
    only the lines it reads."""
    from prometheus_client.parser import text_string_to_metric_families

    usage: dict[str, float] = {}
    legacy: dict[str, float] = {}
    figures: dict[str, dict[str, Any]] = {}
    started: float | None = None
    names = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
             "vllm:prompt_tokens_total": "prompt_tokens_total",
             "vllm:generation_tokens_total": "generation_tokens_total"}  # fmt: skip
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "process_start_time_seconds":
                started = s.value
            if model is not None and s.labels.get("model_name") != model:
                continue
            rank = s.labels.get("engine", "0")
            if s.name == "vllm:kv_cache_usage_perc":
                usage[rank] = s.value
            elif s.name == "vllm:gpu_cache_usage_perc":
                legacy[rank] = s.value
            elif s.name in names:
                figures.setdefault(rank, {})[names[s.name]] = int(s.value)
            elif s.name == "vllm:request_success_total":
                done = figures.setdefault(rank, {}).setdefault("finished", {})
                reason = s.labels.get("finished_reason", "")
                done[reason] = done.get(reason, 0) + int(s.value)
    return usage or legacy, figures, started


def _vllm_page(rng: random.Random, models: list[str], ranks: int) -> str:
    """A page shaped like vLLM's: the figures the relay reads among many histograms it does not,
    typed counters (``# TYPE x counter`` with ``x_total`` samples), labels in either order."""
    lines = ["# HELP python_gc_objects_collected_total Objects collected during gc",
             "# TYPE python_gc_objects_collected_total counter"]  # fmt: skip
    lines += [f'python_gc_objects_collected_total{{generation="{g}"}} {g * 11}.0' for g in range(3)]
    if rng.random() < 0.7:  # prometheus_client's process collector (absent in multiprocess mode)
        lines += ["# TYPE process_start_time_seconds gauge",
                  f"process_start_time_seconds {1.7e9 + rng.randrange(10**8) / 100!r}"]  # fmt: skip
    for m in models:
        esc = m.replace("\\", "\\\\").replace('"', '\\"')
        for r in range(ranks):
            labels = [f'engine="{r}"', f'model_name="{esc}"']
            rng.shuffle(labels)
            lab = ",".join(labels)
            for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
                lines.append(f"# TYPE vllm:{h} histogram")
                lines += [f'vllm:{h}_bucket{{{lab},le="{0.01 * 2**i}"}} {i}.0' for i in range(20)]
                lines.append(f'vllm:{h}_bucket{{{lab},le="+Inf"}} 20.0')
                lines.append(f"vllm:{h}_count{{{lab}}} 20.0")
            lines += ["# TYPE vllm:kv_cache_usage_perc gauge",
                      f"vllm:kv_cache_usage_perc{{{lab}}} {rng.random():.6f}",
                      f"vllm:num_requests_running{{{lab}}} {rng.randrange(64)}.0",
                      f"vllm:num_requests_waiting{{{lab}}} {rng.randrange(8)}.0",
                      "# TYPE vllm:prompt_tokens counter",
                      f"vllm:prompt_tokens_total{{{lab}}} {rng.randrange(1 << 30)}.0",
                      f"vllm:generation_tokens_total{{{lab}}} {rng.randrange(1 << 30)}.0",
                      ]  # fmt: skip
            for reason in ("stop", "length", "abort"):
                lines.append(f'vllm:request_success_total{{finished_reason="{reason}",{lab}}}'
                             f" {rng.randrange(1000)}.0")  # fmt: skip
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("seed", range(8))
def test_reading_only_the_wanted_lines_gives_what_the_whole_page_gives(seed: int) -> None:
    rng = random.Random(seed)
    models = rng.sample(["llama", 'we"ird\\name', "qwen", "llama-lora"], rng.randrange(1, 4))
    page = _vllm_page(rng, models, rng.randrange(1, 4))
    if rng.random() < 0.5:
        page = page.replace("\n", "\r\n")
    for model in [None, *models, "absent", "lama"]:
        got = parse_engine_page(page, model)
        usage, figures, started = _oracle(page, model)
        assert got.kv_usage == usage, model
        assert got.started == started  # the process's: read whatever the model
        assert {r: dataclasses.asdict(v) for r, v in got.serving.items()} == {
            r: {"running": None, "waiting": None, "prompt_tokens_total": None,
                "generation_tokens_total": None, "finished": {}, **f}
            for r, f in figures.items()
        }  # fmt: skip


def test_a_family_the_relay_does_not_read_cannot_blank_the_load() -> None:
    page = ('vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
            "some_histogram_bucket{le= 1\n")  # fmt: skip
    assert parse_engine_page(page).kv_usage == {"0": 0.5}
    with pytest.raises(MetricsScrapeError):  # a malformed line it reads still does
        parse_engine_page('vllm:kv_cache_usage_perc{engine="0" 1\n')


def test_a_series_listed_twice_or_out_of_range_is_refused() -> None:
    """A page doubled or spliced has no one value to believe (the finished counters were
    summed, the gauges' last line won); a counter at 2**63 or more is no engine's count (1e300
    pinned the total at u64 max for good); the process start time is one per page."""
    lab = 'engine="0",model_name="m"'
    good = [f"vllm:num_requests_running{{{lab}}} 1", f"vllm:prompt_tokens_total{{{lab}}} 100",
            f'vllm:request_success_total{{{lab},finished_reason="stop"}} 5',
            f'vllm:request_success_total{{{lab},finished_reason="length"}} 5',
            "process_start_time_seconds 1.7e+09"]  # fmt: skip
    page = parse_engine_page("\n".join(good) + "\n", "m")
    assert page.serving["0"].finished == {"stop": 5, "length": 5} and page.started == 1.7e9
    for extra in (good[2], f"vllm:num_requests_running{{{lab}}} 7",
                  'vllm:prompt_tokens_total{model_name="m",engine="0"} 1',  # labels reordered
                  "process_start_time_seconds 1.8e+09"):  # fmt: skip
        with pytest.raises(MetricsScrapeError, match="twice"):
            parse_engine_page("\n".join([*good, extra]) + "\n", "m")
    for big in (f"{2**63}", "9.3e18", "1e300"):
        with pytest.raises(MetricsScrapeError, match="not a count"):
            parse_engine_page(f"vllm:prompt_tokens_total{{{lab}}} {big}\n", "m")
    assert parse_engine_page(f"vllm:prompt_tokens_total{{{lab}}} {2**62}\n", "m").serving[
        "0"
    ].prompt_tokens_total == 2**62
    with pytest.raises(MetricsScrapeError):
        parse_engine_page("process_start_time_seconds NaN\n")
    # another model's series, or the same name with other labels, is no duplicate
    other = 'vllm:num_requests_running{engine="0",model_name="n"} 3'
    assert parse_engine_page("\n".join([*good, other]) + "\n", "m").serving["0"].running == 1


async def _serve_once(response: bytes) -> tuple[asyncio.Server, int]:
    """A server answering any request with ``response`` and closing the connection."""

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(response)
        await w.drain()
        w.close()

    srv = await asyncio.start_server(serve, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1]


async def test_a_close_delimited_body_cut_mid_line_is_refused() -> None:
    """A body with neither Content-Length nor chunks ends where the connection closes: one cut
    mid-line read a counter cut short ("150.0" as "15"), a dip taken for an engine restart. The
    text format ends every line in a newline, so one that does not is cut."""
    body = b'vllm:generation_tokens_total{engine="0",model_name="m"} 150.0\n'
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n"
    whole, port = await _serve_once(head + body)
    cut, cut_port = await _serve_once(head + body[:-4])
    try:
        page = await scrape_engine_page("127.0.0.1", port, "m", timeout=5)
        assert page.serving["0"].generation_tokens_total == 150
        with pytest.raises(MetricsScrapeError, match="cut short"):
            await scrape_engine_page("127.0.0.1", cut_port, "m", timeout=5)
    finally:
        for srv in (whole, cut):
            srv.close()
            await srv.wait_closed()


async def test_the_simulators_page_tells_a_restart_by_its_process_start_time() -> None:
    """The simulator's page carries ``process_start_time_seconds`` as vLLM's does; a restart is
    a new process, so a new value (the relay tells a restart by it)."""
    eng = SimEngine(SimConfig(capacity_blocks=64, served_model_name="m"))
    await eng.start()
    try:
        first = await scrape_engine_page("127.0.0.1", eng.metrics_port or 0, "m")
        again = await scrape_engine_page("127.0.0.1", eng.metrics_port or 0, "m")
        assert first.started is not None and first.started == again.started
        assert abs(first.started - time.time()) < 60
        await eng.restart()
        after = await scrape_engine_page("127.0.0.1", eng.metrics_port or 0, "m")
        assert after.started is not None and after.started > first.started
        assert set(after.serving["0"].finished) == {"stop", "length", "abort", "error"}
    finally:
        await eng.stop()


async def _serve_page(head: bytes, body: bytes) -> asyncio.Server:
    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        with contextlib.suppress(ConnectionError):
            await w.drain()
        w.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_a_page_made_only_of_wanted_lines_is_refused_unparsed() -> None:
    """A hostile engine's 8 MiB page of nothing but lines of the samples the relay reads (137,000
    distinct series) cost 2.5 s of parse CPU per scrape. More than ``MAX_WANTED_LINES`` is refused
    as ``oversized`` before prometheus_client sees a line."""
    line = 'vllm:num_requests_running{engine="%d",model_name="m"} 1.0\n'
    body = "".join(line % i for i in range(137_000)).encode()
    srv = await _serve_page(b"HTTP/1.1 200 OK\r\n", body)
    try:
        cpu = time.process_time()
        with pytest.raises(MetricsScrapeError, match="lines of the samples read") as err:
            await scrape_engine_page("127.0.0.1", srv.sockets[0].getsockname()[1], "m", timeout=30)
        assert err.value.reason == "oversized"
        assert time.process_time() - cpu < 1.0  # filtering 8 MiB takes ~0.05 s; parsing it 2.5
    finally:
        srv.close()
        await srv.wait_closed()


def test_the_wanted_lines_cap_admits_the_largest_real_page() -> None:
    """The simulator's page (vLLM's shape: ~16 KB and 9 read lines per DP rank) at 512 ranks, the
    most that fits ``MAX_BODY``, is read whole; a page of ``MAX_WANTED_LINES`` series too, and one
    line more is ``oversized``."""
    eng = SimEngine(SimConfig(dp_size=512, served_model_name="m"))
    page = render_metrics(eng)
    assert len(page) <= MAX_BODY
    assert len(parse_engine_page(page, "m").kv_usage) == 512
    lines = [f'vllm:num_requests_waiting{{engine="{i}"}} 1.0' for i in range(MAX_WANTED_LINES)]
    assert len(parse_engine_page("\n".join(lines)).serving) == MAX_WANTED_LINES
    with pytest.raises(MetricsScrapeError) as err:
        parse_engine_page("\n".join([*lines, 'vllm:num_requests_waiting{engine="x"} 1.0']))
    assert err.value.reason == "oversized"


@pytest.mark.parametrize("encoding", [b"gzip", b"br"])
async def test_an_encoded_page_is_malformed_not_an_empty_one(encoding: bytes) -> None:
    """No encoding is asked for; a page sent compressed anyway used to read as a page without a
    sample (load unknown, no failure counted). It is a ``malformed`` page."""
    srv = await _serve_page(b"HTTP/1.1 200 OK\r\nContent-Encoding: " + encoding + b"\r\n",
                            b"\x1f\x8b\x08\x00garbage")  # fmt: skip
    try:
        with pytest.raises(MetricsScrapeError, match="Content-Encoding") as err:
            await scrape_engine_page("127.0.0.1", srv.sockets[0].getsockname()[1])
        assert err.value.reason == "malformed"
    finally:
        srv.close()
        await srv.wait_closed()
