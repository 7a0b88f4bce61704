"""``SubscribeServingLoad`` end to end: simulated engines with ``/metrics`` pages → relay → SDK.

The oracle is the simulator's own schedulers (what its pages render): between steps nothing
moves, so once a window reflects a scrape taken after the last step, every counter must equal
the schedulers' sums exactly. Then an engine restart (its counters start over) must not make a
total go back, and a stopped engine makes both views partial: the pool gauge goes unset and the
model view DEGRADED, its counters kept. The engines' pages are read by the name they serve
under, a page that does not list the model is not a report of zero, and a frontend's running total
follows its address (not its configured names) and its process start time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest

from kvrelay.client import RelayClient, cli
from kvrelay.client.views import ModelServingView, PoolServingView
from kvrelay.contract.limits import RelayLimits
from kvrelay.discovery.metrics_scrape import parse_engine_page
from kvrelay.publication.serving_load import RunningTotals
from kvrelay.relay.pool_runtime import FENCE_STABLE_S
from kvrelay.relay.relay import Relay
from kvrelay.relay.serving import Page, ServingInputs, rank_counters
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from kvrelay.sim.metrics_http import render_metrics
from tests.support.fleet import eventually, fleet_and_relay, metered_pool
from tests.support.timing import scaled

#: engines scraped and windows sent four times a second: every wait below is for a scrape and
#: then a window, and at the daemon's default of 1 s the file took half a minute
TICK_S = 0.25


def _fleet(
    configs: list[SimConfig], pools: Callable[[list[SimEngine]], tuple[PoolSpec, ...]]
) -> Any:
    return fleet_and_relay(configs, pools=pools, scrape_interval_s=TICK_S,
                           limits=RelayLimits(load_window_s=TICK_S))  # fmt: skip


_pools = metered_pool


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
    async with _fleet(configs, _pools) as (engines, relay, server):
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

            # A Control outage alone (a probe timing out on a busy engine): its stream and its
            # /metrics page go on, so its ranks are observed and the pool's figures stay whole.
            # The capacity came from reachable Control answers only: it went unknown, the
            # pool's load partial (total 0, gauge unset, DEGRADED) for the outage.
            await engines[1].stop_control()
            assert await client.wait_for(
                lambda: any(st.unreachable_since is not None
                            for st in relay.pools[0].engines.values()), 30)  # fmt: skip
            await asyncio.sleep(1.5)  # windows and scrapes of the outage
            q = pool()
            assert q is not None and q.status == "COMPLETE" and q.active_decode_blocks is not None
            (load,) = client.load().values()
            assert load.total_kv_blocks == 3 * 128 and load.observed_ranks == 3, load  # 3 ranks
            await engines[1].start_control()

            # An engine gone: until it is declared down the pool's sum is partial (gauge unset)
            # and the model DEGRADED. The pool's status follows the ranks the load plane still
            # sees and its live workers the probe of each engine: two observations, not one
            # instant, so the test waits for both.
            runtime = relay.pools[0]
            grace = runtime.engine_down_grace_s
            runtime.engine_down_grace_s = 3600.0
            await engines[1].stop()
            assert await client.wait_for(
                lambda: (q := pool()) is not None and q.status == "DEGRADED"
                and q.active_decode_blocks is None and q.live_workers == 1,
                30,
            ), pool()
            assert await client.wait_for(lambda: settled(expect, "DEGRADED"), 30), model()
            m = model()
            assert m is not None and (m.observed_frontends, m.expected_frontends) == (1, 2)
            # Declared down (its members cleared), it has departed, as a worker leaving
            # Dynamo's discovery has: the views are whole again over the engine that serves,
            # its counters still counted while it stays configured.
            runtime.engine_down_grace_s = grace
            assert await client.wait_for(
                lambda: (q := pool()) is not None and q.status == "COMPLETE"
                and q.active_decode_blocks is not None and q.live_workers == 1,
                30,
            ), pool()
            assert await client.wait_for(lambda: settled(expect), 30), model()
            m = model()
            assert m is not None and (m.observed_frontends, m.expected_frontends) == (1, 1)

            # Every engine gone: the pool is withdrawn, but the model is still configured: it
            # stays, UNAVAILABLE, with its totals (absent would mean it is gone).
            await engines[0].stop()  # it has not stepped since: ``expect`` still holds
            # (the engine's scrapes fail at once; its pool is withdrawn after the down grace)
            assert await client.wait_for(
                lambda: settled(expect, "UNAVAILABLE")
                and (q := model()) is not None and q.serving_pools == ()
                and q.expected_frontends == 0,  # both engines down: none expected
                30,
            ), model()
            m = model()
            assert m is not None and (m.observed_frontends, m.expected_frontends) == (0, 0)
            assert m.ready_frontends == 0 and m.serving_pools == ()


async def test_totals_count_what_engines_did_while_nobody_read_the_windows() -> None:
    """Windows are built only when read, but the running totals follow every scrape: an
    engine that restarts while nobody subscribes keeps what it counted before the restart."""
    configs = [SimConfig(name="n0", seed=61, capacity_blocks=128, max_running=4)]
    async with _fleet(configs, _pools) as (engines, _relay, server):
        await engines[0].step(40)
        before = _oracle(engines)
        assert before["requests_completed_total"] > 0 and before["output_tokens_total"] > 0
        await asyncio.sleep(scaled(3 * TICK_S))  # two scrapes of the counts before the restart
        await engines[0].restart()
        await engines[0].step(10)
        after = _oracle(engines)
        expect = {k: before[k] + after[k] for k in before}
        await asyncio.sleep(scaled(3 * TICK_S))  # scraped since: the page has only the new counts
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


def _second_engine_reads(port: int) -> Callable[[list[SimEngine]], tuple[PoolSpec, ...]]:
    """The pool of ``_pools``, its second engine's page served by the stub on ``port``."""

    def pools(engines: list[SimEngine]) -> tuple[PoolSpec, ...]:
        (spec,) = _pools(engines)
        e0, e1 = spec.engines
        return (replace(spec, engines=(e0, replace(e1, metrics_port=port))),)

    return pools


