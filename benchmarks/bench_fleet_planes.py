"""What the planes cost a running relay with many pools: one simulated engine per pool (real
Control gRPC and ZMQ), the real ``Relay``, measured on its event loop.

* ``refresh_planes`` with nothing changed, what every engine or generation event costs the relay
  (``refresh_planes_unchanged_ms``), against the same call made to recompute both planes
  (``refresh_planes_forced_ms``, from the entries the planes keep encoded, and
  ``…_forced_unmemoized_ms``, every descriptor and topology entry built and serialized again: what
  an event that changed an endpoint cost before the planes kept them);
* ``refresh_planes`` after one pool built a new descriptor (a LoRA loaded, an engine joined), with
  the catalog's per-descriptor memo (``refresh_planes_one_pool_rebuilt_ms``) and with that memo
  emptied first (``…_unmemoized_ms``: every descriptor serialized and parsed, as before it); and
  the catalog's and the readiness plane's wire bytes laid out from their cached pieces against
  serializing each message;
* one load and one serving-load window with their wire bytes (what each second costs while
  someone subscribes), against serializing the same windows anew (what it cost before);
* one ``/metrics`` scrape: what it holds the loop for (``metrics_scrape_collect_ms``: the
  relay's snapshot and the few families read from live objects) and what runs in the loop's
  executor (``metrics_scrape_text_ms``: every family built from that snapshot, and the text),
  against collecting every family on the loop (``metrics_scrape_collect_all_on_loop_ms``, what a
  scrape held the loop for before, its text then written off it); and the longest a ticker on
  the loop waited during one whole scrape (``metrics_scrape_longest_loop_stall_ms``, with the 1 ms
  GIL switch interval the daemon sets, ``ops/event_loop.py``: the executor thread holds the GIL
  while it builds the families, so the loop may wait for it; ``…_5ms_switch_ms`` with CPython's
  default; ``metrics_scrape_all_on_loop_longest_loop_stall_ms``: collected on the loop, at 5 ms,
  as before);
* one full garbage collection (``gc.collect(2)``, on the loop) in that process, with the objects
  alive before the engines and the relay were made frozen out of it as the daemon freezes its
  own after the warm-up (``gc_full_collection_ms``, ``ops/gc_freeze.py``), and with nothing frozen
  (``gc_full_collection_unfrozen_ms``). The simulated engines live in this process too, so both
  walk their objects as well as the relay's;
* reading one engine's ``/metrics`` page, which the relay scrapes from every engine every
  ``metrics_scrape_interval_s`` (1 s): the lines it reads, against prometheus_client's parse of
  the whole page (what it did before).

Usage: ``python -m benchmarks.bench_fleet_planes [--pools 64] [--rounds 20] [--repeats 3]
[--smoke]``; each figure is the median of the repeats, with its range under ``spread``; writes
``results/fleet_planes.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks._common import machine, over_repeats, print_over_repeats, results_dir, write_json
from kvrelay.discovery.metrics_scrape import parse_engine_page
from kvrelay.ops.event_loop import tune_thread_switching
from kvrelay.ops.gc_freeze import freeze_startup_objects
from kvrelay.ops.metrics import RelayMetrics
from kvrelay.ops.metrics_http import Collected
from kvrelay.ops.warmup import warm_kernels
from kvrelay.relay.relay import Relay
from kvrelay.relay.settings import EngineSpec, PoolSpec, RelaySettings
from kvrelay.sim.config import SimConfig
from kvrelay.sim.engine import SimEngine
from kvrelay.sim.metrics_http import render_metrics


def _median_ms(fn: Callable[[], object], rounds: int) -> float:
    fn()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


async def _longest_stall_ms(take: Callable[[], Collected], rounds: int) -> float:
    """The longest a 0.5 ms ticker on the loop waited past its time during one whole scrape (taken
    on the loop, its text written in the executor), median over ``rounds``: what a delta arriving
    during a scrape could wait, the executor thread's hold on the GIL included. The garbage
    collector is paused meanwhile: with 64 simulated engines in this process it runs a full
    collection every few seconds (a daemon, every half minute), which would land in some rounds
    and not others; a full collection's own cost is reported apart (``gc_full_collection_ms``)."""
    loop = asyncio.get_running_loop()
    worst = [0.0]
    running = [True]

    async def ticker() -> None:
        while running[0]:
            t0 = loop.time()
            await asyncio.sleep(0.0005)
            worst[0] = max(worst[0], loop.time() - t0 - 0.0005)

    out = []
    gc.disable()
    try:
        for _ in range(rounds):
            running[0] = True
            task = asyncio.create_task(ticker())
            await asyncio.sleep(0.005)
            worst[0] = 0.0
            scrape = take()
            await loop.run_in_executor(None, scrape.text)
            running[0] = False
            await task
            out.append(worst[0])
    finally:
        gc.enable()
    return statistics.median(out) * 1e3


