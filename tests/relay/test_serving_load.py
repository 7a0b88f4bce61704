"""``SubscribeServingLoad`` end to end: simulated engines with ``/metrics`` pages → relay → SDK.

The oracle is the simulator's own schedulers (what its pages render): between steps nothing
moves, so once a window reflects a scrape taken after the last step, every counter must equal
the schedulers' sums exactly. Then an engine restart (its counters start over) must not make a
total go back, and a stopped engine makes both views partial: the pool gauge goes unset and the
model view DEGRADED, its counters kept.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from kvrelay.client import RelayClient, cli
from kvrelay.client.views import ModelServingView, PoolServingView
from kvrelay.relay.settings import EngineSpec, PoolSpec
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from tests.support.fleet import fleet_and_relay


def _pools(engines: list[SimEngine]) -> tuple[PoolSpec, ...]:
    return (
        PoolSpec(
            namespace="ns", component="backend", endpoint="generate", expected_blocks=8192,
            engines=tuple(
                EngineSpec(name=e.cfg.name, host="127.0.0.1", grpc_port=e.grpc_port,
                           metrics_port=e.metrics_port)
                for e in engines
            ),
        ),
    )  # fmt: skip


def _oracle(engines: list[SimEngine]) -> dict[str, int]:
    scheds = [s for e in engines for s in e.schedulers]
    return {
        "requests_completed_total": sum(s.finished for s in scheds),
        "requests_cancelled_total": sum(s.dropped_waiting for s in scheds),
        "requests_failed_total": sum(s.rejected for s in scheds),
        "requests_started_total": sum(
            s.finished + s.dropped_waiting + s.rejected + len(s.running) + len(s.waiting)
            for s in scheds
        ),
        "input_tokens_total": sum(s.prefix_queries for s in scheds),
        "output_tokens_total": sum(s.generated_tokens for s in scheds),
    }


def _totals(m: ModelServingView) -> dict[str, int | None]:
    return {k: getattr(m, k) for k in (
        "requests_completed_total", "requests_cancelled_total", "requests_failed_total",
        "requests_started_total", "input_tokens_total", "output_tokens_total",
    )}  # fmt: skip


async def test_views_match_the_engines_through_a_restart_and_an_outage() -> None:
    configs = [
        SimConfig(name="e0", seed=31, dp_size=2, capacity_blocks=128, max_running=4),
        SimConfig(name="e1", seed=32, capacity_blocks=128, max_running=3),
    ]
    async with fleet_and_relay(configs, pools=_pools) as (engines, _relay, server):
        async with RelayClient([f"127.0.0.1:{server.port}"]) as client:
            assert await client.wait_ready(30)
            for e in engines:
                await e.step(40)
            want = _oracle(engines)
            assert want["requests_completed_total"] > 0 and want["output_tokens_total"] > 0

            def model() -> ModelServingView | None:
                views = client.serving_load().models
                return views[0] if len(views) == 1 else None

            def pool() -> PoolServingView | None:
                views = list(client.serving_load().pools.values())
                return views[0] if len(views) == 1 else None

            def settled(expect: dict[str, int], status: str = "COMPLETE") -> bool:
                m = model()
                return m is not None and m.status == status and _totals(m) == expect

            assert await client.wait_for(lambda: settled(want), 30), model()
            m, p = model(), pool()
            assert m is not None and p is not None
            assert (m.namespace, m.model) == ("ns", configs[0].served_model_name)
            assert (m.expected_frontends, m.observed_frontends, m.ready_frontends) == (2, 2, 2)
            assert m.requests_awaiting_first_token is None and m.requests_generating is None
            assert m.inflight_input_tokens is None  # no source for it: unset, never zero
            assert m.awaiting_first_token_input_tokens is None
            assert [k.endpoint_path for k in m.serving_pools] == ["ns/backend/generate"]
            assert p.status == "COMPLETE" and p.active_prefill_tokens is None
            assert p.live_workers == 2
            assert p.max_concurrency == 4 * 2 + 3 * 1  # max_num_seqs x DP size, summed
            # The decode-blocks gauge is the KV usage the load plane reports for the pool.
            assert await client.wait_for(
                lambda: (q := pool()) is not None and q.active_decode_blocks is not None
                and [v.kv_used_blocks for v in client.load().values()] == [q.active_decode_blocks],
                20,
            )

            # A restarted engine starts its counters over; the totals go on from where they were.
            before = _oracle(engines)
            await engines[1].restart()
            await engines[1].step(10)
            after = _oracle([engines[1]])
            expect = {k: before[k] + after[k] for k in before}
            assert await client.wait_for(lambda: settled(expect), 30), (model(), expect)

            # An engine gone: the pool's sum is partial (gauge unset), the model DEGRADED, its
            # departed engine's counters still counted while it stays configured. The pool's
            # status follows the ranks the load plane still sees and its live workers the probe
            # of each engine: two observations, not one instant, so the test waits for both.
            await engines[1].stop()
            assert await client.wait_for(
                lambda: (q := pool()) is not None and q.status == "DEGRADED"
                and q.active_decode_blocks is None and q.live_workers == 1,
                30,
            ), pool()
            assert await client.wait_for(lambda: settled(expect, "DEGRADED"), 30), model()
            m = model()
            assert m is not None and (m.observed_frontends, m.expected_frontends) == (1, 2)

            # Every engine gone: the pool is withdrawn, but the model is still configured: it
            # stays, UNAVAILABLE, with its totals (absent would mean it is gone).
            await engines[0].stop()  # it has not stepped since: ``expect`` still holds
            assert await client.wait_for(lambda: settled(expect, "UNAVAILABLE"), 30), model()
            m = model()
            assert m is not None and (m.observed_frontends, m.expected_frontends) == (0, 2)
            assert m.ready_frontends == 0 and m.serving_pools == ()


async def test_totals_count_what_engines_did_while_nobody_read_the_windows() -> None:
    """Windows are built only when read, but the running totals follow every scrape: an
    engine that restarts while nobody subscribes keeps what it counted before the restart."""
    configs = [SimConfig(name="n0", seed=61, capacity_blocks=128, max_running=4)]
    async with fleet_and_relay(configs, pools=_pools) as (engines, _relay, server):
        await engines[0].step(40)
        before = _oracle(engines)
        assert before["requests_completed_total"] > 0 and before["output_tokens_total"] > 0
        await asyncio.sleep(2.5)  # at least two scrapes of the counts before the restart
        await engines[0].restart()
        await engines[0].step(10)
        after = _oracle(engines)
        expect = {k: before[k] + after[k] for k in before}
        await asyncio.sleep(2.5)  # scraped since: the page holds only the new counts
        async with RelayClient([f"127.0.0.1:{server.port}"]) as client:  # the first reader
            assert await client.wait_ready(30)

            def settled() -> bool:
                views = client.serving_load().models
                return len(views) == 1 and _totals(views[0]) == expect

            assert await client.wait_for(settled, 30), (client.serving_load().models, expect)


async def _metrics_stub(page: Callable[[], bytes]) -> tuple[asyncio.Server, int]:
    """An engine's ``/metrics`` endpoint serving ``page()`` (its server and port)."""

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        body = page()
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n%s" % (len(body), body))  # fmt: skip
        await w.drain()
        w.close()

    stub = await asyncio.start_server(serve, "127.0.0.1", 0)
    return stub, stub.sockets[0].getsockname()[1]