async def test_a_page_without_request_figures_is_not_a_report_of_zero() -> None:
    """An engine whose page lists the model but gives no request figures (another server's
    format, a rank's label missing) is not an observed frontend: the model is DEGRADED, not
    COMPLETE with that engine's requests read as zero."""
    page = b'vllm:kv_cache_usage_perc{engine="0",model_name="sim-model"} 0.25\n'
    stub, stub_port = await _metrics_stub(lambda: page)

    pools = _second_engine_reads(stub_port)

    configs = [SimConfig(name="f0", seed=51, capacity_blocks=128, max_running=4),
               SimConfig(name="f1", seed=52, capacity_blocks=128, max_running=4)]  # fmt: skip
    try:
        async with _fleet(configs, pools) as (engines, _relay, server):
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
    async with _fleet(configs, _pools) as (engines, _relay, server):
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
        assert msg["plane"] == "serving-load" and msg["window_ms"] == TICK_S * 1000
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
        async with _fleet([SimConfig(name="c0", seed=61, capacity_blocks=128)],
                                   pools) as (_engines, _relay, server):  # fmt: skip
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


def _model(client: RelayClient) -> ModelServingView | None:
    views = client.serving_load().models
    return views[0] if len(views) == 1 else None


async def test_pages_are_read_by_the_name_the_engine_serves_under() -> None:
    """A pool configured with a canonical id other than the engine's served name: vLLM labels
    its samples ``model_name=<served name>``, so filtered by the canonical id the page listed
    nothing (KV usage unknown, the model's requests all zero)."""

    def pools(engines: list[SimEngine]) -> tuple[PoolSpec, ...]:
        return tuple(replace(p, model="org/canonical") for p in _pools(engines))

    configs = [SimConfig(name="m0", seed=71, capacity_blocks=128, max_running=4)]
    async with _fleet(configs, pools) as (engines, _relay, server):
        async with RelayClient([f"127.0.0.1:{server.port}"]) as client:
            assert await client.wait_ready(30)
            await engines[0].step(30)
            want = _oracle(engines)
            assert want["requests_completed_total"] > 0

            def settled() -> bool:
                m = _model(client)
                return m is not None and m.status == "COMPLETE" and _totals(m) == want

            assert await client.wait_for(settled, 20), _model(client)
            m = _model(client)
            assert m is not None and m.model == "org/canonical"
            assert await client.wait_for(
                lambda: [v.observed_ranks for v in client.load().values()] == [1], 20
            ), client.load()


