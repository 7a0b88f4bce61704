"""The ``/metrics`` page as Prometheus reads it: content negotiation (text format 0.0.4 or
OpenMetrics), gzip, HEAD, and every family written once, also by a ``kvrelay mirror`` with
``workers = 2`` (real processes).

Oracles: prometheus_client's two parsers (``prometheus_client.parser`` for the text format,
``prometheus_client.openmetrics.parser``, which refuses a family written twice or a page
without ``# EOF``), and the gzip format itself.
"""

from __future__ import annotations

import asyncio
import collections
import gzip
import re
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from benchmarks._common import free_port
from kvrelay.ops.metrics import RelayMetrics
from kvrelay.ops.metrics_http import accepts_gzip, wants_openmetrics
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.commands import REPO, clean_env
from tests.support.rig import make_settings, start_relay
from tests.support.scrape import HttpReply, fleet_and_relay, http_request, wait_subscribed
from tests.support.timing import scaled

#: What Prometheus 2.x/3.x sends when scraping (its default scrape protocols).
PROMETHEUS_ACCEPT = (
    b"application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    b"q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
TEXT = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


async def _get(port: int, method: bytes = b"GET", **headers: bytes) -> HttpReply:
    head = b"".join(k.replace("_", "-").encode() + b": " + v + b"\r\n" for k, v in headers.items())
    return await http_request(port, method + b" /metrics HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")


def _strict_text(body: bytes) -> dict[str, int]:
    """Parse a text-format page; every family's TYPE and every sample must appear once.
    Returns the samples per family."""
    text = body.decode()
    types = collections.Counter(re.findall(r"^# TYPE (\S+)", text, re.M))
    assert not [n for n, k in types.items() if k > 1], "families written twice"
    seen: collections.Counter[tuple[str, tuple[tuple[str, str], ...]]] = collections.Counter()
    out: dict[str, int] = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = len(fam.samples)
        for s in fam.samples:
            seen[(s.name, tuple(sorted(s.labels.items())))] += 1
    assert not [k for k, n in seen.items() if n > 1], "samples written twice"
    return out


def _strict_openmetrics(body: bytes) -> dict[str, int]:
    text = body.decode()
    assert text.endswith("# EOF\n")
    return {f.name: len(f.samples) for f in openmetrics_families(text)}  # type: ignore[no-untyped-call]


def test_negotiation_follows_what_the_client_asks_for() -> None:
    assert wants_openmetrics(PROMETHEUS_ACCEPT)
    assert wants_openmetrics(b"application/openmetrics-text")
    assert not wants_openmetrics(b"")
    assert not wants_openmetrics(b"*/*")  # curl: the text format
    assert not wants_openmetrics(b"text/plain;version=0.0.4")
    assert not wants_openmetrics(b"text/plain, application/openmetrics-text;q=0.5")
    assert not wants_openmetrics(b"application/openmetrics-text;q=0")
    assert not wants_openmetrics(b"application/openmetrics-text;version=9.9.9")
    assert accepts_gzip(b"gzip") and accepts_gzip(b"br, GZIP;q=0.5") and accepts_gzip(b"*")
    assert not accepts_gzip(b"") and not accepts_gzip(b"identity")
    assert not accepts_gzip(b"gzip;q=0") and not accepts_gzip(b"*, gzip;q=0")


async def test_openmetrics_text_gzip_and_head_from_a_live_relay() -> None:
    """A relay fed by a simulated engine (pool, member, histogram and info families): the
    OpenMetrics page has the same families and samples as the text page; gzip is gzip."""
    async with fleet_and_relay([SimConfig(name="e0", seed=3, dp_size=2)]) as (
        engines, relay, server,
    ):  # fmt: skip
        metrics = RelayMetrics(relay, CollectorRegistry())
        metrics.attach_service(server.service)
        port = await metrics.start_http("127.0.0.1", 0)
        try:
            await wait_subscribed(relay, 2)
            await engines[0].step(8)
            metrics.observe_loop_lag(0.002)
            plain = await _get(port)
            assert plain.status == 200 and plain.headers["content-type"] == TEXT
            assert "content-encoding" not in plain.headers
            text = _strict_text(plain.body)
            assert text["kvrelay_ingest_messages"] == 2  # one per member
            om = await _get(port, accept=PROMETHEUS_ACCEPT)
            assert om.status == 200 and om.headers["content-type"] == OPENMETRICS, om.headers
            fams = _strict_openmetrics(om.body)
            assert fams["kvrelay_ingest_messages"] == 2 and "kvrelay_relay" in fams
            assert "kvrelay_event_loop_lag_seconds" in fams
            # the same families (OpenMetrics folds _created and writes info as one family)
            assert {n for n in text if not n.endswith("_created")} - {"kvrelay_relay_info"} == (
                set(fams) - {"kvrelay_relay"}
            )
            assert "accept" in om.headers["vary"].lower()
            # gzip when accepted (Prometheus always sends Accept-Encoding: gzip)
            gz = await _get(port, accept=PROMETHEUS_ACCEPT, accept_encoding=b"gzip")
            assert gz.headers["content-encoding"] == "gzip"
            assert int(gz.headers["content-length"]) == len(gz.body)
            assert _strict_openmetrics(gzip.decompress(gz.body)).keys() == fams.keys()
            refused = await _get(port, accept_encoding=b"gzip;q=0")
            assert "content-encoding" not in refused.headers
            _strict_text(refused.body)
            head = await _get(port, b"HEAD", accept=PROMETHEUS_ACCEPT, accept_encoding=b"gzip")
            assert head.status == 200 and head.body == b""
            assert head.headers["content-encoding"] == "gzip"
            assert head.headers["content-type"] == OPENMETRICS
        finally:
            await asyncio.wait_for(metrics.close(), scaled(10))


async def _scrape_when_up(port: int, proc: asyncio.subprocess.Process) -> None:
    deadline = asyncio.get_running_loop().time() + scaled(90)
    while True:
        assert proc.returncode is None, (await proc.stderr.read()).decode()[-3000:]  # type: ignore[union-attr]
        try:
            reply = await _get(port)
            if reply.status == 200 and b'kvrelay_mirror_synced{worker="1"} 1.0' in reply.body:
                return
        except (OSError, AssertionError, IndexError, ValueError):
            pass
        assert asyncio.get_running_loop().time() < deadline, "the mirror's workers never synced"
        await asyncio.sleep(0.2)


async def test_a_mirror_with_workers_writes_each_family_once(tmp_path: Path) -> None:
    """``kvrelay mirror --workers 2``: the mirror's own ``kvrelay_mirror_*`` samples
    (``worker=""``) and its worker's (``worker="1"``) came as two families of each name, so the
    page had every ``# HELP``/``# TYPE`` twice (and OpenMetrics refused it)."""
    engine = SimEngine(SimConfig(name="m0", seed=21, capacity_blocks=64))
    await engine.start()
    relay, upstream = await start_relay(make_settings([engine]))
    conf = tmp_path / "mirror.toml"
    conf.write_text(
        f'[mirror]\nupstream = "127.0.0.1:{upstream.port}"\n[logging]\nformat = "json"\n'
    )
    metrics_port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrelay", "mirror", "--config", str(conf), "--bind", "127.0.0.1:0",
        "--metrics-bind", f"127.0.0.1:{metrics_port}", "--workers", "2",
        env=clean_env(), cwd=REPO, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        await _scrape_when_up(metrics_port, proc)
        text = _strict_text((await _get(metrics_port)).body)
        assert text["kvrelay_mirror_synced"] == 2  # the mirror's and its worker's, one family
        fams = _strict_openmetrics((await _get(metrics_port, accept=PROMETHEUS_ACCEPT)).body)
        assert fams["kvrelay_mirror_synced"] == 2 and "kvrelay_workers" in fams
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), scaled(20))
            except TimeoutError:
                proc.kill()
                await proc.wait()
        await upstream.close(grace_s=1.0)
        await relay.stop()
        await engine.stop()