async def test_a_page_without_request_figures_is_not_a_report_of_zero() -> None:
    """An engine whose page lists the model but gives no request figures (another server's
    format, a rank's label missing) is not an observed frontend: the model is DEGRADED, not
    COMPLETE with that engine's requests read as zero."""
    page = b'vllm:kv_cache_usage_perc{engine="0",model_name="sim-model"} 0.25\n'
    stub, stub_port = await _metrics_stub(lambda: page)

    def pools(engines: list[SimEngine]) -> tuple[PoolSpec, ...]:
        (spec,) = _pools(engines)
        e0, e1 = spec.engines
        return (replace(spec, engines=(e0, replace(e1, metrics_port=stub_port))),)

    configs = [SimConfig(name="f0", seed=51, capacity_blocks=128, max_running=4),
               SimConfig(name="f1", seed=52, capacity_blocks=128, max_running=4)]  # fmt: skip
    try:
        async with fleet_and_relay(configs, pools=pools) as (engines, _relay, server):
            async with RelayClient([f"127.0.0.1:{server.port}"]) as client:
                assert await client.wait_ready(30)
                await engines[0].step(20)
                done = engines[0].schedulers[0].finished

                def seen() -> bool:
                    views = client.serving_load().models
                    return len(views) == 1 and views[0].requests_completed_total == done

                assert await client.wait_for(seen, 30), client.serving_load().models
                (m,) = client.serving_load().models
                assert (m.expected_frontends, m.observed_frontends) == (2, 1)
                assert m.status == "DEGRADED"
    finally:
        stub.close()
        await stub.wait_closed()