async def test_a_page_that_does_not_list_the_model_is_not_a_report_of_zero() -> None:
    """An engine run with ``--disable-log-stats`` serves a page of process collectors only. Every
    engine of the model's pools serves the model, so that page is no report: the frontend is not
    observed and the model DEGRADED, not COMPLETE with that engine's requests missing."""
    page = (b"# TYPE python_gc_objects_collected_total counter\n"
            b'python_gc_objects_collected_total{generation="0"} 1234.0\n'
            b"process_resident_memory_bytes 1.2e9\n"
            b"process_start_time_seconds 1.7e+09\n")  # fmt: skip
    stub, stub_port = await _metrics_stub(lambda: page)

    pools = _second_engine_reads(stub_port)

    configs = [SimConfig(name="d0", seed=81, capacity_blocks=128, max_running=4),
               SimConfig(name="d1", seed=82, capacity_blocks=128, max_running=4)]  # fmt: skip
    try:
        async with _fleet(configs, pools) as (engines, _relay, server):
            async with RelayClient([f"127.0.0.1:{server.port}"]) as client:
                assert await client.wait_ready(30)
                await engines[0].step(20)
                want = _oracle(engines[:1])

                def seen() -> bool:
                    m = _model(client)
                    return m is not None and _totals(m) == want

                assert await client.wait_for(seen, 20), _model(client)
                m = _model(client)
                assert m is not None and m.status == "DEGRADED"
                assert (m.expected_frontends, m.observed_frontends, m.ready_frontends) == (2, 1, 1)
    finally:
        stub.close()
        await stub.wait_closed()


async def test_a_renamed_or_moved_engine_is_not_counted_again() -> None:
    """A reload that renames an engine, then one that moves it to another pool of the same model:
    the same frontend (same address), so its total goes on from its own values. Keyed by the
    configured names, its whole running total was counted a second time at each."""
    configs = [SimConfig(name="r0", seed=91, capacity_blocks=128, max_running=4)]
    async with _fleet(configs, _pools) as (engines, relay, server):
        async with RelayClient([f"127.0.0.1:{server.port}"]) as client:
            assert await client.wait_ready(30)
            want: dict[str, int] = {}

            def settled(endpoint: str) -> bool:
                m = _model(client)
                return (m is not None and m.status == "COMPLETE" and _totals(m) == want
                        and [k.endpoint_path for k in m.serving_pools] == [endpoint])  # fmt: skip

            await engines[0].step(20)
            want = _oracle(engines)
            assert await client.wait_for(lambda: settled("ns/backend/generate"), 20), _model(client)
            (spec,) = relay.settings.pools
            renamed = replace(spec, engines=(replace(spec.engines[0], name="gpu-node-0"),))
            await relay.reconfigure(replace(relay.settings, pools=(renamed,)))
            await engines[0].step(10)  # moved on since: the totals must follow it, once
            want = _oracle(engines)
            assert await client.wait_for(lambda: settled("ns/backend/generate"), 20), (
                _model(client), want
            )
            moved = replace(renamed, endpoint="generate-b")
            await relay.reconfigure(replace(relay.settings, pools=(moved,)))
            await engines[0].step(10)
            want = _oracle(engines)
            assert await client.wait_for(lambda: settled("ns/backend/generate-b"), 20), (
                _model(client), want
            )
            m = _model(client)
            assert m is not None and m.expected_frontends == 1


