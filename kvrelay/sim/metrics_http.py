"""Tiny asyncio HTTP server exposing vLLM-style Prometheus gauges at ``GET /metrics``.

No framework: one request per connection, ``Connection: close``. Requests larger than 8 KiB of
headers or slower than 5 s are dropped (bounded per-connection cost).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from kvrelay._aio import server_closed
from kvrelay.sim.face import EngineFace

_MAX_HEADER = 8192


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(engine: EngineFace) -> str:
    """Prometheus text exposition for every DP rank (label ``engine`` = DP rank, as in vLLM)."""
    model = _esc(engine.cfg.served_model_name)
    gauges: list[tuple[str, str, str, list[float]]] = []
    ranks = range(engine.cfg.dp_size)
    gauges.append(
        (
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage. 1 means 100 percent usage.",
            [engine.kv_usage(r) for r in ranks],
        )
    )
    gauges.append(
        (
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            [float(len(engine.schedulers[r].running)) for r in ranks],
        )
    )
    gauges.append(
        (
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            [float(len(engine.schedulers[r].waiting)) for r in ranks],
        )
    )
    gauges.append(
        (
            "vllm:prefix_cache_queries",
            "counter",
            "Prefix cache queries, in tokens.",
            [float(engine.schedulers[r].prefix_queries) for r in ranks],
        )
    )
    gauges.append(
        (
            "vllm:prefix_cache_hits",
            "counter",
            "Prefix cache hits, in tokens.",
            [float(engine.schedulers[r].prefix_hits) for r in ranks],
        )
    )
    gauges.append(
        (
            "vllm:prompt_tokens",
            "counter",
            "Number of prefill tokens processed.",
            [float(engine.schedulers[r].prefix_queries) for r in ranks],
        )
    )
    gauges.append(
        (
            "vllm:generation_tokens",
            "counter",
            "Number of generation tokens processed.",
            [float(engine.schedulers[r].generated_tokens) for r in ranks],
        )
    )
    lines: list[str] = []
    for name, kind, help_text, values in gauges:
        sample = f"{name}_total" if kind == "counter" else name
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for r, v in zip(ranks, values, strict=True):
            lines.append(f'{sample}{{engine="{r}",model_name="{model}"}} {v!r}')
    # Finished requests by reason, as vLLM labels them: every reason listed from the start, zeros
    # included (the simulator never stops on a stop token; it finishes by length, drops a waiting
    # request when its queue is full (abort) and refuses a prompt that can never fit).
    lines.append("# HELP vllm:request_success Count of successfully processed requests.")
    lines.append("# TYPE vllm:request_success counter")
    for r in ranks:
        sch = engine.schedulers[r]
        for reason, n in (("stop", 0), ("length", sch.finished), ("abort", sch.dropped_waiting),
                          ("error", sch.rejected)):  # fmt: skip
            lines.append(
                f'vllm:request_success_total{{engine="{r}",finished_reason="{reason}",'
                f'model_name="{model}"}} {float(n)!r}'
            )
    lines += _histograms(engine, model)
    # prometheus_client's process collector, on vLLM's page in its default single-process setup:
    # the relay tells a restart by it.
    lines.append("# HELP process_start_time_seconds Start time of the process since unix epoch "
                 "in seconds.")  # fmt: skip
    lines.append("# TYPE process_start_time_seconds gauge")
    lines.append(f"process_start_time_seconds {engine.started_at!r}")
    return "\n".join(lines) + "\n"


#: Histograms vLLM's page carries and the relay never reads (name, help, bucket bounds): they
#: are most of a real page's bytes, so the relay's scrape parses a page of realistic weight.
_HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
     (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
      10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
     (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
      20.0, 40.0, 80.0)),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
     (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
      240.0, 480.0, 960.0, 1920.0, 7680.0)),
    ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase.",
     (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)),
    ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase.",
     (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)),
    ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase.",
     (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)),
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
     (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0)),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.",
     (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0)),
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
     (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0)),
)  # fmt: skip


def _histograms(engine: EngineFace, model: str) -> list[str]:
    lines: list[str] = []
    for name, help_text, bounds in _HISTOGRAMS:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} histogram")
        for r in range(engine.cfg.dp_size):
            n = float(engine.schedulers[r].finished)  # every finished request in the last bucket
            lab = f'engine="{r}",model_name="{model}"'
            lines += [f'{name}_bucket{{{lab},le="{b}"}} 0.0' for b in bounds]
            lines += [f'{name}_bucket{{{lab},le="+Inf"}} {n!r}', f"{name}_count{{{lab}}} {n!r}",
                      f"{name}_sum{{{lab}}} {n!r}"]  # fmt: skip
    return lines


async def _handle(
    engine: EngineFace, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5.0)
        if len(head) > _MAX_HEADER:
            return
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) >= 2 and parts[0] == b"GET" and parts[1].split(b"?")[0] == b"/metrics":
            body = render_metrics(engine).encode()
            status = b"200 OK"
            ctype = b"text/plain; version=0.0.4; charset=utf-8"
        else:
            body, status, ctype = b"not found\n", b"404 Not Found", b"text/plain"
        writer.write(
            b"HTTP/1.1 "
            + status
            + b"\r\nContent-Type: "
            + ctype
            + b"\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\nConnection: close\r\n\r\n"
            + body
        )
        await writer.drain()
    except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def start_metrics_server(engine: EngineFace) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(
        lambda r, w: _handle(engine, r, w),
        engine.cfg.host_ip,
        engine.cfg.metrics_port or 0,
        limit=_MAX_HEADER,
    )
    return server, int(server.sockets[0].getsockname()[1])


async def stop_metrics_server(server: Any) -> None:
    server.close()
    await server_closed(server)  # (bounded: a scraper may keep its connection)