async def run(pools: int, rounds: int) -> dict[str, Any]:
    gc.unfreeze()
    freeze_startup_objects()  # as the daemon does after its warm-up, before any pool exists
    engines = [SimEngine(SimConfig(name=f"e{i}", seed=i)) for i in range(pools)]
    for e in engines:
        await e.start()
    specs = tuple(
        PoolSpec(namespace="bench", component=f"c{i}", endpoint="generate", expected_blocks=4096,
                 engines=(EngineSpec(name=e.cfg.name, host="127.0.0.1", grpc_port=e.grpc_port),))
        for i, e in enumerate(engines)
    )  # fmt: skip
    relay = Relay(RelaySettings(dc_name="dc-bench", pools=specs, discovery_interval_s=0.5))
    await relay.start()
    try:
        deadline = time.monotonic() + 60 + pools
        while len(relay.catalog.current()[1].snapshot.pools) < pools:  # type: ignore[union-attr]
            if time.monotonic() > deadline:
                raise RuntimeError("not every pool reached the catalog in time")
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)

        def window(plane: Any) -> Callable[[], object]:
            def go() -> object:
                plane.publish_window()
                return plane.wire(plane.current()[0])

            return go

        def rebuilt(unmemoized: bool) -> Callable[[], object]:
            def go() -> object:
                relay.pools[0]._descriptor = None  # the next descriptor() builds a new object
                if unmemoized:
                    relay.catalog._descriptors.clear()
                    relay.catalog._pool_ids.clear()
                relay.refresh_planes()
                return None

            return go

        def forced(unmemoized: bool) -> Callable[[], object]:
            def go() -> object:
                if unmemoized:
                    relay.catalog._descriptors.clear()
                    relay.catalog._pool_ids.clear()
                    relay.readiness._entries = {}
                    relay.readiness._pool_ids.clear()
                relay.refresh_planes(force=True)
                return None

            return go

        def readiness_wire() -> object:
            version = relay.readiness.current()[0]
            relay.readiness._wire.published(version)
            return relay.readiness.wire(version)

        def catalog_wire() -> object:
            version = relay.catalog.current()[0]
            relay.catalog._wire.published(version)  # written anew, as after each new revision
            return relay.catalog.wire(version)

        page = render_metrics(engines[0])
        model = engines[0].cfg.served_model_name
        metrics = RelayMetrics(relay)
        scrape = metrics.collected()
        default = sys.getswitchinterval()
        try:
            sys.setswitchinterval(0.005)  # CPython's default: what the relay ran with before
            stall_default = await _longest_stall_ms(metrics.collected, rounds)
            stall_all_on_loop = await _longest_stall_ms(lambda: Collected(metrics.registry), rounds)
            tune_thread_switching()  # what the daemon and its workers run with
            stall = await _longest_stall_ms(metrics.collected, rounds)
        finally:
            sys.setswitchinterval(default)
        full_gc = _median_ms(lambda: gc.collect(2), rounds)
        gc.unfreeze()  # the next run freezes anew before its engines and relay exist
        full_gc_unfrozen = _median_ms(lambda: gc.collect(2), rounds)
        return {
            "pools": pools,
            "gc_full_collection_ms": full_gc,
            "gc_full_collection_unfrozen_ms": full_gc_unfrozen,
            "metrics_scrape_longest_loop_stall_ms": stall,
            "metrics_scrape_longest_loop_stall_5ms_switch_ms": stall_default,
            "metrics_scrape_all_on_loop_longest_loop_stall_ms": stall_all_on_loop,
            "metrics_scrape_collect_ms": _median_ms(metrics.collected, rounds),
            "metrics_scrape_text_ms": _median_ms(scrape.text, rounds),
            "metrics_scrape_collect_all_on_loop_ms": _median_ms(
                lambda: Collected(metrics.registry), rounds
            ),
            "metrics_scrape_all_on_loop_text_ms": _median_ms(
                Collected(metrics.registry).text, rounds
            ),
            "metrics_scrape_bytes": len(scrape.text()),
            "engine_page_bytes": len(page),
            "engine_page_parse_ms": _median_ms(lambda: parse_engine_page(page, model), rounds),
            "engine_page_parse_whole_ms": _median_ms(
                lambda: list(text_string_to_metric_families(page)), rounds
            ),
            "rounds": rounds,
            "refresh_planes_unchanged_ms": _median_ms(relay.refresh_planes, rounds),
            "refresh_planes_forced_ms": _median_ms(forced(False), rounds),
            "refresh_planes_forced_unmemoized_ms": _median_ms(forced(True), rounds),
            "refresh_planes_one_pool_rebuilt_ms": _median_ms(rebuilt(False), rounds),
            "refresh_planes_one_pool_rebuilt_unmemoized_ms": _median_ms(rebuilt(True), rounds),
            "catalog_wire_ms": _median_ms(catalog_wire, rounds),
            "catalog_serialize_ms": _median_ms(lambda: bytes(relay.catalog.current()[1]), rounds),
            "readiness_wire_ms": _median_ms(readiness_wire, rounds),
            "readiness_serialize_ms": _median_ms(
                lambda: bytes(relay.readiness.current()[1]), rounds
            ),
            "load_window_with_wire_ms": _median_ms(window(relay.load), rounds),
            "load_window_serialize_ms": _median_ms(lambda: bytes(relay.load.current()[1]), rounds),
            "serving_load_window_with_wire_ms": _median_ms(window(relay.serving_load), rounds),
            "serving_load_window_serialize_ms": _median_ms(
                lambda: bytes(relay.serving_load.current()[1]), rounds
            ),
        }
    finally:
        await relay.stop()
        for e in engines:
            await e.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pools", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3, help="whole runs (median, range)")
    ap.add_argument("--smoke", action="store_true", help="4 pools, results to .work/smoke")
    a = ap.parse_args()
    if a.smoke:
        a.pools, a.rounds, a.repeats = 4, 3, 1
    warm_kernels()  # loaded before the freeze, as in the daemon
    res = over_repeats([asyncio.run(run(a.pools, a.rounds)) for _ in range(a.repeats)])
    print_over_repeats(res, 50)
    res["machine"] = machine()
    write_json(results_dir(a.smoke) / "fleet_planes.json", res)


if __name__ == "__main__":
    main()