async def test_a_restart_that_overtook_its_old_counts_is_seen_by_its_start_time() -> None:
    """An engine that restarted and counted past its old values before the next scrape: no
    counter went down, so only its page's ``process_start_time_seconds`` tells the restart. Seen
    as the same process, everything its previous run counted was lost. The page is the
    simulator's, served as of chosen moments, so no scrape falls between restart and catch-up."""
    page: list[bytes] = [b""]
    stub, stub_port = await _metrics_stub(lambda: page[0])

    def pools(engines: list[SimEngine]) -> tuple[PoolSpec, ...]:
        (spec,) = _pools(engines)
        return (replace(spec, engines=(replace(spec.engines[0], metrics_port=stub_port),)),)

    configs = [SimConfig(name="s0", seed=1, capacity_blocks=128, max_running=4)]
    try:
        async with _fleet(configs, pools) as (engines, _relay, server):
            engine = engines[0]
            async with RelayClient([f"127.0.0.1:{server.port}"]) as client:
                assert await client.wait_ready(30)

                def settled(expect: dict[str, int]) -> bool:
                    m = _model(client)
                    return m is not None and m.status == "COMPLETE" and _totals(m) == expect

                await engine.step(12)
                before = _oracle(engines)
                page[0] = render_metrics(engine).encode()
                assert await client.wait_for(lambda: settled(before), 20), _model(client)
                await engine.restart()
                await engine.step(60)
                after = _oracle(engines)
                # no counter of the new run is below the old run's: nothing but the start time
                assert all(after[k] >= before[k] for k in before), (before, after)
                page[0] = render_metrics(engine).encode()
                expect = {k: before[k] + after[k] for k in before}
                assert await client.wait_for(lambda: settled(expect), 20), (_model(client), expect)
    finally:
        stub.close()
        await stub.wait_closed()


def test_a_page_cut_at_a_line_inside_the_finished_counter_counts_nothing_twice() -> None:
    """The request counters need the reasons ``stop``, ``length`` and ``abort`` on the page (the
    failed one ``error``): a page cut after the ``length`` line read ``abort`` as 0, a dip taken
    for a restart, and every counter was counted again once the whole page came back."""
    lab = 'engine="0",model_name="m"'
    full = [f"vllm:num_requests_running{{{lab}}} 2", f"vllm:num_requests_waiting{{{lab}}} 1",
            f"vllm:prompt_tokens_total{{{lab}}} 5000", f"vllm:generation_tokens_total{{{lab}}} 900",
            *(f'vllm:request_success_total{{{lab},finished_reason="{r}"}} {n}'
              for r, n in (("stop", 40), ("length", 10), ("abort", 3), ("error", 1)))]  # fmt: skip

    def counters(lines: list[str]) -> dict[str, int]:
        return rank_counters(parse_engine_page("\n".join(lines) + "\n", "m").serving["0"])

    whole = counters(full)
    assert whole == {"requests_completed_total": 50, "requests_cancelled_total": 3,
                     "requests_failed_total": 1, "requests_started_total": 57,
                     "input_tokens_total": 5000, "output_tokens_total": 900}  # fmt: skip
    cut = counters(full[:6])  # ends cleanly after the "length" line
    assert cut == {"input_tokens_total": 5000, "output_tokens_total": 900}
    no_error = counters(full[:7])  # an older vLLM has no "error" reason: failed unknown, not 0
    assert "requests_failed_total" not in no_error and no_error["requests_started_total"] == 56
    totals = RunningTotals()
    for report in (whole, cut, whole):
        assert totals.window(("ns", "m"), ["src"], {"src": report}) == whole


def _counts_page(n: int) -> bytes:
    """A one-rank vLLM page of ``n`` requests finished (``stop``), ten input and five output
    tokens each, none running or waiting."""
    lab = 'engine="0",model_name="sim-model"'
    lines = [f"vllm:num_requests_running{{{lab}}} 0", f"vllm:num_requests_waiting{{{lab}}} 0",
             f"vllm:prompt_tokens_total{{{lab}}} {10 * n}",
             f"vllm:generation_tokens_total{{{lab}}} {5 * n}",
             *(f'vllm:request_success_total{{{lab},finished_reason="{r}"}} {k}'
               for r, k in (("stop", n), ("length", 0), ("abort", 0), ("error", 0)))]  # fmt: skip
    return ("\n".join(lines) + "\n").encode()