async def test_watch_serving_load_and_load_name_pools(capsys: pytest.CaptureFixture[str]) -> None:
    """``kvrelay watch serving-load`` prints both views; ``watch load`` and it name pools by
    endpoint (from the catalog), not by a digest; unset figures are ``-`` / null."""
    configs = [SimConfig(name="w0", seed=41, capacity_blocks=128, max_running=4)]
    async with fleet_and_relay(configs, pools=_pools) as (engines, _relay, server):
        await engines[0].step(20)
        addr = f"127.0.0.1:{server.port}"

        def watch(*argv: str) -> tuple[int, str]:
            rc = cli.main(list(argv))
            return rc, capsys.readouterr().out

        async def complete_window() -> dict[str, Any]:
            for _ in range(30):
                rc, out = await asyncio.to_thread(
                    watch, "watch", "serving-load", "--relay", addr, "--json", "--count", "1"
                )
                assert rc == 0
                (msg,) = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
                if msg["models"] and msg["models"][0]["status"] == "COMPLETE":
                    return msg
                await asyncio.sleep(0.3)
            raise AssertionError("no COMPLETE serving-load window")

        msg = await complete_window()
        assert msg["plane"] == "serving-load" and msg["window_ms"] == 1000
        (pool,) = msg["pools"]
        assert pool["pool"] == "ns/backend/generate" and pool["status"] == "COMPLETE"
        assert pool["active_prefill_tokens"] is None and pool["live_workers"] == 1
        (model,) = msg["models"]
        assert model["requests_completed_total"] == engines[0].schedulers[0].finished
        assert model["requests_generating"] is None
        assert (model["inflight_input_tokens"], model["awaiting_first_token_input_tokens"]) == (
            None, None
        )  # listed, unset: null, never zero
        rc, text = await asyncio.to_thread(watch, "watch", "serving-load", "--relay", addr,
                                           "--count", "1")  # fmt: skip
        assert rc == 0 and "serving-load window" in text and "ns/backend/generate" in text
        assert "1/1 seen, 1 ready" in text
        rc, text = await asyncio.to_thread(watch, "watch", "load", "--relay", addr,
                                           "--count", "1")  # fmt: skip
        assert rc == 0 and "POOL" in text and "ns/backend/generate" in text


async def test_a_page_cut_before_its_request_counter_counts_nothing_twice() -> None:
    """A page that gives the gauges but not ``vllm:request_success_total`` (cut short, or
    another server's): the frontend is not observed and its counters are not read as zeros. Read
    as zeros they looked like an engine restart, and every count was added again once a whole
    page came back (completed 201 and input tokens 2,000 where the engine had done 101 and
    1,000)."""
    labels = 'engine="0",model_name="sim-model"'

    def render(completed: int | None) -> bytes:
        lines = [f"vllm:num_requests_running{{{labels}}} 1",
                 f"vllm:num_requests_waiting{{{labels}}} 0",
                 f"vllm:prompt_tokens_total{{{labels}}} 1000",
                 f"vllm:generation_tokens_total{{{labels}}} 500"]  # fmt: skip
        if completed is not None:
            lines += [f'vllm:request_success_total{{{labels},finished_reason="{r}"}} {n}'
                      for r, n in (("stop", completed), ("length", 0), ("abort", 0),
                                   ("error", 0))]  # fmt: skip
        return ("\n".join(lines) + "\n").encode()

    page = [render(100)]
    stub, stub_port = await _metrics_stub(lambda: page[0])

    def pools(engines: list[SimEngine]) -> tuple[PoolSpec, ...]:
        (spec,) = _pools(engines)
        return (replace(spec, engines=(replace(spec.engines[0], metrics_port=stub_port),)),)

    try:
        async with fleet_and_relay([SimConfig(name="c0", seed=61, capacity_blocks=128)],
                                   pools=pools) as (_engines, _relay, server):  # fmt: skip
            async with RelayClient([f"127.0.0.1:{server.port}"]) as client:
                assert await client.wait_ready(30)

                def model() -> ModelServingView | None:
                    views = client.serving_load().models
                    return views[0] if len(views) == 1 else None

                def reached(completed: int, observed: int) -> bool:
                    m = model()
                    return m is not None and (m.requests_completed_total, m.observed_frontends,
                                              m.input_tokens_total) == (completed, observed, 1000)

                assert await client.wait_for(lambda: reached(100, 1), 30), model()
                page[0] = render(None)  # the request counter's lines are gone
                assert await client.wait_for(lambda: reached(100, 0), 30), model()
                m = model()
                assert m is not None and m.status == "UNAVAILABLE"
                page[0] = render(101)
                assert await client.wait_for(lambda: reached(101, 1), 30), model()
                m = model()
                assert m is not None and m.status == "COMPLETE"
                assert (m.requests_started_total, m.output_tokens_total) == (102, 500)
    finally:
        stub.close()
        await stub.wait_closed()