async def _async_stub(page: Callable[[], Awaitable[bytes]]) -> tuple[asyncio.Server, int]:
    """:func:`_metrics_stub` answering with ``await page()``: a page that takes its time."""

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        body = await page()
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n%s" % (len(body), body))  # fmt: skip
        with contextlib.suppress(ConnectionError):
            await w.drain()
        w.close()

    stub = await asyncio.start_server(serve, "127.0.0.1", 0)
    return stub, stub.sockets[0].getsockname()[1]


async def test_a_page_replaced_before_the_totals_saw_it_is_still_counted() -> None:
    """Engine ``a`` reports 100 requests, then 150, then restarts and reports 5, while nobody
    reads the windows. Its 150 page lands just after engine ``b``'s scrape folded the totals,
    and is replaced by the restart's page before any other scrape is taken. When the totals
    were folded at most once per scrape interval, they never saw that page, and 50 requests
    ``a`` had reported were lost (105, not 155). The scrapes are timed by the stubs: ``a``
    answers 0.1 s after each request, ``b`` when the test lets it."""
    loop = asyncio.get_running_loop()
    a_page = [_counts_page(100)]
    a_served: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def a_answer() -> bytes:
        await asyncio.sleep(0.1)
        body = a_page[0]
        a_served.put_nowait((loop.time(), body))
        return body

    b_free, b_held, b_go = [True], asyncio.Event(), asyncio.Event()

    async def b_answer() -> bytes:
        if not b_free[0]:
            b_held.set()
            await b_go.wait()
            b_go.clear()  # one answer: b's next scrape waits again
        return _counts_page(7)

    def free_b() -> None:
        b_free[0] = True
        b_go.set()

    async def next_a() -> tuple[float, bytes]:
        while not a_served.empty():
            a_served.get_nowait()
        return await asyncio.wait_for(a_served.get(), scaled(5))

    stub_a, port_a = await _async_stub(a_answer)
    stub_b, port_b = await _async_stub(b_answer)

    def pools(engines: list[SimEngine]) -> tuple[PoolSpec, ...]:
        (spec,) = _pools(engines)
        e0, e1 = spec.engines
        return (replace(spec, engines=(replace(e0, metrics_port=port_a),
                                       replace(e1, metrics_port=port_b))),)  # fmt: skip

    configs = [SimConfig(name="g0", seed=5, capacity_blocks=128),
               SimConfig(name="g1", seed=6, capacity_blocks=128)]  # fmt: skip
    try:
        async with _fleet(configs, pools) as (_engines, _relay, server):
            await next_a()
            b_free[0] = False
            await asyncio.wait_for(b_held.wait(), scaled(5))  # b's next scrape waits
            t, _ = await next_a()  # a's page is stored (and folded) about now
            await asyncio.sleep(max(0.0, t + TICK_S + 0.04 - loop.time()))
            a_page[0] = _counts_page(150)
            b_go.set()  # b's page stored: a fold, a scrape interval after a's
            _, body = await next_a()  # a's 150, stored after that fold
            assert body == _counts_page(150)
            a_page[0] = _counts_page(5)  # a restarted: its counters start over
            _, body = await next_a()  # the 150 page replaced; b's next scrape still waits
            assert body == _counts_page(5)
            await asyncio.sleep(0.05)
            free_b()
            expect = {"requests_completed_total": 155 + 7, "requests_started_total": 155 + 7,
                      "requests_cancelled_total": 0, "requests_failed_total": 0,
                      "input_tokens_total": 1550 + 70, "output_tokens_total": 775 + 35}  # fmt: skip
            async with RelayClient([f"127.0.0.1:{server.port}"]) as client:  # the first reader
                assert await client.wait_ready(30)

                def settled() -> bool:
                    m = _model(client)
                    return m is not None and _totals(m) == expect

                assert await client.wait_for(settled, 20), (_model(client), expect)
    finally:
        free_b()
        for stub in (stub_a, stub_b):
            stub.close()
            await stub.wait_closed()


async def test_a_page_dropped_or_forgotten_before_the_totals_saw_it_is_still_counted() -> None:
    """The scrape loop drops an engine's page when a scrape fails (the engine went down, say to
    restart) and forgets it when the engine leaves the configuration: a page the totals had not
    seen is folded in first, as one the engine's next page replaces. Dropped unseen, its counts
    since the totals' last look were lost once the restarted engine reported again."""
    engines = tuple(EngineSpec(name=n, host="127.0.0.1", grpc_port=p, metrics_port=p + 1)
                    for n, p in (("a", 2), ("b", 4)))  # fmt: skip
    spec = PoolSpec(namespace="ns", component="backend", endpoint="generate", model="sim-model",
                    engines=engines)  # fmt: skip
    relay = Relay(RelaySettings(dc_name="dc-unit", pools=(spec,)))  # never started: no network
    (pool,) = relay.pools
    inputs = ServingInputs(lambda: relay.pools)

    def page(n: int) -> Page:
        return Page(0, parse_engine_page(_counts_page(n).decode(), "sim-model"))

    def completed() -> int:
        (m,) = inputs.build().models
        return m.totals["requests_completed_total"]

    inputs.store(pool.name, "a", page(100))
    assert completed() == 100
    inputs.store(pool.name, "a", page(150))
    inputs.store(pool.name, "a", None)  # a's scrape failed: it went down
    inputs.store(pool.name, "a", page(5))  # back, its counters started over
    assert completed() == 155
    inputs.store(pool.name, "b", page(7))
    assert completed() == 162
    inputs.store(pool.name, "b", page(9))
    inputs.forget(pool.name, "b")  # b's scraper stopped: b leaves the configuration
    await pool.remove_engine("b", reconcile=False)
    assert completed() == 164  # what b counted stays counted, its last page included


async def test_a_removed_pools_last_pages_are_counted_before_it_goes() -> None:
    """A reload removes a pool: its engines' pages the totals had not seen are folded in while
    it is still configured, so an engine that comes back in a pool of the same model (after a
    restart) goes on from its last page, not from an older one."""
    spec = PoolSpec(namespace="ns", component="backend", endpoint="generate", model="sim-model",
                    engines=(EngineSpec(name="a", host="127.0.0.1", grpc_port=2, metrics_port=3),))
    relay = Relay(RelaySettings(dc_name="dc-unit", pools=(spec,)))  # never started: no network
    serving = relay._serving

    def page(n: int) -> Page:
        return Page(0, parse_engine_page(_counts_page(n).decode(), "sim-model"))

    def completed() -> int:
        (m,) = serving.build().models
        return m.totals["requests_completed_total"]

    (pool,) = relay.pools
    serving.store(pool.name, "a", page(100))
    assert completed() == 100
    serving.store(pool.name, "a", page(150))  # not seen by the totals yet
    await relay._remove_pool(pool)
    assert relay.pools == [] and serving.build().models == []
    relay._add_pool(replace(spec, endpoint="generate-b"))  # the engine, configured again
    (pool,) = relay.pools
    serving.store(pool.name, "a", page(5))  # restarted meanwhile: its counters started over
    assert completed() == 155



async def test_the_pool_ids_kept_for_sorting_are_the_listed_ones_only() -> None:
    """Every rebuilt generation (a fence, a reload, a new model) brings a new pool id object. The
    relay keeps each serving pool's bytes to sort ``serving_pools`` by, and kept every dead
    generation's up to the memo's bound of 4,096 (7 after 6 rebuilds of one pool): the planes'
    own memos keep the identities they list now only, this one must too."""
    configs = [SimConfig(name="g0", seed=71, capacity_blocks=128)]
    async with _fleet(configs, _pools) as (_engines, relay, _server):
        (p,) = relay.pools

        def published() -> bool:
            return p.generation is not None and p.published is not None

        await eventually(published, 30, "the pool published")
        for _ in range(4):
            gen = p.generation
            assert gen is not None
            relay.serving_load.publish_window()
            p._materialized_at -= FENCE_STABLE_S  # a fence long after the last: no rebuild delay
            p.fence(gen, "test: rebuild the generation")

            def rebuilt(old: object = gen) -> bool:
                return published() and p.generation is not old

            await eventually(rebuilt, 30, "a new generation")
        assert relay.serving_load.publish_window()
        (model,) = relay.serving_load.current()[1].models
        assert model.deployment is not None and len(model.deployment.serving_pools) == 1
        assert len(relay._serving._pool_ids) == 1
